"""Differential check of kvplan's prefix-cache prediction against each release's
own KV cache manager (run in that release's CPU environment, like compare.py).

For every generated engine that both planners accept with prefix caching on, this
starts the release's KVCacheManager (and its coordinator) with the arguments its
scheduler would give it, stores one request (prefilled one scheduler block per
step, as chunked prefill caches it, a step ending where the scheduler ends one
for a Mamba checkpoint, then finished), then asks for the longest
cache hit of requests that repeat its first N tokens and then diverge, for N just
under and over each unit, multiples of it, and the draft block drop, and compares
vLLM's hit length with kvplan.core.prefix_cache.cached_tokens. Where a Mamba or
sliding-window group sits beside others it also measures the request after that
one, once the first has recorded its shared-prefix junction and run ("later"
probes, against cached_tokens_after_junction; --first-only skips them). For the
minimum prefix (facts' min_shared_prefix) it stores a prompt of that many tokens,
and of a few lengths below it, each on a new manager, and repeats it with one more
token: vLLM must hit as kvplan says, so at the minimum and not below ("min"
probes; --min-only runs these alone). For the minimum shared prefix for any hit
(facts' min_any_hit_prefix, M) it stores the prompt length kvplan says gives it and
looks up M tokens of it, and M - 1 tokens of that and of stored lengths around it
("any" probes, run beside the min probes).

    python -m conformance.prefix_probe [--only ID] [--stride K --offset I] [--limit N]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from conformance import vllm_driver as driver
from conformance.compare import for_release
from conformance.generate import (
    add_fuzz_argument,
    add_split_arguments,
    check_split,
    fuzz_sections,
    generate_cases,
    split_cases,
)
from conformance.prefix_lengths import block_by_block, probe_lengths, stored_and_tail
from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import PlanningError
from kvplan.core.prefix_cache import (
    GroupKind,
    PrefixCacheSetup,
    cached_tokens,
    cached_tokens_after_junction,
    facts,
    hit_candidates,
)
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.prefix_facts import setup_from_plan

Json = dict[str, Any]


def _hasher(hash_block: int, lookahead: int) -> Any:
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    try:
        from vllm.utils.hashing import sha256_cbor as hash_fn
    except ImportError:  # pragma: no cover - older layout
        from vllm.utils import sha256_cbor as hash_fn  # type: ignore[no-redef]
    init_none_hash(hash_fn)
    if lookahead:  # 0.33+: the engine hashes with the drafter's lookahead
        return get_request_block_hasher(hash_block, hash_fn, lookahead)
    return get_request_block_hasher(hash_block, hash_fn)


def _request(rid: str, tokens: list[int], hasher: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def _failure(exc: Exception) -> str:
    """vLLM's own error, as one line: its type, message and the vLLM function
    that raised it (the class of failure the report counts)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = next(
        (f"{Path(f.filename).name}:{f.name}" for f in reversed(frames) if "vllm" in f.filename),
        "?",
    )
    message = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__} in {where}: {message}"[:200]


class PoolTooSmall(RuntimeError):
    """The probe's block pool cannot hold the requests it stores and runs: vLLM
    could not allocate a step, or evicted a cached block to make room (a hit read
    after that would be a smaller pool's, not the engine's). The harness's own
    error, never counted as vLLM's."""


def _pool_blocks(kv_cache_config: Any, requests: list[int], watermark: float) -> int:
    """Blocks for `requests` (token counts) held at once in every group, as each
    group's manager counts them (a block per started block, one more where a step
    straddles a block, a Mamba group's speculative blocks), the null block, and the
    watermark vLLM keeps free for waiting requests. Cached blocks of a finished
    request stay in the pool, so the stored request counts while the next runs.
    A larger pool only costs time: the manager builds every block (a floor of
    4,096 blocks took 40% of a probe run, 3.8 of 9.4 s on 40 fuzz engines)."""
    needed = 1 + sum(
        -(-tokens // spec.block_size) + 1 + int(getattr(spec, "num_speculative_blocks", 0))
        for tokens in requests
        for group in kv_cache_config.kv_cache_groups
        for spec in [group.kv_cache_spec]
    )
    if watermark:  # int(watermark * num_blocks) blocks stay free beside them
        needed = math.ceil(needed / (1.0 - watermark)) + 1
    return needed


def _refuse_evictions(pool: Any) -> None:
    """Make `pool` raise PoolTooSmall where it would evict a cached block to hand
    it out: its `_maybe_evict_cached_block` sees the block just taken from the free
    queue (no reference yet). vLLM's other calls to it (a Mamba checkpoint slot
    overwritten, a partial block's hash replaced) are on blocks a request holds and
    are the engine's own behaviour, left as they are."""
    evict = pool._maybe_evict_cached_block

    def evict_unless_for_room(block: Any) -> bool:
        if block.ref_cnt == 0 and block.block_hash is not None:
            raise PoolTooSmall(
                f"the probe's pool of {pool.num_gpu_blocks} blocks evicted a cached "
                "block to make room: _pool_blocks undercounts what these requests hold"
            )
        return bool(evict(block))

    pool._maybe_evict_cached_block = evict_unless_for_room


def _mamba_checkpoint(manager: Any, arguments: Json, stored: int) -> int:
    """Where the release's scheduler ends a prefill chunk so that a Mamba "align"
    state is written (its `_mamba_block_aligned_split`, from vLLM's own helper);
    0 without such a group."""
    from vllm.v1 import kv_cache_interface as interface

    blocks = [
        spec.block_size
        for group in arguments["kv_cache_config"].kv_cache_groups
        for spec in [group.kv_cache_spec]
        if isinstance(spec, interface.MambaSpec) and spec.mamba_cache_mode == "align"
    ]
    if not blocks:
        return 0
    partial = getattr(manager.coordinator, "enable_partial_hash_hits", False)
    unit = arguments["hash_block_size"] if partial else blocks[0]
    position = interface.get_mamba_prefill_checkpoint_position
    lookahead = arguments.get("num_hash_lookahead_tokens", 0)
    if lookahead:  # 0.33+
        return int(
            position(stored, unit, arguments["use_eagle"], num_hash_lookahead_tokens=lookahead)
        )
    return int(position(stored, unit, arguments["use_eagle"]))


def _manager(stored: int, requests: list[int]) -> tuple[Any, Json, Any]:
    """A new KV cache manager of the release's (driver.MANAGER_ARGUMENTS: the last
    engine the driver started), its arguments and the request hasher. Its pool
    holds `requests` (token counts: the stored request and any run after it) at
    once, so nothing cached is evicted (_refuse_evictions makes sure)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    arguments = dict(driver.MANAGER_ARGUMENTS)
    scheduler = arguments.pop("scheduler")
    pool = _pool_blocks(scheduler, requests, float(arguments.get("watermark", 0.0)))
    arguments["kv_cache_config"] = replace(scheduler, num_blocks=pool)
    arguments["max_model_len"] = max(arguments["max_model_len"], 4 * stored)
    manager = KVCacheManager(**arguments)
    _refuse_evictions(manager.block_pool)
    hasher = _hasher(arguments["hash_block_size"], arguments.get("num_hash_lookahead_tokens", 0))
    return manager, arguments, hasher


def _mamba_block(arguments: Json) -> int:
    """The scheduler's block in "align" mode (a Mamba group's), 0 without one."""
    from vllm.v1 import kv_cache_interface as interface

    for group in arguments["kv_cache_config"].kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, interface.MambaSpec) and spec.mamba_cache_mode == "align":
            return int(spec.block_size)
    return 0


def _junction_stops_exactly(manager: Any, arguments: Json) -> bool:
    """The release's scheduler ends a chunk at the junction itself, not block-floored:
    vLLM's opt-in enable_mamba_shared_prefix_checkpoint, where its manager takes it
    (`mamba_shared_prefix_checkpoint`) and its hash block is finer than the
    scheduler block (the scheduler's `mamba_partial_cache_hit`)."""
    return bool(getattr(manager, "mamba_shared_prefix_checkpoint", False)) and (
        arguments["hash_block_size"] < arguments["scheduler_block_size"]
    )


def _run(manager: Any, arguments: Json, request: Any, hit: int = 0, blocks: Any = None) -> None:
    """Prefill `request` from its hit as chunked prefill does (one scheduler block a
    step, a step ending where the scheduler ends one: the Mamba prefill checkpoint
    and the shared-prefix junction, block-floored, or exactly where the junction
    checkpoint is on and the junction within the prompt), then finish it."""
    total = request.num_tokens
    step = arguments["scheduler_block_size"]
    checkpoint = _mamba_checkpoint(manager, arguments, total)
    mamba_block = _mamba_block(arguments)
    junction = request.shared_prefix_boundary if mamba_block else 0
    exact = _junction_stops_exactly(manager, arguments) and junction <= request.num_prompt_tokens
    done = hit
    while done < total:
        take = min(step - done % step, total - done)
        stops = [checkpoint]
        if done < junction < done + take:
            floored = done + (junction - done) // mamba_block * mamba_block
            stops.append(junction if exact else floored)
        take = min([take] + [s - done for s in stops if done < s < done + take])
        adopted = (hit, blocks) if done == hit else (0, None)
        manager.new_step_starts()  # as each scheduler step does
        if manager.allocate_slots(request, take, adopted[0], adopted[1]) is None:
            raise PoolTooSmall(
                f"the probe's pool of {manager.block_pool.num_gpu_blocks} blocks cannot "
                f"take {take} more tokens of a {total}-token request at {done}"
            )
        request.num_computed_tokens = done + take
        done += take
        manager.cache_blocks(request, done)
    manager.free(request)


def _later_is_probed(setup: PrefixCacheSetup) -> bool:
    """Later requests can differ from the first only where a recorded junction
    shapes what is kept: several groups, one of them Mamba or sliding window."""
    return len(setup.groups) > 1 and any(
        g.prefix_cacheable and g.kind in (GroupKind.MAMBA, GroupKind.SLIDING_WINDOW)
        for g in setup.groups
    )


def vllm_hits(stored: int, lengths: list[int], tail: int) -> list[int | str]:
    """Hits the release's own manager gives (driver.MANAGER_ARGUMENTS: the last
    engine the driver started) to the first request sharing each prefix after the
    stored one; where its lookup raises, the failure (_failure) in that probe's
    place. Storing the request raising propagates."""
    manager, arguments, hasher = _manager(stored, [stored])
    first = _request("stored", list(range(stored)), hasher)
    manager.get_computed_blocks(first)
    _run(manager, arguments, first)
    hits: list[int | str] = []
    for n in lengths:
        probe = _request(f"p{n}", list(range(n)) + [10**7 + i for i in range(tail)], hasher)
        try:
            _, hit, _ = manager.get_computed_blocks(probe)
        except Exception as exc:  # vLLM's own lookup: report, do not hide
            hits.append(_failure(exc))
            continue
        hits.append(int(hit))
    return hits


def vllm_later_hit(stored: int, n: int, tail: int) -> int | str:
    """The hit of the second request sharing `n` tokens with the stored one, after
    the first (looked up, its junction recorded, run and finished) on a new manager;
    each goes on with its own tokens. A failure of vLLM's: _failure."""
    manager, arguments, hasher = _manager(stored, [stored, n + tail])
    prefix = list(range(n))
    try:
        stored_request = _request("stored", list(range(stored)), hasher)
        manager.get_computed_blocks(stored_request)
        _run(manager, arguments, stored_request)
        first = _request("first", prefix + [10**7 + i for i in range(tail)], hasher)
        blocks, hit, junction = manager.get_computed_blocks(first)
        first.shared_prefix_boundary = junction
        _run(manager, arguments, first, int(hit), blocks)
        later = _request("later", prefix + [2 * 10**7 + i for i in range(tail)], hasher)
        _, later_hit, _ = manager.get_computed_blocks(later)
    except PoolTooSmall:
        raise
    except Exception as exc:  # vLLM's own: report, do not hide
        return _failure(exc)
    return int(later_hit)


def vllm_min_hits(pairs: list[tuple[int, int]]) -> list[int | str]:
    """For each (stored, shared): the hit the release's own manager gives a request
    repeating the first `shared` tokens of a stored prompt of `stored` tokens and
    going on one token, each on a new manager (the minimum probes); a failure of
    vLLM's (_failure) in that probe's place."""
    hits: list[int | str] = []
    for stored, shared in pairs:
        manager, arguments, hasher = _manager(stored, [stored])
        try:
            first = _request("stored", list(range(stored)), hasher)
            manager.get_computed_blocks(first)
            _run(manager, arguments, first)
            probe = _request("probe", [*range(shared), 10**7], hasher)
            _, hit, _ = manager.get_computed_blocks(probe)
        except PoolTooSmall:
            raise
        except Exception as exc:  # vLLM's own: report, do not hide
            hits.append(_failure(exc))
            continue
        hits.append(int(hit))
    return hits


def min_probe_lengths(setup: PrefixCacheSetup) -> list[int]:
    """Prompt lengths the minimum probes store and repeat: the predicted minimum
    (facts' min_shared_prefix, the first that hits), the two below it and one unit
    below it (none where the scan gave up)."""
    f = facts(setup)
    if not f.on or not f.min_shared_prefix_exact:
        return []
    minimum = f.min_shared_prefix
    return sorted({n for n in (minimum, minimum - 1, minimum - 2, minimum - f.unit) if n > 0})


def any_hit_probe_pairs(setup: PrefixCacheSetup) -> list[tuple[int, int]]:
    """(stored, shared) pairs the any-hit probes store and look up: the predicted
    shortest shared prefix M for any hit (facts' min_any_hit_prefix) against the
    stored length that gives it (S) and its neighbours; M - 1 against S, stored
    lengths around it, M - 1 itself (sent again), a unit and a scheduler block
    past S, and the first stored lengths past M - 1 where the hit can change
    (`hit_candidates`): vLLM must hit at (S, M) and nowhere at M - 1. None where
    the scan was not exact."""
    f = facts(setup)
    if not f.on or not f.min_any_hit_prefix_exact:
        return []
    minimum, at = f.min_any_hit_prefix, f.min_any_hit_stored_tokens
    pairs = {(stored, minimum) for stored in (at - 1, at, at + 1) if stored >= minimum}
    below = minimum - 1
    if below > 0:
        stored_lengths = {below, minimum, at - 2, at - 1, at, at + 1, at + 2}
        stored_lengths |= {at + f.unit, at + setup.scheduler_block}
        for count, stored in enumerate(hit_candidates(setup, below)):
            if count >= 6:
                break
            stored_lengths.add(stored)
        pairs |= {(stored, below) for stored in stored_lengths if stored >= below}
    return sorted(pairs)


def _vllm_raised(hit: int | str, counts: dict[str, int], failure_classes: dict[str, int]) -> bool:
    """Whether vLLM's lookup raised (`hit` is then its failure class): counted as
    vLLM's failure, never as a probe."""
    if not isinstance(hit, str):
        return False
    counts["lookup_crashes"] += 1
    failure_classes[hit] = failure_classes.get(hit, 0) + 1
    return True


def _probe_any(
    case_id: str,
    setup: PrefixCacheSetup,
    counts: dict[str, int],
    disagreements: list[Json],
    failure_classes: dict[str, int],
) -> None:
    """The any-hit probes (vllm_min_hits at any_hit_probe_pairs) against
    cached_tokens: vLLM hits at the predicted minimum for any hit with the stored
    length kvplan names, and at nothing a token below it."""
    pairs = any_hit_probe_pairs(setup)
    try:
        got = vllm_min_hits(pairs)
    except PoolTooSmall as exc:
        raise PoolTooSmall(f"{case_id} (any-hit probes {pairs}): {exc}") from exc
    f = facts(setup)
    minimum = f.min_any_hit_prefix
    counts["any_lower_engines"] += bool(pairs) and minimum < f.min_shared_prefix
    for (stored, shared), hit in zip(pairs, got, strict=True):
        if _vllm_raised(hit, counts, failure_classes):
            continue
        want = cached_tokens(setup, shared, stored, shared + 1)
        counts["any_probes"] += 1
        counts["any_below"] += shared < minimum
        if want == hit:
            counts["any_agree"] += 1
        elif len(disagreements) < 2000:
            disagreements.append(
                {
                    "id": case_id,
                    "any_hit_minimum": minimum,
                    "shared": shared,
                    "stored": stored,
                    "vllm": hit,
                    "kvplan": want,
                    "setup": repr(setup),
                }
            )


def _probe_min(
    case_id: str,
    setup: PrefixCacheSetup,
    counts: dict[str, int],
    disagreements: list[Json],
    failure_classes: dict[str, int],
) -> None:
    """The minimum probes (vllm_min_hits at min_probe_lengths) against
    cached_tokens: vLLM hits at the predicted minimum and at nothing below it."""
    lengths = min_probe_lengths(setup)
    try:
        got = vllm_min_hits([(n, n) for n in lengths])
    except PoolTooSmall as exc:
        raise PoolTooSmall(f"{case_id} (minimum probes {lengths}): {exc}") from exc
    for n, hit in zip(lengths, got, strict=True):
        if _vllm_raised(hit, counts, failure_classes):
            continue
        want = cached_tokens(setup, n, n, n + 1)
        counts["min_probes"] += 1
        if want == hit:
            counts["min_agree"] += 1
        elif len(disagreements) < 2000:
            disagreements.append(
                {
                    "id": case_id,
                    "minimum": facts(setup).min_shared_prefix,
                    "shared": n,
                    "stored": n,
                    "vllm": hit,
                    "kvplan": want,
                    "setup": repr(setup),
                }
            )


def run(
    only: list[str],
    limit: int | None,
    seed: int = 20260,
    scenarios: bool = True,
    fuzz: dict[str, int] | None = None,
    later: bool = True,
    minimum: bool = True,
    first: bool = True,
    split: tuple[int, int] = (1, 0),
) -> Json:
    """Probe the cases of `seed` (kept by `only`, then `split`: stride and offset,
    generate.split_cases, then `limit`)."""
    cases = generate_cases(seed, scenarios=scenarios, fuzz=fuzz)
    if only:
        cases = [c for c in cases if any(s in c.id for s in only)]
    cases = split_cases(cases, *split)
    if limit is not None:
        cases = cases[:limit]
    counts = {
        "engines": 0,
        "off": 0,
        "refused": 0,
        "not_probed": 0,
        "crashed": 0,
        "probes": 0,
        "agree": 0,
        "lookup_crashes": 0,
        "later_probes": 0,
        "later_agree": 0,
        "later_gain": 0,  # later probes where vLLM hits more than for the first request
        # A prompt of the predicted minimum (and of a few lengths below it) stored,
        # then repeated with one more token: vLLM hits at the minimum, not below.
        "min_probes": 0,
        "min_agree": 0,
        # The shortest prefix shared with a stored prompt of any length that hits
        # (min_any_hit_prefix), with the stored length that gives it, and a token
        # below it with stored lengths around that one: vLLM hits as kvplan says.
        "any_probes": 0,
        "any_agree": 0,
        "any_below": 0,  # any-hit probes a token below the minimum (kvplan: no hit)
        "any_lower_engines": 0,  # engines probed whose any-hit minimum is below the other
    }
    # vLLM's own failures, by class (_failure): engines vLLM
    # cannot store a request for, and probes whose lookup raises. Reported, not compared.
    failure_classes: dict[str, int] = {}
    disagreements: list[Json] = []
    crashes: list[Json] = []
    for case in cases:
        request = for_release(case.request, driver.ENGINE_VERSION)
        v = driver.plan_with_vllm(request, GPU_MEMORY_BYTES)
        try:
            response = plan_from_proto(request)
            core = request_from_proto(request)
        except PlanningError:
            continue
        if not v["ok"]:
            counts["refused"] += 1
            continue
        setup = block_by_block(setup_from_plan(core, response))
        if not driver.MANAGER_ARGUMENTS.get("enable_caching"):
            counts["off"] += 1
            if setup.enabled:
                disagreements.append({"id": case.id, "on": "vLLM off, kvplan on"})
            continue
        if core.options.hisparse is not None:
            # HiSparse's managers serve hits through the engine's offload connector,
            # which a bare KVCacheManager does not have.
            counts["not_probed"] += 1
            continue
        stored, tail = stored_and_tail(setup)
        lengths = probe_lengths(setup, stored) if first else []
        try:
            got = vllm_hits(stored, lengths, tail)
        except PoolTooSmall as exc:
            raise PoolTooSmall(f"{case.id} (stored {stored} tokens): {exc}") from exc
        except Exception as exc:  # vLLM's own manager: report, do not hide
            counts["crashed"] += 1
            failure = _failure(exc)
            failure_classes[failure] = failure_classes.get(failure, 0) + 1
            crashes.append({"id": case.id, "error": failure})
            continue
        counts["engines"] += 1
        for n, hit in zip(lengths, got, strict=True):
            if _vllm_raised(hit, counts, failure_classes):
                if failure_classes[str(hit)] == 1:
                    crashes.append({"id": case.id, "shared": n, "stored": stored, "error": hit})
                continue
            want = cached_tokens(setup, n, stored, n + tail)
            counts["probes"] += 1
            if want == hit:
                counts["agree"] += 1
            elif len(disagreements) < 2000:
                disagreements.append(
                    {
                        "id": case.id,
                        "shared": n,
                        "stored": stored,
                        "vllm": hit,
                        "kvplan": want,
                        "setup": repr(setup),
                    }
                )
            if later and _later_is_probed(setup):
                _probe_later(
                    case.id, setup, stored, (n, hit), tail, counts, disagreements, failure_classes
                )
        if minimum:
            _probe_min(case.id, setup, counts, disagreements, failure_classes)
            _probe_any(case.id, setup, counts, disagreements, failure_classes)
    return {
        "counts": counts,
        "disagreements": disagreements,
        "crashes": crashes,
        "failure_classes": failure_classes,
    }


def _probe_later(
    case_id: str,
    setup: PrefixCacheSetup,
    stored: int,
    shared: tuple[int, int],
    tail: int,
    counts: dict[str, int],
    disagreements: list[Json],
    failure_classes: dict[str, int],
) -> None:
    """The second request sharing `n` tokens (vllm_later_hit) against
    cached_tokens_after_junction. `shared`: (n, vLLM's hit for the first one)."""
    n, first_hit = shared
    try:
        hit = vllm_later_hit(stored, n, tail)
    except PoolTooSmall as exc:
        raise PoolTooSmall(f"{case_id} (stored {stored}, shared {n} tokens): {exc}") from exc
    if _vllm_raised(hit, counts, failure_classes):
        return
    want = cached_tokens_after_junction(setup, n, stored, n + tail)
    counts["later_probes"] += 1
    counts["later_gain"] += hit > first_hit
    if want == hit:
        counts["later_agree"] += 1
    elif len(disagreements) < 2000:
        disagreements.append(
            {
                "id": case_id,
                "later": True,
                "shared": n,
                "stored": stored,
                "vllm": hit,
                "kvplan": want,
                "setup": repr(setup),
            }
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--limit", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=20260)
    parser.add_argument("--no-scenarios", action="store_true", help="skip tests/ scenarios")
    parser.add_argument(
        "--first-only", action="store_true", help="skip the later requests (a quicker campaign)"
    )
    parser.add_argument(
        "--min-only",
        action="store_true",
        help="only the minimum probes (the predicted minimum prefix and below it)",
    )
    add_fuzz_argument(parser)
    add_split_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_split(args.stride, args.offset)
    except ValueError as error:
        parser.error(str(error))
    start, cpu = time.perf_counter(), time.process_time()
    fuzz = fuzz_sections(args.fuzz)
    result = run(
        args.only,
        args.limit,
        args.seed,
        not args.no_scenarios,
        fuzz,
        later=not (args.first_only or args.min_only),
        minimum=True,
        first=not args.min_only,
        split=(args.stride, args.offset),
    )
    result["meta"] = {
        "vllm": driver.VLLM_VERSION,
        "seed": args.seed,
        "fuzz": fuzz,
        "stride": args.stride,
        "offset": args.offset,
        "seconds": round(time.perf_counter() - start, 1),
        # This process's CPU time: on a shared machine the wall time says more
        # about the neighbours than about the probe.
        "cpu_seconds": round(time.process_time() - cpu, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    c = result["counts"]
    print(
        f"vLLM {driver.VLLM_VERSION}: {c['engines']} engines probed, {c['probes']} probes, "
        f"{c['agree']} agree; {c['off']} with prefix caching off, {c['refused']} refused, "
        f"{c['crashed']} engines vLLM fails to store a request for, "
        f"{c['lookup_crashes']} lookups vLLM raises in; later requests (after the "
        f"junction is recorded): {c['later_probes']} probes, {c['later_agree']} agree, "
        f"{c['later_gain']} hit more than the first; minimum prefix: {c['min_probes']} "
        f"probes, {c['min_agree']} agree; any-hit minimum: {c['any_probes']} probes "
        f"({c['any_below']} a token below it; {c['any_lower_engines']} engines where it is "
        f"below the sent-again one), {c['any_agree']} agree "
        f"({result['meta']['seconds']:.0f} s)"
    )
    for failure, count in sorted(result["failure_classes"].items(), key=lambda kv: -kv[1]):
        print(f"  vLLM fails {count}x: {failure}")
    # vLLM crashing in its own lookup is reported, not failed on: it is vLLM's.
    agree = (
        c["agree"] == c["probes"]
        and c["later_agree"] == c["later_probes"]
        and c["min_agree"] == c["min_probes"]
        and c["any_agree"] == c["any_probes"]
    )
    return 0 if agree and not result["disagreements"] else 1


if __name__ == "__main__":
    sys.exit(main())
