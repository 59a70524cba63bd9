"""The custom all-reduce rule kvplan's non-torch figure follows (weights.py
`non_torch_bytes`), from vLLM's own CustomAllreduce constructor in each release's CPU
venv (tests/models/vllm_custom_ar_side.py): more than two GPUs not all NVLink-connected
turn it off; two GPUs, or every pair on NVLink, go on to the P2P check."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplan.gpus import CATALOG
from kvplan.models.weights import PROFILES, non_torch_bytes
from tests.vllm_envs import run_in_vllm

SIDE = Path(__file__).parent / "vllm_custom_ar_side.py"
CASES = [(4, False), (6, False), (8, False), (2, False), (4, True), (8, True)]
OFF = "off: not NVLink-connected"


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_custom_all_reduce_is_off_on_more_than_two_gpus_without_nvlink(release: str) -> None:
    decisions = run_in_vllm(release, [str(SIDE)], [list(case) for case in CASES])
    for (world_size, nvlink), decision in zip(CASES, decisions, strict=True):
        off = world_size > 2 and not nvlink
        assert decision == (OFF if off else "on to the P2P check"), (world_size, nvlink)
    # kvplan: on a part without NVLink (NVML reports no NVLink P2P for any pair) the
    # non-torch figure is the TP 1 one exactly where vLLM turned custom all-reduce off.
    rules = PROFILES["v1"]
    pcie_parts = [gpu.name for gpu in CATALOG if gpu.pcie_only]
    assert pcie_parts
    for world_size, nvlink in CASES:
        expected = rules.non_torch_single_gpu if world_size > 2 and not nvlink else (
            rules.non_torch_tensor_parallel)  # fmt: skip
        assert non_torch_bytes(rules, world_size, pcie_only_gpu=not nvlink) == expected
