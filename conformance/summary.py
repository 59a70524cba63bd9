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
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
