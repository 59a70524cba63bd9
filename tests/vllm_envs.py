"""The vLLM CPU environments the tests run vLLM's own code in (scripts/vllm-venv
builds them; `make test` does so first). A missing one fails the test, with how to
build it: these checks are never skipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

VLLM_CACHE = Path(os.environ.get("KVPLAN_VLLM_CACHE", Path.home() / ".cache" / "kvplan"))


def vllm_python(release: str) -> Path:
    """The Python of vLLM `release` ("0.33")'s CPU environment."""
    venv = VLLM_CACHE / f"vllm-{release}" / "venv"
    if not (venv / ".kvplan-vllm-ready").exists():
        pytest.fail(
            f"the vLLM {release} CPU venv is missing ({venv}); build it with "
            f"`scripts/vllm-venv {release}` (make test does)"
        )
    return venv / "bin" / "python"
