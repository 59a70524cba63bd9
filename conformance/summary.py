"""conformance/report.md: one row per release from conformance/reports/*.json.

Usage: python -m conformance.summary [--reports DIR --out FILE] (run by conformance/run
after every release; a fuzz campaign's reports are summed up beside them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path
from typing import Any

from conformance import scheduler_known
from conformance.scheduler_known import (
    FIRST,
    LATER,
    chunk_figures,
    known_by_engine,
    unexpected_disagreements,
)

HERE = Path(__file__).resolve().parent


def _campaign(reports: list[Path]) -> list[str]:
    """A line naming the seed and fuzz sections, for reports that are not the fixed
    check's (a fuzz campaign: `make fuzz`)."""
    metas = [json.loads(path.read_text())["meta"] for path in reports]
    campaigns = {(meta.get("seed"), json.dumps(meta.get("fuzz") or {})) for meta in metas}
    if not any(meta.get("fuzz") for meta in metas):
        return []
    described = "; ".join(
        f"seed {seed}, " + ", ".join(f"{name} {count}" for name, count in json.loads(fuzz).items())
        for seed, fuzz in sorted(campaigns, key=str)
    )
    return [f"Fuzz campaign (conformance/fuzz.py): {described}.", ""]


def _release(path: Path) -> str:
    return path.stem.removeprefix("scheduler-vllm-")


def scheduler_section(reports: list[Path], link_dir: Path) -> list[str]:
    """conformance/scheduler_probe.py's reports (scheduler-vllm-<release>.json): per
    release and chunk spec the probes and disagreements (first and later requests),
    how many of those are of a known open class (conformance/scheduler_known.py) and
    how many are not (each fails `make conformance`), the probes vLLM stalls in and
    the engines it fails on; then the known classes by engine, the unexpected
    disagreements and vLLM's failures by class. No lines without reports."""
    if not reports:
        return []
    loaded = {_release(path): json.loads(path.read_text()) for path in reports}
    lines = [
        "",
        "## Prefix caching against vLLM's scheduler (chunked prefill)",
        "",
        "`conformance/scheduler_probe.py` drives each release's v1 `Scheduler` with",
        "chunked prefill at each chunk size (`max_num_batched_tokens`: N tokens, or xF",
        "of the engine's coarsest block) and compares the tokens it serves from cache",
        "with kvplan's prediction, for the request sharing a prefix of a stored one",
        "(first) and, on Mamba / sliding-window hybrids, the request after it (later).",
        "A disagreement of a known open class (`conformance/scheduler_known.py`,",
        "docs/prefix-caching.md) is listed and does not fail `make conformance`; any",
        "other (unexpected) does. Stalls (vLLM's scheduler never finishes a request)",
        "and vLLM failures (engines its scheduler raises on) are vLLM's own.",
        "",
    ]
    sampled = {
        f"every {meta['stride']}-th engine from offset {meta['offset']}"
        for meta in (report["meta"] for report in loaded.values())
        if meta.get("stride", 1) > 1
    }
    if sampled:
        lines += [f"Engines: {'; '.join(sorted(sampled))} (`--stride`, `--offset`).", ""]
    lines += [
        "| vLLM | chunk | engines | probes | disagree | later probes | disagree later "
        "| known open | unexpected | stalls | vLLM failures | wall s (all chunks) | report |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for path in reports:
        report = loaded[_release(path)]
        meta = report["meta"]
        for i, f in enumerate(chunk_figures(report)):
            wall = f"{meta['seconds']:.1f}" if i == 0 else ""  # one run for all its chunks
            lines.append(
                f"| {meta['vllm']} | {f.chunk} | {f.engines} | {f.probes} | {f.disagree_first} "
                f"| {f.later_probes} | {f.disagree_later} | {f.known_first + f.known_later} "
                f"| {f.unexpected} | {f.stalls} | {f.vllm_failures} | {wall} "
                f"| [{path.name}]({(link_dir / path.name).as_posix()}) |"
            )
    lines += ["", "### Known open classes (not failing `make conformance`)", ""]
    by_release = {release: known_by_engine(report) for release, report in loaded.items()}
    if not scheduler_known.KNOWN_OPEN:
        lines.append("none")
    for entry in scheduler_known.KNOWN_OPEN:
        lines.append(f"- `{entry.name}`: {entry.reason}.")
        seen = False
        for release, by_class in by_release.items():
            for engine, probes in sorted(by_class.get(entry.name, {}).items()):
                seen = True
                detail = ", ".join(f"{key} {count}" for key, count in sorted(probes.items()))
                lines.append(f"  - vLLM {release}, `{engine}`: {detail}")
        if not seen:
            lines.append("  - no longer disagrees in these reports: delete the entry if fixed")
    unexpected = _unexpected_records(loaded)
    failing = {r: unexpected_disagreements(report) for r, report in loaded.items()}
    lines += ["", "### Unexpected disagreements (failing `make conformance`)", ""]
    if not any(failing.values()):
        lines.append("none")
    for release, count in failing.items():
        if count:
            lines.append(f"- vLLM {release}: {count} probes")
            lines += [f"  - {line}" for line in unexpected.get(release, [])[:20]]
    lines += ["", "### vLLM's own failures (scheduler probe, over all chunk sizes)", ""]
    failures = [
        f"- vLLM {release}: {count}x {failure}"
        for release, report in loaded.items()
        for failure, count in sorted(
            report.get("failure_classes", {}).items(), key=lambda kv: (-kv[1], kv[0])
        )
    ]
    lines += failures or ["none"]
    return lines


def _unexpected_records(loaded: dict[str, Any]) -> dict[str, list[str]]:
    """Per release, the recorded disagreements of no known class, one line each."""
    out: dict[str, list[str]] = {}
    for release, report in loaded.items():
        for r in report.get("disagreements", []):
            if r.get("known") is None:
                request = LATER if r.get("later") else FIRST
                out.setdefault(release, []).append(
                    f"`{r['id']}` chunk {r['chunk_spec']} ({r['chunk']} tokens), {request} "
                    f"request, {r['shared']} of {r['stored']} shared: the scheduler serves "
                    f"{r['scheduler']}, kvplan says {r['kvplan']}"
                )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=Path, default=HERE / "reports")
    parser.add_argument("--out", type=Path, default=HERE / "report.md")
    args = parser.parse_args(argv)
    reports = sorted(args.reports.glob("vllm-*.json"))
    link_dir = Path(os.path.relpath(args.reports, args.out.parent))
    lines = [
        "# kvplan vs each vLLM release's own planner: differential check",
        "",
        "`make conformance` plans every generated engine with kvplan in a release's rule",
        "set (`options.engine_version`) and with that release's own planner (CPU build,",
        "pinned by `conformance/locks/`). A documented deviation is one listed in",
        "`docs/semantics.md`; anything else is a disagreement. The `kvplan` row plans",
        "with kvplan's own rules (empty `engine_version`) against vLLM 0.33, which they",
        "extend: its differences are the deviations D1-D11. Per-release details:",
        f"`{Path(os.path.relpath(args.reports, HERE.parent)).as_posix()}/`.",
        "",
        *_campaign(reports),
        "| vLLM | kvplan rule set | cases | agree | deviation | disagree | wall s | report |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for path in reports:
        data = json.loads(path.read_text())
        meta, overall = data["meta"], data["summary"][-1]
        lines.append(
            f"| {meta['vllm']} | `{meta['rule_set']}` | {overall['total']} | {overall['agree']} "
            f"| {overall['deviation']} | {overall['disagree']} | {meta['seconds']:.1f} "
            f"| [{path.stem}.md]({(link_dir / path.stem).as_posix()}.md) |"
        )
    lines += [
        "",
        "## How often the releases answer differently",
        "",
        "Cases whose vLLM answers (groups, flags, blocks, tensors, lengths, warnings, error",
        "class and numbers) differ between two releases, per generator category: the",
        "generator reaches the rules that differ.",
        "",
    ]
    digests = {
        json.loads(path.read_text())["meta"]["vllm"]: json.loads(path.read_text()).get(
            "vllm_digests", {}
        )
        for path in reports
    }
    versions = sorted(digests)
    for first, second in itertools.pairwise(versions):
        common = set(digests[first]) & set(digests[second])
        differ = [case for case in common if digests[first][case] != digests[second][case]]
        by_category: dict[str, int] = {}
        for case in differ:
            category = case.split("/", 1)[0]
            by_category[category] = by_category.get(category, 0) + 1
        detail = ", ".join(f"{name} {count}" for name, count in sorted(by_category.items()))
        lines.append(
            f"- vLLM {first} vs {second}: {len(differ)} of {len(common)} cases differ ({detail})"
        )
    deviations: dict[str, int] = {}
    for path in reports:
        for outcome in json.loads(path.read_text())["outcomes"]:
            if outcome["status"] == "deviation":
                key = f"{path.stem}: {outcome['reason']}"
                deviations[key] = deviations.get(key, 0) + 1
    lines += ["", "## Documented deviations", ""]
    lines += [f"- {key} ({count} cases)" for key, count in sorted(deviations.items())] or ["none"]
    lines += scheduler_section(sorted(args.reports.glob("scheduler-vllm-*.json")), link_dir)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
