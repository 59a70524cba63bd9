"""Is one commit slower than another? bench.plan_core and the uncached rows of
bench.rpc_bench, run in turn in each tree's own .venv, the order rotated every round,
so that every tree sees the same busy machine; then the median and range per tree and
each median over the first tree's.

    python -m bench.interleaved run OUT base=../kvplan-e83fa37 new=. --rounds 5 --only core
    python -m bench.interleaved run OUT base=../kvplan-e83fa37 new=. --rounds 3 --only rpc
    python -m bench.interleaved compare OUT base new      # a markdown table

Each tree is a checkout with `make install` done. Results stay under OUT
(OUT/LABEL-core-ROUND/plan_core.json, OUT/LABEL-rpc-ROUND/rpc.json). Issue 32's figures:
bench/results/issue-32-no-slower.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

CORE_FLAGS = ["--max-layers", "1024", "--max-workers", "64"]
# One repeat per round (the rounds are the repeats), a small rendezvous: only the
# uncached rows are compared.
RPC_FLAGS = ["--repeats", "1", "--engines", "32"]
RPC_FIGURES = (  # of rpc.json's "plan uncached" rows: (key, name, digits)
    ("throughput_rps", "req/s", 0),
    ("throughput_over_echo", "× Echo", 2),
    ("server_cpu_us_per_call", "server µs CPU/plan", 0),
)


def run(out: Path, trees: dict[str, Path], rounds: int, only: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    labels = list(trees)
    for round_ in range(1, rounds + 1):
        shift = (round_ - 1) % len(labels)
        for label in labels[shift:] + labels[:shift]:
            tree, python = trees[label], str(trees[label] / ".venv" / "bin" / "python")
            if only in ("core", "both"):
                flags = [*CORE_FLAGS, "--results", str(out / f"{label}-core-{round_}")]
                subprocess.run(
                    [python, "-m", "bench.plan_core", *flags],
                    cwd=tree,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
            if only in ("rpc", "both"):
                flags = [*RPC_FLAGS, "--results", str(out / f"{label}-rpc-{round_}")]
                with open(out / f"{label}-rpc-{round_}.log", "w") as log:
                    subprocess.run(
                        [python, "-m", "bench.rpc_bench", *flags],
                        cwd=tree,
                        check=True,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
            print(f"round {round_} {label} done", flush=True)


def _cell(values: list[float], base: float, digits: int) -> str:
    median = statistics.median(values)
    return (
        f"{median:,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f}) "
        f"**{median / base:.3f}**"
    )


def compare(out: Path, labels: list[str]) -> str:
    core: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for label in labels:
        for path in sorted(out.glob(f"{label}-core-*/plan_core.json")):
            report = json.loads(path.read_text())
            for row in report["by_layers"] + report["by_workers"]:
                for metric in ("core_us", "wire_us"):
                    core[(row["case"], metric)][label].append(float(row[metric]))
    rpc: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for label in labels:
        for path in sorted(out.glob(f"{label}-rpc-*/rpc.json")):
            for row in json.loads(path.read_text())["load"]:
                if row["variant"] == "plan uncached":
                    case = f"rpc uncached {row['engine']} c={row['concurrency']}"
                    for key, _, _ in RPC_FIGURES:
                        rpc[(case, key)][label].extend(float(v) for v in row[key]["values"])
    head = " | ".join(f"{label}: median (range) **/ {labels[0]}**" for label in labels)
    lines = [f"| case | metric | {head} |", "|---|---|" + "---:|" * len(labels)]
    for (case, metric), by in core.items():
        if all(by[label] for label in labels):
            base = statistics.median(by[labels[0]])
            cells = " | ".join(_cell(by[label], base, 0) for label in labels)
            lines.append(f"| {case} | {metric.replace('_us', ' µs')} | {cells} |")
    names = {key: (name, digits) for key, name, digits in RPC_FIGURES}
    for (case, key), by in rpc.items():
        if all(by[label] for label in labels):
            name, digits = names[key]
            base = statistics.median(by[labels[0]])
            cells = " | ".join(_cell(by[label], base, digits) for label in labels)
            lines.append(f"| {case} | {name} | {cells} |")
    counts = {label: len(list(out.glob(f"{label}-core-*/plan_core.json"))) for label in labels}
    rpc_counts = {label: len(list(out.glob(f"{label}-rpc-*/rpc.json"))) for label in labels}
    lines.append("")
    lines.append(f"rounds: plan_core {counts}, rpc_bench {rpc_counts}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("out", type=Path)
    run_parser.add_argument("trees", nargs="+", help="LABEL=PATH, the first is the baseline")
    run_parser.add_argument("--rounds", type=int, default=3)
    run_parser.add_argument("--only", choices=("core", "rpc", "both"), default="both")
    compare_parser = commands.add_parser("compare")
    compare_parser.add_argument("out", type=Path)
    compare_parser.add_argument("labels", nargs="+", help="the first is the baseline")
    args = parser.parse_args(argv)
    if args.command == "run":
        trees = {}
        for item in args.trees:
            label, _, path = item.partition("=")
            trees[label] = Path(path).resolve()
        run(args.out, trees, args.rounds, args.only)
    else:
        print(compare(args.out, args.labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
