"""deploy/prometheus/kvplan-rules.yaml through promtool (Debian's `prometheus`
package): the file is valid, every alert fires and resolves in the unit tests
(tests/deploy/kvplan-rules.test.yaml), and every alert has its runbook."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.deploy.parsing import ROOT
from tests.deploy.tools import RULES_FILE, RULES_TESTS, debian_prometheus_binary

KUBERNETES_DOC = ROOT / "docs" / "kubernetes.md"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [debian_prometheus_binary("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def alert_names() -> list[str]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", str(RULES_FILE))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in checked.stdout


def test_every_alert_fires_and_resolves_in_the_unit_tests() -> None:
    tested = promtool("test", "rules", str(RULES_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Each alert is expected to fire (exp_alerts with entries) and to be quiet again
    # later (an empty exp_alerts at a later time) somewhere in the unit tests.
    fired: dict[str, list[int]] = {}
    quiet: dict[str, list[int]] = {}
    for case in yaml.safe_load(RULES_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            minutes = int(check["eval_time"].removesuffix("m"))
            (fired if check["exp_alerts"] else quiet).setdefault(check["alertname"], []).append(
                minutes
            )
    for name in alert_names():
        assert name in fired, f"{name} is never expected to fire"
        assert any(q > min(fired[name]) for q in quiet.get(name, [])), f"{name} never resolves"


def test_every_alert_has_a_runbook_section() -> None:
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", KUBERNETES_DOC.read_text(), re.MULTILINE)
    }
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            runbook = rule["annotations"]["runbook"]
            assert runbook == f"docs/kubernetes.md#{rule['alert'].lower()}"
            assert rule["alert"].lower() in anchors, f"docs/kubernetes.md lacks ### {rule['alert']}"
