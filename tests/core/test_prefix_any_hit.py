"""kvplan.core.prefix_cache's minimum prefix for any hit (`facts().min_any_hit_prefix`,
`first_any_hit_prefix`): the shortest prefix that, shared with a stored prompt of
any length, gets a hit. Checked here against trying every shared and stored length
of small engines with the step-by-step lookup; the figure itself against vLLM's own
manager in conformance/prefix_probe.py's any-hit probes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.core import prefix_cache
from kvplan.core.prefix_cache import (
    CacheGroup,
    GroupKind,
    PrefixCacheSetup,
    cached_tokens,
    facts,
    first_any_hit_prefix,
)
from tests.core.test_prefix_min import engines_with_tails


@st.composite
def small_setups(draw: st.DrawFn) -> PrefixCacheSetup:
    """Engines of a few tokens per block, so that every shared and stored length
    up to past the scan's horizon can be tried: one to three groups of every kind
    (one-token windows too), groups of one spec, groups out of prefix caching, the
    draft drop or hash lookahead, a multi-module MTP tail, partial hash hits where
    vLLM allows them, sparse or dense retention, the scheduler's bounded replay and
    its prefill chunks."""
    count = draw(st.integers(1, 3))
    groups: list[CacheGroup] = []
    for index in range(count):
        if groups and draw(st.integers(0, 4)) == 0:
            groups.append(draw(st.sampled_from(groups)))
            continue
        kind = draw(
            st.sampled_from([GroupKind.FULL]) if index == 0 else st.sampled_from(list(GroupKind))
        )
        windowed = kind in (GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL)
        groups.append(
            CacheGroup(
                kind=kind,
                block_tokens=draw(st.sampled_from([1, 2, 3, 4, 6])),
                is_draft=draw(st.booleans()),
                prefix_cacheable=index == 0 or draw(st.integers(0, 4)) > 0,
                window=draw(st.sampled_from([1, 3, 4, 8, 12])) if windowed else 0,
                spec_id=index,
            )
        )
    blocks = [g.block_tokens for g in groups]
    scheduler = math.lcm(*blocks)
    hash_block = math.gcd(*blocks) if count > 1 else scheduler
    partial = False
    if count > 1 and draw(st.booleans()):
        finer = draw(st.sampled_from([d for d in (1, 2) if hash_block % d == 0]))
        partial = any(g.kind is GroupKind.MAMBA and g.block_tokens > finer for g in groups) and all(
            g.kind not in (GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL)
            or g.block_tokens == finer
            for g in groups
        )
        hash_block = finer if partial else hash_block
    drop = draw(st.booleans())
    # The scheduler's prefill chunks (a Mamba state only where one ends), aligned to
    # the smallest prefix-cacheable block as a plan sets them; 0: block by block.
    chunk = draw(st.sampled_from([0, 0, 1, 2, 3, 5, 7, 9, 13, 25]))
    cacheable = [g.block_tokens for g in groups if g.prefix_cacheable]
    return PrefixCacheSetup(
        enabled=True,
        groups=tuple(groups),
        scheduler_block=scheduler,
        hash_block=hash_block,
        partial_hash_hits=partial,
        block_drop=drop,
        hash_lookahead=0 if drop else draw(st.sampled_from([0, 1, 2])),
        retention_interval=draw(st.sampled_from([0, 0, None])),
        reprefill_tokens=draw(st.sampled_from([0, 0, 1, 2])) if drop else 0,
        replay_window=draw(st.sampled_from([0, 0, 0, 1, 2, 5])),
        prefill_chunk_tokens=chunk,
        split_block=min(cacheable) if chunk else 0,
    )


@contextmanager
def step_by_step_lookups() -> Iterator[None]:
    """The Mamba and full-attention lookups replaced by trying every aligned length
    from the top (`_lookup_by_steps`, the reference)."""
    fast = prefix_cache._lookup

    def by_steps(
        stored: prefix_cache._Stored,
        members: list[int],
        max_len: int,
        reach: tuple[int, int],
        dropping: bool,
    ) -> int:
        kind = stored.setup.groups[members[0]].kind
        if kind in (GroupKind.MAMBA, GroupKind.FULL, GroupKind.OTHER):
            return prefix_cache._lookup_by_steps(stored, members, max_len, reach, dropping)
        return fast(stored, members, max_len, reach, dropping)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix_cache, "_lookup", by_steps)
        yield


def _hits(setup: PrefixCacheSetup, shared: int, stored: int) -> bool:
    """A request of `shared` tokens of a stored prompt and one of its own hits."""
    return cached_tokens(setup, shared, stored, shared + 1) > 0


@settings(max_examples=150, deadline=None)
@given(small_setups())
def test_no_shared_prefix_below_the_minimum_hits_with_any_stored_length(
    setup: PrefixCacheSetup,
) -> None:
    """Every shared length below the figure, against every stored length from it to
    three scan horizons past it, misses (by the step-by-step lookups); the figure
    hits with the stored length it names, and is at most the sent-again minimum."""
    f = facts(setup)
    if not f.on:
        assert f.min_any_hit_prefix == f.min_any_hit_stored_tokens == 0
        return
    assert f.min_any_hit_prefix <= f.min_shared_prefix
    if not f.min_shared_prefix_exact:
        assert not f.min_any_hit_prefix_exact
        return
    assert f.min_any_hit_prefix_exact
    minimum, stored = f.min_any_hit_prefix, f.min_any_hit_stored_tokens
    assert stored >= minimum
    far = minimum + 3 * prefix_cache._scan_horizon(setup)
    with step_by_step_lookups():
        assert _hits(setup, minimum, stored)
        missed = [
            (shared, length)
            for shared in range(1, minimum)
            for length in range(shared, far)
            if _hits(setup, shared, length)
        ]
    assert missed == []


@settings(max_examples=150, deadline=None)
@given(st.one_of(small_setups(), engines_with_tails()), st.data())
def test_a_longer_shared_prefix_of_one_stored_prompt_never_loses_the_hit(
    setup: PrefixCacheSetup, data: st.DataObject
) -> None:
    """(P1) What the scan's bisection rests on: for one stored prompt, the KV
    cache manager's hit never falls as the shared length grows, so neither does
    the served one (the manager's less the replay window) nor hitting at all."""
    stored = data.draw(st.integers(1, 3 * max(64, setup.scheduler_block)))
    shorter = data.draw(st.integers(0, stored))
    longer = data.draw(st.integers(shorter, stored))
    manager = prefix_cache.manager_view(setup)
    assert cached_tokens(manager, shorter, stored, shorter + 1) <= cached_tokens(
        manager, longer, stored, longer + 1
    )
    if _hits(setup, shorter, stored):
        assert _hits(setup, longer, stored)


# The steps of the scan's proof (docs/prefix-caching.md, "Why the scan is
# exact"), each against the simulation: what a stored prompt keeps is read only up
# to the shared prefix (R), is the same for every stored length a horizon past it
# (H), changes only at `hit_candidates` (C), and no lookup lands below
# `_least_hit_prefix` (F); each lookup is monotone in its candidate and reach (L).


def _readable(stored: prefix_cache._Stored, shared: int) -> tuple[object, ...]:
    """What a request of `shared` tokens of the stored prompt can read of it: each
    group's blocks that end within the shared prefix, its states inside a block
    and its last-hash-boundary positions there."""
    return tuple(
        (
            frozenset(j for j in range(shared // g.block_tokens) if stored.has(i, j)),
            frozenset(x for x in stored.points[i] if x <= shared),
            frozenset(x for x in stored.tails[i] if x <= shared),
        )
        for i, g in enumerate(stored.setup.groups)
    )


class _CutAt(prefix_cache._Stored):
    """A stored prompt with all it keeps past `shared` tokens forgotten."""

    def __init__(self, stored: prefix_cache._Stored, shared: int) -> None:
        self.setup, self.align, self.drops = stored.setup, stored.align, stored.drops
        self.inner, self.shared = stored, shared
        self.points = [{x for x in p if x <= shared} for p in stored.points]
        self.tails = [{x for x in t if x <= shared} for t in stored.tails]

    def has(self, group: int, block: int) -> bool:
        b = self.setup.groups[group].block_tokens
        return (block + 1) * b <= self.shared and self.inner.has(group, block)

    def run(self, group: int) -> int:
        return min(self.inner.run(group), self.shared // self.setup.groups[group].block_tokens)

    def states(self, group: int) -> set[int] | None:
        states = self.inner.states(group)
        return None if states is None else {x for x in states if x <= self.shared}


def _near(horizon: int, setup: PrefixCacheSetup) -> st.SearchStrategy[int]:
    """A distance past a length: mostly within two periods (where a stored
    prompt's own state sits and the lemmas are tight), sometimes a horizon on."""
    period = max(setup.scheduler_block, setup.hash_block, *(g.block_tokens for g in setup.groups))
    return st.one_of(st.integers(0, 2 * period), st.integers(0, 2 * horizon))


def _shared(horizon: int, setup: PrefixCacheSetup) -> st.SearchStrategy[int]:
    """A shared prefix up to three horizons: often within a few tokens of a unit
    boundary, where the states a stored prompt keeps move."""
    unit = prefix_cache._alignment(setup)
    return st.one_of(
        st.integers(1, 3 * horizon),
        st.builds(
            lambda units, off: max(1, units * unit + off),
            st.integers(1, max(1, 3 * horizon // unit)),
            st.integers(-2, 2),
        ),
    )


def _manager_hit(
    setup: PrefixCacheSetup, stored: prefix_cache._Stored, length: int, shared: int
) -> int:
    reach = prefix_cache._reach(setup, shared, length, shared + 1)
    return prefix_cache._settle(setup, stored, reach, shared + 1)[0]


@settings(max_examples=150, deadline=None)
@given(st.one_of(small_setups(), engines_with_tails()), st.data())
def test_r_a_hit_reads_only_what_the_stored_prompt_keeps_within_the_shared_prefix(
    setup: PrefixCacheSetup, data: st.DataObject
) -> None:
    """(R) The lookups read a stored prompt's blocks that end within the shared
    prefix and its states at or below it, nothing past it: forgetting the rest
    changes no hit."""
    if not facts(setup).on:
        return
    horizon = prefix_cache._scan_horizon(setup)
    shared = data.draw(_shared(horizon, setup))
    length = shared + data.draw(_near(horizon, setup))
    stored = prefix_cache._Stored(setup, length)
    assert _manager_hit(setup, stored, length, shared) == _manager_hit(
        setup, _CutAt(stored, shared), length, shared
    )


@settings(max_examples=150, deadline=None)
@given(st.one_of(small_setups(), engines_with_tails()), st.data())
def test_h_a_stored_prompt_a_horizon_past_the_shared_prefix_keeps_there_what_any_longer_does(
    setup: PrefixCacheSetup, data: st.DataObject
) -> None:
    """(H) A prompt of S >= P + `_scan_horizon` tokens keeps, within the first P,
    every block of the groups that keep every block (full attention and its kin,
    chunked local, dense retention) and nothing of the others (whose blocks and
    states sit near S: its replay boundaries, checkpoints and last hash boundary,
    and the prefill chunk ends written there); so every such stored length gives
    one hit."""
    if not facts(setup).on:
        return
    horizon = prefix_cache._scan_horizon(setup)
    shared = data.draw(_shared(horizon, setup))
    length = shared + horizon + data.draw(_near(horizon, setup))
    stored = prefix_cache._Stored(setup, length)
    endless: tuple[object, ...] = tuple(
        (
            frozenset(range(shared // g.block_tokens)) if stored.kept[i] is None else frozenset(),
            frozenset(),
            frozenset(),
        )
        for i, g in enumerate(setup.groups)
    )
    assert _readable(stored, shared) == endless
    assert cached_tokens(setup, shared, length, shared + 1) == cached_tokens(
        setup, shared, shared + horizon, shared + 1
    )


@settings(max_examples=150, deadline=None)
@given(st.one_of(small_setups(), engines_with_tails()), st.data())
def test_c_the_hit_of_one_shared_prefix_changes_only_at_a_candidate_stored_length(
    setup: PrefixCacheSetup, data: st.DataObject
) -> None:
    """(C) For one shared prefix P, the hit of a stored prompt of S > P tokens is
    that of S - 1 unless S is one of `hit_candidates` (a length where a floor the
    stored prompt's state depends on moves). Every S within two periods past P
    (beyond them, (H)) and one further on."""
    if not facts(setup).on:
        return
    horizon = prefix_cache._scan_horizon(setup)
    period = max(setup.scheduler_block, setup.hash_block, *(g.block_tokens for g in setup.groups))
    shared = data.draw(_shared(horizon, setup))
    far = shared + 1 + data.draw(st.integers(0, 2 * horizon))
    lengths = {*range(shared + 1, shared + 2 * period + 2), far}
    candidates = set(
        itertools.takewhile(lambda n: n <= max(lengths), prefix_cache.hit_candidates(setup, shared))
    )
    for length in lengths - candidates:
        assert cached_tokens(setup, shared, length, shared + 1) == cached_tokens(
            setup, shared, length - 1, shared + 1
        ), length


@settings(max_examples=150, deadline=None)
@given(st.one_of(small_setups(), engines_with_tails()), st.data())
def test_f_no_shared_prefix_below_the_floor_hits(
    setup: PrefixCacheSetup, data: st.DataObject
) -> None:
    """(F) No prefix shorter than `_least_hit_prefix` hits, whatever is stored (by
    (H), the stored lengths up to a horizon past it stand for all)."""
    floor = prefix_cache._least_hit_prefix(setup)
    if not facts(setup).on or floor < 2:
        return
    shared = data.draw(st.integers(1, floor - 1))
    length = shared + data.draw(_near(prefix_cache._scan_horizon(setup), setup))
    assert cached_tokens(setup, shared, length, shared + 1) == 0


@settings(max_examples=150, deadline=None)
@given(st.one_of(small_setups(), engines_with_tails()), st.data())
def test_l_each_lookup_is_monotone_in_its_candidate_and_reach(
    setup: PrefixCacheSetup, data: st.DataObject
) -> None:
    """(L) One lookup of a spec's groups, for a stored prompt, never returns less
    for a longer candidate or a longer shared prefix (the reach), drop or not."""
    if not facts(setup).on:
        return
    horizon = prefix_cache._scan_horizon(setup)
    length = data.draw(st.integers(1, 3 * horizon))
    stored = prefix_cache._Stored(setup, length)
    shorter = data.draw(st.integers(1, length))
    longer = data.draw(st.integers(shorter, length))
    low = data.draw(st.integers(0, shorter))
    high = data.draw(st.integers(low, longer))
    for ids, dropping in prefix_cache._spec_groups(setup):
        for drop in {False, dropping}:
            assert prefix_cache._lookup(
                stored, ids, low, prefix_cache._reach(setup, shorter, length, shorter + 1), drop
            ) <= prefix_cache._lookup(
                stored, ids, high, prefix_cache._reach(setup, longer, length, longer + 1), drop
            )


@settings(max_examples=100, deadline=None)
@given(engines_with_tails())
def test_the_figure_of_larger_engines_hits_and_is_at_most_the_sent_again_one(
    setup: PrefixCacheSetup,
) -> None:
    f = facts(setup)
    assert f.min_any_hit_prefix <= f.min_shared_prefix
    if f.on and f.min_any_hit_prefix_exact:
        assert _hits(setup, f.min_any_hit_prefix, f.min_any_hit_stored_tokens)
        # One token less misses with the stored lengths near the one it names.
        below = f.min_any_hit_prefix - 1
        near = range(max(below, f.min_any_hit_stored_tokens - 8), f.min_any_hit_stored_tokens + 9)
        assert not any(_hits(setup, below, length) for length in near if length >= below)


def test_jamba_80_shared_tokens_of_an_81_token_prompt_hit_below_the_sent_again_81() -> None:
    """Jamba-like, no drafter: an 81-token prompt keeps its Mamba state at 80 (its
    last token but one, floored to the 80-token unit), so a request sharing its
    first 80 tokens hits 80; sent again, an 80-token prompt keeps it at 0."""
    groups = (CacheGroup(GroupKind.MAMBA, 80, False), CacheGroup(GroupKind.FULL, 80, False))
    setup = PrefixCacheSetup(True, groups, 80, 80, False, False)
    f = facts(setup)
    assert (f.min_shared_prefix, f.min_any_hit_prefix, f.min_any_hit_stored_tokens) == (81, 80, 81)
    assert cached_tokens(setup, 80, 81, 81) == 80
    assert cached_tokens(setup, 79, 81, 80) == 0


def test_a_full_attention_group_hits_from_one_block_either_way() -> None:
    setup = PrefixCacheSetup(True, (CacheGroup(GroupKind.FULL, 16, False),), 16, 16, False, False)
    assert first_any_hit_prefix(setup) == (16, 16, True)


def test_off_is_zero() -> None:
    setup = PrefixCacheSetup(False, (CacheGroup(GroupKind.FULL, 16, False),), 16, 16, False, False)
    assert first_any_hit_prefix(setup) == (0, 0, True)


def test_the_scan_limit_makes_the_figure_inexact() -> None:
    """A full-attention group and a sliding window of 16-token blocks: a prompt
    sent again first hits at 17, 16 shared tokens of a 17-token prompt hit. A scan
    stopped by its limit before it tried that keeps the sent-again figure (which
    hits) and says it is not exact."""
    groups = (
        CacheGroup(GroupKind.FULL, 16, False),
        CacheGroup(GroupKind.SLIDING_WINDOW, 16, False, window=64, spec_id=1),
    )
    setup = PrefixCacheSetup(True, groups, 16, 16, False, False)
    assert facts(setup).min_shared_prefix == 17
    assert first_any_hit_prefix(setup) == (16, 17, True)
    assert prefix_cache._any_hit_below(setup, 17, True, limit=0) == (17, 17, False)
    # Where the sent-again scan gave up, so does this one.
    assert prefix_cache._any_hit_below(setup, 17, False, limit=100) == (17, 0, False)
