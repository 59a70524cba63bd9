"""The block sizes the engine's scheduler works in, and what the scheduler and its
KV cache manager refuse when they start.

After planning, vLLM's engine core resolves two token granularities from the
groups (the same rules in 0.32, 0.33 and 0.34):

- the scheduler block: one group's block size, or the least common multiple of
  every group's, a DCP-sharded group's size times the DCP size;
- the prefix-cache hash block: the scheduler block with one group, when nothing
  consumes hashes (neither prefix caching nor a KV connector, which HiSparse always
  runs), or with a Mamba group outside "align" mode; otherwise `prefix_match_unit`
  when set, else the greatest common divisor of the prefix-cacheable groups' sizes
  (of every group's, when none is cacheable).

It then starts the scheduler and its KV cache manager, which refuse some of these
engines (ValueError or AssertionError there; `start_scheduler` here). vLLM
does all this after the memory checks, so the planner raises the refusal last.
Before planning, vLLM turns prefix caching off for some models
(`_prefix_caching_in_effect`); all of these rules read that. The scheduler sees
each group as its representative spec (a uniform-type group as its first layer's),
and so do these rules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvplan.core.errors import InvalidRequest, PlanningError, UnplannableSpecs
from kvplan.core.groups import KVCacheGroup
from kvplan.core.request import EngineOptions, SpecDecode
from kvplan.core.rules import RuleSet
from kvplan.core.specs import (
    FullAttentionSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    layer_specs_of,
)

MAX_SCHEDULER_BLOCK = 2**32 - 1  # the reply's scheduler_block_size is a uint32


def group_block_tokens(group: KVCacheGroup, dcp: int) -> int:
    """Tokens one block of the group spans: a DCP-sharded group's block holds
    `dcp` times its block size across the DCP ranks."""
    spec = group.representative_spec
    return spec.block_size * (dcp if spec.dcp_sharded else 1)


def _hashing_sizes(groups: list[KVCacheGroup], dcp: int) -> list[int]:
    """The sizes the hash block must divide: the prefix-cacheable groups', or
    every group's when none is cacheable."""
    sizes = [group_block_tokens(group, dcp) for group in groups]
    cacheable = [
        size
        for group, size in zip(groups, sizes, strict=True)
        if group.representative_spec.prefix_cacheable
    ]
    return cacheable or sizes


# What vLLM 0.32-0.34 do with an engine whose layers need no KV cache and prefix
# caching forced on (checked in each release's engine core: tests/vllm_plugin,
# test_an_engine_without_kv_cache_groups_cannot_prefix_cache_in_vllm_either): the
# configuration keeps it on (only a pooling model gets a warning), the KV cache is
# planned with no group, and the scheduler's KV cache manager then fails. kvplan
# refuses it up front with the same cause.
VLLM_WITHOUT_KV_GROUPS = (
    "vLLM 0.32-0.34 do not start it either: their scheduler's KV cache manager fails "
    "with AssertionError 'HybridKVCacheCoordinator requires at least one cacheable "
    "group.'; it starts with prefix caching off"
)


def _prefix_caching_in_effect(groups: Iterable[KVCacheGroup], options: EngineOptions) -> bool:
    """Prefix caching as the scheduler runs it: vLLM's engine turns it off for a
    model with a non-causal layer, after the configuration (the Mamba mode stays
    as configured): a cached prefix would hold keys that saw later tokens.
    `groups`: every group of the engine (all ranks' layers)."""
    return options.enable_prefix_caching and not any(
        getattr(spec, "non_causal", False)
        for group in groups
        for spec in layer_specs_of(group.spec)
    )


def _hashing(options: EngineOptions, caching: bool) -> bool:
    """Whether block hashes are consumed: by prefix caching or by a KV connector
    (HiSparse always runs one)."""
    return caching or options.hisparse is not None


def _hashes_finely(groups: list[KVCacheGroup], options: EngineOptions, caching: bool) -> bool:
    """Whether block hashes may be finer than the scheduler block: several groups,
    hashes consumed, and no Mamba group outside "align" mode."""
    return (
        len(groups) > 1
        and _hashing(options, caching)
        and (
            options.mamba_align_mode
            or not any(isinstance(group.representative_spec, MambaSpec) for group in groups)
        )
    )


def _resolve_block_sizes(
    groups: list[KVCacheGroup], options: EngineOptions, caching: bool
) -> tuple[int, int]:
    """(scheduler block, hash block) in tokens for the lowest rank's groups;
    `caching`: `_prefix_caching_in_effect`."""
    dcp = options.decode_context_parallel_size
    if groups:
        scheduler = math.lcm(*(group_block_tokens(group, dcp) for group in groups))
    else:
        scheduler = options.block_size * dcp
    if scheduler > MAX_SCHEDULER_BLOCK:
        dcp_scaled = dcp > 1 and any(group.representative_spec.dcp_sharded for group in groups)
        raise InvalidRequest(
            f"the scheduler's block would be {scheduler} tokens (the least common multiple "
            "of the groups' block sizes"
            + (f", each times decode_context_parallel_size {dcp}" if dcp_scaled else "")
            + f"), over {MAX_SCHEDULER_BLOCK}: use block sizes with more in common"
            + (" or a smaller decode_context_parallel_size" if dcp_scaled else ""),
            field="options.parallel.decode_context_parallel_size" if dcp_scaled else "workers",
        )
    if not _hashes_finely(groups, options, caching):
        return scheduler, scheduler
    unit = options.prefix_match_unit
    return scheduler, unit if unit is not None else math.gcd(*_hashing_sizes(groups, dcp))


def _partial_hash_hits(groups: list[KVCacheGroup], hash_block: int, options: EngineOptions) -> bool:
    """Whether prefix-cache hits may land inside a scheduler block: an aligned
    Mamba group whose block is coarser than the hash block (DCP: or equal)."""
    if not options.mamba_align_mode:
        return False
    dcp = options.decode_context_parallel_size
    return any(
        isinstance(spec, MambaSpec)
        and (spec.block_size > hash_block or (dcp > 1 and spec.block_size == hash_block))
        for spec in (group.representative_spec for group in groups)
    )


def _check_hash_alignment(
    groups: list[KVCacheGroup], options: EngineOptions, block_sizes: tuple[int, int]
) -> None:
    """Prefix-cache hashing finer than the scheduler's block: its unit divides every
    prefix-cacheable group's block, and hits land on a multiple of every compressed
    layer's tokens per state."""
    scheduler, hash_block = block_sizes
    unit = options.prefix_match_unit
    dcp = options.decode_context_parallel_size
    sizes = _hashing_sizes(groups, dcp)
    if any(size % hash_block for size in sizes):
        raise InvalidRequest(
            f"prefix_match_unit {hash_block} does not divide the block sizes of the "
            f"prefix-cacheable KV cache groups ({sizes} tokens). Set it to a common "
            f"divisor of them (the largest is {math.gcd(*sizes)}) or leave it unset",
            field="options.prefix_match_unit",
        )
    alignments = sorted(
        {
            tokens
            for group in groups
            if (spec := group.representative_spec).prefix_cacheable
            and isinstance(tokens := getattr(spec, "tokens_per_state", 1), int)
            and tokens > 1
        }
    )
    hit_alignment = hash_block if _partial_hash_hits(groups, hash_block, options) else scheduler
    if any(hit_alignment % tokens for tokens in alignments):
        source = (
            f"prefix_match_unit {unit}"
            if unit is not None and hit_alignment == hash_block
            else "the groups' block sizes"
        )
        raise InvalidRequest(
            f"prefix-cache hits would land every {hit_alignment} tokens (from {source}), "
            f"which is not a multiple of every compressed layer's tokens per state "
            f"({alignments}). Choose a prefix_match_unit (or block sizes) that is, or "
            "disable prefix caching",
            field="options.prefix_match_unit",
        )


def _check_hybrid_caching(groups: list[KVCacheGroup], dcp: int) -> None:
    """The several-group (hybrid) manager with prefix caching, in its order."""
    if dcp > 1:
        for group in groups:
            spec = group.representative_spec
            if not isinstance(spec, FullAttentionSpec) and spec.dcp_sharded:
                raise UnplannableSpecs(
                    "decode context parallelism with prefix caching over several KV "
                    "cache groups supports full-attention (and MLA), Mamba and "
                    f"replicated groups; group {group.group_id} holds "
                    f"{type(spec).__name__} layers "
                    f"{list(group.layer_names[:2])} sharded across the DCP ranks. Set "
                    "dcp_sharded = false on them, disable prefix caching, or set "
                    "decode_context_parallel_size = 1",
                    field="options.parallel.decode_context_parallel_size",
                )
    if not any(group.representative_spec.prefix_cacheable for group in groups):
        raise InvalidRequest(
            "prefix caching is on, but no KV cache group can be prefix-cached"
            + (
                f" (this engine has no KV cache group). {VLLM_WITHOUT_KV_GROUPS}"
                if not groups
                else " (every group opts out, e.g. circular buffers or bounded replay)"
            )
            + ": set options.enable_prefix_caching = false",
            field="options.enable_prefix_caching",
        )


def _check_start(
    groups: list[KVCacheGroup],
    options: EngineOptions,
    spec_decode: SpecDecode,
    rules: RuleSet,
    block_sizes: tuple[int, int],
    caching: bool,
) -> None:
    """Raise what the engine's scheduler raises when it starts with these groups
    (the lowest rank's) and block sizes; `caching`: `_prefix_caching_in_effect`."""
    scheduler = block_sizes[0]
    unit = options.prefix_match_unit
    dcp = options.decode_context_parallel_size
    if len(groups) == 1 and _hashing(options, caching) and unit is not None and unit != scheduler:
        raise InvalidRequest(
            f"prefix_match_unit {unit} has no effect with one KV cache group: prefix-cache "
            f"hits land on its block of {scheduler} tokens. Leave it unset or set it to "
            f"{scheduler}",
            field="options.prefix_match_unit",
        )
    replay_windows = sorted(
        {
            group.representative_spec.sliding_window
            for group in groups
            if isinstance(group.representative_spec, SlidingWindowMLASpec)
            and group.representative_spec.bounded_replay
        }
    )
    if len(replay_windows) > 1:
        raise UnplannableSpecs(
            "sliding-window MLA layers with bounded replay must share one window (a "
            "prefix hit recomputes one window's trailing tokens for every group); "
            f"these groups have windows {replay_windows}",
            field="workers",
        )
    if _hashes_finely(groups, options, caching):
        _check_hash_alignment(groups, options, block_sizes)
    lookahead = spec_decode.prefill_lookahead_tokens
    if caching and scheduler < lookahead:
        # The drafter's prefill lookahead must fit in the last block a prefix-cache
        # hit drops; the groups that drop it are the flagged ones, or every group
        # when the block drop applies and none is flagged.
        # A KV connector (HiSparse) keeps the legacy hashes: the drop applies again.
        lookahead_hashes = rules.lookahead_block_hashes and options.hisparse is None
        all_dropped = spec_decode.block_drop_enabled(rules) and not lookahead_hashes
        if any(group.is_draft for group in groups) or (all_dropped and groups):
            raise InvalidRequest(
                f"multi-module MTP with prefix caching needs the scheduler's block "
                f"({scheduler} tokens) to hold num_speculative_tokens ({lookahead}). Lower "
                "num_speculative_tokens, raise the block size, or disable prefix caching",
                field="spec_decode.num_speculative_tokens",
            )

    for group in groups:
        # The sink manager's own check, as it is built for its group.
        spec = group.representative_spec
        if isinstance(spec, SinkFullAttentionSpec):
            block = group_block_tokens(group, dcp)
            if not spec.sink_len or spec.sink_len % block:
                raise InvalidRequest(
                    f"attention-sink layers {list(group.layer_names[:2])} keep a sink of "
                    f"{spec.sink_len or 0} tokens; the engine needs it to be a positive "
                    f"multiple of their group's block ({block} tokens"
                    + (f", {spec.block_size} x DCP {dcp}" if block != spec.block_size else "")
                    + "). Choose a block size that divides the sink length",
                    field="options.block_size",
                )
    if caching and len(groups) != 1:
        _check_hybrid_caching(groups, dcp)


@dataclass(frozen=True)
class SchedulerStart:
    """What the engine's scheduler starts with, worked out once per model plan (it
    depends on the model alone): its block sizes and, when it would not start, why,
    raised anew for each engine after its memory checks (`refusal()`)."""

    scheduler_block: int  # tokens
    hash_block: int  # tokens
    refused: tuple[type[PlanningError], str, str] | None = None  # class, message, field

    def refusal(self) -> PlanningError | None:
        if self.refused is None:
            return None
        error, message, field = self.refused
        return error(message, field=field)


def start_scheduler(
    groups: list[KVCacheGroup],
    all_groups: Iterable[KVCacheGroup],
    options: EngineOptions,
    spec_decode: SpecDecode,
    rules: RuleSet,
) -> SchedulerStart:
    """The scheduler's start for the lowest rank's `groups`; `all_groups`: every
    group of the engine (what `_prefix_caching_in_effect` reads). A scheduler block
    past the reply's uint32 is raised at once: it is kvplan's limit, not vLLM's."""
    caching = _prefix_caching_in_effect(all_groups, options)
    block_sizes = _resolve_block_sizes(groups, options, caching)
    try:
        _check_start(groups, options, spec_decode, rules, block_sizes, caching)
    except PlanningError as refusal:
        return SchedulerStart(*block_sizes, (type(refusal), refusal.message, refusal.field))
    return SchedulerStart(*block_sizes)


__all__ = [
    "MAX_SCHEDULER_BLOCK",
    "SchedulerStart",
    "group_block_tokens",
    "start_scheduler",
]
