"""Where an uncached plan's server CPU goes, step by step, against an Echo.

    python -m bench.cpu_breakdown            # or: make bench-breakdown
    python -m bench.cpu_breakdown --quick    # smoke-test scale

Per repeat, three fresh servers under bench/instrumented_server.py, each loaded back
to back at concurrency 1 for a slice: uncached plans of the 64-layer engine (a new
engine with new content each call: a new engine id and another non-torch memory figure,
bench.common.FreshContent, so the server plans each) on the memory store, the same on
the default store (SQLite), and Echo of the same request. Reported per call: the
whole server's CPU (all threads, /proc), the event-loop thread's, and the thread CPU
of each step of the handler (see instrumented_server.py for what is wrapped). No
targets: it explains the rpc benchmark's figures. Results: bench/results/cpu_breakdown.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    ECHO_METHOD,
    PLAN_METHOD,
    FreshContent,
    Spread,
    bench_channel,
    bench_parser,
    new_report,
    repeats_of,
    spawn_server,
    timed_calls,
    write_results,
)
from bench.engines import gemma_style
from bench.options import parse_arguments

ENGINE = "gemma-64l-tp1"
# Steps in the handler's order; what is left of the handler is "other handler work".
STEPS = (
    "limits",
    "encode workers",
    "plan keys",
    "planning",
    "reply bytes",
    "plan cache",
    "metrics and log line",
    "store hand-off",
)
RUNS = {  # name: (RPC, server flags)
    "plan, memory store": (PLAN_METHOD, ["--store", "memory"]),
    "plan, SQLite store": (PLAN_METHOD, []),
    "Echo": (ECHO_METHOD, []),
}


@dataclass(frozen=True)
class Scale:
    slice_s: float

    @classmethod
    def of(cls, args: argparse.Namespace) -> Scale:
        return cls(0.5 if args.quick else args.slice)


async def load(target: str, method: str, fresh: FreshContent, seconds: float) -> int:
    """Plans of fresh content, or Echo of the template, back to back: the call count."""
    next_payload = fresh.next if method == PLAN_METHOD else (lambda: fresh.template)
    async with bench_channel(target) as channel:
        await channel.channel_ready()
        latencies = await timed_calls(channel, method, next_payload, seconds, min_calls=10)
    return len(latencies)


def measure(
    folder: Path, name: str, method: str, flags: list[str], seconds: float
) -> dict[str, float]:
    """One fresh server, one slice: µs per call of each figure."""
    out = folder / f"{name.replace(' ', '-').replace(',', '')}.json"
    server = spawn_server(folder, "breakdown", flags, instrument_to=out)
    fresh = FreshContent(gemma_style(64), "breakdown")
    try:
        time.sleep(0.2)
        cpu_before = server.cpu_s()
        count = asyncio.run(load(server.target, method, fresh, seconds))
        cpu_s = server.cpu_s() - cpu_before
    finally:
        server.stop()
    counted = json.loads(out.read_text())
    handler = "PlanKVCache" if method == PLAN_METHOD else "Echo"
    if counted["calls"].get(handler) != count:
        raise RuntimeError(f"{name}: the server counted {counted['calls']}, the load {count}")
    spent = {step: ns / 1e3 / count for step, ns in counted["spent_ns"].items()}
    figures = {
        "server, all threads": cpu_s * 1e6 / count,
        "event-loop thread": counted["loop_thread_ns"] / 1e3 / count,
        "in the handler": spent[handler],
    }
    if method == PLAN_METHOD:
        figures.update({step: spent.get(step, 0.0) for step in STEPS})
        figures["other handler work"] = spent[handler] - sum(spent.get(s, 0.0) for s in STEPS)
    figures["outside the handler (gRPC, asyncio)"] = (
        figures["event-loop thread"] - figures["in the handler"]
    )
    return figures


def render_markdown(report: dict[str, Any]) -> list[str]:
    runs = report["runs"]
    names = list(runs)
    rows = list(runs["plan, memory store"])
    lines = [
        f"The 64-layer single-worker engine ({ENGINE}), back to back at concurrency 1; "
        "each plan a new engine with new content (a new engine id and another non-torch "
        "memory figure: the server plans it), Echo of the same payload; "
        f"{report['settings']['slice_s']:.1f} s per server, {report['settings']['repeats']} "
        "repeats, each run on a fresh server under bench/instrumented_server.py; µs of "
        "CPU per call, median (min-max). Thread CPU time of the event-loop thread for the "
        "handler's steps (a wrapper adds about 1 µs each); the store hand-off also counts "
        "the loop's wake-up when the store thread is done. What it explains: rpc.md.",
        "",
        "| µs per call | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for row in rows:
        cells = [
            Spread.from_dict(runs[name][row]).text(".0f") if row in runs[name] else "-"
            for name in names
        ]
        indent = "↳ " if row in STEPS or row == "other handler work" else ""
        lines.append(f"| {indent}{row} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--slice", type=float, default=3.0, help="seconds of load per server")
    args = parse_arguments(parser, argv)
    scale = Scale.of(args)
    repeats = repeats_of(args)
    report = new_report("cpu_breakdown", args, asdict(scale))
    report["title"] = "Where an uncached plan's (new engine, new content) server CPU goes"
    collected: dict[str, list[dict[str, float]]] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory(prefix="kvplan-bench-breakdown-") as name:
        for repeat in range(repeats):
            for run, (method, flags) in RUNS.items():
                figures = measure(Path(name), run, method, flags, scale.slice_s)
                collected[run].append(figures)
                print(
                    f"  repeat {repeat + 1} {run:<20} event loop "
                    f"{figures['event-loop thread']:6.0f} µs/call, handler "
                    f"{figures['in the handler']:6.0f}",
                    flush=True,
                )
    report["runs"] = {
        run: {key: Spread.of([one[key] for one in of_run]).as_dict() for key in of_run[0]}
        for run, of_run in collected.items()
    }
    report["targets"] = []
    write_results(args.results, "cpu_breakdown", report, render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
