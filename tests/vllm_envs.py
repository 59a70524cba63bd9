"""The vLLM CPU environments the tests run vLLM's own code in (scripts/vllm-venv
builds them; `make test` does so first). A missing one fails the test, with how to
build it: these checks are never skipped."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

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


STUBS = Path(__file__).parent / "models" / "vllm_stubs"


def run_in_vllm(
    release: str,
    args: list[str],
    payload: object = None,
    *,
    cache_root: Path | None = None,
    timeout: float = 280,
) -> Any:
    """Run `args` (a script's path, or ["-c", code]) with vLLM `release`'s Python,
    `payload` as JSON on its stdin; its last stdout line, read as JSON.

    `cache_root`: a VLLM_CACHE_ROOT of the test's own (the releases would overwrite
    each other's model-info cache) and tests/models/vllm_stubs on the path (inert
    stand-ins for modules the CPU venvs lack and the model builds never use)."""
    env = None
    if cache_root is not None:
        path = os.pathsep.join(filter(None, [str(STUBS), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root / "vllm-cache"), "PYTHONPATH": path}
    result = subprocess.run(
        [str(vllm_python(release)), *args],
        input=None if payload is None else json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
