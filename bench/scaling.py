"""Per-plan cost against the number of workers, pipeline- and tensor-parallel, 8 → 256.

    python -m bench.scaling              # or: make bench-scaling
    python -m bench.scaling --quick      # smoke-test scale

One `kvplan serve` on its default store (SQLite). Engines (Gemma-3-style hybrid, 5
sliding-window : 1 full attention):

- PP: `n` pipeline stages of 8 layers each (the model grows with the stages, 8n layers);
- TP: `n` tensor-parallel ranks, each with all 64 layers (64n layer specs on the wire).

Per repeat, for each kind and size (the order of sizes alternating between repeats):
uncached plans (a new engine with new content each call: a new engine id and another
non-torch memory figure in every worker, bench.common.FreshContent, so the server plans
each) back to back at concurrency 1 for a slice,
then Echo of the same payload for a slice; server CPU per call from /proc. The slope is
the least-squares slope of log(server CPU per plan) on log(workers) over the sizes,
per repeat; 1.0 is linear. Results: bench/results/scaling.json and scaling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    ECHO_METHOD,
    PLAN_METHOD,
    FreshContent,
    ServerProcess,
    Spread,
    Target,
    bench_channel,
    bench_parser,
    exit_code,
    loglog_slope,
    new_report,
    percentile,
    print_targets,
    repeats_of,
    spawn_server,
    timed_calls,
    write_results,
)
from bench.engines import gemma_style, gemma_style_pipeline
from bench.options import parse_arguments
from kvplan.v1 import plan_pb2

TARGET_SLOPE = 1.1
KINDS: dict[str, tuple[str, Callable[[int], plan_pb2.PlanRequest]]] = {
    "pp": ("pipeline stages of 8 layers each", gemma_style_pipeline),
    "tp": ("tensor-parallel ranks with all 64 layers each", lambda n: gemma_style(64, n)),
}


@dataclass(frozen=True)
class Scale:
    workers: tuple[int, ...]
    slice_s: float

    @classmethod
    def of(cls, args: argparse.Namespace) -> Scale:
        if args.quick:
            return cls((8, 16, 32), 0.1)
        return cls(tuple(args.workers), args.slice)


async def cost_of(
    server: ServerProcess, request: plan_pb2.PlanRequest, slice_s: float
) -> dict[str, float]:
    """Uncached plans (fresh content), then Echo of the same payload, one slice each, at
    concurrency 1."""
    fresh = FreshContent(request, request.engine_id)
    figures: dict[str, float] = {"request_bytes": len(fresh.template)}
    async with bench_channel(server.target) as channel:
        await channel.channel_ready()
        for name, method, next_payload in (
            ("plan", PLAN_METHOD, fresh.next),
            ("echo", ECHO_METHOD, lambda: fresh.template),
        ):
            cpu = server.cpu_s()
            latencies = await timed_calls(channel, method, next_payload, slice_s, 3)
            figures[f"{name}_cpu_ms"] = (server.cpu_s() - cpu) / len(latencies) * 1e3
            figures[f"{name}_p50_ms"] = percentile(latencies, 0.5) * 1e3
            figures[f"{name}_calls"] = len(latencies)
    return figures


async def scaling(server: ServerProcess, scale: Scale, repeats: int) -> dict[str, Any]:
    requests = {kind: {n: build(n) for n in scale.workers} for kind, (_, build) in KINDS.items()}
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        sizes = scale.workers if repeat % 2 == 0 else scale.workers[::-1]
        for kind in KINDS:
            costs = {n: await cost_of(server, requests[kind][n], scale.slice_s) for n in sizes}
            slope = loglog_slope(
                list(scale.workers), [costs[n]["plan_cpu_ms"] for n in scale.workers]
            )
            print(
                f"  repeat {repeat + 1} {kind}: "
                + ", ".join(f"{n}: {costs[n]['plan_cpu_ms']:.1f}" for n in scale.workers)
                + f" ms CPU/plan; slope {slope:.2f}",
                flush=True,
            )
            runs.append({"kind": kind, "costs": costs, "slope": slope})
    summary: dict[str, Any] = {}
    for kind in KINDS:
        of_kind = [run for run in runs if run["kind"] == kind]
        summary[kind] = {
            "slope": Spread.of([run["slope"] for run in of_kind]).as_dict(),
            "by_workers": [
                {
                    "workers": n,
                    **{
                        key: Spread.of([run["costs"][n][key] for run in of_kind]).as_dict()
                        for key in of_kind[0]["costs"][n]
                    },
                }
                for n in scale.workers
            ],
        }
    return summary


def evaluate_targets(report: dict[str, Any]) -> list[Target]:
    workers = report["settings"]["workers"]
    targets = []
    for kind, figures in report["scaling"].items():
        slope = Spread.from_dict(figures["slope"])
        targets.append(
            Target(
                f"{kind.upper()}: server CPU per plan linear in workers, slope ≤ {TARGET_SLOPE} "
                f"from {workers[0]} to {workers[-1]} workers",
                f"slope {slope.text()}",
                slope.median <= TARGET_SLOPE,
                {"slope": slope.as_dict()},
            )
        )
    return targets


def render_markdown(report: dict[str, Any]) -> list[str]:
    settings = report["settings"]
    lines = [
        "One `kvplan serve` on the default store (SQLite); Gemma-3-style hybrid (5 "
        f"sliding-window : 1 full). Per repeat ({settings['repeats']}), per size: uncached "
        "plans (a new engine with new content each call: a new engine id and another "
        "non-torch memory figure in every worker, so the server plans each) back to back "
        f"at concurrency 1 for {settings['slice_s']:.1f} s, then Echo of "
        "the same payload; server CPU per call from /proc. Median (min-max) over repeats; "
        "slope = least-squares slope of log(CPU per plan) on log(workers).",
    ]
    for kind, figures in report["scaling"].items():
        lines += [
            "",
            f"### {kind.upper()}: {KINDS[kind][0]}; slope "
            f"{Spread.from_dict(figures['slope']).text()}",
            "",
            "| workers | request KB | server CPU ms/plan | plan p50 ms | echo CPU ms/call "
            "| plan / echo CPU |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for row in figures["by_workers"]:
            plan_cpu = Spread.from_dict(row["plan_cpu_ms"])
            echo_cpu = Spread.from_dict(row["echo_cpu_ms"])
            lines.append(
                f"| {row['workers']} | {row['request_bytes']['median'] / 1e3:,.0f} | "
                f"{plan_cpu.text()} | {Spread.from_dict(row['plan_p50_ms']).text()} | "
                f"{echo_cpu.text()} | {plan_cpu.median / echo_cpu.median:.1f}x |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--slice", type=float, default=1.5, help="seconds per size and call")
    args = parse_arguments(parser, argv)
    scale = Scale.of(args)
    repeats = repeats_of(args)
    report = new_report("scaling", args, asdict(scale))
    report["title"] = "Per-plan cost against workers (PP and TP)"
    with tempfile.TemporaryDirectory(prefix="kvplan-bench-scaling-") as folder:
        server = spawn_server(Path(folder), "scaling")
        try:
            print("scaling:", flush=True)
            report["scaling"] = asyncio.run(scaling(server, scale, repeats))
        finally:
            server.stop()
    targets = evaluate_targets(report)
    report["targets"] = [target.as_dict() for target in targets]
    print_targets(targets)
    write_results(args.results, "scaling", report, render_markdown(report))
    return exit_code(targets, args.strict)


if __name__ == "__main__":
    sys.exit(main())
