"""The CUDA-graph capture sizes kvplan's graph estimate counts, against each release's
own `VllmConfig._set_cudagraph_sizes` run in its CPU venv (on a bare config: the method
reads only the model's eager flag, the compilation config, the scheduler's
max_num_seqs / max_num_batched_tokens and the speculative config)."""

from __future__ import annotations

import pytest

from kvplan.models.profiling import cudagraph_capture_sizes
from tests.vllm_envs import run_in_vllm

# (max_num_seqs, max_num_batched_tokens): vllm serve's defaults by device class, the
# offline class's, a small interactive engine, and a step budget under the grid's cap.
CASES = [(1024, 8192), (256, 2048), (256, 8192), (6, 8192), (1, 8192), (1024, 256), (64, 100)]

VLLM_SIDE = """
import json, sys, types
from vllm.config import CompilationConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode
out = []
for seqs, tokens in json.loads(sys.stdin.read()):
    config = object.__new__(VllmConfig)
    compilation = CompilationConfig()
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.__dict__.update(
        model_config=types.SimpleNamespace(enforce_eager=False),
        compilation_config=compilation,
        scheduler_config=types.SimpleNamespace(
            max_num_seqs=seqs, max_num_batched_tokens=tokens),
        speculative_config=None,
        performance_mode="balanced",
    )
    config._set_cudagraph_sizes()
    decode = getattr(compilation, "decode_cudagraph_capture_request_sizes", None)
    out.append([list(compilation.cudagraph_capture_sizes),
                None if decode is None else list(decode)])
print(json.dumps(out))
"""


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_capture_sizes_are_the_release_defaults(release: str) -> None:
    answers = run_in_vllm(release, ["-c", VLLM_SIDE], CASES, timeout=240)
    for (seqs, tokens), (theirs, decode) in zip(CASES, answers, strict=True):
        ours = cudagraph_capture_sizes(seqs, tokens, f"vllm-{release}")
        assert ours == theirs, (release, seqs, tokens)
        if decode is not None:  # the FULL (uniform decode) graphs, where the release splits
            assert [size for size in ours if size <= seqs] == decode, (release, seqs, tokens)
