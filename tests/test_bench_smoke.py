"""The benchmarks run end to end at smoke-test scale and write well-formed results.

No timing is asserted (a shared CI host says nothing about speed): this keeps the
benchmark programs from rotting between the runs that produce the published figures.
vLLM's side is left out (--no-vllm; CI has no vLLM environment), so its targets must
read NOT RUN rather than pass or fail.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = (
    "rpc",
    "cpu_breakdown",
    "vs_vllm",
    "leases",
    "large_request",
    "scaling",
    "long_run",
    "plan_core",
)
VERDICTS = {"PASS", "FAIL", "NOT RUN"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bench-results")
    # One repeat: each program's repeat loop and spreads still run, in about 15 s.
    command = [sys.executable, "-m", "bench", "--quick", "--no-vllm", "--repeats", "1"]
    command += ["--results", str(folder)]
    completed = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return folder


def load(folder: Path, name: str) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((folder / f"{name}.json").read_text())
    return report


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def test_every_program_writes_json_and_markdown(results: Path) -> None:
    summary = load(results, "summary")
    assert set(summary["programs"]) == set(PROGRAMS)
    assert all("error" not in program for program in summary["programs"].values())
    for name in PROGRAMS:
        report = load(results, name)
        assert report["quick"] is True
        markdown = (results / f"{name}.md").read_text()
        assert markdown.startswith("## ")
        assert "quick mode" in markdown
    summary_markdown = (results / "summary.md").read_text()
    rows = [line for line in summary_markdown.splitlines() if line.startswith("| ")]
    targets = sum(len(program["targets"]) for program in summary["programs"].values())
    assert len(rows) == 1 + targets  # the header and one row per target


def test_targets_are_well_formed(results: Path) -> None:
    for name in PROGRAMS:
        for target in load(results, name)["targets"]:
            assert target["target"] and target["measured"]
            assert target["verdict"] in VERDICTS
            expected = {None: "NOT RUN", True: "PASS", False: "FAIL"}[target["pass"]]
            assert target["verdict"] == expected
    # Measured without vLLM: its targets are not run, never passed or failed.
    vs_vllm = load(results, "vs_vllm")
    assert [t["verdict"] for t in vs_vllm["targets"]] == ["NOT RUN", "NOT RUN"]
    for row in vs_vllm["engines"]:
        for column in ("kvplan", "new_model", "known_content", "echo"):  # kvplan: the target
            assert finite(row[f"{column}_round_trip_p50_ms"]["median"]), (row["engine"], column)
    vs_vllm_markdown = (results / "vs_vllm.md").read_text()
    assert "new model p50 ms (informational)" in vs_vllm_markdown
    assert "known content p50 ms (informational)" in vs_vllm_markdown
    # What each program promises to measure is there.
    expected_targets = {
        "rpc": 5,
        "cpu_breakdown": 0,
        "vs_vllm": 2,
        "leases": 3,
        "scaling": 2,
        "long_run": 4,
    }
    for name, count in expected_targets.items():
        assert len(load(results, name)["targets"]) == count, name


def test_cpu_breakdown_adds_up(results: Path) -> None:
    runs = load(results, "cpu_breakdown")["runs"]
    assert set(runs) == {"plan, memory store", "plan, SQLite store", "Echo"}
    for name, figures in runs.items():
        median = {key: figure["median"] for key, figure in figures.items()}
        assert all(finite(value) for value in median.values()), name
        assert 0 < median["in the handler"] < median["event-loop thread"], name
        assert median["event-loop thread"] <= median["server, all threads"], name
    plan = {key: figure["median"] for key, figure in runs["plan, SQLite store"].items()}
    assert 0 < plan["planning"] < plan["in the handler"]
    assert plan["store hand-off"] > 0


def test_headline_figures(results: Path) -> None:
    rpc = load(results, "rpc")
    rows = rpc["load"]
    variants = ("echo", "plan uncached", "plan new model", "plan known content", "plan cached")
    assert sorted((row["engine"], row["concurrency"], row["variant"]) for row in rows) == sorted(
        (engine, concurrency, variant)
        for engine in ("qwen3-next-tp8", "gemma-64l-tp1")
        for concurrency in (1, 16)
        for variant in variants
    )
    for row in rows:
        assert row["calls"]["median"] > 0, row
        assert row["errors"]["high"] == 0, row
        assert finite(row["server_cpu_us_per_call"]["median"]), row
        assert len(row["throughput_rps"]["values"]) == rpc["settings"]["repeats"]
        if row["variant"] != "echo":
            ratio = row["throughput_over_echo"]
            assert ratio["low"] <= ratio["median"] <= ratio["high"]
    assert rpc["rendezvous"]["errors"] == 0 and rpc["rendezvous"]["consistent"]
    # One plan per rendezvous engine in every repeat: each engine's ranks carried its
    # own content, and each repeat its own engines.
    runs = rpc["rendezvous"]["runs"]
    assert len(runs) == len(rpc["rendezvous"]["wall_s"]["values"]) == rpc["settings"]["repeats"]
    assert all(run["distinct_plan_ids"] == run["engines"] == 16 for run in runs), runs
    # The targets are judged on fresh content; new models and known content are said
    # apart from them.
    assert all("new content" in target["target"] for target in rpc["targets"][:2])
    rpc_markdown = (results / "rpc.md").read_text()
    assert "Informational, not a target: plan known content" in rpc_markdown
    assert "Informational, not a target: plan new model" in rpc_markdown
    assert all(f"| {variant} |" in rpc_markdown for variant in variants)


def test_long_run_leases_and_scaling_figures(results: Path) -> None:
    long_run = load(results, "long_run")
    windows = long_run["windows"]
    assert [w["plans"] for w in windows] == [100, 200, 300]
    for window in windows:
        assert window["sqlite_bytes"] > 0 and window["metrics_bytes"] > 0
        assert finite(window["cpu_us_per_plan"]["median"]) and window["rss_mb"] > 0

    leases = load(results, "leases")
    assert [level["live_leases"] for level in leases["levels"]] == [10, 50, 200]
    for stall in leases["stalls"]:
        # The stall reached the store: the calls that need it waited for it.
        assert stall["store_bound_min_wait_s"] >= 0.8 * stall["held_s"]

    scaling = load(results, "scaling")
    for kind in ("pp", "tp"):
        assert finite(scaling["scaling"][kind]["slope"]["median"])
        assert [row["workers"] for row in scaling["scaling"][kind]["by_workers"]] == [8, 16, 32]

    plan_core = load(results, "plan_core")
    assert plan_core["core_only"] is True and plan_core["by_layers"]


def test_large_request_figures(results: Path) -> None:
    """Even at smoke scale the request is over LARGE_MESSAGE_BYTES (the path measured)."""
    from kvplan.server.large_messages import LARGE_MESSAGE_BYTES

    report = load(results, "large_request")
    assert report["request_bytes"] > LARGE_MESSAGE_BYTES
    for name in ("large_s", "worst_during_ms", "worst_control_ms"):
        assert report["figures"][name]["median"] > 0
    assert finite(report["added_ms"]["median"])


def test_interleaved_compare_reads_both_benchmarks(results: Path, tmp_path: Path) -> None:
    """bench.interleaved's table from the smoke run's own results, as two trees and two
    rounds: every row of plan_core and the uncached rows of rpc, each tree against the
    first (here the same figures, so each ratio is 1)."""
    import shutil

    from bench.interleaved import compare

    for label in ("base", "new"):
        for round_ in (1, 2):
            for name in ("core", "rpc"):
                folder = tmp_path / f"{label}-{name}-{round_}"
                folder.mkdir()
                source = "plan_core.json" if name == "core" else "rpc.json"
                shutil.copy(results / source, folder / source)
    table = compare(tmp_path, ["base", "new"])
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    core_rows = [row for row in rows[1:] if not row.startswith("| rpc")]
    rpc_rows = [row for row in rows if row.startswith("| rpc uncached")]
    plan_core = load(results, "plan_core")
    assert len(core_rows) == 2 * len(plan_core["by_layers"] + plan_core["by_workers"])
    assert len(rpc_rows) == 3 * 4  # 2 engines x concurrency 1, 16; 3 figures each
    assert all(row.endswith("**1.000** |") for row in core_rows + rpc_rows), table
    assert "plan_core {'base': 2, 'new': 2}, rpc_bench {'base': 2, 'new': 2}" in table
