"""Domain -> proto: an EnginePlan rendered as a PlanResponse, and layer specs as
LayerSpecs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from kvplan.convert.request import _STORAGE
from kvplan.core.diagnostics import WarningCode
from kvplan.core.errors import InvalidRequest
from kvplan.core.groups import DraftRule, GroupingPath, KVCacheGroup
from kvplan.core.layout import KVCacheLayout
from kvplan.core.memory import BudgetMode
from kvplan.core.planner import (
    EnginePlan,
    WorkerPlan,
)
from kvplan.core.prefix_cache import PrefixCacheFacts, PrefixCacheSetup, WhyOff
from kvplan.core.prefix_cache import facts as prefix_facts
from kvplan.core.prefix_warnings import (
    PrefixContext,
    boundary_block,
    coarse_block,
    drop_window,
    drop_windows,
    mamba_checkpoint_strides,
    off_detail,
    prefix_warnings,
    reprefill_tail,
    rule_is_exact,
    shortest_window,
    what_if,
    what_if_step,
)
from kvplan.core.request import EngineRequest
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
    UniformTypeSpecs,
)
from kvplan.prefix_facts import setup_from_plan
from kvplan.v1 import plan_pb2, spec_pb2

_STORAGE_TO_PROTO = {value: key for key, value in _STORAGE.items()}


def layout_to_proto(layout: KVCacheLayout) -> plan_pb2.KVCacheLayout.ValueType:
    return plan_pb2.KVCacheLayout.Value(f"KV_CACHE_LAYOUT_{layout.name}")


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


_OFF_REASONS = {
    WhyOff.ON: plan_pb2.PREFIX_CACHE_OFF_REASON_UNSPECIFIED,
    WhyOff.DISABLED: plan_pb2.PREFIX_CACHE_OFF_REASON_DISABLED,
    WhyOff.NO_CACHEABLE_GROUP: plan_pb2.PREFIX_CACHE_OFF_REASON_NO_CACHEABLE_GROUP,
}


def prefix_rule_to_proto(
    setup: PrefixCacheSetup,
    facts: PrefixCacheFacts,
    group_ids: list[int],
    out: plan_pb2.PrefixCacheDiagnostics,
) -> None:
    """The facts and the terms of the rule a client evaluates
    (kvplan.client.prefix_cache.cached_tokens) into `out`; `group_ids`: the
    plan's group ids, in the setup's group order."""
    out.effectively_on = facts.on
    out.off_reason = _OFF_REASONS[facts.why_off]
    out.off_detail = off_detail(facts)
    out.hit_unit_tokens = facts.unit
    out.group_hit_unit_tokens.extend(facts.group_units)
    out.min_shared_prefix_tokens = facts.min_shared_prefix
    out.min_any_hit_prefix_tokens = facts.min_any_hit_prefix
    out.min_any_hit_stored_tokens = facts.min_any_hit_stored_tokens
    out.drop_group_ids.extend(group_ids[i] for i in facts.drop_groups)
    out.drop_tokens = facts.drop_tokens
    out.hash_block_tokens = setup.hash_block if facts.on else 0
    out.hash_lookahead_tokens = setup.hash_lookahead if facts.on else 0
    out.boundary_only = facts.boundary_only
    out.rule_exact = rule_is_exact(setup, facts)
    out.boundary_block_tokens = boundary_block(setup, facts)
    out.mamba_checkpoint_tokens.extend(mamba_checkpoint_strides(setup, facts))
    out.drop_window_tokens = drop_window(setup, facts)
    out.further_drop_window_tokens.extend(drop_windows(setup, facts)[1:])
    out.replay_tokens = facts.replay_tokens
    out.reprefill_tokens = reprefill_tail(setup, facts)
    out.shortest_window_tokens = shortest_window(setup, facts)
    out.coarse_block_tokens = coarse_block(setup, facts)


def prefix_cache_diagnostics(
    request: EngineRequest, response: plan_pb2.PlanResponse, *, asked_off: bool = False
) -> bytes:
    """The plan's prefix-cache facts (kvplan.core.prefix_cache) and its prefix
    warnings, as Diagnostics bytes to merge into `response.diagnostics`. They depend
    on the model plan alone (groups, draft flags, block sizes, options), so a kept
    model renders them once (`KnownModel.prefix_diagnostics`). `asked_off`: the
    request set options.enable_prefix_caching false (no warning for that)."""
    setup = setup_from_plan(request, response)
    facts = prefix_facts(setup)
    diagnostics = plan_pb2.Diagnostics()
    prefix_rule_to_proto(
        setup, facts, [group.group_id for group in response.groups], diagnostics.prefix_cache
    )
    context = PrefixContext(
        spec_decode=request.spec_decode.uses_eagle,
        drafter_flagged=any(group.is_draft for group in response.groups),
        asked_off=asked_off,
        promotion_drops_bounded_replay=request.rules.promotion_drops_bounded_replay,
    )
    for warning in prefix_warnings(setup, facts, context):
        diagnostics.warnings.add(code=_WARNINGS[warning.code], message=warning.message)
    return diagnostics.SerializeToString()


# The what-if simulates the release's lookups (kvplan.core.prefix_cache), each
# walking the prefix in its finest step (what_if_step: the hash block or a finer
# group block), for the first request and the next one: its work is bounded by
# answering at most this many steps. Measured figures: docs/prefix-caching.md.
WHAT_IF_MAX_STEPS = 32_768


def prefix_what_if_to_proto(
    request: EngineRequest, response: plan_pb2.PlanResponse, shared_prefix: int
) -> None:
    """PlanRequest.shared_prefix_tokens answered into `response`'s prefix_cache."""
    if shared_prefix > response.max_model_len:
        raise InvalidRequest(
            f"shared_prefix_tokens {shared_prefix:,} is longer than the plan's max_model_len "
            f"{response.max_model_len:,}: no request shares more tokens than it holds",
            field="shared_prefix_tokens",
        )
    setup = setup_from_plan(request, response)
    facts = prefix_facts(setup)
    step = what_if_step(setup)
    if facts.on and shared_prefix // step > WHAT_IF_MAX_STEPS:
        raise InvalidRequest(
            f"shared_prefix_tokens {shared_prefix:,} spans {shared_prefix // step:,} of the "
            f"prefix-cache simulation's {step:,}-token steps (the finest block it walks); "
            f"the what-if answers at most {WHAT_IF_MAX_STEPS:,} ({WHAT_IF_MAX_STEPS * step:,} "
            "tokens here); for longer prefixes evaluate the rule Diagnostics.prefix_cache "
            "states (kvplan.client.prefix_cache.cached_tokens)",
            field="shared_prefix_tokens",
        )
    answer = what_if(setup, facts, shared_prefix)
    out = response.diagnostics.prefix_cache.what_if
    out.shared_prefix_tokens = answer.shared_prefix
    out.cached_tokens_prefix_stored = answer.prefix_stored
    out.cached_tokens_prefix_diverges = answer.prefix_diverges
    out.cached_tokens_next_request = answer.next_request
