"""kvplan.core.prefix_cache: invariants of the predicted prefix-cache hits. The
hits themselves are checked against vLLM's own KV cache manager by
conformance/prefix_probe.py (make conformance)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.core.prefix_cache import (
    CacheGroup,
    GroupKind,
    PrefixCacheSetup,
    WhyOff,
    cached_tokens,
    facts,
    replay_boundaries,
)

BLOCKS = st.sampled_from([16, 32, 64])
KINDS = st.sampled_from([GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA])


@st.composite
def setups(draw: st.DrawFn) -> PrefixCacheSetup:
    count = draw(st.integers(1, 3))
    groups = []
    for index in range(count):
        kind = GroupKind.FULL if index == 0 else draw(KINDS)
        groups.append(
            CacheGroup(
                kind=kind,
                block_tokens=draw(BLOCKS),
                is_draft=draw(st.booleans()),
                window=draw(st.sampled_from([64, 1024])) if kind is GroupKind.SLIDING_WINDOW else 0,
            )
        )
    scheduler = math.lcm(*(g.block_tokens for g in groups))
    return PrefixCacheSetup(
        enabled=True,
        groups=tuple(groups),
        scheduler_block=scheduler,
        hash_block=math.gcd(*(g.block_tokens for g in groups)) if count > 1 else scheduler,
        partial_hash_hits=False,
        block_drop=draw(st.booleans()),
        hash_lookahead=draw(st.sampled_from([0, 1])),
        retention_interval=draw(st.sampled_from([0, None])),
    )


@settings(max_examples=150, deadline=None)
@given(setups(), st.integers(0, 600), st.integers(1, 600), st.integers(1, 64))
def test_hits_are_whole_units_within_the_shared_prefix(
    setup: PrefixCacheSetup, shared: int, stored: int, tail: int
) -> None:
    f = facts(setup)
    hit = cached_tokens(setup, shared, stored, shared + tail)
    assert hit % f.unit == 0
    assert 0 <= hit <= min(shared, stored, shared + tail - 1)
    if shared < f.min_shared_prefix:
        assert hit == 0


@settings(max_examples=100, deadline=None)
@given(setups(), st.integers(0, 600), st.integers(1, 600))
def test_the_draft_drop_never_adds_hits_to_dense_checkpoints(
    setup: PrefixCacheSetup, shared: int, stored: int
) -> None:
    # Under sparse retention the drop also moves the checkpoint a stored prompt
    # keeps one block lower, so only dense checkpoints compare.
    dense = PrefixCacheSetup(**{**setup.__dict__, "retention_interval": None})
    without = PrefixCacheSetup(**{**dense.__dict__, "block_drop": False})
    request = shared + 17
    assert cached_tokens(dense, shared, stored, request) <= cached_tokens(
        without, shared, stored, request
    )


@settings(max_examples=100, deadline=None)
@given(BLOCKS, st.integers(0, 600), st.integers(1, 600), st.integers(1, 64))
def test_one_full_attention_group_hits_every_whole_shared_block(
    block: int, shared: int, stored: int, tail: int
) -> None:
    setup = PrefixCacheSetup(
        True, (CacheGroup(GroupKind.FULL, block, False),), block, block, False, False
    )
    request = shared + tail
    expected = min(shared, stored, request - 1) // block * block
    assert cached_tokens(setup, shared, stored, request) == expected


def test_off_and_why() -> None:
    group = CacheGroup(GroupKind.FULL, 16, False)
    off = PrefixCacheSetup(False, (group,), 16, 16, False, False)
    assert facts(off).why_off is WhyOff.DISABLED
    assert cached_tokens(off, 1000, 1000, 2000) == 0
    scratch = CacheGroup(GroupKind.OTHER, 16, False, prefix_cacheable=False)
    none = PrefixCacheSetup(True, (scratch,), 16, 16, False, False)
    assert facts(none).why_off is WhyOff.NO_CACHEABLE_GROUP


def test_an_unflagged_drafter_makes_every_group_drop() -> None:
    groups = (CacheGroup(GroupKind.MAMBA, 2096, False), CacheGroup(GroupKind.FULL, 2096, False))
    setup = PrefixCacheSetup(True, groups, 2096, 2096, False, True)
    f = facts(setup)
    assert f.drop_groups == (0, 1)
    assert f.min_shared_prefix == 2 * 2096
    flagged = PrefixCacheSetup(
        True, (groups[0], CacheGroup(GroupKind.FULL, 2096, True)), 2096, 2096, False, True
    )
    assert facts(flagged).drop_groups == (1,)


def test_mamba_hits_only_at_the_stored_replay_boundary() -> None:
    groups = (CacheGroup(GroupKind.MAMBA, 64, False), CacheGroup(GroupKind.FULL, 64, False))
    setup = PrefixCacheSetup(True, groups, 64, 64, False, False)
    stored = 10 * 64 + 5
    (boundary,) = replay_boundaries(stored, 64, dropping=False)
    at = boundary // 64 * 64
    assert cached_tokens(setup, at, stored, at + 100) == at
    assert cached_tokens(setup, at - 64, stored, at + 100) == 0
    dense = PrefixCacheSetup(True, groups, 64, 64, False, False, retention_interval=None)
    assert cached_tokens(dense, at - 64, stored, at + 100) == at - 64


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([16, 64, 256]),
    st.sampled_from([100, 512, 8192]),
    st.integers(0, 2000),
    st.integers(1, 2000),
    st.integers(1, 600),
)
def test_chunked_local_counts_blocks_before_the_current_chunk_as_hit(
    block: int, chunk: int, shared: int, stored: int, tail: int
) -> None:
    # vLLM's chunked-local lookup fills the blocks wholly before the chunk the next
    # token is in with null blocks and counts them as computed, shared or not.
    group = CacheGroup(GroupKind.CHUNKED_LOCAL, block, False, window=chunk)
    setup = PrefixCacheSetup(True, (group,), block, block, False, False)
    request = shared + tail
    hit = cached_tokens(setup, shared, stored, request)
    skipped = (request - 1) // chunk * chunk // block * block
    assert hit % block == 0
    assert skipped <= hit <= max(skipped, min(shared, stored, request - 1))
