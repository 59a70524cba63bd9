"""The sampler terms of the activation estimate, stated with figures read in vLLM's
own source (no GPU log sets them): the 0.17-0.19 Triton kernel's row buffer follows
the GPU's SM count, and float32 logits are the sampler's float32 copy."""

from __future__ import annotations

import pytest

from kvplan.gpus import lookup_gpu
from kvplan.models import load_config
from kvplan.models.calibration_set import ROOT
from kvplan.models.importer import Deployment, import_layers
from kvplan.models.profiling import (
    PROFILES,
    float32_logits_saving,
    profile_rules,
    triton_row_buffer_bytes,
)
from kvplan.models.request import ModelPlanOptions, build_plan_request
from kvplan.models.weights import estimate_overhead, estimate_weights

MIB = 1 << 20
LLAMA_VOCAB = 128_256


@pytest.mark.parametrize(
    ("gpu", "sms", "requests", "rows"),
    [
        ("H100", 132, 1024, 132),
        ("H200", 132, 1024, 132),
        ("A100-80GB", 108, 1024, 108),
        ("L40S", 142, 1024, 142),
        ("B200", 148, 1024, 148),
        ("RTX-4090", 128, 256, 128),
        ("A10G", 80, 256, 80),
        # Fewer requests than SMs: the next power of two of the programs, capped at SMs.
        ("H100", 132, 100, 128),
        ("A100-80GB", 108, 100, 108),
        ("L40S", 142, 64, 64),
        ("RTX-4090", 128, 8, 8),
    ],
)
def test_the_triton_row_buffer_follows_the_gpus_sm_count(
    gpu: str, sms: int, requests: int, rows: int
) -> None:
    """vLLM 0.17.0, 0.18.0 and 0.19.0 (read in their wheels), topk_topp_triton.py
    `apply_top_k_top_p_triton`: programs = min(num_compute_units, batch), and the cached
    float32 buffer has min(next_power_of_2(programs), num_compute_units) rows of the
    vocabulary; platforms/cuda.py `num_compute_units` is torch's
    `multi_processor_count`, so the buffer is the part's SM count, not a constant."""
    assert lookup_gpu(gpu).sm_count == sms
    rules = profile_rules("0.19.0")
    assert triton_row_buffer_bytes(rules, requests, LLAMA_VOCAB, sms) == rows * LLAMA_VOCAB * 4


def test_the_row_buffer_is_the_v1_runners_from_0_17_and_needs_8_requests() -> None:
    """topk_topp_sampler.py `apply_top_k_top_p` (0.17.0-0.30.0) takes the Triton kernel
    only from 8 rows; under that it sorts in torch. The V1 runner keeps the buffer in
    every release from 0.17 that has one (0.20 samples with Triton, 0.21-0.33's second
    dummy pass too: tests/models/test_sampler_by_release.py); the sort releases have
    none. An unknown part plans at an H100's 132 SMs."""
    rules = profile_rules("0.17.0")
    assert triton_row_buffer_bytes(rules, 7, LLAMA_VOCAB, 132) == 0
    assert triton_row_buffer_bytes(rules, 1024, LLAMA_VOCAB) == 132 * LLAMA_VOCAB * 4
    assert triton_row_buffer_bytes(profile_rules("0.16.0"), 1024, LLAMA_VOCAB, 142) == 0
    for release in ("0.20.0", "0.21.0", "0.25.0", "0.28.0", "vllm-0.33"):
        rows = triton_row_buffer_bytes(profile_rules(release), 1024, LLAMA_VOCAB, 142)
        assert rows == 142 * LLAMA_VOCAB * 4, release


def test_an_l40s_plans_its_own_row_buffer() -> None:
    """Through the estimate: Llama 3.1 8B at 1,024 requests on 0.19, an L40S's 142 SMs
    hold 10 vocabulary rows more than an H100's 132 (5.1 MB)."""
    llama = load_config(str(ROOT / "examples/models/llama-3.1-8b/config.json"))
    layers = import_layers(llama)
    h100, l40s = (
        estimate_overhead(llama, layers, 1, 8192, 1024, "0.19.0", gpu_arch="hopper",
                          gpu_sms=lookup_gpu(gpu).sm_count).activation_peak_bytes
        for gpu in ("H100", "L40S")
    )  # fmt: skip
    assert l40s - h100 == 10 * LLAMA_VOCAB * 4


def test_float32_logits_are_the_samplers_float32_copy() -> None:
    """compute_logits returns the model dtype, and v1/sample/sampler.py
    `Sampler.forward` (0.17.0-0.19.0) casts it with `.to(torch.float32)`, which returns
    float32 logits themselves: a float32 model holds no 2 B model-dtype logits beside
    a copy. 0.19's Triton path then holds 4 (logits) + 4 (softmax) + 4
    (`random_sample`'s exponential noise) = 12 B per logit, 2 B under bf16's 14."""
    assert float32_logits_saving(4) == 2
    assert float32_logits_saving(2) == 0
    llama = load_config(str(ROOT / "examples/models/llama-3.1-8b/config.json"))
    float32 = import_layers(llama, Deployment(dtype="float32"))
    # 1,024 batched tokens keep the forward (1,024 x 55,296 x 4 B) under the sampler
    # phase: the forward's and the requests' hidden states, the logits, the row buffer
    # and cuBLAS's 32 MiB.
    estimate = estimate_overhead(llama, float32, 1, 1024, 1024, "0.19.0", gpu_arch="hopper")
    hidden = (1024 + 2 * 1024) * 4096 * 4
    logits = 1024 * LLAMA_VOCAB * (PROFILES["v1-0.19"].sampler_bytes_per_logit - 2)
    assert estimate.activation_peak_bytes == hidden + logits + 132 * LLAMA_VOCAB * 4 + 32 * MIB
    assert PROFILES["v1-0.19"].sampler_bytes_per_logit - 2 == 12


def test_qwen3_vl_deepstack_buffers_are_in_the_weights() -> None:
    """vLLM 0.19.0 and 0.34 qwen3_vl.py `Qwen3VLForConditionalGeneration.__init__`
    allocates one zeros buffer of max_num_batched_tokens x the text hidden size per
    deepstack level while the runner's load_model builds the model, so "Model loading
    took" (DeviceMemoryProfiler around load_model) counts it and the profile's
    baseline holds it: the weights, not the activation peak. Qwen3-VL-8B: 3 levels x
    8,192 x 4,096 x 2 B = 192 MiB on every stage."""
    config = load_config(str(ROOT / "examples/models/qwen3-vl-8b-instruct/config.json"))
    layers = import_layers(config)
    plain = estimate_weights(config, layers, 1)
    held = estimate_weights(config, layers, 1, max_num_batched_tokens=8192)
    assert held.model_buffer_bytes == 3 * 8192 * 4096 * 2 == 192 * MIB
    assert held.bytes_per_worker - plain.bytes_per_worker == 192 * MIB
    staged = estimate_weights(config, layers, 1, 2, max_num_batched_tokens=8192)
    unstaged = estimate_weights(config, layers, 1, 2)
    added = [b - a for a, b in zip(unstaged.bytes_per_stage, staged.bytes_per_stage, strict=True)]
    assert added == [192 * MIB, 192 * MIB]
    # A plan passes its batched tokens to the weights, which carry the buffers.
    plan = build_plan_request(config, ModelPlanOptions(gpu="H100", max_num_batched_tokens=8192))[1]
    assert plan.weights is not None and plan.weights.model_buffer_bytes == 192 * MIB
