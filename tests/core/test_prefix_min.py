"""kvplan.core.prefix_cache's minimum prefix (`facts().min_shared_prefix`): the
shortest prompt that, stored and then sent again with one more token, gets any
hit; found by trying only `hit_candidates`, over lookups that skip to the states a
stored prompt keeps. Both are checked here against trying everything; the minimum
itself against vLLM's own manager in conformance/prefix_probe.py's min probes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.core import prefix_cache
from kvplan.core.prefix_cache import (
    CacheGroup,
    GroupKind,
    PrefixCacheSetup,
    cached_tokens,
    cached_tokens_after_junction,
    facts,
    first_hit_prefix,
)
from tests.core.test_prefix_cache import setups
from tests.core.test_prefix_warnings import planned_setups

ENGINES = st.one_of(setups(), planned_setups())


@st.composite
def engines_with_tails(draw: st.DrawFn) -> PrefixCacheSetup:
    """Random engines, with a multi-module MTP drafter's reprefilled tail where
    the drop applies without lookahead hashes (vLLM has one or the other)."""
    setup = draw(ENGINES)
    if setup.block_drop and not setup.hash_lookahead:
        setup = replace(setup, reprefill_tokens=draw(st.sampled_from([0, 1, 2, 5])))
    return setup


@settings(max_examples=150, deadline=None)
@given(engines_with_tails())
def test_the_minimum_is_the_first_prompt_that_hits_when_sent_again(
    setup: PrefixCacheSetup,
) -> None:
    f = facts(setup)
    if not f.on:
        assert f.min_shared_prefix == 0
        return
    hits = [cached_tokens(setup, n, n, n + 1) for n in range(1, f.min_shared_prefix + 1)]
    assert not any(hits[:-1])  # every shorter prompt misses, tried or not
    # Where the scan gave up (one-token windows here) the figure is a length below
    # which every prompt was seen to miss; elsewhere it hits.
    assert (hits[-1] > 0) is f.min_shared_prefix_exact


@settings(max_examples=150, deadline=None)
@given(engines_with_tails(), st.integers(0, 700), st.integers(1, 700), st.integers(1, 64))
def test_the_shortcut_lookups_are_the_step_by_step_lookup(
    setup: PrefixCacheSetup, shared: int, stored: int, tail: int
) -> None:
    """`_full_like_hit` and `_mamba_hit` return what trying every aligned length
    from the top (`_lookup_by_steps`) does, for first and later requests."""
    fast = prefix_cache._lookup
    every = (
        cached_tokens(setup, shared, stored, shared + tail),
        cached_tokens_after_junction(setup, shared, stored, shared + tail),
    )

    def by_steps(
        stored_prompt: prefix_cache._Stored,
        members: list[int],
        max_len: int,
        reach: tuple[int, int],
        dropping: bool,
    ) -> int:
        kind = setup.groups[members[0]].kind
        if kind in (GroupKind.MAMBA, GroupKind.FULL, GroupKind.OTHER):
            return prefix_cache._lookup_by_steps(stored_prompt, members, max_len, reach, dropping)
        return fast(stored_prompt, members, max_len, reach, dropping)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix_cache, "_lookup", by_steps)
        stepped = (
            cached_tokens(setup, shared, stored, shared + tail),
            cached_tokens_after_junction(setup, shared, stored, shared + tail),
        )
    assert every == stepped


def test_a_mamba_state_kept_a_unit_lower_puts_the_minimum_a_token_past_the_unit() -> None:
    """Jamba-like, no drafter: a prompt of one 80-token unit keeps its Mamba state
    at its replay boundary (its last token but one, floored to the unit: 0), so
    it misses when sent again; one of 81 tokens keeps it at 80 and hits 80. A
    shared 80 tokens of a longer stored prompt do hit: the minimum is about a
    prompt sent again, not about every shared prefix."""
    groups = (CacheGroup(GroupKind.MAMBA, 80, False), CacheGroup(GroupKind.FULL, 80, False))
    setup = PrefixCacheSetup(True, groups, 80, 80, False, False)
    assert facts(setup).min_shared_prefix == 81
    assert cached_tokens(setup, 80, 80, 81) == 0 < cached_tokens(setup, 81, 81, 82) == 80
    assert cached_tokens(setup, 80, 81, 81) == 80


def test_the_scan_gives_up_with_a_length_every_shorter_prompt_misses_at() -> None:
    """A one-token sliding window beside full attention keeps none of a stored
    prompt's window blocks: no prompt hits when sent again. The scan stops after
    its limit and says so (min_shared_prefix_exact false)."""
    groups = (
        CacheGroup(GroupKind.FULL, 80, False),
        CacheGroup(GroupKind.SLIDING_WINDOW, 80, False, window=1, spec_id=1),
    )
    setup = PrefixCacheSetup(True, groups, 80, 80, False, False)
    length, exact = first_hit_prefix(setup, limit=20)
    assert not exact and length > 80
    assert not any(cached_tokens(setup, n, n, n + 1) for n in range(1, length))
