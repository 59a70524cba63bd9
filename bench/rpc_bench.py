"""The headline: an uncached PlanKVCache (a new engine with new content each call) against
Echo.

    python -m bench.rpc_bench            # or: make bench-rpc
    python -m bench.rpc_bench --quick    # smoke-test scale
    python -m bench.rpc_bench --store memory   # another store, for comparison
    RPC_BENCH_PROFILE=/tmp/prof python -m bench.rpc_bench   # the server under cProfile

Against one `kvplan serve` on its default store (SQLite), in its own process:

- For each engine (the 8-worker Qwen3-Next-like engine and a 64-layer single-worker
  engine) and concurrency (1 and 16), in alternating slices of one run: Echo of the
  same payload; an uncached plan, the headline and what the targets are judged on:
  a new engine id AND new content each call (every worker reports another non-torch
  memory figure, as real GPUs differ by MiBs of CUDA context and NCCL memory;
  bench.common.FreshContent), so the server has to plan; a known-content plan, a new
  engine id with content the server has seen (a fleet's new replica of a known
  model: the server may answer it from memory), informational only; and a cached
  plan (the same request again). Per repeat: plan/echo throughput and p99, server
  CPU per call from /proc; the figures are the median and range over the repeats.
- Sporadic arrivals: server CPU per uncached plan (fresh content) with 20 ms between
  calls against back to back (both engines, concurrency 1).
- Rank-mode rendezvous: 256 engines x 8 ranks arriving concurrently in random order,
  each engine's ranks carrying that engine's own non-torch figure (fresh content).
- Cold start (spawn to health SERVING) and the server's RSS.

The load generator sends pre-serialized bytes on raw grpc.aio multicallables and keeps
the replies as bytes, one channel (one HTTP/2 connection) per concurrent caller, as
each engine worker is its own process: the figures are the server's.
Results: bench/results/rpc.json and rpc.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc.aio

from bench.common import (
    CALL_TIMEOUT_S,
    ECHO_METHOD,
    PLAN_METHOD,
    FreshContent,
    ServerProcess,
    Spread,
    Target,
    Variant,
    bench_channel,
    bench_parser,
    exit_code,
    new_report,
    next_fresh_serial,
    non_torch_bytes_of,
    print_targets,
    reference_parse_us,
    repeats_of,
    run_interleaved,
    scrape,
    spawn_server,
    steal_seconds,
    with_engine_id,
    write_results,
)
from bench.engines import gemma_style, qwen3_next_tp8
from bench.options import parse_arguments
from kvplan.client import AsyncPlannerClient, PlannerError
from kvplan.server.heap import QuietTrim
from kvplan.server.main import HEAP_TRIM_INTERVAL_S
from kvplan.v1 import plan_pb2

PROFILE_ENV = "RPC_BENCH_PROFILE"  # a folder: run the main server under cProfile

ENGINES: dict[str, tuple[str, Callable[[], plan_pb2.PlanRequest]]] = {
    "qwen3-next-tp8": (
        "Qwen3-Next-like hybrid, 64 layers (3 Gated DeltaNet : 1 full attention) + MTP, "
        "8 TP workers (from examples/qwen3-next-80b-a3b-mtp.yaml)",
        qwen3_next_tp8,
    ),
    "gemma-64l-tp1": (
        "Gemma-3-style hybrid, 64 layers (5 sliding-window : 1 full attention), 1 worker",
        lambda: gemma_style(64),
    ),
}

VARIANTS = ("echo", "plan uncached", "plan new model", "plan known content", "plan cached")
TARGET_UNCACHED_OVER_ECHO = 0.5  # throughput, at every concurrency, for both engines
TARGET_P99_OVER_ECHO = 3.0
TARGET_RENDEZVOUS_S = 2.0
TARGET_COLD_START_S = 1.5
TARGET_IDLE_RSS_MB = 120.0
SPORADIC_GAP_S = 0.02  # an engine starting now and then, not back to back


@dataclass(frozen=True)
class Scale:
    concurrency: tuple[int, ...]
    rounds: int  # alternations of the variants per repeat
    slice_s: float
    settle_s: float
    rendezvous_engines: int
    cold_starts: int
    sporadic_plans: int  # per engine and repeat, with SPORADIC_GAP_S between calls

    @classmethod
    def of(cls, args: argparse.Namespace) -> Scale:
        if args.quick:
            # 24 sporadic plans: several of /proc's 10 ms CPU ticks (8 could read 0).
            return cls((1, 16), 1, 0.2, 0.05, 16, 1, 24)
        return cls(tuple(args.concurrency), args.rounds, args.slice, 0.3, args.engines, 5, 300)


# --- plan vs echo -----------------------------------------------------------------------


async def check_replies(server: ServerProcess, fresh: FreshContent) -> int:
    """A plan, a plan of fresh content, a plan of the same content renamed (a known
    model) and an echo, parsed: the load is of calls that do what they say. Returns the
    plan's size."""
    serial = next_fresh_serial()
    fresh_id, known_id = f"check-fresh-{serial}", f"check-known-content-{serial}"
    async with grpc.aio.insecure_channel(server.target) as channel:
        plan_call = channel.unary_unary(PLAN_METHOD)
        plan_bytes = await plan_call(fresh.template, timeout=CALL_TIMEOUT_S)
        fresh_bytes = await plan_call(fresh.payload(serial, fresh_id), timeout=CALL_TIMEOUT_S)
        known_payload = with_engine_id(fresh.template, known_id)
        known_bytes = await plan_call(known_payload, timeout=CALL_TIMEOUT_S)
        echo_bytes = await channel.unary_unary(ECHO_METHOD)(fresh.template, timeout=CALL_TIMEOUT_S)
    plan, fresh_plan, known = (
        plan_pb2.PlanResponse.FromString(reply) for reply in (plan_bytes, fresh_bytes, known_bytes)
    )
    workers = len(fresh.request.workers)
    if plan.num_blocks <= 0 or len(plan.workers) != workers:
        raise RuntimeError(f"unexpected plan: {plan.num_blocks} blocks, {len(plan.workers)}")
    for reply, engine_id in ((fresh_plan, fresh_id), (known, known_id)):
        if reply.engine_id != engine_id or reply.plan_id == plan.plan_id:
            raise RuntimeError(f"{engine_id} was not planned as a new engine: {reply.engine_id}")
    # Fresh content reached the plan: every worker's non-KV bytes moved by the step.
    added = non_torch_bytes_of(serial) - non_torch_bytes_of(0)
    moved = [
        fresh_worker.budget.non_kv_bytes - worker.budget.non_kv_bytes
        for fresh_worker, worker in zip(fresh_plan.workers, plan.workers, strict=True)
    ]
    if moved != [added] * workers:
        raise RuntimeError(f"fresh content was not planned: non-KV bytes moved by {moved}")
    if known.num_blocks != plan.num_blocks or known.workers != plan.workers:
        raise RuntimeError("known content under a new engine id got another plan")
    async with grpc.aio.insecure_channel(server.target) as channel:
        new_model = plan_pb2.PlanResponse.FromString(
            await channel.unary_unary(PLAN_METHOD)(fresh.new_model(), timeout=CALL_TIMEOUT_S)
        )
    if new_model.num_blocks <= 0 or len(new_model.workers) != workers:
        raise RuntimeError(f"a new model was not planned: {new_model.num_blocks} blocks")
    if plan_pb2.PlanRequest.FromString(echo_bytes) != fresh.request:
        raise RuntimeError("Echo did not return its payload")
    return len(plan_bytes)


async def plan_vs_echo(
    server: ServerProcess, engine: str, base: plan_pb2.PlanRequest, concurrency: int, scale: Scale
) -> dict[str, Any]:
    """One repeat for one engine and concurrency: echo, uncached (fresh content),
    known-content and cached plans interleaved."""
    fresh = FreshContent(base, f"{engine}-c{concurrency}")
    variants = [
        Variant("echo", ECHO_METHOD, lambda: fresh.template),
        Variant("plan uncached", PLAN_METHOD, fresh.next),
        Variant("plan new model", PLAN_METHOD, fresh.new_model),
        Variant("plan known content", PLAN_METHOD, fresh.known_content),
        Variant("plan cached", PLAN_METHOD, lambda: fresh.template),
    ]
    tallies = await run_interleaved(
        server, variants, concurrency, scale.rounds, scale.slice_s, scale.settle_s
    )
    figures = {name: tally.summary() for name, tally in tallies.items()}
    echo = figures["echo"]
    for name in VARIANTS[1:]:
        plan = figures[name]
        plan["throughput_over_echo"] = plan["throughput_rps"] / echo["throughput_rps"]
        plan["p50_over_echo"] = plan["p50_ms"] / echo["p50_ms"]
        plan["p99_over_echo"] = plan["p99_ms"] / echo["p99_ms"]
        plan["cpu_over_echo"] = plan["server_cpu_us_per_call"] / echo["server_cpu_us_per_call"]
    return figures


def summarize_load(repeats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine, concurrency and variant: every figure as a Spread over the repeats."""
    keys = sorted({(row["engine"], row["concurrency"]) for row in repeats})
    rows: list[dict[str, Any]] = []
    for engine, concurrency in keys:
        runs = [r for r in repeats if (r["engine"], r["concurrency"]) == (engine, concurrency)]
        for variant in VARIANTS:
            per_repeat = [run["figures"][variant] for run in runs]
            figures = {
                name: Spread.of([figure[name] for figure in per_repeat]).as_dict()
                for name in per_repeat[0]
                if isinstance(per_repeat[0][name], float | int)
            }
            seen = sorted({error for figure in per_repeat for error in figure["errors_seen"]})
            rows.append(
                {
                    "engine": engine,
                    "concurrency": concurrency,
                    "variant": variant,
                    **figures,
                    "errors_seen": seen[:5],
                }
            )
    return rows


async def sporadic_vs_back_to_back(
    server: ServerProcess, engine: str, base: plan_pb2.PlanRequest, count: int
) -> dict[str, float]:
    """Server CPU per uncached plan (fresh content) arriving every SPORADIC_GAP_S against
    back to back (both at concurrency 1, one after the other). The server's CPU between
    sporadic calls is charged to them: a server that works while idle costs that per plan."""
    fresh = FreshContent(base, f"{engine}-sporadic")
    figures: dict[str, float] = {}
    async with bench_channel(server.target) as channel:
        await channel.channel_ready()
        call = channel.unary_unary(PLAN_METHOD)
        for name, gap_s in (("back_to_back", 0.0), ("sporadic", SPORADIC_GAP_S)):
            cpu = server.cpu_s()
            for _ in range(count):
                await call(fresh.next(), timeout=CALL_TIMEOUT_S)
                if gap_s:
                    await asyncio.sleep(gap_s)
            figures[f"{name}_cpu_us"] = (server.cpu_s() - cpu) / count * 1e6
    back_to_back = figures["back_to_back_cpu_us"]  # 0: less than one CPU tick to read
    figures["sporadic_over_back_to_back"] = (
        figures["sporadic_cpu_us"] / back_to_back if back_to_back else math.nan
    )
    return figures


# --- rendezvous -------------------------------------------------------------------------


def rank_request(
    base: plan_pb2.PlanRequest, engine_id: str, rank: int, non_torch_bytes: int
) -> plan_pb2.PlanRequest:
    """Rank mode: one worker of `base`, world_size = the engine's worker count. The
    worker reports `non_torch_bytes`: the engine's own figure, the same on its ranks."""
    request = plan_pb2.PlanRequest()
    request.CopyFrom(base)
    request.engine_id = engine_id
    request.world_size = len(base.workers)
    del request.workers[:]
    worker = request.workers.add()
    worker.CopyFrom(base.workers[rank])
    worker.memory.non_kv.non_torch_bytes = non_torch_bytes
    return request


@dataclass
class RendezvousResult:
    engines: int
    ranks_per_engine: int
    calls: int
    wall_s: float
    errors: int
    consistent: bool  # every rank of an engine: one plan id, one num_blocks
    distinct_plan_ids: int
    server_cpu_s: float
    steal_cores: float
    clients: int
    errors_seen: list[str] = field(default_factory=list)


async def measure_rendezvous(
    server: ServerProcess,
    base: plan_pb2.PlanRequest,
    engines: int,
    clients: int,
    engine_prefix: str,
) -> RendezvousResult:
    """`engines` x world_size rank-mode calls at once, in random arrival order; each
    engine is a new one with new content (its own non-torch figure on all its ranks),
    named `engine_prefix`-N. Each call needs a prefix of its own: an engine planned
    once refuses other content."""
    ranks = len(base.workers)
    arrivals = [(engine, rank) for engine in range(engines) for rank in range(ranks)]
    random.Random(0).shuffle(arrivals)
    non_torch = [non_torch_bytes_of(next_fresh_serial()) for _ in range(engines)]
    requests = [
        (engine, rank_request(base, f"{engine_prefix}-{engine}", rank, non_torch[engine]))
        for engine, rank in arrivals
    ]
    planners = [AsyncPlannerClient(server.target, timeout_s=60) for _ in range(clients)]
    errors: list[str] = []

    async def join(
        index: int, request: plan_pb2.PlanRequest
    ) -> tuple[str, int, frozenset[int]] | None:
        try:
            result = await planners[index % clients].plan(request)
        except PlannerError as error:
            errors.append(str(error))
            return None
        worker_blocks = frozenset(worker.num_blocks for worker in result.response.workers)
        return result.plan_id, result.num_blocks, worker_blocks

    try:
        await asyncio.gather(*(planner._channel.channel_ready() for planner in planners))
        cpu_start, steal_start = server.cpu_s(), steal_seconds()
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(join(index, request) for index, (_, request) in enumerate(requests))
        )
        wall_s = time.perf_counter() - start
        server_cpu_s = server.cpu_s() - cpu_start
        steal_cores = (steal_seconds() - steal_start) / wall_s
    finally:
        for planner in planners:
            await planner.close()
    by_engine: dict[int, set[tuple[str, int, frozenset[int]]]] = {}
    for (engine, _), reply in zip(requests, replies, strict=True):
        if reply is not None:
            by_engine.setdefault(engine, set()).add(reply)
    consistent = len(by_engine) == engines and all(
        len(seen) == 1 and len(next(iter(seen))[2]) == 1 and next(iter(seen))[1] > 0
        for seen in by_engine.values()
    )
    plan_ids = {plan_id for seen in by_engine.values() for plan_id, _, _ in seen}
    return RendezvousResult(
        engines=engines,
        ranks_per_engine=ranks,
        calls=len(requests),
        wall_s=wall_s,
        errors=len(errors),
        consistent=consistent,
        distinct_plan_ids=len(plan_ids),
        server_cpu_s=server_cpu_s,
        steal_cores=steal_cores,
        clients=clients,
        errors_seen=sorted(set(errors))[:5],
    )


# --- cold start -------------------------------------------------------------------------


def measure_cold_start(log_dir: Path, runs: int) -> dict[str, Any]:
    spawn_to_serving: list[float] = []
    ready_in: list[float] = []
    for run in range(runs):
        server = spawn_server(log_dir, f"cold-{run}")
        server.stop()
        spawn_to_serving.append(server.spawn_to_serving_s)
        own = server.ready_in_s()
        if own is not None:
            ready_in.append(own)
        print(f"  start {run + 1}: {server.spawn_to_serving_s:.3f} s to SERVING", flush=True)
    return {
        "runs_s": spawn_to_serving,
        "median_s": statistics.median(spawn_to_serving),
        "ready_in_s": ready_in,  # the server's own start_server time, imports excluded
    }


# --- report -----------------------------------------------------------------------------


def _row(rows: list[dict[str, Any]], engine: str, concurrency: int, variant: str) -> dict[str, Any]:
    return next(
        row
        for row in rows
        if (row["engine"], row["concurrency"], row["variant"]) == (engine, concurrency, variant)
    )


def evaluate_targets(report: dict[str, Any]) -> list[Target]:
    rows = report["load"]
    pairs = sorted({(row["engine"], row["concurrency"]) for row in rows})
    throughput = {
        pair: Spread.from_dict(_row(rows, *pair, "plan uncached")["throughput_over_echo"])
        for pair in pairs
    }
    p99 = {
        pair: Spread.from_dict(_row(rows, *pair, "plan uncached")["p99_over_echo"])
        for pair in pairs
    }
    # Figures of calls that failed would be no figures: any error fails both targets.
    errors = sum(row["errors"]["high"] for row in rows)
    rendezvous = report["rendezvous"]
    rendezvous_wall = Spread.from_dict(rendezvous["wall_s"])
    cold = report["cold_start"]
    rss = report["rss_mb"]

    def listing(spreads: dict[tuple[str, int], Spread]) -> str:
        text = "; ".join(f"{e} c={c}: {s.text(unit='x')}" for (e, c), s in spreads.items())
        return text + (f"; {errors:.0f} FAILED CALLS (see rpc.json)" if errors else "")

    return [
        Target(
            f"uncached plan (new engine, new content) throughput ≥ {TARGET_UNCACHED_OVER_ECHO}x "
            "Echo of the same "
            f"payload (each engine, each concurrency; {report['store']} store)",
            listing(throughput),
            not errors and all(s.median >= TARGET_UNCACHED_OVER_ECHO for s in throughput.values()),
            {f"{e} c={c}": s.as_dict() for (e, c), s in throughput.items()},
        ),
        Target(
            f"uncached plan (new engine, new content) p99 ≤ {TARGET_P99_OVER_ECHO:.0f}x Echo p99",
            listing(p99),
            not errors and all(s.median <= TARGET_P99_OVER_ECHO for s in p99.values()),
            {f"{e} c={c}": s.as_dict() for (e, c), s in p99.items()},
        ),
        Target(
            f"rendezvous of {rendezvous['engines']} engines x {rendezvous['ranks_per_engine']} "
            f"ranks < {TARGET_RENDEZVOUS_S:.0f} s, 0 errors, one plan per engine "
            f"(median of {len(rendezvous['runs'])})",
            f"{rendezvous_wall.text(unit=' s')}, {rendezvous['errors']} errors, "
            f"{'consistent' if rendezvous['consistent'] else 'INCONSISTENT'}",
            rendezvous_wall.median < TARGET_RENDEZVOUS_S
            and rendezvous["errors"] == 0
            and rendezvous["consistent"],
            {"wall_s": rendezvous["wall_s"], "errors": rendezvous["errors"]},
        ),
        Target(
            f"cold start to SERVING < {TARGET_COLD_START_S} s (median of {len(cold['runs_s'])})",
            Spread.of(cold["runs_s"]).text(".3f", " s"),
            cold["median_s"] < TARGET_COLD_START_S,
            {"median_s": cold["median_s"]},
        ),
        Target(
            f"idle RSS < {TARGET_IDLE_RSS_MB:.0f} MB besides the plan cache's plans (after "
            "start / after the load, less kvplan_plan_cache_bytes: bounded by "
            "--plan-cache-bytes, 32 MiB, which distinct plans fill)",
            f"{rss['after_start']:.1f} MB / {rss['after_load']:.1f} MB - "
            f"{rss['plan_cache']:.1f} MB = {rss['after_load'] - rss['plan_cache']:.1f} MB",
            max(rss["after_start"], rss["after_load"] - rss["plan_cache"]) < TARGET_IDLE_RSS_MB,
            dict(rss),
        ),
    ]


def informational_lines(report: dict[str, Any]) -> list[str]:
    """The ratios of the informational variants, said apart from the targets: a new
    model (no kept grouping: the first engine of a model, the worst case) and known
    content (a server that remembers a plan answers it without planning)."""
    lines = []
    for variant, what in (
        ("plan new model", "a new engine, new content and a model never seen"),
        ("plan known content", "a new engine id, content seen before"),
    ):
        rows = [row for row in report["load"] if row["variant"] == variant]
        ratios = "; ".join(
            f"{row['engine']} c={row['concurrency']}: "
            f"{Spread.from_dict(row['throughput_over_echo']).text(unit='x')} req/s, "
            f"p99 {Spread.from_dict(row['p99_over_echo']).text(unit='x')}"
            for row in rows
        )
        lines.append(f"Informational, not a target: {variant} ({what}) against Echo: {ratios}.")
    return lines


def render_markdown(report: dict[str, Any]) -> list[str]:
    settings = report["settings"]
    lines = [
        f"One `kvplan serve` on the {report['store']} store; the load generator in another "
        "process, raw grpc.aio calls (bytes in, bytes out), one channel per concurrent "
        "caller. Five kinds of call alternate: Echo of the same payload; **plan uncached**, "
        "a new engine id and new content each call (every worker reports another non-torch "
        "memory figure, 1 GiB + 4 KiB x serial), so the server has to plan it: it budgets "
        "the model's grouping, which it keeps (what a fleet's engines of one model cost); "
        "the targets are judged on it; **plan new model**, the same and a model the server "
        "has never seen (a serial in an options field no release defines), planned from "
        "scratch: informational; **plan known content**, a new engine id with content the "
        "server has seen (a new replica on GPUs reporting the same memory, which it may "
        "answer from memory): informational; **plan cached**, the same request again. They "
        f"alternate in {settings['rounds']} round(s) of {settings['slice_s']:.2f} s slices "
        f"({settings['settle_s']:.2f} s settle after each switch), repeated "
        f"{settings['repeats']} times; each cell is the median over the repeats "
        "(min-max). Server CPU per call from /proc (all threads). Machine speed: parsing "
        f"the Qwen3-Next request took {report['machine']['reference_parse_us_start']:.0f} µs "
        f"at the start, {report['machine']['reference_parse_us_end']:.0f} µs at the end.",
        "",
    ]
    for key, engine in report["engines"].items():
        lines += [
            f"**{key}**: {engine['description']}; request {engine['request_bytes']:,} B, "
            f"plan {engine['response_bytes']:,} B.",
            "",
        ]
    lines += [
        "### Plans vs Echo: uncached (new engine, new content: the headline and the targets), "
        "new model and known content (informational), cached",
        "",
        "| engine | c | RPC | req/s | p50 ms | p99 ms | vs echo req/s | vs echo p99 "
        "| server CPU µs/call | vs echo CPU | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["load"]:
        versus = ("- | -", "-")
        if row["variant"] != "echo":
            versus = (
                f"{Spread.from_dict(row['throughput_over_echo']).text(unit='x')} | "
                f"{Spread.from_dict(row['p99_over_echo']).text(unit='x')}",
                Spread.from_dict(row["cpu_over_echo"]).text(unit="x"),
            )
        lines.append(
            f"| {row['engine']} | {row['concurrency']} | {row['variant']} | "
            f"{Spread.from_dict(row['throughput_rps']).text(',.0f')} | "
            f"{Spread.from_dict(row['p50_ms']).text()} | "
            f"{Spread.from_dict(row['p99_ms']).text()} | "
            f"{versus[0]} | {Spread.from_dict(row['server_cpu_us_per_call']).text(',.0f')} | "
            f"{versus[1]} | {row['errors']['high']:.0f} |"
        )
    lines += [
        "",
        *informational_lines(report),
        "",
        f"### Sporadic arrivals: uncached plans (new content) {SPORADIC_GAP_S * 1e3:.0f} ms "
        "apart vs back to back (concurrency 1; server CPU per plan, the idle time between "
        "calls included)",
        "",
        "| engine | back to back µs/plan | sporadic µs/plan | sporadic / back to back |",
        "|---|---:|---:|---:|",
    ]
    for key, figures in report["sporadic"].items():
        lines.append(
            f"| {key} | {Spread.from_dict(figures['back_to_back_cpu_us']).text(',.0f')} | "
            f"{Spread.from_dict(figures['sporadic_cpu_us']).text(',.0f')} | "
            f"{Spread.from_dict(figures['sporadic_over_back_to_back']).text(unit='x')} |"
        )
    rendezvous = report["rendezvous"]
    cold = report["cold_start"]
    lines += [
        "",
        "### Rendezvous, cold start, memory",
        "",
        "| measure | figure |",
        "|---|---|",
        f"| rendezvous: {rendezvous['engines']} engines x {rendezvous['ranks_per_engine']} "
        f"ranks ({rendezvous['calls']} calls at once, random order, {rendezvous['clients']} "
        "AsyncPlannerClients; each engine new, its ranks with its own non-torch figure; "
        f"{len(rendezvous['runs'])} repeats, each with engines of its own) "
        f"| {Spread.from_dict(rendezvous['wall_s']).text(unit=' s')} wall, "
        f"{rendezvous['errors']} errors, plan ids "
        + ", ".join(str(run["distinct_plan_ids"]) for run in rendezvous["runs"])
        + f", server CPU {Spread.from_dict(rendezvous['server_cpu_s']).text(unit=' s')} |",
        f"| cold start, spawn to health SERVING | median {cold['median_s']:.3f} s of "
        + ", ".join(f"{seconds:.3f}" for seconds in cold["runs_s"])
        + " |",
        f"| server RSS after start (idle) | {report['rss_mb']['after_start']:.1f} MB |",
        f"| server RSS after the load (idle) | {report['rss_mb']['after_load']:.1f} MB, of "
        f"which the plan cache's plans {report['rss_mb']['plan_cache']:.1f} MB |",
        f"| /metrics after the load | {report['metrics_after_load']['bytes']:,} B, "
        f"{report['metrics_after_load']['series']:,} samples, scraped in "
        f"{report['metrics_after_load']['seconds'] * 1e3:.1f} ms |",
    ]
    return lines


async def run_server_benchmarks(
    server: ServerProcess, scale: Scale, repeats: int, report: dict[str, Any]
) -> None:
    bases = {key: build() for key, (_, build) in ENGINES.items()}
    for key, base in bases.items():
        fresh = FreshContent(base, f"{key}-check")
        report["engines"][key] = {
            "description": ENGINES[key][0],
            "request_bytes": len(fresh.template),
            "response_bytes": await check_replies(server, fresh),
        }
    print("uncached plan (new engine, new content) vs echo:", flush=True)
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for key, base in bases.items():
            for concurrency in scale.concurrency:
                figures = await plan_vs_echo(server, key, base, concurrency, scale)
                uncached = figures["plan uncached"]
                new_model = figures["plan new model"]
                print(
                    f"  repeat {repeat + 1} {key:<15} c={concurrency:<3} uncached "
                    f"{uncached['throughput_rps']:7.0f} req/s = "
                    f"{uncached['throughput_over_echo']:.2f}x echo, p99 "
                    f"{uncached['p99_over_echo']:.2f}x, server "
                    f"{uncached['server_cpu_us_per_call']:6.0f} µs CPU/plan "
                    f"({uncached['cpu_over_echo']:.1f}x echo); new model "
                    f"{new_model['throughput_over_echo']:.2f}x echo (informational)",
                    flush=True,
                )
                runs.append({"engine": key, "concurrency": concurrency, "figures": figures})
    report["load"] = summarize_load(runs)
    print(f"sporadic arrivals ({SPORADIC_GAP_S * 1e3:.0f} ms apart) vs back to back:", flush=True)
    sporadic: dict[str, list[dict[str, float]]] = {key: [] for key in bases}
    for _ in range(repeats):
        for key, base in bases.items():
            figures = await sporadic_vs_back_to_back(server, key, base, scale.sporadic_plans)
            print(
                f"  {key:<15} {figures['back_to_back_cpu_us']:6.0f} -> "
                f"{figures['sporadic_cpu_us']:6.0f} µs CPU/plan "
                f"({figures['sporadic_over_back_to_back']:.2f}x)",
                flush=True,
            )
            sporadic[key].append(figures)
    report["sporadic"] = {
        key: {name: Spread.of([one[name] for one in of_engine]).as_dict() for name in of_engine[0]}
        for key, of_engine in sporadic.items()
    }
    rendezvous_base = bases["qwen3-next-tp8"]
    print(f"rendezvous: {scale.rendezvous_engines} engines x 8 ranks ...", flush=True)
    runs = []
    for repeat in range(repeats):
        run = await measure_rendezvous(
            server, rendezvous_base, scale.rendezvous_engines, 16, f"rendezvous-{repeat}"
        )
        print(f"  {run.wall_s:.2f} s, {run.errors} errors", flush=True)
        runs.append(asdict(run))
    report["rendezvous"] = summarize_rendezvous(runs)


def summarize_rendezvous(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeats of the rendezvous (each its own engines): wall and server CPU as
    spreads, errors added up; consistent only if every repeat was, one plan per engine."""
    first = runs[0]
    return {
        "engines": first["engines"],
        "ranks_per_engine": first["ranks_per_engine"],
        "calls": first["calls"],
        "clients": first["clients"],
        "wall_s": Spread.of([run["wall_s"] for run in runs]).as_dict(),
        "server_cpu_s": Spread.of([run["server_cpu_s"] for run in runs]).as_dict(),
        "errors": sum(run["errors"] for run in runs),
        "consistent": all(
            run["consistent"] and run["distinct_plan_ids"] == run["engines"] for run in runs
        ),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=4, help="alternations per repeat")
    parser.add_argument("--slice", type=float, default=0.5, help="measured seconds per slice")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--engines", type=int, default=256, help="rendezvous engines")
    parser.add_argument(
        "--store", default="", help="the server's --store (default: the embedded SQLite store)"
    )
    args = parse_arguments(parser, argv)
    scale = Scale.of(args)
    repeats = repeats_of(args)
    profile_dir = os.environ.get(PROFILE_ENV)
    profile_path = Path(profile_dir) / "server.prof" if profile_dir else None
    reference = qwen3_next_tp8().SerializeToString()
    report = new_report("rpc", args, asdict(scale))
    report["title"] = (
        "kvplan over gRPC: uncached plans (new engine, new content) vs Echo, rendezvous, cold start"
    )
    report["machine"]["reference_parse_us_start"] = reference_parse_us(reference)
    report["engines"] = {}
    report["store"] = args.store or "default (SQLite)"
    with tempfile.TemporaryDirectory(prefix="kvplan-bench-rpc-") as folder:
        log_dir = Path(folder)
        print(f"cold start ({scale.cold_starts} fresh processes):", flush=True)
        report["cold_start"] = measure_cold_start(log_dir, scale.cold_starts)
        if profile_path is not None:
            profile_path.parent.mkdir(parents=True, exist_ok=True)
        store_flags = ["--store", args.store] if args.store else []
        server = spawn_server(log_dir, "main", store_flags, profile_to=profile_path)
        try:
            time.sleep(0.5)
            rss_start = server.rss_mb()
            asyncio.run(run_server_benchmarks(server, scale, repeats, report))
            # Idle: the server hands freed heap back once a trim tick finds it quiet
            # after a tick that saw calls, and again RETRIM_TICK ticks later.
            time.sleep((QuietTrim.RETRIM_TICK + 1) * HEAP_TRIM_INTERVAL_S + 1.0)
            rss_after_load = server.rss_mb()
            metrics = scrape(server)
            report["rss_mb"] = {
                "after_start": rss_start,
                "after_load": rss_after_load,
                "plan_cache": metrics.value("kvplan_plan_cache_bytes") / (1 << 20),  # as rss_mb
            }
            report["metrics_after_load"] = {
                "bytes": metrics.size_bytes,
                "series": metrics.series(),
                "seconds": metrics.seconds,
            }
        finally:
            server.stop()
    report["machine"]["reference_parse_us_end"] = reference_parse_us(reference)
    targets = evaluate_targets(report)
    report["targets"] = [target.as_dict() for target in targets]
    print_targets(targets)
    for line in informational_lines(report):
        print(line, flush=True)
    if profile_path is None:
        write_results(args.results, "rpc", report, render_markdown(report))
    else:
        print(f"\nserver profile ({profile_path}), top 30 by own time:")
        pstats.Stats(str(profile_path)).sort_stats("tottime").print_stats(30)
    return exit_code(targets, args.strict)


if __name__ == "__main__":
    sys.exit(main())
