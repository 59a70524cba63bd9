"""What a plan says of the engine's prefix cache, evaluated and worded with only
protobuf: the rule PrefixCacheDiagnostics states for cached tokens of a shared
prefix, and the one-line summary `kvplan plan` and the vLLM plugin print
(docs/prefix-caching.md, "Where kvplan shows it")."""

from __future__ import annotations

from kvplan.v1 import plan_pb2


def cached_tokens(prefix_cache: plan_pb2.PrefixCacheDiagnostics, shared_prefix: int) -> int:
    """Tokens served from cache when a request repeats all `shared_prefix` tokens
    of an earlier request that was exactly those tokens and goes on past them.
    Exact when `prefix_cache.rule_exact`; else (the cases PrefixCacheDiagnostics
    .rule_exact lists in proto/kvplan/v1/plan.proto: the coordinator's turns
    between a finer dropping window and other non-full-attention groups, one-token
    windows, some partial hash hits, Mamba states only where prefill chunks end,
    ...) an estimate: ask the server with PlanRequest.shared_prefix_tokens. The KV
    cache manager's hit, less the window the scheduler replays (`replay_tokens`,
    bounded replay). A plan from a server before a field leaves it 0, which drops
    that term."""
    unit = prefix_cache.hit_unit_tokens
    if (
        not prefix_cache.effectively_on
        or not unit
        or shared_prefix < prefix_cache.min_shared_prefix_tokens
    ):
        return 0
    return max(0, _manager_hit(prefix_cache, shared_prefix) - prefix_cache.replay_tokens)


def _manager_hit(prefix_cache: plan_pb2.PrefixCacheDiagnostics, shared_prefix: int) -> int:
    """`cached_tokens` before the scheduler's bounded replay."""
    n = shared_prefix
    unit = prefix_cache.hit_unit_tokens
    hash_block = prefix_cache.hash_block_tokens or unit
    hashed = max(0, n - prefix_cache.hash_lookahead_tokens) // hash_block * hash_block
    # A coarse full-attention block that keeps its last block is landed inside only
    # at the stored request's last hash boundary short of its last token.
    resend = max(0, min(n - 1, hashed) // unit * unit)
    coarse = prefix_cache.coarse_block_tokens
    # What the stored request's groups cache: all but a reprefilled tail.
    cached = n - prefix_cache.reprefill_tokens
    shortest_window = prefix_cache.shortest_window_tokens
    if not prefix_cache.drop_group_ids:
        base = n - 1 if prefix_cache.boundary_only else n
        hit = max(0, min(base, cached, hashed) // unit * unit)
        boundary = (n - 1) // unit * unit  # the stored request's replay boundary
        if shortest_window and hit < boundary and boundary > shortest_window:
            # Lookahead hashes hold the hit below the boundary, where the windows'
            # kept blocks (anchored there) no longer reach back to the first block.
            return 0
        return resend if coarse and hit % coarse else hit
    # The dropped block must be matched too.
    reach = (min(cached, hashed) - prefix_cache.drop_tokens) // unit * unit
    drop_windows = [prefix_cache.drop_window_tokens, *prefix_cache.further_drop_window_tokens]
    if not prefix_cache.boundary_only:
        hit = resend if coarse and reach % coarse else reach
        # Every window block kept (dense retention): each finer dropping window
        # still longer than the hit takes a unit off it.
        for drop_window in drop_windows:
            if 0 < hit < drop_window:
                hit -= unit
        return max(0, hit)
    # State kept only at the stored request's replay boundaries (one lower under
    # the drop) and at its Mamba prefill checkpoint.
    stride = prefix_cache.boundary_block_tokens or unit
    last_boundary = n // stride * stride - stride
    kept = [last_boundary, (n - 1) // stride * stride - stride]
    checkpoints = {n // c * c - c for c in prefix_cache.mamba_checkpoint_tokens if c}
    if len(checkpoints) == 1:
        kept.extend(checkpoints)
    if reach < last_boundary <= shortest_window:
        # Every window still holds the stored request's first block at its last
        # boundary, so every block below it: the reach (under the tail) lands.
        kept.append(reach)
    hit = max((x for x in kept if 0 < x <= reach and x % unit == 0), default=0)
    window = prefix_cache.drop_window_tokens
    if hit and hit < window:
        # A finer dropping window's lookup from the first block: its run is the hit
        # and one block past it, short of the window and the dropped block.
        if last_boundary > window:
            return 0
        hit = max(0, min(hit, reach - unit, last_boundary - unit))
        # Each further dropping window of its own spec takes a unit more while it
        # is longer than the hit (the coordinator looks them up in turn).
        for other in prefix_cache.further_drop_window_tokens:
            if 0 < hit < other:
                hit -= unit
    return hit


def summary(prefix_cache: plan_pb2.PrefixCacheDiagnostics) -> str:
    """e.g. "prefix cache: hits in 2,096-token units; a prompt sent again hits only
    from 4,192 tokens; the drafter's groups drop the last matched block (2,096 tokens)";
    where a shared prefix of a longer stored prompt hits lower, "...; a prompt sent
    again hits only from 81 tokens; a shared prefix of a longer stored prompt from
    80" (Jamba)."""
    if not prefix_cache.effectively_on:
        return f"prefix cache: no hit ever ({prefix_cache.off_detail or 'off'})"
    sent_again = prefix_cache.min_shared_prefix_tokens
    reached = f"a prompt sent again hits only from {sent_again:,} tokens"
    any_hit = prefix_cache.min_any_hit_prefix_tokens
    if 0 < any_hit < sent_again:
        # A longer stored prompt keeps its state further on (a server before the
        # field leaves it 0: the sent-again figure alone).
        reached += f"; a shared prefix of a longer stored prompt from {any_hit:,}"
    parts = [f"prefix cache: hits in {prefix_cache.hit_unit_tokens:,}-token units", reached]
    if prefix_cache.drop_tokens:
        parts.append(
            f"the drafter's groups drop the last matched block ({prefix_cache.drop_tokens:,} "
            "tokens)"
        )
    if prefix_cache.boundary_only:
        parts.append("Mamba / window state only where a request ended")
    if prefix_cache.replay_tokens:
        parts.append(
            f"the scheduler recomputes the last {prefix_cache.replay_tokens:,} tokens of "
            "every hit (bounded replay)"
        )
    return "; ".join(parts)


def reported_cached_tokens(prefix_cache: plan_pb2.PrefixCacheDiagnostics, served: int) -> int:
    """What vLLM's own figures count for a request served `served` tokens from
    cache: its usage `cached_tokens` and its prefix-cache hit metric take the KV
    cache manager's hit, before the scheduler recomputes the bounded-replay window
    (Scheduler.schedule records the hit, then _mark_prefix_replay rewinds it), and
    0 where the scheduler dropped a hit no longer than the window. So the served
    figure plus `replay_tokens` once anything is served
    (kvplan.core.prefix_cache.reported_after_replay)."""
    return served + prefix_cache.replay_tokens if served else 0


def what_if_line(prefix_cache: plan_pb2.PrefixCacheDiagnostics) -> str:
    """The answer to PlanRequest.shared_prefix_tokens, in words ("" when not asked).
    Where bounded replay serves less than vLLM's hit metric will count for the
    same three requests (`reported_cached_tokens`), it says that too: an operator
    would otherwise read the metric as kvplan being wrong by the window."""
    if not prefix_cache.HasField("what_if"):
        return ""
    answer = prefix_cache.what_if
    n = answer.shared_prefix_tokens
    line = (
        f"shared prefix of {n:,} tokens: "
        f"{answer.cached_tokens_prefix_stored:,} served from cache after a request of "
        "exactly those tokens; after one that went on with other text, first request: "
        f"{answer.cached_tokens_prefix_diverges:,} of {n:,} tokens from cache; the next "
        f"one: {answer.cached_tokens_next_request:,}"
    )
    served = [
        answer.cached_tokens_prefix_stored,
        answer.cached_tokens_prefix_diverges,
        answer.cached_tokens_next_request,
    ]
    counted = [reported_cached_tokens(prefix_cache, figure) for figure in served]
    if counted != served:  # bounded replay, and some hit served
        line += (
            f" (vLLM's prefix-cache hit metric and usage cached_tokens count "
            f"{' / '.join(f'{c:,}' for c in counted)}: the {prefix_cache.replay_tokens:,} "
            "tokens the scheduler recomputes included)"
        )
    return line


def zero_hit_reason(response: plan_pb2.PlanResponse) -> str:
    """Why an engine with prefix caching asked for will get no hit at all, with
    the knob; "" when some shared prefix hits. A prefix cache switched off on
    purpose is not a reason: that engine asked for no hits."""
    pc = response.diagnostics.prefix_cache
    if not response.diagnostics.HasField("prefix_cache"):
        return ""
    if not pc.effectively_on:
        if pc.off_reason == plan_pb2.PREFIX_CACHE_OFF_REASON_DISABLED:
            return ""
        return pc.off_detail
    if pc.min_shared_prefix_tokens > response.max_model_len:
        return (
            f"the shortest prompt that hits when sent again ({pc.min_shared_prefix_tokens:,} "
            "tokens) is "
            f"longer than max_model_len ({response.max_model_len:,}); knob: a smaller "
            "--block-size, or a longer --max-model-len"
        )
    return ""


def degraded_reason(response: plan_pb2.PlanResponse) -> str:
    """The plan's warning for a drafter no group was identified as (every group
    takes the block drop): hits remain, fewer; "" otherwise."""
    for warning in response.diagnostics.warnings:
        if warning.code == plan_pb2.WARNING_CODE_PREFIX_UNIDENTIFIED_DRAFTER:
            return warning.message
    return ""


def repeated_prompts_only_reason(response: plan_pb2.PlanResponse) -> str:
    """The plan's warning that shared prefixes shorter than a stored prompt get
    nothing (Mamba groups; a sliding window shorter than most prompts): only
    repeated prompts hit. "" otherwise."""
    for warning in response.diagnostics.warnings:
        if warning.code == plan_pb2.WARNING_CODE_PREFIX_BOUNDARY_ONLY:
            return warning.message
    return ""


__all__ = [
    "cached_tokens",
    "degraded_reason",
    "repeated_prompts_only_reason",
    "reported_cached_tokens",
    "summary",
    "what_if_line",
    "zero_hit_reason",
]
