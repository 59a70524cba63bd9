"""kvplan.core.prefix_cache: invariants of the predicted prefix-cache hits. The
hits themselves are checked against vLLM's own KV cache manager by
conformance/prefix_probe.py (make conformance)."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.core.prefix_cache import (
    CacheGroup,
    GroupKind,
    PrefillChunks,
    PrefixCacheSetup,
    WhyOff,
    cached_tokens,
    cached_tokens_after_junction,
    facts,
    junction_checkpoint_applies,
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
    # A hit is a unit whose dropped block and lookahead tokens are shared too.
    if shared < f.unit + f.drop_tokens + setup.hash_lookahead:
        assert hit == 0
    # The minimum is the shortest prompt that hits when sent again; a shorter
    # prefix of a longer stored prompt may hit (its state is kept further on).
    if shared == stored and shared < f.min_shared_prefix:
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


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([32, 64, 128]), st.sampled_from([2, 4]), st.integers(1, 3000))
def test_partial_hash_hits_drop_one_hash_block_of_full_attention(
    hash_block: int, ratio: int, prompt: int
) -> None:
    # Mamba "align" blocks as fine as the hash block, full attention coarser: full
    # attention is looked up by hash blocks, reads the stored prompt's partly filled
    # last block as far as it is hashed, and the (unflagged) drop takes one hash block.
    groups = (
        CacheGroup(GroupKind.MAMBA, hash_block, False),
        CacheGroup(GroupKind.FULL, hash_block * ratio, False),
    )
    setup = PrefixCacheSetup(
        True, groups, hash_block * ratio, hash_block, True, True, retention_interval=None
    )
    hit = cached_tokens(setup, prompt, prompt, prompt + 100)
    assert hit == max(0, prompt // hash_block * hash_block - hash_block)


def test_the_drop_keeps_the_mamba_prefill_checkpoint_state() -> None:
    # vLLM 0.32's own manager (fuzz seed 7, fuzzw/w0110): Mamba 128 x 4 groups and
    # DCP-sharded MLA of 256, every group dropping; a repeated 1,665-token prompt
    # hits at 1,536: the scheduler ends a prefill chunk one hash block below the
    # last whole one, 1,664, and the Mamba state written there is kept.
    mamba = CacheGroup(GroupKind.MAMBA, 128, False, spec_id=0)
    groups = (mamba, mamba, mamba, mamba, CacheGroup(GroupKind.FULL, 256, False, spec_id=1))
    setup = PrefixCacheSetup(True, groups, 256, 128, True, True)
    assert cached_tokens(setup, 1664, 1665, 1664 + 257) == 1536


@settings(max_examples=60, deadline=None)
@given(BLOCKS, st.integers(1, 4), st.integers(0, 600))
def test_a_dropping_mamba_group_adds_nothing_to_the_minimum_prefix(
    block: int, ratio: int, stored: int
) -> None:
    # Only a flagged Mamba group drops: its lookup takes no drop, so the minimum
    # shared prefix is the unit and a repeated prompt of one unit and a bit hits it.
    groups = (
        CacheGroup(GroupKind.FULL, block, False),
        CacheGroup(GroupKind.MAMBA, block * ratio, True),
    )
    setup = PrefixCacheSetup(
        True, groups, block * ratio, block, False, True, retention_interval=None
    )
    f = facts(setup)
    assert f.drop_tokens == 0
    assert f.min_shared_prefix == f.unit
    if stored > f.unit:
        assert cached_tokens(setup, stored, stored, stored + 1) >= f.unit


@settings(max_examples=60, deadline=None)
@given(BLOCKS, st.integers(0, 600), st.integers(1, 600), st.integers(1, 64))
def test_a_one_token_window_keeps_nothing_to_hit(
    block: int, shared: int, stored: int, tail: int
) -> None:
    # A hit must land on a matched block; a one-token window retains none of a
    # stored prompt's blocks (vLLM's sparse retention), so it never hits. Dense
    # checkpoints keep every block: then it hits like full attention.
    group = CacheGroup(GroupKind.SLIDING_WINDOW, block, False, window=1)
    sparse = PrefixCacheSetup(True, (group,), block, block, False, False)
    assert cached_tokens(sparse, shared, stored, shared + tail) == 0
    dense = PrefixCacheSetup(True, (group,), block, block, False, False, retention_interval=None)
    expected = min(shared, stored, shared + tail - 1) // block * block
    assert cached_tokens(dense, shared, stored, shared + tail) == expected


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 4, 8]), st.sampled_from([16, 64]), st.integers(2, 2000))
def test_a_repeated_prompt_hits_at_the_mamba_prefill_checkpoint(
    hash_block: int, block: int, prompt: int
) -> None:
    # Partial hash hits: vLLM's scheduler ends a prefill chunk at the last hash
    # block before the final token and keeps the Mamba state written there, even
    # inside a Mamba block; full attention reaches it hash block by hash block.
    groups = (CacheGroup(GroupKind.MAMBA, block, False), CacheGroup(GroupKind.FULL, block, False))
    setup = PrefixCacheSetup(True, groups, block, hash_block, True, False)
    assert (
        cached_tokens(setup, prompt, prompt, prompt + 100)
        == (prompt - 1) // hash_block * hash_block
    )


def test_other_cacheable_kinds_are_looked_up_as_full_attention() -> None:
    # vLLM 0.32's own manager (fuzz seed 11, fuzzy/y0053): a one-token window of 16
    # and a full-attention kin (reduced sliding window) of 1, both dropping: one
    # turn each, as for full attention and one other group; 80 of 104 shared tokens.
    groups = (
        CacheGroup(GroupKind.SLIDING_WINDOW, 16, False, window=1, spec_id=0),
        CacheGroup(GroupKind.OTHER, 1, False, spec_id=1),
    )
    setup = PrefixCacheSetup(True, groups, 16, 1, False, True)
    assert cached_tokens(setup, 104, 105, 104 + 17) == 80


def test_a_later_request_hits_at_the_junction_the_first_one_recorded() -> None:
    """Mamba and full attention of 528-token blocks (Qwen3-Next at TP 4): a request
    sharing 4,000 tokens of a longer stored prompt hits 0 (no Mamba state there),
    its full attention would hit 3,696: vLLM records that junction and keeps the
    request's Mamba state there, so the next request sharing the prefix hits it
    (vLLM 0.33's manager: 0, then 3,696; tests/test_prefix_against_vllm.py)."""
    mamba = CacheGroup(GroupKind.MAMBA, 528, False, spec_id=0)
    setup = PrefixCacheSetup(
        True,
        (mamba, mamba, mamba, CacheGroup(GroupKind.FULL, 528, True, spec_id=1)),
        528,
        528,
        False,
        False,
        hash_lookahead=1,
    )
    stored, request = 4000 + 4 * 528 + 2, 4000 + 529
    assert cached_tokens(setup, 4000, stored, request) == 0
    assert cached_tokens_after_junction(setup, 4000, stored, request) == 3696


def test_full_attention_lands_inside_a_block_only_at_a_prompts_last_hash_boundary() -> None:
    """Partial hash hits (Mamba of 16 beside full attention of 64, DCP-sharded):
    vLLM registers a full-attention block under its last hash boundary alone, so a
    request sharing 16 tokens of a 417-token prompt finds no full-attention hit,
    records no junction, and the next one hits 0 too (vLLM 0.32's manager,
    parallel/dcp2-mamba in make conformance; kvplan said 16 for the next one)."""
    mamba = CacheGroup(GroupKind.MAMBA, 16, False, spec_id=0)
    setup = PrefixCacheSetup(
        True,
        (mamba, mamba, CacheGroup(GroupKind.FULL, 64, False, spec_id=1)),
        64,
        16,
        True,
        False,
    )
    assert cached_tokens(setup, 16, 417, 16 + 65) == 0
    assert cached_tokens_after_junction(setup, 16, 417, 16 + 65) == 0
    # The stored prompt's own last boundary (416, inside block 6) still hits.
    assert cached_tokens(setup, 417, 417, 417 + 65) == 416


def test_a_dropping_window_shorter_than_its_run_falls_back_a_whole_unit() -> None:
    """fuzz/f230's groups: 128-token windows of 16- and 32-token blocks beside full
    attention of both, every group dropping (0.32, no group flagged): with only 7
    of the 16-token blocks in reach vLLM's
    lookup takes the run from the first block (112), cuts it to the unit (96),
    drops a block and cuts again: 64 (fuzz/f230's later request, vLLM 0.32's
    manager; kvplan said 96)."""
    window = CacheGroup(GroupKind.SLIDING_WINDOW, 16, False, window=128, spec_id=0)
    full = CacheGroup(GroupKind.FULL, 32, False, spec_id=1)
    wide_window = CacheGroup(GroupKind.SLIDING_WINDOW, 32, False, window=128, spec_id=2)
    fine = CacheGroup(GroupKind.FULL, 16, False, spec_id=3)
    setup = PrefixCacheSetup(
        True,
        (window, window, full, full, wide_window, fine, fine),
        32,
        16,
        False,
        True,
    )
    assert cached_tokens_after_junction(setup, 159, 209, 159 + 33) == 64


def test_a_dropping_group_outside_prefix_caching_takes_nothing_off_hits() -> None:
    # A flagged group that takes no part in prefix caching is never looked up: its
    # drop shortens no hit, so the minimum shared prefix is the unit (random engines
    # of tests/core/test_prefix_warnings.py found facts counting it).
    groups = (
        CacheGroup(GroupKind.FULL, 80, True, prefix_cacheable=False),
        CacheGroup(GroupKind.OTHER, 16, False),
    )
    setup = PrefixCacheSetup(True, groups, 80, 16, False, True)
    f = facts(setup)
    assert f.drop_groups == (0,) and f.drop_tokens == 0
    assert f.min_shared_prefix == f.unit == 80
    assert cached_tokens(setup, 80, 80, 81) == 80


def test_the_junction_checkpoint_keeps_mamba_state_inside_a_block() -> None:
    """vLLM's opt-in enable_mamba_shared_prefix_checkpoint: 64-token Mamba blocks,
    16-token attention (the drafter's) and hash blocks, one lookahead token. A
    request sharing 100 tokens with a longer stored one hits nothing (Mamba state
    only at the stored prompt's end); full attention matched 96, its junction. It
    then keeps its Mamba state there with the checkpoint, block-floored to 64
    without: the next request hits 96, or 64."""
    groups = (CacheGroup(GroupKind.MAMBA, 64, False), CacheGroup(GroupKind.FULL, 16, True))
    on = PrefixCacheSetup(True, groups, 64, 16, True, False, 1, junction_checkpoint=True)
    off = replace(on, junction_checkpoint=False)
    stored, request = 100 + 4 * 64 + 2, 100 + 64 + 1
    assert junction_checkpoint_applies(on) and not junction_checkpoint_applies(off)
    assert cached_tokens(on, 100, stored, request) == cached_tokens(off, 100, stored, request) == 0
    assert cached_tokens_after_junction(on, 100, stored, request) == 96
    assert cached_tokens_after_junction(off, 100, stored, request) == 64
    # vLLM's manager and scheduler take it only with a drafter's group, partial hash
    # hits finer than the scheduler block, and no multi-module MTP tail.
    no_drafter = replace(on, groups=(groups[0], replace(groups[1], is_draft=False)))
    for ignored in (
        no_drafter,
        replace(on, partial_hash_hits=False),
        replace(on, hash_block=64),
        replace(on, reprefill_tokens=1),
    ):
        assert not junction_checkpoint_applies(ignored), ignored
    assert cached_tokens_after_junction(no_drafter, 100, stored, request) == 64
    # The draft drop puts every group in the drafter's set when none is flagged.
    assert junction_checkpoint_applies(replace(no_drafter, block_drop=True, hash_lookahead=0))


@settings(max_examples=300, deadline=None)
@given(
    setups(),
    st.sampled_from([1, 4, 16, 64]),
    st.integers(1, 300),
    st.integers(2, 900),
    st.data(),
)
def test_a_chunk_ends_within_a_span_where_is_end_finds_one(
    setup: PrefixCacheSetup, block: int, budget: int, prompt: int, data: st.DataObject
) -> None:
    """`PrefillChunks.ends_within` (which Mamba blocks a chunk ended inside, so vLLM
    keeps them) walks the chunks as `is_end` does: it finds a chunk end in a span
    exactly where asking `is_end` at each position there would, the internal
    prefill checkpoint's last chunk included."""
    setup = replace(
        setup,
        prefill_chunk_tokens=budget,
        split_block=block,
        partial_hash_hits=data.draw(st.booleans()),
        junction_checkpoint=data.draw(st.booleans()),
        mamba_checkpoint_alignment=data.draw(st.sampled_from([0, 1, 16])),
    )
    start = data.draw(st.integers(0, prompt - 1))
    junction = data.draw(st.integers(0, prompt))
    chunks = PrefillChunks(setup, prompt, start, junction)
    ends = [p for p in range(1, prompt + 1) if chunks.is_end(p)]
    low = data.draw(st.integers(-2, prompt + 2))
    high = data.draw(st.integers(low, prompt + 3))
    assert chunks.ends_within(low, high) == any(low < p <= high for p in ends)


@st.composite
def partial_hash_setups(draw: st.DrawFn) -> PrefixCacheSetup:
    """Mamba beside full attention with finer hash blocks (partial hash hits), and
    a hash lookahead (a multi-module MTP drafter's) of 0 to 4 tokens."""
    block = draw(st.sampled_from([16, 64, 288]))
    hash_block = draw(st.sampled_from([h for h in (1, 4, 16) if block % h == 0]))
    return PrefixCacheSetup(
        True,
        (
            CacheGroup(GroupKind.MAMBA, block, False, spec_id=0),
            CacheGroup(GroupKind.FULL, block, False, spec_id=1),
        ),
        block,
        hash_block,
        True,
        False,
        hash_lookahead=draw(st.integers(0, 4)),
    )


@settings(max_examples=200, deadline=None)
@given(partial_hash_setups(), st.integers(2, 2000), st.integers(0, 2000), st.integers(1, 400))
def test_a_stored_requests_output_only_takes_hits_away_and_settles_at_the_lookahead(
    setup: PrefixCacheSetup, stored: int, shared: int, output: int
) -> None:
    """Sampled tokens only move full attention's partial-tail key away from where
    a prompt can reach it: an output never adds a hit, every output of at least the
    hash lookahead gives the same figure (the plan's), and without a lookahead of 2
    or more (the key already at the prompt's last token but one) none changes it."""
    shared = min(shared, stored)

    def hit(tokens: int) -> tuple[int, int]:
        after = replace(setup, stored_output_tokens=tokens)
        return (
            cached_tokens(after, shared, stored, shared + 65),
            cached_tokens_after_junction(after, shared, stored, shared + 65),
        )

    silent, decoded = hit(0), hit(output)
    assert all(d <= s for d, s in zip(decoded, silent, strict=True))
    if output >= setup.hash_lookahead:
        assert decoded == hit(setup.hash_lookahead) == hit(output + 1_000)
    if setup.hash_lookahead <= 1:
        assert decoded == silent


def test_output_moves_the_partial_tail_past_a_resent_prompts_reach() -> None:
    """The reprefilled-tail hybrid's figures (1-token hash blocks, 3 lookahead
    tokens, 288-token Mamba and attention blocks, a 1,873-token prompt sent again):
    stored without sampling (the bare manager) it hits 1,870, after any output only
    full attention's whole blocks, 1,728 (vLLM 0.33 and 0.34's scheduler,
    tests/test_scheduler_probe.py)."""
    setup = PrefixCacheSetup(
        True,
        (
            CacheGroup(GroupKind.MAMBA, 288, False, spec_id=0),
            CacheGroup(GroupKind.FULL, 288, False, spec_id=1),
        ),
        288,
        1,
        True,
        False,
        hash_lookahead=3,
    )
    hits = [
        cached_tokens(replace(setup, stored_output_tokens=d), 1_873, 1_873, 1_873 + 289)
        for d in (0, 1, 2, 3, 64, 300)
    ]
    assert hits == [1_870, 1_728, 1_728, 1_728, 1_728, 1_728]


def test_the_internal_checkpoint_under_the_draft_drop_is_a_block_lower() -> None:
    """Fuzz seed 21's `fuzzx/x0901` under vLLM 0.32 (its scheduler served 2,880):
    three Mamba groups and full attention of 576-token blocks, the draft drop, Mamba
    prefill checkpoint blocks (alignment 64), a 3,745-token prompt prefilled in one
    8,192-token chunk. The coordinator sets the Mamba managers'
    drop_eagle_checkpoint_block under the drop, so the backend's internal checkpoint
    is the dropped one, 2,880 (3,456 less a block), where a resend lands; kvplan said
    0 when it took the manager's checkpoint without the drop (3,456)."""
    mamba = CacheGroup(GroupKind.MAMBA, 576, False, spec_id=0)
    groups = (mamba, mamba, mamba, CacheGroup(GroupKind.FULL, 576, False, spec_id=1))
    setup = PrefixCacheSetup(
        True,
        groups,
        576,
        576,
        False,
        True,
        prefill_chunk_tokens=8192,
        split_block=576,
        mamba_checkpoint_alignment=64,
        stored_output_tokens=2,
    )
    assert cached_tokens(setup, 3_744, 3_745, 3_745) == 2_880
    assert cached_tokens(setup, 3_745, 3_745, 3_746) == 2_880
