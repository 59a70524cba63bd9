"""Prefix-cache setups that lose hits, named with a warning code and the knob that
fixes each, and the what-if answer for a shared prefix of N tokens: pure functions
over kvplan.core.prefix_cache's setup and facts (docs/prefix-caching.md, "Where
kvplan shows it")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvplan.core.diagnostics import PlanWarning, WarningCode
from kvplan.core.prefix_cache import (
    GroupKind,
    PrefixCacheFacts,
    PrefixCacheSetup,
    WhyOff,
    cached_tokens,
    cached_tokens_after_junction,
    lookup_order,
    served_after_replay,
)

# A hit unit from here up is worth a warning: a system prompt or a chat turn is
# often shorter, and then never hits.
LARGE_HIT_UNIT_TOKENS = 256

# A sliding window shorter than this is worth the repeated-prompts-only warning:
# most prompts are longer, and a shorter prefix of a longer stored prompt never
# hits. Longer windows hold many whole prompts, whose shorter prefixes still hit.
SHORT_WINDOW_TOKENS = 8_192

# vLLM's names for the knobs (checked in the 0.32, 0.33 and 0.34 sources).
DRAFT_DROP_SWITCH = 'speculative_config {"disable_eagle_block_drop": true}'
PREFIX_CACHING_SWITCH = "--enable-prefix-caching (options.enable_prefix_caching)"
BLOCK_SIZE_KNOB = "--block-size (options.block_size)"
HYBRID_MANAGER_SWITCH = (
    "--disable-hybrid-kv-cache-manager (options.disable_hybrid_kv_cache_manager)"
)

# The plain words of PREFIX_BOUNDARY_ONLY, which the vLLM plugin's log repeats.
REPEATED_PROMPTS_ONLY = (
    "shared prefixes shorter than a stored prompt get 0 cached tokens; only repeated "
    "prompts (multi-turn) hit"
)


@dataclass(frozen=True)
class PrefixContext:
    """What the warnings need beyond the setup: from the request."""

    spec_decode: bool  # a drafter runs (EAGLE family)
    drafter_flagged: bool  # some group was identified as the drafter's
    asked_off: bool = False  # the request itself turned prefix caching off
    why_off_detail: str = ""
    # The release allocates bounded-replay windows as MLA (no replay) under
    # --disable-hybrid-kv-cache-manager (RuleSet.promotion_drops_bounded_replay).
    promotion_drops_bounded_replay: bool = False


def _fmt(tokens: int) -> str:
    return f"{tokens:,}"


def off_detail(facts: PrefixCacheFacts) -> str:
    if facts.why_off is WhyOff.DISABLED:
        return "prefix caching is disabled (asked, or the model's rule: non-causal layers)"
    if facts.why_off is WhyOff.NO_CACHEABLE_GROUP:
        return "no KV cache group takes part in prefix caching (attention-free model)"
    return ""


def prefix_warnings(
    setup: PrefixCacheSetup, facts: PrefixCacheFacts, context: PrefixContext
) -> tuple[PlanWarning, ...]:
    """Each setup that gets no hit or fewer hits than it could, with its knob."""
    if not facts.on:
        if facts.why_off is WhyOff.DISABLED and context.asked_off:
            return ()  # what was asked for: nothing to fix
        return (
            PlanWarning(
                WarningCode.PREFIX_CACHE_OFF,
                f"prefix cache gets no hit: {off_detail(facts)}; knob: {PREFIX_CACHING_SWITCH}",
            ),
        )
    out: list[PlanWarning] = []
    every_group_drops = len(facts.drop_groups) == len(setup.groups) > 1
    if context.spec_decode and not context.drafter_flagged and every_group_drops:
        out.append(
            PlanWarning(
                WarningCode.PREFIX_UNIDENTIFIED_DRAFTER,
                "no KV cache group was identified as the drafter's, so every group drops "
                "its last matched block: a prompt sent again hits only from "
                f"{_fmt(facts.min_shared_prefix)} tokens; knob: mark the drafter's layers "
                "is_draft (LayerSpec.is_draft)",
            )
        )
    elif facts.drop_tokens:
        out.append(
            PlanWarning(
                WarningCode.PREFIX_DRAFT_DROP,
                f"the drafter's groups drop their last matched block: {_fmt(facts.drop_tokens)} "
                "tokens off every hit, and a one-unit hit is emptied; knob (experimental in "
                f"vLLM, may lower acceptance): {DRAFT_DROP_SWITCH}",
            )
        )
    if facts.unit >= LARGE_HIT_UNIT_TOKENS:
        cause = (
            "the attention block is the smallest whose page holds a Mamba state (vLLM "
            "raises --block-size to it); knob: fewer state bytes per worker, e.g. a larger "
            "tensor-parallel size"
            if any(g.kind is GroupKind.MAMBA for g in setup.groups)
            else f"knob: a smaller {BLOCK_SIZE_KNOB}"
        )
        out.append(
            PlanWarning(
                WarningCode.PREFIX_LARGE_HIT_UNIT,
                f"prefix cache hits in {_fmt(facts.unit)}-token units: a prompt sent again "
                f"hits only from {_fmt(facts.min_shared_prefix)} tokens; {cause}",
            )
        )
    if facts.replay_tokens:
        out.append(PlanWarning(WarningCode.PREFIX_BOUNDED_REPLAY, _bounded_replay(facts, context)))
    repeated_only = _repeated_prompts_only(setup, facts)
    if repeated_only:
        out.append(PlanWarning(WarningCode.PREFIX_BOUNDARY_ONLY, repeated_only))
    return tuple(out)


def _repeated_prompts_only(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> str:
    """Why a request sharing only part of a stored prompt gets nothing, with the
    knob; "" where shorter shared prefixes hit. vLLM keeps a stored prompt's Mamba
    states and sliding-window blocks only near its replay boundary: a Mamba group
    then hits at that boundary alone, a window once the prompt outgrows it."""
    if not facts.boundary_only:
        return ""
    cacheable = [g for g in setup.groups if g.prefix_cacheable]
    if any(g.kind is GroupKind.MAMBA for g in cacheable):
        return (
            f"{REPEATED_PROMPTS_ONLY}: Mamba groups keep a request's state only where it "
            "ended (vLLM's 'align' Mamba cache mode, on with prefix caching); knob: none "
            "(vLLM runs Mamba in 'align' mode whenever prefix caching is on; "
            "--mamba-cache-mode cannot change it)"
        )
    windows = [g.window for g in cacheable if g.kind is GroupKind.SLIDING_WINDOW]
    if not windows or min(windows) >= SHORT_WINDOW_TOKENS:
        return ""
    return (
        f"{REPEATED_PROMPTS_ONLY} (once a stored prompt is longer than the "
        f"{_fmt(min(windows))}-token sliding window): sliding-window groups keep a "
        f"request's blocks only near where it ended; knob: {HYBRID_MANAGER_SWITCH} keeps "
        "every layer's whole context, at full attention's KV memory per token"
    )


def _bounded_replay(facts: PrefixCacheFacts, context: PrefixContext) -> str:
    """The scheduler's bounded replay, in words, with the knob where the release
    has one."""
    window = _fmt(facts.replay_tokens)
    knob = (
        f"{HYBRID_MANAGER_SWITCH} allocates the windows as full MLA, which replays "
        "nothing, at full attention's KV memory per token"
        if context.promotion_drops_bounded_replay
        else "none (the model's sliding-window MLA layers declare it; this release "
        "refuses to allocate them as full MLA)"
    )
    return (
        f"vLLM's scheduler recomputes the last {window} tokens of every prefix-cache hit "
        f"(bounded replay of the sliding-window MLA layers): hits of {window} tokens or "
        f"fewer serve nothing and longer ones {window} fewer (vLLM still reports the "
        f"whole hit as cached); a prompt sent again is served from "
        f"{_fmt(facts.min_shared_prefix)} tokens; knob: {knob}"
    )


@dataclass(frozen=True)
class WhatIf:
    shared_prefix: int
    prefix_stored: int  # the earlier request was exactly the prefix
    prefix_diverges: int  # the earlier request went on with other tokens
    # The request after the `prefix_diverges` one, sharing the prefix with both: it
    # can also hit the state the first kept at its shared-prefix junction.
    next_request: int


# How far the earlier request of the diverging case goes past the shared prefix,
# in hit units: far enough that its own end is not near the prefix.
DIVERGING_TAIL_UNITS = 4


def what_if(setup: PrefixCacheSetup, facts: PrefixCacheFacts, shared_prefix: int) -> WhatIf:
    """Cached tokens of a request going one hit unit (and the hash lookahead) past
    `shared_prefix` tokens that repeat an earlier request's: one that was exactly
    those tokens, and one that went on DIVERGING_TAIL_UNITS units past them; and,
    after the latter, of the next such request (each going on differently)."""
    unit = max(facts.unit, 1)
    request = shared_prefix + unit + setup.hash_lookahead
    diverging = shared_prefix + DIVERGING_TAIL_UNITS * unit + setup.hash_lookahead + 1
    return WhatIf(
        shared_prefix=shared_prefix,
        prefix_stored=cached_tokens(setup, shared_prefix, shared_prefix, request),
        prefix_diverges=cached_tokens(setup, shared_prefix, diverging, request),
        next_request=cached_tokens_after_junction(setup, shared_prefix, diverging, request),
    )


def what_if_step(setup: PrefixCacheSetup) -> int:
    """The finest step the what-if's simulation walks a prefix in: the hash block, or
    a cacheable group's block where finer (a sliding window's run search, a
    hidden-state cache's lookup). Its work grows with the shared prefix over this
    step, not over the hit unit (a 1-token hidden-state group beside 96-token
    attention: a 96-token unit, a 1-token step)."""
    blocks = [g.block_tokens for g in setup.groups if g.prefix_cacheable]
    return max(1, min([setup.hash_block, *blocks]))


def boundary_block(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> int:
    """The stride of a stored request's replay boundaries: the scheduler block
    (0 when off)."""
    return setup.scheduler_block if facts.on else 0


def mamba_checkpoint_strides(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> tuple[int, ...]:
    """The strides of the Mamba prefill checkpoint a stored request keeps under the
    draft drop (one hash block or Mamba block below its last whole one): one per
    distinct Mamba block, the hash block under partial hash hits. Empty without a
    drop or a Mamba group, and when a cacheable sliding-window group keeps only the
    replay boundaries' blocks (a checkpoint above them never hits it)."""
    cacheable = [g for g in setup.groups if g.prefix_cacheable]
    if not facts.on or not facts.drop_groups or not facts.boundary_only:
        return ()
    if any(g.kind is GroupKind.SLIDING_WINDOW for g in cacheable):
        return ()
    if setup.partial_hash_hits:
        return (setup.hash_block,)
    return tuple(sorted({g.block_tokens for g in cacheable if g.kind is GroupKind.MAMBA}))


def drop_windows(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> tuple[int, ...]:
    """Each dropping sliding-window spec whose block is finer than the hit unit: its
    window in whole blocks, in tokens, largest first (empty when none). While the
    others' hit is shorter, such a group's lookup (the hit and one block past it,
    against the window and the dropped block) finds no whole window: it runs from
    the first block, is cut to the unit, drops a block and is cut again, so the
    hit falls a unit back; the coordinator looks each spec up in turn, and each
    whose window is still longer than the hit takes its unit too."""
    if not facts.on:
        return ()
    windows: dict[int, int] = {}
    for i, g in enumerate(setup.groups):
        if (
            i in facts.drop_groups
            and g.prefix_cacheable
            and g.kind is GroupKind.SLIDING_WINDOW
            and g.block_tokens < facts.unit
        ):
            spec = g.spec_id if g.spec_id >= 0 else -1 - i
            whole = -(-(g.window - 1) // g.block_tokens) * g.block_tokens
            windows[spec] = max(windows.get(spec, 0), whole)
    return tuple(sorted(windows.values(), reverse=True))


def drop_window(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> int:
    """The largest of `drop_windows` (0 when none): the one whose fall back the
    rule takes first."""
    return max(drop_windows(setup, facts), default=0)


def reprefill_tail(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> int:
    """The tokens at a stored prompt's end a multi-module MTP drafter may prefill
    again, where they are not cached: by a single group, or by a cacheable group
    that drops beside others (0 otherwise, and 0 without such a drafter). Those
    groups cache a stored prompt of N tokens only up to N less these, so the
    rule's hit counts from there; groups that keep their last block beside
    others cache the whole prompt."""
    cacheable_drop = any(setup.groups[i].prefix_cacheable for i in facts.drop_groups)
    single = len(setup.groups) == 1
    return setup.reprefill_tokens if facts.on and (single or cacheable_drop) else 0


def shortest_window(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> int:
    """Where a stored request keeps sliding-window state only near its end and no
    Mamba group takes part: the shortest window of the cacheable sliding-window
    groups in whole blocks (tokens; 0 otherwise). A stored request whose last
    replay boundary is within it keeps every window block below that boundary,
    so a hit below the boundary (the reprefilled tail holds the reach there)
    still lands."""
    cacheable = [g for g in setup.groups if g.prefix_cacheable]
    if not facts.on or not facts.boundary_only:
        return 0
    if any(g.kind is GroupKind.MAMBA for g in cacheable):
        return 0
    return min(
        (
            -(-(g.window - 1) // g.block_tokens) * g.block_tokens
            for g in cacheable
            if g.kind is GroupKind.SLIDING_WINDOW
        ),
        default=0,
    )


def _coarse_groups(setup: PrefixCacheSetup, facts: PrefixCacheFacts, dropping: bool) -> list[int]:
    """Under partial hash hits, the cacheable full-attention-like groups whose block
    is coarser than the hash block that drop their last block (`dropping`) or keep
    it: their indices."""
    if not setup.partial_hash_hits or not facts.on:
        return []
    return [
        i
        for i, g in enumerate(setup.groups)
        if g.prefix_cacheable
        and g.kind in (GroupKind.FULL, GroupKind.OTHER)
        and g.block_tokens != setup.hash_block
        and (i in facts.drop_groups) == dropping
    ]


def coarse_block(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> int:
    """Under partial hash hits, where nothing in the lookup drops and state is kept
    past a stored request's end (not boundary-only): the lcm of the blocks of the
    coarse groups that keep their last block (0: none, or elsewhere). vLLM's
    full-attention lookup lands inside one of its blocks only at a stored
    request's last hash boundary short of its last token, so a hit that is not a
    multiple of this falls back to that boundary (the rule's
    floor(min(N - 1, hashed) / u) * u)."""
    if facts.drop_tokens or facts.boundary_only:
        return 0
    blocks = [setup.groups[i].block_tokens for i in _coarse_groups(setup, facts, False)]
    return math.lcm(*blocks) if blocks else 0


def _partial_hits_in_rule(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> bool:
    """Whether the rule's terms cover where partial hash hits let full attention
    land. vLLM's full-attention lookup lands inside one of its blocks only at a
    stored request's last hash boundary (its last token but one for a resend; the
    whole prompt for a dropping group, whose dropped hash block must end there).
    A coarse group (a block coarser than the hash block) that keeps its block
    then hits either the match or that boundary, or a multiple of its block.
    The rule's answer is still the hit where:

    * nothing in the lookup drops: the hit is the match where it is a multiple of
      every such block (`coarse_block`), else the resend's boundary, which every
      group takes (a Mamba / window group holding state only at the stored
      request's end takes nothing else);
    * something drops, and every coarse group that keeps its block is looked up
      before each dropping full-attention group: those coarse groups hit one hash
      block below the match or higher, the dropping group then cuts the hit to the
      rule's reach, and Mamba / window state is kept no higher than that.

    Not where such a coarse group is looked up after a dropping full-attention
    group: it cuts the hit to its block, the dropping group's next turn drops
    again, and the turns go on to the highest length both take, which only the
    simulation follows. Nor where a dropping coarse group meets a multi-module MTP
    drafter's reprefilled tail: whenever the tail reaches into the block holding
    the stored prompt's last hash boundary, the group does not cache that
    boundary and lands on its whole blocks only."""
    if not setup.partial_hash_hits or not facts.on:
        return True
    if reprefill_tail(setup, facts) and _coarse_groups(setup, facts, True):
        return False
    keeps = set(_coarse_groups(setup, facts, False))
    order = lookup_order(setup)
    keeps_coarse = [
        position for position, (ids, _) in enumerate(order) if any(i in keeps for i in ids)
    ]
    if not keeps_coarse:
        return True
    if setup.hash_lookahead >= 2 and setup.stored_output_tokens:
        # The stored request's output moves that boundary's key past where a
        # prompt reaches, for some prompt lengths (prefix_cache._tail_survives): the
        # coarse group then falls back to its whole blocks, which the rule's terms
        # do not state.
        return False
    if not facts.drop_tokens:
        return True
    dropping_full = [
        position
        for position, (ids, dropping) in enumerate(order)
        if dropping and setup.groups[ids[0]].kind in (GroupKind.FULL, GroupKind.OTHER)
    ]
    return max(keeps_coarse) < min(dropping_full, default=len(order))


def _lookahead_below_mamba(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> bool:
    """Whether lookahead hashes of several tokens (a multi-module MTP drafter, vLLM
    0.33+) can hold a hit below a stored request's replay boundary where a Mamba
    group holds no state the rule states: its prefill checkpoint sits at the
    hashed length floored to its block, which is the hit only where that block is
    the hit unit (or partial hash hits land on hash blocks); and beside a
    sliding-window group, whose kept blocks the rule follows only without Mamba
    (`shortest_window`)."""
    cacheable = [g for g in setup.groups if g.prefix_cacheable]
    mamba = [g for g in cacheable if g.kind is GroupKind.MAMBA]
    if not mamba:
        return False
    if any(g.kind is GroupKind.SLIDING_WINDOW for g in cacheable):
        return True
    return not setup.partial_hash_hits and any(g.block_tokens != facts.unit for g in mamba)


def rule_is_exact(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> bool:
    """Whether `rule_cached_tokens` is the simulation's answer for every N
    (tests/core/test_prefix_warnings.py checks it on random engines). Not where:

    * a draft drop beside a sliding-window group whose block is finer than the hit
      unit and whose window (drop_window) is two units or more, when another group
      that is not full attention (a Mamba group, another window) takes part too:
      the coordinator's turns between them move the hit in ways the rule's terms
      do not follow;
    * a window of one token (fuzz engines): under vLLM's sparse retention it keeps
      none or one block of a stored prompt, and the coordinator's turns decide;
    * retention every k tokens (`retention_interval` k > 0: a modelling option,
      no plan uses it) with sliding-window or Mamba groups; dense retention
      (None) keeps every block, and the rule covers it;
    * partial hash hits with a full-attention-like group whose block is coarser than
      the hash block and that keeps its block, looked up after a dropping
      full-attention group; or a dropping such group under a multi-module MTP
      drafter's reprefilled tail; or any such group under a hash lookahead of 2 or
      more once the stored request generated output, which moves that block's key
      (`_partial_hits_in_rule`);
    * a reprefilled tail beside a dropping sliding-window group finer than the
      hit unit, with state kept only near a stored request's end: the tail can
      hold the hit at the replay boundary below the last, where the window's
      fall back lands on blocks the rule does not follow;
    * lookahead hashes of several tokens (vLLM 0.33+'s multi-module MTP) with
      state kept only near a stored request's end, beside a Mamba group whose
      block is not the hit unit or beside Mamba and sliding-window groups
      together (`_lookahead_below_mamba`);
    * a Mamba group whose block, or the hit unit, is coarser than the block the
      scheduler ends prefill chunks on: its states exist only where a chunk ends,
      which depends on the stored prompt's length and the chunk budget
      (`PrefillChunks`). A 16-token Mamba block beside 32-token full attention
      (conformance reference/r17): a 51-token prompt is prefilled to 48 in one
      chunk, no state is written at the unit boundary 32, and it hits 0.
    * Mamba prefill checkpoint blocks under the draft drop: whether the backend
      writes the (dropped) checkpoint inside a prompt's last chunk depends on where
      that chunk starts, which the rule's terms do not state;
    * under partial hash hits, a Mamba group that takes the draft drop beside a
      reprefilled tail: its prefill checkpoint inside a block (one hash block
      below the prompt's end) lies inside the tail, where the rule caps the reach,
      yet the simulation keeps it (a state vLLM's Mamba manager keys by its
      position; found by the random engines of test_prefix_warnings, not seen in a
      plan: vLLM 0.33+ hashes a lookahead instead of dropping)."""
    if setup.mamba_checkpoint_alignment and setup.block_drop:
        return False
    if (
        setup.partial_hash_hits
        and reprefill_tail(setup, facts)
        and any(
            setup.groups[i].kind is GroupKind.MAMBA and setup.groups[i].prefix_cacheable
            for i in facts.drop_groups
        )
    ):
        return False
    if setup.prefill_chunk_tokens and any(
        g.kind is GroupKind.MAMBA
        and g.prefix_cacheable
        and max(g.block_tokens, facts.unit) > setup.split_block
        for g in setup.groups
    ):
        return False
    cacheable = [g for g in setup.groups if g.prefix_cacheable]
    sparse = [g for g in cacheable if g.kind in (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA)]
    if sparse and setup.retention_interval not in (0, None):
        return False
    if not _partial_hits_in_rule(setup, facts):
        return False
    if any(g.kind is GroupKind.SLIDING_WINDOW and g.window <= 1 for g in sparse):
        return False
    if facts.boundary_only and setup.hash_lookahead > 1 and _lookahead_below_mamba(setup, facts):
        return False
    if facts.boundary_only and reprefill_tail(setup, facts) and drop_windows(setup, facts):
        # The tail can hold the reach below the last replay boundary, to the one
        # below it, whose window blocks may still reach the first block when the
        # last one's do not: the finer window's fall back then lands where the
        # rule's terms (anchored at the last boundary) say 0.
        return False
    finer = facts.drop_groups and any(
        g.kind is GroupKind.SLIDING_WINDOW and g.block_tokens < facts.unit for g in sparse
    )
    if finer:
        # Exact beside full attention alone (the other groups are one spec), or
        # where the window's fall back can only empty the hit: a stored request
        # within the window then ends under two units, so the hit a unit below its
        # last boundary is 0, which the other groups' turns leave at 0.
        return (
            len(sparse) == 1
            or (sparse[0].spec_id >= 0 and len({g.spec_id for g in sparse}) == 1)
            or drop_window(setup, facts) < 2 * facts.unit
        )
    return True


def rule_cached_tokens(setup: PrefixCacheSetup, facts: PrefixCacheFacts, shared_prefix: int) -> int:
    """The closed-form rule the PlanResponse states (PrefixCacheDiagnostics) for a
    request continuing an earlier one that was exactly `shared_prefix` tokens:
    exact where `rule_is_exact` (tests/core/test_prefix_warnings.py checks it
    against `cached_tokens`), an estimate elsewhere: the KV cache manager's hit,
    less the scheduler's bounded-replay window (`served_after_replay`). Mirrors
    kvplan.client.prefix_cache.cached_tokens term for term."""
    if not facts.on or shared_prefix < facts.min_shared_prefix:
        return 0
    return served_after_replay(setup, _rule_manager_hit(setup, facts, shared_prefix))


def _rule_manager_hit(setup: PrefixCacheSetup, facts: PrefixCacheFacts, shared_prefix: int) -> int:
    """`rule_cached_tokens` before the bounded replay: the KV cache manager's hit."""
    n, unit = shared_prefix, facts.unit
    h = setup.hash_block
    hashed = max(0, n - setup.hash_lookahead) // h * h
    # Where the hit lands inside a coarse block that keeps its last block: only at
    # the stored request's last hash boundary short of its last token.
    resend = max(0, min(n - 1, hashed) // unit * unit)
    coarse = coarse_block(setup, facts)
    # What the stored request's groups cache: all but a reprefilled tail.
    cached = n - reprefill_tail(setup, facts)
    if not facts.drop_groups:
        base = n - 1 if facts.boundary_only else n
        hit = max(0, min(base, cached, hashed) // unit * unit)
        boundary = (n - 1) // unit * unit  # the stored request's replay boundary
        short = shortest_window(setup, facts)
        if short and hit < boundary and boundary > short:
            # Lookahead hashes hold the hit below the boundary, where the windows'
            # kept blocks (anchored there) no longer reach back to the first block.
            return 0
        return resend if coarse and hit % coarse else hit
    # The dropped block must be matched too, and hits stay whole units.
    reach = (min(cached, hashed) - facts.drop_tokens) // unit * unit
    windows = drop_windows(setup, facts) or (0,)
    if not facts.boundary_only:
        hit = resend if coarse and reach % coarse else reach
        # Every window block kept (dense retention): a hit shorter than a finer
        # dropping window still falls a unit back per such spec.
        for drop_window_tokens in windows:
            if 0 < hit < drop_window_tokens:
                hit -= unit
        return max(0, hit)
    # Window / Mamba state only where the stored request was kept: its replay
    # boundaries (one boundary lower under the drop) and its Mamba checkpoint.
    s = boundary_block(setup, facts)
    last_boundary = n // s * s - s
    kept = [last_boundary, (n - 1) // s * s - s]
    checkpoints = {n // c * c - c for c in mamba_checkpoint_strides(setup, facts)}
    if len(checkpoints) == 1:
        kept.extend(checkpoints)
    if reach < last_boundary <= shortest_window(setup, facts):
        # Every window still holds the stored request's first block at its last
        # boundary: it keeps every block below, and the reach lands.
        kept.append(reach)
    hit = max((x for x in kept if 0 < x <= reach and x % unit == 0), default=0)
    window, *further = windows
    if hit and hit < window:
        # The finer window's lookup from the first block (hit / b + 1 blocks, short
        # of the window's blocks and the dropped one): a unit below the reach and
        # the last boundary, and only while the window holds that boundary.
        if last_boundary > window:
            return 0
        hit = max(0, min(hit, reach - unit, last_boundary - unit))
        # Each further such spec, looked up in its turn, takes a unit more while
        # its window is longer than the hit.
        for other in further:
            if 0 < hit < other:
                hit -= unit
    return hit


__all__ = [
    "LARGE_HIT_UNIT_TOKENS",
    "REPEATED_PROMPTS_ONLY",
    "SHORT_WINDOW_TOKENS",
    "PrefixContext",
    "WhatIf",
    "boundary_block",
    "coarse_block",
    "drop_window",
    "drop_windows",
    "mamba_checkpoint_strides",
    "off_detail",
    "prefix_warnings",
    "reprefill_tail",
    "rule_cached_tokens",
    "rule_is_exact",
    "shortest_window",
    "what_if",
    "what_if_step",
]
