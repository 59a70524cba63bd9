"""The custom all-reduce rule kvplan's non-torch figure follows (profiling.py
`custom_all_reduce_on`, `non_torch_bytes`), from vLLM's own argparse, worker switch and
CustomAllreduce constructor in each release's CPU venv (tests/models/vllm_custom_ar_side.py):
--disable-custom-all-reduce builds none; a TP size outside 2, 4, 6, 8, 16 and more than
two GPUs not all NVLink-connected turn it off; the rest go on to the P2P check."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplan.cli import build_parser
from kvplan.gpus import CATALOG
from kvplan.models.cli import options_from_args
from kvplan.models.profiling import PROFILES, custom_all_reduce_on, non_torch_bytes
from tests.vllm_envs import run_in_vllm

SIDE = Path(__file__).parent / "vllm_custom_ar_side.py"
MODEL = Path(__file__).parents[2] / "examples" / "models" / "qwen3.6-27b"
FLAG = ["--disable-custom-all-reduce"]
# (world size, every pair NVLink-connected, vllm serve flags)
CASES: list[tuple[int, bool, list[str]]] = [
    (4, False, []), (6, False, []), (8, False, []), (2, False, []), (4, True, []),
    (8, True, []), (3, True, []), (5, False, []), (12, True, []),
    (2, False, FLAG), (2, True, FLAG), (8, True, FLAG),
]  # fmt: skip
OFF_PCIE = "off: not NVLink-connected"
ON = "on to the P2P check"


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_custom_all_reduce_decision_matches_vllm(release: str) -> None:
    decisions = run_in_vllm(release, [str(SIDE)], [list(case) for case in CASES])
    parser = build_parser()
    rules = PROFILES["v1"]
    assert [gpu.name for gpu in CATALOG if gpu.pcie_only]  # parts the PCIe rule covers
    for (world_size, nvlink, argv), decision in zip(CASES, decisions, strict=True):
        case = (world_size, nvlink, argv)
        # vLLM's reason, where it turned custom all-reduce off
        if argv:
            assert decision == "off: flag", case
        elif world_size not in (2, 4, 6, 8, 16):
            assert decision.startswith("off: ") and "unsupported world size" in decision, case
        elif world_size > 2 and not nvlink:
            assert decision == OFF_PCIE, case
        else:
            assert decision == ON, case
        # kvplan, reading the same flags with its own parser: custom all-reduce on
        # exactly where vLLM goes on to the P2P check (which kvplan assumes passes), and
        # the TP non-torch figure only there.
        args = parser.parse_args(["plan", "--model", str(MODEL), *argv])
        flag = options_from_args(args).disable_custom_all_reduce
        on = custom_all_reduce_on(world_size, pcie_only_gpu=not nvlink, disabled=flag)
        assert on == (decision == ON), case
        expected = rules.non_torch_tensor_parallel if on else rules.non_torch_single_gpu
        assert non_torch_bytes(rules, on) == expected
