"""A loopback round trip of a new engine against vLLM 0.33's in-process planning of it.

    python -m bench.vs_vllm              # or: make bench-vllm
    python -m bench.vs_vllm --quick      # smoke-test scale

Two processes, idle while the other is measured:

- kvplan: one `kvplan serve` on its default store (SQLite); a PlanKVCache of a new
  engine with new content each call (uncached: a new engine id and another non-torch
  memory figure in every worker, bench.common.FreshContent, so the server has to
  plan), back to back at concurrency 1, the round trip timed by the caller
  (serialized request in, serialized plan out). The targets are judged on it;
  The server budgets the model's grouping, which it keeps (kvplan.model_cache): what
  a fleet's engines of one model cost;
- kvplan, new model (informational): the same and a model the server has never seen
  (FreshContent.new_model), planned from scratch: the first engine of a model;
- kvplan, known content (informational, never a target): the same, but each call only
  a new engine id with content the server has seen (a new replica on GPUs reporting
  the same memory, which the server may answer from memory);
- vLLM 0.33 (its own environment, `--vllm-python`; bench/vllm_worker.py): vLLM's
  get_global_kv_cache_groups + get_kv_cache_configs of the same engine, in process;
- the floor: an Echo of the same payload over the same loopback, timed the same way,
  i.e. what any unary call of this size costs before any planning. vLLM's p50 over
  Echo's is the most any round trip could reach against vLLM on this machine.

Per repeat and engine (the 64-layer single-worker engine and the 8-worker Qwen3-Next-
like engine), a kvplan slice, a new-model slice, a known-content slice, an Echo slice
and a vLLM slice alternate (order rotated each repeat);
the figure is vLLM's p50 over kvplan's p50, median and range over the repeats. Without
vLLM's environment the kvplan side is still measured and the targets read NOT RUN.
Results: bench/results/vs_vllm.json and vs_vllm.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    ECHO_METHOD,
    PLAN_METHOD,
    ROOT,
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
    write_results,
)
from bench.options import parse_arguments
from bench.rpc_bench import ENGINES
from bench.vllm_worker import READY_LINE, REPLY_PREFIX

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "kvplan" / "vllm-0.33" / "venv"
READY_MARKER = ".kvplan-vllm-ready"
VLLM_START_TIMEOUT_S = 600.0
# vLLM p50 / kvplan round-trip p50, at least.
TARGETS = {"gemma-64l-tp1": 5.0, "qwen3-next-tp8": 15.0}


@dataclass(frozen=True)
class Scale:
    slice_s: float
    min_calls: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Scale:
        return cls(0.3, 3) if args.quick else cls(args.slice, 10)


class VllmWorker:
    """bench.vllm_worker in vLLM's environment, one job at a time over its pipes."""

    def __init__(self, python: Path, log_path: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [str(python), "-m", "bench.vllm_worker"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def _line(self, timeout_s: float, wanted: Callable[[str], bool]) -> str:
        """The next stdout line `wanted` accepts (vLLM's own output skipped)."""
        found: list[str] = []

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                if wanted(line):
                    found.append(line)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            raise RuntimeError(
                f"vLLM worker gave no answer in {timeout_s:.0f} s (exit {self.process.poll()})"
            )
        return found[0]

    def wait_ready(self) -> None:
        self._line(VLLM_START_TIMEOUT_S, lambda line: line.strip() == READY_LINE)

    def time_planning(self, request_path: Path, seconds: float, min_calls: int) -> list[float]:
        assert self.process.stdin is not None
        job = {"request": str(request_path), "seconds": seconds, "min_calls": min_calls}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        line = self._line(seconds + 300, lambda line: line.startswith(REPLY_PREFIX))
        reply = json.loads(line.removeprefix(REPLY_PREFIX))
        if "error" in reply:
            raise RuntimeError(f"vLLM could not plan {request_path.name}: {reply['error']}")
        return [float(sample) for sample in reply["samples_s"]]

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def vllm_python(args: argparse.Namespace) -> tuple[Path | None, str]:
    """vLLM's interpreter, or None and why not."""
    if args.vllm_venv is None:
        return None, "vLLM not requested (--no-vllm)"
    if not (args.vllm_venv / READY_MARKER).exists():
        return None, f"no vLLM 0.33 environment at {args.vllm_venv} (`make conformance`)"
    return args.vllm_venv / "bin" / "python", ""


async def round_trips(
    server: ServerProcess, method: str, payloads: Callable[[], bytes], scale: Scale
) -> list[float]:
    async with bench_channel(server.target) as channel:
        await channel.channel_ready()
        return await timed_calls(channel, method, payloads, scale.slice_s, scale.min_calls)


def compare(
    server: ServerProcess,
    vllm: VllmWorker | None,
    folder: Path,
    scale: Scale,
    repeats: int,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for key, (description, build) in ENGINES.items():
        fresh = FreshContent(build(), f"vs-vllm-{key}")
        # vLLM plans the template: the known content, 4 KiB x serial of non-torch
        # memory from each fresh call's.
        request_path = folder / f"{key}.pb"
        request_path.write_bytes(fresh.template)

        def echo(payload: bytes = fresh.template) -> bytes:
            return payload

        warm_up = Scale(0.0, 3)
        asyncio.run(round_trips(server, PLAN_METHOD, fresh.next, warm_up))
        asyncio.run(round_trips(server, PLAN_METHOD, fresh.known_content, warm_up))
        asyncio.run(round_trips(server, PLAN_METHOD, fresh.new_model, warm_up))
        if vllm is not None:
            vllm.time_planning(request_path, 0.0, 2)
        asyncio.run(round_trips(server, ECHO_METHOD, echo, warm_up))
        kvplan_p50: list[float] = []
        known_p50: list[float] = []
        new_model_p50: list[float] = []
        echo_p50: list[float] = []
        vllm_p50: list[float] = []
        order = ["kvplan", "new model", "known content", "echo", "vllm"]
        for repeat in range(repeats):
            turn = repeat % len(order)
            for side in order[turn:] + order[:turn]:
                if side == "kvplan":
                    samples = asyncio.run(round_trips(server, PLAN_METHOD, fresh.next, scale))
                    kvplan_p50.append(percentile(samples, 0.5) * 1e3)
                elif side == "new model":
                    samples = asyncio.run(round_trips(server, PLAN_METHOD, fresh.new_model, scale))
                    new_model_p50.append(percentile(samples, 0.5) * 1e3)
                elif side == "known content":
                    samples = asyncio.run(
                        round_trips(server, PLAN_METHOD, fresh.known_content, scale)
                    )
                    known_p50.append(percentile(samples, 0.5) * 1e3)
                elif side == "echo":
                    samples = asyncio.run(round_trips(server, ECHO_METHOD, echo, scale))
                    echo_p50.append(percentile(samples, 0.5) * 1e3)
                elif vllm is not None:
                    samples = vllm.time_planning(request_path, scale.slice_s, scale.min_calls)
                    vllm_p50.append(percentile(samples, 0.5) * 1e3)
            print(
                f"  repeat {repeat + 1} {key:<15} kvplan round trip {kvplan_p50[-1]:8.2f} ms"
                f" (new model {new_model_p50[-1]:.2f} ms, known content {known_p50[-1]:.2f} ms,"
                f" Echo {echo_p50[-1]:.2f} ms)"
                + (
                    f", vLLM in process {vllm_p50[-1]:8.2f} ms: "
                    f"{vllm_p50[-1] / kvplan_p50[-1]:.1f}x"
                    if vllm_p50
                    else ""
                ),
                flush=True,
            )
        row: dict[str, Any] = {
            "engine": key,
            "description": description,
            "request_bytes": len(fresh.template),
            "kvplan_round_trip_p50_ms": Spread.of(kvplan_p50).as_dict(),
            "new_model_round_trip_p50_ms": Spread.of(new_model_p50).as_dict(),
            "known_content_round_trip_p50_ms": Spread.of(known_p50).as_dict(),
            "echo_round_trip_p50_ms": Spread.of(echo_p50).as_dict(),
        }
        if vllm_p50:
            row["vllm_p50_ms"] = Spread.of(vllm_p50).as_dict()
            row["vllm_over_kvplan"] = Spread.of(
                [v / k for v, k in zip(vllm_p50, kvplan_p50, strict=True)]
            ).as_dict()
            row["vllm_over_new_model"] = Spread.of(
                [v / k for v, k in zip(vllm_p50, new_model_p50, strict=True)]
            ).as_dict()
            row["vllm_over_known_content"] = Spread.of(
                [v / k for v, k in zip(vllm_p50, known_p50, strict=True)]
            ).as_dict()
            row["vllm_over_echo"] = Spread.of(
                [v / e for v, e in zip(vllm_p50, echo_p50, strict=True)]
            ).as_dict()
        rows.append(row)
    return rows


def evaluate_targets(report: dict[str, Any]) -> list[Target]:
    targets = []
    for row in report["engines"]:
        goal = TARGETS[row["engine"]]
        name = (
            f"a loopback round trip of a new engine with new content ({row['engine']}) "
            f"beats vLLM 0.33's in-process planning by ≥ {goal:.0f}x"
        )
        if "vllm_over_kvplan" not in row:
            targets.append(Target(name, f"NOT RUN: {report['vllm_missing']}", None))
            continue
        ratio = Spread.from_dict(row["vllm_over_kvplan"])
        targets.append(
            Target(
                name,
                f"{ratio.text('.1f', 'x')}: vLLM {row['vllm_p50_ms']['median']:.2f} ms, kvplan "
                f"{row['kvplan_round_trip_p50_ms']['median']:.2f} ms (an Echo of the same "
                f"payload: {row['echo_round_trip_p50_ms']['median']:.2f} ms, "
                f"{row['vllm_over_echo']['median']:.1f}x; informational: a new model "
                f"{row['new_model_round_trip_p50_ms']['median']:.2f} ms, "
                f"{row['vllm_over_new_model']['median']:.1f}x, known content "
                f"{row['known_content_round_trip_p50_ms']['median']:.2f} ms, "
                f"{row['vllm_over_known_content']['median']:.1f}x)",
                ratio.median >= goal,
                {"ratio": ratio.as_dict()},
            )
        )
    return targets


def render_markdown(report: dict[str, Any]) -> list[str]:
    settings = report["settings"]
    lines = [
        "kvplan: the round trip of a PlanKVCache of a new engine with new content "
        "(uncached: a new engine id and another non-torch memory figure in every worker "
        "each call, so the server has to plan it, budgeting the model's grouping, which it "
        "keeps; the targets are judged on it), over "
        "loopback to one `kvplan serve` on its default store (SQLite), at concurrency 1. "
        "New model (informational): the same and a model the server has never seen, "
        "planned from scratch. Known content (informational, never a target): only a new "
        "engine id, content the server has seen (a new replica on GPUs reporting the same "
        "memory, which it may answer from memory). "
        "vLLM 0.33: `get_global_kv_cache_groups` + `get_kv_cache_configs` of the same "
        "engine in its own process (inputs built by conformance/vllm_driver.py, not "
        "timed). Echo: the same payload echoed over the same loopback, the floor of any "
        f"round trip of this size. Slices of {settings['slice_s']:.1f} s alternate between "
        f"the five, {settings['repeats']} repeats; p50 per slice, median (min-max) over "
        "repeats.",
        "",
        "| engine | request B | kvplan round trip p50 ms (uncached) | new model p50 ms "
        "(informational) | known content p50 ms (informational) | Echo p50 ms | vLLM "
        "in-process p50 ms | vLLM / kvplan (the target) | vLLM / new model "
        "(informational) | vLLM / known content (informational) | vLLM / Echo (the "
        "ceiling) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["engines"]:
        vllm = (
            f"{Spread.from_dict(row['vllm_p50_ms']).text()} | "
            f"{Spread.from_dict(row['vllm_over_kvplan']).text('.1f', 'x')} | "
            f"{Spread.from_dict(row['vllm_over_new_model']).text('.1f', 'x')} | "
            f"{Spread.from_dict(row['vllm_over_known_content']).text('.1f', 'x')} | "
            f"{Spread.from_dict(row['vllm_over_echo']).text('.1f', 'x')}"
            if "vllm_over_kvplan" in row
            else f"not run ({report['vllm_missing']}) | - | - | - | -"
        )
        lines.append(
            f"| {row['engine']}: {row['description']} | {row['request_bytes']:,} | "
            f"{Spread.from_dict(row['kvplan_round_trip_p50_ms']).text()} | "
            f"{Spread.from_dict(row['new_model_round_trip_p50_ms']).text()} | "
            f"{Spread.from_dict(row['known_content_round_trip_p50_ms']).text()} | "
            f"{Spread.from_dict(row['echo_round_trip_p50_ms']).text()} | {vllm} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--slice", type=float, default=2.0, help="seconds per slice")
    parser.add_argument(
        "--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV, help="vLLM 0.33's environment"
    )
    parser.add_argument(
        "--no-vllm", dest="vllm_venv", action="store_const", const=None, help="kvplan side only"
    )
    args = parse_arguments(parser, argv)
    scale = Scale.of(args)
    repeats = repeats_of(args)
    python, missing = vllm_python(args)
    report = new_report("vs_vllm", args, asdict(scale))
    report["title"] = "kvplan over the wire vs vLLM 0.33 in process"
    report["vllm_missing"] = missing
    with tempfile.TemporaryDirectory(prefix="kvplan-bench-vllm-") as name:
        folder = Path(name)
        # vLLM imports for a while: start it first, the kvplan server meanwhile.
        vllm = VllmWorker(python, folder / "vllm.log") if python is not None else None
        try:
            server = spawn_server(folder, "vs-vllm")
            try:
                if vllm is not None:
                    print("waiting for vLLM to import ...", flush=True)
                    vllm.wait_ready()
                print("kvplan vs vLLM:", flush=True)
                report["engines"] = compare(server, vllm, folder, scale, repeats)
            finally:
                server.stop()
        finally:
            if vllm is not None:
                vllm.stop()
    targets = evaluate_targets(report)
    report["targets"] = [target.as_dict() for target in targets]
    print_targets(targets)
    write_results(args.results, "vs_vllm", report, render_markdown(report))
    return exit_code(targets, args.strict)


if __name__ == "__main__":
    sys.exit(main())
