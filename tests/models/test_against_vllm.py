"""The importer's state shapes and pages against vLLM 0.33's own calculators, run on the
CPU in the vLLM venv (one subprocess for all cases). Skips only when that venv is absent."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvplan.core.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec
from kvplan.models import Deployment, HFConfig, Speculative, import_layers, load_config
from tests.models.test_importer import NEMOTRON_H_TEST_CONFIG, domain

VENV = Path.home() / ".cache" / "kvplan" / "vllm-0.33" / "venv"
MODELS = Path(__file__).parents[2] / "examples" / "models"

# Runs inside the vLLM venv: reads cases from stdin, answers with vLLM's own figures.
VLLM_SIDE = """
import json, sys, torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as C
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
dtypes = {"bfloat16": torch.bfloat16, "uint8": torch.uint8}
out = []
for case in json.load(sys.stdin):
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
print(json.dumps(out))
"""


def test_importer_matches_vllm_calculators() -> None:
    if not (VENV / ".kvplan-vllm-ready").exists():
        pytest.skip(f"vLLM 0.33 CPU venv not built at {VENV}")
    cases: list[dict[str, object]] = []
    ours: list[object] = []

    def states(spec: MambaSpec) -> list[list[int]]:
        return [list(state.shape) for state in spec.states]

    next_config = load_config(str(MODELS / "qwen3-next-defaults" / "config.json"))
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
    for model, tp, kv_heads, head in (
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
            cases.append({"kind": "full", "args": [16, kv_heads, head, storage]})
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
    result = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", VLLM_SIDE],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    for case, mine, vllm in zip(cases, ours, theirs, strict=True):
        assert mine == vllm, case
