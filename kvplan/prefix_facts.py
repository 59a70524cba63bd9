"""The prefix-cache setup of a planned engine: its core request (kvplan.convert's
`request_from_proto`) and the PlanResponse, turned into kvplan.core.prefix_cache's
plain values."""

from __future__ import annotations

from kvplan.core.grouping import allocated_layer_spec
from kvplan.core.prefix_cache import CacheGroup, GroupKind, PrefixCacheSetup
from kvplan.core.request import EngineRequest
from kvplan.core.specs import KVCacheSpec
from kvplan.v1 import plan_pb2, spec_pb2

_KINDS = {
    "full_attention": GroupKind.FULL,
    "mla_attention": GroupKind.FULL,
    "sink_full_attention": GroupKind.FULL,
    "sliding_window": GroupKind.SLIDING_WINDOW,
    "sliding_window_mla": GroupKind.SLIDING_WINDOW,
    "chunked_local_attention": GroupKind.CHUNKED_LOCAL,
    "mamba": GroupKind.MAMBA,
}


def _non_causal(response: plan_pb2.PlanResponse) -> bool:
    for group in response.groups:
        for spec in [group.spec, *group.layer_specs]:
            kind = spec.WhichOneof("kind")
            body = getattr(spec, kind) if kind else None
            if body is not None and getattr(body, "non_causal", False):
                return True
    return False


def _window(spec: spec_pb2.LayerSpec) -> int:
    kind = spec.WhichOneof("kind")
    body = getattr(spec, kind) if kind else None
    for name in ("sliding_window", "attention_chunk_size"):
        value = getattr(body, name, 0) if body is not None else 0
        if isinstance(value, int) and value:
            return value
    return 0


def _dcp_sharded(spec: spec_pb2.LayerSpec) -> bool:
    """Attention specs shard token positions across DCP ranks unless told not to."""
    kind = spec.WhichOneof("kind")
    body = getattr(spec, kind) if kind else None
    params = getattr(body, "attention", None)
    if params is None or kind == "mamba":
        return False
    return not params.HasField("dcp_sharded") or params.dcp_sharded


def _needs_whole_blocks(group: CacheGroup, hash_block: int) -> bool:
    """A cacheable group whose lookup cannot land inside its block (sliding window,
    chunked local): unless its block is the hash block, vLLM turns partial hash hits
    off for the whole engine. Full attention (and its kin) and Mamba can."""
    return (
        group.prefix_cacheable
        and group.kind in (GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL)
        and group.block_tokens != hash_block
    )


def _scheduler_draft_flags(response: plan_pb2.PlanResponse) -> list[bool]:
    """Each group's draft flag as the scheduler sees it. vLLM's scheduler (and its
    KV cache manager) takes the first worker's config: under pipeline parallelism a
    group that worker holds no layer of may have lost its flag there (0.32: a
    drafter on the last stage leaves no group flagged, so every group drops)."""
    if not response.workers:
        return [bool(group.is_draft) for group in response.groups]
    first = min(response.workers, key=lambda worker: worker.rank)
    flags = {projected.group_id: bool(projected.is_draft) for projected in first.groups}
    return [flags.get(group.group_id, bool(group.is_draft)) for group in response.groups]


def _scheduler_first_layers(response: plan_pb2.PlanResponse) -> list[int]:
    """Each group's first layer as the scheduler sees it, as an index into its
    `layer_names`. vLLM's scheduler takes the first worker's config and, for a group of
    several layer specs, the spec of its first layer there (the whole group's first
    layer where that worker holds none): a group kvplan calls not cacheable because a
    later member opts out (a bounded-replay sliding-window MLA layer) is cacheable
    there when its first layer is."""
    first = min(response.workers, key=lambda worker: worker.rank) if response.workers else None
    held = {p.group_id: list(p.layer_names) for p in first.groups} if first else {}
    firsts = []
    for group in response.groups:
        names = held.get(group.group_id)
        firsts.append(list(group.layer_names).index(names[0]) if names else 0)
    return firsts


def _core_spec(request: EngineRequest, layer_name: str) -> KVCacheSpec | None:
    """A layer's spec as the request declares it (searched only for groups of
    several layer specs, which are rare: no per-plan index of every layer)."""
    return next(
        (spec for worker in request.workers for name, spec in worker.layers if name == layer_name),
        None,
    )


def _scheduler_view(
    group: plan_pb2.KVCacheGroup, first: int, request: EngineRequest
) -> tuple[spec_pb2.LayerSpec, bool]:
    """The spec the scheduler reads for `group` and whether it takes part in prefix
    caching: its first layer's own where the group holds several layer specs (the
    core spec's `prefix_cacheable`, as the planner allocated the layer: a promoted
    layer is its promotion's), else the group's."""
    if not group.layer_specs:
        return group.spec, bool(group.prefix_cacheable)
    allocated = group.layer_specs[first]
    core = _core_spec(request, group.layer_names[first])
    if core is None:
        return allocated, bool(group.prefix_cacheable)
    core = allocated_layer_spec(core, allocated.WhichOneof("kind") or "", request.rules)
    return allocated, core.prefix_cacheable


def _replay_window(spec: spec_pb2.LayerSpec) -> int:
    """The tokens vLLM's scheduler recomputes at the end of a prefix hit for a group
    whose spec it reads as `spec` (KVCacheSpec.prefix_replay_tokens): a
    bounded-replay sliding-window MLA spec's window, else 0. A layer vLLM 0.34
    promotes to MLA (disable_hybrid_kv_cache_manager) reads as MLA: no replay."""
    if (
        spec.WhichOneof("kind") != "sliding_window_mla"
        or not spec.sliding_window_mla.bounded_replay
    ):
        return 0
    return int(spec.sliding_window_mla.sliding_window)


def _mamba_checkpoint_alignment(specs: list[spec_pb2.LayerSpec]) -> int:
    """The alignment (tokens) of the Mamba prefill checkpoint a backend can export
    inside a prompt's last chunk, as vLLM's scheduler reads it: the first Mamba
    group's `prefill_checkpoint_alignment`, where every Mamba group has prefill
    checkpoint blocks (Scheduler.mamba_has_prefill_checkpoint_blocks); else 0."""
    mambas = [spec.mamba for spec in specs if spec.WhichOneof("kind") == "mamba"]
    if not mambas or any(m.num_prefill_checkpoint_blocks == 0 for m in mambas):
        return 0
    first = mambas[0]
    if not first.HasField("prefill_checkpoint_alignment"):
        return 0  # vLLM's validity test fails without an alignment
    return int(first.prefill_checkpoint_alignment)


def setup_from_plan(request: EngineRequest, response: plan_pb2.PlanResponse) -> PrefixCacheSetup:
    options = request.options
    dcp = options.decode_context_parallel_size
    draft_flags = _scheduler_draft_flags(response)
    views = [
        _scheduler_view(group, first, request)
        for group, first in zip(response.groups, _scheduler_first_layers(response), strict=True)
    ]
    spec_ids: dict[bytes, int] = {}
    groups = tuple(
        CacheGroup(
            kind=_KINDS.get(spec.WhichOneof("kind") or "", GroupKind.OTHER),
            block_tokens=int(group.block_size) * (dcp if _dcp_sharded(group.spec) else 1),
            is_draft=is_draft,
            prefix_cacheable=cacheable,
            window=_window(spec),
            spec_id=spec_ids.setdefault(
                group.spec.SerializeToString(deterministic=True), len(spec_ids)
            ),
        )
        for group, is_draft, (spec, cacheable) in zip(
            response.groups, draft_flags, views, strict=True
        )
    )
    enabled = options.enable_prefix_caching and not _non_causal(response)
    hash_block = int(response.diagnostics.hash_block_size)
    partial = (
        options.mamba_align_mode
        and any(
            g.kind is GroupKind.MAMBA
            and (g.block_tokens > hash_block or (dcp > 1 and g.block_tokens == hash_block))
            for g in groups
        )
        and not any(_needs_whole_blocks(g, hash_block) for g in groups)
    )
    rules = request.rules
    spec_decode = request.spec_decode
    drafter_drops = spec_decode.block_drop_enabled(rules)
    # 0.33+: block hashes cover the drafter's prefill lookahead instead of a drop
    # (a KV connector, HiSparse's, keeps the legacy hashes and the drop).
    lookahead = (
        spec_decode.prefill_lookahead_tokens
        if drafter_drops and rules.lookahead_block_hashes and options.hisparse is None and enabled
        else 0
    )
    # The engine's cache block once planned (vLLM's engine core sets it to the
    # smallest prefix-cacheable group block): the scheduler aligns chunk ends to it.
    blocks = [int(group.block_size) for group in response.groups]
    cacheable = [b for b, (_, on) in zip(blocks, views, strict=True) if on]
    split_block = min(cacheable or blocks or [0])
    return PrefixCacheSetup(
        enabled=enabled,
        groups=groups,
        scheduler_block=int(response.diagnostics.scheduler_block_size),
        hash_block=hash_block,
        partial_hash_hits=partial and len(groups) > 1,
        block_drop=drafter_drops and lookahead == 0,
        hash_lookahead=lookahead,
        reprefill_tokens=max(0, spec_decode.prefill_lookahead_tokens - 1),
        junction_checkpoint=options.mamba_shared_prefix_checkpoint,
        prefill_chunk_tokens=max(
            1, options.max_num_batched_tokens - spec_decode.step_draft_slots(rules)
        ),
        split_block=split_block,
        # The planner refuses groups of different replay windows (vLLM asserts one).
        replay_window=max((_replay_window(spec) for spec, _ in views), default=0),
        mamba_checkpoint_alignment=_mamba_checkpoint_alignment([spec for spec, _ in views]),
        # The figures are for a stored request that generated output, as real ones
        # do: at least its hash lookahead, past which more output changes nothing
        # (the partial-tail key stops at the prompt's last token but one).
        stored_output_tokens=lookahead,
    )


__all__ = ["setup_from_plan"]
