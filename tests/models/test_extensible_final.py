"""vLLM 0.34's extensible KV cache sized after warm-up (kvplan/models/extensible.py):
the rule against vLLM 0.34's own `measure_kv_cache_bytes` in its CPU venv, the start-up
figure against the calibration logs, and the plans a 0.34 deployment gets."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan.cli import main
from kvplan.core.extensible import blocks_within
from kvplan.gpus import lookup_gpu
from kvplan.models import load_config
from kvplan.models.config import ModelConfigError
from kvplan.models.extensible import (
    KV_CACHE_MARGIN_FLOOR_BYTES,
    KV_CACHE_MARGIN_FRACTION,
    STARTUP_RESERVED_ONE_GPU_BYTES,
    STARTUP_RESERVED_SEVERAL_GPUS_BYTES,
    measured_kv_cache_bytes,
)
from kvplan.models.request import (
    ModelPlanOptions,
    build_plan_request,
    extensible_cache_on,
    extensible_setting,
)
from tests.vllm_envs import run_in_vllm

ROOT = Path(__file__).parents[2]
MODELS = ROOT / "examples" / "models"
CALIBRATION = ROOT / "tests" / "data" / "calibration"
GIB = 1 << 30

# Runs in vLLM 0.34's venv: each case answered by its own measure_kv_cache_bytes, with
# the module's own margin constants (CUDA), and again with the module reloaded as on
# ROCm (its floor is decided at import from current_platform.is_rocm()).
VLLM_0_34_SIDE = """
import importlib, json, sys
import vllm.platforms
import vllm.v1.worker.extensible_kv_cache as E
payload = json.load(sys.stdin)

def answer(module):
    return [module.measure_kv_cache_bytes(**case) for case in payload["cases"]]

out = {"floor": E.KV_CACHE_MARGIN_FLOOR_BYTES, "fraction": E.KV_CACHE_MARGIN_FRACTION,
       "cuda": answer(E)}
type(vllm.platforms.current_platform).is_rocm = lambda self: True
E = importlib.reload(E)
out["rocm_floor"] = E.KV_CACHE_MARGIN_FLOOR_BYTES
out["rocm"] = answer(E)
print(json.dumps(out))
"""

# A measurement after warm-up, in vLLM's terms (bytes).
_size = st.integers(min_value=0, max_value=200 * GIB)


@st.composite
def measurements(draw: st.DrawFn) -> dict[str, int]:
    """init_free, the engine's non-KV use, the committed prefix (free is what is left),
    the budget (below or above init_free), the transient and the reservation growth."""
    init_free = draw(_size)
    non_kv_used = draw(st.integers(min_value=0, max_value=init_free))
    committed = draw(st.integers(min_value=0, max_value=init_free - non_kv_used))
    return {
        "init_free_memory": init_free,
        "free_memory": init_free - non_kv_used - committed,
        "committed_bytes": committed,
        "requested_memory": draw(st.integers(min_value=0, max_value=2 * init_free + GIB)),
        "transient_peak_bytes": draw(st.integers(min_value=0, max_value=40 * GIB)),
        "torch_reserve_growth_bytes": draw(st.integers(min_value=0, max_value=40 * GIB)),
    }


# Edges: each bound binding, the margin's floor and its 0.75 share (a 1 GiB floor is
# exactly 0.75 x 4/3 GiB), the growth above the transient, nothing left.
EDGES = [
    {"init_free_memory": 78 * GIB, "free_memory": 60 * GIB, "committed_bytes": 2 * GIB,
     "requested_memory": 80 * GIB, "transient_peak_bytes": 2 * GIB,
     "torch_reserve_growth_bytes": 0},
    {"init_free_memory": 78 * GIB, "free_memory": 60 * GIB, "committed_bytes": 2 * GIB,
     "requested_memory": 71 * GIB, "transient_peak_bytes": 2 * GIB,
     "torch_reserve_growth_bytes": 3 * GIB},
    {"init_free_memory": 78 * GIB, "free_memory": 60 * GIB, "committed_bytes": 0,
     "requested_memory": 77 * GIB, "transient_peak_bytes": 4 * GIB // 3,
     "torch_reserve_growth_bytes": 0},
    {"init_free_memory": 10 * GIB, "free_memory": 1 * GIB, "committed_bytes": 0,
     "requested_memory": 10 * GIB, "transient_peak_bytes": 0,
     "torch_reserve_growth_bytes": 0},
    {"init_free_memory": 0, "free_memory": 0, "committed_bytes": 0,
     "requested_memory": 0, "transient_peak_bytes": 0, "torch_reserve_growth_bytes": 0},
]  # fmt: skip


def ours(case: dict[str, int], platform: str) -> int:
    return measured_kv_cache_bytes(
        requested_bytes=case["requested_memory"],
        init_free_bytes=case["init_free_memory"],
        # Everything resident after warm-up but the committed KV prefix.
        non_kv_used_bytes=case["init_free_memory"] - case["free_memory"] - case["committed_bytes"],
        transient_peak_bytes=case["transient_peak_bytes"],
        torch_reserve_growth_bytes=case["torch_reserve_growth_bytes"],
        platform=platform,
    )


def check_against_vllm(cases: list[dict[str, int]], tmp_path: Path) -> None:
    answer = run_in_vllm("0.34", ["-c", VLLM_0_34_SIDE], {"cases": cases}, cache_root=tmp_path)
    assert answer["floor"] == KV_CACHE_MARGIN_FLOOR_BYTES["cuda"]
    assert answer["rocm_floor"] == KV_CACHE_MARGIN_FLOOR_BYTES["rocm"]
    assert answer["fraction"] == KV_CACHE_MARGIN_FRACTION
    assert [ours(case, "cuda") for case in cases] == answer["cuda"]
    assert [ours(case, "rocm") for case in cases] == answer["rocm"]


def test_the_rule_is_vllm_0_34s_on_its_edges(tmp_path: Path) -> None:
    check_against_vllm(EDGES, tmp_path)
    # The edges do reach each branch: the budget, the device, the growth, zero.
    assert [ours(case, "cuda") for case in EDGES] == [
        62 * GIB - 3 * GIB // 2 - 2 * GIB,  # the device: headroom - margin 0.75 x 2 GiB
        71 * GIB - 16 * GIB - 3 * GIB,  # the budget, less the growth
        59 * GIB - 4 * GIB // 3,  # both bounds 59 GiB (the 1 GiB floor over 0.75 x 4/3 GiB)
        0,  # 10 - 9 - 1 GiB margin
        0,
    ]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases=st.lists(measurements(), min_size=150, max_size=150))
def test_the_rule_is_vllm_0_34s(cases: list[dict[str, int]], tmp_path_factory: Any) -> None:
    check_against_vllm(cases, tmp_path_factory.mktemp("vllm"))


STARTUP_LINE = re.compile(r"Free memory on device \(([\d.]+)/([\d.]+) GiB\) on startup")


def _startup_reserved(log: Path) -> float | None:
    """total - free at the worker's start, as the log prints them (None: no such line)."""
    found = STARTUP_LINE.search(log.read_text())
    if found is None:
        return None
    free, total = found.groups()
    return round(float(total) - float(free), 2)


def test_the_startup_figures_are_the_logs() -> None:
    # One H100 at vLLM 0.19: 0.51 GiB not free at start in every such log; TP 4 of a
    # dense model: 1.55 GiB (kvplan/models/extensible.py lists the rest).
    one = [
        figure
        for log in sorted(CALIBRATION.glob("*-h100-*llmd-v0.19.log"))
        if not re.search(r"-(tp|pp)\d", log.name) and (figure := _startup_reserved(log)) is not None
    ]
    assert len(one) >= 10 and set(one) == {round(STARTUP_RESERVED_ONE_GPU_BYTES / GIB, 2)}
    tp4 = _startup_reserved(CALIBRATION / "qwen2.5-7b-instruct-h100-tp4-llmd-v0.19.log")
    assert tp4 == round(STARTUP_RESERVED_SEVERAL_GPUS_BYTES / GIB, 2)


def _plan(*flags: str) -> dict[str, Any]:
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100-80GB", "--json"]
    plan: dict[str, Any] = json.loads(_run([*args, "--engine-version", "vllm-0.34", *flags]))
    return plan


def _run(args: list[str]) -> str:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(args) == 0
    return buffer.getvalue()


def test_a_0_34_plan_on_an_h100_gives_the_final_tokens() -> None:
    # Llama-3.1-8B on one H100 at 0.34's defaults: the plan's blocks and tokens are the
    # cache after warm-up, under the reservation made before it.
    plan = _plan()
    assert plan["plan_stage"] == "PLAN_STAGE_EXTENSIBLE_FINAL"
    (sizing,) = plan["extensible_final_sizing"]
    capacity, worker = plan["capacity"], plan["workers"][0]
    total = lookup_gpu("H100-80GB").total_memory_bytes
    reserved = worker["budget"]["available_bytes"]
    # Before warm-up: ceil(total x 1.0) - weights - activation peak - non-torch.
    assert int(worker["budget"]["requested_bytes"]) == total == sizing["requested_bytes"]
    assert int(reserved) == capacity["reserved_kv_bytes"]
    bpb = int(worker["bytes_per_block"])
    assert int(plan["reserved_num_blocks"]) == int(reserved) // bpb
    # After it, at utilization 1.0 the device binds: the reservation less the CUDA
    # context, the captured graphs and the margin (the transient is in both).
    assert not sizing["bound_by_utilization"]
    assert sizing["kv_cache_bytes"] == int(reserved) - (
        sizing["startup_reserved_bytes"] + sizing["graph_bytes"] + sizing["margin_bytes"]
    )
    assert sizing["margin_bytes"] == max(GIB, int(0.75 * sizing["transient_bytes"]))
    assert sizing["graph_bytes"] > 0
    assert capacity["available_kv_bytes"] == sizing["kv_cache_bytes"]
    # 32 layer segments of 256 KiB blocks mapped in 2 MiB granules.
    blocks = blocks_within([bpb // 32] * 32, sizing["kv_cache_bytes"], 2 << 20, 10**9)
    assert int(plan["num_blocks"]) == capacity["num_blocks"] == blocks
    assert blocks < int(plan["reserved_num_blocks"])
    per_request = int(worker["blocks_per_request"])
    assert capacity["kv_cache_tokens"] == int(blocks / per_request * 131_072)
    assert capacity["reserved_kv_cache_tokens"] == int(
        int(plan["reserved_num_blocks"]) / per_request * 131_072
    )
    assert capacity["kv_cache_tokens"] < capacity["reserved_kv_cache_tokens"]


def test_a_utilization_under_1_binds_as_the_classic_budget() -> None:
    # At 0.9 the budget binds: the final bytes are 0.9 x total less everything the
    # classic (estimate-sized) cache subtracts, graphs and the activation peak included;
    # vLLM 0.34 warns that this keeps free memory out of the cache.
    final = _plan("--gpu-memory-utilization", "0.9")
    classic = _plan("--gpu-memory-utilization", "0.9", "--no-enable-extensible-kv-cache")
    (sizing,) = final["extensible_final_sizing"]
    assert sizing["bound_by_utilization"]
    assert classic["plan_stage"] == "PLAN_STAGE_CLASSIC"
    assert "extensible_final_sizing" not in classic
    assert sizing["kv_cache_bytes"] == int(classic["workers"][0]["budget"]["available_bytes"])
    assert final["capacity"]["available_kv_bytes"] == sizing["kv_cache_bytes"]
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100-80GB"]
    text = _run([*args, "--engine-version", "vllm-0.34", "--gpu-memory-utilization", "0.9"])
    assert "gpu_memory_utilization=0.9 keeps about" in text
    assert "assumed" in text  # the CUDA context figure is said to be an assumption
    # 1.0 given is the default; nothing withheld, no warning.
    assert _plan("--gpu-memory-utilization", "1.0")["num_blocks"] == _plan()["num_blocks"]


def test_the_opt_out_sizes_once_as_0_33_does() -> None:
    classic = _plan("--no-enable-extensible-kv-cache")
    budget = classic["workers"][0]["budget"]
    total = lookup_gpu("H100-80GB").total_memory_bytes
    assert int(budget["requested_bytes"]) == -(-total * 92 // 100)  # 0.92, 0.33's default
    assert classic["plan_stage"] == "PLAN_STAGE_CLASSIC"
    assert "reserved_num_blocks" not in classic


@pytest.mark.parametrize(
    ("options", "on"),
    [
        (ModelPlanOptions(engine_version="vllm-0.34"), True),
        (ModelPlanOptions(engine_version="vllm-0.34", extensible_kv_cache=False), False),
        (ModelPlanOptions(engine_version="vllm-0.34", kv_cache_memory_bytes=GIB), False),
        (ModelPlanOptions(engine_version="vllm-0.34", num_gpu_blocks_override=100), False),
        (ModelPlanOptions(engine_version="vllm-0.33"), False),
        (ModelPlanOptions(), False),
    ],
)
def test_when_the_cache_is_extensible(options: ModelPlanOptions, on: bool) -> None:
    assert extensible_cache_on(options) is on


def test_a_0_34_profile_under_kvplans_rules_keeps_its_graphs_unestimated() -> None:
    # `calibrate` of a 0.34 log plans with kvplan's own rules and 0.34's profile: no
    # extensible plan (those rules have none), and, as before, no graph estimate, which
    # 0.34 skips unless the flags turn its cache off.
    config = load_config(str(MODELS / "llama-3.1-8b"))
    options = ModelPlanOptions(engine_release="0.34.0", gpu="H100-80GB")
    assert extensible_setting(options) is None and not extensible_cache_on(options)
    _, inputs = build_plan_request(config, options)
    assert inputs.overhead is not None and inputs.overhead.cudagraph_bytes == 0
    assert inputs.final_sizings == ()
    _, off = build_plan_request(config, replace(options, kv_cache_memory_bytes=GIB))
    assert off.overhead is not None and off.overhead.cudagraph_bytes > 0


def test_asking_for_it_where_vllm_refuses() -> None:
    for options in (
        ModelPlanOptions(
            engine_version="vllm-0.34", extensible_kv_cache=True, kv_cache_memory_bytes=GIB
        ),
        ModelPlanOptions(engine_version="vllm-0.33", extensible_kv_cache=True),
    ):
        with pytest.raises(ModelConfigError, match="--enable-extensible-kv-cache"):
            extensible_cache_on(options)


def test_pipeline_stages_are_sized_each() -> None:
    # PP 2: each stage its own final size (its weights, its activation peak); the plan
    # takes the smaller, on the several-GPU start-up figure.
    config = load_config(str(MODELS / "llama-3.1-8b"))
    options = ModelPlanOptions(
        engine_version="vllm-0.34", gpu="H100-80GB", pipeline_parallel_size=2
    )
    request, inputs = build_plan_request(config, options)
    first, last = inputs.final_sizings
    assert first.startup_reserved_bytes == STARTUP_RESERVED_SEVERAL_GPUS_BYTES
    assert [worker.memory.measured_kv_cache_bytes for worker in request.workers] == [
        first.kv_cache_bytes,
        last.kv_cache_bytes,
    ]
    assert inputs.final_kv_cache_bytes == min(first.kv_cache_bytes, last.kv_cache_bytes)


VLLM_FLAG_SIDE = """
import json, sys
from vllm.platforms import current_platform
current_platform.device_type = "cpu"  # the CPU build names no device; argparse needs one
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
AsyncEngineArgs.add_cli_args(parser)
print(json.dumps([parser.parse_args(["--model", "m", *argv]).enable_extensible_kv_cache
                  for argv in json.load(sys.stdin)]))
"""
FLAG_CASES = [[], ["--enable-extensible-kv-cache"], ["--no-enable-extensible-kv-cache"]]


def test_the_flag_parses_as_vllm_0_34_parses_it(tmp_path: Path) -> None:
    from kvplan.cli import build_parser
    from kvplan.models.cli import options_from_args

    theirs = run_in_vllm("0.34", ["-c", VLLM_FLAG_SIDE], FLAG_CASES, cache_root=tmp_path)
    parser = build_parser()
    ours = [
        options_from_args(
            parser.parse_args(["plan", "--model", str(MODELS / "llama-3.1-8b"), *argv])
        ).extensible_kv_cache
        for argv in FLAG_CASES
    ]
    assert ours == theirs == [None, True, False]


def test_a_no_fit_names_the_length_that_fits_after_warm_up() -> None:
    # Llama-3.1-8B at 131,072 tokens on one L4: vLLM 0.34 refuses on the reservation
    # first; the length offered is the one that also fits the final size after warm-up.
    from kvplan.cli import main as cli

    args = ["capacity", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "L4", "--tp", "1"]
    (row,) = json.loads(_run([*args, "--engine-version", "vllm-0.34", "--json"]))
    assert row["status"] == "does not fit"
    fits = row["fits_max_model_len"]
    assert "after it (vLLM 0.34)" in row["error"]
    plan = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "L4", "--json"]
    plan += ["--engine-version", "vllm-0.34", "--max-model-len"]
    fitted = json.loads(_run([*plan, str(fits)]))
    assert fitted["plan_stage"] == "PLAN_STAGE_EXTENSIBLE_FINAL"
    assert fitted["capacity"]["reserved_kv_cache_tokens"] > fitted["capacity"]["kv_cache_tokens"]
    assert cli([*plan, str(fits + 1)]) != 0  # refused after warm-up
