"""What an engine's prefix cache will do, predicted from its plan.

Pure functions over plain values: the plan's KV cache groups (kind, block size,
draft flag, whether they take part in prefix caching), the scheduler and hash
block sizes, and the release's draft-drop rule. The facts are checked against each
release's own KV cache manager by conformance/prefix_probe.py, which stores one
request and asks for the longest hit of requests sharing prefixes of many lengths.

The model the facts describe (docs/prefix-caching.md):

* Hits are chained block hashes: a request shares `floor(N / hash_block)` hash
  blocks with a stored one whose first N tokens it repeats, and a hit never covers
  the request's last token (it is recomputed for logits).
* One group: hits land on that group's blocks. Several groups: every group must
  hit at one common length, a multiple of the hit alignment (the scheduler block,
  the lcm of the groups' blocks; the hash block where a coarser Mamba block allows
  partial hash hits).
* Several groups keep a stored request's blocks only up to its replay boundary,
  the last alignment boundary before its final token; a Mamba group holds state
  at that boundary alone, so a shorter shared prefix never hits it.
* Groups that take the EAGLE last-block drop lose one block of every hit (the
  drafter's lookahead slot); when the hit is one block, it is emptied.
* A request whose groups' hits part records the longest as its shared-prefix
  junction and keeps its state there too: `cached_tokens_after_junction` is the
  hit of the request after it.
* Bounded replay (`replay_window`, DeepSeek-V4.1's sliding-window MLA layers,
  which opt out of prefix caching): vLLM's scheduler, not its KV cache manager,
  recomputes the last `replay_window` tokens of the manager's hit to rebuild
  those layers' windows. A hit no longer than the window is recomputed whole and
  dropped (0); a longer one serves all but the window (`served_after_replay`: an
  8,192-token hit under a 256-token window serves 7,936, no block rounding). The
  manager's own hit is that of `manager_view(setup)` (conformance/prefix_probe.py
  checks it); `cached_tokens`, the facts and the what-if answer what the
  scheduler serves.
* The minimum prefix (`facts().min_shared_prefix`, `first_hit_prefix`) is the
  shortest prompt that, stored and sent again with one more token, hits. The
  minimum for any hit (`facts().min_any_hit_prefix`, `first_any_hit_prefix`) is
  the shortest prefix shared with a stored prompt of any length (the request
  going on with one token of its own) that hits: a longer stored prompt can keep
  state lower than one sent again does.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum


class GroupKind(Enum):
    FULL = "full"  # full attention, MLA, and their quantised forms
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    OTHER = "other"


class WhyOff(Enum):
    ON = ""
    DISABLED = "disabled"  # options.enable_prefix_caching false, or a model rule
    NO_CACHEABLE_GROUP = "no_cacheable_group"  # attention-free / every group opts out


@dataclass(frozen=True)
class CacheGroup:
    kind: GroupKind
    block_tokens: int  # the group's block, DCP-scaled where sharded
    is_draft: bool
    prefix_cacheable: bool = True
    window: int = 0  # sliding window / attention chunk (tokens); 0 for others
    spec_id: int = -1  # groups of one spec share an id (>= 0); -1: a spec of its own


@dataclass(frozen=True)
class PrefixCacheSetup:
    """What decides hits: from the plan and the release's rules."""

    enabled: bool
    groups: tuple[CacheGroup, ...]
    scheduler_block: int
    hash_block: int
    partial_hash_hits: bool  # hits may land on hash blocks inside a scheduler block
    block_drop: bool  # the EAGLE last-block drop applies (release rule and method)
    hash_lookahead: int = 0  # tokens after each hash block its hash also covers
    # Sliding-window / Mamba checkpoints a stored request keeps: 0 (vLLM's default)
    # only its replay boundary; None densely; k > 0 one per k tokens as well.
    retention_interval: int | None = 0
    # The last tokens of a prompt whose KV a multi-module MTP drafter may prefill
    # again (its lookahead less one): not cached, by a single group, or by the
    # groups that take the drop beside others.
    reprefill_tokens: int = 0
    # vLLM's opt-in enable_mamba_shared_prefix_checkpoint: a request ends a prefill
    # chunk exactly at its shared-prefix junction and keeps its Mamba state there
    # (inside a block), not only block-floored. Takes effect where
    # `junction_checkpoint_applies`.
    junction_checkpoint: bool = False
    # Chunked prefill (vLLM's scheduler in Mamba "align" mode): a Mamba state is
    # written only where a prefill chunk ends. `prefill_chunk_tokens`: the tokens one
    # request's prefill step may take (max_num_batched_tokens less the drafter's
    # rows); `split_block`: the block the scheduler aligns chunk ends to (the
    # engine's cache block: the smallest prefix-cacheable group block). 0: every
    # block boundary ends a chunk (a prefill in scheduler-block steps).
    prefill_chunk_tokens: int = 0
    split_block: int = 0
    # Bounded replay: the window (tokens) vLLM's scheduler recomputes at the end of
    # the KV cache manager's hit (Scheduler.prefix_replay_tokens: the sliding window
    # of the groups whose spec as the scheduler reads it is a bounded-replay
    # sliding-window MLA spec; one window for all). 0: no such group.
    replay_window: int = 0
    # Mamba prefill checkpoint blocks (every Mamba group has them): the alignment
    # (tokens) of the checkpoint a backend can export inside a prompt's last chunk,
    # so the scheduler need not stop the chunk there (vLLM's "internal checkpoint",
    # is_mamba_prefill_checkpoint_valid); 0: none, the chunk stops there.
    mamba_checkpoint_alignment: int = 0
    # The tokens a stored request generated before the next request is looked up
    # (0: stored without sampling, as the bare KV cache manager stores a prompt).
    # Each token it samples extends its hashes (they fill its hash lookahead), and
    # the scheduler's next `cache_blocks` moves full attention's partial-tail key
    # with them (`_tail_survives`). The plan's figure is for a request that
    # generated at least its hash lookahead (prefix_facts.setup_from_plan): every
    # longer output gives the same figure.
    stored_output_tokens: int = 0


@dataclass(frozen=True)
class PrefixCacheFacts:
    why_off: WhyOff
    group_units: tuple[int, ...]  # each group's hit unit (0: takes no part)
    unit: int  # the engine's effective hit unit: every hit is a multiple (0: off)
    drop_groups: tuple[int, ...]  # indices of the groups that drop their last block
    drop_tokens: int  # tokens the drop takes off a hit (0: no drop)
    # The shortest prompt that, stored and then repeated by a request one token
    # longer, gets any hit (`first_hit_prefix`; 0: off). Where the scan gave up
    # (`min_shared_prefix_exact` false): a length every shorter prompt misses at.
    min_shared_prefix: int
    # Sliding-window / Mamba groups keep a stored request's state only near its
    # replay boundary (several groups, sparse retention): shorter shared prefixes
    # of that request do not hit.
    boundary_only: bool
    min_shared_prefix_exact: bool = True
    # The shortest prefix that, shared with a stored prompt of any length (at least
    # as long) and followed by one token of the request's own, gets any hit
    # (`first_any_hit_prefix`; 0: off); at most `min_shared_prefix`. Where not
    # exact: the shortest one a hit was found at (shorter ones not all ruled out),
    # or the sent-again figure where that scan gave up.
    min_any_hit_prefix: int = 0
    min_any_hit_prefix_exact: bool = True
    # A stored prompt length the any-hit minimum is reached with (0: off or none).
    min_any_hit_stored_tokens: int = 0
    # Bounded replay: the tokens the scheduler recomputes at the end of the KV
    # cache manager's hit (`PrefixCacheSetup.replay_window`; 0: none). Every
    # figure above but the minimums is the manager's hit; the minimums are those
    # of a served hit (one longer than this window).
    replay_tokens: int = 0

    @property
    def on(self) -> bool:
        return self.why_off is WhyOff.ON


def _drop_groups(setup: PrefixCacheSetup) -> tuple[int, ...]:
    """The groups that drop: the flagged ones, or every group when none is flagged."""
    if not setup.block_drop:
        return ()
    flagged = {i for i, g in enumerate(setup.groups) if g.is_draft}
    if not flagged:
        return tuple(range(len(setup.groups)))
    # Groups of one spec are looked up together: one flagged member makes all drop.
    specs = {setup.groups[i].spec_id for i in flagged if setup.groups[i].spec_id >= 0}
    return tuple(
        i
        for i, g in enumerate(setup.groups)
        if i in flagged or (g.spec_id >= 0 and g.spec_id in specs)
    )


def _alignment(setup: PrefixCacheSetup) -> int:
    if len(setup.groups) == 1:
        return setup.groups[0].block_tokens
    return setup.hash_block if setup.partial_hash_hits else setup.scheduler_block


def _full_like(group: CacheGroup) -> bool:
    """Full attention and the other kinds vLLM looks up as it does full attention
    (reduced sliding window, hidden-state caches: its full-attention manager)."""
    return group.kind in (GroupKind.FULL, GroupKind.OTHER)


def _sparse_kinds() -> frozenset[GroupKind]:
    return frozenset({GroupKind.SLIDING_WINDOW, GroupKind.MAMBA})


def _why_off(setup: PrefixCacheSetup) -> WhyOff:
    if not setup.enabled:
        return WhyOff.DISABLED
    if not any(g.prefix_cacheable for g in setup.groups):
        return WhyOff.NO_CACHEABLE_GROUP
    return WhyOff.ON


def _drop_tokens(setup: PrefixCacheSetup) -> int:
    """The tokens the drop takes off a hit. A Mamba group's lookup takes no drop
    (its state sits at the hit itself); every other dropping group must match its
    drop past the hit, the widest one decides."""
    return min(
        _alignment(setup),
        max(
            (
                setup.groups[i].block_tokens
                for i in _drop_groups(setup)
                if setup.groups[i].kind is not GroupKind.MAMBA and setup.groups[i].prefix_cacheable
            ),
            default=0,
        ),
    )


# How many shared-prefix lengths `first_hit_prefix` evaluates before it gives up
# (x0788, a fuzz engine of 1-token units under a 288-token Mamba block, needs 575).
FIRST_HIT_SCAN_LIMIT = 4_096


def hit_candidates(setup: PrefixCacheSetup, start: int) -> Iterator[int]:
    """The prompt lengths from `start` up at which a prompt stored and then repeated
    (`first_hit_prefix`) can hit differently from one token shorter. Every length
    the simulation reads is a multiple of a block, the hash block, the scheduler
    block, the unit or a chunked-local chunk, counted from the prompt's end less a few tokens
    (its last token, the hash lookahead, the reprefilled tail), so the hit changes
    only where one of those moves; between them it stays."""
    la, tail = setup.hash_lookahead, setup.reprefill_tokens
    offsets = {0, 1, la - 1, la, la + 1, max(1, la), tail, tail + 1, tail + la}
    moduli = {setup.hash_block, setup.scheduler_block, _alignment(setup)}
    moduli |= {g.block_tokens for g in setup.groups}
    # A chunked-local group's free blocks end at the chunk the request's last token is in.
    moduli |= {g.window for g in setup.groups if g.kind is GroupKind.CHUNKED_LOCAL}
    heap = [
        (start + (offset - start) % m, m)
        for m in sorted(x for x in moduli if x > 0)
        for offset in sorted(offsets)
    ]
    heapq.heapify(heap)
    yield start
    last = start
    while heap:
        n, m = heapq.heappop(heap)
        heapq.heappush(heap, (n + m, m))
        if n > last:
            last = n
            yield n


def _scan_horizon(setup: PrefixCacheSetup) -> int:
    """How far past a shared prefix P the scans look at stored lengths.

    For the any-hit scan it is proven enough (docs/prefix-caching.md, "Why the
    scan is exact", lemma H, tested in tests/core/test_prefix_any_hit.py): what a
    stored prompt of S tokens keeps sits near S (its replay boundaries, at least
    S less two scheduler blocks, floored to the unit; the window's blocks below
    them; the Mamba checkpoint a unit lower; the block of its last hash
    boundary), except for the groups that keep every block, whose run reaches
    S less the lookahead, a hash block, the tail and a scheduler block. So past
    P + the unit + the widest window + lookahead + tail + three periods, a prompt
    keeps within P what an endless one does and every such S gives P one hit;
    this adds the drop, the replay window and a fourth period. For a prompt sent
    again (`first_hit_prefix`) the states it keeps move with it: past the horizon
    a scan that found no hit gives up instead of running on (a one-token window
    beside other groups never hits) and says so."""
    period = max(setup.scheduler_block, setup.hash_block, *(g.block_tokens for g in setup.groups))
    windows = [g.window for g in setup.groups if g.kind is not GroupKind.MAMBA]
    return (
        _alignment(setup)
        + _drop_tokens(setup)
        + setup.replay_window
        + setup.hash_lookahead
        + setup.reprefill_tokens
        + max(windows, default=0)
        + 4 * period
    )


def first_hit_prefix(
    setup: PrefixCacheSetup, limit: int = FIRST_HIT_SCAN_LIMIT
) -> tuple[int, bool]:
    """The shortest prompt that, stored and then repeated by a request one token
    longer, gets any hit, and True; or, where `limit` evaluations at the
    `hit_candidates` (or `_scan_horizon`) found none, the shortest length not tried
    (every shorter one misses) and False. (0, True) when prefix caching is off.

    A hit is a positive multiple of the unit within the shared prefix, so the scan
    starts at one unit. The first hit is the unit plus the drop, the hash lookahead
    and a multi-module MTP drafter's reprefilled tail where the drop applies, often
    a token more (the stored prompt's last token is recomputed, so its state is
    kept a unit lower), and far more where Mamba or sliding-window state is kept
    only near a stored prompt's end: fuzz engine x0788 (1-token units, a 288-token
    Mamba block, the drop and a 2-token tail) first hits at 578."""
    if _why_off(setup) is not WhyOff.ON:
        return 0, True
    horizon = _scan_horizon(setup)
    n = _alignment(setup)
    for count, n in enumerate(hit_candidates(setup, _alignment(setup))):
        if count >= limit or n > horizon:
            return n, False
        if served_after_replay(setup, _first_request_hit(setup, n, n, n + 1)):
            return n, True
    return n, False  # pragma: no cover - the candidates never run out


def _least_hit_prefix(setup: PrefixCacheSetup) -> int:
    """No shared prefix shorter than this hits, whatever was stored: a hit is a
    positive multiple of the unit, and every lookup but chunked local's (whose
    blocks before the request's last chunk are free) lands within the hash blocks
    the request shares, after their lookahead, with room for a dropping
    full-attention group's drop (`_full_like_hit`)."""
    unit = _alignment(setup)
    cacheable = [g for g in setup.groups if g.prefix_cacheable]
    if all(g.kind is GroupKind.CHUNKED_LOCAL for g in cacheable):
        return unit
    drops = set(_drop_groups(setup))
    step = setup.hash_block if setup.partial_hash_hits else 0
    drop = max(
        (
            step or g.block_tokens
            for i, g in enumerate(setup.groups)
            if i in drops and g.prefix_cacheable and _full_like(g)
        ),
        default=0,
    )
    return unit + drop + setup.hash_lookahead


def _any_hit(setup: PrefixCacheSetup, shared_prefix: int, stored_tokens: int) -> bool:
    """Whether a request of `shared_prefix` tokens of a stored prompt of
    `stored_tokens` and one token of its own gets any hit the scheduler serves."""
    return (
        served_after_replay(
            setup, _first_request_hit(setup, shared_prefix, stored_tokens, shared_prefix + 1)
        )
        > 0
    )


def first_any_hit_prefix(
    setup: PrefixCacheSetup, limit: int = FIRST_HIT_SCAN_LIMIT
) -> tuple[int, int, bool]:
    """The shortest prefix that, shared with a stored prompt of any length at least
    as long (the request going on with one token of its own), gets any hit: (that
    prefix, a stored length that gives it, True); (0, 0, True) when prefix caching
    is off.

    A stored prompt keeps state where it ended (the replay boundary, the Mamba
    checkpoint, the block holding its last hash boundary): one longer than the
    shared prefix can keep it lower than a prompt sent again does (Jamba: 80
    shared tokens of an 81-token prompt hit 80, a prompt sent again first hits at
    81). The scan starts from the sent-again minimum M (a stored prompt of M
    tokens), tries each stored length that can change the hit (`hit_candidates`)
    at one token below the best prefix so far, and where that hits, bisects down to
    that length's own minimum; it ends at `_least_hit_prefix` or a horizon
    (`_scan_horizon`) past the best. It is exact by lemmas each tested against the
    simulation (docs/prefix-caching.md, "Why the scan is exact"): for one stored
    prompt a longer shared prefix never lowers the hit (P1; so no prompt shorter
    than M hits at all), the hit reads what the stored prompt keeps within the
    shared prefix alone (R), which is the same for every stored length past the
    horizon (H) and changes only at the candidates (C), and nothing below the
    floor hits (F). P1 is proven for one group, for two specs with full attention
    first (one turn) and for full-attention specs beside one other spec that does
    not drop; elsewhere the tests hold it. Where the sent-again scan gave up, or
    `limit` evaluations here do, the flag is False."""
    if _why_off(setup) is not WhyOff.ON:
        return 0, 0, True
    return _any_hit_below(setup, *first_hit_prefix(setup, limit), limit)


def _any_hit_below(
    setup: PrefixCacheSetup, sent_again: int, exact: bool, limit: int
) -> tuple[int, int, bool]:
    """`first_any_hit_prefix` from the sent-again minimum (`first_hit_prefix`)."""
    best = sent_again
    if not exact:
        return best, 0, False
    at, floor, horizon = best, _least_hit_prefix(setup), _scan_horizon(setup)
    evaluations = 0
    for stored in hit_candidates(setup, best):
        if best <= floor or stored > best - 1 + horizon:
            return best, at, True
        if evaluations >= limit:
            return best, at, False
        evaluations += 1
        if not _any_hit(setup, best - 1, stored):
            continue
        low, high = floor, best - 1  # high hits, every length below `low` misses
        while low < high:
            middle = (low + high) // 2
            evaluations += 1
            if _any_hit(setup, middle, stored):
                high = middle
            else:
                low = middle + 1
        best, at = high, stored
    return best, at, False  # pragma: no cover - the candidates never run out


def facts(setup: PrefixCacheSetup) -> PrefixCacheFacts:
    cacheable = [i for i, g in enumerate(setup.groups) if g.prefix_cacheable]
    why = _why_off(setup)
    if why is not WhyOff.ON:
        return PrefixCacheFacts(why, (), 0, (), 0, 0, False)
    unit = _alignment(setup)
    drops = _drop_groups(setup)
    drop_tokens = _drop_tokens(setup)
    first, exact = first_hit_prefix(setup)
    any_hit, any_hit_stored, any_hit_exact = _any_hit_below(
        setup, first, exact, FIRST_HIT_SCAN_LIMIT
    )
    boundary_only = setup.retention_interval is not None and any(
        setup.groups[i].kind in _sparse_kinds() for i in cacheable
    )
    return PrefixCacheFacts(
        why_off=why,
        group_units=tuple(unit if g.prefix_cacheable else 0 for g in setup.groups),
        unit=unit,
        drop_groups=drops,
        drop_tokens=drop_tokens,
        min_shared_prefix=first,
        boundary_only=boundary_only,
        min_shared_prefix_exact=exact,
        min_any_hit_prefix=any_hit,
        min_any_hit_prefix_exact=any_hit_exact,
        min_any_hit_stored_tokens=any_hit_stored,
        replay_tokens=setup.replay_window,
    )


def junction_checkpoint_applies(setup: PrefixCacheSetup) -> bool:
    """Whether the junction checkpoint is in effect: vLLM's KV cache manager takes
    it only with partial hash hits (a Mamba state inside a block can be hit), some
    group in the drafter's set (the flagged ones, or every group under the draft
    drop when none is flagged), and no multi-module MTP reprefilled tail; its
    scheduler stops a chunk at the junction only then, and only with a hash block
    finer than the scheduler block."""
    drafter = setup.block_drop or any(g.is_draft for g in setup.groups)
    return (
        setup.junction_checkpoint
        and drafter
        and setup.partial_hash_hits
        and setup.reprefill_tokens == 0
        and setup.hash_block < setup.scheduler_block
    )


def replay_boundaries(prompt_tokens: int, scheduler_block: int, dropping: bool) -> set[int]:
    """Where a later request repeating a stored prompt can resume: its last token
    is recomputed; with a drop, the block above each candidate is kept too."""
    if not dropping:
        return {prompt_tokens - 1}
    resend = (prompt_tokens - 1) // scheduler_block * scheduler_block
    extension = prompt_tokens // scheduler_block * scheduler_block
    return {max(resend - scheduler_block, 0), max(extension - scheduler_block, 0)}


class _Stored:
    """Which blocks (states) of one stored, fully prefilled prompt each group keeps.

    `junction`: the shared-prefix boundary vLLM recorded for the prompt when it was
    looked up (kept like a replay boundary); `computed_from`: the tokens it got from
    the cache, whose blocks it does not store again (0: it was computed whole)."""

    def __init__(
        self, setup: PrefixCacheSetup, prompt_tokens: int, junction: int = 0, computed_from: int = 0
    ) -> None:
        self.setup = setup
        self.align = _alignment(setup)
        self.drops = set(_drop_groups(setup))
        self.prompt_tokens = prompt_tokens
        self.junction = junction
        # A Mamba state exists only where a prefill chunk of this prompt ended.
        self.chunks = PrefillChunks(setup, prompt_tokens, computed_from, junction)
        h = setup.hash_block
        hashed = max(0, prompt_tokens - setup.hash_lookahead) // h * h
        several = len(setup.groups) > 1
        self.kept: list[set[int] | None] = []  # None: every block up to `full`
        # Mamba states kept inside a block (token positions), per group.
        self.points: list[set[int]] = [set() for _ in setup.groups]
        # Full attention under partial hash hits: where a lookup can land inside a
        # block (the prompt's final hash boundary alone), per group.
        self.tails: list[set[int]] = [set() for _ in setup.groups]
        self.full: list[int] = []
        bounds = replay_boundaries(prompt_tokens, setup.scheduler_block, bool(self.drops))
        if junction:
            bounds.add(junction)
        for i, g in enumerate(setup.groups):
            finalized = max(0, prompt_tokens - setup.reprefill_tokens)
            cacheable = finalized if not several else self._aligned(prompt_tokens)
            if several and i in self.drops and cacheable > 0:
                cacheable = min(finalized, self._aligned(finalized) + g.block_tokens)
            full = min(cacheable, hashed) // g.block_tokens
            if setup.partial_hash_hits and _full_like(g):
                # vLLM registers the block holding the prompt's last hash boundary
                # there too (a resend reads up to its last token but one; the drop
                # the whole prompt), not at the boundaries before it in the block.
                limit = prompt_tokens if i in self.drops else prompt_tokens - 1
                boundary = min(limit // h * h, hashed)
                if (
                    boundary % g.block_tokens
                    and computed_from < boundary <= cacheable
                    and _tail_survives(setup, prompt_tokens, limit, boundary)
                ):
                    self.tails[i].add(boundary)
            self.full.append(full)
            kept = self._kept(i, g, full, bounds)
            if kept is not None and computed_from:
                # Blocks below its hit were another prompt's: only those it computed.
                kept = {j for j in kept if j >= computed_from // g.block_tokens}
                self.points[i] = {p for p in self.points[i] if p > computed_from}
            self.kept.append(kept)

    def _aligned(self, tokens: int) -> int:
        """Where several groups cache up to: the scheduler block, or any hash
        block under partial hash hits."""
        if self.setup.partial_hash_hits:
            return tokens
        return tokens // self.setup.scheduler_block * self.setup.scheduler_block

    def _kept(self, i: int, g: CacheGroup, full: int, bounds: set[int]) -> set[int] | None:
        retention = self.setup.retention_interval
        if g.kind not in _sparse_kinds() or retention is None:
            return None
        b = g.block_tokens
        kept: set[int] = set()
        if g.kind is GroupKind.MAMBA:
            written = self.chunks.is_end
            for bound in bounds:
                block = bound // self.align * self.align // b - 1
                # vLLM keys a kept block with the state at its end once a chunk
                # passes it, whatever state its last chunk inside it wrote
                # (MambaManager.cache_blocks: a block is real where some chunk
                # ended in it); a block no chunk ended in is null and uncached.
                if 0 <= block < full and self.chunks.ends_within(block * b, (block + 1) * b):
                    kept.add(block)
            checkpoint = _mamba_checkpoint(self.setup, b, self.prompt_tokens)
            if checkpoint % b == 0 and 0 < checkpoint // b <= full:
                if written(checkpoint):
                    kept.add(checkpoint // b - 1)
            elif (
                self.setup.partial_hash_hits
                and 0 < checkpoint <= self.prompt_tokens
                and written(checkpoint)
            ):
                # A state inside a block: partial hash hits can land on it.
                self.points[i].add(checkpoint)
            internal = self.chunks.internal_checkpoint(b)
            if internal and internal % b == 0 and internal // b <= full:
                kept.add(internal // b - 1)
            elif internal and self.setup.partial_hash_hits:
                self.points[i].add(internal)  # written inside the last chunk
            junction = self.junction
            if (
                junction % b
                and junction % self.setup.hash_block == 0
                and junction <= self.prompt_tokens
                and junction_checkpoint_applies(self.setup)
                and written(junction)
            ):
                # The opt-in checkpoint: a chunk ends at the junction itself, and its
                # state is kept there (the caller drops it below the request's hit).
                self.points[i].add(junction)
            return kept
        if self.align % b:
            return None
        need = _window_blocks(g, i in self.drops)
        shift = 1 if i in self.drops else 0
        for bound in bounds:
            end = bound // self.align * self.align // b + shift
            kept.update(j for j in range(max(0, end - need), min(full, end)))
        return kept

    def has(self, group: int, block: int) -> bool:
        kept = self.kept[group]
        return block < self.full[group] and (kept is None or block in kept)

    def run(self, group: int) -> int:
        """How many blocks from the first the group keeps without a gap."""
        if self.kept[group] is None:
            return self.full[group]
        return self._run_by_blocks(group)

    def _run_by_blocks(self, group: int) -> int:
        blocks = 0
        while self.has(group, blocks):
            blocks += 1
        return blocks

    def states(self, group: int) -> set[int] | None:
        """Where a Mamba group holds state (token positions: ends of kept blocks
        and states inside a block); None when it keeps every block (dense)."""
        kept = self.kept[group]
        if kept is None:
            return None
        b = self.setup.groups[group].block_tokens
        return {(j + 1) * b for j in kept if j < self.full[group]} | self.points[group]


class _StoredTogether(_Stored):
    """Several stored prompts sharing a prefix: a block is kept if any keeps it."""

    def __init__(self, prompts: list[_Stored]) -> None:
        first = prompts[0]
        self.setup, self.align, self.drops = first.setup, first.align, first.drops
        self.prompts = prompts
        groups = range(len(first.points))
        self.points = [set().union(*(p.points[i] for p in prompts)) for i in groups]
        self.tails = [set().union(*(p.tails[i] for p in prompts)) for i in groups]

    def has(self, group: int, block: int) -> bool:
        return any(p.has(group, block) for p in self.prompts)

    def run(self, group: int) -> int:
        if all(p.kept[group] is None for p in self.prompts):
            return max(p.full[group] for p in self.prompts)
        return self._run_by_blocks(group)

    def states(self, group: int) -> set[int] | None:
        each = [p.states(group) for p in self.prompts]
        if any(s is None for s in each):
            return None
        return set().union(*(s for s in each if s is not None))


def _tail_survives(setup: PrefixCacheSetup, prompt_tokens: int, limit: int, boundary: int) -> bool:
    """Whether full attention's partial-tail key at `boundary` (the prompt's last
    hash boundary its own hashes reach) is still there after the stored request
    generated `setup.stored_output_tokens` tokens.

    vLLM keys the block at the request's last hash boundary up to `limit` (the
    prompt's last token but one; FullAttentionManager._cache_partial_tail_block:
    `min(token_limit // hash, len(request.block_hashes))`), and each `cache_blocks`
    after a decode step keys it again as the sampled tokens extend the request's
    hashes: a boundary inside the block replaces the older key
    (BlockPool.cache_partial_block removes a shorter one), a boundary at the
    block's end caches it whole, which drops its partial keys too
    (BlockPool.cache_full_blocks, the partial-to-full promotion). Either new key's
    hash covers sampled tokens (its lookahead reaches past the prompt), which no
    request repeating the prompt has. So the tail survives only where the output
    moves the request's last boundary below `limit` no further."""
    h = setup.hash_block
    extended = max(0, prompt_tokens + setup.stored_output_tokens - setup.hash_lookahead)
    return min(limit // h * h, extended // h * h) == boundary


def _checkpoint_position(setup: PrefixCacheSetup, prompt_tokens: int, unit: int) -> int:
    """vLLM's prefill checkpoint in `unit`s: the last one a replay of the prompt can
    reach (its last token, or the lookahead, recomputed), one lower under the drop."""
    if setup.block_drop:
        return max(0, prompt_tokens // unit * unit - unit)
    return max(0, (prompt_tokens - max(1, setup.hash_lookahead)) // unit * unit)


def _checkpoint_exportable(
    start: int, end: int, checkpoint: int, hash_block: int, mamba_block: int, alignment: int
) -> bool:
    """Whether a prompt's last chunk from `start` to `end` can have the backend
    export the Mamba state at `checkpoint` inside it (vLLM's
    is_mamba_prefill_checkpoint_valid): the chunk starts on a hash block, ends at
    least two `mamba_block` columns past its initial state's, starts a hash block
    or more below the checkpoint, and reaches it in whole `alignment`s."""
    initial_column = (start - 1) // mamba_block
    checkpoint_column = -(-end // mamba_block) - 2
    return (
        start % hash_block == 0
        and checkpoint_column > initial_column
        and start + hash_block <= checkpoint
        and start < checkpoint < end
        and (checkpoint - start) % alignment == 0
    )


class PrefillChunks:
    """Where vLLM's scheduler ends the prefill chunks of a prompt in Mamba "align"
    mode (its `_mamba_block_aligned_split`), from `start` (the tokens the request
    got from cache): a chunk takes the step's budget, cut down to the split block
    unless it ends the prompt, and stops early at the first of the prompt's
    mandatory stops inside it: the next split-block boundary when it starts inside
    one, the last cacheable split-block position, the last hash-block checkpoint
    (partial hash hits) and the shared-prefix junction (block-floored, or exact
    where the junction checkpoint applies). With Mamba prefill checkpoint blocks
    (`mamba_checkpoint_alignment`) the chunk that reaches the prompt's end skips
    all but the junction where the backend can export the prompt's checkpoint
    inside it, which the scheduler tests against the split block. Between stops
    the ends are a regular grid, which `_walk` walks stop by stop, not chunk by
    chunk."""

    def __init__(
        self, setup: PrefixCacheSetup, prompt_tokens: int, start: int = 0, junction: int = 0
    ) -> None:
        self.budget = setup.prefill_chunk_tokens
        self.block = setup.split_block
        self.prompt_tokens = prompt_tokens
        self.start = start
        self.hash_block = setup.hash_block
        self.alignment = setup.mamba_checkpoint_alignment
        # The scheduler's (and the Mamba manager's) checkpoint unit, and the
        # prompt's checkpoint, the same for both: under the draft drop the
        # coordinator sets the Mamba managers' drop_eagle_checkpoint_block, so the
        # manager's checkpoint is a block lower too (fuzz seed 21's fuzzx/x0901
        # under 0.32: 2,880 of a 3,745-token prompt, not 3,456).
        unit = (
            setup.hash_block
            if setup.partial_hash_hits and setup.hash_block < setup.scheduler_block
            else setup.scheduler_block
        )
        self.checkpoint = _checkpoint_position(setup, prompt_tokens, unit)
        stops: set[int] = set()
        junction_stops: set[int] = set()
        if self.budget and self.block:
            last = _checkpoint_position(setup, prompt_tokens, self.block)
            stops.add(last)
            if setup.partial_hash_hits and setup.hash_block < setup.scheduler_block:
                tail = _checkpoint_position(setup, prompt_tokens, setup.hash_block)
                if last < tail:
                    stops.add(tail)
            if junction > start:
                exact = junction_checkpoint_applies(setup) and junction <= prompt_tokens
                # Floored in the chunk it falls in (an aligned one: an unaligned
                # chunk stops at its block's end first).
                floored = junction // self.block * self.block
                junction_stops.add(junction if exact else floored)
        self.stops = sorted(x for x in stops | junction_stops if start < x < prompt_tokens)
        self.junction_stops = sorted(x for x in junction_stops if start < x < prompt_tokens)
        # The internal checkpoint applies only with whole blocks a chunk (a
        # narrower budget is left to the plain walk).
        self.internal = bool(self.alignment and self.budget and self.block <= self.budget)
        self.final_start = self._walk(prompt_tokens - 1)[1] if self.internal else -1

    def _exports_internally(self, at: int) -> bool:
        """Whether the scheduler lets the chunk from `at` run to the prompt's end
        past the checkpoint stops (its use_internal_checkpoint)."""
        return (
            self.internal
            and at + self.budget >= self.prompt_tokens
            and _checkpoint_exportable(
                at,
                self.prompt_tokens,
                self.checkpoint,
                self.hash_block,
                self.block,
                self.alignment,
            )
        )

    def internal_checkpoint(self, mamba_block: int) -> int:
        """Where the Mamba manager has the backend write the prompt's checkpoint
        inside its last chunk (MambaManager._needs_internal_checkpoint, tested
        against the group's own block), kept as the prompt's checkpoint; 0: none."""
        at, total = self.final_start, self.prompt_tokens
        if at < self.start or -(-total // mamba_block) - 2 < 0:
            return 0
        exported = _checkpoint_exportable(
            at, total, self.checkpoint, self.hash_block, mamba_block, self.alignment
        )
        return self.checkpoint if exported else 0

    def ends_within(self, low: int, high: int) -> bool:
        """Whether a prefill chunk ends in (`low`, `high`] (and inside the prompt):
        as `is_end` at some position there, without asking every one."""
        low, high = max(low, self.start), min(high, self.prompt_tokens - 1)
        if low >= high:
            return False
        if not (self.budget and self.block):
            return True
        if not self.internal and any(low < x <= high for x in self.stops):
            return True
        c = self.block
        if self.budget < c:
            return high // c * c > low
        return self._walk(low)[0] <= high

    def _walk(self, position: int) -> tuple[int, int]:
        """The first chunk end past `position` (the prompt's end where none is
        before it) and where that chunk starts, walked stop by stop, a regular run
        of chunks at a time (not chunk by chunk)."""
        c, total = self.block, self.prompt_tokens
        grid = self.budget // c * c
        at = self.start
        while at < total:
            if self._exports_internally(at):
                end = min([total, *(x for x in self.junction_stops if at < x < total)])
            elif at % c:
                end = min(-(-at // c) * c, *(x for x in self.stops if x > at), total)
            else:
                stop = min((x for x in self.stops if x > at), default=total)
                steps = max(0, min((stop - at) // grid, (total - 1 - at - self.budget) // grid + 1))
                if steps:
                    if position < at + steps * grid:
                        end = at + ((position - at) // grid + 1) * grid
                        return end, end - grid
                    at += steps * grid
                    continue
                end = min(at + self.budget, total)
                if end < total:
                    end = end // c * c
                end = min([end, *(x for x in self.stops if at < x < end)])
            if end > position:
                return end, at
            at = end
        return total, at

    def is_end(self, position: int) -> bool:
        """Whether a prefill chunk ends at `position` (start < position < prompt)."""
        if not (self.budget and self.block):
            return True
        if not self.start < position < self.prompt_tokens:
            return False
        if self.budget < self.block:
            # No chunk reaches a boundary whole: each stops at the next one.
            return position in self.stops or position % self.block == 0
        return self._walk(position - 1)[0] == position


def _mamba_checkpoint(setup: PrefixCacheSetup, mamba_block: int, prompt_tokens: int) -> int:
    """Where vLLM's scheduler ends a prefill chunk so that a Mamba "align" state is
    written there: the last hash block (partial hash hits; else Mamba block) a
    replay can reach, one lower under the draft drop; the state it writes is kept."""
    unit = setup.hash_block if setup.partial_hash_hits else mamba_block
    if setup.block_drop:
        return max(0, prompt_tokens // unit * unit - unit)
    return max(0, (prompt_tokens - max(1, setup.hash_lookahead)) // unit * unit)


def _window_blocks(group: CacheGroup, dropping: bool) -> int:
    need = -(-(group.window - 1) // group.block_tokens)
    return need + (1 if dropping else 0)


def _accepts(
    stored: _Stored, i: int, x: int, reach: tuple[int, int], dropping: bool, max_len: int
) -> bool:
    """Whether group `i`'s lookup can land at `x` tokens. `reach`: (tokens of hash
    blocks that agree with the stored prompt, the request's hashed tokens);
    `dropping`: this lookup takes the draft drop; `max_len`: its candidate."""
    if x == 0:
        return True
    matched, hashed = reach
    g = stored.setup.groups[i]
    b = g.block_tokens
    # Under partial hash hits full attention looks up (and drops) hash blocks: whole
    # blocks, and a stored prompt's block holding its last hash boundary.
    step = b
    if stored.setup.partial_hash_hits and _full_like(g):
        step = stored.setup.hash_block
    drop = step if dropping and g.kind is not GroupKind.MAMBA else 0
    if drop and g.kind is GroupKind.SLIDING_WINDOW:
        # A window longer than the matched run: the run from the first block is the
        # hit, rounded down to the unit, and its drop falls back a whole unit.
        last = (x + stored.align) // b - (1 if b == stored.align else 0)
        if last + 1 < _window_blocks(g, True):
            return (
                last * b <= max_len
                and (last + 1) * b <= min(matched, hashed)
                and all(stored.has(i, j) for j in range(last + 1))
            )
    end = x + drop
    if x > max_len or end > matched or end > hashed:
        return False
    if g.kind is GroupKind.MAMBA and x in stored.points[i]:
        return True
    if end % step:
        return False
    if g.kind is GroupKind.MAMBA:
        return stored.has(i, x // b - 1)
    if step != b and end % b:
        # Inside a block: only where a stored prompt's last hash boundary is.
        return end in stored.tails[i] and all(stored.has(i, j) for j in range(end // b))
    first = 0
    if g.kind is GroupKind.SLIDING_WINDOW:
        # A hit lands on a matched block: a window of one token still needs one.
        first = max(0, end // b - max(1, _window_blocks(g, bool(drop))))
    return all(stored.has(i, j) for j in range(first, -(-end // b)))


def _lookup(
    stored: _Stored, members: list[int], max_len: int, reach: tuple[int, int], dropping: bool
) -> int:
    """The longest hit one lookup of groups sharing a spec returns: the highest
    aligned length at most `max_len` every member can land at."""
    kind = stored.setup.groups[members[0]].kind
    if kind is GroupKind.CHUNKED_LOCAL:
        return _chunked_local_hit(stored, members, max_len, reach)
    if kind is GroupKind.SLIDING_WINDOW and len(stored.setup.groups) > 1:
        return _sliding_window_hit(stored, members, max_len, reach, dropping)
    if kind is GroupKind.MAMBA:
        hit = _mamba_hit(stored, members, max_len, reach)
        if hit is not None:
            return hit
    elif _full_like(stored.setup.groups[members[0]]):
        return _full_like_hit(stored, members, max_len, reach, dropping)
    return _lookup_by_steps(stored, members, max_len, reach, dropping)


def _lookup_by_steps(
    stored: _Stored, members: list[int], max_len: int, reach: tuple[int, int], dropping: bool
) -> int:
    """`_lookup` by trying every aligned length from the top, one unit at a time:
    the reference the shortcuts below are checked against, and the path of the
    kinds they do not cover (one sliding-window group, dense Mamba retention)."""
    unit = stored.align
    x = max_len // unit * unit
    while x > 0 and not all(_accepts(stored, i, x, reach, dropping, max_len) for i in members):
        x -= unit
    return x


def _full_like_hit(
    stored: _Stored, members: list[int], max_len: int, reach: tuple[int, int], dropping: bool
) -> int:
    """`_lookup` for full attention and its kin, which keep every block up to where
    a stored prompt is cached: the highest aligned length whose end (with the drop)
    is a whole block within the kept run, or a stored prompt's last hash boundary
    inside a block (partial hash hits), without trying every unit below."""
    setup = stored.setup
    b = setup.groups[members[0]].block_tokens
    step = setup.hash_block if setup.partial_hash_hits else b
    drop = step if dropping else 0
    unit = stored.align
    matched, hashed = reach
    top = min(max_len + drop, matched, hashed)
    run = min(stored.run(i) for i in members)
    best = 0
    end = min(top, run * b) // b * b
    while end - drop > 0:
        if end % step == 0 and (end - drop) % unit == 0:
            best = end - drop
            break
        end -= b
    tails = set.intersection(*(stored.tails[i] for i in members))
    for end in tails:
        x = end - drop
        if x > best and end <= top and end % step == 0 and x % unit == 0 and end // b <= run:
            best = x
    return best


def _mamba_hit(
    stored: _Stored, members: list[int], max_len: int, reach: tuple[int, int]
) -> int | None:
    """`_lookup` for Mamba groups, which hold state at a few positions: the highest
    aligned one every member accepts, trying only those (None under dense
    retention: the caller steps)."""
    states = stored.states(members[0])
    if states is None:
        return None
    unit = stored.align
    top = min(max_len, *reach)
    for x in sorted(states, reverse=True):
        if (
            0 < x <= top
            and x % unit == 0
            and all(_accepts(stored, i, x, reach, False, max_len) for i in members)
        ):
            return x
    return 0


def _sliding_window_hit(
    stored: _Stored, members: list[int], max_len: int, reach: tuple[int, int], dropping: bool
) -> int:
    """vLLM's sliding-window lookup beside other groups: the right-most run of the
    window's blocks (one more with the drop) whose end, less the dropped block, is
    aligned; failing that the run from the first block, cut to the alignment. The
    drop then takes its block off, and the hit is cut to the alignment again. A
    dropping lookup reads one block past the candidate (as far as it is hashed)."""
    g = stored.setup.groups[members[0]]
    b, align = g.block_tokens, stored.align
    matched, hashed = reach
    limit = min(max_len + b, hashed) if dropping else max_len
    need = _window_blocks(g, dropping)

    def present(j: int) -> bool:
        return (j + 1) * b <= min(matched, hashed) and all(stored.has(i, j) for i in members)

    def aligned(blocks: int) -> int:
        while blocks and blocks * b % align:
            blocks -= 1
        return blocks

    run, hit = 0, -1
    for j in range(limit // b - 1, -1, -1):
        if not present(j):
            run = 0
            continue
        if run == 0 and ((j if dropping else j + 1) * b) % align:
            continue  # a run must end where the hit is aligned
        run += 1
        if run >= need:
            hit = j + run
            break
    blocks = hit if hit >= 0 else aligned(run)
    if dropping and blocks:
        blocks = aligned(blocks - 1)
    return blocks * b


def _chunked_local_hit(
    stored: _Stored, members: list[int], max_len: int, reach: tuple[int, int]
) -> int:
    """Chunked local attention needs no state before the chunk the next token is
    in: those blocks count as hit without a lookup (whatever the request shares),
    and the hit runs on over the blocks from there that the stored prompt has."""
    g = stored.setup.groups[members[0]]
    b = g.block_tokens
    start = max_len // g.window * g.window // b if g.window else 0
    reachable = min(reach)
    blocks = start
    while (blocks + 1) * b <= max_len and (blocks + 1) * b <= reachable:
        if not all(stored.has(i, blocks) for i in members):
            break
        blocks += 1
    return blocks * b


def _spec_groups(setup: PrefixCacheSetup) -> list[tuple[list[int], bool]]:
    """Cacheable groups merged by spec, full attention first (it bounds the rest
    cheapest), each with whether any member takes the drop."""
    drops = set(_drop_groups(setup))
    merged: dict[int, list[int]] = {}
    for i, g in enumerate(setup.groups):
        if g.prefix_cacheable:
            merged.setdefault(g.spec_id if g.spec_id >= 0 else -1 - i, []).append(i)
    ordered = sorted(merged.values(), key=lambda ids: not _full_like(setup.groups[ids[0]]))
    return [(ids, any(i in drops for i in ids)) for ids in ordered]


def lookup_order(setup: PrefixCacheSetup) -> list[tuple[list[int], bool]]:
    """The order the coordinator looks groups up in: each spec's cacheable group
    indices, full attention first, with whether the spec takes the draft drop."""
    return _spec_groups(setup)


def manager_view(setup: PrefixCacheSetup) -> PrefixCacheSetup:
    """`setup` as vLLM's KV cache manager sees it: without the scheduler's bounded
    replay, so `cached_tokens` and `facts` of it are the manager's own hit (what
    conformance/prefix_probe.py compares with the bare manager), and for a stored
    prompt that generated nothing (the bare manager stores one without sampling,
    so its partial-tail keys never move: `_tail_survives`)."""
    return replace(setup, replay_window=0, stored_output_tokens=0)


def served_after_replay(setup: PrefixCacheSetup, manager_hit: int) -> int:
    """The tokens vLLM's scheduler takes from cache for a KV cache manager hit of
    `manager_hit` tokens: the hit less the bounded-replay window it recomputes (its
    `_mark_prefix_replay`; a hit no longer than the window is dropped first, as it
    would save nothing), never rounded to a block. The hit itself where no group
    replays."""
    return max(0, manager_hit - setup.replay_window)


def reported_after_replay(setup: PrefixCacheSetup, manager_hit: int) -> int:
    """The cached tokens vLLM reports for such a hit (its prefill stats: the
    request's usage `cached_tokens` and the prefix-cache hit metrics): the
    manager's hit, replayed window included, once it is longer than the window;
    0 when the scheduler dropped it."""
    return manager_hit if manager_hit > setup.replay_window else 0


def cached_tokens(
    setup: PrefixCacheSetup, shared_prefix: int, stored_tokens: int, request_tokens: int
) -> int:
    """Tokens of a request of `request_tokens` served from cache when its first
    `shared_prefix` tokens repeat a stored, fully prefilled prompt of
    `stored_tokens` (and the rest differ): the scheduler's figure, after its
    bounded replay (`served_after_replay`); the KV cache manager's hit is that of
    `manager_view(setup)`.

    Several groups settle on one length by turns: each lookup may only lower the
    candidate, a dropping group drops once per candidate, and the turns repeat until
    none lowers it (once, for one full-attention group and one other)."""
    if _why_off(setup) is not WhyOff.ON:
        return 0
    return served_after_replay(
        setup, _first_request_hit(setup, shared_prefix, stored_tokens, request_tokens)
    )


def _first_request_hit(
    setup: PrefixCacheSetup, shared_prefix: int, stored_tokens: int, request_tokens: int
) -> int:
    """`cached_tokens` of a setup with prefix caching on."""
    if request_tokens <= 1:
        return 0
    reach = _reach(setup, shared_prefix, stored_tokens, request_tokens)
    return _settle(setup, _Stored(setup, stored_tokens), reach, request_tokens)[0]


def cached_tokens_after_junction(
    setup: PrefixCacheSetup, shared_prefix: int, stored_tokens: int, request_tokens: int
) -> int:
    """As `cached_tokens`, for the request after that one: when the first request
    sharing the prefix is looked up, vLLM records where its groups' hits parted (the
    "shared-prefix junction": the longest single-group hit, when it is longer than
    the settled one); that request, run and stored, then keeps its Mamba state and
    its sliding-window blocks at the junction as well. A later request of
    `request_tokens` sharing the same `shared_prefix` tokens with both (and going on
    differently from each) is looked up against them together. Served after the
    scheduler's bounded replay, as `cached_tokens`; the first request adopts the
    manager's whole hit (the replay recomputes its tail without storing it again)."""
    if _why_off(setup) is not WhyOff.ON or request_tokens <= 1:
        return 0
    reach = _reach(setup, shared_prefix, stored_tokens, request_tokens)
    stored = _Stored(setup, stored_tokens)
    hit, junction = _settle(setup, stored, reach, request_tokens)
    first = _Stored(setup, request_tokens, junction=junction, computed_from=hit)
    return served_after_replay(
        setup, _settle(setup, _StoredTogether([stored, first]), reach, request_tokens)[0]
    )


def _reach(
    setup: PrefixCacheSetup, shared_prefix: int, stored_tokens: int, request_tokens: int
) -> tuple[int, int]:
    """(tokens of hash blocks that agree with the stored prompt, the request's hashed
    tokens)."""
    h, lookahead = setup.hash_block, setup.hash_lookahead
    return (
        max(0, min(shared_prefix, stored_tokens) - lookahead) // h * h,
        max(0, request_tokens - lookahead) // h * h,
    )


def _settle(
    setup: PrefixCacheSetup, stored: _Stored, reach: tuple[int, int], request_tokens: int
) -> tuple[int, int]:
    """The coordinator's turns: (the hit, the shared-prefix junction vLLM records:
    the longest hit one lookup returned on the way, when longer than the hit; else
    0)."""
    spec_groups = _spec_groups(setup)
    if len(setup.groups) == 1:
        ids, dropping = spec_groups[0]
        return _lookup(stored, ids, request_tokens - 1, reach, dropping), 0
    simple = len(spec_groups) == 2 and _full_like(setup.groups[spec_groups[0][0][0]])
    hit = request_tokens - 1
    longest = 0
    full_hits: dict[int, int] = {}
    verified: set[int] = set()
    while True:
        candidate = hit
        for index, (ids, dropping) in enumerate(spec_groups):
            if _full_like(setup.groups[ids[0]]) and index in full_hits:
                candidate = min(candidate, full_hits[index])
                continue
            drop_now = dropping and index not in verified
            found = _lookup(stored, ids, candidate, reach, drop_now)
            if drop_now:
                verified.add(index)
            elif found < candidate:
                verified.clear()
            candidate = found
            longest = max(longest, candidate)
            if _full_like(setup.groups[ids[0]]):
                full_hits[index] = found
        if candidate >= hit or simple:
            hit = min(hit, candidate)
            return hit, longest if longest > hit else 0
        hit = candidate


__all__ = [
    "FIRST_HIT_SCAN_LIMIT",
    "CacheGroup",
    "GroupKind",
    "PrefillChunks",
    "PrefixCacheFacts",
    "PrefixCacheSetup",
    "WhyOff",
    "cached_tokens",
    "cached_tokens_after_junction",
    "facts",
    "first_any_hit_prefix",
    "first_hit_prefix",
    "hit_candidates",
    "junction_checkpoint_applies",
    "lookup_order",
    "manager_view",
    "replay_boundaries",
    "reported_after_replay",
    "served_after_replay",
]
