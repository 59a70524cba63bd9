"""The public calibration set (tests/data/calibration) and its error table.

Each record is a `.log` (lines copied verbatim from a public vLLM startup log) and a
`.json` naming its source, the shipped model config, the GPU and any vLLM flag the log
does not state. `kvplan calibrate` is run on every record; the table in
docs/capacity.md is this module's output (`scripts/calibration-table --write`), and a
test keeps the two equal.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "calibration"
BEGIN = "<!-- calibration-table:begin (scripts/calibration-table --write) -->"
END = "<!-- calibration-table:end -->"
AVAILABLE = "available KV cache memory per worker"
NON_KV = "non-KV memory (utilization x total - available)"
WEIGHTS = "model loading (weights) per worker"
GRAPH_ESTIMATE = "CUDA-graph estimate the release logged"


@dataclass(frozen=True)
class RecordResult:
    name: str
    meta: dict[str, Any]
    release: str
    rows: dict[str, dict[str, Any]]  # calibrate's rows by figure

    def row(self, prefix: str) -> dict[str, Any] | None:
        return next((row for figure, row in self.rows.items() if figure.startswith(prefix)), None)

    @property
    def available_error(self) -> float | None:
        row = self.row(AVAILABLE)
        return row["error"] if row is not None else None


def record_names() -> list[str]:
    return sorted(path.stem for path in RECORDS.glob("*.json"))


def run_record(name: str) -> RecordResult:
    """`kvplan calibrate --json` on one record (the CLI path a user runs)."""
    from kvplan.cli import main

    meta: dict[str, Any] = json.loads((RECORDS / f"{name}.json").read_text())
    args = ["calibrate", str(RECORDS / f"{name}.log"), "--model", str(ROOT / meta["model"])]
    args += ["--gpu", str(meta["gpu"]), *meta.get("flags", []), "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    if code != 0:
        raise RuntimeError(f"calibrate failed on {name} (exit {code})")
    result = json.loads(out.getvalue())
    rows = {row["figure"]: row for row in result["rows"]}
    release = result["release"] or ("V0 engine" if result.get("engine") == "v0" else "")
    return RecordResult(name, meta, release, rows)


def run_all() -> list[RecordResult]:
    return [run_record(name) for name in record_names() if json.loads(
        (RECORDS / f"{name}.json").read_text()).get("model")]  # fmt: skip


def _gib(value: float | None) -> str:
    return "–" if value is None else f"{value:,.2f}"


def _tokens(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _error(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1%}".replace("-", "−")


def _source(url: str) -> str:
    link = url.split(" ")[0]
    if "llm-d-planner" in link:
        label = "llm-d-planner " + link.rsplit("/", 1)[-1].removesuffix(".log")[:28] + "…"
    elif link.startswith("code-index:"):
        # A public repository's file the code index found without naming its repository.
        return f"public file, code index id {link.removeprefix('code-index:')}"
    elif "/blob/" in link:
        # A repository's file at a commit: owner/name path@commit.
        repo, rest = link.split("github.com/")[1].split("/blob/", 1)
        commit, path = rest.split("/", 1)
        label = f"{repo} {path}@{commit[:7]}"
    elif "/issues/" in link or "/pull/" in link:
        kind = "/issues/" if "/issues/" in link else "/pull/"
        repo = link.split("github.com/")[1].split(kind)[0].split("/")[-1]
        label = f"{repo}#{link.rsplit('/', 1)[-1]}"
    else:
        label = link
    return f"[{label}]({link})"


def table(results: list[RecordResult]) -> str:
    lines = [
        "| Record | Release | Role | Weights log / kvplan | Graph estimate log / kvplan "
        "| Non-KV log / kvplan | Available KV log / kvplan (GiB) | Error | KV tokens log / "
        "kvplan (the release's formula) | Error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        meta = result.meta
        available = result.row(AVAILABLE) or {}
        non_kv = result.row(NON_KV) or {}
        weights = result.row(WEIGHTS) or {}
        graphs = result.row(GRAPH_ESTIMATE) or {}
        printed = [
            row
            for figure, row in result.rows.items()
            if figure.startswith("KV cache tokens, ") and "(printed by" in figure
        ]
        tokens = printed[0] if printed else result.row("KV cache tokens, int(") or {}
        role = str(meta.get("role", "check"))
        if not meta.get("config_known"):
            role += ", config not fully known"
        cells = [
            f"{result.name} ({_source(str(meta['source']))})",
            result.release or "not logged",
            role,
            f"{_gib(weights.get('measured'))} / {_gib(weights.get('predicted'))}",
            f"{_gib(graphs.get('measured'))} / {_gib(graphs.get('predicted'))}",
            f"{_gib(non_kv.get('measured'))} / {_gib(non_kv.get('predicted'))}",
            f"{_gib(available.get('measured'))} / {_gib(available.get('predicted'))}",
            _error(available.get("error")),
            f"{_tokens(tokens.get('measured'))} / {_tokens(tokens.get('predicted'))}",
            _error(tokens.get("error")) if tokens.get("measured") is not None else "–",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def docs_section(text: str) -> str:
    """The generated part of docs/capacity.md (between the markers)."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def write_docs(path: Path, generated: str) -> None:
    text = path.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:start] + "\n" + generated + "\n" + text[end:])
