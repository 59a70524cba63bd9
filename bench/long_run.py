"""The long run: 100,000 distinct engines against one server, and what it costs over time.

    python -m bench.long_run             # or: make bench-long
    python -m bench.long_run --quick     # smoke-test scale

One `kvplan serve` on its default store (SQLite) plans `--engines` engines, each a new
engine with new content (a new engine id and another non-torch memory figure in every
worker, bench.common.FreshContent: each plan is uncached, planned, stored, counted in
the metrics; a new engine id alone would be a known model, which the server may answer
from memory), from
`--concurrency` callers. Per window of `--window` plans it records the server CPU per
plan (from /proc, over sub-windows of the window for a spread), then, outside that CPU
window, a short Echo slice of the same payload (server CPU per echo: the machine's speed
at that moment, so a slower host is not read as a slower service), the server's RSS,
the /metrics page (bytes, samples, time to scrape) and the SQLite file (database + WAL).

Targets: CPU per plan of the last window within 1.2x of the first; RSS, /metrics and the
SQLite file bounded, read as: grow by at most 10% over the second half of the run.
Results: bench/results/long_run.json and long_run.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
    bench_channel,
    bench_parser,
    exit_code,
    new_report,
    print_targets,
    scrape,
    spawn_server,
    write_results,
)
from bench.options import parse_arguments
from bench.rpc_bench import ENGINES

TARGET_LAST_OVER_FIRST = 1.2
TARGET_SECOND_HALF_GROWTH = 1.10  # "bounded": at most 10% more at the end than halfway


@dataclass(frozen=True)
class Scale:
    engines: int
    window: int
    sub_windows: int
    echo_calls: int
    concurrency: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Scale:
        if args.quick:
            # 200 Echo calls: several of /proc's 10 ms CPU ticks (40 could read 0).
            return cls(engines=300, window=100, sub_windows=2, echo_calls=200, concurrency=4)
        return cls(args.engines, args.window, 10, 500, args.concurrency)


async def run_calls(
    channels: list[grpc.aio.Channel], method: str, count: int, payload: Callable[[], bytes]
) -> None:
    """`count` calls spread over the channels, each channel calling back to back."""
    remaining = count

    async def caller(channel: grpc.aio.Channel) -> None:
        nonlocal remaining
        call = channel.unary_unary(method)
        while remaining > 0:
            remaining -= 1
            await call(payload(), timeout=CALL_TIMEOUT_S)

    await asyncio.gather(*(caller(channel) for channel in channels))


async def one_window(
    server: ServerProcess,
    channels: list[grpc.aio.Channel],
    next_plan: Callable[[], bytes],
    echo_payload: bytes,
    scale: Scale,
    plans_before: int,
) -> dict[str, Any]:
    per_sub = scale.window // scale.sub_windows
    sub_costs_us: list[float] = []
    wall_s = 0.0
    for _ in range(scale.sub_windows):
        cpu, start = server.cpu_s(), time.perf_counter()
        await run_calls(channels, PLAN_METHOD, per_sub, next_plan)
        wall_s += time.perf_counter() - start
        sub_costs_us.append((server.cpu_s() - cpu) / per_sub * 1e6)
    cpu = server.cpu_s()
    await run_calls(channels, ECHO_METHOD, scale.echo_calls, lambda: echo_payload)
    echo_us = (server.cpu_s() - cpu) / scale.echo_calls * 1e6
    metrics = scrape(server)
    plans = plans_before + per_sub * scale.sub_windows
    window: dict[str, Any] = {
        "plans": plans,
        "cpu_us_per_plan": Spread.of(sub_costs_us).as_dict(),
        "echo_cpu_us": echo_us,
        # nan when the Echo calls took less than one CPU tick to read.
        "plan_over_echo_cpu": statistics.median(sub_costs_us) / echo_us if echo_us else math.nan,
        "plans_per_s": per_sub * scale.sub_windows / wall_s,
        "rss_mb": server.rss_mb(),
        "metrics_bytes": metrics.size_bytes,
        "metrics_samples": metrics.series(),
        "scrape_ms": metrics.seconds * 1e3,
        "sqlite_bytes": server.sqlite_bytes(),
    }
    print(
        f"  {plans:>7,} plans: {window['cpu_us_per_plan']['median']:6.0f} µs CPU/plan "
        f"({window['plan_over_echo_cpu']:.1f}x echo), {window['plans_per_s']:5.0f} plans/s, "
        f"RSS {window['rss_mb']:.0f} MB, /metrics {metrics.size_bytes:,} B in "
        f"{window['scrape_ms']:.0f} ms, SQLite {window['sqlite_bytes'] / 2**20:.1f} MiB",
        flush=True,
    )
    return window


async def long_run(server: ServerProcess, engine: str, scale: Scale) -> list[dict[str, Any]]:
    fresh = FreshContent(ENGINES[engine][1](), f"long-{engine}")
    channels = [bench_channel(server.target) for _ in range(scale.concurrency)]
    windows: list[dict[str, Any]] = []
    try:
        for channel in channels:
            await channel.channel_ready()
        plans = 0
        while plans < scale.engines:
            window = await one_window(server, channels, fresh.next, fresh.template, scale, plans)
            plans = window["plans"]
            windows.append(window)
    finally:
        for channel in channels:
            await channel.close()
    return windows


def growth_over_second_half(windows: list[dict[str, Any]], key: str) -> float:
    halfway = windows[len(windows) // 2 - 1] if len(windows) > 1 else windows[0]
    return float(windows[-1][key]) / max(float(halfway[key]), 1e-9)


def evaluate_targets(windows: list[dict[str, Any]]) -> list[Target]:
    first, last = windows[0], windows[-1]
    first_cost = first["cpu_us_per_plan"]["median"]
    # Each of the last window's sub-windows over the first window: the spread.
    ratio = Spread.of([cost / first_cost for cost in last["cpu_us_per_plan"]["values"]])
    normalized = last["plan_over_echo_cpu"] / first["plan_over_echo_cpu"]
    targets = [
        Target(
            f"server CPU per uncached plan (new engine, new content), last {first['plans']:,} "
            "plans (of "
            f"{last['plans']:,} engines) ≤ {TARGET_LAST_OVER_FIRST}x the first {first['plans']:,}",
            f"{ratio.text(unit='x')}: {first_cost:,.0f} → "
            f"{last['cpu_us_per_plan']['median']:,.0f} µs/plan; against Echo CPU of the "
            f"moment {normalized:.2f}x",
            ratio.median <= TARGET_LAST_OVER_FIRST,
            {"ratio": ratio.as_dict(), "echo_normalized_ratio": normalized},
        )
    ]
    for key, what, unit, scale_by in (
        ("rss_mb", "server RSS", "MB", 1.0),
        ("metrics_bytes", "/metrics size", "KB", 1e-3),
        ("sqlite_bytes", "SQLite file (database + WAL)", "MB", 1e-6),
    ):
        growth = growth_over_second_half(windows, key)
        peak = max(float(window[key]) for window in windows) * scale_by
        targets.append(
            Target(
                f"{what} bounded: ≤ {TARGET_SECOND_HALF_GROWTH:.2f}x over the second half",
                f"{growth:.3f}x; {float(first[key]) * scale_by:,.1f} → "
                f"{float(last[key]) * scale_by:,.1f} {unit}, peak {peak:,.1f} {unit}",
                growth <= TARGET_SECOND_HALF_GROWTH,
                {"growth": growth, "peak": peak, "unit": unit},
            )
        )
    return targets


def render_markdown(report: dict[str, Any]) -> list[str]:
    scale = report["settings"]
    windows = report["windows"]
    step = max(1, len(windows) // 20)  # at most about 20 rows; every window is in the JSON
    shown = sorted({*range(0, len(windows), step), len(windows) - 1})
    lines = [
        f"Engine **{report['engine']}**: {ENGINES[report['engine']][0]}. "
        f"{scale['engines']:,} engines, each a new engine with new content (a new engine id "
        "and another non-torch memory figure in every worker: an uncached plan, planned and "
        "stored), from "
        f"{scale['concurrency']} callers on the default store (SQLite). Per window of "
        f"{scale['window']:,} plans: server CPU per plan over {scale['sub_windows']} "
        "sub-windows (median, min-max), then, outside that window, "
        f"{scale['echo_calls']} Echo calls of the same payload (machine speed now), RSS, "
        "/metrics and the SQLite file (database + WAL).",
        "",
        "| plans | server CPU µs/plan | echo CPU µs | plan / echo CPU | plans/s | RSS MB "
        "| /metrics KB | samples | scrape ms | SQLite MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index in shown:
        window = windows[index]
        cost = Spread.from_dict(window["cpu_us_per_plan"])
        lines.append(
            f"| {window['plans']:,} | {cost.text(',.0f')} | {window['echo_cpu_us']:,.0f} | "
            f"{window['plan_over_echo_cpu']:.2f}x | {window['plans_per_s']:,.0f} | "
            f"{window['rss_mb']:.1f} | {window['metrics_bytes'] / 1e3:,.1f} | "
            f"{window['metrics_samples']:,} | {window['scrape_ms']:.1f} | "
            f"{window['sqlite_bytes'] / 1e6:,.1f} |"
        )
    scrape_ms = [window["scrape_ms"] for window in windows]
    lines += [
        "",
        f"/metrics scrape time: first {scrape_ms[0]:.1f} ms, last {scrape_ms[-1]:.1f} ms, "
        f"max {max(scrape_ms):.1f} ms. Run time {report['total_s']:,.0f} s.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--engines", type=int, default=100_000, help="distinct engines")
    parser.add_argument("--window", type=int, default=1000, help="plans per window")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--engine", choices=sorted(ENGINES), default="qwen3-next-tp8")
    args = parse_arguments(parser, argv)
    scale = Scale.of(args)
    report = new_report("long_run", args, asdict(scale))
    report["title"] = f"Long run: {scale.engines:,} distinct engines on one server"
    report["engine"] = args.engine
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvplan-bench-long-") as folder:
        server = spawn_server(Path(folder), "long")
        try:
            report["rss_mb_after_start"] = server.rss_mb()
            print(f"long run: {scale.engines:,} engines ({args.engine})", flush=True)
            report["windows"] = asyncio.run(long_run(server, args.engine, scale))
        finally:
            server.stop()
    report["total_s"] = time.perf_counter() - began
    targets = evaluate_targets(report["windows"])
    report["targets"] = [target.as_dict() for target in targets]
    print_targets(targets)
    write_results(args.results, "long_run", report, render_markdown(report))
    return exit_code(targets, args.strict)


if __name__ == "__main__":
    sys.exit(main())
