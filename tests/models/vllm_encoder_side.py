"""Runs in a vLLM CPU venv: vLLM's own vision towers, run forward on the CPU with a
dummy batch, and the peak of the memory their forward allocates; and vLLM's own encoder
budget and dummy item count for the profile run.

The towers are the modules the multimodal wrappers build (Gemma 3: SiglipVisionModel
and Gemma3MultiModalProjector; Qwen3.5 / 3.6: Qwen3_VisionTransformer), with the
config's widths and a reduced depth (every encoder layer holds the same activations,
so the peak does not grow with the depth). Weights are uninitialised: the values do
not change what is allocated. The peak is read from torch's profiler (profile_memory):
every allocation and free of the CPU allocator in order, over the inputs already held.

stdin: {"port": P, "towers": [{"kind": "siglip" | "qwen3_vit", "vision": {...},
         "text_hidden": H, "mm_tokens_per_image": T, "depth": D, "items": N,
         "grid": [t, h, w]}],
        "budgets": [{"max_tokens_per_item": T, "max_num_batched_tokens": B,
         "max_num_seqs": S, "max_model_len": L, "limit": M}]}
stdout (last line): {"peaks": [bytes per tower case], "outputs": [bytes of the
         embeddings returned], "budgets": [[encoder budget, items per batch], ...]}
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

import weakref

import torch
import vllm.config
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from vllm_model_side import join_one_rank_groups  # type: ignore[import-not-found]


class LiveBytes(TorchDispatchMode):  # type: ignore[misc]
    """Counts the bytes of every storage an op creates while the storage lives (freed
    when its last tensor or view goes) and keeps the peak: the memory a forward pass
    allocates, as a device allocator would see it, less kernels' private workspaces."""

    def __init__(self, held: set[int]) -> None:
        super().__init__()
        self.held = held  # storages that exist before the run: weights, buffers, inputs
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in self.held or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)
        return out


def _peak_of(
    run: object, modules: list[torch.nn.Module], inputs: list[torch.Tensor]
) -> tuple[int, int]:
    """(peak bytes `run` allocates over the weights, buffers and inputs that exist
    before it, bytes its result holds)."""
    tensors = [
        *inputs,
        *(t for module in modules for t in [*module.parameters(), *module.buffers()]),
    ]
    with LiveBytes({t.untyped_storage().data_ptr() for t in tensors}) as counter:
        result = run()  # type: ignore[operator]
    outputs = list(result) if isinstance(result, (list, tuple)) else [result]
    held = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in outputs}.values()
    )
    return counter.peak, held


def _siglip(case: dict[str, object]) -> tuple[int, int]:
    from transformers import Gemma3Config  # type: ignore[import-not-found]
    from vllm.model_executor.models.gemma3_mm import Gemma3MultiModalProjector
    from vllm.model_executor.models.siglip import SiglipVisionModel

    vision = {**case["vision"], "num_hidden_layers": case["depth"]}  # type: ignore[dict-item]
    config = Gemma3Config(
        text_config={"hidden_size": case["text_hidden"]},
        vision_config=vision,
        mm_tokens_per_image=case["mm_tokens_per_image"],
    )
    tower = SiglipVisionModel(config.vision_config, prefix="vision_tower")
    projector = Gemma3MultiModalProjector(config)
    size = config.vision_config.image_size
    # in the model dtype, as vLLM's processor casts them (InputProcessingContext)
    pixels = torch.zeros(int(case["items"]), 3, size, size)  # type: ignore[call-overload]

    def run() -> torch.Tensor:
        return projector(tower(pixels))

    return _peak_of(run, [tower, projector], [pixels])


def _qwen3_vit(case: dict[str, object]) -> tuple[int, int]:
    from transformers import Qwen3_5VisionConfig
    from vllm.model_executor.models import qwen3_vl
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    # The CPU build has no pinned-memory allocator (host-side staging buffers, not
    # the device memory measured here).
    from vllm.utils import torch_utils

    qwen3_vl.PIN_MEMORY = False
    torch_utils.is_pin_memory_available = lambda: False
    # The ViT enforces its rotary op's device kernel (flash-attn's, absent here): its
    # PyTorch-native forward instead.
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

    ApplyRotaryEmb.forward_cuda = ApplyRotaryEmb.forward_native

    vision: dict[str, int] = {**case["vision"], "depth": case["depth"]}  # type: ignore[dict-item]
    tower = Qwen3_VisionTransformer(Qwen3_5VisionConfig(**vision), prefix="visual")
    t, h, w = (int(size) for size in case["grid"])  # type: ignore[attr-defined]
    items = int(case["items"])  # type: ignore[call-overload]
    patch = vision["patch_size"]
    channels = vision.get("in_channels", 3) * vision["temporal_patch_size"] * patch * patch
    pixels = torch.zeros(items * t * h * w, channels)
    grid = torch.tensor([[t, h, w]] * items)

    def run() -> torch.Tensor:
        return tower(pixels, grid_thw=grid)

    return _peak_of(run, [tower], [pixels, grid])


def _no_device_kernels() -> None:
    """The CPU build has no pinned-memory allocator (host-side staging buffers, not
    the device memory measured here), and the Qwen ViTs enforce their rotary op's
    device kernel (flash-attn's, absent here): its PyTorch-native forward instead."""
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb
    from vllm.model_executor.models import qwen2_5_vl, qwen3_vl
    from vllm.utils import torch_utils

    qwen3_vl.PIN_MEMORY = False
    qwen2_5_vl.PIN_MEMORY = False
    torch_utils.PIN_MEMORY = False  # async_tensor_h2d's staging buffer (0.34)
    torch_utils.is_pin_memory_available = lambda: False
    ApplyRotaryEmb.forward_cuda = ApplyRotaryEmb.forward_native


def _one_output_silu_and_mul() -> None:
    """SiluAndMul as a CUDA engine runs it: one kernel, one output tensor (the CUDA op,
    or with custom ops off its native forward compiled by torch.compile, vLLM's
    `SiluAndMul(compile_native=True)`). The CPU's eager native form keeps silu(gate)
    beside the product; this stand-in computes the same values in its one output."""
    from vllm.model_executor.layers.activation import SiluAndMul

    def one_output(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        out = torch.sigmoid(x[..., :d])
        return out.mul_(x[..., :d]).mul_(x[..., d:])

    SiluAndMul.forward_native = staticmethod(one_output)


def _qwen_pixels(
    case: dict[str, object], vision: dict[str, int]
) -> tuple[torch.Tensor, list[list[int]]]:
    """Dummy pixels (items x t x h x w patches, in the model dtype) and their grids."""
    t, h, w = (int(size) for size in case["grid"])  # type: ignore[attr-defined]
    items = int(case["items"])  # type: ignore[call-overload]
    patch = vision["patch_size"]
    channels = vision.get("in_channels", 3) * vision["temporal_patch_size"] * patch * patch
    return torch.zeros(items * t * h * w, channels), [[t, h, w]] * items


def _qwen2_5_vit(case: dict[str, object]) -> tuple[int, int]:
    """Qwen2.5-VL's windowed ViT (Qwen2_5_VisionTransformer)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (  # type: ignore[import-not-found]
        Qwen2_5_VLVisionConfig,
    )
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer

    _no_device_kernels()
    _one_output_silu_and_mul()
    vision: dict[str, int] = {**case["vision"], "depth": case["depth"]}  # type: ignore[dict-item]
    tower = Qwen2_5_VisionTransformer(Qwen2_5_VLVisionConfig(**vision), prefix="visual")
    pixels, grid = _qwen_pixels(case, vision)

    def run() -> torch.Tensor:
        return tower(pixels, grid_thw=grid)

    return _peak_of(run, [tower], [pixels])


def _qwen3_vl_vit(case: dict[str, object]) -> tuple[int, int]:
    """Qwen3-VL's ViT with its deepstack mergers (Qwen3_VisionTransformer)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import (  # type: ignore[import-not-found]
        Qwen3VLVisionConfig,
    )
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    _no_device_kernels()
    vision: dict[str, int] = {**case["vision"], "depth": case["depth"]}  # type: ignore[dict-item]
    tower = Qwen3_VisionTransformer(Qwen3VLVisionConfig(**vision), prefix="visual")
    pixels, grid = _qwen_pixels(case, vision)
    grid_tensor = torch.tensor(grid)

    def run() -> torch.Tensor:
        return tower(pixels, grid_thw=grid_tensor)

    return _peak_of(run, [tower], [pixels, grid_tensor])


def _llama4(case: dict[str, object]) -> tuple[int, int]:
    """Llama 4's vision model (Llama4VisionModel: patch unfold, encoder, pixel-shuffle
    adapter) and its projector into the text width (Llama4MultiModalProjector), over
    `tiles` tiles of image_size x image_size."""
    from transformers import Llama4Config
    from vllm.model_executor.models.mllama4 import Llama4MultiModalProjector, Llama4VisionModel

    vision = {**case["vision"], "num_hidden_layers": case["depth"]}  # type: ignore[dict-item]
    config = Llama4Config(text_config={"hidden_size": case["text_hidden"]},
                          vision_config=vision)  # fmt: skip
    tower = Llama4VisionModel(config.vision_config, prefix="vision_model")
    projector = Llama4MultiModalProjector(config, prefix="multi_modal_projector")
    size = config.vision_config.image_size
    pixels = torch.zeros(int(case["tiles"]), 3, size, size)  # type: ignore[call-overload]

    def run() -> torch.Tensor:
        return projector(tower(pixels))

    return _peak_of(run, [tower, projector], [pixels])


def _stand_in_mistral_common() -> None:
    """vLLM's llava.py imports pixtral.py, which imports `mistral_common` (not in the
    CPU venvs) for Pixtral's processor; the SigLIP path never uses it. Inert stand-ins
    from tests/models/vllm_stubs (its placeholder modules), for this process only."""
    import importlib.machinery

    import compressed_tensors as stubs  # type: ignore[import-not-found]  # the stand-in

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: object = None,
                      target: object = None) -> importlib.machinery.ModuleSpec | None:  # fmt: skip
            if fullname == "mistral_common" or fullname.startswith("mistral_common."):
                return importlib.machinery.ModuleSpec(fullname, stubs._Loader(), is_package=True)
            return None

    sys.meta_path.insert(0, Finder())


def _llava_next_config(case: dict[str, object]) -> Any:
    """LlavaNextConfig, or LlavaConfig where the case's "wrapper" is "llava" (LLaVA
    1.5); the tower is SigLIP or CLIP by the vision dict's model_type."""
    from transformers import LlavaConfig, LlavaNextConfig

    common = {
        "text_config": {"model_type": "granite", "hidden_size": case["text_hidden"]},
        "vision_config": case["vision"],
        "vision_feature_layer": case["feature_layers"],
        "vision_feature_select_strategy": case["strategy"],
        "multimodal_projector_bias": True,
    }
    if case.get("wrapper") == "llava":
        return LlavaConfig(**common)
    return LlavaNextConfig(**common, image_grid_pinpoints=case["pinpoints"])


def _select_layers(case: dict[str, object]) -> list[int] | None:
    """What the wrapper passes as `select_layers`: LLaVA-Next's list of feature layers
    (None for a single index); LLaVA 1.5 never passes one."""
    layers = case["feature_layers"]
    if case.get("wrapper") == "llava" or not isinstance(layers, list):
        return None
    return layers


def _llava_next_modules(case: dict[str, object]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tower and projector as LlavaNextForConditionalGeneration (or
    LlavaForConditionalGeneration) builds them."""
    _stand_in_mistral_common()
    from vllm.model_executor.models.llava import (
        LlavaMultiModalProjector,
        init_vision_tower_for_llava,
    )

    config = _llava_next_config(case)
    tower = init_vision_tower_for_llava(config, None, require_post_norm=False,
                                        prefix="vision_tower")  # fmt: skip
    selected = _select_layers(case)
    width = config.vision_config.hidden_size * (len(selected) if selected else 1)
    projector = LlavaMultiModalProjector(
        vision_hidden_size=width,
        text_hidden_size=config.text_config.hidden_size,
        projector_hidden_act=config.projector_hidden_act,
        multimodal_projector_bias=True,
    )
    return tower, projector


def _llava_next(case: dict[str, object]) -> tuple[int, int]:
    """The tower over `tiles` tiles with the selected layers concatenated (the
    wrapper's _image_pixels_to_features), then the projector."""
    tower, projector = _llava_next_modules(case)
    size = int(case["vision"]["image_size"])  # type: ignore[index]
    pixels = torch.zeros(int(case["tiles"]), 3, size, size)  # type: ignore[call-overload]

    def run() -> torch.Tensor:
        features = tower(pixels, select_layers=_select_layers(case),
                         feature_select_strategy=case["strategy"])  # fmt: skip
        return projector(features)

    return _peak_of(run, [tower, projector], [pixels])


def _llava_embed(case: dict[str, object]) -> tuple[int, int]:
    """The whole image path of the profile run: the wrapper's own _process_image_input
    (LlavaNextForConditionalGeneration's tower, projector and anyres merge with the
    image_newline; LlavaForConditionalGeneration's tower and projector) over `items`
    images of the largest size, `tiles` tiles each. The wrapper object is made without
    its __init__ (no language model) and given the modules it would build."""
    _stand_in_mistral_common()
    from vllm.model_executor.models.llava import LlavaForConditionalGeneration
    from vllm.model_executor.models.llava_next import LlavaNextForConditionalGeneration

    llava = case.get("wrapper") == "llava"
    cls = LlavaForConditionalGeneration if llava else LlavaNextForConditionalGeneration
    tower, projector = _llava_next_modules(case)
    config = _llava_next_config(case)
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.config = config
    model.vision_tower = tower
    model.multi_modal_projector = projector
    model.image_newline = torch.nn.Parameter(torch.zeros(config.text_config.hidden_size))
    model.select_layers = _select_layers(case)
    size = config.vision_config.image_size
    items, tiles = int(case["items"]), int(case["tiles"])  # type: ignore[call-overload]
    shape = (items, 3, size, size) if llava else (items, tiles, 3, size, size)
    pixels = torch.zeros(*shape)
    # the largest image's size, as the processor passes it (kept on the host)
    sizes = torch.tensor([case["image"]] * items)

    def run() -> object:
        return model._process_image_input(
            {"type": "pixel_values", "pixel_values": pixels, "image_sizes": sizes}
        )

    return _peak_of(run, [model], [pixels, sizes])


def _moonvit(case: dict[str, object]) -> tuple[int, int]:
    """Kimi-VL's MoonViT (MoonVitPretrainedModel) and KimiVLMultiModalProjector over
    `items` images of `grid` patches, packed as the processor packs them ((patches, 3,
    14, 14) pixels and a grid per image). The rotary table (a cached property the first
    forward builds) is built before the run, so the peak is the forward's own; its size
    comes back as the output's last entry."""
    from vllm.model_executor.models.kimi_vl import KimiVLMultiModalProjector
    from vllm.model_executor.models.moonvit import MoonVitPretrainedModel
    from vllm.transformers_utils.configs.kimi_vl import KimiVLConfig

    vision = {**case["vision"], "num_hidden_layers": case["depth"]}  # type: ignore[dict-item]
    config = KimiVLConfig(vision_config=vision, text_config={"hidden_size": case["text_hidden"]})
    tower = MoonVitPretrainedModel(config.vision_config, prefix="vision_tower")
    projector = KimiVLMultiModalProjector(config, prefix="multi_modal_projector")
    # The table's device is the platform's device type, read at import (empty on the
    # CPU build; "cuda" on a GPU, where the table is device memory).
    tower.encoder.rope_2d.device = "cpu"
    table = tower.encoder.rope_2d.precomputed_freqs_cis
    grid_shape = [int(n) for n in case["grid"]]  # type: ignore[attr-defined]
    rows, cols = grid_shape[0], grid_shape[1]
    items = int(case["items"])  # type: ignore[call-overload]
    patch = config.vision_config.patch_size
    pixels = torch.zeros(items * rows * cols, 3, patch, patch)
    grid = torch.tensor([[rows, cols]] * items)

    def run() -> torch.Tensor:
        return projector(torch.cat(tower(pixels, grid)))

    peak, held = _peak_of(run, [tower, projector], [pixels, grid, table])
    TABLES.append(table.untyped_storage().nbytes())
    return peak, held


TABLES: list[int] = []


def llava_next_facts(case: dict[str, object]) -> list[int]:
    """[parameters of the tower, projector and (LLaVA-Next's) image_newline as vLLM
    builds them, the most embeddings of one image and the tiles of that image]: vLLM's
    LlavaNextProcessingInfo.get_num_image_tokens over the pinpoints, as its
    get_image_size_with_most_features does (LLaVA 1.5: LlavaProcessingInfo's
    get_max_image_tokens, one tile), with the config standing in for the processor
    context."""
    from transformers.models.llava_next.modeling_llava_next import (  # type: ignore[import-not-found]
        get_anyres_image_grid_shape,
    )
    from vllm.model_executor.models.llava import LlavaProcessingInfo
    from vllm.model_executor.models.llava_next import LlavaNextProcessingInfo
    from vllm.model_executor.models.vision import get_vision_encoder_info

    config = _llava_next_config(case)
    with torch.device("meta"):
        tower, projector = _llava_next_modules(case)
    params = sum(p.numel() for m in (tower, projector) for p in m.parameters())
    encoder_info = get_vision_encoder_info(config)
    info = SimpleNamespace(
        get_hf_config=lambda: config, get_vision_encoder_info=lambda: encoder_info
    )
    if case.get("wrapper") == "llava":
        info.get_image_size_with_most_features = lambda: (
            LlavaProcessingInfo.get_image_size_with_most_features(info)
        )
        info.get_num_image_tokens = lambda **kw: LlavaProcessingInfo.get_num_image_tokens(
            info, **kw
        )
        return [params, LlavaProcessingInfo.get_max_image_tokens(info), 1]
    info._get_num_unpadded_features = lambda **kw: (
        LlavaNextProcessingInfo._get_num_unpadded_features(info, **kw)
    )
    info.get_num_image_tokens = lambda **kw: LlavaNextProcessingInfo.get_num_image_tokens(
        info, **kw
    )
    largest = LlavaNextProcessingInfo.get_image_size_with_most_features(info)
    tokens = info.get_num_image_tokens(image_width=largest.width, image_height=largest.height)
    size = config.vision_config.image_size
    rows, cols = get_anyres_image_grid_shape((largest.height, largest.width),
                                             config.image_grid_pinpoints, size)  # fmt: skip
    return [params + config.text_config.hidden_size, tokens, 1 + rows * cols]


def _budget(case: dict[str, int]) -> list[int]:
    """vLLM's encoder budget and profiled item count (compute_mm_encoder_budget and
    MultiModalBudget._get_max_items) for one modality of `max_tokens_per_item`."""
    from vllm.config import SchedulerConfig
    from vllm.multimodal.encoder_budget import MultiModalBudget
    from vllm.v1.core.encoder_cache_manager import compute_mm_encoder_budget

    scheduler = SchedulerConfig(
        max_num_batched_tokens=case["max_num_batched_tokens"],
        max_num_seqs=case["max_num_seqs"],
        max_model_len=case["max_model_len"],
        is_encoder_decoder=False,
    )
    compute, cache = compute_mm_encoder_budget(scheduler, {"image": case["max_tokens_per_item"]})
    budget = SimpleNamespace(
        encoder_compute_budget=compute,
        encoder_cache_size=cache,
        mm_limits={"image": case["limit"]},
        max_model_len=case["max_model_len"],
        max_num_reqs=case["max_num_seqs"],
        scheduler_config=scheduler,
    )
    budget.get_encoder_budget = lambda: MultiModalBudget.get_encoder_budget(budget)
    _, items = MultiModalBudget._get_max_items(budget, "image", case["max_tokens_per_item"])
    return [budget.get_encoder_budget(), items]


TOWERS = {
    "siglip": _siglip,
    "qwen3_vit": _qwen3_vit,
    "qwen2_5_vit": _qwen2_5_vit,
    "qwen3_vl_vit": _qwen3_vl_vit,
    "llama4": _llama4,
    "llava_next": _llava_next,
    "llava_embed": _llava_embed,
    "moonvit": _moonvit,
}


def main() -> None:
    payload = json.load(sys.stdin)
    importlib.import_module("vllm.model_executor.models.siglip")
    peaks, outputs = [], []
    # Custom ops run their PyTorch-native forward: the CPU build has none of the CUDA
    # kernels (rotary embedding's comes from flash-attn), so the attention phase's
    # temporaries are the native ones.
    config = vllm.config.VllmConfig(
        device_config=vllm.config.DeviceConfig(device="cpu"),
        compilation_config=vllm.config.CompilationConfig(custom_ops=["none"]),
    )
    torch.set_default_dtype(torch.bfloat16)
    with vllm.config.set_current_vllm_config(config), torch.inference_mode():
        join_one_rank_groups(int(payload["port"]))
        for case in payload.get("towers", []):
            peak, held = TOWERS[case["kind"]](case)
            peaks.append(peak)
            outputs.append(held)
        facts = [llava_next_facts(case) for case in payload.get("llava_next", [])]
    torch.set_default_dtype(torch.float32)
    budgets = [_budget(case) for case in payload.get("budgets", [])]
    print(json.dumps({"peaks": peaks, "outputs": outputs, "budgets": budgets,
                      "llava_next": facts, "tables": TABLES}))  # fmt: skip


if __name__ == "__main__":
    main()
