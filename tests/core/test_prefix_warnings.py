"""kvplan.core.prefix_warnings: the closed-form rule the PlanResponse states agrees
with the core's simulation (kvplan.core.prefix_cache.cached_tokens) wherever it
says it is exact, and each lossy setup is named with its code and knob."""

from __future__ import annotations

import math
import os
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.client.prefix_cache import cached_tokens as client_cached_tokens
from kvplan.convert.render import prefix_rule_to_proto
from kvplan.core.diagnostics import WarningCode
from kvplan.core.prefix_cache import (
    CacheGroup,
    GroupKind,
    PrefixCacheSetup,
    cached_tokens,
    cached_tokens_after_junction,
    facts,
)
from kvplan.core.prefix_warnings import (
    DRAFT_DROP_SWITCH,
    PrefixContext,
    prefix_warnings,
    rule_cached_tokens,
    rule_is_exact,
    what_if,
    what_if_step,
)
from kvplan.v1 import plan_pb2
from tests.core.test_prefix_cache import setups


def _examples(default: int) -> int:
    """Random engines per run: KVPLAN_RULE_EXAMPLES=5000 (with pytest --timeout=0)
    for a wider check by hand."""
    return int(os.environ.get("KVPLAN_RULE_EXAMPLES", default))


@settings(max_examples=_examples(200), deadline=None)
@given(setups(), st.integers(0, 700), st.integers(1, 64))
def test_the_stated_rule_is_the_simulation_where_it_says_it_is_exact(
    setup: PrefixCacheSetup, shared: int, tail: int
) -> None:
    f = facts(setup)
    if not rule_is_exact(setup, f):
        return  # the response says it is an estimate there (rule_exact false)
    assert rule_cached_tokens(setup, f, shared) == cached_tokens(
        setup, shared, shared, shared + tail
    )


@st.composite
def planned_setups(draw: st.DrawFn) -> PrefixCacheSetup:
    """Engines as plans describe them: vLLM's sparse retention, one to four groups
    of full attention, sliding window (one-token windows too), Mamba and the other
    kinds looked up as full attention, with blocks that need not divide each other,
    groups of one spec, groups that take no part in prefix caching, the draft drop or
    hash lookahead, partial hash hits where vLLM allows them (a Mamba block
    coarser than the hash block, any sliding window's block the hash block), and
    the scheduler's bounded replay."""
    count = draw(st.integers(1, 4))
    groups: list[CacheGroup] = []
    for index in range(count):
        if groups and draw(st.integers(0, 3)) == 0:
            groups.append(draw(st.sampled_from(groups)))  # another group of one spec
            continue
        kind = draw(
            st.sampled_from([GroupKind.FULL])
            if index == 0
            else st.sampled_from(
                [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA, GroupKind.OTHER]
            )
        )
        window = draw(st.sampled_from([1, 16, 64, 128, 1024]))
        groups.append(
            CacheGroup(
                kind=kind,
                block_tokens=draw(st.sampled_from([16, 32, 48, 64, 80])),
                is_draft=draw(st.booleans()),
                prefix_cacheable=index == 0 or draw(st.integers(0, 4)) > 0,
                window=window if kind is GroupKind.SLIDING_WINDOW else 0,
                spec_id=index,
            )
        )
    blocks = [g.block_tokens for g in groups]
    scheduler = math.lcm(*blocks)
    hash_block = math.gcd(*blocks) if count > 1 else scheduler
    partial = False
    if count > 1 and draw(st.booleans()):
        finer = draw(st.sampled_from([d for d in (1, 4, 8, 16) if hash_block % d == 0]))
        partial = any(g.kind is GroupKind.MAMBA and g.block_tokens > finer for g in groups) and all(
            g.kind is not GroupKind.SLIDING_WINDOW or g.block_tokens == finer for g in groups
        )
        hash_block = finer if partial else hash_block
    drop = draw(st.booleans())
    return PrefixCacheSetup(
        enabled=True,
        groups=tuple(groups),
        scheduler_block=scheduler,
        hash_block=hash_block,
        partial_hash_hits=partial,
        block_drop=drop,
        # vLLM hashes the drafter's lookahead or drops a block, never both.
        hash_lookahead=0 if drop else draw(st.sampled_from([0, 1])),
        # Bounded replay (a DeepSeek-V4.1 window beside the groups), not a multiple
        # of the unit too.
        replay_window=draw(st.sampled_from([0, 0, 0, 16, 100, 128])),
    )


@st.composite
def rule_engines(draw: st.DrawFn) -> PrefixCacheSetup:
    """The engines the client's rule is checked on: `planned_setups` and
    test_prefix_cache's `setups` (dense retention too, the drop beside lookahead
    hashes), with a multi-module MTP drafter's lookahead hashes of several tokens
    where nothing drops (vLLM 0.33+: its lookahead), and its reprefilled tail (the
    lookahead less one, or any) or none."""
    setup = draw(st.one_of(planned_setups(), setups()))
    lookahead = setup.hash_lookahead
    if not setup.block_drop:
        lookahead = draw(st.sampled_from([lookahead, lookahead, 2, 3, 5]))
    tail = draw(st.sampled_from([0, 0, 1, 2, 5, max(0, lookahead - 1)]))
    return replace(setup, hash_lookahead=lookahead, reprefill_tokens=tail)


def rule_check_lengths(prefix_cache: plan_pb2.PrefixCacheDiagnostics, below: int) -> list[int]:
    """Every N below `below`, and N around the lengths the rule turns at further on:
    each of 12 units (and the units past the minimum), the minimum, the drop, the
    replay window and the boundary stride, just under, at and just over each."""
    unit = prefix_cache.hit_unit_tokens or 1
    low = prefix_cache.min_shared_prefix_tokens
    marks = [low, prefix_cache.drop_tokens, prefix_cache.replay_tokens]
    marks += [k * unit for k in range(1, 13)] + [low + k * unit for k in range(1, 13)]
    marks += [k * prefix_cache.boundary_block_tokens for k in range(1, 13)]
    near = {m + d for m in marks for d in range(-2, 3)}
    return sorted(set(range(below)) | {n for n in near if n >= 0})


# Engines whose stated rule was checked for every N up to this many tokens.
RULE_CHECK_TOKENS = 1_200
rule_checks = {"engines": 0, "exact": 0, "with_drop_and_sparse": 0}


@settings(max_examples=_examples(150), deadline=None)
@given(rule_engines(), st.integers(1, 64))
def test_the_clients_rule_is_the_simulation_for_every_n_where_it_says_exact(
    setup: PrefixCacheSetup, tail: int
) -> None:
    f = facts(setup)
    prefix_cache = plan_pb2.PrefixCacheDiagnostics()
    prefix_rule_to_proto(setup, f, list(range(len(setup.groups))), prefix_cache)
    rule_checks["engines"] += 1
    if not prefix_cache.rule_exact:
        return  # an estimate: the what-if answers
    rule_checks["exact"] += 1
    if f.drop_groups and f.boundary_only:
        rule_checks["with_drop_and_sparse"] += 1
    for n in rule_check_lengths(prefix_cache, RULE_CHECK_TOKENS):
        expected = cached_tokens(setup, n, n, n + tail)
        assert client_cached_tokens(prefix_cache, n) == expected, n
        assert rule_cached_tokens(setup, f, n) == expected, n


def _qwen_like(block_drop: bool, flagged: bool) -> PrefixCacheSetup:
    groups = (
        CacheGroup(GroupKind.MAMBA, 2096, False),
        CacheGroup(GroupKind.FULL, 2096, flagged),
    )
    return PrefixCacheSetup(True, groups, 2096, 2096, False, block_drop)


def _codes(setup: PrefixCacheSetup, spec_decode: bool = True) -> dict[WarningCode, str]:
    context = PrefixContext(
        spec_decode=spec_decode, drafter_flagged=any(g.is_draft for g in setup.groups)
    )
    return {w.code: w.message for w in prefix_warnings(setup, facts(setup), context)}


def test_an_unidentified_drafter_names_is_draft() -> None:
    codes = _codes(_qwen_like(block_drop=True, flagged=False))
    assert "is_draft" in codes[WarningCode.PREFIX_UNIDENTIFIED_DRAFTER]
    assert "hits only from 4,192 tokens" in codes[WarningCode.PREFIX_UNIDENTIFIED_DRAFTER]
    assert WarningCode.PREFIX_DRAFT_DROP not in codes


def test_a_flagged_drafter_names_the_release_switch_and_the_unit() -> None:
    codes = _codes(_qwen_like(block_drop=True, flagged=True))
    assert WarningCode.PREFIX_UNIDENTIFIED_DRAFTER not in codes
    assert DRAFT_DROP_SWITCH in codes[WarningCode.PREFIX_DRAFT_DROP]
    assert "2,096-token units" in codes[WarningCode.PREFIX_LARGE_HIT_UNIT]
    assert "Mamba state" in codes[WarningCode.PREFIX_LARGE_HIT_UNIT]
    assert "only where it ended" in codes[WarningCode.PREFIX_BOUNDARY_ONLY]


def test_plain_attention_gets_no_prefix_warning_and_a_large_block_names_block_size() -> None:
    small = PrefixCacheSetup(True, (CacheGroup(GroupKind.FULL, 16, False),), 16, 16, False, False)
    assert _codes(small, spec_decode=False) == {}
    large = PrefixCacheSetup(
        True, (CacheGroup(GroupKind.FULL, 512, False),), 512, 512, False, False
    )
    assert "smaller --block-size" in _codes(large, False)[WarningCode.PREFIX_LARGE_HIT_UNIT]


def test_off_is_named_with_its_switch_unless_asked_for() -> None:
    off = PrefixCacheSetup(False, (CacheGroup(GroupKind.FULL, 16, False),), 16, 16, False, False)
    (message,) = _codes(off, False).values()
    assert "disabled" in message and "--enable-prefix-caching" in message
    asked = PrefixContext(spec_decode=False, drafter_flagged=False, asked_off=True)
    assert prefix_warnings(off, facts(off), asked) == ()


def test_what_if_separates_a_stored_prefix_from_a_diverging_one() -> None:
    setup = _qwen_like(block_drop=False, flagged=True)
    answer = what_if(setup, facts(setup), 3 * 2096)
    assert answer.prefix_stored == cached_tokens(setup, 3 * 2096, 3 * 2096, 4 * 2096)
    # Mamba state only at the earlier request's end: a diverging one never hits here.
    assert answer.prefix_diverges == 0 < answer.prefix_stored
    # The first diverging request's groups part at 3 units (full attention hits them,
    # Mamba does not): it keeps its Mamba state there, and the next request hits all 3.
    assert answer.next_request == 3 * 2096
    assert answer.next_request == cached_tokens_after_junction(
        setup, 3 * 2096, 3 * 2096 + 4 * 2096 + 1, 4 * 2096
    )


@settings(max_examples=_examples(300), deadline=None)
@given(planned_setups(), st.integers(0, 1500))
def test_the_next_request_never_gets_less_and_gains_only_from_kept_state(
    setup: PrefixCacheSetup, shared: int
) -> None:
    """The next request can hit what the first one kept (Mamba / sliding-window state
    at its junction, its last hash boundary under partial hash hits); where every
    cacheable group is full attention hitting whole blocks, nothing new is kept."""
    answer = what_if(setup, facts(setup), shared)
    assert answer.next_request >= answer.prefix_diverges
    whole_blocks_only = not setup.partial_hash_hits and all(
        g.kind in (GroupKind.FULL, GroupKind.OTHER) for g in setup.groups if g.prefix_cacheable
    )
    if whole_blocks_only:
        assert answer.next_request == answer.prefix_diverges


def test_the_what_if_step_is_the_finest_block_the_simulation_walks() -> None:
    attention = CacheGroup(GroupKind.FULL, 96, False)
    hidden = CacheGroup(GroupKind.OTHER, 1, False)
    window = CacheGroup(GroupKind.SLIDING_WINDOW, 96, False, window=1024)
    # A 1-token hidden-state cache beside 96-token attention: 96-token hits, 1-token steps.
    fine = PrefixCacheSetup(True, (attention, window, hidden), 96, 1, False, False)
    assert facts(fine).unit == 96 and what_if_step(fine) == 1
    # A finer group outside prefix caching is never looked up: the hash block decides.
    outside = CacheGroup(GroupKind.OTHER, 1, False, prefix_cacheable=False)
    coarse = PrefixCacheSetup(True, (attention, window, outside), 96, 96, False, False)
    assert what_if_step(coarse) == 96


def test_a_finer_dropping_window_needs_its_window_in_the_rule() -> None:
    # gpt-oss-like groups with the window's blocks finer than the unit, every group
    # dropping (an unflagged drafter): the stated window keeps the rule exact, and
    # without it the rule would promise hits the manager does not give.
    groups = (
        CacheGroup(GroupKind.FULL, 32, False),
        CacheGroup(GroupKind.SLIDING_WINDOW, 16, False, window=128),
    )
    setup = PrefixCacheSetup(True, groups, 32, 16, False, True)
    f = facts(setup)
    prefix_cache = plan_pb2.PrefixCacheDiagnostics()
    prefix_rule_to_proto(setup, f, [0, 1], prefix_cache)
    assert prefix_cache.rule_exact and prefix_cache.drop_window_tokens == 128
    simulated = [cached_tokens(setup, n, n, n + 1) for n in range(2_000)]
    assert [client_cached_tokens(prefix_cache, n) for n in range(2_000)] == simulated
    prefix_cache.drop_window_tokens = 0
    assert [client_cached_tokens(prefix_cache, n) for n in range(2_000)] != simulated


def _client_rule(setup: PrefixCacheSetup) -> plan_pb2.PrefixCacheDiagnostics:
    prefix_cache = plan_pb2.PrefixCacheDiagnostics()
    prefix_rule_to_proto(setup, facts(setup), list(range(len(setup.groups))), prefix_cache)
    return prefix_cache


def test_a_finer_window_beside_a_group_outside_prefix_caching_follows_the_run_search() -> None:
    # Every group drops (no drafter flagged); the coarse group takes no part. The
    # window's run from the first block is short of its blocks and the dropped one
    # until the hit reaches the window: the hit falls a unit back before that.
    groups = (
        CacheGroup(GroupKind.FULL, 16, False, spec_id=0),
        CacheGroup(GroupKind.SLIDING_WINDOW, 16, False, window=64, spec_id=1),
        CacheGroup(GroupKind.FULL, 32, False, prefix_cacheable=False, spec_id=2),
    )
    setup = PrefixCacheSetup(True, groups, 32, 16, False, True)
    prefix_cache = _client_rule(setup)
    assert prefix_cache.rule_exact and prefix_cache.drop_window_tokens == 64
    for tail in (1, 17, 64):
        simulated = [cached_tokens(setup, n, n, n + tail) for n in range(1_500)]
        assert [client_cached_tokens(prefix_cache, n) for n in range(1_500)] == simulated


def test_partial_hash_hits_beside_a_coarse_group_that_keeps_its_block() -> None:
    # Full attention lands inside its 64-token block only at a stored request's last
    # hash boundary. A coarse group that keeps its block, looked up after a dropping
    # one, cuts the hit to its block: not the rule's, and the response says so. Looked
    # up first, or dropping too, it leaves the rule exact.
    def setup(coarse_first: bool, coarse_drafts: bool) -> PrefixCacheSetup:
        coarse = CacheGroup(GroupKind.FULL, 64, coarse_drafts, spec_id=0)
        fine = CacheGroup(GroupKind.FULL, 16, True, spec_id=1)
        mamba = CacheGroup(GroupKind.MAMBA, 64, False, prefix_cacheable=False, spec_id=2)
        groups = (coarse, fine, mamba) if coarse_first else (fine, coarse, mamba)
        return PrefixCacheSetup(True, groups, 64, 8, True, True)

    ns = range(1_000)
    for coarse_first, coarse_drafts in ((False, False), (True, False), (False, True)):
        engine = setup(coarse_first, coarse_drafts)
        rule = _client_rule(engine)
        simulated = [cached_tokens(engine, n, n, n + 1) for n in ns]
        stated = [client_cached_tokens(rule, n) for n in ns]
        assert rule.rule_exact == (coarse_first or coarse_drafts)
        assert (stated == simulated) == rule.rule_exact, (coarse_first, coarse_drafts)


def test_a_finer_window_beside_mamba_is_exact_while_its_fall_back_can_only_empty_the_hit() -> None:
    # Every group drops. A window under two units: a stored request within it ends
    # under two units, so its fall back empties the hit and the rule is exact. A
    # longer window falls back to a length the Mamba group holds no state at.
    def setup(window_block: int, window: int) -> PrefixCacheSetup:
        groups = (
            CacheGroup(GroupKind.FULL, 64, False, spec_id=0),
            CacheGroup(GroupKind.SLIDING_WINDOW, window_block, False, window=window, spec_id=1),
            CacheGroup(GroupKind.MAMBA, 64, False, spec_id=2),
        )
        return PrefixCacheSetup(True, groups, math.lcm(64, window_block), 16, False, True)

    ns = range(1_600)
    for engine, exact in ((setup(16, 64), True), (setup(48, 1024), False)):
        rule = _client_rule(engine)
        assert rule.rule_exact == exact and rule.drop_window_tokens > 0
        simulated = [cached_tokens(engine, n, n, n + 1) for n in ns]
        assert ([client_cached_tokens(rule, n) for n in ns] == simulated) == exact


def test_each_dropping_window_of_its_own_spec_takes_its_unit_off_the_minimums_hit() -> None:
    """Full attention (80-token blocks) beside three sliding-window specs of a
    1,024-token window (48, 16 and 48-token blocks, the first and last the
    drafter's): a 240-token unit. A 960-token prompt sent again (the minimum)
    hits 240: full attention 960, the first dropping window falls back to 480,
    the second to 240. The rule stated only one fall back (480); the plan now
    names the second window (further_drop_window_tokens) and the client's rule
    takes its unit too. Still an estimate elsewhere (rule_exact false)."""
    groups = (
        CacheGroup(GroupKind.FULL, 80, False, spec_id=0),
        CacheGroup(GroupKind.SLIDING_WINDOW, 48, True, window=1024, spec_id=1),
        CacheGroup(GroupKind.SLIDING_WINDOW, 16, False, window=1024, spec_id=2),
        CacheGroup(GroupKind.SLIDING_WINDOW, 48, True, window=1024, spec_id=3),
    )
    setup = PrefixCacheSetup(True, groups, 240, 16, False, True)
    f = facts(setup)
    prefix_cache = plan_pb2.PrefixCacheDiagnostics()
    prefix_rule_to_proto(setup, f, list(range(len(groups))), prefix_cache)
    assert not prefix_cache.rule_exact and f.min_shared_prefix == 960
    assert (prefix_cache.drop_window_tokens, list(prefix_cache.further_drop_window_tokens)) == (
        1056,
        [1056],
    )
    n = f.min_shared_prefix
    assert cached_tokens(setup, n, n, n + 1) == 240
    assert client_cached_tokens(prefix_cache, n) == rule_cached_tokens(setup, f, n) == 240
    prefix_cache.ClearField("further_drop_window_tokens")  # a plan without the field
    assert client_cached_tokens(prefix_cache, n) == 480


def _every_n_agrees(setup: PrefixCacheSetup, prefix_cache: plan_pb2.PrefixCacheDiagnostics) -> bool:
    ns = rule_check_lengths(prefix_cache, 1_500)
    return all(
        client_cached_tokens(prefix_cache, n) == cached_tokens(setup, n, n, n + 1) for n in ns
    )


def test_dense_retention_takes_the_finer_dropping_windows_fall_back_too() -> None:
    # Every window block kept (retention_interval None, a modelling option): full
    # attention of 64-token blocks beside a dropping 1,024-token window of 16-token
    # blocks. A hit shorter than the window still falls a unit back (128 -> 64 at
    # N = 145), which the rule took only for state kept near a prompt's end.
    groups = (
        CacheGroup(GroupKind.FULL, 64, False, spec_id=0),
        CacheGroup(GroupKind.SLIDING_WINDOW, 16, True, window=1024, spec_id=1),
    )
    setup = PrefixCacheSetup(True, groups, 64, 16, False, True, retention_interval=None)
    prefix_cache = _client_rule(setup)
    assert prefix_cache.rule_exact and not prefix_cache.boundary_only
    assert prefix_cache.drop_window_tokens == 1024
    assert cached_tokens(setup, 145, 145, 146) == client_cached_tokens(prefix_cache, 145) == 64
    assert (
        cached_tokens(setup, 1100, 1100, 1101) == client_cached_tokens(prefix_cache, 1100) == 1024
    )
    assert _every_n_agrees(setup, prefix_cache)


def test_a_reprefilled_tail_is_counted_off_the_groups_that_do_not_cache_it() -> None:
    # A multi-module MTP drafter (2 tokens prefilled again) under the draft drop:
    # the dropping full-attention groups cache a stored prompt only up to N - 2, so
    # a 49-token prompt sent again reaches 16, below its last replay boundary (32).
    # The 64-token window beside them still holds the prompt's first block there,
    # so every block below it, and 16 lands. At N = 97 the reach (64) is below the
    # boundary (80) too, but the window no longer holds the first block: 0.
    groups = (
        CacheGroup(GroupKind.FULL, 16, True, spec_id=0),
        CacheGroup(GroupKind.FULL, 16, True, spec_id=0),
        CacheGroup(GroupKind.SLIDING_WINDOW, 16, False, window=64, spec_id=2),
    )
    setup = PrefixCacheSetup(True, groups, 16, 16, False, True, reprefill_tokens=2)
    prefix_cache = _client_rule(setup)
    assert prefix_cache.rule_exact and prefix_cache.reprefill_tokens == 2
    assert prefix_cache.shortest_window_tokens == 64
    assert cached_tokens(setup, 49, 49, 50) == client_cached_tokens(prefix_cache, 49) == 16
    assert cached_tokens(setup, 97, 97, 98) == client_cached_tokens(prefix_cache, 97) == 0
    assert _every_n_agrees(setup, prefix_cache)
    prefix_cache.shortest_window_tokens = 0  # a plan without the field
    assert client_cached_tokens(prefix_cache, 49) == 0
    prefix_cache.reprefill_tokens = 0
    assert client_cached_tokens(prefix_cache, 97) == 80
    # Without the drop the groups beside others cache the whole prompt: no tail.
    keeps = replace(setup, block_drop=False)
    assert _client_rule(keeps).reprefill_tokens == 0


def test_partial_hash_hits_with_nothing_dropping_land_inside_a_coarse_block_at_the_resend() -> None:
    # Full attention of 48-token blocks beside a Mamba group outside prefix caching,
    # 1-token hash blocks: full attention lands inside a block only at the stored
    # prompt's last hash boundary short of its last token. A 100-token prompt sent
    # again hits 99; a 96-token one, a whole block, hits 96.
    groups = (
        CacheGroup(GroupKind.FULL, 48, False),
        CacheGroup(GroupKind.MAMBA, 48, False, prefix_cacheable=False),
    )
    setup = PrefixCacheSetup(True, groups, 48, 1, True, False)
    prefix_cache = _client_rule(setup)
    assert prefix_cache.rule_exact and prefix_cache.coarse_block_tokens == 48
    assert [client_cached_tokens(prefix_cache, n) for n in (96, 97, 100)] == [96, 96, 99]
    assert [cached_tokens(setup, n, n, n + 1) for n in (96, 97, 100)] == [96, 96, 99]
    assert _every_n_agrees(setup, prefix_cache)
    prefix_cache.coarse_block_tokens = 0  # a plan without the field
    assert client_cached_tokens(prefix_cache, 100) == 100


def test_the_rule_is_an_estimate_where_output_moves_a_partial_tail() -> None:
    """The reprefilled-tail hybrid's shape (288-token Mamba and full attention,
    1-token hash blocks, 3 lookahead tokens): stored without output the rule states
    the simulation's 1,870 for a 1,873-token prompt sent again; after output (the
    plan's figure) full attention falls back to whole blocks, 1,728, and the rule,
    which keeps 1,870, says it is an estimate."""
    groups = (
        CacheGroup(GroupKind.MAMBA, 288, False, spec_id=0),
        CacheGroup(GroupKind.FULL, 288, False, spec_id=1),
    )
    silent = PrefixCacheSetup(True, groups, 288, 1, True, False, hash_lookahead=3)
    decoded = replace(silent, stored_output_tokens=3)
    assert rule_is_exact(silent, facts(silent))
    assert rule_cached_tokens(silent, facts(silent), 1_873) == 1_870
    assert cached_tokens(silent, 1_873, 1_873, 1_874) == 1_870
    assert not rule_is_exact(decoded, facts(decoded))
    assert cached_tokens(decoded, 1_873, 1_873, 1_874) == 1_728
