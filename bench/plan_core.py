"""Core only: planning time in-process vs layer count and worker count.

    python -m bench.plan_core            # kvplan only
    make bench-core                      # also vLLM 0.33 when its venv exists

NOT what users meet (that is bench.rpc_bench and bench.vs_vllm: a new engine over
gRPC): this times kvplan's pure core on values already converted, and the proto ->
proto path in process, with no server, store or network. Prints microseconds per plan,
the growth factor per doubling and, when vLLM 0.33.0 can be imported (run inside its
venv with the repo on PYTHONPATH), vLLM's `get_global_kv_cache_groups` +
`get_kv_cache_configs` on the same engines in the same process, and the ratio.
Results: bench/results/plan_core.json and plan_core.md.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.engines import gemma_style
from bench.options import add_output_arguments, parse_arguments
from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.planner import plan_engine
from kvplan.v1 import plan_pb2


def time_call(call: Callable[[], object], min_seconds: float, max_calls: int = 2000) -> float:
    """Median seconds per call over batches filling `min_seconds`."""
    call()  # warm up
    samples: list[float] = []
    deadline = time.perf_counter() + min_seconds
    while (time.perf_counter() < deadline or len(samples) < 3) and len(samples) < max_calls:
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_each(calls: list[Callable[[], object]]) -> float:
    """Median seconds over one run of each call (each on its own fresh input)."""
    samples: list[float] = []
    for call in calls:
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _vllm_timer(min_seconds: float) -> Callable[[plan_pb2.PlanRequest], float] | None:
    try:
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

        from conformance import vllm_driver
    except ImportError:
        return None

    def time_vllm(request: plan_pb2.PlanRequest) -> float:
        samples: list[float] = []
        deadline = time.perf_counter() + min_seconds
        while time.perf_counter() < deadline or len(samples) < 3:
            inputs = vllm_driver.build_inputs(request)  # fresh: vLLM mutates its config
            register_all_kvcache_specs(inputs.config)
            start = time.perf_counter()
            groups = get_global_kv_cache_groups(inputs.config, inputs.specs)
            get_kv_cache_configs(inputs.config, inputs.specs, inputs.available_memory, groups)
            samples.append(time.perf_counter() - start)
            if len(samples) >= 200:
                break
        return statistics.median(samples)

    return time_vllm


def measure(
    cases: list[tuple[str, plan_pb2.PlanRequest]],
    vllm: Callable[[plan_pb2.PlanRequest], float] | None,
    min_seconds: float,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, request in cases:
        # A fresh domain value per call: the specs' cached page sizes start cold,
        # as they do for every request the service converts.
        size = sum(len(worker.layers) for worker in request.workers)
        count = max(3, min(150 if min_seconds >= 0.3 else 10, 40_000 // size))
        fresh = [request_from_proto(request) for _ in range(count)]
        core_s = time_each([lambda domain=domain: plan_engine(domain) for domain in fresh])  # type: ignore[misc]
        wire_s = time_call(lambda request=request: plan_from_proto(request), min_seconds)  # type: ignore[misc]
        row: dict[str, Any] = {"case": label, "core_us": core_s * 1e6, "wire_us": wire_s * 1e6}
        if vllm is not None:
            vllm_s = vllm(request)
            row["vllm_us"] = vllm_s * 1e6
            row["vllm_over_core"] = vllm_s / core_s
            row["vllm_over_wire"] = vllm_s / wire_s
        rows.append(row)
    for previous, row in itertools.pairwise(rows):
        row["core_growth"] = row["core_us"] / previous["core_us"]
        row["wire_growth"] = row["wire_us"] / previous["wire_us"]
    return rows


def render(title: str, rows: list[dict[str, Any]]) -> str:
    has_vllm = any("vllm_us" in row for row in rows)
    header = "| case | kvplan core µs | kvplan wire µs | growth per doubling (core / wire) |"
    rule = "|---|---:|---:|---:|"
    if has_vllm:
        header += " vLLM 0.33 µs | vLLM / core | vLLM / wire |"
        rule += "---:|---:|---:|"
    lines = [f"### {title}", "", header, rule]
    for row in rows:
        growth = (
            f"{row['core_growth']:.2f}x / {row['wire_growth']:.2f}x"
            if "core_growth" in row
            else "-"
        )
        line = f"| {row['case']} | {row['core_us']:,.0f} | {row['wire_us']:,.0f} | {growth} |"
        if has_vllm:
            line += (
                f" {row['vllm_us']:,.0f} | {row['vllm_over_core']:.1f}x |"
                f" {row['vllm_over_wire']:.1f}x |"
            )
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_output_arguments(parser)
    parser.add_argument("--max-layers", type=int, default=4096)
    parser.add_argument("--max-workers", type=int, default=256)
    args = parse_arguments(parser, argv)
    max_layers, max_workers = (128, 8) if args.quick else (args.max_layers, args.max_workers)
    min_seconds = 0.05 if args.quick else 0.3
    vllm = _vllm_timer(min_seconds)
    layer_counts = [n for n in (32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= max_layers]
    worker_counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= max_workers]
    by_layers = measure([(f"{n} layers", gemma_style(n)) for n in layer_counts], vllm, min_seconds)
    by_workers = measure(
        [(f"64 layers x {n} workers", gemma_style(64, n)) for n in worker_counts],
        vllm,
        min_seconds,
    )
    machine = (
        f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}"
    )
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    report = "\n\n".join(
        [
            "## Core only: planning in process (not the headline)",
            f"{date} · {machine}"
            + (" · **quick mode: smoke-test scale, not figures**" if args.quick else ""),
            "What users meet is a new engine over gRPC: see rpc.md (uncached plan vs Echo) "
            "and vs_vllm.md (round trip vs vLLM). This table times kvplan without server, "
            "store or network. Engine: 5 sliding-window : 1 full attention, 1 TiB per "
            "worker, TP ranks holding every layer. core = `plan_engine` on typed values "
            "already converted; wire = proto request -> PlanResponse in process. "
            + ("vLLM 0.33.0 timed in the same process." if vllm else "vLLM not importable here."),
            render("By layer count (1 worker)", by_layers),
            render("By worker count (64 layers each)", by_workers),
        ]
    )
    print(report)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "plan_core.md").write_text(report + "\n")
    result = {
        "benchmark": "plan_core",
        "core_only": True,
        "date": date,
        "quick": bool(args.quick),
        "vllm": vllm is not None,
        "by_layers": by_layers,
        "by_workers": by_workers,
        "targets": [],  # core-only: the targets are measured over gRPC
    }
    (args.results / "plan_core.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
