"""Planning time vs layer count and worker count, in-process.

    python -m bench.plan_core            # kvplan only
    make bench                           # also vLLM 0.33 when its venv exists

Prints microseconds per plan, the growth factor per doubling and, when vLLM
0.33.0 can be imported (run inside its venv with the repo on PYTHONPATH),
vLLM's `get_global_kv_cache_groups` + `get_kv_cache_configs` on the same
engines in the same run, and the ratio. Results go to bench/results/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvplan.convert import plan_from_proto, request_from_proto
from kvplan.core.planner import plan_engine
from kvplan.v1 import plan_pb2, spec_pb2

RESULTS = Path(__file__).parent / "results"
GIB = 1 << 30


def hybrid_engine(num_layers: int, num_workers: int = 1) -> plan_pb2.PlanRequest:
    """A Gemma-3-style hybrid (5 sliding-window : 1 full) on `num_workers` TP ranks."""
    request = plan_pb2.PlanRequest(engine_id=f"bench-{num_layers}x{num_workers}")
    request.options.max_model_len = 32_768
    layers = []
    for index in range(num_layers):
        layer = spec_pb2.LayerSpec(name=f"model.layers.{index}.self_attn.attn")
        if index % 6 == 5:
            layer.full_attention.attention.num_kv_heads = 8
            layer.full_attention.attention.head_size = 128
        else:
            layer.sliding_window.attention.num_kv_heads = 8
            layer.sliding_window.attention.head_size = 128
            layer.sliding_window.sliding_window = 1024
        layers.append(layer)
    for rank in range(num_workers):
        worker = request.workers.add(rank=rank)
        worker.memory.kv_cache_memory_bytes = 1024 * GIB  # ample for 4096 layers
        worker.layers.extend(layers)
    return request


def time_call(call: Callable[[], object], min_seconds: float = 0.3, max_calls: int = 2000) -> float:
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


def _vllm_timer() -> Callable[[plan_pb2.PlanRequest], float] | None:
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
        deadline = time.perf_counter() + 0.5
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
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, request in cases:
        # A fresh domain value per call: the specs' cached page sizes start cold,
        # as they do for every request the service converts.
        size = sum(len(worker.layers) for worker in request.workers)
        fresh = [request_from_proto(request) for _ in range(max(3, min(150, 40_000 // size)))]
        core_s = time_each([lambda domain=domain: plan_engine(domain) for domain in fresh])  # type: ignore[misc]
        wire_s = time_call(lambda request=request: plan_from_proto(request))  # type: ignore[misc]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-layers", type=int, default=4096)
    parser.add_argument("--max-workers", type=int, default=256)
    args = parser.parse_args()
    vllm = _vllm_timer()
    layer_counts = [n for n in (32, 64, 128, 256, 512, 1024, 2048, 4096) if n <= args.max_layers]
    worker_counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n <= args.max_workers]
    by_layers = measure([(f"{n} layers", hybrid_engine(n)) for n in layer_counts], vllm)
    by_workers = measure(
        [(f"64 layers x {n} workers", hybrid_engine(64, n)) for n in worker_counts], vllm
    )
    machine = (
        f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}"
    )
    report = "\n\n".join(
        [
            "## Planning time (in-process)",
            f"Engine: 5 sliding-window : 1 full attention, 1 TiB per worker. {machine}. "
            "core = `plan_engine` on typed values; wire = proto request -> PlanResponse. "
            + ("vLLM 0.33.0 timed in the same process." if vllm else "vLLM not importable here."),
            render("By layer count (1 worker)", by_layers),
            render("By worker count (64 layers each)", by_workers),
        ]
    )
    print(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_core.md").write_text(report + "\n")
    (RESULTS / "plan_core.json").write_text(
        json.dumps({"by_layers": by_layers, "by_workers": by_workers}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
