"""The vision encoder's part of the profile run (kvplan.models.encoder) against vLLM's
own code in the 0.32 CPU venv (tests/models/vllm_encoder_side.py):

* the forward peak of vLLM's towers (Gemma 3's SiglipVisionModel with
  Gemma3MultiModalProjector, Qwen3.5 / 3.6's Qwen3_VisionTransformer), built with the
  shipped configs' widths and run on dummy pixels, every storage their ops create
  counted while it lives, against kvplan's per-patch count, at two depths and two batch
  sizes (the peak does not grow with the depth, and grows linearly with the patches);
  likewise Qwen2.5-VL's Qwen2_5_VisionTransformer and Qwen3-VL's deepstack tower, at an
  eighth of the shipped widths (the same head size) to keep the CPU run short, and
  Llama 4's Llama4VisionModel with its projector at Scout's widths, over one and two
  tiles;
* the embeddings they return (what the encoder cache holds through the decoder run);
* the encoder budget and the number of items profiled (vLLM's
  compute_mm_encoder_budget and MultiModalBudget._get_max_items) for 46 settings;
* the flags, as vLLM's own argparse reads them (0.32 and 0.34).
"""

from __future__ import annotations

import itertools
import json
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvplan.cli import build_parser
from kvplan.models.cli import options_from_args
from kvplan.models.config import HFConfig
from kvplan.models.encoder import (
    MultimodalOptions,
    Tower,
    encoder_items,
    forward_peak_bytes,
    llava_next_image_tokens,
    vision_tower,
)
from kvplan.models.weights import _llava_vision_params
from tests.vllm_envs import run_in_vllm

MODELS = Path(__file__).parents[2] / "examples" / "models"
SIDE = Path(__file__).with_name("vllm_encoder_side.py")
BF16 = 2


def _config(name: str) -> HFConfig:
    return HFConfig(json.loads((MODELS / name / "config.json").read_text()))


def _port() -> int:
    with socket.socket() as probe:  # a free loopback port for the one-rank gloo group
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# (tokens per item, max_num_batched_tokens, max_num_seqs, max_model_len, limit)
BUDGETS = [
    *itertools.product((256,), (2048, 8192, 16384), (1, 4, 256), (4096, 262144), (1, 999)),
    (16384, 8192, 2, 262144, 999),  # Qwen3.5 / 3.6 at 8,192 batched tokens: one image
    (16384, 32768, 2, 262144, 999),
    (16384, 32768, 1, 8192, 999),  # shorter than one image: still one per prompt
    (16384, 65536, 1, 262144, 2),
    (1200, 8192, 1024, 32768, 3),
    (1200, 2048, 1, 1024, 999),
    (2928, 8192, 256, 32768, 999),  # llava-v1.6-mistral-7b-hf's 672 x 672 image: 2 items
    (2928, 2048, 256, 32768, 1),  # fewer batched tokens than one image: the image's
    (576, 8192, 256, 4096, 999),  # LLaVA 1.5's 336 x 336 image: 14 items
    (576, 8192, 4, 4096, 2),  # four requests of two images: 8
]


def _scaled(vision: dict[str, object], **widths: object) -> dict[str, object]:
    """A shipped vision_config at smaller widths (CPU time), its other fields kept."""
    return {**vision, **widths}


def _qwen2_5_host_side(items: int, grid: tuple[int, int, int]) -> int:
    """What Qwen2.5-VL's ViT keeps on the host (which the CPU run counts too): one
    grid's int64 window order in its per-grid cache (the batch's order and its inverse
    go to the device, which kvplan counts), the int32 window boundaries (cached per
    grid, padded: vLLM always pads to the next window; and the batch's, empty windows
    dropped), cu_seqlens (items + 1), the grid's own (t entries) and two int32 maxima."""
    t, h, w = grid
    merged_h, merged_w = h // 2, w // 2
    side = 112 // 2 // 14  # window_size // spatial_merge_size // patch_size, in tokens
    padded = (merged_h // side + 1) * (merged_w // side + 1) * t
    windows = -(-merged_h // side) * -(-merged_w // side) * t
    tokens = t * merged_h * merged_w
    return 8 * tokens + 4 * padded + 4 * (1 + items * windows) + 4 * (items + 1) + 4 * t + 8


def test_encoder_peak_outputs_and_budget_against_vllm(tmp_path: Path) -> None:
    gemma, qwen = _config("gemma-3-27b"), _config("qwen3.6-27b")
    qwen25, qwen3vl = _config("qwen2.5-vl-7b-instruct"), _config("qwen3-vl-8b-instruct")
    # An eighth of the widths, the same head size (80 / 72) and ratios; the deepstack
    # levels after blocks 0 and 1 of 3 (both held while the last block runs), or after
    # 0 and 2 (one held: the last block's own is taken after it).
    v25 = _scaled(qwen25.data["vision_config"], hidden_size=160, intermediate_size=428,
                  num_heads=2, out_hidden_size=448)  # fmt: skip
    v3 = _scaled(qwen3vl.data["vision_config"], hidden_size=144, intermediate_size=538,
                 num_heads=2, out_hidden_size=512, deepstack_visual_indexes=[0, 1])  # fmt: skip
    v3_late = {**v3, "deepstack_visual_indexes": [0, 2]}
    scout = json.loads(
        (Path(__file__).parents[1] / "data" / "llama-4-scout-vision.json").read_text()
    )
    llama4 = {"kind": "llama4", "vision": scout["vision_config"],
              "text_hidden": scout["text_hidden_size"]}  # fmt: skip
    siglip = {
        "kind": "siglip",
        "vision": gemma.data["vision_config"],
        "text_hidden": gemma.data["text_config"]["hidden_size"],
        "mm_tokens_per_image": gemma.data["mm_tokens_per_image"],
    }
    vit = {"kind": "qwen3_vit", "vision": qwen.data["vision_config"]}
    # The second SigLIP case halves the image (448 pixels, 32 x 32 patches pooled to
    # 8 x 8 = 64 tokens, the same 4 x 4 pooling) to keep the CPU run short.
    small = {**gemma.data, "mm_tokens_per_image": 64,
             "vision_config": {**gemma.data["vision_config"], "image_size": 448}}  # fmt: skip
    towers = [
        {**siglip, "depth": 2, "items": 1},
        {**siglip, "vision": small["vision_config"], "mm_tokens_per_image": 64, "depth": 3,
         "items": 2},
        {**vit, "depth": 2, "items": 1, "grid": [1, 32, 32]},
        {**vit, "depth": 3, "items": 2, "grid": [1, 16, 32]},
        {"kind": "qwen2_5_vit", "vision": v25, "depth": 2, "items": 1, "grid": [1, 16, 16]},
        {"kind": "qwen2_5_vit", "vision": v25, "depth": 3, "items": 2, "grid": [1, 12, 20]},
        {"kind": "qwen3_vl_vit", "vision": v3, "depth": 3, "items": 1, "grid": [1, 16, 16]},
        {"kind": "qwen3_vl_vit", "vision": v3_late, "depth": 3, "items": 2, "grid": [1, 12, 20]},
        {**llama4, "depth": 2, "tiles": 1},  # Scout's widths: 24 x 24 patches + CLS a tile
        {**llama4, "depth": 3, "tiles": 2},
    ]  # fmt: skip
    budgets = [
        dict(zip(("max_tokens_per_item", "max_num_batched_tokens", "max_num_seqs",
                  "max_model_len", "limit"), case, strict=True))
        for case in BUDGETS
    ]  # fmt: skip
    assert len(budgets) == 46
    answer = run_in_vllm(
        "0.32", [str(SIDE)], {"port": _port(), "towers": towers, "budgets": budgets},
        cache_root=tmp_path, timeout=280,
    )  # fmt: skip

    gemma_tower, qwen_tower = vision_tower(gemma, 1), vision_tower(qwen, 1)
    small_tower = vision_tower(HFConfig(small), 1)
    assert gemma_tower is not None and qwen_tower is not None and small_tower is not None
    patches = [1 * 64 * 64, 2 * 32 * 32, 1 * 32 * 32, 2 * 16 * 32]

    # On the CPU the host-side buffers count too, which on a GPU are not device memory:
    # the Qwen ViT keeps one item's int64 position ids (2 per patch) in a host cache
    # (`_rot_pos_ids_cache`), and its int32 cu_seqlens (items + 1) and max_seqlen.
    def host_side(items: int, patches_per_item: int) -> int:
        return 2 * 8 * patches_per_item + 4 * (items + 1) + 4

    def scaled_tower(config: HFConfig, vision: dict[str, object]) -> Tower:
        tower = vision_tower(HFConfig({**config.data, "vision_config": vision}), 1)
        assert tower is not None
        return tower

    q25, q3 = scaled_tower(qwen25, v25), scaled_tower(qwen3vl, {**v3, "depth": 3})
    q3_late = scaled_tower(qwen3vl, {**v3_late, "depth": 3})
    scout_text = {"hidden_size": scout["text_hidden_size"]}
    scout_config = HFConfig(
        {"model_type": "llama4", "vision_config": scout["vision_config"], "text_config": scout_text}
    )
    scout_tower = vision_tower(scout_config, 1)
    assert scout_tower is not None
    # 17 tiles (16 + the global one) of 24 x 24 patches shuffled to 144 embeddings each
    assert scout_tower.tokens_per_item == 17 * 144
    expected_peaks = [
        forward_peak_bytes(gemma_tower, 1, 64 * 64, BF16),
        forward_peak_bytes(small_tower, 2, 32 * 32, BF16),
        forward_peak_bytes(qwen_tower, 1, 32 * 32, BF16) + host_side(1, 32 * 32),
        forward_peak_bytes(qwen_tower, 2, 16 * 32, BF16) + host_side(2, 16 * 32),
        forward_peak_bytes(q25, 1, 16 * 16, BF16) + _qwen2_5_host_side(1, (1, 16, 16)),
        forward_peak_bytes(q25, 2, 12 * 20, BF16) + _qwen2_5_host_side(2, (1, 12, 20)),
        forward_peak_bytes(q3, 1, 16 * 16, BF16) + host_side(1, 16 * 16),
        forward_peak_bytes(q3_late, 2, 12 * 20, BF16) + host_side(2, 12 * 20),
        forward_peak_bytes(scout_tower, 1, 24 * 24 + 1, BF16),  # a tile as the unit
        forward_peak_bytes(scout_tower, 2, 24 * 24 + 1, BF16),
    ]
    assert answer["peaks"] == expected_peaks
    # The deepstack features held while the last block runs: both, then one.
    assert q3.peak_elements_per_patch - q3_late.peak_elements_per_patch == 512 // 4
    text_hidden = gemma.data["text_config"]["hidden_size"]
    out_hidden = qwen.data["vision_config"]["out_hidden_size"]
    assert answer["outputs"] == [
        1 * 256 * text_hidden * BF16,
        2 * 64 * text_hidden * BF16,
        patches[2] // 4 * out_hidden * BF16,
        patches[3] // 4 * out_hidden * BF16,
        16 * 16 // 4 * 448 * BF16,
        2 * 12 * 20 // 4 * 448 * BF16,
        16 * 16 // 4 * (1 + 2) * 512 * BF16,  # the merger's and two deepstack levels'
        2 * 12 * 20 // 4 * (1 + 2) * 512 * BF16,
        1 * 144 * scout["text_hidden_size"] * BF16,
        2 * 144 * scout["text_hidden_size"] * BF16,
    ]
    assert q3.output_hidden == q3_late.output_hidden == 3 * 512
    ours = [list(encoder_items(tokens, limit, length, batched, seqs))
            for tokens, batched, seqs, length, limit in BUDGETS]  # fmt: skip
    assert answer["budgets"] == ours


VLLM_FLAGS = """
import json, sys
from vllm.platforms import current_platform
current_platform.device_type = "cpu"  # the CPU build names no device; argparse needs one
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
AsyncEngineArgs.add_cli_args(parser)
answers = []
for argv in json.load(sys.stdin):
    args = parser.parse_args(["--model", "m", *argv])
    answers.append([args.skip_mm_profiling, args.limit_mm_per_prompt, args.language_model_only])
print(json.dumps(answers))
"""
FLAG_CASES = [
    ["--skip-mm-profiling"],
    ["--limit-mm-per-prompt", '{"image": 2, "video": 0}'],
    ["--limit-mm-per-prompt", '{"image": {"count": 1}}'],
    ["--language-model-only"],
    ["--skip-mm-profiling", "--limit-mm-per-prompt", '{"image": 0}'],
]


@pytest.mark.parametrize("release", ["0.32", "0.34"])
def test_the_flags_parse_as_vllm_parses_them(release: str) -> None:
    """vLLM's own argparse (AsyncEngineArgs.add_cli_args) and kvplan's read the same
    multimodal flags to the same settings."""
    theirs = run_in_vllm(release, ["-c", VLLM_FLAGS], FLAG_CASES)
    parser = build_parser()
    for argv, (skip, limits, text_only) in zip(FLAG_CASES, theirs, strict=True):
        args = parser.parse_args(["plan", "--model", str(MODELS / "gemma-3-27b"), *argv])
        ours = options_from_args(args).multimodal
        counts = {key: value["count"] if isinstance(value, dict) else value
                  for key, value in limits.items()}  # fmt: skip
        assert ours == MultimodalOptions(bool(skip), counts, bool(text_only)), argv


GRANITE_VISION = Path(__file__).parents[1] / "data" / "checkpoints" / "granite-vision-3.3-2b"


def _tower_only(tower: Tower | None) -> Tower:
    """The tower's own moments: what a run of the tower and projector over tiles (not
    whole images) is compared with."""
    assert tower is not None
    return replace(tower, after_tower=())


def test_llava_next_tower_against_vllm(tmp_path: Path) -> None:
    """LLaVA-Next (Granite Vision's wrapper) against vLLM 0.32's own modules: the SigLIP
    tower init_vision_tower_for_llava builds and LlavaMultiModalProjector, run over two
    and three tiles with a list of feature layers (every layer's output held) at an
    eighth of the shipped widths (CPU time); their parameters (the tower built to the
    deepest feature layer only); and the largest image's embeddings and tiles as
    LlavaNextProcessingInfo counts them, for the shipped pinpoints and a smaller set."""
    granite = json.loads((GRANITE_VISION / "config.json").read_text())
    small = {**granite["vision_config"], "hidden_size": 144, "intermediate_size": 538,
             "num_attention_heads": 2, "num_hidden_layers": 5}  # fmt: skip
    base = {"kind": "llava_next", "vision": small, "text_hidden": 256, "strategy": "full",
            "pinpoints": granite["image_grid_pinpoints"]}  # fmt: skip
    towers = [
        {**base, "feature_layers": [-4, -2, -1], "tiles": 2},  # all five layers built
        {**base, "feature_layers": [-5, -2], "tiles": 3},  # four of five built
    ]
    shipped = {**base, "vision": granite["vision_config"],
               "text_hidden": granite["text_config"]["hidden_size"],
               "feature_layers": granite["vision_feature_layer"]}  # fmt: skip
    few = {**towers[1], "strategy": "default", "pinpoints": [[384, 768], [768, 768], [1152, 384]]}
    answer = run_in_vllm(
        "0.32", [str(SIDE)],
        {"port": _port(), "towers": towers, "llava_next": [shipped, towers[0], few]},
        cache_root=tmp_path, timeout=280,
    )  # fmt: skip

    def config(case: dict[str, object]) -> HFConfig:
        return HFConfig({
            **granite, "vision_config": case["vision"],
            "text_config": {**granite["text_config"], "hidden_size": case["text_hidden"]},
            "vision_feature_layer": case["feature_layers"],
            "vision_feature_select_strategy": case["strategy"],
            "image_grid_pinpoints": case["pinpoints"],
        })  # fmt: skip

    # the tower and projector over tiles; the moments after them, per image, are
    # test_llava_image_path_against_vllm's
    ours = [_tower_only(vision_tower(config(case), 1)) for case in towers]
    expected = [
        forward_peak_bytes(tower, case["tiles"], 27 * 27, BF16)
        for tower, case in zip(ours, towers, strict=True)
    ]
    assert answer["peaks"] == expected
    assert answer["outputs"] == [case["tiles"] * 27 * 27 * 256 * BF16 for case in towers]
    for case, (params, tokens, tiles) in zip((shipped, towers[0], few), answer["llava_next"],
                                             strict=True):  # fmt: skip
        c = config(case)
        tower = vision_tower(c, 1)
        assert tower is not None
        assert (tower.tokens_per_item, tower.patches_per_item) == (tokens, tiles * 27 * 27)
        hidden = c.sub("text_config").integer("hidden_size")  # type: ignore[union-attr]
        assert _llava_vision_params(c, c.sub("vision_config"), hidden) == params  # type: ignore[arg-type]
    # The shipped pinpoints: the 3,840 x 384 strip, ten tiles and the base one, 8,289
    # embeddings (the encoder budget the 0.19 log prints).
    assert answer["llava_next"][0][1:] == [8289, 11]


KIMI_VL = Path(__file__).parents[1] / "data" / "checkpoints" / "kimi-vl-a3b-instruct"


def test_moonvit_tower_against_vllm(tmp_path: Path) -> None:
    """Kimi-VL's MoonViT and projector against vLLM 0.32's own modules at an eighth of
    the widths (the same head size, 72; CPU time): the forward's peak over one image of
    16 x 16 patches at depth 2 and two of 12 x 20 at depth 3, with the rotary table
    built beforehand, equals kvplan's per-patch count (`forward_peak_bytes`, plus the
    sequence boundaries' few bytes); the table
    itself is kvplan's `persistent_bytes`; the projector's output is a text-width row
    per merged 2 x 2 patch."""
    kimi = json.loads((KIMI_VL / "config.json").read_text())
    small = {**kimi["vision_config"], "hidden_size": 144, "intermediate_size": 538,
             "num_attention_heads": 2}  # fmt: skip
    base = {"kind": "moonvit", "vision": small, "text_hidden": 256}
    towers = [
        {**base, "depth": 2, "items": 1, "grid": [16, 16]},
        {**base, "depth": 3, "items": 2, "grid": [12, 20]},
    ]
    answer = run_in_vllm("0.32", [str(SIDE)], {"port": _port(), "towers": towers},
                         cache_root=tmp_path, timeout=280)  # fmt: skip
    config = HFConfig({**kimi, "vision_config": small,
                       "text_config": {**kimi["text_config"], "hidden_size": 256}})  # fmt: skip
    tower = vision_tower(config, 1)
    assert tower is not None
    # Besides, the packed sequence's boundaries, (items + 1) int64 lengths and int32
    # cu_seqlens (bytes; not modelled).
    assert answer["peaks"] == [
        forward_peak_bytes(tower, 1, 16 * 16, BF16) + 2 * 12,
        forward_peak_bytes(tower, 2, 12 * 20, BF16) + 3 * 12,
    ]
    assert answer["tables"] == [tower.persistent_bytes] * 2
    assert answer["outputs"] == [16 * 16 // 4 * 256 * BF16, 2 * 12 * 20 // 4 * 256 * BF16]
    # The shipped config: vLLM's dummy image is 66 x 66 patches, 1,089 embeddings.
    shipped = vision_tower(HFConfig(kimi), 1)
    assert shipped is not None
    assert (shipped.patches_per_item, shipped.tokens_per_item) == (66 * 66, 1089)


LLAVA_MISTRAL = Path(__file__).parents[1] / "data" / "checkpoints" / "llava-v1.6-mistral-7b-hf"
LLAVA_1_5 = Path(__file__).parents[1] / "data" / "checkpoints" / "llava-1.5-7b-hf"


def test_clip_llava_towers_against_vllm(tmp_path: Path) -> None:
    """LLaVA-Next and LLaVA 1.5 over CLIP against vLLM 0.32's own modules: the
    CLIPVisionModel init_vision_tower_for_llava builds (to the deepest feature layer, no
    post-layernorm) and LlavaMultiModalProjector, run on the CPU at an eighth of
    llava-v1.6-mistral-7b-hf's tower widths (128 wide, MLP 512, two heads of 64, four
    layers; 336-pixel tiles of 24 x 24 patches and the class token), with one feature
    layer over two tiles, a list of them over three (every layer's output held), and
    LLaVA 1.5's wrapper over two images. The peak is at a layer's QuickGELU, whose
    PyTorch form (vLLM's custom ops off) holds three MLP-wide tensors. Then the
    parameters (tower, projector, newline) and the largest image's embeddings and tiles
    as LlavaNextProcessingInfo / LlavaProcessingInfo count them, for the shipped files
    and the scaled cases."""
    mistral = json.loads((LLAVA_MISTRAL / "config.json").read_text())
    llava = json.loads((LLAVA_1_5 / "config.json").read_text())
    small = {**mistral["vision_config"], "hidden_size": 128, "intermediate_size": 512,
             "num_attention_heads": 2, "num_hidden_layers": 4}  # fmt: skip
    base = {"kind": "llava_next", "vision": small, "text_hidden": 256, "strategy": "default",
            "pinpoints": mistral["image_grid_pinpoints"], "feature_layers": -2}  # fmt: skip
    towers = [
        {**base, "tiles": 2},  # three of four layers built
        {**base, "feature_layers": [-3, -1], "tiles": 3},  # all four, two concatenated
        {**base, "wrapper": "llava", "tiles": 2},  # LLaVA 1.5: two one-tile images
    ]
    shipped_next = {**base, "vision": mistral["vision_config"], "text_hidden": 4096}
    shipped_llava = {**base, "wrapper": "llava", "vision": llava["vision_config"],
                     "text_hidden": 4096}  # fmt: skip
    facts = [shipped_next, shipped_llava, *towers]
    answer = run_in_vllm(
        "0.32", [str(SIDE)], {"port": _port(), "towers": towers, "llava_next": facts},
        cache_root=tmp_path, timeout=280,
    )  # fmt: skip

    def config(case: dict[str, object]) -> HFConfig:
        raw = {**mistral, "vision_config": case["vision"],
               "text_config": {**mistral["text_config"], "hidden_size": case["text_hidden"]},
               "vision_feature_layer": case["feature_layers"],
               "vision_feature_select_strategy": case["strategy"]}  # fmt: skip
        if case.get("wrapper") == "llava":
            raw = {**raw, "model_type": "llava",
                   "architectures": ["LlavaForConditionalGeneration"]}  # fmt: skip
            del raw["image_grid_pinpoints"]
        return HFConfig(raw)

    ours = [_tower_only(vision_tower(config(case), 1)) for case in towers]
    sequence = 24 * 24 + 1  # a tile's patches and CLIP's class token
    expected = [
        forward_peak_bytes(tower, case["tiles"], sequence, BF16)
        for tower, case in zip(ours, towers, strict=True)
    ]
    assert answer["peaks"] == expected
    # one feature layer: 4 x 128 + 3 x 512 per position; the list, at the fourth layer's
    # MLP: the embeddings and three layers' outputs in the pool, the residual and its
    # normed copy (6 x 128) beside QuickGELU's three (3 x 512)
    assert [t.peak_elements_per_patch for t in ours] == [2048, 2304, 2048]
    # the projector's output: every position but the class token, 256 wide
    assert answer["outputs"] == [case["tiles"] * 576 * 256 * BF16 for case in towers]
    for case, (params, tokens, tiles) in zip(facts, answer["llava_next"], strict=True):
        c = config(case)
        tower = vision_tower(c, 1)
        assert tower is not None
        assert (tower.tokens_per_item, tower.patches_per_item) == (tokens, tiles * sequence)
        hidden = c.sub("text_config").integer("hidden_size")  # type: ignore[union-attr]
        assert _llava_vision_params(c, c.sub("vision_config"), hidden) == params  # type: ignore[arg-type]
    # The shipped pinpoints: 672 x 672, the base tile and four, 2,928 embeddings (576 +
    # 48 x 48 + 48 newlines); LLaVA 1.5: one tile's 576.
    assert answer["llava_next"][0][1:] == [2928, 5]
    assert answer["llava_next"][1][1:] == [576, 1]


def test_llava_image_path_against_vllm(tmp_path: Path) -> None:
    """The whole image path of vLLM 0.32's LLaVA wrappers on the CPU (the wrapper's own
    _process_image_input: tower, projector and LLaVA-Next's anyres merge with the newline
    vector) over one and two largest images, at an eighth of the towers' widths, against
    kvplan's forward peak (the larger of the tower's and the moments after it) and the
    embeddings returned. Text widths 4 x the tower's (llava-v1.6-mistral's 4,096 over
    1,024: the tower's peak), 8 x (the merge's: the projected tiles, the merged images
    and the grid being merged), and for LLaVA 1.5 4 x and 16 x (the projector's);
    Granite Vision's SigLIP with its feature list and `full` strategy under a 2,048-wide
    text model (the merge's)."""
    mistral = json.loads((LLAVA_MISTRAL / "config.json").read_text())
    granite = json.loads((GRANITE_VISION / "config.json").read_text())
    clip = {**mistral["vision_config"], "hidden_size": 128, "intermediate_size": 512,
            "num_attention_heads": 2, "num_hidden_layers": 4}  # fmt: skip
    siglip = {**granite["vision_config"], "hidden_size": 144, "intermediate_size": 538,
              "num_attention_heads": 2, "num_hidden_layers": 5}  # fmt: skip
    cases: list[dict[str, Any]] = [
        *({"vision": clip, "text_hidden": hidden, "strategy": "default", "items": items,
           "pinpoints": mistral["image_grid_pinpoints"], "feature_layers": -2}
          for hidden, items in ((512, 2), (1024, 1), (1024, 2))),
        *({"vision": clip, "text_hidden": hidden, "strategy": "default", "items": 2,
           "feature_layers": -2, "wrapper": "llava", "pinpoints": []}
          for hidden in (512, 2048)),
        {"vision": siglip, "text_hidden": 2048, "strategy": "full", "items": 1,
         "pinpoints": granite["image_grid_pinpoints"], "feature_layers": [-4, -2, -1]},
    ]  # fmt: skip

    def config(case: dict[str, Any]) -> HFConfig:
        raw = {**(granite if case["vision"] is siglip else mistral),
               "vision_config": case["vision"],
               "vision_feature_layer": case["feature_layers"],
               "vision_feature_select_strategy": case["strategy"]}  # fmt: skip
        raw["text_config"] = {**raw["text_config"], "hidden_size": case["text_hidden"]}
        if case.get("wrapper") == "llava":
            raw = {**raw, "model_type": "llava",
                   "architectures": ["LlavaForConditionalGeneration"]}  # fmt: skip
            del raw["image_grid_pinpoints"]
        return HFConfig(raw)

    towers: list[Tower] = []
    for case in cases:
        tower = vision_tower(config(case), 1)
        assert tower is not None
        towers.append(tower)
        size = case["vision"]["image_size"]
        case["tiles"] = tower.input_elements_per_item // (3 * size * size)
        sequence = tower.patches_per_item // case["tiles"]  # a tile's positions
        # the largest image: the pinpoint with the most embeddings (LLaVA 1.5: one tile)
        pinpoints = [tuple(p) for p in case["pinpoints"]] or [(size, size)]
        grid = size // case["vision"]["patch_size"]
        base = sequence - (case["strategy"] == "default")
        case["image"] = max(pinpoints, key=lambda p: llava_next_image_tokens(
            p[0], p[1], pinpoints, size, grid, base))  # fmt: skip
        case["kind"] = "llava_embed"
    assert [case["tiles"] for case in cases] == [5, 5, 5, 1, 1, 11]
    answer = run_in_vllm(
        "0.32", [str(SIDE)], {"port": _port(), "towers": cases},
        cache_root=tmp_path, timeout=280,
    )  # fmt: skip
    ours = [
        forward_peak_bytes(tower, case["items"], tower.patches_per_item, BF16)
        for tower, case in zip(towers, cases, strict=True)
    ]
    assert answer["peaks"] == ours
    assert answer["outputs"] == [
        case["items"] * tower.tokens_per_item * case["text_hidden"] * BF16
        for tower, case in zip(towers, cases, strict=True)
    ]
    # which moment is the peak: the tower's, the merge's (twice), the tower's, the
    # projector's, the merge's
    in_tower = [
        case["items"] * tower.patches_per_item * tower.peak_elements_per_patch * BF16
        for tower, case in zip(towers, cases, strict=True)
    ]
    assert [peak == tower for peak, tower in zip(ours, in_tower, strict=True)] == [
        True, False, False, True, False, False
    ]  # fmt: skip
