"""Differential check of kvplan's prefix-cache prediction against each release's
own v1 scheduler, with chunked prefill (run in that release's CPU environment,
like prefix_probe.py).

prefix_probe.py stores a request by prefilling it one scheduler block a step
through the bare KV cache manager. This drives the release's real `Scheduler`
instead, with no model: for every generated engine that both planners accept with
prefix caching on, and for each chunk size (the engine's max_num_batched_tokens,
planned again by both planners with that value), it starts the scheduler on the
engine's scheduler-side KV cache config, cache config (prefix caching, the Mamba
cache mode) and speculative config, submits a request of `stored` tokens and runs
schedule() / update_from_output() with made-up sampled tokens (and draft tokens
where the scheduler asks for them) until it finishes (`--max-tokens`), then
submits a request repeating its first N tokens and going on differently, and
reads the tokens the scheduler took from cache for it in its first step (the
scheduler's own lookup: NewRequestData.num_computed_tokens). Each (engine, chunk,
N) runs on a new scheduler, so no probe sees another's cached state.

The hit is compared with kvplan.core.prefix_cache.cached_tokens of the plan's
setup (for the same stored length, N and request: what the scheduler serves, after
its bounded replay) and with prefix_probe's block-by-block answer (its vllm_hits
on the same engine: the bare manager's hit, which no replay shortens).

    python -m conformance.scheduler_probe [--chunk SPEC ...] [--only ID]
        [--stride K --offset I] [--limit N] [--fuzz SECTION=COUNT] [--out FILE]

A chunk SPEC is a token count (`--chunk 100`) or a multiple of the engine's
coarsest block (`--chunk x0.5`: half a block, at least one token; `x1.37`: not a
multiple of it; `x3`: three blocks).

`make conformance` runs it per release (conformance/run: `--chunk x1.37 --chunk
8192`). It exits 1 on any disagreement outside the known open classes of
conformance/scheduler_known.py, which it counts (`known_first`, `known_later`) and
marks (`known`) in the report; vLLM's own failures and stalls are reported only.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from conformance import prefix_probe as probe
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
from conformance.prefix_lengths import (
    DEFAULT_CHUNKS,
    ChunkSpec,
    parse_chunk,
    probe_lengths,
    stored_and_tail,
)
from conformance.scheduler_known import KNOWN_OPEN, classify, unexpected_disagreements
from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import PlanningError
from kvplan.core.prefix_cache import (
    PrefixCacheSetup,
    cached_tokens,
    cached_tokens_after_junction,
)
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.prefix_facts import setup_from_plan
from kvplan.v1 import plan_pb2

Json = dict[str, Any]
_MAX_STEPS = 100_000  # a request that has not finished after this many steps is stuck
_SAMPLED = 10**8  # made-up sampled and draft tokens: never a prompt token
_TAIL = 10**7  # a probe's own tokens after its shared prefix: 10**7 + i, 2 * 10**7 + i


class SchedulerEngineConfig(driver.PlannerConfig):
    """What vLLM's Scheduler reads of a VllmConfig, over the planned engine's own
    sub-configs (driver.ENGINE_CONFIG: the real SchedulerConfig, CacheConfig,
    ParallelConfig and SpeculativeConfig the driver planned with); the derived
    token counts are VllmConfig's own properties (inherited from PlannerConfig) or
    its own rule (the hash lookahead, driver._num_hash_lookahead_tokens). What a
    model would add (LoRA, multimodal inputs, KV connectors, events) is absent."""

    def __init__(self, planned: driver.PlannerConfig, num_gpu_blocks: int) -> None:
        from vllm.config import ObservabilityConfig, StructuredOutputsConfig
        from vllm.config.vllm import VllmConfig

        cache_config = copy.copy(planned.cache_config)
        cache_config.num_gpu_blocks = num_gpu_blocks
        super().__init__(
            model_config=planned.model_config,
            cache_config=cache_config,
            scheduler_config=planned.scheduler_config,
            parallel_config=planned.parallel_config,
            speculative_config=planned.speculative_config,
            use_v2_model_runner=planned.use_v2_model_runner,
        )
        self.attention_config = planned.attention_config
        self.kv_transfer_config = None
        self.num_hash_lookahead_tokens = driver._num_hash_lookahead_tokens(planned)
        self.lora_config = None
        self.kv_events_config = None
        self.ec_transfer_config = None
        self.watermark_config = None
        self.observability_config = ObservabilityConfig()
        self.structured_outputs_config = StructuredOutputsConfig()
        defaults = VllmConfig.__pydantic_fields__
        self.aux_output_config = defaults["aux_output_config"].default_factory()
        self.ec_manager_config = defaults["ec_manager_config"].default_factory()
        # A model's own attributes, as a text-only decoder without a model reads.
        model = planned.model_config
        self.model_config = SimpleNamespace(
            **vars(model),
            uses_mrope=False,
            is_encoder_decoder=False,
            runner_type="generate",
            supports_multimodal_inputs=False,
            return_sampling_mask=False,
            skip_tokenizer_init=True,  # no tokenizer: no structured output either
        )

    is_mm_encoder_only = False


def _runner_output(scheduler_output: Any, sampled: dict[str, list[int]]) -> Any:
    """A ModelRunnerOutput for one step, as a model runner would return it: the
    scheduled requests in order, `sampled` tokens for those that sampled (a prefill
    chunk that does not reach the prompt's end samples nothing)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    values: Json = {
        "req_ids": req_ids,
        "req_id_to_index": {r: i for i, r in enumerate(req_ids)},
        "sampled_token_ids": [sampled.get(r, []) for r in req_ids],
        "logprobs": None,
        "prompt_logprobs_dict": {},
        "pooler_output": [],
    }
    accepted = {f.name for f in fields(ModelRunnerOutput)}
    return ModelRunnerOutput(**{k: v for k, v in values.items() if k in accepted})


def _step(scheduler: Any, step: int) -> Any:
    """One schedule() / update_from_output() round (_finish_step); the output."""
    out = scheduler.schedule()
    _finish_step(scheduler, out, step)
    return out


def _finish_step(scheduler: Any, out: Any, step: int) -> None:
    """update_from_output() for a scheduled step, as a model runner would answer
    it: each scheduled request that reaches the end of its known tokens samples one
    made-up token (its drafts, if it had any scheduled, all rejected); where the
    scheduler wants drafts and a request goes on decoding, the drafter proposes the
    speculative config's number of made-up tokens."""
    from vllm.v1.outputs import DraftTokenIds

    sampled: dict[str, list[int]] = {}
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        # num_computed_tokens is already advanced past this step (schedule() does it).
        drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
        if request.num_computed_tokens - drafts >= request.num_tokens:
            sampled[req_id] = [_SAMPLED + step]
    scheduler.update_from_output(out, _runner_output(out, sampled))
    k = scheduler.num_spec_tokens
    wants_drafts = k and not getattr(out, "skip_drafts", False)
    going_on = [r for r in sampled if r in scheduler.requests]
    if wants_drafts and going_on:
        drafts_of = [[_SAMPLED + step + 1 + i for i in range(k)] for _ in going_on]
        scheduler.update_draft_token_ids(DraftTokenIds(going_on, drafts_of))


def _run_to_end(scheduler: Any, request: Any, step: int, out: Any = None) -> tuple[int, list[int]]:
    """Run the scheduler until `request` finishes (`out`: a step already scheduled
    for it, finished first); the last step's number and the tokens each of its
    prefill steps scheduled. SchedulerStalled where vLLM's own rules leave it no
    token; PoolTooSmall where the pool does."""
    chunks: list[int] = []
    if out is not None:
        chunks.append(out.num_scheduled_tokens.get(request.request_id, 0))
        _finish_step(scheduler, out, step)
    while request.request_id in scheduler.requests:
        step += 1
        if step > _MAX_STEPS:
            raise probe.PoolTooSmall(f"a request did not finish in {_MAX_STEPS} steps")
        prefilling = request.num_computed_tokens < request.num_prompt_tokens
        out = _step(scheduler, step)
        if not out.num_scheduled_tokens:
            _raise_if_stalled(scheduler, request)
            raise probe.PoolTooSmall(
                f"the scheduler scheduled nothing at step {step} (a pool of "
                f"{scheduler.kv_cache_manager.block_pool.num_gpu_blocks} blocks)"
            )
        if prefilling:
            chunks.append(out.num_scheduled_tokens.get(request.request_id, 0))
    return step, chunks


def _first_step_hit(scheduler: Any, request: Any) -> tuple[int, Any]:
    """Submit `request` and schedule one step: the tokens the scheduler took from
    cache for it, and that step's output."""
    scheduler.add_request(request)
    out = scheduler.schedule()
    new = [r for r in out.scheduled_new_reqs if r.req_id == request.request_id]
    if not new:
        raise probe.PoolTooSmall(
            f"the scheduler did not admit {request.request_id} (a pool of "
            f"{scheduler.kv_cache_manager.block_pool.num_gpu_blocks} blocks)"
        )
    return int(new[0].num_computed_tokens), out


def _scheduler(stored: int, requests: list[int]) -> Any:
    """vLLM's Scheduler for the last engine the driver planned (its scheduler-side
    KV cache config and block sizes, driver.MANAGER_ARGUMENTS; its configs,
    driver.ENGINE_CONFIG), with a block pool that holds `requests` (token counts)
    at once and refuses to evict a cached block (prefix_probe's)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    arguments = driver.MANAGER_ARGUMENTS
    planned = driver.ENGINE_CONFIG["config"]
    kv_config = arguments["scheduler"]
    pool = probe._pool_blocks(kv_config, requests, float(arguments.get("watermark", 0.0)))
    config = SchedulerEngineConfig(planned, pool)
    config.model_config.max_model_len = max(config.model_config.max_model_len, 4 * stored)
    scheduler = Scheduler(
        vllm_config=config,  # type: ignore[arg-type]
        kv_cache_config=replace(kv_config, num_blocks=pool),
        structured_output_manager=StructuredOutputManager(config),  # type: ignore[arg-type]
        block_size=arguments["scheduler_block_size"],
        hash_block_size=arguments["hash_block_size"],
        log_stats=False,
    )
    probe._refuse_evictions(scheduler.kv_cache_manager.block_pool)
    return scheduler


def _request(rid: str, tokens: list[int], max_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    arguments = driver.MANAGER_ARGUMENTS
    hasher = probe._hasher(
        arguments["hash_block_size"], arguments.get("num_hash_lookahead_tokens", 0)
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, tokens, params, None, block_hasher=hasher)


class SchedulerStalled(RuntimeError):
    """vLLM's scheduler schedules nothing for a running request it can never
    finish: its own rules for the request's next chunk (the step's budget, the
    Mamba "align" split, then a multi-module MTP drafter's prefill lookahead
    reservation) leave no token. vLLM's failure, reported by class."""


def _raise_if_stalled(scheduler: Any, request: Any) -> None:
    """SchedulerStalled where vLLM's own rules, applied as its schedule() applies
    them to a running request, leave `request` no tokens in a step of its own."""
    computed = request.num_computed_tokens
    remaining = request.num_tokens - computed
    config = driver.ENGINE_CONFIG["config"]
    speculative = config.speculative_config
    slots = speculative.max_num_new_slots_for_drafting if speculative is not None else 0
    budget = min(
        remaining,
        scheduler.max_num_scheduled_tokens,
        scheduler.scheduler_config.max_num_batched_tokens - slots,
    )
    split = budget
    if getattr(scheduler, "need_mamba_block_aligned_split", False):
        split = scheduler._mamba_block_aligned_split(request, budget)
    if (
        remaining > 0
        and split > 0
        and scheduler._reserve_prefill_lookahead(request, computed, split) == 0
    ):
        # One class per cause (the counts are by message), the figures after it.
        cause = "the Mamba align split" if split < budget else "the step's budget"
        raise SchedulerStalled(
            f"SchedulerStalled: a multi-module MTP prefill lookahead reserves away the "
            f"whole chunk {cause} leaves: nothing scheduled, for ever"
        )


def scheduler_hit(
    stored: int, shared: int, tail: int, max_tokens: int, later: bool = False
) -> Json:
    """On a new scheduler: run a request of `stored` tokens to its end (chunked
    prefill, `max_tokens` sampled), then submit one repeating its first `shared`
    tokens and going on `tail` tokens of its own: the tokens the scheduler took
    from cache for it (`hit`), and the stored request's steps and prefill chunks
    (`steps`, `chunks`: the tokens each prefill step scheduled). `later`: that
    request runs to its end too (from its hit, its shared-prefix junction recorded
    by the scheduler), and a third sharing the same `shared` tokens and going on
    differently from both is submitted: its hit (`later_hit`). PoolTooSmall where
    the pool cannot hold them (the harness's error); SchedulerStalled and vLLM's
    own exceptions propagate."""
    if stored >= _TAIL or tail >= _TAIL:
        # Every prompt token stays below 3 * _TAIL < _SAMPLED: a sampled token equal
        # to one of the next request's own would let it match past the prompt.
        raise ValueError(f"token ids overlap: stored {stored}, tail {tail}")
    slack = 4 * (max_tokens + 2) * (1 + int(driver.ENGINE_CONFIG["config"].num_lookahead_tokens))
    held = [stored + slack, shared + tail + slack] + ([shared + tail + slack] if later else [])
    scheduler = _scheduler(stored, held)
    first = _request("stored", list(range(stored)), max_tokens)
    scheduler.add_request(first)
    steps, chunks = _run_to_end(scheduler, first, 0)
    tokens = list(range(shared)) + [_TAIL + i for i in range(tail)]
    probe_request = _request("probe", tokens, max_tokens)
    hit, out = _first_step_hit(scheduler, probe_request)
    result: Json = {"hit": hit, "steps": steps, "chunks": chunks}
    if later:
        _run_to_end(scheduler, probe_request, steps + 1, out)
        tokens = list(range(shared)) + [2 * _TAIL + i for i in range(tail)]
        result["later_hit"], _ = _first_step_hit(scheduler, _request("later", tokens, max_tokens))
    return result


def _with_chunk(request: plan_pb2.PlanRequest, chunk: int) -> plan_pb2.PlanRequest:
    chunked = plan_pb2.PlanRequest()
    chunked.CopyFrom(request)
    chunked.options.max_num_batched_tokens = chunk
    return chunked


def _plans(request: plan_pb2.PlanRequest) -> tuple[str, PrefixCacheSetup | None]:
    """Plan `request` with the installed release (the driver keeps its scheduler
    view) and with kvplan: the outcome ("ok", "kvplan_refused", "refused", "off",
    "not_probed") and kvplan's prefix-cache setup when "ok"."""
    try:
        response = plan_from_proto(request)
        core = request_from_proto(request)
    except PlanningError:
        return "kvplan_refused", None
    if not driver.plan_with_vllm(request, GPU_MEMORY_BYTES)["ok"]:
        return "refused", None
    setup = setup_from_plan(core, response)
    if not driver.MANAGER_ARGUMENTS.get("enable_caching"):
        return "off", setup
    if core.options.hisparse is not None:
        return "not_probed", setup  # hits come through HiSparse's offload connector
    return "ok", setup


def _new_counts() -> Json:
    return {
        "engines": 0,
        "refused": 0,
        "kvplan_refused": 0,
        "off": 0,
        "not_probed": 0,
        "crashed": 0,
        "stalled": 0,  # probes whose requests vLLM's scheduler never finishes
        "probes": 0,
        "agree": 0,
        "differ_from_block_by_block": 0,
        "multi_chunk_prefills": 0,
        # The request after the first (its junction recorded, run to its end).
        "later_probes": 0,
        "later_agree": 0,
        # Disagreements of a known open class (conformance/scheduler_known.py).
        "known_first": 0,
        "known_later": 0,
    }


def run(
    only: list[str],
    limit: int | None,
    chunks: list[ChunkSpec],
    seed: int = 20260,
    scenarios: bool = True,
    fuzz: dict[str, int] | None = None,
    split: tuple[int, int] = (1, 0),
    max_tokens: int = 2,
    lengths_per_engine: int | None = None,
    output_sensitive: bool = False,
) -> Json:
    """Probe the cases of `seed` (kept by `only`, `split`, then `limit`) at each
    chunk size; counts per chunk spec. `lengths_per_engine` keeps that many of
    prefix_probe's shared lengths, spread over them (None: all). `output_sensitive`
    keeps the engines whose plan has a hash lookahead or partial hash hits, the
    only ones where the stored request's output can move a key (others are not
    counted)."""
    cases = generate_cases(seed, scenarios=scenarios, fuzz=fuzz)
    if only:
        cases = [c for c in cases if any(s in c.id for s in only)]
    cases = split_cases(cases, *split)
    if limit is not None:
        cases = cases[:limit]
    counts = {spec.text: _new_counts() for spec in chunks}
    disagreements: list[Json] = []
    failure_classes: dict[str, int] = {}
    for case in cases:
        request = for_release(case.request, driver.ENGINE_VERSION)
        outcome, setup = _plans(request)
        if output_sensitive and not (
            setup is not None and (setup.hash_lookahead or setup.partial_hash_hits)
        ):
            continue
        if outcome != "ok" or setup is None:
            for spec in chunks:
                counts[spec.text][outcome] += 1
            continue
        unit = max(setup.scheduler_block, *(g.block_tokens for g in setup.groups))
        for spec in chunks:
            _probe_engine(
                case.id,
                _with_chunk(request, spec.for_unit(unit)),
                spec,
                counts[spec.text],
                disagreements,
                failure_classes,
                max_tokens,
                lengths_per_engine,
            )
    return {
        "counts": counts,
        "disagreements": disagreements,
        "failure_classes": failure_classes,
    }


def _spread(lengths: list[int], keep: int | None) -> list[int]:
    """`keep` of `lengths`, evenly spread and always with the last (the whole
    stored prompt sent again)."""
    if keep is None or len(lengths) <= keep:
        return lengths
    step = (len(lengths) - 1) / max(keep - 1, 1)
    return sorted({lengths[round(i * step)] for i in range(keep)} | {lengths[-1]})


def _probe_engine(
    case_id: str,
    request: plan_pb2.PlanRequest,
    spec: ChunkSpec,
    counts: Json,
    disagreements: list[Json],
    failure_classes: dict[str, int],
    max_tokens: int,
    lengths_per_engine: int | None,
) -> None:
    """One engine at one chunk size (`request` carries it): both planners plan it
    again, then every shared length is probed on a new scheduler and compared with
    cached_tokens and with the block-by-block probe."""
    outcome, setup = _plans(request)
    if outcome != "ok" or setup is None:
        counts[outcome] += 1
        return
    # kvplan's figure for a stored request of this probe's output length (the plan
    # states the one for its hash lookahead or more, which every longer output has).
    setup = replace(setup, stored_output_tokens=max_tokens)
    chunk = request.options.max_num_batched_tokens
    stored, tail = stored_and_tail(setup)
    lengths = _spread(probe_lengths(setup, stored), lengths_per_engine)
    try:
        block_by_block = probe.vllm_hits(stored, lengths, tail)
    except Exception as exc:  # vLLM's own manager: report, do not hide
        block_by_block = [probe._failure(exc)] * len(lengths)
    measured: list[Json | str] = []
    later = probe._later_is_probed(setup)
    try:
        for n in lengths:
            try:
                measured.append(scheduler_hit(stored, n, tail, max_tokens, later))
            except SchedulerStalled as exc:  # this probe's requests: vLLM's failure
                measured.append(str(exc))
    except probe.PoolTooSmall as exc:
        raise probe.PoolTooSmall(f"{case_id} (chunk {chunk}, stored {stored}): {exc}") from exc
    except Exception as exc:  # vLLM's own scheduler: report, do not hide
        failure = probe._failure(exc)
        failure_classes[failure] = failure_classes.get(failure, 0) + 1
        counts["crashed"] += 1
        return
    counts["engines"] += 1
    for n, got, manager_hit in zip(lengths, measured, block_by_block, strict=True):
        if isinstance(got, str):
            counts["stalled"] += 1
            failure_classes[got] = failure_classes.get(got, 0) + 1
            continue
        want = cached_tokens(setup, n, stored, n + tail)
        counts["probes"] += 1
        counts["multi_chunk_prefills"] += len(got["chunks"]) > 1
        counts["agree"] += got["hit"] == want
        counts["differ_from_block_by_block"] += got["hit"] != manager_hit
        if later:
            want_later = cached_tokens_after_junction(setup, n, stored, n + tail)
            counts["later_probes"] += 1
            counts["later_agree"] += got["later_hit"] == want_later
            if got["later_hit"] != want_later:
                _disagreement(
                    {
                        "id": case_id,
                        "later": True,
                        "chunk": chunk,
                        "chunk_spec": spec.text,
                        "shared": n,
                        "stored": stored,
                        "scheduler": got["later_hit"],
                        "kvplan": want_later,
                        "setup": repr(setup),
                    },
                    counts,
                    disagreements,
                )
        if got["hit"] != want:
            _disagreement(
                {
                    "id": case_id,
                    "chunk": chunk,
                    "chunk_spec": spec.text,
                    "shared": n,
                    "stored": stored,
                    "scheduler": got["hit"],
                    "kvplan": want,
                    "block_by_block": manager_hit,
                    "stored_chunks": got["chunks"][:40],
                    "setup": repr(setup),
                },
                counts,
                disagreements,
            )


_MAX_RECORDS = 2000  # disagreements kept in the report; every one is counted


def _disagreement(record: Json, counts: Json, disagreements: list[Json]) -> None:
    """Count a disagreement against its known open class, if it is of one
    (conformance/scheduler_known.py: those do not fail the run), and keep it."""
    classify(record, counts)
    if len(disagreements) < _MAX_RECORDS:
        disagreements.append(record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chunk",
        action="append",
        default=[],
        help=f"max_num_batched_tokens: N tokens or xF blocks (default {' '.join(DEFAULT_CHUNKS)})",
    )
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--limit", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=20260)
    parser.add_argument("--no-scenarios", action="store_true", help="skip tests/ scenarios")
    parser.add_argument(
        "--max-tokens", type=int, default=2, help="tokens the stored request generates"
    )
    parser.add_argument(
        "--output-sensitive",
        action="store_true",
        help="only engines whose plan has a hash lookahead or partial hash hits (where "
        "the stored request's output can move a key)",
    )
    parser.add_argument(
        "--lengths",
        type=int,
        help="shared lengths per engine and chunk, spread over prefix_probe's (default all)",
    )
    add_fuzz_argument(parser)
    add_split_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_split(args.stride, args.offset)
        chunks = [parse_chunk(text) for text in args.chunk or DEFAULT_CHUNKS]
    except ValueError as error:
        parser.error(str(error))
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: a request generates 1 or more")
    if args.lengths is not None and args.lengths < 1:
        parser.error(f"--lengths {args.lengths}: probe 1 or more shared lengths")
    start, cpu = time.perf_counter(), time.process_time()
    fuzz = fuzz_sections(args.fuzz)
    result = run(
        args.only,
        args.limit,
        chunks,
        args.seed,
        not args.no_scenarios,
        fuzz,
        split=(args.stride, args.offset),
        max_tokens=args.max_tokens,
        lengths_per_engine=args.lengths,
        output_sensitive=args.output_sensitive,
    )
    result["meta"] = {
        "vllm": driver.VLLM_VERSION,
        "seed": args.seed,
        "fuzz": fuzz,
        "stride": args.stride,
        "offset": args.offset,
        "chunks": [c.text for c in chunks],
        "max_tokens": args.max_tokens,
        "output_sensitive": args.output_sensitive,
        "seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1),
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for text, c in result["counts"].items():
        print(
            f"vLLM {driver.VLLM_VERSION}, chunk {text}: {c['engines']} engines, "
            f"{c['probes']} probes ({c['multi_chunk_prefills']} stored in several chunks); "
            f"{c['probes'] - c['agree']} disagree with kvplan ({c['known_first']} of a known "
            f"open class); {c['differ_from_block_by_block']} differ from the block-by-block "
            f"probe; later requests: {c['later_probes'] - c['later_agree']} disagree of "
            f"{c['later_probes']} ({c['known_later']} known); "
            f"{c['off']} off, {c['refused']} refused by vLLM, {c['kvplan_refused']} by "
            f"kvplan, {c['not_probed']} not probed, {c['crashed']} vLLM fails in, "
            f"{c['stalled']} probes it stalls in"
        )
    for failure, count in sorted(result["failure_classes"].items(), key=lambda kv: -kv[1]):
        print(f"  vLLM fails {count}x: {failure}")
    print(f"({result['meta']['seconds']:.0f} s, {result['meta']['cpu_seconds']:.0f} s CPU)")
    # The block-by-block probe prefills as no scheduler does: differing from it is a
    # measurement, not a failure (prefix_probe checks kvplan's rule for it). Known
    # open classes are reported, not failed on; vLLM's own failures neither.
    unexpected = unexpected_disagreements(result)
    if unexpected:
        print(
            f"{unexpected} disagreements outside the known open classes "
            f"({', '.join(k.name for k in KNOWN_OPEN) or 'none'}: conformance/scheduler_known.py)"
        )
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
