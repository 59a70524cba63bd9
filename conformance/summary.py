"""conformance/report.md: one row per release from conformance/reports/*.json.

Usage: python -m conformance.summary (run by conformance/run after every release).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    reports = sorted((HERE / "reports").glob("vllm-*.json"))
    lines = [
        "# kvplan vs each vLLM release's own planner: differential check",
        "",
        "`make conformance` plans every generated engine with kvplan in a release's rule",
        "set (`options.engine_version`) and with that release's own planner (CPU build,",
        "pinned by `conformance/locks/`). A documented deviation is one listed in",
        "`docs/semantics.md`; anything else is a disagreement. Per-release details:",
        "`conformance/reports/`.",
        "",
        "| vLLM | kvplan rule set | cases | agree | deviation | disagree | wall s | report |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for path in reports:
        data = json.loads(path.read_text())
        meta, overall = data["meta"], data["summary"][-1]
        lines.append(
            f"| {meta['vllm']} | `{meta['rule_set']}` | {overall['total']} | {overall['agree']} "
            f"| {overall['deviation']} | {overall['disagree']} | {meta['seconds']:.1f} "
            f"| [{path.stem}.md](reports/{path.stem}.md) |"
        )
    deviations: dict[str, int] = {}
    for path in reports:
        for outcome in json.loads(path.read_text())["outcomes"]:
            if outcome["status"] == "deviation":
                key = f"{path.stem}: {outcome['reason']}"
                deviations[key] = deviations.get(key, 0) + 1
    lines += ["", "## Documented deviations", ""]
    lines += [f"- {key} ({count} cases)" for key, count in sorted(deviations.items())] or ["none"]
    (HERE / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
