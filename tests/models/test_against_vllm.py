"""The importer against vLLM 0.33 on the CPU, in the vLLM venv: its state-shape
calculators and spec pages, and its planner on every imported request. One vLLM-side
run (tests/vllm_envs.py's run_in_vllm) answers both tests. A missing venv fails them
with how to build it (make test builds every release's venv first)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvplan.core.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec
from kvplan.models import (
    Deployment,
    HFConfig,
    ModelConfigError,
    Speculative,
    import_layers,
    load_config,
)
from tests.models.test_importer import EAGLE3_TEST_DRAFTER, NEMOTRON_H_TEST_CONFIG, domain
from tests.vllm_envs import run_in_vllm

MODELS = Path(__file__).parents[2] / "examples" / "models"
# Checkpoint configs (tests/data/checkpoints) of families imported for calibration
# records and not among the shipped examples, planned here too (Phi-2 at its 2,048
# positions).
CHECKPOINTS = Path(__file__).parents[1] / "data" / "checkpoints"
PLANNED_CHECKPOINTS = {"gemma-7b": 8192, "qwen1.5-moe-a2.7b": 8192, "phi-2": 2048}

# Both vLLM-side scripts: each calculator case answered with vLLM's own figure.
CALCULATOR_CASES = """
for case in payload["calculators"]:
    kind, a = case["kind"], case["args"]
    if kind == "gdn":
        out.append([list(s) for s in C.gated_delta_net_state_shape(*a)])
    elif kind == "mamba1":
        out.append([list(s) for s in C.mamba1_state_shape(*a)])
    elif kind == "mamba2":
        out.append([list(s) for s in C.mamba2_state_shape(*a)])
    elif kind == "full":
        out.append(FullAttentionSpec(block_size=a[0], num_kv_heads=a[1], head_size=a[2],
                                     dtype=dtypes[a[3]]).page_size_bytes)
    elif kind == "mla":
        out.append(MLAAttentionSpec(block_size=a[0], num_kv_heads=1, head_size=a[1],
                                    dtype=dtypes[a[2]], cache_dtype_str=a[3]).page_size_bytes)
"""

# Runs inside the vLLM venv with the repository on sys.path: answers the calculator
# cases with vLLM's own figures, and plans each request with vLLM 0.33's planner
# (conformance/vllm_driver.py) and with kvplan, listing every differing field
# (conformance/compare.py).
VLLM_SIDE = (
    """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as C
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from conformance.compare import compare_results, plan_with_kvplan
from conformance.vllm_driver import plan_with_vllm
from kvplan.convert import plan_from_proto
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.core.errors import PlanningError
from kvplan.v1 import plan_pb2
dtypes = {"bfloat16": torch.bfloat16, "uint8": torch.uint8}
payload = json.load(sys.stdin)
out = []
"""
    + CALCULATOR_CASES
    + """plans = []
for blob in payload["requests"]:
    request = plan_pb2.PlanRequest.FromString(bytes.fromhex(blob))
    vllm = plan_with_vllm(request, GPU_MEMORY_BYTES)
    ours = plan_with_kvplan(plan_from_proto, PlanningError, request)
    diffs = [repr(diff) for diff in compare_results(vllm, ours)]
    plans.append({"ok": bool(vllm.get("ok")), "diffs": diffs})
print(json.dumps({"calculators": out, "plans": plans}))
"""
)


def calculator_cases() -> tuple[list[dict[str, object]], list[object]]:
    """(cases for vLLM's calculators, the importer's answers)."""
    cases: list[dict[str, object]] = []
    ours: list[object] = []

    def states(spec: MambaSpec) -> list[list[int]]:
        return [list(state.shape) for state in spec.states]

    next_config = load_config(str(MODELS / "qwen3-next-80b-a3b" / "config.json"))
    for tp in (1, 2, 4, 8):
        for spec_tokens in (0, 1, 2):
            speculative = Speculative("mtp", spec_tokens) if spec_tokens else None
            layers = import_layers(
                next_config, Deployment(tensor_parallel_size=tp, speculative=speculative)
            )
            mamba = next(s for _, s in domain(layers) if isinstance(s, MambaSpec))
            cases.append({"kind": "gdn", "args": [tp, 16, 32, 128, 128, 4, spec_tokens]})
            ours.append(states(mamba))
    jamba = load_config(str(MODELS / "jamba-defaults" / "config.json"))
    for tp in (1, 2, 4):
        layers = import_layers(jamba, Deployment(tensor_parallel_size=tp))
        mamba = next(s for _, s in domain(layers) if isinstance(s, MambaSpec))
        cases.append({"kind": "mamba1", "args": [tp, 2 * 4096, 16, 4]})
        ours.append(states(mamba))
    for tp in (1, 4, 16):
        layers = import_layers(
            HFConfig(NEMOTRON_H_TEST_CONFIG), Deployment(tensor_parallel_size=tp)
        )
        mamba = next(s for _, s in domain(layers) if isinstance(s, MambaSpec))
        cases.append({"kind": "mamba2", "args": [tp, 8192, 8, 128, 64, 128, 4, 0]})
        ours.append(states(mamba))
    nano = load_config(str(MODELS / "nemotron-3-nano-30b-a3b"))
    for tp in (1, 2, 4, 8):
        layers = import_layers(nano, Deployment(tensor_parallel_size=tp))
        mamba = next(s for _, s in domain(layers) if isinstance(s, MambaSpec))
        cases.append({"kind": "mamba2", "args": [tp, 64 * 64, 8, 64, 64, 128, 4, 0]})
        ours.append(states(mamba))
    for model, tp, kv_heads, head in (
        ("whisper-small", 2, 6, 64),
        ("nemotron-3-nano-30b-a3b", 4, 1, 128),
        ("llama-3.1-8b", 1, 8, 128),
        ("llama-3.1-8b", 16, 1, 128),
        ("phi-4", 2, 5, 128),
        ("gpt-oss-120b", 4, 2, 64),
        ("gemma-3-27b", 1, 16, 128),
    ):
        for kv_dtype, storage in (("auto", "bfloat16"), ("fp8", "uint8")):
            layers = import_layers(
                load_config(str(MODELS / model / "config.json")),
                Deployment(tensor_parallel_size=tp, kv_cache_dtype=kv_dtype),
            )
            full = next(s for _, s in domain(layers) if type(s) is FullAttentionSpec)
            cases.append({"kind": "full", "args": [full.block_size, kv_heads, head, storage]})
            ours.append(full.page_size_bytes)
    for kv_dtype, storage in (("auto", "bfloat16"), ("fp8", "uint8")):
        layers = import_layers(
            load_config(str(MODELS / "deepseek-v3" / "config.json")),
            Deployment(tensor_parallel_size=8, kv_cache_dtype=kv_dtype),
        )
        mla = domain(layers)[0][1]
        assert isinstance(mla, MLAAttentionSpec)
        cases.append({"kind": "mla", "args": [64, 576, storage, kv_dtype]})
        ours.append(mla.page_size_bytes)
    return cases, ours


def request_cases() -> tuple[list[tuple[str, str]], list[str]]:
    """Every shipped config at TP 1, 2 (fp8 KV), 8, and 4 with MTP, as PlanRequests."""
    from kvplan.models.request import ModelPlanOptions, build_plan_request

    names: list[tuple[str, str]] = []
    blobs: list[str] = []
    planned = [(directory, 8192) for directory in sorted(MODELS.iterdir())]
    planned += [(CHECKPOINTS / name, length) for name, length in PLANNED_CHECKPOINTS.items()]
    for directory, length in planned:
        config = load_config(str(directory))
        mtp = Speculative("mtp", 1)
        for tp, spec, kv in (
            (1, None, "auto"),
            (2, None, "fp8"),
            (8, None, "auto"),
            (4, mtp, "auto"),
        ):
            options = ModelPlanOptions(
                tensor_parallel_size=tp,
                kv_cache_dtype=kv,
                max_model_len=length,
                gpu_memory_bytes=1 << 40,  # room for every model: the plan, not the fit
                non_kv_bytes=1 << 30,
                speculative=spec,
            )
            try:
                request, _ = build_plan_request(config, options)
            except ModelConfigError:
                continue  # e.g. TP 8 over Phi-4's 10 KV heads; MTP without MTP layers
            names.append((directory.name, f"tp{tp}-{kv}{'-mtp' if spec else ''}"))
            blobs.append(request.SerializeToString().hex())
    for model in ("llama-3.1-8b", "qwen3-next-80b-a3b", "jamba-defaults", "gemma-3-27b"):
        options = ModelPlanOptions(
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            max_model_len=8192,
            gpu_memory_bytes=1 << 40,
            non_kv_bytes=1 << 30,
        )
        request, _ = build_plan_request(load_config(str(MODELS / model)), options)
        names.append((model, "tp2-pp2"))
        blobs.append(request.SerializeToString().hex())
    drafter = HFConfig(EAGLE3_TEST_DRAFTER)
    for model in ("llama-3.1-8b", "qwen3-next-80b-a3b"):
        for tp in (1, 2):
            eagle = Speculative("eagle3", 3, drafter)
            options = ModelPlanOptions(
                tensor_parallel_size=tp,
                max_model_len=8192,
                gpu_memory_bytes=1 << 40,
                non_kv_bytes=1 << 30,
                speculative=eagle,
            )
            request, _ = build_plan_request(load_config(str(MODELS / model)), options)
            names.append((model, f"tp{tp}-eagle3"))
            blobs.append(request.SerializeToString().hex())
    return names, blobs


@pytest.fixture(scope="module")
def vllm_answers() -> dict[str, list[object]]:
    calculators, _ = calculator_cases()
    _, requests = request_cases()
    answers: dict[str, list[object]] = run_in_vllm(
        "0.33",
        ["-c", VLLM_SIDE, str(MODELS.parents[1])],
        {"calculators": calculators, "requests": requests},
    )
    return answers


def test_importer_matches_vllm_calculators(vllm_answers: dict[str, list[object]]) -> None:
    cases, ours = calculator_cases()
    for case, mine, vllm in zip(cases, ours, vllm_answers["calculators"], strict=True):
        assert mine == vllm, case


def test_imported_requests_plan_the_same_in_vllm(vllm_answers: dict[str, list[object]]) -> None:
    """Every shipped config, imported and planned by vLLM 0.33 and by kvplan: same
    groups, blocks, tensors and capacity, no error on either side."""
    names, _ = request_cases()
    assert len(names) >= 3 * len(list(MODELS.iterdir()))
    assert {name for name, _ in names} >= set(PLANNED_CHECKPOINTS)
    for name, outcome in zip(names, vllm_answers["plans"], strict=True):
        assert isinstance(outcome, dict)
        assert outcome["ok"], name
        assert outcome["diffs"] == [], name


# --- every release ---------------------------------------------------------------------

RELEASES = ("vllm-0.32", "vllm-0.33", "vllm-0.34")

# Runs in one release's venv: that release's registration facts (its default block size,
# whether its layer specs have `is_draft`), and each imported request planned by the
# release's own planner and by kvplan under that release's rule set.
RELEASE_SIDE = (
    """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from vllm.config import CacheConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as C
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from conformance.compare import compare_results, plan_with_kvplan
from conformance.vllm_driver import plan_with_vllm
from kvplan.convert import plan_from_proto
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.core.errors import PlanningError
from kvplan.v1 import plan_pb2
payload = json.load(sys.stdin)
dtypes = {"bfloat16": torch.bfloat16, "uint8": torch.uint8}
out = []
"""
    + CALCULATOR_CASES
    + """facts = {
    "default_block_size": CacheConfig.DEFAULT_BLOCK_SIZE,
    "has_is_draft": "is_draft" in {f.name for f in dataclasses.fields(FullAttentionSpec)},
}
plans = []
for blob in payload["requests"]:
    request = plan_pb2.PlanRequest.FromString(bytes.fromhex(blob))
    vllm = plan_with_vllm(request, GPU_MEMORY_BYTES)
    ours = plan_with_kvplan(plan_from_proto, PlanningError, request)
    diffs = [repr(diff) for diff in compare_results(vllm, ours)]
    plans.append({"ok": bool(vllm.get("ok")), "diffs": diffs})
print(json.dumps({"facts": facts, "calculators": out, "plans": plans}))
"""
)


def release_request_cases(engine_version: str) -> tuple[list[str], list[str]]:
    """Every shipped config at TP 1 and TP 2 with an fp8 cache, DeepSeek V3 with MTP,
    Llama 3.1 with an EAGLE3 drafter and Qwen3-Next over two pipeline stages, imported
    for `engine_version`."""
    from kvplan.models.request import ModelPlanOptions, build_plan_request

    base = ModelPlanOptions(
        max_model_len=8192,
        gpu_memory_bytes=1 << 40,
        non_kv_bytes=1 << 30,
        engine_version=engine_version,
    )
    variants: list[tuple[str, str, ModelPlanOptions]] = []
    for directory in sorted(MODELS.iterdir()):
        length = 448 if directory.name.startswith("whisper") else 8192
        variants.append((directory.name, "tp1", replace(base, max_model_len=length)))
        variants.append(
            (
                directory.name,
                "tp2-fp8",
                replace(base, max_model_len=length, tensor_parallel_size=2, kv_cache_dtype="fp8"),
            )
        )
    variants.append(
        (
            "deepseek-v3",
            "tp4-mtp",
            replace(base, tensor_parallel_size=4, speculative=Speculative("mtp", 1)),
        )
    )
    eagle = Speculative("eagle3", 3, HFConfig(EAGLE3_TEST_DRAFTER))
    variants.append(("llama-3.1-8b", "tp1-eagle3", replace(base, speculative=eagle)))
    variants.append(
        (
            "qwen3-next-80b-a3b",
            "tp2-pp2",
            replace(base, tensor_parallel_size=2, pipeline_parallel_size=2),
        )
    )
    names: list[str] = []
    blobs: list[str] = []
    for model, variant, options in variants:
        try:
            request, _ = build_plan_request(load_config(str(MODELS / model)), options)
        except ModelConfigError:
            continue  # e.g. TP 2 over a model whose heads do not split
        assert request.options.engine_version == engine_version
        names.append(f"{model}:{variant}")
        blobs.append(request.SerializeToString().hex())
    return names, blobs


@pytest.fixture(scope="module", params=RELEASES)
def release_answers(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    engine_version: str = request.param
    _, blobs = release_request_cases(engine_version)
    answers: dict[str, object] = run_in_vllm(
        engine_version.removeprefix("vllm-"),
        ["-c", RELEASE_SIDE, str(MODELS.parents[1])],
        {"calculators": calculator_cases()[0], "requests": blobs},
    )
    return engine_version, answers


def test_registration_matches_each_release(
    release_answers: tuple[str, dict[str, object]],
) -> None:
    """The importer's release table against the release itself: its default block size
    and whether its specs have `is_draft`."""
    from kvplan.models.importer import registration_for

    engine_version, answers = release_answers
    facts = answers["facts"]
    assert isinstance(facts, dict)
    registration = registration_for(engine_version)
    assert registration.default_block_size == facts["default_block_size"]
    assert registration.marks_draft_layers == facts["has_is_draft"]
    # State shapes and page formulas do not change between releases: the same
    # calculator cases as vLLM 0.33's, answered by this release.
    cases, ours = calculator_cases()
    calculators = answers["calculators"]
    assert isinstance(calculators, list)
    for case, mine, theirs in zip(cases, ours, calculators, strict=True):
        assert mine == theirs, (engine_version, case)


def test_imported_requests_plan_the_same_in_each_release(
    release_answers: tuple[str, dict[str, object]],
) -> None:
    """Imported for a release and planned by that release's own planner and by kvplan
    with its rule set: same groups, draft flags, blocks, tensors and capacity."""
    engine_version, answers = release_answers
    names, _ = release_request_cases(engine_version)
    plans = answers["plans"]
    assert isinstance(plans, list) and len(plans) == len(names) >= 2 * len(list(MODELS.iterdir()))
    for name, outcome in zip(names, plans, strict=True):
        assert outcome["ok"], (engine_version, name)
        assert outcome["diffs"] == [], (engine_version, name)
