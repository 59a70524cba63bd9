"""Proto <-> domain conversion: the only module that knows both.

`request_from_proto` validates every field (errors name the proto field path)
and applies kvplan's documented defaults (docs/semantics.md);
`plan_to_proto` renders an EnginePlan as a PlanResponse.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvplan.core.cached import cached_value
from kvplan.core.diagnostics import WarningCode
from kvplan.core.dtypes import StorageDtype, storage_dtype_for_cache_dtype
from kvplan.core.errors import FieldViolation, InvalidRequest, PlanningError
from kvplan.core.extensible import DEFAULT_ALLOCATION_GRANULE_BYTES
from kvplan.core.groups import DraftRule, GroupingPath, KVCacheGroup
from kvplan.core.hisparse import DEFAULT_HOST_PAGE_BYTES, HiSparseConfig
from kvplan.core.layout import KVCacheLayout
from kvplan.core.memory import BudgetMode
from kvplan.core.planner import (
    EnginePlan,
    WorkerPlan,
    plan_engine,
    plan_model,
    worker_budgets,
)
from kvplan.core.request import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EAGLE_FAMILY,
    DeviceInfo,
    EngineOptions,
    EngineRequest,
    MemoryRequest,
    NonKVMemory,
    SpecDecode,
    WorkerInput,
    configured_prefix_caching,
)
from kvplan.core.rules import (
    FIELD_EXTENSIBLE_KV_CACHE,
    FIELD_IS_DRAFT,
    FIELD_KV_HEAD_MAJOR_SLOTS,
    FIELD_MEASURED_KV_BYTES,
    FIELD_STATE_ALIGNMENT,
    FIELD_SW_MLA_SPEC_MARKER,
    FIELD_TOPK_BUFFER_WIDTH,
    AsyncDraftCheck,
    RuleSet,
    rule_set_for,
    versions_with_spec_method,
)
from kvplan.core.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    StateShape,
    UniformTypeSpecs,
)
from kvplan.fieldcheck import check_fields
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.model_cache import KnownModel, ModelCache, WorkerModel
from kvplan.v1 import plan_pb2, spec_pb2

GIB = 1 << 30

# Total device memory of known GPUs by name: the catalog in kvplan/gpus.py.

_STORAGE = {
    spec_pb2.DTYPE_FLOAT32: StorageDtype.FLOAT32,
    spec_pb2.DTYPE_FLOAT16: StorageDtype.FLOAT16,
    spec_pb2.DTYPE_BFLOAT16: StorageDtype.BFLOAT16,
    spec_pb2.DTYPE_UINT8: StorageDtype.UINT8,
    spec_pb2.DTYPE_INT8: StorageDtype.INT8,
    spec_pb2.DTYPE_FLOAT8_E4M3FN: StorageDtype.FLOAT8_E4M3FN,
    spec_pb2.DTYPE_FLOAT8_E5M2: StorageDtype.FLOAT8_E5M2,
}
_STORAGE_TO_PROTO = {value: key for key, value in _STORAGE.items()}
_MLA_FAMILY = ("mla_attention", "sliding_window_mla", "hidden_state_cache")


def _enum_suffix(enum_type: Any, value: int, prefix: str) -> str:
    return str(enum_type.Name(value)).removeprefix(prefix).lower()


def layout_from_proto(value: int) -> KVCacheLayout:
    return KVCacheLayout[_enum_suffix(plan_pb2.KVCacheLayout, value, "KV_CACHE_LAYOUT_").upper()]


def layout_to_proto(layout: KVCacheLayout) -> plan_pb2.KVCacheLayout.ValueType:
    return plan_pb2.KVCacheLayout.Value(f"KV_CACHE_LAYOUT_{layout.name}")


def cache_dtype_name(value: int) -> str:
    return _enum_suffix(spec_pb2.KVCacheDtype, value, "KV_CACHE_DTYPE_")


class _Context:
    """Engine-level values the layer conversion needs."""

    def __init__(
        self, options: plan_pb2.EngineOptions, rules: RuleSet, *, mamba_align_mode: bool
    ) -> None:
        self.rules = rules
        self.block_size = options.block_size or rules.default_block_size
        model_dtype = _STORAGE.get(options.model_dtype, StorageDtype.BFLOAT16)
        self.cache_dtype = storage_dtype_for_cache_dtype(
            cache_dtype_name(options.cache_dtype), model_dtype
        )
        self.align_mode = mamba_align_mode
        self.hisparse = options.HasField("hisparse")
        self.specs_by_bytes: dict[bytes, KVCacheSpec] = {}
        # Tensor-parallel ranks repeat one layer list: convert each distinct list once
        # (keyed by `WorkerBytes.layers_key`).
        self.layer_lists: dict[
            bytes, tuple[tuple[tuple[str, KVCacheSpec], ...], tuple[str, ...]]
        ] = {}
        # Device and memory per distinct setting (keyed by `WorkerBytes.settings_key`).
        self.settings: dict[bytes, tuple[MemoryRequest, DeviceInfo]] = {}
        self.starting_max_model_len = (
            options.derived_max_model_len
            if options.max_model_len == -1 and options.HasField("derived_max_model_len")
            else options.max_model_len
        )


def _positive(value: int, path: str, what: str, violations: list[FieldViolation]) -> None:
    if value <= 0:
        violations.append(FieldViolation(path, f"{what} must be >= 1"))


def _attention_kwargs(
    params: spec_pb2.AttentionParams, path: str, ctx: _Context, mla_family: bool
) -> dict[str, Any]:
    violations: list[FieldViolation] = []
    _positive(params.num_kv_heads, f"{path}.num_kv_heads", "num_kv_heads", violations)
    _positive(params.head_size, f"{path}.head_size", "head_size", violations)
    kwargs: dict[str, Any] = {
        "num_kv_heads": params.num_kv_heads,
        "head_size": params.head_size,
        "dtype": _STORAGE.get(params.dtype, ctx.cache_dtype),
        "kv_quant_mode": int(params.kv_quant_mode),
        "dcp_sharded": params.dcp_sharded if params.HasField("dcp_sharded") else True,
        "kv_head_major_slots": params.kv_head_major_slots,
    }
    if params.kv_quant_mode > ctx.rules.max_kv_quant_mode:
        violations.append(
            FieldViolation(
                f"{path}.kv_quant_mode",
                f"{spec_pb2.KVQuantMode.Name(params.kv_quant_mode)} does not exist in "
                f"{ctx.rules.description}",
            )
        )
    if params.HasField("head_size_v"):
        if mla_family and params.head_size_v != 0:
            violations.append(
                FieldViolation(f"{path}.head_size_v", "MLA layers have no separate V head")
            )
        kwargs["head_size_v"] = params.head_size_v
    elif not mla_family:
        kwargs["head_size_v"] = params.head_size
    for name, field in (
        ("page_size_padded_bytes", "page_size_padded"),
        ("num_head_slots", "num_head_slots"),
        ("state_content_bytes", "state_content_bytes"),
        ("max_tp_shards", "max_tp_shards"),
    ):
        if params.HasField(name):  # type: ignore[arg-type]
            _positive(getattr(params, name), f"{path}.{name}", name, violations)
            kwargs[field] = getattr(params, name)
    which = params.tokens_per_state.WhichOneof("value")
    if which == "tokens":
        _positive(
            params.tokens_per_state.tokens, f"{path}.tokens_per_state.tokens", "tokens", violations
        )
        kwargs["tokens_per_state"] = params.tokens_per_state.tokens
    elif which == "states_per_token":
        count = params.tokens_per_state.states_per_token
        _positive(
            count, f"{path}.tokens_per_state.states_per_token", "states_per_token", violations
        )
        kwargs["tokens_per_state"] = Fraction(1, max(count, 1))
    if violations:
        raise InvalidRequest(
            violations[0].description, field=violations[0].field, violations=violations
        )
    return kwargs


def _mla_kwargs(mla: spec_pb2.MLAParams, path: str, *, sliding_window: bool) -> dict[str, Any]:
    """The MLA parameters of a spec at `path` (its `mla` message's parent). No
    release's sliding-window MLA spec has a top-k index buffer."""
    kwargs: dict[str, Any] = {
        "cache_dtype_str": cache_dtype_name(mla.cache_dtype),
        "model_version": mla.model_version or None,
    }
    if mla.HasField("topk_buffer_width"):
        if sliding_window:
            raise InvalidRequest(
                "sliding-window MLA layers have no top-k index buffer: leave "
                "mla.topk_buffer_width unset",
                field=f"{path}.mla.topk_buffer_width",
            )
        kwargs["topk_buffer_width"] = mla.topk_buffer_width
    if mla.HasField("alignment_bytes"):
        if mla.alignment_bytes <= 0:
            raise InvalidRequest(
                "alignment_bytes must be >= 1", field=f"{path}.mla.alignment_bytes"
            )
        kwargs["alignment"] = mla.alignment_bytes
    return kwargs


def _require(value: int, path: str, what: str) -> int:
    if value <= 0:
        raise InvalidRequest(f"{what} must be >= 1", field=path)
    return value


def _window_kwargs(message: Any, path: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name in ("sliding_window", "attention_chunk_size"):
        if message.HasField(name):
            kwargs[name] = _require(getattr(message, name), f"{path}.{name}", name)
    return kwargs


def _hisparse_layer_from_proto(
    kind: str, body: Any, path: str, ctx: _Context, *, is_draft: bool
) -> KVCacheSpec:
    """A HiSparse hot / resident entry the model runner derived for a sparse-MLA layer.
    Planning lays these out again from the MLA layers; only names must match, and
    `is_draft`, which the draft annotation reads off every layer's spec as vLLM's
    does (the group holding a drafter's entry takes the block drop)."""
    body_path = f"{path}.{kind}"
    if not ctx.hisparse:
        raise InvalidRequest(
            f"{kind} layers exist only with HiSparse on (options.hisparse)", field=body_path
        )
    page = _require(body.page_size_bytes, f"{body_path}.page_size_bytes", "page_size_bytes")
    if kind == "hisparse_hot":
        blocks = _require(
            body.blocks_per_request, f"{body_path}.blocks_per_request", "blocks_per_request"
        )
        return HiSparseHotSpec(
            block_size=ctx.block_size,
            page_size=page,
            blocks_per_request=blocks,
            is_draft=is_draft,
        )
    return HiSparseResidentSpec(block_size=ctx.block_size, page_size=page, is_draft=is_draft)


MAX_HOST_POOL_GIB = float(1 << 20)  # 1 PiB of host memory: beyond any machine


def _hisparse_from_proto(options: plan_pb2.EngineOptions) -> HiSparseConfig | None:
    if not options.HasField("hisparse"):
        return None
    config = options.hisparse
    if not config.host_pool_gib > 0:
        raise InvalidRequest(
            "HiSparse needs a host pool: host_pool_gib must be > 0",
            field="options.hisparse.host_pool_gib",
        )
    # Its bytes must be a number the plan can carry (inf and 1e300 are not).
    if not config.host_pool_gib <= MAX_HOST_POOL_GIB:
        raise InvalidRequest(
            f"host_pool_gib {config.host_pool_gib} is over {MAX_HOST_POOL_GIB} GiB (1 PiB)",
            field="options.hisparse.host_pool_gib",
        )
    device_buffer_size: int | None = None
    if config.HasField("device_buffer_size"):
        device_buffer_size = _require(
            config.device_buffer_size,
            "options.hisparse.device_buffer_size",
            "device_buffer_size",
        )
    index_topk: int | None = None
    if config.HasField("index_topk"):
        index_topk = _require(config.index_topk, "options.hisparse.index_topk", "index_topk")
    return HiSparseConfig(
        host_pool_gib=config.host_pool_gib,
        device_buffer_size=device_buffer_size,
        shared_host_pool=config.shared_host_pool,
        index_topk=index_topk,
        host_page_bytes=config.host_page_size_bytes or DEFAULT_HOST_PAGE_BYTES,
    )


def _release_fields_set(layer: spec_pb2.LayerSpec, kind: str, body: Any) -> list[tuple[str, str]]:
    """(rule-set field name, path suffix) of the release-specific fields `layer` sets."""
    found: list[tuple[str, str]] = []
    if layer.is_draft:
        found.append((FIELD_IS_DRAFT, "is_draft"))
    if kind in ("mla_attention", "hidden_state_cache") and body.mla.HasField("topk_buffer_width"):
        found.append((FIELD_TOPK_BUFFER_WIDTH, f"{kind}.mla.topk_buffer_width"))
    if kind not in ("mamba", "hisparse_hot", "hisparse_resident") and (
        body.attention.kv_head_major_slots
    ):
        found.append((FIELD_KV_HEAD_MAJOR_SLOTS, f"{kind}.attention.kv_head_major_slots"))
    if kind == "sliding_window_mla" and body.non_causal_multi_token_decode:
        found.append((FIELD_SW_MLA_SPEC_MARKER, f"{kind}.non_causal_multi_token_decode"))
    if kind == "mamba" and body.HasField("state_alignment_bytes"):
        found.append((FIELD_STATE_ALIGNMENT, f"{kind}.state_alignment_bytes"))
    return found


def layer_from_proto(layer: spec_pb2.LayerSpec, path: str, ctx: _Context) -> KVCacheSpec:
    """One LayerSpec as a domain spec (raises InvalidRequest with field paths)."""
    check_fields(layer, path)
    kind = layer.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("a layer needs a spec kind (full_attention, mamba, ...)", field=path)
    body = getattr(layer, kind)
    body_path = f"{path}.{kind}"
    for name, suffix in _release_fields_set(layer, kind, body):
        if not ctx.rules.has_field(name):
            raise ctx.rules.unsupported_field(name, f"{path}.{suffix}")
    if kind in ("hisparse_hot", "hisparse_resident"):
        return _hisparse_layer_from_proto(kind, body, path, ctx, is_draft=layer.is_draft)
    common: dict[str, Any] = {"is_draft": layer.is_draft}
    alignment = layer.block_stride_alignment.WhichOneof("alignment")
    if alignment == "bytes":
        common["block_stride_alignment"] = _require(
            layer.block_stride_alignment.bytes, f"{path}.block_stride_alignment.bytes", "bytes"
        )
    elif alignment == "multiple_of_kernel_block_tokens":
        tokens = layer.block_stride_alignment.multiple_of_kernel_block_tokens
        common["block_stride_alignment"] = MultipleOf(
            _require(
                tokens, f"{path}.block_stride_alignment.multiple_of_kernel_block_tokens", "tokens"
            )
        )
    if layer.HasField("block_size"):
        common["block_size"] = _require(layer.block_size, f"{path}.block_size", "block_size")
    elif kind == "mamba" and not ctx.align_mode:
        common["block_size"] = max(ctx.starting_max_model_len, 1)
    else:
        common["block_size"] = ctx.block_size

    try:
        if kind == "mamba":
            return _mamba_from_proto(body, body_path, common)
        attention = _attention_kwargs(
            body.attention, f"{body_path}.attention", ctx, kind in _MLA_FAMILY
        )
        kwargs = {**common, **attention}
        tokens_per_state = attention.get("tokens_per_state", 1)
        if tokens_per_state > common["block_size"]:
            # A block must hold at least one state, or its page is 0 bytes.
            raise InvalidRequest(
                f"tokens_per_state ({tokens_per_state}) exceeds the layer's block_size "
                f"({common['block_size']}): a block would hold no state; raise block_size "
                "to a multiple of tokens_per_state",
                field=f"{body_path}.attention.tokens_per_state.tokens",
            )
        if kind == "full_attention":
            return FullAttentionSpec(
                **kwargs, **_window_kwargs(body, body_path), non_causal=body.non_causal
            )
        if kind == "sink_full_attention":
            return SinkFullAttentionSpec(
                **kwargs,
                **_window_kwargs(body, body_path),
                non_causal=body.non_causal,
                sink_len=body.sink_len,
            )
        if kind == "rswa":
            window = _require(body.rswa_window, f"{body_path}.rswa_window", "rswa_window")
            return RSWASpec(**kwargs, rswa_window=window)
        if kind == "mla_attention":
            return MLAAttentionSpec(
                **kwargs,
                **_mla_kwargs(body.mla, body_path, sliding_window=False),
                cache_role=SparseCacheRole.INDEXER
                if body.cache_role == spec_pb2.SPARSE_CACHE_ROLE_INDEXER
                else SparseCacheRole.SPARSE,
                is_index_group_leader=body.is_index_group_leader,
                non_causal_multi_token_decode=body.non_causal_multi_token_decode,
            )
        if kind == "hidden_state_cache":
            return HiddenStateCacheSpec(
                **kwargs, **_mla_kwargs(body.mla, body_path, sliding_window=False)
            )
        if kind == "sliding_window":
            window = _require(body.sliding_window, f"{body_path}.sliding_window", "sliding_window")
            return SlidingWindowSpec(**kwargs, sliding_window=window)
        if kind == "sliding_window_mla":
            window = _require(body.sliding_window, f"{body_path}.sliding_window", "sliding_window")
            return SlidingWindowMLASpec(
                **kwargs,
                **_mla_kwargs(body.mla, body_path, sliding_window=True),
                sliding_window=window,
                bounded_replay=body.bounded_replay,
                non_causal_multi_token_decode=body.non_causal_multi_token_decode,
            )
        if kind == "chunked_local_attention":
            chunk = _require(
                body.attention_chunk_size,
                f"{body_path}.attention_chunk_size",
                "attention_chunk_size",
            )
            return ChunkedLocalAttentionSpec(**kwargs, attention_chunk_size=chunk)
        if kind == "cross_attention":
            return CrossAttentionSpec(**kwargs)
        if kind == "encoder_only_attention":
            return EncoderOnlyAttentionSpec(**kwargs)
        if kind == "circular_buffer":
            return CircularBufferSpec(**kwargs)
    except InvalidRequest as error:
        # Errors raised while building the spec name the field they concern.
        field = error.field
        if not field.startswith(path):
            field = f"{body_path}.{field}" if field else body_path
        raise InvalidRequest(error.message, field=field) from error
    raise InvalidRequest(f"unsupported layer kind {kind!r}", field=path)


def _mamba_from_proto(body: spec_pb2.MambaSpec, path: str, common: dict[str, Any]) -> MambaSpec:
    if not body.states:
        raise InvalidRequest(
            "a Mamba layer needs at least one state tensor", field=f"{path}.states"
        )
    states = []
    for index, state in enumerate(body.states):
        state_path = f"{path}.states[{index}]"
        if state.dtype not in _STORAGE:
            raise InvalidRequest(
                "a state tensor needs an explicit dtype", field=f"{state_path}.dtype"
            )
        if not state.shape or any(size <= 0 for size in state.shape):
            raise InvalidRequest(
                "a state tensor shape needs positive dimensions", field=f"{state_path}.shape"
            )
        states.append(StateShape(tuple(state.shape), _STORAGE[state.dtype]))
    kwargs: dict[str, Any] = {
        **common,
        "states": tuple(states),
        "mamba_type": _enum_suffix(spec_pb2.MambaType, body.mamba_type, "MAMBA_TYPE_").upper(),
        "num_speculative_blocks": body.num_speculative_blocks,
        "num_prefill_checkpoint_blocks": body.num_prefill_checkpoint_blocks,
        "num_state_heads": body.num_heads or 1,
        "tp_replicated": body.tp_replicated,
    }
    if body.HasField("page_size_padded_bytes"):
        kwargs["page_size_padded"] = _require(
            body.page_size_padded_bytes, f"{path}.page_size_padded_bytes", "page_size_padded_bytes"
        )
    if body.HasField("prefill_checkpoint_alignment"):
        kwargs["prefill_checkpoint_alignment"] = body.prefill_checkpoint_alignment
    if body.HasField("state_alignment_bytes"):
        kwargs["state_alignment"] = _require(
            body.state_alignment_bytes, f"{path}.state_alignment_bytes", "state_alignment_bytes"
        )
    try:
        return MambaSpec(**kwargs)
    except InvalidRequest as error:
        raise InvalidRequest(error.message, field=f"{path}.page_size_padded_bytes") from error


def _target_kinds(message: plan_pb2.PlanRequest, encoded: Sequence[WorkerBytes]) -> set[str | None]:
    """The spec kinds of the target model's layers (`is_draft` ones do not count),
    which vLLM's configuration reads to settle engine options."""
    kinds: set[str | None] = set()
    seen: set[bytes] = set()
    for worker, worker_bytes in zip(message.workers, encoded, strict=True):
        if worker_bytes.layers_key not in seen:  # tensor-parallel ranks repeat one list
            seen.add(worker_bytes.layers_key)
            kinds.update(layer.WhichOneof("kind") for layer in worker.layers if not layer.is_draft)
    return kinds


def _prefix_caching(message: plan_pb2.PlanRequest, kinds: set[str | None]) -> bool:
    """Prefix caching as vLLM's configuration settles it for this request."""
    options = message.options
    return configured_prefix_caching(
        options.enable_prefix_caching if options.HasField("enable_prefix_caching") else None,
        decoder_attention=bool(kinds - {"mamba", "cross_attention", "encoder_only_attention"}),
        mamba="mamba" in kinds,
        cross_attention="cross_attention" in kinds,
        rswa="rswa" in kinds,
    )


def _options_from_proto(
    options: plan_pb2.EngineOptions,
    prefix_caching: bool,
    rules: RuleSet,
    *,
    extensible_kv_cache: bool,
) -> EngineOptions:
    """`prefix_caching` and `extensible_kv_cache`: settled (`_prefix_caching`,
    `_extensible_kv_cache`); Mamba's cache mode follows prefix caching."""
    max_model_len = options.max_model_len
    if max_model_len == 0 or max_model_len < -1:
        raise InvalidRequest(
            "max_model_len must be a positive number of tokens, or -1 to auto-fit",
            field="options.max_model_len",
        )
    if options.HasField("derived_max_model_len"):
        derived = _require(
            options.derived_max_model_len, "options.derived_max_model_len", "derived_max_model_len"
        )
    elif max_model_len == -1:
        raise InvalidRequest(
            "auto-fit (max_model_len = -1) needs derived_max_model_len, the model's own limit",
            field="options.derived_max_model_len",
        )
    else:
        derived = max_model_len
    # An override of 0 is one too, as in vLLM: a pool of no blocks, which the memory
    # check refuses (RESOURCE_EXHAUSTED) unless no layer needs a KV cache.
    override = (
        options.num_gpu_blocks_override if options.HasField("num_gpu_blocks_override") else None
    )
    batched = options.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    _check_engine_configuration(options, rules)
    parallel = options.parallel
    return EngineOptions(
        max_model_len=max_model_len,
        derived_max_model_len=derived,
        block_size=options.block_size or rules.default_block_size,
        disable_hybrid_kv_cache_manager=options.disable_hybrid_kv_cache_manager,
        num_gpu_blocks_override=override,
        max_num_batched_tokens=batched,
        async_scheduling=options.async_scheduling,
        use_v2_model_runner=options.use_v2_model_runner,
        tensor_parallel_size=parallel.tensor_parallel_size or 1,
        pipeline_parallel_size=parallel.pipeline_parallel_size or 1,
        decode_context_parallel_size=parallel.decode_context_parallel_size or 1,
        layout=layout_from_proto(options.layout) if options.HasField("layout") else None,
        max_num_encoder_input_tokens=options.max_num_encoder_input_tokens or batched,
        enable_prefix_caching=prefix_caching,
        prefix_match_unit=(
            options.prefix_match_unit if options.HasField("prefix_match_unit") else None
        ),
        extensible_kv_cache=extensible_kv_cache,
        hisparse=_hisparse_from_proto(options),
    )


def _check_engine_configuration(options: plan_pb2.EngineOptions, rules: RuleSet) -> None:
    """What vLLM's engine configuration refuses before any worker starts (its
    ParallelConfig and VllmConfig checks; docs/semantics.md, "Engine options")."""
    parallel = options.parallel
    tp = parallel.tensor_parallel_size or 1
    dcp = parallel.decode_context_parallel_size or 1
    # ParallelConfig refuses it in every release (no prefill context parallelism here).
    if tp % dcp:
        raise InvalidRequest(
            f"decode_context_parallel_size {dcp} does not divide tensor_parallel_size "
            f"{tp}: DCP shards the KV cache over the TP ranks",
            field="options.parallel.decode_context_parallel_size",
        )
    if (
        rules.nvfp4_ds_mla_refuses_dcp
        and dcp > 1
        and options.cache_dtype == spec_pb2.KV_CACHE_DTYPE_NVFP4_DS_MLA
    ):
        raise InvalidRequest(
            f"{rules.description} does not run the nvfp4_ds_mla KV cache with decode "
            "context parallelism: choose another cache_dtype or decode_context_parallel_size 1",
            field="options.cache_dtype",
        )
    if options.HasField("hisparse"):
        for size, name in (
            (parallel.pipeline_parallel_size or 1, "pipeline_parallel_size"),
            (dcp, "decode_context_parallel_size"),
        ):
            if size > 1:
                raise InvalidRequest(
                    f"HiSparse does not run with {name} {size} (vLLM refuses the "
                    "engine's configuration)",
                    field=f"options.parallel.{name}",
                )
        if options.disable_hybrid_kv_cache_manager:
            raise InvalidRequest(
                "HiSparse needs the hybrid KV cache manager: "
                "disable_hybrid_kv_cache_manager must be false",
                field="options.disable_hybrid_kv_cache_manager",
            )


def _check_hybrid_manager(
    options: plan_pb2.EngineOptions, spec_decode: SpecDecode, kinds: set[str | None]
) -> None:
    """vLLM (0.32-0.34) turns the hybrid KV cache manager off for a model with chunked
    local attention whose drafter reads its hidden states (the EAGLE family: vLLM's
    use_eagle(), and 0.34's uses_target_hidden_states for the same methods), and
    refuses an engine that asks for it on: no such engine runs with the manager on.
    `kinds`: the target's layer kinds (`_target_kinds`)."""
    if options.disable_hybrid_kv_cache_manager or not spec_decode.uses_eagle:
        return
    if "chunked_local_attention" in kinds:
        raise InvalidRequest(
            "vLLM runs chunked local attention with a drafter that reads the target's "
            f"hidden states ({spec_decode.method}) only with the hybrid KV cache manager "
            "off: set disable_hybrid_kv_cache_manager",
            field="options.disable_hybrid_kv_cache_manager",
        )


# Drafters async scheduling overlaps: the EAGLE family, the draft model and vLLM's
# GPU n-gram, which the vLLM plugin sends as ngram too (so ngram is not refused).
_ASYNC_DRAFTERS = EAGLE_FAMILY | {"draft_model", "ngram"}
# The target model type whose checkpoints carry DSpark stages, not MTP modules.
_DSPARK_ONLY_TARGET = "deepseek_v41"


def _check_spec_decode(
    spec_decode: SpecDecode, options: EngineOptions, rules: RuleSet, *, nextn_given: bool
) -> None:
    """What vLLM's SpeculativeConfig and VllmConfig refuse of the speculative settings
    before any worker starts (docs/semantics.md, "Engine options"). `nextn_given`:
    whether the request set num_nextn_predict_layers (unset, vLLM reads no module
    count and checks none)."""
    method = spec_decode.method
    if method == "none":
        return
    tokens = spec_decode.num_speculative_tokens
    if tokens < 1:
        raise InvalidRequest(
            f"speculative method {method!r} drafts at least one token: set "
            "num_speculative_tokens to 1 or more (or the method to NONE)",
            field="spec_decode.num_speculative_tokens",
        )
    if method == "mtp":
        if spec_decode.target_model_type == _DSPARK_ONLY_TARGET:
            raise InvalidRequest(
                f"a {_DSPARK_ONLY_TARGET} target has no MTP drafter (its checkpoints carry "
                "DSpark stages): use method DSPARK",
                field="spec_decode.method",
            )
        modules = spec_decode.num_nextn_predict_layers
        if nextn_given and modules < 1:
            raise InvalidRequest(
                "an MTP drafter has at least one module: set num_nextn_predict_layers "
                "to 1 or more, or leave it unset",
                field="spec_decode.num_nextn_predict_layers",
            )
        if nextn_given and tokens > modules and tokens % modules:
            raise InvalidRequest(
                f"num_speculative_tokens {tokens} is more than the drafter's {modules} MTP "
                f"modules and not a multiple of them (the modules are reused in whole "
                f"rounds): use at most {modules}, or a multiple of {modules}",
                field="spec_decode.num_speculative_tokens",
            )
    slots = spec_decode.batch_slots_for_drafting(rules)
    if options.max_num_batched_tokens <= slots:
        raise InvalidRequest(
            f"max_num_batched_tokens {options.max_num_batched_tokens} leaves no token to "
            f"schedule: the {method} drafter takes {slots} of each step's tokens per "
            f"request in {rules.description}; raise it above {slots} or lower "
            "num_speculative_tokens",
            field="options.max_num_batched_tokens",
        )
    if options.async_scheduling and method not in _ASYNC_DRAFTERS:
        v2_runner = options.use_v2_model_runner or options.hisparse is not None
        check = rules.async_draft_check
        if check is AsyncDraftCheck.ANY_RUNNER or (
            check is AsyncDraftCheck.V1_RUNNER and not v2_runner
        ):
            runner = " on the V1 model runner" if check is AsyncDraftCheck.V1_RUNNER else ""
            raise InvalidRequest(
                f"{rules.description} does not run async scheduling with the {method} "
                f"drafter{runner}: turn async_scheduling off"
                + (" or use the V2 model runner" if runner else ""),
                field="options.async_scheduling",
            )


def _spec_decode_from_proto(config: plan_pb2.SpecDecodeConfig) -> SpecDecode:
    return SpecDecode(
        method=_enum_suffix(plan_pb2.SpecDecodeMethod, config.method, "SPEC_DECODE_METHOD_"),
        num_speculative_tokens=config.num_speculative_tokens,
        target_model_type=config.target_model_type,
        disable_eagle_block_drop=config.disable_eagle_block_drop,
        num_nextn_predict_layers=(
            config.num_nextn_predict_layers if config.HasField("num_nextn_predict_layers") else 1
        ),
    )


def _settings_from_proto(
    worker: plan_pb2.WorkerSpec, path: str, table: Mapping[str, int], by_name: Mapping[str, int]
) -> tuple[MemoryRequest, DeviceInfo]:
    """The worker's memory request and device."""
    memory = worker.memory
    which = memory.WhichOneof("budget")
    utilization: float | None = None
    explicit: int | None = None
    free_fraction: float | None = None
    if which in ("gpu_memory_utilization", "free_memory_fraction"):
        fraction = getattr(memory, which)
        if not 0.0 < fraction <= 1.0:
            raise InvalidRequest(
                f"{which} must be in (0, 1], got {fraction}", field=f"{path}.memory.{which}"
            )
        if which == "gpu_memory_utilization":
            utilization = fraction
        else:
            free_fraction = fraction
    elif which == "kv_cache_memory_bytes":
        explicit = memory.kv_cache_memory_bytes
    device = worker.device
    total: int | None = device.total_memory_bytes or None
    if total is None and device.name:
        total = by_name.get(device.name.lower())
        if total is None and explicit is None and free_fraction is None:
            raise InvalidRequest(
                f"unknown device name {device.name!r}; known: {', '.join(sorted(table))} "
                "(or set device.total_memory_bytes)",
                field=f"{path}.device.name",
            )
    non_kv = memory.non_kv
    return (
        MemoryRequest(
            gpu_memory_utilization=utilization,
            kv_cache_memory_bytes=explicit,
            free_memory_fraction=free_fraction,
            non_kv=NonKVMemory(
                weights_bytes=non_kv.weights_bytes,
                activation_peak_bytes=non_kv.activation_peak_bytes,
                non_torch_bytes=non_kv.non_torch_bytes,
                cuda_graph_bytes=non_kv.cuda_graph_bytes,
            ),
            device_bytes_in_use=memory.device_bytes_in_use,
            measured_kv_cache_bytes=(
                memory.measured_kv_cache_bytes
                if memory.HasField("measured_kv_cache_bytes")
                else None
            ),
            allocation_granule_bytes=(
                memory.allocation_granule_bytes or DEFAULT_ALLOCATION_GRANULE_BYTES
            ),
        ),
        DeviceInfo(
            uuid=device.uuid,
            name=device.name,
            total_memory_bytes=total,
            free_memory_bytes=(
                device.free_memory_bytes if device.HasField("free_memory_bytes") else None
            ),
        ),
    )


def _worker_from_proto(
    worker: plan_pb2.WorkerSpec,
    encoded: WorkerBytes,
    index: int,
    ctx: _Context,
    table: Mapping[str, int],
    by_name: Mapping[str, int],
    known: WorkerModel | None = None,
) -> WorkerInput:
    """`known`: this worker's model side, converted from an earlier request with the
    same model key (its layers are not read again)."""
    path = f"workers[{index}]"
    # Workers with the same device and memory settings (as sent) share their values;
    # the first of them was checked.
    settings = ctx.settings.get(encoded.settings_key)
    if settings is None:
        settings = ctx.settings[encoded.settings_key] = _settings_from_proto(
            worker, path, table, by_name
        )
    memory, device = settings
    if known is not None:
        return WorkerInput(
            rank=worker.rank,
            layers=known.layers,
            memory=memory,
            device=device,
            encoder_only_layers=known.encoder_only_layers,
            supported_layouts=known.supported_layouts,
        )
    layers, encoder_only = _layers_from_proto(worker, encoded, path, ctx)
    return WorkerInput(
        rank=worker.rank,
        layers=layers,
        memory=memory,
        device=device,
        encoder_only_layers=encoder_only,
        supported_layouts=tuple(layout_from_proto(value) for value in worker.supported_layouts),
    )


def encode_varint(value: int) -> bytes:
    """Protobuf's base-128 varint (field lengths of hand-framed wire bytes)."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The base-128 varint at `pos`: (value, position after it)."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _skip_value(data: bytes, pos: int, wire_type: int) -> int:
    """The position after the value of a field of `wire_type` that starts at `pos`."""
    if wire_type == 0:
        return _read_varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        length, pos = _read_varint(data, pos)
        return pos + length
    if wire_type == 5:
        return pos + 4
    if wire_type == 3:  # a group (kept only as an unknown field): up to its end tag
        while True:
            tag, pos = _read_varint(data, pos)
            if tag & 7 == 4:
                return pos
            pos = _skip_value(data, pos, tag & 7)
    raise ValueError(f"protobuf wire type {wire_type} out of place")


def _wire_fields(data: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, field start, value start, field end) of each top-level field of
    the message serialized in data[pos:end] (protobuf's own, well-formed bytes); the
    value of a length-delimited field starts after its length."""
    while pos < end:
        start = pos
        tag, pos = _read_varint(data, pos)
        if tag & 7 == 2:
            length, value = _read_varint(data, pos)
            pos = value + length
        else:
            value = pos
            pos = _skip_value(data, pos, tag & 7)
        yield tag >> 3, start, value, pos


_RANK = plan_pb2.WorkerSpec.RANK_FIELD_NUMBER
_DEVICE = plan_pb2.WorkerSpec.DEVICE_FIELD_NUMBER
_MEMORY = plan_pb2.WorkerSpec.MEMORY_FIELD_NUMBER
_LAYERS = plan_pb2.WorkerSpec.LAYERS_FIELD_NUMBER
# Tags of length-delimited fields (one byte each).
_LAYERS_TAG = _LAYERS << 3 | 2
_RANK_TAG = bytes([_RANK << 3])  # a varint
_DEVICE_TAG = bytes([_DEVICE << 3 | 2])
_MEMORY_TAG = bytes([_MEMORY << 3 | 2])
_NAME_TAG = spec_pb2.LayerSpec.NAME_FIELD_NUMBER << 3 | 2


class WorkerBytes:
    """One worker's deterministic serialization, made once per request: the plan id
    hashes it and the converter reads the worker's identity from it, so that no
    worker or layer is serialized again (8 workers x 65 layers: plan id and
    conversion 510 µs with serializations per worker and per layer, 355 µs so).

    Protobuf writes known fields in field-number order: rank, device and memory
    (the worker's settings) come first, then the layers. `layers_key` is what
    follows the settings: equal keys, equal layer lists. Were the order ever
    different, a key would merely hold more than the layers: still exact, less shared.
    """

    def __init__(self, worker: plan_pb2.WorkerSpec) -> None:
        self._worker = worker

    @cached_value
    def data(self) -> bytes:
        # On first use: a caller that finds the plan by the request's digest never
        # needs the workers' bytes.
        return self._worker.SerializeToString(deterministic=True)

    @cached_value
    def _settings(self) -> tuple[bytes, int]:
        """(device and memory fields as sent, where the fields after them start):
        rank, device and memory are written first, in that order, each at most once
        (read by their one-byte tags: 8 workers 17 -> 6 µs)."""
        data = self.data
        pos = _read_varint(data, 1)[1] if data[:1] == _RANK_TAG else 0
        start = pos
        for tag in (_DEVICE_TAG, _MEMORY_TAG):
            if data[pos : pos + 1] == tag:
                length, value = _read_varint(data, pos + 1)
                pos = value + length
        return data[start:pos], pos

    @property
    def settings_key(self) -> bytes:
        """Equal for workers with equal device and memory settings (tensor-parallel
        ranks often differ in rank alone)."""
        return self._settings[0]

    @property
    def layers_start(self) -> int:
        return self._settings[1]

    @cached_value
    def layers_key(self) -> bytes:
        return self.data[self.layers_start :]

    @cached_value
    def layer_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each layer's serialization, in order. A layer's tag is one
        byte and its length mostly one: read inline, with no call per layer (64
        layers: 19 -> 6 µs); other fields are stepped over by `_wire_fields`."""
        data, pos, end = self.data, self.layers_start, len(self.data)
        spans: list[tuple[int, int]] = []
        while pos < end:
            if data[pos] == _LAYERS_TAG:
                length, start = data[pos + 1], pos + 2
                if length > 0x7F:
                    length, start = _read_varint(data, pos + 1)
                pos = start + length
                spans.append((start, pos))
                continue
            number, _, payload, pos = next(_wire_fields(data, pos, end))
            if number == _LAYERS:
                spans.append((payload, pos))
        return spans


def encode_workers(message: plan_pb2.PlanRequest) -> list[WorkerBytes]:
    return [WorkerBytes(worker) for worker in message.workers]


def encoded_now(message: plan_pb2.PlanRequest) -> list[WorkerBytes]:
    """`encode_workers(message)` with what each worker's bytes give made now rather
    than on first use (for a large request, in a worker thread): its layer list and
    that list's hash, and the layers' spans of each distinct list (the limit check
    and the conversion read them of the first worker with the list only)."""
    encoded = encode_workers(message)
    lists: set[bytes] = set()
    for worker in encoded:
        if worker.layers_key not in lists:
            lists.add(worker.layers_key)
            _ = worker.layer_spans
    return encoded


def _layers_from_proto(
    worker: plan_pb2.WorkerSpec, encoded: WorkerBytes, path: str, ctx: _Context
) -> tuple[tuple[tuple[str, KVCacheSpec], ...], tuple[str, ...]]:
    """(name, spec) of the layers that need KV cache, and the encoder-only names.
    A list identical to an earlier worker's was validated there (errors name the
    first worker that has it) and is reused."""
    key = encoded.layers_key
    cached = ctx.layer_lists.get(key)
    if cached is not None:
        return cached
    data = encoded.data
    layers: list[tuple[str, KVCacheSpec]] = []
    encoder_only: list[str] = []
    specs_by_bytes = ctx.specs_by_bytes
    for layer_index, (start, end) in enumerate(encoded.layer_spans):
        # A layer's bytes without its name (field 1, written first) identify its
        # spec: layers that differ only by name share one converted value.
        spec_key: bytes | None = None
        if start < end and data[start] == _NAME_TAG:
            size, name_start = data[start + 1], start + 2
            if size > 0x7F:
                size, name_start = _read_varint(data, start + 1)
            name = data[name_start : name_start + size].decode()
            spec_key = data[name_start + size : end]
        else:
            name = worker.layers[layer_index].name
        if not name:
            raise InvalidRequest("a layer needs a name", field=f"{path}.layers[{layer_index}].name")
        spec = specs_by_bytes.get(spec_key) if spec_key is not None else None
        if spec is None:
            layer = worker.layers[layer_index]
            spec = layer_from_proto(layer, f"{path}.layers[{layer_index}]", ctx)
            if spec_key is not None:
                specs_by_bytes[spec_key] = spec
        if isinstance(spec, EncoderOnlyAttentionSpec):
            # Encoder-only layers need no KV cache and never enter planning.
            encoder_only.append(name)
        else:
            layers.append((name, spec))
    result = (tuple(layers), tuple(encoder_only))
    ctx.layer_lists[key] = result
    return result


def _extensible_kv_cache(message: plan_pb2.PlanRequest, rules: RuleSet) -> bool:
    """The extensible KV cache as vLLM 0.34 settles it before planning: sized from
    measured memory, it cannot run with a block override. Unset, it is off then;
    asked for, the engine is refused. (vLLM's kv_cache_memory_bytes turns it off
    too, but a worker's KV bytes here may be the budget an engine measured, as the
    vLLM plugin sends it with the engine's settled value.)"""
    options = message.options
    if options.HasField("extensible_kv_cache"):
        if options.extensible_kv_cache and options.HasField("num_gpu_blocks_override"):
            raise InvalidRequest(
                "the extensible KV cache is sized from measured memory, which "
                "options.num_gpu_blocks_override overrides (vLLM refuses the engine): "
                "drop options.extensible_kv_cache or the override",
                field="options.extensible_kv_cache",
            )
        return options.extensible_kv_cache
    return rules.extensible_kv_cache and not options.HasField("num_gpu_blocks_override")


def _check_release_request_fields(message: plan_pb2.PlanRequest, rules: RuleSet) -> bool:
    """Engine- and worker-level fields only some releases have; measured KV bytes
    belong to an extensible cache and are given by every worker or none. Returns
    whether the extensible cache is on (settled)."""
    options = message.options
    method = (
        _enum_suffix(plan_pb2.SpecDecodeMethod, message.spec_decode.method, "SPEC_DECODE_METHOD_")
        if rules.unsupported_spec_methods
        else ""
    )
    if method in rules.unsupported_spec_methods:
        raise InvalidRequest(
            f"speculative method {method!r} does not exist in {rules.description}; choose "
            f"another method, or an engine_version that has it "
            f"({', '.join(repr(v) for v in versions_with_spec_method(method))})",
            field="spec_decode.method",
        )
    if options.HasField("extensible_kv_cache") and not rules.has_field(FIELD_EXTENSIBLE_KV_CACHE):
        raise rules.unsupported_field(FIELD_EXTENSIBLE_KV_CACHE, "options.extensible_kv_cache")
    extensible = _extensible_kv_cache(message, rules)
    measured = [w.memory.HasField("measured_kv_cache_bytes") for w in message.workers]
    for index, worker in enumerate(message.workers):
        memory = worker.memory
        for name in ("measured_kv_cache_bytes", "allocation_granule_bytes"):
            if not memory.HasField(name):
                continue
            path = f"workers[{index}].memory.{name}"
            if not rules.has_field(FIELD_MEASURED_KV_BYTES):
                raise rules.unsupported_field(FIELD_MEASURED_KV_BYTES, path)
            if not extensible:
                raise InvalidRequest(
                    f"{name} applies to the extensible KV cache, which is off for this "
                    "request (options.extensible_kv_cache false, or a block override)",
                    field=path,
                )
        if memory.HasField("allocation_granule_bytes"):
            _require(
                memory.allocation_granule_bytes,
                f"workers[{index}].memory.allocation_granule_bytes",
                "allocation_granule_bytes",
            )
    if any(measured) and not all(measured):
        index = measured.index(False)
        raise InvalidRequest(
            "the final extensible plan needs measured_kv_cache_bytes from every worker "
            "(or from none, for the reservation)",
            field=f"workers[{index}].memory.measured_kv_cache_bytes",
        )
    return extensible


def _lowered(table: Mapping[str, int]) -> dict[str, int]:
    return {name.lower(): size for name, size in table.items()}


_GPU_BY_NAME = _lowered(GPU_MEMORY_BYTES)
_LAYERS_SKIPPED = frozenset({"layers"})
_SETTINGS_SKIPPED = frozenset({"layers", "device", "memory"})


def request_from_proto(
    message: plan_pb2.PlanRequest,
    *,
    gpu_memory_table: Mapping[str, int] | None = None,
    encoded_workers: Sequence[WorkerBytes] | None = None,
    known_model: KnownModel | None = None,
) -> EngineRequest:
    """`encoded_workers`: the request's `encode_workers`, when the caller has them.
    `known_model`: the model side of an earlier request with this one's model key
    (`PlanKeys.model`); options, spec decode and layers are then taken from it, as
    converting the same bytes again would give them, and only the workers' device and
    memory settings are converted and checked."""
    encoded = encode_workers(message) if encoded_workers is None else encoded_workers
    # Enums and integer ranges first; layers are checked once per distinct spec, and
    # device and memory settings once per distinct setting.
    if known_model is None:
        check_fields(message.options, "options")
        check_fields(message.spec_decode, "spec_decode")
    checked_settings: set[bytes] = set()
    for index, (worker, worker_bytes) in enumerate(zip(message.workers, encoded, strict=True)):
        if len(worker.supported_layouts) > len(KVCacheLayout):
            # Bounded before any walk: a list longer than the enum repeats a layout.
            raise InvalidRequest(
                f"supported_layouts lists {len(worker.supported_layouts)} layouts; there "
                f"are {len(KVCacheLayout)}, each listed at most once",
                field=f"workers[{index}].supported_layouts",
            )
        seen = worker_bytes.settings_key in checked_settings
        check_fields(
            worker, f"workers[{index}]", skip=_SETTINGS_SKIPPED if seen else _LAYERS_SKIPPED
        )
        checked_settings.add(worker_bytes.settings_key)
    rules = (
        rule_set_for(message.options.engine_version) if known_model is None else known_model.rules
    )
    extensible_kv_cache = _check_release_request_fields(message, rules)
    known_workers: Sequence[WorkerModel | None]
    if known_model is None:
        kinds = _target_kinds(message, encoded)
        options = _options_from_proto(
            message.options,
            _prefix_caching(message, kinds),
            rules,
            extensible_kv_cache=extensible_kv_cache,
        )
        spec_decode = _spec_decode_from_proto(message.spec_decode)
        _check_spec_decode(
            spec_decode,
            options,
            rules,
            nextn_given=message.spec_decode.HasField("num_nextn_predict_layers"),
        )
        _check_hybrid_manager(message.options, spec_decode, kinds)
        known_workers = [None] * len(message.workers)
    else:
        options, spec_decode = known_model.options, known_model.spec_decode
        known_workers = [known_model.worker(worker.rank) for worker in message.workers]
    ctx = _Context(message.options, rules, mamba_align_mode=options.mamba_align_mode)
    table = GPU_MEMORY_BYTES if gpu_memory_table is None else gpu_memory_table
    by_name = _GPU_BY_NAME if gpu_memory_table is None else _lowered(gpu_memory_table)
    return EngineRequest(
        engine_id=message.engine_id,
        options=options,
        workers=tuple(
            _worker_from_proto(worker, worker_bytes, index, ctx, table, by_name, known)
            for index, (worker, worker_bytes, known) in enumerate(
                zip(message.workers, encoded, known_workers, strict=True)
            )
        ),
        spec_decode=spec_decode,
        rules=rules,
    )


# --- domain -> proto -------------------------------------------------------------


def _attention_to_proto(spec: AttentionSpec, params: spec_pb2.AttentionParams) -> None:
    params.num_kv_heads = spec.num_kv_heads
    params.head_size = spec.head_size
    if spec.head_size_v is not None:
        params.head_size_v = spec.head_size_v
    params.dtype = _STORAGE_TO_PROTO[spec.dtype]
    params.kv_quant_mode = spec.kv_quant_mode  # type: ignore[assignment]
    params.dcp_sharded = spec.dcp_sharded
    if spec.page_size_padded is not None:
        params.page_size_padded_bytes = spec.page_size_padded
    if spec.num_head_slots is not None:
        params.num_head_slots = spec.num_head_slots
    if spec.state_content_bytes is not None:
        params.state_content_bytes = spec.state_content_bytes
    if spec.max_tp_shards is not None:
        params.max_tp_shards = spec.max_tp_shards
    params.kv_head_major_slots = spec.kv_head_major_slots
    tokens = spec.tokens_per_state
    if isinstance(tokens, Fraction) and tokens.numerator == 1 and tokens.denominator > 1:
        params.tokens_per_state.states_per_token = tokens.denominator
    elif tokens != 1:
        params.tokens_per_state.tokens = int(tokens)


def _mla_to_proto(spec: MLAAttentionSpec | SlidingWindowMLASpec, mla: spec_pb2.MLAParams) -> None:
    if spec.cache_dtype_str:
        mla.cache_dtype = spec_pb2.KVCacheDtype.Value(
            f"KV_CACHE_DTYPE_{spec.cache_dtype_str.upper()}"
        )
    if isinstance(spec, MLAAttentionSpec) and spec.topk_buffer_width is not None:
        mla.topk_buffer_width = spec.topk_buffer_width
    if spec.alignment is not None:
        mla.alignment_bytes = spec.alignment
    mla.model_version = spec.model_version or ""


def spec_to_proto(spec: KVCacheSpec, name: str = "") -> spec_pb2.LayerSpec:
    """A domain spec as a LayerSpec (inverse of `layer_from_proto`)."""
    out = spec_pb2.LayerSpec(name=name, is_draft=spec.is_draft, block_size=spec.block_size)
    alignment = spec.block_stride_alignment
    if isinstance(alignment, MultipleOf):
        out.block_stride_alignment.multiple_of_kernel_block_tokens = alignment.base
    elif alignment is not None:
        out.block_stride_alignment.bytes = alignment
    if isinstance(spec, HiSparseHotSpec):
        out.hisparse_hot.page_size_bytes = spec.page_size
        out.hisparse_hot.blocks_per_request = spec.blocks_per_request
        return out
    if isinstance(spec, HiSparseResidentSpec):
        out.hisparse_resident.page_size_bytes = spec.page_size
        return out
    if isinstance(spec, MambaSpec):
        body = out.mamba
        for state in spec.states:
            body.states.add(shape=state.shape, dtype=_STORAGE_TO_PROTO[state.dtype])
        if spec.page_size_padded is not None:
            body.page_size_padded_bytes = spec.page_size_padded
        body.mamba_type = spec_pb2.MambaType.Value(f"MAMBA_TYPE_{spec.mamba_type}")
        body.num_speculative_blocks = spec.num_speculative_blocks
        body.num_prefill_checkpoint_blocks = spec.num_prefill_checkpoint_blocks
        if spec.prefill_checkpoint_alignment is not None:
            body.prefill_checkpoint_alignment = spec.prefill_checkpoint_alignment
        body.num_heads = spec.num_state_heads
        body.tp_replicated = spec.tp_replicated
        if spec.state_alignment != 1:
            body.state_alignment_bytes = spec.state_alignment
        return out
    assert isinstance(spec, AttentionSpec)
    # Subclasses before their bases.
    if isinstance(spec, HiddenStateCacheSpec):
        _attention_to_proto(spec, out.hidden_state_cache.attention)
        _mla_to_proto(spec, out.hidden_state_cache.mla)
    elif isinstance(spec, MLAAttentionSpec):
        body_mla = out.mla_attention
        _attention_to_proto(spec, body_mla.attention)
        _mla_to_proto(spec, body_mla.mla)
        body_mla.cache_role = (
            spec_pb2.SPARSE_CACHE_ROLE_INDEXER
            if spec.cache_role is SparseCacheRole.INDEXER
            else spec_pb2.SPARSE_CACHE_ROLE_SPARSE
        )
        body_mla.is_index_group_leader = spec.is_index_group_leader
        body_mla.non_causal_multi_token_decode = spec.non_causal_multi_token_decode
    elif isinstance(spec, RSWASpec):
        _attention_to_proto(spec, out.rswa.attention)
        out.rswa.rswa_window = spec.rswa_window
    elif isinstance(spec, SinkFullAttentionSpec):
        sink = out.sink_full_attention
        _attention_to_proto(spec, sink.attention)
        sink.sink_len = spec.sink_len or 0
        _windows_to_proto(spec, sink)
        sink.non_causal = spec.non_causal
    elif isinstance(spec, FullAttentionSpec):
        body_full = out.full_attention
        _attention_to_proto(spec, body_full.attention)
        _windows_to_proto(spec, body_full)
        body_full.non_causal = spec.non_causal
    elif isinstance(spec, SlidingWindowMLASpec):
        swa = out.sliding_window_mla
        _attention_to_proto(spec, swa.attention)
        _mla_to_proto(spec, swa.mla)
        swa.sliding_window = spec.sliding_window
        swa.bounded_replay = spec.bounded_replay
        swa.non_causal_multi_token_decode = spec.non_causal_multi_token_decode
    elif isinstance(spec, SlidingWindowSpec):
        _attention_to_proto(spec, out.sliding_window.attention)
        out.sliding_window.sliding_window = spec.sliding_window
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        _attention_to_proto(spec, out.chunked_local_attention.attention)
        out.chunked_local_attention.attention_chunk_size = spec.attention_chunk_size
    elif isinstance(spec, CrossAttentionSpec):
        _attention_to_proto(spec, out.cross_attention.attention)
    elif isinstance(spec, EncoderOnlyAttentionSpec):
        _attention_to_proto(spec, out.encoder_only_attention.attention)
    elif isinstance(spec, CircularBufferSpec):
        _attention_to_proto(spec, out.circular_buffer.attention)
    return out


def _windows_to_proto(spec: FullAttentionSpec, body: Any) -> None:
    if spec.sliding_window is not None:
        body.sliding_window = spec.sliding_window
    if spec.attention_chunk_size is not None:
        body.attention_chunk_size = spec.attention_chunk_size


_PATHS = {path: plan_pb2.GroupingPath.Value(f"GROUPING_PATH_{path.name}") for path in GroupingPath}
_RULES = {rule: plan_pb2.DraftRule.Value(f"DRAFT_RULE_{rule.name}") for rule in DraftRule}
_WARNINGS = {code: plan_pb2.WarningCode.Value(f"WARNING_CODE_{code.name}") for code in WarningCode}
_BUDGET_MODES = {mode: plan_pb2.BudgetMode.Value(f"BUDGET_MODE_{mode.name}") for mode in BudgetMode}


def _worker_layout_to_proto(worker: WorkerPlan, out: plan_pb2.WorkerPlan) -> None:
    """The worker's tensors and projected groups."""
    for tensor in worker.tensors:
        out.tensors.add(
            size_bytes=tensor.size_bytes,
            layer_names=tensor.layer_names,
            offset_bytes=tensor.offset_bytes,
            layer_stride_bytes=tensor.layer_stride_bytes,
            block_stride_bytes=tensor.block_stride_bytes,
            group_id=tensor.group_id,
            host_resident=tensor.host_resident,
        )
    for projected in worker.groups:
        out.groups.add(
            group_id=projected.group_id,
            layer_names=projected.layer_names,
            is_draft=projected.is_draft,
        )


def _worker_body_key(worker: WorkerPlan) -> tuple[object, ...]:
    """Equal for workers whose messages differ in rank and device uuid alone: every
    other field of `WorkerPlan`, its tuples and budget by identity."""
    return (
        worker.num_blocks,
        worker.bytes_per_block,
        id(worker.tensors),
        id(worker.groups),
        id(worker.budget),
        worker.check_bytes,
        worker.needed_per_request_bytes,
        worker.encoder_only_layers,
        worker.kv_tp_replicas,
        worker.footprint_bytes,
        worker.needs_kv_cache_zeroing,
    )


def _worker_body_to_proto(plan: EnginePlan, worker: WorkerPlan, out: plan_pb2.WorkerPlan) -> None:
    """Everything of a worker's message but its rank and device uuid."""
    budget = worker.budget
    out.num_blocks = worker.num_blocks
    out.bytes_per_block = worker.bytes_per_block
    out.kv_cache_size_tokens = plan.kv_cache_size_tokens
    out.max_concurrency = plan.max_concurrency
    out.max_model_len = plan.max_model_len
    out.blocks_per_request = plan.blocks_per_request
    out.encoder_only_layers.extend(worker.encoder_only_layers)
    out.kv_tp_replicas = worker.kv_tp_replicas
    out.needs_kv_cache_zeroing = worker.needs_kv_cache_zeroing
    out.budget.CopyFrom(
        plan_pb2.MemoryBudget(
            mode=_BUDGET_MODES[budget.mode],
            total_bytes=budget.total_bytes,
            gpu_memory_utilization=budget.gpu_memory_utilization,
            requested_bytes=max(budget.requested_bytes, 0),
            non_kv_bytes=budget.non_kv_bytes,
            available_bytes=max(budget.available_bytes, 0),
            check_bytes=max(worker.check_bytes, 0),
            needed_per_request_bytes=worker.needed_per_request_bytes,
            free_bytes=budget.free_bytes,
            free_memory_fraction=budget.free_memory_fraction,
            in_use_bytes=budget.in_use_bytes,
            footprint_bytes=max(worker.footprint_bytes, 0),
        )
    )
    _worker_layout_to_proto(worker, out)


def _groups_to_proto(groups: Sequence[KVCacheGroup], response: plan_pb2.PlanResponse) -> None:
    # Groups share spec objects (a hybrid bucket's groups, a wrapper's layers): each
    # is rendered once and merged in as bytes (Gemma-3-style 64 layers: 7 groups, 2
    # renderings; plan_to_proto 57 -> 47 µs).
    rendered: dict[int, bytes] = {}

    def spec_bytes(spec: KVCacheSpec) -> bytes:
        if id(spec) not in rendered:
            rendered[id(spec)] = spec_to_proto(spec).SerializeToString()
        return rendered[id(spec)]

    for group in groups:
        out = response.groups.add(
            group_id=group.group_id,
            layer_names=group.layer_names,
            uniform_type=isinstance(group.spec, UniformTypeSpecs),
            block_size=group.spec.block_size,
            page_size_bytes=group.spec.page_size_bytes,
            is_draft=group.is_draft,
            draft_rule=_RULES[group.draft_rule],
            padding_layers=group.padding_layers,
            prefix_cacheable=group.spec.prefix_cacheable,
            host_resident=group.host_resident,
        )
        if isinstance(group.spec, UniformTypeSpecs):
            out.spec.MergeFromString(spec_bytes(group.spec.first_spec))
            for name, layer_spec in group.spec.layer_specs:
                out.layer_specs.add(name=name).MergeFromString(spec_bytes(layer_spec))
        else:
            out.spec.MergeFromString(spec_bytes(group.spec))


def render_groups(groups: Sequence[KVCacheGroup]) -> bytes:
    """`groups` as a PlanResponse serializes them: a model plan's groups are every
    one of its engines' groups, so a kept model renders them once (`plan_to_proto`'s
    `rendered_groups`)."""
    response = plan_pb2.PlanResponse()
    _groups_to_proto(groups, response)
    return response.SerializeToString()


def plan_to_proto(
    plan: EnginePlan, *, plan_id: str, rendered_groups: bytes | None = None
) -> plan_pb2.PlanResponse:
    """`rendered_groups`: `render_groups(plan.groups)`, when the caller kept it.
    Merging it in parses bytes where rendering makes calls per group and spec (fresh
    content, with serializing: 64 layers 100 -> 54 µs, 8 workers x 65 layers 234 ->
    176 µs; medians of 6 interleaved rounds); the reply's bytes are the same."""
    response = plan_pb2.PlanResponse(
        plan_id=plan_id,
        engine_id=plan.engine_id,
        max_model_len=plan.max_model_len,
        num_blocks=plan.num_blocks,
        rule_set=plan.rule_set,
        hisparse_host_num_blocks=plan.hisparse_host_num_blocks,
        plan_stage=plan_pb2.PlanStage.Value(f"PLAN_STAGE_{plan.stage.name}"),
        reserved_num_blocks=plan.reserved_num_blocks,
    )
    if rendered_groups is None:
        _groups_to_proto(plan.groups, response)
    else:
        response.MergeFromString(rendered_groups)
    # Tensor-parallel ranks differ in rank and device alone: they share their tuples
    # of tensors and groups (one projection) and their budget (one setting). What
    # they share is rendered once and merged into each as bytes (8 workers x 65
    # layers: plan_to_proto 79 -> 64 µs; merging bytes beats MergeFrom of the message).
    sharers = Counter(_worker_body_key(worker) for worker in plan.workers)
    shared: dict[tuple[object, ...], bytes] = {}
    for worker in plan.workers:
        key = _worker_body_key(worker)
        if sharers[key] == 1:
            _worker_body_to_proto(
                plan, worker, response.workers.add(rank=worker.rank, device_uuid=worker.device_uuid)
            )
            continue
        if key not in shared:
            body = plan_pb2.WorkerPlan()
            _worker_body_to_proto(plan, worker, body)
            shared[key] = body.SerializeToString()
        response.workers.add(rank=worker.rank, device_uuid=worker.device_uuid).MergeFromString(
            shared[key]
        )
    diagnostics = response.diagnostics
    diagnostics.grouping_path = _PATHS[plan.path]
    diagnostics.page_sizes_unified = plan.page_sizes_unified
    diagnostics.local_attention_promoted = plan.local_attention_promoted
    diagnostics.scheduler_block_size = plan.scheduler_block_size
    diagnostics.hash_block_size = plan.hash_block_size
    diagnostics.group_size = plan.group_size
    diagnostics.kv_cache_layout = layout_to_proto(plan.layout)
    diagnostics.layout_candidates.extend(layout_to_proto(x) for x in plan.layout_candidates)
    for padding in plan.padding:
        diagnostics.padding.add(
            bucket_index=padding.bucket_index,
            padding_layers=padding.padding_layers,
            waste_percent=padding.waste_percent,
            wasted_bytes_per_block=padding.wasted_bytes_per_block,
        )
    for warning in plan.warnings:
        diagnostics.warnings.add(code=_WARNINGS[warning.code], message=warning.message)
    return response


@dataclass(frozen=True)
class PlanKeys:
    """What names a request's plan.

    `plan_id`: the content address of the whole request, engine id included.
    `content`: the SHA-256 of everything a plan depends on, which is the request
    without its engine id. Two engines with equal `content` get equal plans apart
    from the ids: a fleet's new replica of a model it has already planned.
    `model`: the SHA-256 of what its model plan (`plan_model`) depends on, which is
    `content` without the workers' device and memory settings. Engines with equal
    `model` and any memory share one model plan.
    """

    plan_id: str
    content: bytes
    model: bytes


def plan_keys(
    message: plan_pb2.PlanRequest, encoded_workers: Sequence[WorkerBytes] | None = None
) -> PlanKeys:
    """Both keys of a request in one walk: every set field in deterministic bytes,
    workers in rank order (so worker order does not change them). Each part is framed
    with its field number and length; nothing is copied. `encoded_workers`: the
    request's `encode_workers`, when the caller has them."""
    encoded = encode_workers(message) if encoded_workers is None else encoded_workers
    whole, content, model = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    workers_field = plan_pb2.PlanRequest.WORKERS_FIELD_NUMBER
    engine_id_field = plan_pb2.PlanRequest.ENGINE_ID_FIELD_NUMBER
    for field, value in message.ListFields():
        if field.number == workers_field:
            continue
        part = (
            value.SerializeToString(deterministic=True)
            if field.message_type is not None
            else repr(value).encode()
        )
        framed = b"%d:%d:" % (field.number, len(part)) + part
        whole.update(framed)
        if field.number != engine_id_field:
            content.update(framed)
            model.update(framed)
    ranks = [worker.rank for worker in message.workers]
    for index in sorted(range(len(ranks)), key=ranks.__getitem__):
        part = encoded[index].data
        frame = b"%d:%d:" % (workers_field, len(part))
        whole.update(frame)
        whole.update(part)
        content.update(frame)
        content.update(part)
    # Each distinct layer list hashed once (tensor-parallel ranks share one).
    layer_digests: dict[bytes, bytes] = {}
    for index in sorted(range(len(ranks)), key=ranks.__getitem__):
        layers = encoded[index].layers_key
        digest = layer_digests.get(layers)
        if digest is None:
            digest = layer_digests[layers] = hashlib.sha256(layers).digest()
        model.update(b"%d:%d:" % (workers_field, ranks[index]) + digest)
    return PlanKeys(f"plan-{whole.hexdigest()[:32]}", content.digest(), model.digest())


def plan_id_for(
    message: plan_pb2.PlanRequest, encoded_workers: Sequence[WorkerBytes] | None = None
) -> str:
    """The request's content address (`PlanKeys.plan_id`)."""
    return plan_keys(message, encoded_workers).plan_id


def plan_from_proto(
    message: plan_pb2.PlanRequest,
    *,
    gpu_memory_table: Mapping[str, int] | None = None,
    plan_id: str | None = None,
    encoded_workers: Sequence[WorkerBytes] | None = None,
    models: ModelCache | None = None,
    model_key: Hashable | None = None,
) -> plan_pb2.PlanResponse:
    """request -> validate -> plan -> budget -> respond. `plan_id`: the request's
    `plan_id_for`, when the caller already has it; `encoded_workers`: its
    `encode_workers` (serialized once for the plan id and the conversion).

    `models`: where model plans are kept; `model_key`: this request's key there (by
    default its `PlanKeys.model`; a caller adds whatever scopes it). A known model is
    not converted or grouped again, only budgeted: the same plan, for less work.
    """
    encoded = encode_workers(message) if encoded_workers is None else encoded_workers
    known = None
    if models is not None:
        if model_key is None:
            model_key = plan_keys(message, encoded).model
        known = models.get(model_key)
    request = request_from_proto(
        message, gpu_memory_table=gpu_memory_table, encoded_workers=encoded, known_model=known
    )
    budgets = worker_budgets(request)  # as the workers start, before there is a model
    if known is not None:
        model, rendered_groups = known.plan, known.rendered_groups
    else:
        model, rendered_groups = plan_model(request), None
    plan = plan_engine(request, model, budgets)
    try:
        if known is None and models is not None:
            # Kept once an engine of it planned: rendering reads every page size, which
            # may raise an error that vLLM (and plan_engine) raises later than others.
            rendered_groups = render_groups(model.groups)
            models.put(model_key, KnownModel.of(request, model, rendered_groups))
        return plan_to_proto(
            plan, plan_id=plan_id or plan_id_for(message, encoded), rendered_groups=rendered_groups
        )
    except ValueError as error:  # protobuf: a number outside its field's type
        raise InvalidRequest(
            "the plan's numbers do not fit the reply's 64-bit fields (a size or count "
            f"exceeds 2^64-1: {error}); the request's sizes, block counts or shapes are "
            "out of range",
            field=(
                "options.num_gpu_blocks_override"
                if message.options.HasField("num_gpu_blocks_override")
                else "workers"
            ),
        ) from error


__all__ = [
    "GPU_MEMORY_BYTES",
    "PlanKeys",
    "PlanningError",
    "WorkerBytes",
    "encode_varint",
    "encode_workers",
    "layer_from_proto",
    "plan_from_proto",
    "plan_id_for",
    "plan_keys",
    "plan_to_proto",
    "render_groups",
    "request_from_proto",
    "spec_to_proto",
]
