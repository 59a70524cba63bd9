"""PlanRequest -> EngineRequest: every field checked (errors name the proto field
path) and kvplan's documented defaults applied (docs/semantics.md) as the domain
values are built."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from fractions import Fraction
from typing import Any

from kvplan.convert.checks import (
    _check_engine_configuration,
    _check_hybrid_manager,
    _check_release_request_fields,
    _check_spec_decode,
    _enum_suffix,
    _release_fields_set,
    _require,
)
from kvplan.convert.wire import _NAME_TAG, WorkerBytes, _read_varint, encode_workers
from kvplan.core.dtypes import StorageDtype, storage_dtype_for_cache_dtype
from kvplan.core.errors import FieldViolation, InvalidRequest
from kvplan.core.extensible import DEFAULT_ALLOCATION_GRANULE_BYTES
from kvplan.core.hisparse import DEFAULT_HOST_PAGE_BYTES, HiSparseConfig
from kvplan.core.layout import KVCacheLayout
from kvplan.core.model_runner import (
    RunnerInputs,
    check_model_runner,
    check_parallel_drafting,
    choose_model_runner,
)
from kvplan.core.request import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
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
    RuleSet,
    rule_set_for,
)
from kvplan.core.specs import (
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
)
from kvplan.fieldcheck import check_fields
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.model_cache import KnownModel, WorkerModel
from kvplan.v1 import plan_pb2, spec_pb2

GIB = 1 << 30


_STORAGE = {
    spec_pb2.DTYPE_FLOAT32: StorageDtype.FLOAT32,
    spec_pb2.DTYPE_FLOAT16: StorageDtype.FLOAT16,
    spec_pb2.DTYPE_BFLOAT16: StorageDtype.BFLOAT16,
    spec_pb2.DTYPE_UINT8: StorageDtype.UINT8,
    spec_pb2.DTYPE_INT8: StorageDtype.INT8,
    spec_pb2.DTYPE_FLOAT8_E4M3FN: StorageDtype.FLOAT8_E4M3FN,
    spec_pb2.DTYPE_FLOAT8_E5M2: StorageDtype.FLOAT8_E5M2,
}


_MLA_FAMILY = ("mla_attention", "sliding_window_mla", "hidden_state_cache")


def layout_from_proto(value: int) -> KVCacheLayout:
    return KVCacheLayout[_enum_suffix(plan_pb2.KVCacheLayout, value, "KV_CACHE_LAYOUT_").upper()]


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
        mamba_shared_prefix_checkpoint=options.enable_mamba_shared_prefix_checkpoint,
    )


def _runner_inputs(
    proto_options: plan_pb2.EngineOptions, options: EngineOptions, spec_decode: SpecDecode
) -> RunnerInputs:
    """What the model runner's choice and checks read (kvplan/core/model_runner.py)."""
    asked = (
        proto_options.use_v2_model_runner if proto_options.HasField("use_v2_model_runner") else None
    )
    return RunnerInputs(
        asked=asked,
        hisparse=proto_options.HasField("hisparse"),
        method=spec_decode.method,
        parallel_drafting=spec_decode.method != "none" and spec_decode.drafts_in_parallel,
        pipeline_parallel_size=options.pipeline_parallel_size,
        async_scheduling=options.async_scheduling,
    )


def _spec_decode_from_proto(config: plan_pb2.SpecDecodeConfig) -> SpecDecode:
    return SpecDecode(
        parallel_drafting=(
            config.parallel_drafting if config.HasField("parallel_drafting") else None
        ),
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
        check_parallel_drafting(rules, spec_decode.method, spec_decode.parallel_drafting)
        runner = _runner_inputs(message.options, options, spec_decode)
        options = replace(options, use_v2_model_runner=choose_model_runner(rules, runner))
        _check_spec_decode(
            spec_decode,
            options,
            rules,
            nextn_given=message.spec_decode.HasField("num_nextn_predict_layers"),
        )
        check_model_runner(rules, runner, options.use_v2_model_runner)
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
