"""Release-specific transients of the start-up profile that kvplan counts in the
memory outside the KV cache (weights.PROFILES): the sampler's sort in the releases
that sort by default (vLLM 0.11.1-0.16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplan.models.config import load_config
from kvplan.models.importer import import_layers
from kvplan.models.weights import (
    _SORT_SAMPLER,
    estimate_overhead,
    profile_rules,
    sampler_bytes_per_logit,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("release", "default_sorts", "sorts_without_flashinfer", "moe_workspace_held"),
    [
        ("0.10.2", False, True, False),
        ("0.11.0", False, True, False),  # FlashInfer's sampler by default where installed
        ("0.11.1", True, True, False),  # vllm#26859: FlashInfer's sampler opt-in
        ("0.12.0", True, True, False),
        ("0.13.0", True, True, True),  # fused MoE keeps its scratch in the workspace manager
        ("0.16.0", True, True, True),  # the last release without the Triton kernel
        ("0.17.0", False, False, True),  # vllm#33538's Triton kernel, the fallback too
        ("vllm-0.33", False, False, True),
    ],
)
def test_the_sampler_sorts_by_default_from_0_11_1_to_0_16(
    release: str, default_sorts: bool, sorts_without_flashinfer: bool, moe_workspace_held: bool
) -> None:
    rules = profile_rules(release)
    with_flashinfer = sampler_bytes_per_logit(rules, flashinfer=True)
    without = sampler_bytes_per_logit(rules, flashinfer=False)
    assert (with_flashinfer == _SORT_SAMPLER) == default_sorts, release
    assert (without == _SORT_SAMPLER) == sorts_without_flashinfer, release
    assert rules.moe_workspace_held == moe_workspace_held, release


def test_the_sort_window_shows_in_the_activation_peak() -> None:
    # Llama 3.1 8B, 8,192 batched tokens, 1,024 sequences: the sampler phase is the peak
    # (its logits outweigh the forward), so a sorting release's peak is exactly
    # 1,024 x 128,256 x (38 - 16) B above its neighbours'.
    llama = load_config(str(ROOT / "examples/models/llama-3.1-8b/config.json"))
    layers = import_layers(llama)
    peaks = {
        release: estimate_overhead(llama, layers, 1, 8192, 1024, release).activation_peak_bytes
        for release in ("0.11.0", "0.11.1", "0.16.0", "0.17.0")
    }
    extra = 1024 * 128_256 * (_SORT_SAMPLER - 16)
    assert peaks["0.11.1"] == peaks["0.16.0"] == peaks["0.11.0"] + extra
    assert peaks["0.17.0"] == peaks["0.11.0"]
    # FlashInfer missing changes nothing in the window: the release sorts anyway.
    sorted_without = estimate_overhead(llama, layers, 1, 8192, 1024, "0.13.0", flashinfer=False)
    assert sorted_without.activation_peak_bytes == peaks["0.16.0"]
