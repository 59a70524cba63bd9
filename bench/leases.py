"""Lease scaling (10 → 10,000 live leases) and the event-loop check (a stalled store).

    python -m bench.leases               # or: make bench-leases
    python -m bench.leases --quick       # smoke-test scale

Two `kvplan serve` processes on the default store (SQLite), each with a static
inventory of one H200 (`--devices 1xH200-141GB`) and leases that outlive the run:

- the *baseline* server holds 10 live leases throughout;
- the *scaled* server is filled to 10, 100, 1,000 and 10,000 live leases (a grant is a
  PlanKVCache of a new one-layer engine whose worker names the device: a 4 MiB lease).
  Grants are new engine ids of one content (a known model): a lease reserves the
  worker's non-KV memory too, so fresh non-torch figures (1 GiB and up) would not let
  10,000 leases fit one device; the ledger's cost, not planning, is what this measures.

At each level, batches of samples on the two servers alternate (3 repeats): a sample is
one grant (timed), its ReleasePlan (not timed, so the level holds) and one ListDevices
(timed). Per repeat, the scaled server's p50 over the baseline's p50 of the same moment;
the figure is the median and range of those ratios.

The event-loop check: another SQLite connection takes the baseline server's store
(BEGIN IMMEDIATE) for 1 s while grants and uncached plans (new engines with new
content, bench.common.FreshContent) wait on it; meanwhile Echo
calls run back to back, as they did for 1 s just before (the control). Added latency =
the worst Echo during the stall minus the worst of the control. The grants must have
waited (else the stall did not reach the store).
Results: bench/results/leases.json and leases.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc.aio

from bench.common import (
    CALL_TIMEOUT_S,
    ECHO_METHOD,
    LIST_DEVICES_METHOD,
    PLAN_METHOD,
    RELEASE_METHOD,
    EngineIds,
    FreshContent,
    ServerProcess,
    Spread,
    Target,
    bench_channel,
    bench_parser,
    exit_code,
    new_report,
    percentile,
    print_targets,
    repeats_of,
    spawn_server,
    timed_calls,
    with_engine_id,
    write_results,
)
from bench.engines import gemma_style, leased_engine
from bench.options import parse_arguments
from kvplan.v1 import plan_pb2, service_pb2

# One identity (the bench, unauthenticated) holds every lease: lift the per-identity
# bound (4,096 by default) above the largest level.
SERVER_FLAGS = (
    "--devices",
    "1xH200-141GB",
    "--lease-ttl-s",
    "86400",
    "--max-leases-per-identity",
    "20000",
)
BASELINE_LEASES = 10
TARGET_RATIO = 2.0  # grant and ListDevices p50 at the top level over the baseline's
TARGET_STALL_ADDED_MS = 50.0
FILL_CONCURRENCY = 16


@dataclass(frozen=True)
class Scale:
    levels: tuple[int, ...]
    samples: int  # per batch: grants and ListDevices calls
    stall_s: float
    stalled_calls: int  # grants and uncached plans waiting on the stalled store

    @classmethod
    def of(cls, args: argparse.Namespace) -> Scale:
        if args.quick:
            return cls((10, 50, 200), 6, 0.3, 4)
        return cls(tuple(args.levels), args.samples, 1.0, 8)


class LeaseServer:
    """A server and what this benchmark does to it, on one channel."""

    def __init__(self, server: ServerProcess, channel: grpc.aio.Channel, label: str) -> None:
        self.server = server
        self.channel = channel
        self.ids = EngineIds(f"lease-{label}")
        self.payload = b""
        self.plan = channel.unary_unary(PLAN_METHOD)
        self.release = channel.unary_unary(RELEASE_METHOD)
        self.list_devices = channel.unary_unary(LIST_DEVICES_METHOD)
        self.leases = 0  # granted by fill_to (the samples release theirs)

    async def start(self) -> None:
        await self.channel.channel_ready()
        reply = service_pb2.ListDevicesResponse.FromString(
            await self.list_devices(b"", timeout=CALL_TIMEOUT_S)
        )
        self.payload = leased_engine(reply.devices[0].uuid).SerializeToString()

    async def grant(self) -> str:
        engine_id = self.ids.next()
        reply = plan_pb2.PlanResponse.FromString(
            await self.plan(with_engine_id(self.payload, engine_id), timeout=CALL_TIMEOUT_S)
        )
        if len(reply.leases) != 1:
            raise RuntimeError(f"a grant without its lease: {reply.leases}")
        return engine_id

    async def fill_to(self, level: int) -> None:
        async def granter() -> None:
            while self.leases < level:
                self.leases += 1
                await self.grant()

        await asyncio.gather(*(granter() for _ in range(FILL_CONCURRENCY)))

    async def live_leases(self) -> int:
        reply = service_pb2.ListDevicesResponse.FromString(
            await self.list_devices(b"", timeout=CALL_TIMEOUT_S)
        )
        return sum(device.live_leases for device in reply.devices)

    async def sample(self, count: int) -> dict[str, float]:
        """`count` x (grant timed, its release untimed, ListDevices timed): p50s in ms."""
        grants: list[float] = []
        listings: list[float] = []
        for _ in range(count):
            start = time.perf_counter()
            engine_id = await self.grant()
            grants.append(time.perf_counter() - start)
            release = service_pb2.ReleasePlanRequest(engine_id=engine_id)
            await self.release(release.SerializeToString(), timeout=CALL_TIMEOUT_S)
            start = time.perf_counter()
            await self.list_devices(b"", timeout=CALL_TIMEOUT_S)
            listings.append(time.perf_counter() - start)
        return {
            "grant_p50_ms": percentile(grants, 0.5) * 1e3,
            "list_devices_p50_ms": percentile(listings, 0.5) * 1e3,
        }


async def lease_scaling(
    baseline: LeaseServer, scaled: LeaseServer, scale: Scale, repeats: int
) -> list[dict[str, Any]]:
    await baseline.fill_to(BASELINE_LEASES)
    levels: list[dict[str, Any]] = []
    for level in scale.levels:
        fill_start = time.perf_counter()
        await scaled.fill_to(level)
        fill_s = time.perf_counter() - fill_start
        live = await scaled.live_leases()
        if live != level:
            raise RuntimeError(f"{live} live leases on the scaled server, expected {level}")
        runs: list[dict[str, dict[str, float]]] = []
        sides = {"baseline": baseline, "scaled": scaled}
        for repeat in range(repeats):
            order = ["baseline", "scaled"] if repeat % 2 == 0 else ["scaled", "baseline"]
            runs.append({name: await sides[name].sample(scale.samples) for name in order})
        row: dict[str, Any] = {"live_leases": level, "fill_s": fill_s}
        for key in ("grant_p50_ms", "list_devices_p50_ms"):
            row[key] = Spread.of([run["scaled"][key] for run in runs]).as_dict()
            row[f"baseline_{key}"] = Spread.of([run["baseline"][key] for run in runs]).as_dict()
            row[f"{key}_over_baseline"] = Spread.of(
                [run["scaled"][key] / run["baseline"][key] for run in runs]
            ).as_dict()
        print(
            f"  {level:>6,} leases: grant p50 {row['grant_p50_ms']['median']:.2f} ms "
            f"({row['grant_p50_ms_over_baseline']['median']:.2f}x with {BASELINE_LEASES}), "
            f"ListDevices p50 {row['list_devices_p50_ms']['median']:.2f} ms "
            f"({row['list_devices_p50_ms_over_baseline']['median']:.2f}x); filled in "
            f"{fill_s:.1f} s",
            flush=True,
        )
        levels.append(row)
    return levels


async def stalled_store(target: LeaseServer, scale: Scale) -> dict[str, Any]:
    """One stall of the store (see the module's doc). Echo runs back to back for the same
    time just before it (the control) and during it: the stall's delay is the worst Echo
    during it minus the worst of the control, so a hiccup of a busy host, which the
    control sees too, is not read as the service blocking."""
    fresh = FreshContent(gemma_style(64), "stall")
    echo_payload = fresh.template
    control = await timed_calls(target.channel, ECHO_METHOD, lambda: echo_payload, scale.stall_s)

    target.server.sqlite_bytes()  # the store is where we look for it
    blocker = sqlite3.connect(
        str(target.server.sqlite_path), timeout=10, isolation_level=None, check_same_thread=False
    )
    try:
        await asyncio.to_thread(blocker.execute, "BEGIN IMMEDIATE")
        stall_start = time.perf_counter()

        async def store_bound(index: int) -> float:
            start = time.perf_counter()
            if index % 2 == 0:
                await target.grant()
            else:
                await target.plan(fresh.next(), timeout=CALL_TIMEOUT_S)
            return time.perf_counter() - start

        waiting = [asyncio.create_task(store_bound(index)) for index in range(scale.stalled_calls)]
        during = await timed_calls(target.channel, ECHO_METHOD, lambda: echo_payload, scale.stall_s)
        held_s = time.perf_counter() - stall_start
    finally:
        if blocker.in_transaction:
            await asyncio.to_thread(blocker.execute, "ROLLBACK")
        blocker.close()
    waited = await asyncio.gather(*waiting)
    return {
        "held_s": held_s,
        "echo_calls_control": len(control),
        "echo_p50_control_ms": percentile(control, 0.5) * 1e3,
        "echo_max_control_ms": max(control) * 1e3,
        "echo_calls_during": len(during),
        "echo_p50_during_ms": percentile(during, 0.5) * 1e3,
        "echo_max_during_ms": max(during) * 1e3,
        "added_ms": (max(during) - max(control)) * 1e3,
        "store_bound_calls": len(waited),
        "store_bound_min_wait_s": min(waited),  # ≈ held_s: the stall reached the store
    }


async def run(
    server_a: ServerProcess, server_b: ServerProcess, scale: Scale, repeats: int
) -> dict[str, Any]:
    channels = [bench_channel(server_a.target), bench_channel(server_b.target)]
    try:
        baseline = LeaseServer(server_a, channels[0], "baseline")
        scaled = LeaseServer(server_b, channels[1], "scaled")
        await baseline.start()
        await scaled.start()
        print("lease scaling:", flush=True)
        levels = await lease_scaling(baseline, scaled, scale, repeats)
        print(f"event-loop check: the store stalled {scale.stall_s:.1f} s:", flush=True)
        stalls = []
        for _ in range(repeats):
            stall = await stalled_store(baseline, scale)
            print(
                f"  worst Echo {stall['echo_max_control_ms']:.2f} ms before, "
                f"{stall['echo_max_during_ms']:.2f} ms during ({stall['echo_calls_during']} "
                f"calls); store-bound calls waited ≥ {stall['store_bound_min_wait_s']:.2f} s",
                flush=True,
            )
            stalls.append(stall)
    finally:
        for channel in channels:
            await channel.close()
    return {"levels": levels, "stalls": stalls}


def evaluate_targets(report: dict[str, Any]) -> list[Target]:
    top = report["levels"][-1]
    targets = []
    for key, what in (("grant_p50_ms", "grant"), ("list_devices_p50_ms", "ListDevices")):
        ratio = Spread.from_dict(top[f"{key}_over_baseline"])
        targets.append(
            Target(
                f"{what} p50 with {top['live_leases']:,} live leases ≤ {TARGET_RATIO:.0f}x "
                f"with {BASELINE_LEASES}",
                f"{ratio.text(unit='x')}: {top[key]['median']:.2f} ms vs "
                f"{top['baseline_' + key]['median']:.2f} ms",
                ratio.median <= TARGET_RATIO,
                {"ratio": ratio.as_dict()},
            )
        )
    stalls = report["stalls"]
    added = Spread.of([stall["added_ms"] for stall in stalls])
    reached = all(stall["store_bound_min_wait_s"] >= 0.8 * stall["held_s"] for stall in stalls)
    targets.append(
        Target(
            f"a store stalled {report['settings']['stall_s']:.1f} s delays no unrelated RPC "
            f"(Echo) by more than {TARGET_STALL_ADDED_MS:.0f} ms",
            f"{added.text(unit=' ms')} added; worst Echo during a stall "
            f"{max(stall['echo_max_during_ms'] for stall in stalls):.1f} ms"
            + ("" if reached else "; INVALID: the store-bound calls did not wait on the stall"),
            added.median <= TARGET_STALL_ADDED_MS if reached else False,
            {"added_ms": added.as_dict(), "stall_reached_store": reached},
        )
    )
    return targets


def render_markdown(report: dict[str, Any]) -> list[str]:
    settings = report["settings"]
    lines = [
        "Two `kvplan serve` on the default store (SQLite), `"
        + " ".join(SERVER_FLAGS)
        + f"`: a baseline server with {BASELINE_LEASES} live leases and a scaled server "
        "filled level by level (a lease = a PlanKVCache of a new one-layer engine naming "
        f"the device, 4 MiB). Per level, {settings['repeats']} alternating batches of "
        f"{settings['samples']} samples on each server (grant timed, its release not, "
        "ListDevices timed); ratios are per batch pair, median (min-max).",
        "",
        "| live leases | grant p50 ms | vs 10 leases | ListDevices p50 ms | vs 10 leases "
        "| filled in s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["levels"]:
        lines.append(
            f"| {row['live_leases']:,} | {Spread.from_dict(row['grant_p50_ms']).text()} | "
            f"{Spread.from_dict(row['grant_p50_ms_over_baseline']).text(unit='x')} | "
            f"{Spread.from_dict(row['list_devices_p50_ms']).text()} | "
            f"{Spread.from_dict(row['list_devices_p50_ms_over_baseline']).text(unit='x')} | "
            f"{row['fill_s']:.1f} |"
        )
    lines += [
        "",
        f"Event-loop check: another SQLite connection holds BEGIN IMMEDIATE on the "
        f"baseline server's store for {settings['stall_s']:.1f} s while "
        f"{settings['stalled_calls']} grants and uncached plans wait on it; Echo calls "
        "back to back meanwhile, and for as long just before (the control).",
        "",
        "| stall | held s | Echo p50 / worst, control ms | Echo p50 / worst, during ms "
        "| Echo calls during | added ms (worst - worst) | store-bound calls waited ≥ s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, stall in enumerate(report["stalls"], 1):
        lines.append(
            f"| {index} | {stall['held_s']:.2f} | {stall['echo_p50_control_ms']:.2f} / "
            f"{stall['echo_max_control_ms']:.2f} | {stall['echo_p50_during_ms']:.2f} / "
            f"{stall['echo_max_during_ms']:.2f} | {stall['echo_calls_during']} | "
            f"{stall['added_ms']:.2f} | {stall['store_bound_min_wait_s']:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--levels", type=int, nargs="+", default=[10, 100, 1000, 10_000])
    parser.add_argument("--samples", type=int, default=100, help="samples per batch")
    args = parse_arguments(parser, argv)
    scale = Scale.of(args)
    repeats = repeats_of(args)
    report = new_report("leases", args, asdict(scale))
    report["title"] = "Leases: grant and ListDevices vs live leases; a stalled store"
    with tempfile.TemporaryDirectory(prefix="kvplan-bench-leases-") as folder:
        baseline = spawn_server(Path(folder), "baseline", SERVER_FLAGS)
        try:
            scaled = spawn_server(Path(folder), "scaled", SERVER_FLAGS)
            try:
                report.update(asyncio.run(run(baseline, scaled, scale, repeats)))
            finally:
                scaled.stop()
        finally:
            baseline.stop()
    targets = evaluate_targets(report)
    report["targets"] = [target.as_dict() for target in targets]
    print_targets(targets)
    write_results(args.results, "leases", report, render_markdown(report))
    return exit_code(targets, args.strict)


if __name__ == "__main__":
    sys.exit(main())
