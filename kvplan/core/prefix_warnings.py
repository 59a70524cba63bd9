"""Prefix-cache setups that lose hits, named with a warning code and the knob that
fixes each, and the what-if answer for a shared prefix of N tokens: pure functions
over kvplan.core.prefix_cache's setup and facts (docs/prefix-caching.md, "Where
kvplan shows it")."""

from __future__ import annotations

from dataclasses import dataclass

from kvplan.core.diagnostics import PlanWarning, WarningCode
from kvplan.core.prefix_cache import (
    GroupKind,
    PrefixCacheFacts,
    PrefixCacheSetup,
    WhyOff,
    cached_tokens,
)

# A hit unit from here up is worth a warning: a system prompt or a chat turn is
# often shorter, and then never hits.
LARGE_HIT_UNIT_TOKENS = 256

# vLLM's names for the knobs (checked in the 0.32, 0.33 and 0.34 sources).
DRAFT_DROP_SWITCH = 'speculative_config {"disable_eagle_block_drop": true}'
PREFIX_CACHING_SWITCH = "--enable-prefix-caching (options.enable_prefix_caching)"
BLOCK_SIZE_KNOB = "--block-size (options.block_size)"


@dataclass(frozen=True)
class PrefixContext:
    """What the warnings need beyond the setup: from the request."""

    spec_decode: bool  # a drafter runs (EAGLE family)
    drafter_flagged: bool  # some group was identified as the drafter's
    asked_off: bool = False  # the request itself turned prefix caching off
    why_off_detail: str = ""


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
                f"its last matched block: shared prefixes under {_fmt(facts.min_shared_prefix)} "
                "tokens never hit; knob: mark the drafter's layers is_draft (LayerSpec.is_draft)",
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
                f"prefix cache hits in {_fmt(facts.unit)}-token units: shared prefixes under "
                f"{_fmt(facts.min_shared_prefix)} tokens never hit; {cause}",
            )
        )
    if facts.boundary_only and any(g.kind is GroupKind.MAMBA for g in setup.groups):
        out.append(
            PlanWarning(
                WarningCode.PREFIX_BOUNDARY_ONLY,
                "Mamba groups keep a request's state only where it ended (vLLM's 'align' "
                "Mamba cache mode, on with prefix caching): a prefix shared by requests that "
                "go on with different text hits only where an earlier request ended; "
                "knob: none (vLLM runs Mamba in 'align' mode whenever prefix caching is on; "
                "--mamba-cache-mode cannot change it)",
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class WhatIf:
    shared_prefix: int
    prefix_stored: int  # the earlier request was exactly the prefix
    prefix_diverges: int  # the earlier request went on with other tokens


# How far the earlier request of the diverging case goes past the shared prefix,
# in hit units: far enough that its own end is not near the prefix.
DIVERGING_TAIL_UNITS = 4


def what_if(setup: PrefixCacheSetup, facts: PrefixCacheFacts, shared_prefix: int) -> WhatIf:
    """Cached tokens of a request going one hit unit (and the hash lookahead) past
    `shared_prefix` tokens that repeat an earlier request's: one that was exactly
    those tokens, and one that went on DIVERGING_TAIL_UNITS units past them."""
    unit = max(facts.unit, 1)
    request = shared_prefix + unit + setup.hash_lookahead
    diverging = shared_prefix + DIVERGING_TAIL_UNITS * unit + setup.hash_lookahead + 1
    return WhatIf(
        shared_prefix=shared_prefix,
        prefix_stored=cached_tokens(setup, shared_prefix, shared_prefix, request),
        prefix_diverges=cached_tokens(setup, shared_prefix, diverging, request),
    )


def rule_is_exact(setup: PrefixCacheSetup, facts: PrefixCacheFacts) -> bool:
    """Whether `rule_cached_tokens` is the simulation's answer for every N: all but a
    draft drop beside sliding-window or Mamba groups (there the coordinator's turns
    depend on which window blocks and Mamba states are kept). `drop_groups`, not
    `drop_tokens`: a dropping Mamba group takes no tokens off the minimum prefix
    yet still shapes the hit."""
    if facts.drop_groups and setup.reprefill_tokens:
        return False  # the reprefilled tail the drop comes with: not in the rule
    return not facts.drop_groups or all(
        g.kind not in (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA)
        for g in setup.groups
        if g.prefix_cacheable
    )


def rule_cached_tokens(setup: PrefixCacheSetup, facts: PrefixCacheFacts, shared_prefix: int) -> int:
    """The closed-form rule the PlanResponse states (PrefixCacheDiagnostics) for a
    request continuing an earlier one that was exactly `shared_prefix` tokens:
    exact where `rule_is_exact` (tests/core/test_prefix_warnings.py checks it
    against `cached_tokens`), an estimate elsewhere."""
    n, unit = shared_prefix, facts.unit
    if not facts.on or n < facts.min_shared_prefix:
        return 0
    h = setup.hash_block
    hashed = max(0, n - setup.hash_lookahead) // h * h
    if facts.drop_tokens:
        # The dropped block must be matched too, and hits stay whole units.
        hit = (min(n, hashed) - facts.drop_tokens) // unit * unit
        if facts.boundary_only:  # the stored request's last state, one unit back
            hit = min(hit, n // unit * unit - unit)
        return max(0, hit)
    base = n - 1 if facts.boundary_only else n
    return max(0, min(base, hashed) // unit * unit)


__all__ = [
    "LARGE_HIT_UNIT_TOKENS",
    "PrefixContext",
    "WhatIf",
    "off_detail",
    "prefix_warnings",
    "rule_cached_tokens",
    "rule_is_exact",
    "what_if",
]
