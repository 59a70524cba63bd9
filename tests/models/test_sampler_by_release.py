"""The profile run's sampler phase from vLLM 0.20 on, per release and per model runner,
as each release's own source has it (the 0.20.0-0.31.0 wheels from PyPI, the 0.32-0.34
CPU venvs, FlashInfer's sampling.py in the wheels its pins name; profiling.py's comments
above `_V1_TWO_PASS_SAMPLER` and `_MRV2_SAMPLER_*` and docs/capacity.md, "What the
sampler terms rest on", say where). Model Runner V2's Sampler is also run in the
0.32-0.34 venvs on the dummy batch with every allocation counted. Which runner a model
gets is `default_runner_is_v2`'s (tests/models/test_graph_estimate_by_release.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplan.models import load_config
from kvplan.models.importer import Deployment, import_layers
from kvplan.models.profiling import (
    PROFILES,
    float32_logits_saving,
    mrv2_sampler_bytes,
    profile_rules,
    triton_row_buffer_bytes,
)
from kvplan.models.weights import estimate_overhead
from tests.vllm_envs import run_in_vllm

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
LLAMA_VOCAB = 128_256


@pytest.mark.parametrize(
    ("release", "v1_bytes", "mrv2_bytes", "gumbel_blocks"),
    [
        # 0.20.0: FlashInfer's sampler still opt-in, so the V1 runner's one dummy pass
        # runs the Triton masks in place: bf16 logits 2 + float32 copy 4 + softmax 4 +
        # exponential noise 4 (0.19's path, the same functions in the 0.20.0 wheel).
        # VLLM_USE_V2_MODEL_RUNNER defaults to 0: no MRV2 figure.
        ("0.20.0", 14, 0, False),
        # 0.21.0: FlashInfer's sampler the default (vllm#40376) and the dummy batch
        # sampled twice: FlashInfer's top-k-first path (logits 2 + float32 4 + masked
        # copy 4 + probabilities 4), then the native path with one generator set
        # (2 + 4 + 4 + 4 and the row buffer). V1 still the only default runner.
        ("0.21.0", 14, 0, False),
        # 0.22-0.25: MRV2's Sampler copies the logits to float32 before anything else
        # (`apply_sampling_params`), then takes the greedy Gumbel argmax: 2 + 4.
        ("0.22.0", 14, 6, True),
        ("0.25.1", 14, 6, True),
        # 0.26: the copy only for raw logprobs; 0.27-0.32 skip the processing when no
        # request needs it: the model-dtype logits alone, 2 B.
        ("0.26.0", 14, 2, True),
        ("0.28.0", 14, 2, True),
        ("0.29.0", 14, 2, True),
        ("0.32.0", 14, 2, True),
        # 0.33-0.34: a second pass with SamplingParams.for_sampler_warmup() on every
        # request: float32 copy beside the logits, then FlashInfer's fused sampler with
        # top-k 50 as a tensor (masked copy + probabilities): 2 + 4 + 4 + 4.
        ("0.33.0", 14, 14, False),
        ("vllm-0.34", 14, 14, False),
        ("", 14, 14, False),  # the newest
    ],
)
def test_the_per_release_sampler_bytes(
    release: str, v1_bytes: int, mrv2_bytes: int, gumbel_blocks: bool
) -> None:
    rules = profile_rules(release)
    assert rules.sampler_bytes_per_logit == v1_bytes, release
    assert rules.sampler_row_buffer, release  # the V1 runner's Triton kernel
    assert rules.mrv2_sampler_bytes_per_logit == mrv2_bytes, release
    assert rules.mrv2_gumbel_blocks == gumbel_blocks, release
    # The V1 runner's float32 copy is `.to(torch.float32)`, a no-op on float32 logits:
    # 2 B fewer there; MRV2 copies with empty_like + copy_ whatever the dtype: 2 B more.
    assert float32_logits_saving(4) == 2
    if mrv2_bytes:
        assert mrv2_sampler_bytes(rules, 1, 1024, 4) == mrv2_sampler_bytes(rules, 1, 1024, 2) + (
            2 * 1024)  # fmt: skip


def test_the_rows_follow_the_releases() -> None:
    assert profile_rules("0.20.2") is PROFILES["v1-0.21"] is profile_rules("0.21.0")
    assert profile_rules("0.22.1") is PROFILES["v1-0.25"] is profile_rules("0.25.1")
    assert profile_rules("0.26.0") is PROFILES["v1-0.26"] is profile_rules("0.28.0")
    assert profile_rules("0.29.0") is PROFILES["v1-0.32"] is profile_rules("vllm-0.32")
    assert profile_rules("vllm-0.33") is PROFILES["v1"] is profile_rules("vllm-0.34")


def test_the_sampler_phase_through_the_estimate() -> None:
    """Llama 3.1 8B, 1,024 batched tokens and 1,024 sequences (the sampler phase above
    the forward's 1,024 x 55,296 x 2 B), H100 (132 SMs, cuBLAS's 32 MiB)."""
    llama = load_config(str(ROOT / "examples/models/llama-3.1-8b/config.json"))
    layers = import_layers(llama)
    logits = 1024 * LLAMA_VOCAB
    blocks = 1024 * -(-LLAMA_VOCAB // 1024) * 12  # gumbel_sample's int64 + float32 per block

    def peak(release: str) -> int:
        return estimate_overhead(llama, layers, 1, 1024, 1024, release,
                                 gpu_arch="hopper", gpu_sms=132).activation_peak_bytes  # fmt: skip

    # The V1 runner (0.20-0.22 for Llama): the forward's and the requests' hidden states
    # and their random stand-in, 14 B per logit, 132 float32 vocabulary rows.
    v1 = (1024 + 2 * 1024) * 4096 * 2 + logits * 14 + 132 * LLAMA_VOCAB * 4 + 32 * MIB
    assert peak("0.20.0") == peak("0.21.0") == peak("0.22.0") == v1
    # MRV2 (Llama from 0.23): no stand-in, no row buffer.
    hidden = (1024 + 1024) * 4096 * 2
    assert peak("0.23.0") == peak("0.25.0") == hidden + logits * 6 + blocks + 32 * MIB
    assert peak("0.26.0") == peak("0.31.0") == hidden + logits * 2 + blocks + 32 * MIB
    assert peak("vllm-0.33") == peak("vllm-0.34") == hidden + logits * 14 + 32 * MIB
    # A float32 model on MRV2 holds 2 B more per logit (and 4-byte hidden states).
    float32 = import_layers(llama, Deployment(dtype="float32"))
    wide = estimate_overhead(llama, float32, 1, 1024, 1024, "vllm-0.34", gpu_arch="hopper")
    assert wide.activation_peak_bytes == (1024 + 1024) * 4096 * 4 + logits * 16 + 32 * MIB
    # The row buffer belongs to the V1 runner's Triton kernel only.
    assert triton_row_buffer_bytes(profile_rules("0.21.0"), 1024, LLAMA_VOCAB, 132) > 0


@pytest.mark.parametrize(("release", "warmup"), [("0.32", False), ("0.33", True), ("0.34", True)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_model_runner_v2s_dummy_sampling_in_the_venvs(
    release: str, warmup: bool, dtype: str, tmp_path: Path
) -> None:
    """MRV2's own Sampler on the dummy batch (64 requests of Qwen's 151,936-token
    vocabulary), every tensor its Python code allocates counted: the default pass holds
    the logits and gumbel_sample's per-block results (12 B per 1,024 logits) and no
    float32 copy; 0.33-0.34's warm-up pass holds the float32 copy beside the logits when
    it hands them to FlashInfer's sampler, whose masked copy and probabilities (4 + 4,
    FlashInfer's source) make the 14 B kvplan counts."""
    side = str(Path(__file__).with_name("vllm_mrv2_sampler_side.py"))
    payload = {"rows": 64, "vocab": 151_936, "dtype": dtype, "warmup": warmup}
    answer = run_in_vllm(release, [side], payload, cache_root=tmp_path)
    logits_bytes = 2 if dtype == "bfloat16" else 4
    blocks = -(-151_936 // 1024) * 12 / 151_936
    assert answer["passes"]["default"] == pytest.approx(logits_bytes + blocks, abs=0.002)
    gumbel = next(call for call in answer["calls"] if call["call"] == "gumbel_sample")
    assert gumbel["dtype"] == f"torch.{dtype}"  # the logits themselves, not a copy
    rules = profile_rules(f"vllm-{release}")
    if not warmup:
        assert not any(call["call"] == "flashinfer_sample" for call in answer["calls"])
        assert rules.mrv2_sampler_bytes_per_logit == 2 and rules.mrv2_gumbel_blocks
        return
    fused = next(call for call in answer["calls"] if call["call"] == "flashinfer_sample")
    assert fused["dtype"] == "torch.float32" and fused["top_k"] and fused["top_p"]
    assert fused["held"] == pytest.approx(logits_bytes + 4, abs=0.002)
    # FlashInfer's top-k-first path then adds its masked copy and the probabilities.
    flashinfer_adds = 4 + 4
    assert round(fused["held"]) + flashinfer_adds == rules.mrv2_sampler_bytes_per_logit + (
        logits_bytes - 2)  # fmt: skip


@pytest.mark.parametrize("release", ["0.32", "0.33"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_v1_runners_two_dummy_passes_in_the_venvs(
    release: str, dtype: str, tmp_path: Path
) -> None:
    """The V1 runner's `Sampler` and `TopKTopPSampler.forward_cuda` on the profile's dummy
    batch (256 requests of a 151,936-token vocabulary), every allocation of vLLM's Python
    code counted: the first pass hands FlashInfer's sampler the float32 logits with 6 B
    per logit held (4 with float32 logits, which are that copy), to which FlashInfer's
    masked copy and probabilities add 8; the second, with a generator, holds 14 B (12)
    and the Triton wrapper's row buffer, 132 rows on an H100 (132 x 4 / 256 B per
    logit here)."""
    side = str(Path(__file__).with_name("vllm_v1_sampler_side.py"))
    payload = {"rows": 256, "vocab": 151_936, "dtype": dtype}
    answer = run_in_vllm(release, [side], payload, cache_root=tmp_path)
    saving = float32_logits_saving(4 if dtype == "float32" else 2)
    rules = profile_rules(f"vllm-{release}")
    (fused,) = answer["calls"]
    assert fused["dtype"] == "torch.float32"
    # (The per-request tensors, k, p, the temperature and the sampled ids, add under
    # 0.001 B per logit.)
    assert fused["held"] + 4 + 4 == pytest.approx(rules.sampler_bytes_per_logit - saving, abs=1e-3)
    assert answer["row_buffer_rows"] == [132]
    row_buffer = triton_row_buffer_bytes(rules, 256, 151_936, 132) / (256 * 151_936)
    first, second = answer["passes"]
    assert first == pytest.approx(rules.sampler_bytes_per_logit - saving - 8, abs=1e-3)
    assert second == pytest.approx(rules.sampler_bytes_per_logit - saving + row_buffer, abs=1e-3)
