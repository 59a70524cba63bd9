"""Plan a kvplan `PlanRequest` with the installed vLLM release's own planner
(0.32.0, 0.33.0 or 0.34.0).

Runs inside a reference virtual environment (vllm + CPU torch + protobuf), with
the repository root on `sys.path` so `kvplan.v1` (the generated protobuf modules)
imports. Nothing here copies vLLM code: it builds vLLM's inputs from a request the
way kvplan reads it, calls vLLM's planning functions in the order the engine core
does, and turns their results into a plain dict (see `plan_with_vllm`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
import sys
import warnings
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, cast, get_args

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# vllm.config must be imported before the attention registry (circular import).
import pydantic  # type: ignore[import-not-found]  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
import vllm.config  # noqa: E402
import vllm.logger  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.config.attention import AttentionConfig  # noqa: E402
from vllm.config.speculative import EagleModelTypes, NgramGPUTypes  # noqa: E402
from vllm.v1 import kv_cache_interface  # noqa: E402
from vllm.v1.attention.backend import MultipleOf  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_kv_cache_capacity,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

from kvplan.client.vllm_plugin import specs as spec_mapping  # noqa: E402
from kvplan.v1 import plan_pb2, spec_pb2  # noqa: E402

try:  # vLLM 0.33+: grouping and per-worker configs are two calls
    from vllm.v1.core import kv_cache_planning as _planning
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
except ImportError:  # vLLM 0.32: get_kv_cache_configs(config, specs, memory) groups itself
    _planning = None

Json = dict[str, Any]

VLLM_VERSION: str = vllm.__version__
# The rule set kvplan plans this release with (PlanRequest.options.engine_version).
ENGINE_VERSION = "vllm-" + ".".join(VLLM_VERSION.split(".")[:2])
DEFAULT_BLOCK_SIZE: int = CacheConfig.DEFAULT_BLOCK_SIZE
_SPEC_FIELDS = {f.name for f in dataclass_fields(MLAAttentionSpec)}
HAS_IS_DRAFT = "is_draft" in _SPEC_FIELDS
HAS_TOPK_BUFFER_WIDTH = "topk_buffer_width" in _SPEC_FIELDS
_ATTENTION_FIELDS = {f.name for f in dataclass_fields(FullAttentionSpec)}
HAS_KV_HEAD_MAJOR_SLOTS = "kv_head_major_slots" in _ATTENTION_FIELDS
HAS_SW_MLA_SPEC_MARKER = "non_causal_multi_token_decode" in {
    f.name for f in dataclass_fields(SlidingWindowMLASpec)
}
HAS_STATE_ALIGNMENT = "state_alignment" in {f.name for f in dataclass_fields(MambaSpec)}
# vLLM 0.34's extensible KV cache (on by default on CUDA/ROCm).
HAS_EXTENSIBLE_KV_CACHE = _planning is not None and hasattr(
    _planning, "finalize_extensible_kv_cache"
)
DEFAULT_ALLOCATION_GRANULE_BYTES = 2 << 20


def extensible(req: plan_pb2.PlanRequest) -> bool:
    """The extensible KV cache as 0.34's VllmConfig._resolve_extensible_kv_cache
    settles it on a CUDA engine without a KV connector: off with a block override,
    and an engine asking for it then is refused (the driver runs on the CPU, where
    vLLM would turn it off: the CUDA engine's rule is reproduced, in the driver's
    own words). A worker's KV bytes stand for the budget it measured, not vLLM's
    kv_cache_memory_bytes, which would also turn it off."""
    if not HAS_EXTENSIBLE_KV_CACHE:
        return False
    o = req.options
    override = o.HasField("num_gpu_blocks_override")
    if not o.HasField("extensible_kv_cache"):
        return not override
    if o.extensible_kv_cache and override:
        raise ValueError(
            "enable_extensible_kv_cache: the cache is sized from measured memory, "
            "which num_gpu_blocks_override overrides"
        )
    return o.extensible_kv_cache


DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92

# vLLM memory errors, recognised by how their messages start.
MEMORY_ERROR_PREFIXES = (
    "No available memory for the cache blocks",
    "To serve at least one request",
    "Cannot auto-fit max_model_len",
    "Free memory on device",
    "HiSparse host pool has",  # the host pool cannot hold one max_model_len request
    "HiSparse has no allocatable host blocks",
)

_STORAGE: dict[int, torch.dtype] = {
    spec_pb2.DTYPE_FLOAT32: torch.float32,
    spec_pb2.DTYPE_FLOAT16: torch.float16,
    spec_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    spec_pb2.DTYPE_UINT8: torch.uint8,
    spec_pb2.DTYPE_INT8: torch.int8,
    spec_pb2.DTYPE_FLOAT8_E4M3FN: torch.float8_e4m3fn,
    spec_pb2.DTYPE_FLOAT8_E5M2: torch.float8_e5m2,
}

# Warning codes (kvplan's WarningCode names) for the vLLM log lines that mean the same.
WARNING_PATTERNS: tuple[tuple[str, str], ...] = (
    ("padding layers, may waste at most", "PADDING_LAYERS"),
    ("KV cache page sizes cannot be unified", "FULL_ALLOCATION_FALLBACK"),
    ("Hybrid KV cache manager is disabled", "HYBRID_MANAGER_DISABLED"),
    ("could be identified as the draft model's", "NO_DRAFT_GROUP_MAMBA"),
    ("Auto-fit max_model_len: reduced", "MAX_MODEL_LEN_AUTO_FIT"),
)


def enum_suffix(enum_type: Any, value: int, prefix: str) -> str:
    """`KV_CACHE_DTYPE_FP8_DS_MLA` -> "fp8_ds_mla"."""
    name: str = enum_type.Name(value)
    return name.removeprefix(prefix).lower()


def engine_cache_dtype(options: plan_pb2.EngineOptions) -> torch.dtype:
    """The storage dtype a DTYPE_UNSPECIFIED layer inherits."""
    cache = options.cache_dtype
    if cache == spec_pb2.KV_CACHE_DTYPE_AUTO:
        if options.model_dtype == spec_pb2.DTYPE_UNSPECIFIED:
            return torch.bfloat16
        return _STORAGE[options.model_dtype]
    direct = {
        spec_pb2.KV_CACHE_DTYPE_FLOAT16: torch.float16,
        spec_pb2.KV_CACHE_DTYPE_BFLOAT16: torch.bfloat16,
        spec_pb2.KV_CACHE_DTYPE_FLOAT32: torch.float32,
        spec_pb2.KV_CACHE_DTYPE_INT8_PER_TOKEN_HEAD: torch.int8,
        spec_pb2.KV_CACHE_DTYPE_FP8_INC: torch.float8_e4m3fn,
    }
    return direct.get(cache, torch.uint8)


# --- captured log lines ------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


_CAPTURE = _Capture()


def _install_capture() -> None:
    """Route vLLM's log lines into `_CAPTURE` only (quiet console)."""
    root = logging.getLogger("vllm")
    for handler in list(root.handlers):
        if handler is not _CAPTURE:
            root.removeHandler(handler)
    if _CAPTURE not in root.handlers:
        root.addHandler(_CAPTURE)
    root.setLevel(logging.INFO)
    root.propagate = False


def _reset_log_once() -> None:
    """vLLM's *_once helpers are lru_cached per process; forget what they saw."""
    for name in ("_print_debug_once", "_print_info_once", "_print_warning_once"):
        fn = getattr(vllm.logger, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


_PADDING_RE = re.compile(r"Add (\d+) padding layers, may waste at most ([0-9.]+)%")


def classify_warning(message: str) -> str | None:
    for needle, code in WARNING_PATTERNS:
        if needle in message:
            return code
    return None


# --- the config object the planner reads -------------------------------------------


class PlannerConfig:
    """Stands in for `VllmConfig` (which cannot be built without a model and a GPU).

    The attributes the planner reads are real vLLM sub-configs; the derived
    properties are VllmConfig's own property objects, so their rules are vLLM's.
    """

    max_concurrent_batches = VllmConfig.max_concurrent_batches
    max_in_flight_tokens = VllmConfig.max_in_flight_tokens
    num_speculative_tokens = VllmConfig.num_speculative_tokens
    num_lookahead_tokens = VllmConfig.num_lookahead_tokens
    num_prefill_lookahead_tokens = VllmConfig.num_prefill_lookahead_tokens

    def __init__(
        self,
        *,
        model_config: Any,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        parallel_config: ParallelConfig,
        speculative_config: SpeculativeConfig | None,
        use_v2_model_runner: bool,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.parallel_config = parallel_config
        self.speculative_config = speculative_config
        self.attention_config = AttentionConfig()
        self.device_config = SimpleNamespace(device_type="cuda")
        self.kv_transfer_config: Any = None
        self.diffusion_config = None
        self.use_v2_model_runner = use_v2_model_runner

    # What the model runners' feature lists (0.32 / 0.33) call on the configuration.
    _dflash_needs_multi_kv_group = getattr(VllmConfig, "_dflash_needs_multi_kv_group", None)
    _is_dflash_candidate_draft = getattr(VllmConfig, "_is_dflash_candidate_draft", None)


@functools.cache
def _speculative_field_adapter(name: str) -> pydantic.TypeAdapter[Any]:
    field_info = SpeculativeConfig.__pydantic_fields__[name]
    with warnings.catch_warnings():
        # Dataclass-only attributes of the FieldInfo (init, kw_only) mean nothing here.
        warnings.simplefilter("ignore")
        return pydantic.TypeAdapter(Annotated[field_info.annotation, field_info])


def _validate_speculative_argument(name: str, value: Any) -> None:
    """The release's own pydantic definition of one SpeculativeConfig field (its
    type, e.g. the method Literal, and bounds such as num_speculative_tokens > 0),
    as the engine's arguments are validated; the field validators vLLM declares
    for it run too (0.34's method validator)."""
    _speculative_field_adapter(name).validate_python(value)
    validators = getattr(SpeculativeConfig, "__pydantic_decorators__", None)
    for validator in validators.field_validators.values() if validators else ():
        if name in validator.info.fields:
            validator.func(value)


# vLLM 0.34 sets speculators up through per-method config classes; the MTP one
# checks the target and the module count (adapt_draft_model_config,
# resolve_num_speculative_tokens), callable on the stand-in.
try:
    from vllm.v1.worker.gpu.spec_decode.mtp.config import MTPSpeculatorConfig
except ImportError:  # 0.32 / 0.33: inline in SpeculativeConfig.__post_init__
    MTPSpeculatorConfig = None


def _check_mtp_drafter(config: SpeculativeConfig) -> None:
    """SpeculativeConfig's refusals of an MTP drafter from what the request carries:
    a DeepSeek-V4.1 target (whose checkpoints hold DSpark stages, not MTP modules),
    and num_speculative_tokens above the drafter's module count (n_predict, the
    request's num_nextn_predict_layers) and not a multiple of it. 0.34: its MTP
    config class's own methods. 0.32 / 0.33 inline them in
    SpeculativeConfig.__post_init__ (vllm/config/speculative.py: the 'mtp' branch of
    the method detection, then the n_predict divisibility check), reproduced here
    with the driver's own messages. EAGLE-style drafters carry no n_predict, so only
    MTP is checked."""
    if MTPSpeculatorConfig is not None:
        MTPSpeculatorConfig.adapt_draft_model_config(config)
        MTPSpeculatorConfig.resolve_num_speculative_tokens(config)
        return
    if config.target_model_config.hf_config.model_type == "deepseek_v41":
        raise ValueError("SpeculativeConfig: a DeepSeek V4.1 target has no MTP drafter")
    n_predict = config.draft_model_config.hf_config.n_predict
    tokens = config.num_speculative_tokens
    if tokens > n_predict and tokens % n_predict != 0:
        raise ValueError(f"SpeculativeConfig: {tokens} draft tokens, {n_predict} MTP modules")


def _speculative_config(spec: plan_pb2.SpecDecodeConfig) -> SpeculativeConfig | None:
    """A SpeculativeConfig without its heavy __init__ (which loads the draft model):
    only the fields its predicates (use_eagle, use_eagle_block_drop,
    use_multi_module_mtp) read are set, so those predicates run unchanged. The
    engine's arguments are validated before any worker starts: the fields the
    request sets are validated as the release defines them, and the checks of the
    drafter that depend only on them run."""
    if spec.method == plan_pb2.SPEC_DECODE_METHOD_NONE:
        return None
    method = enum_suffix(plan_pb2.SpecDecodeMethod, spec.method, "SPEC_DECODE_METHOD_")
    _validate_speculative_argument("method", method)
    _validate_speculative_argument("num_speculative_tokens", spec.num_speculative_tokens)
    n_predict = spec.num_nextn_predict_layers if spec.HasField("num_nextn_predict_layers") else 1
    config = object.__new__(SpeculativeConfig)
    # 0.34 counts MTP modules from the draft config's n_predict; earlier releases
    # from num_nextn_predict_layers. Both are the same engine input.
    hf_config = SimpleNamespace(
        num_nextn_predict_layers=n_predict, n_predict=n_predict, model_type=method
    )
    has_draft_model = method not in ("ngram", "suffix")
    values = {
        "method": method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "disable_eagle_block_drop": spec.disable_eagle_block_drop,
        "disable_lookahead_block_hashes": False,
        "num_speculative_tokens_per_batch_size": None,
        "draft_model_config": (
            SimpleNamespace(hf_config=hf_config, architectures=[], model=method)
            if has_draft_model
            else None
        ),
        "target_model_config": SimpleNamespace(
            hf_config=SimpleNamespace(model_type=spec.target_model_type)
        ),
    }
    asked_parallel = spec.parallel_drafting if spec.HasField("parallel_drafting") else None
    if MTPSpeculatorConfig is None:
        # 0.32 / 0.33's __post_init__: DFlash and DSpark draft in parallel, other
        # methods as asked (0.32 counts the batch slots a drafter needs from it).
        values["parallel_drafting"] = method in ("dflash", "dspark") or bool(asked_parallel)
        # What the V1 / V2 runners' feature lists read besides.
        values["enable_adaptive_verification"] = False
        values["draft_lm_head_quantization"] = None
    elif asked_parallel and method not in ("dflash", "dspark"):
        # 0.34's __post_init__ (inline there): the deprecated field is taken for
        # DFlash and DSpark only.
        raise ValueError(f"SpeculativeConfig: parallel_drafting with {method}")
    for key, value in values.items():
        object.__setattr__(config, key, value)
    if method == "mtp":
        _check_mtp_drafter(config)
    return config


def _model_runner(options: plan_pb2.EngineOptions, config: PlannerConfig) -> bool:
    """VllmConfig.use_v2_model_runner with VLLM_USE_V2_MODEL_RUNNER as the request
    sets it (unset: the release's default), then the chosen runner's checks, from
    the release's own lists of what each runner lacks. Triton is taken as present
    (every CUDA build has it; this CPU venv may not). 0.34 has only V2."""
    if not hasattr(VllmConfig, "_get_v1_model_runner_unsupported_features"):
        return True
    asked = options.use_v2_model_runner if options.HasField("use_v2_model_runner") else None
    v2_lacks = VllmConfig._get_v2_model_runner_unsupported_features(config)
    if options.HasField("hisparse"):
        if asked is False:
            raise ValueError("VllmConfig: HiSparse requires model runner V2")
        use_v2 = True
    elif asked is not None:
        use_v2 = asked
    else:
        use_v2 = not v2_lacks
    if use_v2 and v2_lacks:
        raise ValueError(f"VllmConfig: model runner V2 lacks {', '.join(v2_lacks)}")
    if not use_v2:
        v1_lacks = VllmConfig._get_v1_model_runner_unsupported_features(config)
        if v1_lacks:
            raise ValueError(f"VllmConfig: model runner V1 lacks {', '.join(v1_lacks)}")
    return use_v2


def _check_async_drafter(config: PlannerConfig) -> None:
    """VllmConfig.__post_init__ (vllm/config/vllm.py), with async scheduling on (the
    request carries the settled value, so on means asked for): a drafter outside
    vLLM's EAGLE types, the GPU n-gram, the draft model, DSpark and DFlash is
    refused, by 0.32 on any model runner and by 0.33 on the V1 runner only; 0.34
    has only the V2 runner and no such check. Inline there, so reproduced here (the
    method lists are vLLM's own); messages are the driver's."""
    speculative = config.speculative_config
    refused_on = {"vllm-0.32": "any", "vllm-0.33": "v1"}.get(ENGINE_VERSION)
    if speculative is None or not config.scheduler_config.async_scheduling or refused_on is None:
        return
    overlapped = {*get_args(EagleModelTypes), *get_args(NgramGPUTypes)}
    overlapped |= {"draft_model", "dspark", "dflash"}
    # kvplan's ngram also stands for vLLM's ngram_gpu (the plugin sends it so),
    # which is what runs when async scheduling is on; it plans alike.
    overlapped.add("ngram")
    if speculative.method in overlapped:
        return
    if refused_on == "any" or not config.use_v2_model_runner:
        raise ValueError(f"VllmConfig: async scheduling with {speculative.method} drafting")


# --- layer specs ---------------------------------------------------------------------


@dataclass
class _LayerContext:
    options: plan_pb2.EngineOptions
    block_size: int
    mamba_block_size: int
    cache_dtype: torch.dtype
    mamba_mode: str


# vLLM's spec classes and enums, for the plugin's mapping in its LayerSpec -> vLLM
# direction: the plugin and this check read specs through the same tables.
_VLLM_SPECS = SimpleNamespace(
    **{name: getattr(kv_cache_interface, name) for name in spec_mapping.SPEC_KINDS},
    KVQuantMode=KVQuantMode,
    SparseCacheRole=SparseCacheRole,
    MambaAttentionBackendEnum=MambaAttentionBackendEnum,
    MultipleOf=MultipleOf,
)


def build_layer_spec(layer: spec_pb2.LayerSpec, ctx: _LayerContext) -> KVCacheSpec | None:
    """The vLLM spec kvplan's reading of `layer` corresponds to (None: encoder-only,
    which the engine core keeps out of KV-cache planning)."""
    if layer.WhichOneof("kind") == "encoder_only_attention":
        return None
    resolved = spec_mapping.with_engine_defaults(
        layer,
        block_size=ctx.block_size,
        mamba_block_size=ctx.mamba_block_size,
        storage_dtype=spec_mapping.STORAGE_DTYPES[spec_mapping.dtype_name(ctx.cache_dtype)],
    )
    spec = spec_mapping.from_layer_spec(
        resolved, _VLLM_SPECS, torch=torch, mamba_cache_mode=ctx.mamba_mode
    )
    return cast(KVCacheSpec, spec)


# --- inputs ----------------------------------------------------------------------


@dataclass
class VllmInputs:
    config: PlannerConfig
    specs: list[dict[str, KVCacheSpec]]
    available_memory: list[int]
    ranks: list[int]
    encoder_only: list[list[str]] = field(default_factory=list)
    # Extensible cache after warm-up: (measured KV bytes, granule) per worker.
    measured: list[tuple[int, int]] | None = None
    # HiSparse: whether the host pool is one shared mmap (a platform / executor
    # decision vLLM makes at start-up) and the host page size it aligns to.
    hisparse_shared_host_pool: bool = False
    host_page_bytes: int = 4096
    # Each worker's supported layouts (names, most preferred first; empty lists:
    # none given) and the layout asked for (VLLM_KV_CACHE_LAYOUT), if any.
    supported_layouts: list[list[str]] = field(default_factory=list)
    requested_layout: str | None = None


def _measured_blocks(config: KVCacheConfig, layout: Any, measured: int, granule: int) -> int:
    """What vLLM 0.34's worker measures: ExtensibleKVCache's own segment and
    fitting rules over the granule-padded reservation (no device needed)."""
    from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache, pad_kv_cache_segments

    padded = pad_kv_cache_segments(config, layout, granule)
    tensors = [t for t in padded.kv_cache_tensors if not t.host_resident]
    cache = object.__new__(ExtensibleKVCache)
    cache.size = tensors[0].size
    cache.capacity_blocks = padded.num_blocks
    cache._is_block_outermost = layout.is_block_outermost
    cache.segment_offsets, cache.segment_strides = cache._segments(tensors, layout)
    cache.bytes_per_block = sum(cache.segment_strides)
    cache.buffer = SimpleNamespace(granularity=granule)
    return int(cache.blocks_within(measured))


def resolve_layout(inputs: VllmInputs) -> None:
    """The engine core's layout resolution from the workers' lists, before grouping:
    the release's own `resolve_kv_cache_layout`, the asked-for layout passed the
    way an operator does (VLLM_KV_CACHE_LAYOUT)."""
    if inputs.config.cache_config.kv_cache_layout is not None:
        return  # taken as given
    import os

    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    saved = os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    if inputs.requested_layout is not None:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = inputs.requested_layout
    try:
        resolve_kv_cache_layout(
            inputs.config,
            inputs.supported_layouts,
            [spec for specs in inputs.specs for spec in specs.values()],
        )
    finally:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        if saved is not None:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = saved


def _finalize_extensible(inputs: VllmInputs, configs: list[KVCacheConfig]) -> None:
    assert _planning is not None and inputs.measured is not None
    cfg = inputs.config
    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    times = [
        SimpleNamespace(num_kv_blocks=_measured_blocks(config, layout, measured, granule))
        for config, (measured, granule) in zip(configs, inputs.measured, strict=True)
        if config.kv_cache_groups
    ]
    scheduler = generate_scheduler_kv_cache_config(configs)
    _planning.finalize_extensible_kv_cache(cfg, configs, scheduler, times)


def available_kv_memory(
    worker: plan_pb2.WorkerSpec, table: dict[str, int] | None = None, *, extensible: bool = False
) -> int:
    """The per-worker KV budget handed to get_kv_cache_configs (kvplan's rule); an
    extensible cache reserves at utilization 1.0 unless told otherwise."""
    memory = worker.memory
    if memory.WhichOneof("budget") == "kv_cache_memory_bytes":
        return int(memory.kv_cache_memory_bytes)
    total = worker.device.total_memory_bytes
    if not total and table:
        total = {k.lower(): v for k, v in table.items()}.get(worker.device.name.lower(), 0)
    if not total:
        raise ValueError(f"worker rank {worker.rank}: unknown device total memory")
    default = 1.0 if extensible else DEFAULT_GPU_MEMORY_UTILIZATION
    utilization = memory.gpu_memory_utilization or default
    if worker.device.HasField("free_memory_bytes"):
        # The worker's start-up check (vLLM's own request_memory).
        from vllm.v1.worker.utils import request_memory

        snapshot = SimpleNamespace(
            total_memory=total,
            free_memory=int(worker.device.free_memory_bytes),
            device_=f"cuda:{worker.rank}",
        )
        request_memory(
            snapshot,
            SimpleNamespace(
                gpu_memory_utilization=utilization,
                resolved_gpu_memory_utilization=utilization,
                enable_extensible_kv_cache=extensible,
            ),
        )
    non_kv = memory.non_kv
    used = (
        non_kv.weights_bytes
        + non_kv.activation_peak_bytes
        + non_kv.non_torch_bytes
        + non_kv.cuda_graph_bytes
    )
    return math.ceil(total * utilization) - used


def _prefix_caching(req: plan_pb2.PlanRequest) -> bool:
    """Prefix caching as vLLM's configuration settles it. Unset, the engine's
    default (ModelConfig.is_prefix_caching_supported) for the target model's layers:
    its attention type, and a pooler for a model of encoder-only layers alone (vLLM
    serves those as pooling models)."""
    kinds = {
        layer.WhichOneof("kind")
        for worker in req.workers
        for layer in worker.layers
        if not layer.is_draft  # the target model's type decides
    }
    if "rswa" in kinds:
        # UnlimitedOCRForCausalLMConfig, the model hook of the only model with RSWA
        # layers, turns prefix caching off whatever was asked.
        return False
    if req.options.HasField("enable_prefix_caching"):
        return req.options.enable_prefix_caching
    decoder = kinds - {"mamba", "cross_attention", "encoder_only_attention"}
    if decoder and "mamba" in kinds:
        attn_type = "hybrid"  # ModelConfig.attn_type asks is_hybrid first
    elif "cross_attention" in kinds:
        attn_type = "encoder_decoder"
    elif decoder:
        attn_type = "decoder"
    elif "encoder_only_attention" in kinds:
        attn_type = "encoder_only"
    else:
        attn_type = "attention_free"
    model = SimpleNamespace(
        attn_type=attn_type,
        pooler_config=SimpleNamespace() if attn_type == "encoder_only" else None,
    )
    return bool(ModelConfig.is_prefix_caching_supported.fget(model))


def _check_cache_dtype_with_dcp(options: plan_pb2.EngineOptions, parallel: ParallelConfig) -> None:
    """The release's own VllmConfig.validate_nvfp4_kv_cache_with_mla, run on what it
    reads: 0.34 refuses nvfp4_ds_mla under DCP > 1 (0.32 / 0.33 do not check it). Run
    without a model config, which ends the validator before its MLA-model check."""
    validators = VllmConfig.__pydantic_decorators__.model_validators
    validate = validators.get("validate_nvfp4_kv_cache_with_mla")
    if validate is None:
        return
    cache_dtype = enum_suffix(spec_pb2.KVCacheDtype, options.cache_dtype, "KV_CACHE_DTYPE_")
    validate.func(
        SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype=cache_dtype),
            parallel_config=parallel,
            model_config=None,
        )
    )


def _check_hybrid_manager(req: plan_pb2.PlanRequest, speculative: SpeculativeConfig | None) -> None:
    """VllmConfig.__post_init__ settles the hybrid KV cache manager: a model with
    chunked local attention (its attention_chunk_size; the target's layers show it)
    and a drafter that reads the target's hidden states cannot keep it on, so an
    engine asking for it is refused (unset, it is turned off). The drafters are the
    ones use_eagle() names (0.34 asks uses_target_hidden_states, which its speculator
    configs set for the same methods). Without such a drafter an environment variable
    can keep the manager on: the request's setting is taken as given."""
    if req.options.disable_hybrid_kv_cache_manager or speculative is None:
        return
    chunked = any(
        layer.WhichOneof("kind") == "chunked_local_attention" and not layer.is_draft
        for worker in req.workers
        for layer in worker.layers
    )
    if chunked and speculative.use_eagle():
        raise ValueError(
            "VllmConfig: the hybrid KV cache manager cannot run chunked local attention "
            "with a drafter reading the target's hidden states"
        )


def _check_hisparse_engine(parallel: ParallelConfig, scheduler: SchedulerConfig) -> None:
    """VllmConfig.__post_init__'s refusals of HiSparse engines (0.32-0.34 alike),
    which the driver cannot build (it needs a model): no pipeline stages, no
    decode context parallelism, and (where it settles the hybrid manager) the
    hybrid KV cache manager on. Messages are the driver's own."""
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("VllmConfig: HiSparse cannot run with pipeline parallelism")
    if parallel.decode_context_parallel_size > 1:
        raise ValueError("VllmConfig: HiSparse cannot run with decode context parallelism")
    if scheduler.disable_hybrid_kv_cache_manager:
        raise ValueError("VllmConfig: HiSparse needs the hybrid KV cache manager")


def build_inputs(req: plan_pb2.PlanRequest, table: dict[str, int] | None = None) -> VllmInputs:
    """Fresh vLLM inputs for one request (vLLM mutates its configs in place)."""
    o = req.options
    block_size = o.block_size or DEFAULT_BLOCK_SIZE
    auto_fit = o.max_model_len == -1
    if auto_fit:
        max_model_len = int(o.derived_max_model_len)
        original = -1
    else:
        max_model_len = int(o.max_model_len)
        original = max_model_len
    batched = o.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    prefix_caching = _prefix_caching(req)
    # vLLM's Mamba config hook (MambaModelConfig.verify_and_update_config) sets the
    # mode from prefix caching, whatever was asked for.
    align = prefix_caching

    # Given to the constructor, so that the release validates them as the engine's
    # arguments are (prefix_match_unit must be positive).
    given: dict[str, int | bool] = {}
    if o.HasField("num_gpu_blocks_override"):
        given["num_gpu_blocks_override"] = int(o.num_gpu_blocks_override)
    if o.HasField("prefix_match_unit"):
        given["prefix_match_unit"] = o.prefix_match_unit
    if o.enable_mamba_shared_prefix_checkpoint:
        given["enable_mamba_shared_prefix_checkpoint"] = True
    cache_config = CacheConfig(
        block_size=block_size,
        mamba_cache_mode="align" if align else "none",
        enable_prefix_caching=prefix_caching,
        **given,
    )
    # The engine core resolves the layout once (see `resolve_layout`). Without the
    # workers' lists kvplan takes the layout as given: a layout already on the
    # cache config wins outright.
    layout_name = plan_pb2.KVCacheLayout.Name(o.layout).removeprefix("KV_CACHE_LAYOUT_")
    if not any(w.supported_layouts for w in req.workers):
        cache_config.kv_cache_layout = layout_name

    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=batched,
        max_num_seqs=min(128, batched),
        enable_chunked_prefill=True,
        async_scheduling=o.async_scheduling,
        # The request carries the engine's settled value (VllmConfig resolves an
        # unset one before anything is planned).
        disable_hybrid_kv_cache_manager=o.disable_hybrid_kv_cache_manager,
    )
    # Derived state, not an argument (SchedulerConfig sets it from the batch; the CPU
    # platform raises the batch after that): the request carries the engine's value.
    scheduler_config.max_num_encoder_input_tokens = o.max_num_encoder_input_tokens or batched

    par = o.parallel
    # The constructor checks DCP as the engine's arguments are checked: at least 1,
    # and dividing TP (no prefill context parallelism here).
    parallel_config = ParallelConfig(
        tensor_parallel_size=par.tensor_parallel_size or 1,
        pipeline_parallel_size=par.pipeline_parallel_size or 1,
        decode_context_parallel_size=par.decode_context_parallel_size or 1,
    )

    _check_cache_dtype_with_dcp(o, parallel_config)

    model_config = SimpleNamespace(
        max_model_len=max_model_len,
        original_max_model_len=original,
        supports_kv_cache_grouping=False,
        # What model runner V1's feature list reads (no diffusion, no Step5).
        is_diffusion=False,
        architecture="",
        # vLLM 0.32's trailing-layer draft rule reads the target's model type here.
        hf_config=SimpleNamespace(model_type=req.spec_decode.target_model_type),
    )
    speculative_config = _speculative_config(req.spec_decode)
    _check_hybrid_manager(req, speculative_config)
    hisparse = o.HasField("hisparse")
    config = PlannerConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=parallel_config,
        speculative_config=speculative_config,
        use_v2_model_runner=False,  # settled below, from the configuration
    )
    config.use_v2_model_runner = _model_runner(o, config)
    if speculative_config is not None:
        _check_async_drafter(config)
        # The release's own check that a step has room for a token beside the
        # drafter's slots (it also settles max_num_scheduled_tokens, as the engine's).
        VllmConfig._set_max_num_scheduled_tokens(config)
    if hisparse:
        from vllm.config.attention import HiSparseConfig

        h = o.hisparse
        config.attention_config = AttentionConfig(
            hisparse_config=HiSparseConfig(
                device_buffer_size=h.device_buffer_size
                if h.HasField("device_buffer_size")
                else None
            )
        )
        # What hisparse_host_pool_gib reads of the connector configuration.
        config.kv_transfer_config = SimpleNamespace(
            kv_connector="HiSparseConnector",
            kv_connector_module_path=None,
            kv_connector_extra_config={"host_pool_gib": h.host_pool_gib},
        )
        if h.HasField("index_topk"):
            model_config.hf_config.index_topk = h.index_topk
        _check_hisparse_engine(parallel_config, scheduler_config)
    ctx = _LayerContext(
        options=o,
        block_size=block_size,
        mamba_block_size=block_size if align else max_model_len,
        cache_dtype=engine_cache_dtype(o),
        mamba_mode="align" if align else "none",
    )
    workers = sorted(req.workers, key=lambda w: w.rank)
    specs: list[dict[str, KVCacheSpec]] = []
    encoder_only: list[list[str]] = []
    for worker in workers:
        one: dict[str, KVCacheSpec] = {}
        skipped: list[str] = []
        for layer in worker.layers:
            spec = build_layer_spec(layer, ctx)
            if spec is None:
                skipped.append(layer.name)
            else:
                one[layer.name] = spec
        specs.append(one)
        encoder_only.append(skipped)
    has_kv_cache = any(specs)
    is_extensible = extensible(req)
    if HAS_EXTENSIBLE_KV_CACHE:
        cache_config.enable_extensible_kv_cache = is_extensible
    # Every worker checks its device's free memory as it starts (vLLM's
    # request_memory in init_device), whatever the model; only the profiled KV
    # budget is skipped when no layer has a KV spec.
    memory = [available_kv_memory(w, table, extensible=is_extensible) for w in workers]
    if not has_kv_cache:
        memory = [0] * len(workers)
    # The engine core turns prefix caching off for non-causal layers.
    if any(getattr(s, "non_causal", False) for one in specs for s in one.values()):
        cache_config.enable_prefix_caching = False
    measured = None
    if (
        is_extensible
        and workers
        and all(w.memory.HasField("measured_kv_cache_bytes") for w in workers)
    ):
        measured = [
            (
                int(w.memory.measured_kv_cache_bytes),
                int(w.memory.allocation_granule_bytes or DEFAULT_ALLOCATION_GRANULE_BYTES),
            )
            for w in workers
        ]
    inputs = VllmInputs(config, specs, memory, [w.rank for w in workers], encoder_only, measured)
    inputs.supported_layouts = [
        [
            plan_pb2.KVCacheLayout.Name(x).removeprefix("KV_CACHE_LAYOUT_")
            for x in w.supported_layouts
        ]
        for w in workers
    ]
    inputs.requested_layout = layout_name if o.HasField("layout") else None
    if hisparse:
        inputs.hisparse_shared_host_pool = o.hisparse.shared_host_pool
        inputs.host_page_bytes = o.hisparse.host_page_size_bytes or 4096
    return inputs


# --- normalised output ---------------------------------------------------------------


def _spec_class(spec: KVCacheSpec) -> tuple[str, bool]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return type(spec.first_spec).__name__, True
    return type(spec).__name__, False


def _group_dict(group: KVCacheGroupSpec) -> Json:
    spec_class, uniform_type = _spec_class(group.kv_cache_spec)
    return {
        "layers": list(group.layer_names),
        "spec": spec_class,
        "uniform_type": uniform_type,
        "block_size": int(group.kv_cache_spec.block_size),
        "page_size_bytes": int(group.kv_cache_spec.page_size_bytes),
        "is_draft": bool(group.is_eagle_group),
    }


def _block_bytes_and_needed(config: Any, groups: list[KVCacheGroupSpec]) -> tuple[int, int]:
    """(pool bytes per block, bytes one max_model_len request needs) for a worker."""
    if _planning is None:
        return (
            int(kv_cache_utils._pool_bytes_per_block(config, groups)),
            int(kv_cache_utils._max_memory_usage_bytes_from_groups(config, groups)),
        )
    builder = get_kv_cache_config_builder(config)
    return (
        int(_planning._pool_bytes_per_block_from_builder(builder, config, groups)),
        int(_planning._max_memory_usage_bytes_from_groups(builder, config, groups)),
    )


def _plan_groups_and_configs(
    inputs: VllmInputs, result: Json
) -> tuple[list[KVCacheGroupSpec], list[KVCacheConfig]]:
    """The release's own calls, in the engine core's order, with HiSparse's
    platform decision (shared host pool, host page size) taken from the request."""
    from vllm.v1.hisparse import layout as hisparse_layout
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    saved = (
        hisparse_layout.use_shared_hisparse_host_pool,
        SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT,
    )
    shared = inputs.hisparse_shared_host_pool
    hisparse_layout.use_shared_hisparse_host_pool = lambda _config: shared
    SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT = inputs.host_page_bytes
    try:
        return _release_calls(inputs, result)
    finally:
        hisparse_layout.use_shared_hisparse_host_pool, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT = (
            saved
        )


def _release_calls(
    inputs: VllmInputs, result: Json
) -> tuple[list[KVCacheGroupSpec], list[KVCacheConfig]]:
    """`result["stage"]` says how far the calls got (for errors)."""
    cfg = inputs.config
    if _planning is not None:
        result["stage"] = "grouping"
        groups = _planning.get_global_kv_cache_groups(cfg, inputs.specs)
        result["groups"] = [_group_dict(g) for g in groups]
        result["stage"] = "configs"
        configs = _planning.get_kv_cache_configs(cfg, inputs.specs, inputs.available_memory, groups)
        if inputs.measured is not None:
            result["stage"] = "finalize"
            _finalize_extensible(inputs, configs)
        return groups, configs
    # 0.32 groups inside get_kv_cache_configs: observe its one grouping call.
    seen: list[list[KVCacheGroupSpec]] = []
    original = kv_cache_utils.get_kv_cache_groups

    depth = [0]

    def observed(config: Any, specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
        # HiSparse groups the other layers with a nested call: keep the outer one.
        depth[0] += 1
        try:
            groups: list[KVCacheGroupSpec] = original(config, specs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            seen.append(groups)
            result["groups"] = [_group_dict(g) for g in groups]
            result["stage"] = "configs"
        return groups

    result["stage"] = "grouping"
    kv_cache_utils.get_kv_cache_groups = observed
    try:
        configs = kv_cache_utils.get_kv_cache_configs(cfg, inputs.specs, inputs.available_memory)
    finally:
        kv_cache_utils.get_kv_cache_groups = original
    result["groups"] = [_group_dict(g) for g in seen[0]]
    return seen[0], configs


def _worker_dict(
    rank: int, config: KVCacheConfig, inputs: VllmInputs, encoder_only: list[str]
) -> Json:
    groups = config.kv_cache_groups
    if groups:
        bpb, needed = _block_bytes_and_needed(inputs.config, groups)
    else:
        bpb = needed = 0
    return {
        "rank": rank,
        "num_blocks": int(config.num_blocks),
        "hisparse_host_num_blocks": int(getattr(config, "hisparse_host_num_blocks", None) or 0),
        "bytes_per_block": bpb,
        "needed_per_request_bytes": needed,
        "kv_tp_replicas": int(config.kv_tp_replicas),
        "needs_kv_cache_zeroing": bool(config.needs_kv_cache_zeroing),
        "encoder_only_layers": encoder_only,
        "tensors": [
            {
                "size": int(t.size),
                "layers": list(t.layers),
                "offset": int(t.offset),
                "layer_stride": int(t.layer_stride),
                "block_stride": int(t.block_stride),
                "host_resident": bool(getattr(t, "host_resident", False)),
            }
            for t in config.kv_cache_tensors
        ],
        "groups": [
            {"layers": list(g.layer_names), "is_draft": bool(g.is_eagle_group)} for g in groups
        ],
    }


def _error_dict(exc: BaseException, stage: str) -> Json:
    message = str(exc)
    kind = "memory" if message.startswith(MEMORY_ERROR_PREFIXES) else "other"
    return {"class": type(exc).__name__, "message": message, "kind": kind, "stage": stage}


def _warnings() -> tuple[list[Json], list[list[Any]]]:
    warnings: list[Json] = []
    padding: list[list[Any]] = []
    for level, message in _CAPTURE.records:
        code = classify_warning(message)
        if code is None:
            continue
        if code == "MAX_MODEL_LEN_AUTO_FIT" and level < logging.INFO:
            continue
        warnings.append({"code": code, "message": message})
        if code == "PADDING_LAYERS" and (match := _PADDING_RE.search(message)):
            padding.append([int(match.group(1)), match.group(2)])
    return warnings, padding


def _post_planning(inputs: VllmInputs, configs: list[KVCacheConfig], progress: Json) -> Json:
    """What the engine core derives next: scheduler view, capacity, block sizes."""
    cfg = inputs.config
    scheduler = generate_scheduler_kv_cache_config(configs)
    out: Json = {"capacity": None, "block_sizes": None}
    groups = scheduler.kv_cache_groups
    if groups:
        participating = [
            g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable
        ]
        cfg.cache_config.block_size = min(
            participating or [g.kv_cache_spec.block_size for g in groups]
        )
        tokens, concurrency = get_kv_cache_capacity(cfg, scheduler)
        out["capacity"] = {
            "kv_cache_size_tokens": int(tokens),
            "max_concurrency": float(concurrency),
        }
    progress["stage"] = "block_sizes"
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(scheduler, cfg)
    out["block_sizes"] = {"scheduler": int(scheduler_block), "hash": int(hash_block)}
    progress["stage"] = "scheduler"
    # Scheduler.__init__ asserts this inline before it builds the KV cache manager:
    # groups that replay a bounded window after a prefix hit share one window.
    replay_windows = {
        g.kv_cache_spec.prefix_replay_tokens
        for g in scheduler.kv_cache_groups
        if getattr(g.kv_cache_spec, "prefix_replay_tokens", 0) > 0
    }
    if len(replay_windows) > 1:
        raise AssertionError(f"Prefix replay windows should agree: {sorted(replay_windows)}")
    progress["stage"] = "kv_cache_manager"
    _start_kv_cache_manager(cfg, scheduler, scheduler_block, hash_block)
    return out


def _num_hash_lookahead_tokens(cfg: Any) -> int:
    """VllmConfig's own rule: a property in 0.33, resolved once by a method in 0.34,
    absent in 0.32 (no lookahead hashes)."""
    resolve: Any = getattr(VllmConfig, "_resolve_num_hash_lookahead_tokens", None)
    if resolve is not None:
        return int(resolve(cfg))
    rule = VllmConfig.__dict__.get("num_hash_lookahead_tokens")
    if isinstance(rule, property) and rule.fget is not None:
        return int(rule.fget(cfg))
    return 0


# The manager's block pool holds one Python object per block; its checks do not
# depend on the count, so the pool is started small.
_MANAGER_POOL_BLOCKS = 64

# The arguments of the last KV cache manager started (and its full scheduler view).
MANAGER_ARGUMENTS: Json = {}
# The configuration of the last engine whose KV cache manager started (the
# scheduler probe, conformance/scheduler_probe.py, starts vLLM's scheduler from it).
ENGINE_CONFIG: Json = {}


def _fixed_sink_manager() -> None:
    """vLLM 0.32.0-0.34.0 cannot build its sink-attention manager: every manager is
    given `needs_kv_cache_zeroing`, which SinkFullAttentionManager does not take (a
    TypeError; docs/semantics.md, D10). The check compares kvplan with the engine
    as fixed: the manager drops that argument, so its own sink-length assertion and
    the rest of the start run as they would."""
    from vllm.v1.core import single_type_kv_cache_manager as managers

    manager = managers.SinkFullAttentionManager
    build = manager.__init__
    if "needs_kv_cache_zeroing" in inspect.signature(build).parameters:
        return  # a release that takes it

    def build_without_zeroing(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("needs_kv_cache_zeroing", None)
        build(self, *args, **kwargs)

    manager.__init__ = build_without_zeroing


_fixed_sink_manager()


def _start_kv_cache_manager(
    cfg: VllmConfig, scheduler: KVCacheConfig, scheduler_block: int, hash_block: int
) -> None:
    """Start the KV cache manager with the arguments the engine's scheduler gives
    it: its coordinator and per-group managers refuse block sizes and draft
    lookaheads the engine cannot serve (ValueError, AssertionError)."""
    speculative = cfg.speculative_config
    use_block_drop = speculative is not None and speculative.use_eagle_block_drop()
    hash_lookahead = _num_hash_lookahead_tokens(cfg)
    if hash_lookahead:  # 0.33+: lookahead hashes replace the block drop
        use_block_drop = False
    arguments: Json = {
        "kv_cache_config": replace(
            scheduler, num_blocks=min(scheduler.num_blocks, _MANAGER_POOL_BLOCKS)
        ),
        "max_model_len": cfg.model_config.max_model_len,
        "max_in_flight_tokens": cfg.max_in_flight_tokens,
        "enable_caching": cfg.cache_config.enable_prefix_caching,
        "use_eagle": use_block_drop,
        "num_hash_lookahead_tokens": hash_lookahead,
        "num_prefill_lookahead": cfg.num_prefill_lookahead_tokens,
        "log_stats": False,
        "enable_kv_cache_events": False,
        "dcp_world_size": cfg.parallel_config.decode_context_parallel_size,
        "pcp_world_size": 1,
        "scheduler_block_size": scheduler_block,
        "hash_block_size": hash_block,
        "metrics_collector": None,
        "watermark": cfg.scheduler_config.watermark,
        "enable_mamba_shared_prefix_checkpoint": getattr(
            cfg.cache_config, "enable_mamba_shared_prefix_checkpoint", False
        ),
    }
    accepted = inspect.signature(KVCacheManager).parameters
    kept = {name: value for name, value in arguments.items() if name in accepted}
    KVCacheManager(**kept)
    # The prefix-cache probe (conformance/prefix_probe.py) starts its own manager
    # from the same arguments, with a pool large enough for its requests.
    MANAGER_ARGUMENTS.clear()
    MANAGER_ARGUMENTS.update(kept, scheduler=scheduler)
    ENGINE_CONFIG.clear()
    ENGINE_CONFIG["config"] = cfg


def plan_with_vllm(req: plan_pb2.PlanRequest, table: dict[str, int] | None = None) -> Json:
    """Plan `req` with the installed vLLM release and return the normalised result.

    Keys: ok, error ({class, message, kind: memory|other, stage}), max_model_len,
    num_blocks, groups, workers, capacity, block_sizes, warnings, padding.
    """
    _install_capture()
    _reset_log_once()
    _CAPTURE.records.clear()
    result: Json = {
        "ok": False,
        "error": None,
        "max_model_len": None,
        "num_blocks": None,
        "groups": [],
        "workers": [],
        "capacity": None,
        "block_sizes": None,
        "warnings": [],
        "padding": [],
        "layout": None,
    }
    stage = "inputs"
    try:
        inputs = build_inputs(req, table)
        cfg = inputs.config
        stage = "register"
        register_all_kvcache_specs(cfg)
        stage = "layout"
        # EngineCore._initialize_kv_caches, inline there: a non-causal layer turns
        # prefix caching off before anything is planned.
        if any(
            getattr(spec, "non_causal", False) for specs in inputs.specs for spec in specs.values()
        ):
            cfg.cache_config.enable_prefix_caching = False
        resolve_layout(inputs)
        result["layout"] = cfg.cache_config.kv_cache_layout
        progress: Json = {"stage": "grouping"}
        try:
            _, configs = _plan_groups_and_configs(inputs, progress)
        finally:
            stage = progress["stage"]
            if "groups" in progress:
                result["groups"] = progress["groups"]
        stage = "post"
        result["max_model_len"] = int(cfg.model_config.max_model_len)
        result["num_blocks"] = int(configs[0].num_blocks) if configs else None
        result["workers"] = [
            _worker_dict(rank, config, inputs, enc)
            for rank, config, enc in zip(inputs.ranks, configs, inputs.encoder_only, strict=True)
        ]
        progress = {"stage": "post"}
        try:
            result.update(_post_planning(inputs, configs, progress))
        finally:
            stage = progress["stage"]
        result["ok"] = True
    except Exception as exc:
        result["error"] = _error_dict(exc, stage)
    result["warnings"], result["padding"] = _warnings()
    return result


__all__ = [
    "MEMORY_ERROR_PREFIXES",
    "PlannerConfig",
    "VllmInputs",
    "build_inputs",
    "build_layer_spec",
    "plan_with_vllm",
    "spec_mapping",
]
