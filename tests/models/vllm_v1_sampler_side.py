"""Run in a vLLM CPU venv (0.32 or 0.33): the V1 runner's dummy sampling as
`gpu_model_runner._dummy_sampler_run` does it from 0.21 (temperature 0.5, top-k vocab - 1,
top-p 0.9; once as is, then again with one request's generator), through the V1
`Sampler` and `TopKTopPSampler.forward_cuda`, with every tensor vLLM's Python code
allocates counted while it lives. stdin: {"rows": int, "vocab": int, "dtype": str}.
stdout (last line): {"passes": [B, B], "calls": [...]}, bytes per logit (the model-dtype
logits included).

Stand-ins, at the hardware boundary only: the CPU build binds `forward_cpu`, so
`forward_cuda` is bound as `flashinfer_sampler_supported()` makes it on a CUDA part
FlashInfer supports; `flashinfer_sample` records what it is handed (FlashInfer's own
masked copy and probabilities are read from its source); the Triton wrapper
`apply_top_k_top_p_triton` runs with its kernel launch a no-op (`HAS_TRITON` as on CUDA,
132 SMs, an H100's), so its row buffer is allocated and counted."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

import torch
from vllm_live_bytes import LiveBytes  # type: ignore[import-not-found]  # beside this script

request = json.loads(sys.stdin.read())
rows, vocab = int(request["rows"]), int(request["vocab"])


import vllm.v1.sample.ops.topk_topp_sampler as topk_topp_sampler  # noqa: E402
import vllm.v1.sample.ops.topk_topp_triton as topk_topp_triton  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

topk_topp_triton.num_compute_units = lambda *args: 132
topk_topp_triton._topk_topp = lambda *args, **kwargs: None

mode = LiveBytes()
base = 0
calls: list[dict[str, object]] = []


def flashinfer_sample(logits: torch.Tensor, k: Any, p: Any, *rest: Any) -> torch.Tensor:
    held = (mode.current - base) / (rows * vocab)
    calls.append({"call": "flashinfer_sample", "held": held, "dtype": str(logits.dtype)})
    return torch.zeros(logits.shape[0], dtype=torch.int64)


topk_topp_sampler.flashinfer_sample = flashinfer_sample
sampler = Sampler()
sampler.topk_topp_sampler.forward = sampler.topk_topp_sampler.forward_cuda
# After the sampler is built (its CPU __init__ registers no Triton warm-ups): the masks
# take the Triton wrapper, as on CUDA.
topk_topp_sampler.HAS_TRITON = True
topk_topp_sampler.apply_top_k_top_p_triton = topk_topp_triton.apply_top_k_top_p_triton


def full(value: float) -> torch.Tensor:
    return torch.full((rows,), value)


passes: list[float] = []
with mode:
    logits = torch.randn(rows, vocab, dtype=getattr(torch, request["dtype"]))
    metadata = SamplingMetadata(
        temperature=full(0.5),
        all_greedy=False,
        all_random=False,
        top_p=full(0.9),
        top_k=full(vocab - 1),
        generators={},
        max_num_logprobs=None,
        logprob_token_ids=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=full(0.1),
        presence_penalties=full(0.1),
        repetition_penalties=full(0.1),
        output_token_ids=[[] for _ in range(rows)],
        spec_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
    base = mode.current - logits.untyped_storage().nbytes()
    for generators in ({}, {0: torch.Generator().manual_seed(0)}):
        start = len(mode.after)
        sampler(logits=logits, sampling_metadata=replace(metadata, generators=generators))
        passes.append((max(mode.after[start:]) - base) / (rows * vocab))
rows_cached = [buffer.shape[0] for buffer in topk_topp_triton._TRITON_BUFFER_CACHE.values()]
print(json.dumps({"passes": passes, "calls": calls, "row_buffer_rows": rows_cached}))
