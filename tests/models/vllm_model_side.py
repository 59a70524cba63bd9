"""Runs in a vLLM CPU venv: builds vLLM's own model classes on the meta device for
config directories and prints each cache layer's spec as vLLM's layers report it
(`get_kv_cache_spec`, the call the GPU model runner makes).

Stand-ins, at the hardware boundary only: the CPU build has no GPU platform, so
attention-backend selection (a kernel choice, MLA's prefill kernel included) answers a
backend with FlashAttention's block declaration (multiples of 16) and no kernels, and MoE
expert layers (whose kernel oracle needs a GPU platform; experts keep no cache) are
empty modules. Tensor
parallelism is the model-parallel group's world size: the model code reads it to shard
heads and states, and nothing communicates on the meta device.

stdin: {"cases": [{"path": DIR, "tp": N, "max_model_len": L, "kv_cache_dtype": D}]}
stdout (last line): {"specs": [[[name, kind, fields...], ...] per case],
                     "parameters": [element count of the model's parameters, per case]}
"""

from __future__ import annotations

import importlib
import json
import os
import sys

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

import torch
import vllm.config
from torch import nn
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.config.vllm import get_layers_from_vllm_config
from vllm.distributed import (
    init_distributed_environment,
    initialize_model_parallel,
    parallel_state,
)
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.v1.attention.backend import AttentionMetadataBuilder, MultipleOf


class NoKernels:
    supports_quant_query_input = False
    dcp_world_size = 1  # no decode context parallelism

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __getattr__(self, name: str) -> None:
        return None


class NoBuilder(AttentionMetadataBuilder):  # type: ignore[misc]
    pass


class FlashAttentionShapedBackend:
    """Backend metadata only: FlashAttention's name and block rule, no kernels."""

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def is_mla() -> bool:
        return False

    @staticmethod
    def supports_alibi_sqrt() -> bool:
        return False

    @staticmethod
    def get_impl_cls() -> type:
        return NoKernels

    @staticmethod
    def get_builder_cls() -> type:
        return NoBuilder

    @staticmethod
    def customize_spec(spec: object, *args: object, **kwargs: object) -> object:
        return spec

    @staticmethod
    def get_supported_kernel_block_sizes(*args: object, **kwargs: object) -> list[object]:
        return [MultipleOf(16)]


def _backend(*args: object, **kwargs: object) -> type:
    return FlashAttentionShapedBackend


class NoExperts(nn.Module):  # type: ignore[misc]
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()


def _no_experts(*args: object, **kwargs: object) -> nn.Module:
    return NoExperts()


def install_stand_ins() -> None:
    # vLLM inspects a model class in a subprocess so that the parent never initializes
    # CUDA; there is no CUDA here, and one vLLM import per architecture would dominate
    # the run, so the inspection runs in this process.
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda inspect: inspect()
    # The GDN mixer of Qwen3.5 places its norm on the platform's current device, which
    # the CPU build does not name: the meta device, as every other parameter here.
    from vllm.platforms import current_platform

    if getattr(current_platform, "current_device", None) is None:
        current_platform.current_device = lambda: torch.device("meta")
    for name in (
        "attention.attention",
        "attention.mla_attention",
        "attention.chunked_local_attention",
        "attention.cross_attention",
        "attention.encoder_only_attention",
        "attention.static_sink_attention",
        "mamba.abstract",
    ):
        module = importlib.import_module("vllm.model_executor.layers." + name)
        if hasattr(module, "get_attn_backend"):
            setattr(module, "get_attn_backend", _backend)  # noqa: B010
    mla = importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
    setattr(mla, "get_mla_prefill_backend", lambda *args, **kwargs: NoKernels)  # noqa: B010
    for name in ("gpt_oss", "jamba", "llama4", "nemotron_h", "qwen3_moe", "mixtral", "deepseek_v2",
                 "qwen3_next", "qwen2_moe"):  # fmt: skip
        module = importlib.import_module("vllm.model_executor.models." + name)
        if hasattr(module, "FusedMoEFactory"):
            setattr(module, "FusedMoEFactory", _no_experts)  # noqa: B010


def spec_row(name: str, spec: object) -> list[object]:
    kind = type(spec).__name__
    row: list[object] = [name, kind]
    if kind == "MambaSpec":
        row.append([list(shape) for shape in spec.shapes])  # type: ignore[attr-defined]
        row.append([str(dtype).removeprefix("torch.") for dtype in spec.dtypes])  # type: ignore[attr-defined]
        return row
    row += [
        spec.num_kv_heads,  # type: ignore[attr-defined]
        spec.head_size,  # type: ignore[attr-defined]
        str(spec.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
        getattr(spec, "sliding_window", None),
        getattr(spec, "attention_chunk_size", None),
    ]
    return row


def vision_tower(vision: dict[str, object], kind: str = "qwen3_5") -> nn.Module:
    """The vision transformer a Qwen ConditionalGeneration wrapper (its model_type,
    `kind`) builds, on the meta device: Qwen3.5 / 3.6's and Qwen3-VL's
    Qwen3_VisionTransformer (Qwen3-VL's with its deepstack mergers), Qwen2.5-VL's
    Qwen2_5_VisionTransformer."""
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    transformers = importlib.import_module("transformers")
    with torch.device("meta"):
        if kind == "qwen2_5_vl":
            config = transformers.models.qwen2_5_vl.configuration_qwen2_5_vl
            return Qwen2_5_VisionTransformer(config.Qwen2_5_VLVisionConfig(**vision),
                                             prefix="visual")  # fmt: skip
        if kind == "qwen3_vl":
            config = transformers.models.qwen3_vl.configuration_qwen3_vl
            return Qwen3_VisionTransformer(config.Qwen3VLVisionConfig(**vision), prefix="visual")
        return Qwen3_VisionTransformer(transformers.Qwen3_5VisionConfig(**vision),
                                       prefix="visual")  # fmt: skip


PARAMETERS: list[int] = []  # each case's model: its parameters' element count


def cpu_vllm_config(path: str, max_model_len: int, cache_dtype: str = "auto") -> VllmConfig:
    """The engine config vLLM's loader reads, for a config directory on the CPU
    (dummy weights, no tokenizer)."""
    model_config = ModelConfig(
        model=path,
        tokenizer=path,
        skip_tokenizer_init=True,
        dtype="auto",
        max_model_len=max_model_len,
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
        parallel_config=ParallelConfig(),
        load_config=LoadConfig(load_format="dummy"),
        device_config=DeviceConfig(device="cpu"),
    )


def join_one_rank_groups(port: int) -> None:
    """vLLM's distributed groups, one rank each (once per process): the model code
    reads their sizes and ranks; nothing communicates on the meta device."""
    if parallel_state._TP is not None:
        return
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)
    if getattr(parallel_state, "_EP", None) is None:
        # Created only when the first model has experts; one rank either way.
        parallel_state._EP = parallel_state._TP


def specs_of(case: dict[str, object]) -> list[list[object]]:
    config = cpu_vllm_config(
        str(case["path"]),
        int(case["max_model_len"]),  # type: ignore[call-overload]
        str(case["kv_cache_dtype"]),
    )
    with vllm.config.set_current_vllm_config(config):
        join_one_rank_groups(int(case["port"]))  # type: ignore[call-overload]
        parallel_state._TP.world_size = int(case["tp"])  # type: ignore[call-overload]
        with torch.device("meta"):
            model = initialize_model(config)
        if "vision" in case:  # the multimodal wrapper's tower, built beside the text model
            model = nn.ModuleList(
                [model, vision_tower(case["vision"], str(case.get("vision_kind", "qwen3_5")))]  # type: ignore[arg-type]
            )
    PARAMETERS.append(sum(parameter.numel() for parameter in model.parameters()))
    layers = get_layers_from_vllm_config(config, AttentionLayerBase)
    rows = []
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(config)
        if spec is not None:
            rows.append(spec_row(name, spec))
    return rows


def main() -> None:
    payload = json.load(sys.stdin)
    install_stand_ins()
    cases = [{**case, "port": payload["port"]} for case in payload["cases"]]
    specs = [specs_of(case) for case in cases]
    print(json.dumps({"specs": specs, "parameters": PARAMETERS}))


if __name__ == "__main__":
    main()
