"""Every benchmark in one run, and one summary of the issue's targets.

    python -m bench                  # or: make bench (the full set; about 15 min on 2 cores)
    python -m bench --quick          # smoke-test scale (about a minute)
    python -m bench --only rpc leases

Runs, in this order: rpc (uncached plan vs Echo, rendezvous, cold start),
cpu_breakdown (where a plan's server CPU goes), vs_vllm, leases, large_request (how long
a 57 MB request holds other calls), scaling, long_run, then
plan_core (core only, inside vLLM's environment when it
exists). Each writes bench/results/NAME.json and NAME.md; this writes summary.md and
summary.json: every target, PASS / FAIL / NOT RUN, with its figure and spread. A program
that crashes is reported as such and the others still run.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import (
    cpu_breakdown,
    large_request,
    leases,
    long_run,
    plan_core,
    rpc_bench,
    scaling,
    vs_vllm,
)
from bench.common import ROOT, bench_parser, machine_info, machine_line, targets_table
from bench.options import parse_arguments

PROGRAMS: dict[str, Callable[[list[str]], int]] = {
    "rpc": rpc_bench.main,
    "cpu_breakdown": cpu_breakdown.main,
    "vs_vllm": vs_vllm.main,
    "leases": leases.main,
    "large_request": large_request.main,
    "scaling": scaling.main,
    "long_run": long_run.main,
    "plan_core": plan_core.main,
}


def run_plan_core(argv: list[str], vllm_venv: Path | None) -> int:
    """plan_core inside vLLM's environment when there is one (vLLM timed alongside)."""
    if vllm_venv is not None and (vllm_venv / vs_vllm.READY_MARKER).exists():
        command = [str(vllm_venv / "bin" / "python"), "-m", "bench.plan_core", *argv]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
    return plan_core.main(argv)


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = [
        "## kvplan benchmarks: the targets of issue 11",
        "",
        f"{summary['date']} · {machine_line(summary['machine'])} · {summary['total_s']:,.0f} s"
        + (" · **quick mode: smoke-test scale, not figures**" if summary["quick"] else ""),
        "",
        "Ratios are to a baseline measured in the same run (alternating slices), repeated; "
        "median (min-max). How each figure is taken: "
        + ", ".join(f"[{name}.md]({name}.md)" for name in summary["programs"])
        + ".",
        "",
    ]
    rows = [
        {**target, "target": f"{name}: {target['target']}"}
        for name, program in summary["programs"].items()
        for target in program["targets"]
    ]
    lines += targets_table(rows)
    crashed = {name: p["error"] for name, p in summary["programs"].items() if p.get("error")}
    if crashed:
        lines += ["", "Programs that did not finish:", ""]
        lines += [f"- {name}: {error}" for name, error in crashed.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--only", nargs="+", choices=list(PROGRAMS), help="run these only")
    parser.add_argument(
        "--vllm-venv", type=Path, default=vs_vllm.DEFAULT_VLLM_VENV, help="vLLM 0.33's venv"
    )
    parser.add_argument("--no-vllm", dest="vllm_venv", action="store_const", const=None)
    args = parse_arguments(parser, argv)
    common = ["--results", str(args.results)] + (["--quick"] if args.quick else [])
    repeats = ["--repeats", str(args.repeats)] if args.repeats else []
    vllm = ["--vllm-venv", str(args.vllm_venv)] if args.vllm_venv else ["--no-vllm"]
    began = time.perf_counter()
    programs: dict[str, Any] = {}
    for name in args.only or list(PROGRAMS):
        print(f"\n=== {name} ===", flush=True)
        started = time.perf_counter()
        try:
            if name == "plan_core":
                code = run_plan_core(common, args.vllm_venv)
            else:
                extra = vllm if name == "vs_vllm" else []
                code = PROGRAMS[name]([*common, *repeats, *extra])
            result = json.loads((args.results / f"{name}.json").read_text())
            programs[name] = {"exit_code": code, "targets": result["targets"]}
            if code != 0:
                programs[name]["error"] = f"exit code {code}"
        except Exception as error:
            traceback.print_exc()
            programs[name] = {"targets": [], "error": f"{type(error).__name__}: {error}"}
        programs[name]["seconds"] = time.perf_counter() - started
    summary = {
        "benchmark": "summary",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "machine": machine_info(),
        "total_s": time.perf_counter() - began,
        "programs": programs,
    }
    markdown = summary_markdown(summary)
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.results / "summary.md").write_text(markdown)
    print("\n" + markdown)
    failed = any(t["pass"] is False for p in programs.values() for t in p["targets"])
    crashed = any(p.get("error") for p in programs.values())
    return 1 if crashed or (args.strict and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
