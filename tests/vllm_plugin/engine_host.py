"""Starts vLLM engines through vLLM's own `EngineCore._initialize_kv_caches`, with the
kvplan plugin loaded through its `vllm.general_plugins` entry point.

Runs with a vLLM venv's python and the installed plugin on PYTHONPATH (never the
repository: the plugin must come from its wheel). Only the hardware is stood in
for: `StandInExecutor` returns real vLLM spec objects, the memory a GPU worker
would measure, and records what `initialize_from_config` receives; the CUDA
driver that names a worker's GPU is `FakeLibcuda`.

Protocol: one JSON command per stdin line, one JSON answer per stdout line.
  {"op": "start", "name": "A", "engine": "llama", "env": {...}, "memory": [bytes],
   "utilization": 0.45, "uuid": "GPU-..."}  -> {"ok": true, "log": [...], "init": {...}}
                                             or {"ok": false, "error": "..."}
  {"op": "shutdown", "name": "A"}           -> {"ok": true, "log": [...]}
  {"op": "counters"}                        -> the plugin's counters
  {"op": "exit"}
"""

from __future__ import annotations

import ctypes
import inspect
import json
import logging
import math
import os
import sys
import time
import traceback
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

# vLLM logs to stdout by default; the protocol owns stdout.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

import torch
import vllm
import vllm.config
import vllm.plugins
from vllm.config import (
    CacheConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.config.attention import AttentionConfig
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

SERIES = ".".join(vllm.__version__.split(".")[:2])
GIB = 1 << 30


def has_field(spec_class: type, name: str) -> bool:
    """Whether this release's spec class has the field (0.32 has no `is_draft` nor
    MLA's `topk_buffer_width`; 0.34 adds a few)."""
    return name in getattr(spec_class, "__dataclass_fields__", {})


# A drafter layer's marker where the release has one (0.33+); 0.32's specs cannot
# say which layers are the drafter's, so its draft rules find them otherwise.
DRAFTER: dict[str, Any] = {"is_draft": True} if has_field(FullAttentionSpec, "is_draft") else {}

# --- the hardware boundary -------------------------------------------------------------


class FakeLibcuda:
    """The CUDA driver calls kvplan.client.devices makes, for one visible GPU."""

    def __init__(self) -> None:
        self.uuid = ""

    def cuInit(self, flags: int) -> int:
        return 0

    def cuDeviceGetCount(self, count: Any) -> int:
        count.contents.value = 1
        return 0

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:
        if ordinal != 0:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        device.contents.value = 0
        return 0

    def cuDeviceGetUuid_v2(self, out: Any, device: int) -> int:
        hex_digits = self.uuid.removeprefix("GPU-").replace("-", "")
        out.contents.bytes[:] = bytes.fromhex(hex_digits)
        return 0

    def cuDeviceGetName(self, name: Any, length: int, device: int) -> int:
        ctypes.memmove(name, b"NVIDIA H100 80GB HBM3\0", 22)
        return 0


LIBCUDA = FakeLibcuda()


def install_fake_driver() -> None:
    import kvplan.client.devices as devices

    devices._load_libcuda = lambda: LIBCUDA


class StandInWorker:
    """What the plugin's worker-side report reads from a GPU worker."""

    def __init__(self, total: int, requested: int, weights: int, cache_config: Any = None) -> None:
        self.device = SimpleNamespace(index=0)
        self.local_rank = 0
        self.init_snapshot = SimpleNamespace(total_memory=total)
        self.requested_memory = requested
        self.model_runner = SimpleNamespace(model_memory_usage=weights)
        # As a uniprocess executor's worker: the engine's own CacheConfig.
        self.cache_config = cache_config
        self.profiled = False

    def determine_available_memory(self, measured: int) -> int:
        """vLLM's branch (gpu_worker.Worker.determine_available_memory, 0.32-0.34):
        an explicit kv_cache_memory_bytes skips the memory profiling; otherwise the
        profile sets what the plugin's report reads. The device is the boundary:
        `measured` stands for what profiling it would leave."""
        explicit = getattr(self.cache_config, "kv_cache_memory_bytes", None)
        if explicit:
            self.profiled = False
            return int(explicit)
        self.profiled = True
        self.peak_activation_memory = (self.requested_memory - measured) // 4
        self.cudagraph_memory_estimate = GIB // 4
        self.available_kv_cache_memory_bytes = measured
        return measured


class StandInExecutor:
    def __init__(
        self, specs: list[dict[str, Any]], memory: list[int], workers: list[StandInWorker]
    ) -> None:
        self.specs = specs
        self.memory = memory
        self.workers = workers
        self.received: list[Any] = []
        self.extended: int | None = None
        self.warmup_blocks: int | None = None

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return self.specs

    def determine_available_memory(self) -> list[int]:
        return [
            worker.determine_available_memory(measured)
            for worker, measured in zip(self.workers, self.memory, strict=True)
        ]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["LBNHC"] for _ in self.specs]

    def set_kv_cache_layout(self, *args: Any) -> None:
        pass

    def initialize_from_config(self, configs: list[Any]) -> None:
        self.received = configs

    def compile_or_warm_up_model(self) -> list[Any]:
        # 0.34's extensible KV cache: what each rank measures after warm-up.
        if SERIES == "0.34":
            from vllm.v1.worker.gpu_worker import CompilationTimes

            return [
                CompilationTimes(language_model=0.0, encoder=0.0, num_kv_blocks=self.warmup_blocks)
                for _ in self.specs
            ]
        return []

    def extensible_kv_cache_unsupported_reason(self, specs: Any) -> str | None:
        return None

    def disable_extensible_kv_cache(self, reason: str) -> None:
        raise AssertionError(reason)

    def extend_kv_cache(self, num_blocks: int) -> None:
        self.extended = num_blocks

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> list[Any]:
        if isinstance(method, str):
            return [None for _ in self.workers]  # e.g. update_max_model_len: no model here
        # As vLLM's multiprocess executor sends a callable to its worker processes.
        import pickle

        import cloudpickle  # type: ignore[import-not-found]  # vLLM venv only
        from vllm.v1.serial_utils import run_method

        sent = cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
        return [run_method(worker, sent, args, kwargs or {}) for worker in self.workers]


# --- engines: real vLLM spec objects -----------------------------------------------------

BF16 = torch.bfloat16
ALIGNMENT = 1 << 16


def full(heads: int, head: int, dtype: torch.dtype = BF16, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head, dtype=dtype, **kw)


def llama() -> dict[str, Any]:
    return {f"model.layers.{i}.self_attn.attn": full(8, 128) for i in range(32)}


def llama_tp2() -> dict[str, Any]:
    """One tensor-parallel rank of Llama at TP=2: half the KV heads."""
    return {f"model.layers.{i}.self_attn.attn": full(4, 128) for i in range(32)}


def gemma3() -> dict[str, Any]:
    return {
        f"model.layers.{i}.self_attn.attn": (
            full(4, 256)
            if i % 6 == 5
            else SlidingWindowSpec(
                block_size=16, num_kv_heads=4, head_size=256, dtype=BF16, sliding_window=1024
            )
        )
        for i in range(34)
    }


def gpt_oss_eagle3() -> dict[str, Any]:
    specs: dict[str, Any] = {}
    for i in range(24):
        specs[f"model.layers.{i}.attn"] = (
            full(8, 64)
            if i % 2
            else SlidingWindowSpec(
                block_size=16, num_kv_heads=8, head_size=64, dtype=BF16, sliding_window=128
            )
        )
    specs["draft_model.model.layers.24.self_attn.attn"] = full(8, 64, **DRAFTER)
    return specs


def mla(**kw: Any) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=BF16, cache_dtype_str="auto", **kw
    )


def deepseek_mtp() -> dict[str, Any]:
    specs: dict[str, Any] = {f"model.layers.{i}.self_attn.attn": mla() for i in range(8)}
    specs["model.layers.8.self_attn.attn"] = mla(**DRAFTER)
    return specs


def mla_swa_marked_drafter() -> dict[str, Any]:
    """A DeepSeek-V4-like target (MLA and sliding-window MLA layers, alternating)
    with an MTP drafter of one MLA layer carrying the spec marker
    (`non_causal_multi_token_decode`) and one sliding-window MLA layer registered
    last. vLLM 0.32 flags both groups (the marker's, and the last layer's); 0.33+
    flags neither (no layer is `is_draft`); kvplan's own rules flag the marker's."""
    swa = {"block_size": 64, "num_kv_heads": 1, "head_size": 576, "dtype": BF16}
    specs: dict[str, Any] = {
        f"model.layers.{i}.self_attn.attn": (
            mla()
            if i % 2 == 0
            else SlidingWindowMLASpec(**swa, cache_dtype_str="auto", sliding_window=128)
        )
        for i in range(6)
    }
    specs["mtp.layers.0.self_attn.attn"] = mla(non_causal_multi_token_decode=True)
    specs["mtp.layers.0.self_attn.swa"] = SlidingWindowMLASpec(
        **swa, cache_dtype_str="auto", sliding_window=128
    )
    return specs


def _gdn(**kw: Any) -> MambaSpec:
    return MambaSpec(
        block_size=16,
        shapes=((2, 512), (3, 32, 32)),
        dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
        num_speculative_blocks=1,
        **kw,
    )


def qwen3_next(*, marked: bool, **mamba: Any) -> dict[str, Any]:
    """Qwen3-Next-like: GDN layers 3:1 with full attention, and an MTP layer that the
    model marks as a drafter (`marked`) or, like vLLM leaves it, does not."""
    specs: dict[str, Any] = {}
    for i in range(8):
        if i in (3, 7):
            specs[f"model.layers.{i}.self_attn.attn"] = full(2, 64, torch.float32)
        else:
            specs[f"model.layers.{i}.linear_attn"] = _gdn(**mamba)
    specs["mtp.layers.0.self_attn.attn"] = full(2, 64, torch.float32, **(DRAFTER if marked else {}))
    return specs


ENGINES: dict[str, tuple[Any, dict[str, Any]]] = {
    # name: (specs, config: speculative method/target, mamba mode, block size, max len)
    "llama": (llama, {"max_model_len": 32768}),
    "llama-tp2": (llama_tp2, {"max_model_len": 32768, "tp": 2}),
    "llama-auto-fit": (llama, {"max_model_len": 131072, "auto_fit": True}),
    "llama-override": (llama, {"max_model_len": 8192, "override": 1000}),
    "gemma3": (gemma3, {"max_model_len": 32768}),
    "gpt-oss-eagle3": (
        gpt_oss_eagle3,
        {"max_model_len": 32768, "method": "eagle3", "target": "gpt_oss", "k": 3},
    ),
    "deepseek-mtp": (
        deepseek_mtp,
        {"max_model_len": 16384, "block_size": 64, "method": "mtp", "target": "deepseek_v3"},
    ),
    # Requests never longer than one block: no shared prefix can hit.
    "deepseek-mtp-short": (
        deepseek_mtp,
        {"max_model_len": 64, "block_size": 64, "method": "mtp", "target": "deepseek_v3"},
    ),
    "qwen3-next-mtp": (
        lambda: qwen3_next(marked=True),
        {"max_model_len": 8192, "method": "mtp", "target": "qwen3_next", "mamba": "align"},
    ),
    # Each Mamba state starts on a 64 KiB boundary (0.34's state_alignment, what a
    # platform's mamba_state_alignment asks for; 0.33 has only the block stride).
    "qwen3-next-mtp-aligned": (
        lambda: qwen3_next(
            marked=True,
            block_stride_alignment=ALIGNMENT,
            **({"state_alignment": ALIGNMENT} if SERIES == "0.34" else {}),
        ),
        {"max_model_len": 8192, "method": "mtp", "target": "qwen3_next", "mamba": "align"},
    ),
    "qwen3-next-eagle-unmarked": (
        lambda: qwen3_next(marked=False),
        {"max_model_len": 8192, "method": "eagle", "target": "qwen3_next", "mamba": "align"},
    ),
    "qwen3-next-mtp-unmarked": (
        lambda: qwen3_next(marked=False),
        {"max_model_len": 8192, "method": "mtp", "target": "qwen3_next", "mamba": "align"},
    ),
    "mla-swa-marked-drafter": (
        mla_swa_marked_drafter,
        {"max_model_len": 16384, "block_size": 64, "method": "mtp", "target": "deepseek_v4"},
    ),
}


# --- the config EngineCore reads -----------------------------------------------------------


class EngineConfig:
    """`VllmConfig` needs a model and a GPU; this carries real vLLM sub-configs and
    VllmConfig's own properties and methods for what the engine core reads."""

    max_concurrent_batches = VllmConfig.max_concurrent_batches
    max_in_flight_tokens = VllmConfig.max_in_flight_tokens
    num_speculative_tokens = VllmConfig.num_speculative_tokens
    num_prefill_lookahead_tokens = VllmConfig.num_prefill_lookahead_tokens
    adjust_dcp_kv_cache_interleave_size = VllmConfig.adjust_dcp_kv_cache_interleave_size
    validate_block_size = VllmConfig.validate_block_size

    def __init__(self, options: dict[str, Any], utilization: float | None) -> None:
        max_len = options["max_model_len"]
        self.model_config = SimpleNamespace(
            max_model_len=max_len,
            # -1: the user asked vLLM to fit max_model_len to the memory.
            original_max_model_len=-1 if options.get("auto_fit") else max_len,
            supports_kv_cache_grouping=False,
            dtype=BF16,
            is_diffusion=False,
            model="",
            enforce_eager=False,
            quantization=None,
            # 0.32's trailing-layer draft rule reads the target's model type.
            hf_config=SimpleNamespace(model_type=options.get("target", "llama")),
        )
        cache_kwargs: dict[str, Any] = {
            "block_size": options.get("block_size", 16),
            "mamba_cache_mode": options.get("mamba", "none"),
        }
        if utilization is not None:  # None: the release's default
            cache_kwargs["gpu_memory_utilization"] = utilization
        if SERIES == "0.34":
            # As VllmConfig settles it: a block override sizes the cache instead.
            cache_kwargs["enable_extensible_kv_cache"] = "override" not in options
        self.cache_config = CacheConfig(**cache_kwargs)
        if "override" in options:
            self.cache_config.num_gpu_blocks_override = options["override"]
        self.scheduler_config = SchedulerConfig(
            max_model_len=max_len,
            is_encoder_decoder=False,
            max_num_batched_tokens=8192,
            max_num_seqs=128,
            enable_chunked_prefill=True,
        )
        self.parallel_config = ParallelConfig(tensor_parallel_size=options.get("tp", 1))
        self.speculative_config = _speculative(options)
        self.attention_config = AttentionConfig()
        self.device_config = SimpleNamespace(device_type="cuda")
        self.kv_transfer_config = None
        self.diffusion_config = None
        self.use_v2_model_runner = False
        self.compilation_config = SimpleNamespace(
            compilation_time=0.0,
            encoder_compilation_time=0.0,
            cudagraph_mode=SimpleNamespace(name="FULL_AND_PIECEWISE"),
            max_cudagraph_capture_size=512,
        )


def _speculative(options: dict[str, Any]) -> SpeculativeConfig | None:
    """A SpeculativeConfig without its __init__ (which loads the draft model): only
    what its predicates read is set, so vLLM's predicates run unchanged."""
    method = options.get("method")
    if method is None:
        return None
    config = object.__new__(SpeculativeConfig)
    values = {
        "method": method,
        "num_speculative_tokens": options.get("k", 1),
        "disable_eagle_block_drop": False,
        "disable_lookahead_block_hashes": False,
        "num_speculative_tokens_per_batch_size": None,
        "draft_model_config": SimpleNamespace(
            hf_config=SimpleNamespace(num_nextn_predict_layers=1, model_type=method),
            architectures=[],
            model=method,
        ),
        "target_model_config": SimpleNamespace(
            hf_config=SimpleNamespace(model_type=options.get("target", ""))
        ),
    }
    for key, value in values.items():
        object.__setattr__(config, key, value)
    return config


# --- the spec mapping, both directions, over every spec class --------------------------------


def spec_samples() -> list[Any]:
    """One spec per kvplan kind, with fields away from their defaults (and, on 0.34,
    the fields 0.34 added; 0.32's classes lack `is_draft` and `topk_buffer_width`)."""
    import vllm.v1.kv_cache_interface as kv
    from vllm.v1.attention.backend import MultipleOf

    att = {"block_size": 32, "num_kv_heads": 4, "head_size": 128, "dtype": BF16}
    quant = {"kv_quant_mode": kv.KVQuantMode.FP8_PER_TENSOR, "dtype": torch.uint8}
    mla_kw = {"block_size": 64, "num_kv_heads": 1, "head_size": 576, "dtype": BF16}
    topk = (
        {"topk_buffer_width": 2048} if has_field(kv.MLAAttentionSpec, "topk_buffer_width") else {}
    )
    return [
        kv.FullAttentionSpec(**att, head_size_v=64, max_tp_shards=2, **DRAFTER),
        kv.FullAttentionSpec(**{**att, **quant}, sliding_window=256, non_causal=True),
        kv.FullAttentionSpec(**att, block_stride_alignment=MultipleOf(64), dcp_sharded=False),
        kv.FullAttentionSpec(**att, page_size_padded=1 << 20, block_stride_alignment=4096),
        kv.MLAAttentionSpec(
            **mla_kw,
            cache_dtype_str="fp8_ds_mla",
            alignment=576,
            model_version="deepseek_v4",
            cache_role=kv.SparseCacheRole.INDEXER,
            is_index_group_leader=True,
            non_causal_multi_token_decode=True,
            **topk,
        ),
        kv.MLAAttentionSpec(**mla_kw, cache_dtype_str="auto", tokens_per_state=4),
        kv.HiddenStateCacheSpec(**mla_kw, cache_dtype_str="auto"),
        kv.SlidingWindowSpec(**att, sliding_window=1024),
        kv.SlidingWindowMLASpec(
            **mla_kw, cache_dtype_str="auto", sliding_window=128, bounded_replay=True
        ),
        kv.ChunkedLocalAttentionSpec(**att, attention_chunk_size=8192),
        kv.SinkFullAttentionSpec(**att, sink_len=4, sliding_window=512),
        kv.RSWASpec(**att, rswa_window=64),
        kv.CrossAttentionSpec(**att),
        kv.EncoderOnlyAttentionSpec(**att),
        kv.CircularBufferSpec(**att, num_head_slots=2, state_content_bytes=96),
        kv.FullAttentionSpec(**att, tokens_per_state=Fraction(1, 2)),
        kv.MambaSpec(
            block_size=16,
            shapes=((2, 512), (3, 32, 32)),
            dtypes=(BF16, torch.float32),
            mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
            mamba_cache_mode="align",
            num_speculative_blocks=2,
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=64,
            num_heads=4,
            tp_replicated=True,
            page_size_padded=65536,
            **DRAFTER,
        ),
        kv.HiSparseHotSpec(block_size=64, page_size=656 * 64, blocks_per_request=2048),
        kv.HiSparseResidentSpec(block_size=64, page_size=656 * 64, block_stride_alignment=4096),
    ] + (since_034(kv, att, mla_kw) if SERIES == "0.34" else [])


def since_034(kv: Any, att: dict[str, Any], mla_kw: dict[str, Any]) -> list[Any]:
    return [
        kv.FullAttentionSpec(**att, num_head_slots=8, kv_head_major_slots=True),
        kv.SlidingWindowMLASpec(
            **mla_kw,
            cache_dtype_str="auto",
            sliding_window=128,
            non_causal_multi_token_decode=True,
        ),
        kv.MambaSpec(
            block_size=16,
            shapes=((2, 512), (3, 32, 32)),
            dtypes=(BF16, torch.float32),
            mamba_cache_mode="align",
            state_alignment=4096,
            block_stride_alignment=4096,
        ),
    ]


def roundtrip() -> dict[str, Any]:
    """vLLM spec -> LayerSpec -> vLLM spec must give the spec back, for every kind;
    every spec class vLLM defines is either mapped or refused by name."""
    import dataclasses

    import vllm.v1.kv_cache_interface as kv
    from vllm.v1.attention.backend import MultipleOf

    from kvplan.client.vllm_plugin import specs as mapping

    namespace = SimpleNamespace(
        **{name: getattr(kv, name) for name in mapping.SPEC_KINDS},
        KVQuantMode=kv.KVQuantMode,
        SparseCacheRole=kv.SparseCacheRole,
        MambaAttentionBackendEnum=MambaAttentionBackendEnum,
        MultipleOf=MultipleOf,
    )
    failures: list[str] = []
    kinds: set[str] = set()
    for spec in spec_samples():
        layer = mapping.to_layer_spec("layer", spec)
        kinds.add(str(layer.WhichOneof("kind")))
        mode = getattr(spec, "mamba_cache_mode", "none")
        back = mapping.from_layer_spec(layer, namespace, torch=torch, mamba_cache_mode=mode)
        if (
            back != spec
            or getattr(back, "is_draft", None) != getattr(spec, "is_draft", None)
            or type(back) is not type(spec)
        ):
            failures.append(f"{spec!r} came back as {back!r}")
    classes = sorted(
        name
        for name, value in vars(kv).items()
        if isinstance(value, type)
        and issubclass(value, kv.KVCacheSpec)
        and dataclasses.is_dataclass(value)
        and name not in ("KVCacheSpec", "AttentionSpec")
    )
    unmapped = [
        c for c in classes if c not in mapping.SPEC_KINDS and c not in mapping.UNSUPPORTED_CLASSES
    ]
    refused: list[str] = []
    # A field another release lacks, away from its default, cannot be built here.
    other = mapping.to_layer_spec(
        "other", kv.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=BF16)
    )
    other.full_attention.attention.kv_head_major_slots = SERIES != "0.34"
    try:
        mapping.from_layer_spec(other, namespace, torch=torch)
        built_across_releases = "built"
    except mapping.UnsupportedSpec as error:
        built_across_releases = str(error)
    # A drafter layer (0.33+'s is_draft): 0.32 has no field to carry it.
    drafter = mapping.to_layer_spec(
        "drafter", kv.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=BF16)
    )
    drafter.is_draft = True
    try:
        mapping.from_layer_spec(drafter, namespace, torch=torch)
        drafter_built = "built"
    except mapping.UnsupportedSpec as error:
        drafter_built = str(error)
    for bad in (
        kv.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.int32),
        kv.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={}),
        kv.MambaSpec(block_size=16, shapes=((1,),), dtypes=(BF16,), tokens_per_state=8),
    ):
        try:
            mapping.to_layer_spec("bad", bad)
        except mapping.UnsupportedSpec as error:
            refused.append(str(error))
    return {
        "failures": failures,
        "kinds": sorted(kinds),
        "classes": classes,
        "unmapped": unmapped,
        "refused": refused,
        "built_across_releases": built_across_releases,
        "drafter_built": drafter_built,
    }


def conformance_direction(repo: str) -> dict[str, Any]:
    """Every layer of the conformance scenarios, built into a vLLM spec by
    conformance/vllm_driver.py (which goes through the plugin's mapping:
    `with_engine_defaults` + `from_layer_spec`), read back by `to_layer_spec` and
    built again: the two directions must give the same spec over all of them."""
    from pathlib import Path

    from google.protobuf import json_format

    from kvplan.client.vllm_plugin import specs as mapping
    from kvplan.v1 import plan_pb2

    sys.path.append(repo)  # after the installed wheel: kvplan stays the wheel's
    from conformance import vllm_driver

    compared = 0
    mismatches: list[str] = []
    for path in sorted(Path(repo, "tests", "conformance", "scenarios").glob("*.json")):
        scenario = json.loads(path.read_text())
        request = json_format.ParseDict(scenario["request"], plan_pb2.PlanRequest())
        o = request.options
        block_size = o.block_size or 16
        align = o.mamba_cache_mode == plan_pb2.MAMBA_CACHE_MODE_ALIGN
        max_len = int(o.derived_max_model_len) if o.max_model_len == -1 else int(o.max_model_len)
        ctx = vllm_driver._LayerContext(
            options=o,
            block_size=block_size,
            mamba_block_size=block_size if align else max_len,
            cache_dtype=vllm_driver.engine_cache_dtype(o),
            mamba_mode="align" if align else "none",
        )
        for worker in request.workers:
            for layer in worker.layers:
                try:
                    built = vllm_driver.build_layer_spec(layer, ctx)
                except Exception:  # scenarios of invalid layers: vLLM refuses them too
                    continue
                if built is None:
                    continue
                again = mapping.from_layer_spec(
                    mapping.to_layer_spec(layer.name, built),
                    vllm_driver._VLLM_SPECS,
                    torch=torch,
                    mamba_cache_mode=ctx.mamba_mode,
                )
                compared += 1
                same_draft = getattr(again, "is_draft", None) == getattr(built, "is_draft", None)
                if again != built or type(again) is not type(built) or not same_draft:
                    mismatches.append(f"{path.name} {layer.name}: {again!r} != {built!r}")
    return {
        "compared": compared,
        "mismatches": mismatches[:5],
        "driver_uses_the_mapping": vllm_driver.spec_mapping is mapping,
    }


def signatures() -> dict[str, list[str]]:
    """The plugin's load-time check of every release's table against this vLLM's
    own modules (the originals, where the plugin wrapped them)."""
    import vllm.v1.core.kv_cache_utils as kv_cache_utils
    import vllm.v1.engine.core as core_module
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from kvplan.client.vllm_plugin.hooks import RELEASES, signature_problems

    return {
        series: signature_problems(core_module, release, KVCacheGroupSpec, kv_cache_utils)
        for series, release in RELEASES.items()
    }


# --- the host ---------------------------------------------------------------------------------


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")

    def take(self) -> list[str]:
        out, self.lines = self.lines, []
        return out


CAPTURE = Capture()
CORES: dict[str, Any] = {}
BASE_ENV = {k: v for k, v in os.environ.items() if k.startswith("KVPLAN_")}


def start(command: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.engine.core import EngineCore

    make_specs, options = ENGINES[command["engine"]]
    for key in [k for k in os.environ if k.startswith("KVPLAN_")]:
        del os.environ[key]
    os.environ.update(BASE_ENV)
    os.environ.update(command.get("env", {}))
    config = EngineConfig(options, command.get("utilization", 0.9))
    cache = config.cache_config
    utilization = getattr(cache, "resolved_gpu_memory_utilization", None)
    if utilization is None:
        utilization = cache.gpu_memory_utilization
    specs = make_specs()
    memory = command["memory"]
    # The device as the worker measures it (kvplan's inventory may say otherwise).
    total = command.get("total", 80 * GIB)
    requested = math.ceil(total * utilization)
    workers = [
        StandInWorker(total, requested, max(0, min(16 * GIB, requested - m)), cache) for m in memory
    ]
    # The model's directory (its config.json identifies the configuration to the fleet).
    config.model_config.model = command.get("model_dir", "")
    executor = StandInExecutor([specs for _ in memory], memory, workers)
    executor.warmup_blocks = command.get("warmup_blocks")
    LIBCUDA.uuid = command.get("uuid", "GPU-00000000-0000-0000-0000-000000000000")
    core = object.__new__(EngineCore)
    core.model_executor = executor
    core.available_gpu_memory_for_kv_cache = -1
    started = time.perf_counter()
    try:
        scheduler_config = EngineCore._initialize_kv_caches(core, config)
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}", "log": CAPTURE.take()}
    CORES[command["name"]] = core
    received = executor.received
    return {
        "ok": True,
        "log": CAPTURE.take(),
        "init": {
            "num_blocks": [int(c.num_blocks) for c in received],
            "tensor_bytes": [sum(int(t.size) for t in c.kv_cache_tensors) for c in received],
            "groups": [
                {"layers": list(g.layer_names), "is_draft": bool(g.is_eagle_group)}
                for g in received[0].kv_cache_groups
            ],
            # The scheduler's own config (what the KV cache manager is built from).
            "scheduler_draft": [bool(g.is_eagle_group) for g in scheduler_config.kv_cache_groups],
            "extended": executor.extended,
            "max_model_len": int(config.model_config.max_model_len),
            "measured": memory,
            "profiled": [worker.profiled for worker in workers],
            "seconds": time.perf_counter() - started,
        },
    }


def without_kv_groups(command: dict[str, Any]) -> dict[str, Any]:
    """An engine whose layers need no KV cache (vLLM's attention-free spec dict, {}):
    the real `_initialize_kv_caches`, then the KV cache manager EngineCore.__init__'s
    scheduler builds next from its config, prefix caching as `command` says."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine.core import EngineCore

    config = EngineConfig({"max_model_len": 4096}, 0.9)
    config.cache_config.enable_prefix_caching = command["prefix_caching"]
    executor = StandInExecutor([{}], [40 * GIB], [StandInWorker(80 * GIB, 72 * GIB, 16 * GIB)])
    executor.warmup_blocks = None
    core = object.__new__(EngineCore)
    core.model_executor = executor
    core.available_gpu_memory_for_kv_cache = -1
    os.environ.pop("KVPLAN_ADDR", None)  # vLLM alone: the plugin stays inert
    kv_cache_config = EngineCore._initialize_kv_caches(core, config)
    params = inspect.signature(KVCacheManager.__init__).parameters
    sizes = {n: 16 for n in ("scheduler_block_size", "hash_block_size") if n in params}
    try:
        manager = KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=4096,
            enable_caching=config.cache_config.enable_prefix_caching,
            **sizes,
        )
    except Exception as error:
        return {"ok": False, "groups": len(kv_cache_config.kv_cache_groups),
                "error": f"{type(error).__name__}: {error}"}  # fmt: skip
    return {"ok": True, "groups": len(kv_cache_config.kv_cache_groups),
            "coordinator": type(manager.coordinator).__name__}  # fmt: skip


def shutdown(command: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.engine import core as engine_core
    from vllm.v1.engine.core import EngineCore

    core = CORES.pop(command["name"])
    # EngineCore.shutdown stops parts this stand-in never started; give it
    # what it touches as no-ops, and run it (the plugin wraps it).
    core.model_executor.shutdown = lambda: None
    core.scheduler = SimpleNamespace(shutdown=lambda: None)
    core.structured_output_manager = SimpleNamespace(clear_backend=lambda: None)
    # The last step frees accelerator memory: the hardware boundary, absent here.
    engine_core.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
    EngineCore.shutdown(core)
    return {"ok": True, "log": CAPTURE.take()}


def main() -> None:
    logger = logging.getLogger("vllm")
    logger.addHandler(CAPTURE)
    logger.setLevel(logging.INFO)
    install_fake_driver()
    if "KVPLAN_TEST_VLLM_VERSION" in os.environ:  # the version gate's view of vLLM
        vllm.__version__ = os.environ["KVPLAN_TEST_VLLM_VERSION"]
    # What vLLM does in every process it starts: load the general plugins.
    vllm.plugins.load_general_plugins()
    print(json.dumps({"ready": True, "vllm": vllm.__version__, "log": CAPTURE.take()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "start":
                answer = start(command)
            elif command["op"] == "shutdown":
                answer = shutdown(command)
            elif command["op"] == "counters":
                from kvplan.client.vllm_plugin.hooks import COUNTERS

                answer = dict(vars(COUNTERS))
            elif command["op"] == "log":  # what was logged since the last answer
                answer = {"ok": True, "log": CAPTURE.take()}
            elif command["op"] == "lease_state":
                hold = CORES[command["name"]]._kvplan_lease
                answer = {
                    "renewals": hold.keeper.renewals,
                    "allocations": {str(k): v for k, v in hold.allocations().items()},
                    "interval_s": hold.keeper.interval_s,
                }
            elif command["op"] == "conformance_direction":
                answer = conformance_direction(command["repo"])
            elif command["op"] == "without_kv_groups":
                answer = without_kv_groups(command)
            elif command["op"] == "roundtrip":
                answer = roundtrip()
            elif command["op"] == "signatures":
                answer = signatures()
            elif command["op"] == "wrapped":
                from vllm.v1.engine import core as engine_core

                answer = {
                    "wrapped": hasattr(
                        engine_core.EngineCore._initialize_kv_caches, "__kvplan_original__"
                    ),
                    "modules": sorted(m for m in sys.modules if m.startswith("kvplan")),
                }
            elif command["op"] == "exit":
                break
            else:
                answer = {"ok": False, "error": f"unknown op {command['op']}"}
        except Exception:
            answer = {"ok": False, "error": traceback.format_exc(), "log": CAPTURE.take()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
