"""Differential check of kvplan's prefix-cache prediction against each release's
own KV cache manager (run in that release's CPU environment, like compare.py).

For every generated engine that both planners accept with prefix caching on, this
starts the release's KVCacheManager (and its coordinator) with the arguments its
scheduler would give it, stores one request (prefilled one scheduler block per
step, as chunked prefill caches it, a step ending where the scheduler ends one
for a Mamba checkpoint, then finished), then asks for the longest
cache hit of requests that repeat its first N tokens and then diverge, for N just
under and over each unit, multiples of it, and the draft block drop, and compares
vLLM's hit length with kvplan.core.prefix_cache.cached_tokens.

    python -m conformance.prefix_probe [--only ID] [--limit K] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from conformance import vllm_driver as driver
from conformance.compare import for_release
from conformance.generate import add_fuzz_argument, fuzz_sections, generate_cases
from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import PlanningError
from kvplan.core.prefix_cache import PrefixCacheSetup, cached_tokens
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.prefix_facts import setup_from_plan

Json = dict[str, Any]
_STORED_UNITS = 6  # the stored request spans this many scheduler blocks (+ a tail)
_POOL_BLOCKS = 4096


def probe_lengths(setup: PrefixCacheSetup, stored: int) -> list[int]:
    """Shared-prefix lengths around every unit the rules name."""
    units = {setup.scheduler_block, setup.hash_block}
    units |= {g.block_tokens for g in setup.groups}
    points = {1, stored - 1, stored}
    for unit in units:
        for k in (1, 2, 3, _STORED_UNITS - 1):
            for delta in (-1, 0, 1):
                points.add(k * unit + delta)
    return sorted(n for n in points if 0 < n <= stored)


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


def _pool_blocks(scheduler: Any, tokens: int) -> int:
    """Blocks for the stored request and one probe in every group at once."""
    per_request = sum(
        -(-tokens // g.kv_cache_spec.block_size) + 1 for g in scheduler.kv_cache_groups
    )
    return max(_POOL_BLOCKS, 2 * per_request + 16)


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


def vllm_hits(stored: int, lengths: list[int], tail: int) -> list[int | str]:
    """Hits the release's own manager gives (driver.MANAGER_ARGUMENTS: the last
    engine the driver started); where its lookup raises, the failure (_failure)
    in that probe's place. Storing the request raising propagates."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    arguments = dict(driver.MANAGER_ARGUMENTS)
    scheduler = arguments.pop("scheduler")
    pool = _pool_blocks(scheduler, stored + tail)
    arguments["kv_cache_config"] = replace(scheduler, num_blocks=pool)
    arguments["max_model_len"] = max(arguments["max_model_len"], 4 * stored)
    manager = KVCacheManager(**arguments)
    hasher = _hasher(arguments["hash_block_size"], arguments.get("num_hash_lookahead_tokens", 0))
    step = arguments["scheduler_block_size"]
    checkpoint = _mamba_checkpoint(manager, arguments, stored)
    first = _request("stored", list(range(stored)), hasher)
    manager.get_computed_blocks(first)
    done = 0
    while done < stored:
        take = min(step, stored - done)
        if done < checkpoint < done + take:
            take = checkpoint - done
        if manager.allocate_slots(first, take) is None:
            raise RuntimeError(f"pool of {pool} blocks too small")
        first.num_computed_tokens += take
        done += take
        manager.cache_blocks(first, done)
    manager.free(first)
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


def run(
    only: list[str],
    limit: int | None,
    seed: int = 20260,
    scenarios: bool = True,
    fuzz: dict[str, int] | None = None,
) -> Json:
    cases = generate_cases(seed, scenarios=scenarios, fuzz=fuzz)
    if only:
        cases = [c for c in cases if any(s in c.id for s in only)]
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
        setup = setup_from_plan(core, response)
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
        unit = max(setup.scheduler_block, *(g.block_tokens for g in setup.groups))
        stored = _STORED_UNITS * unit + unit // 2 + 1
        lengths = probe_lengths(setup, stored)
        tail = unit + 1
        try:
            got = vllm_hits(stored, lengths, tail)
        except Exception as exc:  # vLLM's own manager: report, do not hide
            counts["crashed"] += 1
            failure = _failure(exc)
            failure_classes[failure] = failure_classes.get(failure, 0) + 1
            crashes.append({"id": case.id, "error": failure})
            continue
        counts["engines"] += 1
        for n, hit in zip(lengths, got, strict=True):
            if isinstance(hit, str):
                counts["lookup_crashes"] += 1
                failure_classes[hit] = failure_classes.get(hit, 0) + 1
                if failure_classes[hit] == 1:
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
    return {
        "counts": counts,
        "disagreements": disagreements,
        "crashes": crashes,
        "failure_classes": failure_classes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--limit", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=20260)
    parser.add_argument("--no-scenarios", action="store_true", help="skip tests/ scenarios")
    add_fuzz_argument(parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    fuzz = fuzz_sections(args.fuzz)
    result = run(args.only, args.limit, args.seed, not args.no_scenarios, fuzz)
    result["meta"] = {
        "vllm": driver.VLLM_VERSION,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - start, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    c = result["counts"]
    print(
        f"vLLM {driver.VLLM_VERSION}: {c['engines']} engines probed, {c['probes']} probes, "
        f"{c['agree']} agree; {c['off']} with prefix caching off, {c['refused']} refused, "
        f"{c['crashed']} engines vLLM fails to store a request for, "
        f"{c['lookup_crashes']} lookups vLLM raises in ({result['meta']['seconds']:.0f} s)"
    )
    for failure, count in sorted(result["failure_classes"].items(), key=lambda kv: -kv[1]):
        print(f"  vLLM fails {count}x: {failure}")
    # vLLM crashing in its own lookup is reported, not failed on: it is vLLM's.
    return 0 if c["agree"] == c["probes"] and not result["disagreements"] else 1


if __name__ == "__main__":
    sys.exit(main())
