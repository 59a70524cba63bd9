"""Release-specific transients of the start-up profile that kvplan counts in the
memory outside the KV cache (profiling.PROFILES): the sampler's sort in the releases
that sort by default (vLLM 0.11.1-0.16), and the hybrid GDN models' transient that the
V1 runner's CUDA-graph estimate counts (0.26-0.28, vllm#50780)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplan.gpus import GIB
from kvplan.models.config import HFConfig, load_config
from kvplan.models.importer import Deployment, ModelLayers, Speculative, import_layers
from kvplan.models.profiling import (
    _SORT_SAMPLER,
    cudagraph_estimate,
    gdn_graph_transient,
    profile_rules,
    sampler_bytes_per_logit,
)
from kvplan.models.weights import estimate_overhead
from tests.vllm_envs import run_in_vllm

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
    # 1,024 x 128,256 x (38 - 16) B above 0.11.0's (FlashInfer's, assumed 16 B).
    llama = load_config(str(ROOT / "examples/models/llama-3.1-8b/config.json"))
    layers = import_layers(llama)
    peaks = {
        release: estimate_overhead(llama, layers, 1, 8192, 1024, release).activation_peak_bytes
        for release in ("0.11.0", "0.11.1", "0.16.0", "0.17.0")
    }
    extra = 1024 * 128_256 * (_SORT_SAMPLER - 16)
    assert peaks["0.11.1"] == peaks["0.16.0"] == peaks["0.11.0"] + extra
    # 0.17's Triton kernel holds 14 B per logit and its 132 float32 vocabulary rows.
    assert peaks["0.17.0"] == peaks["0.11.0"] - 1024 * 128_256 * 2 + 132 * 128_256 * 4
    # FlashInfer missing changes nothing in the window: the release sorts anyway.
    sorted_without = estimate_overhead(llama, layers, 1, 8192, 1024, "0.13.0", flashinfer=False)
    assert sorted_without.activation_peak_bytes == peaks["0.16.0"]


def _qwen36(speculative: Speculative | None = None) -> tuple[HFConfig, ModelLayers]:
    config = load_config(str(ROOT / "examples/models/qwen3.6-27b/config.json"))
    return config, import_layers(config, Deployment(speculative=speculative))


def test_the_gdn_graph_transient_is_counted_on_0_26_to_0_28_only() -> None:
    # vllm#50780: the V1 runner's first FULL sample (256 requests, the largest FULL size
    # at max_num_seqs 256) runs 32,768 // 256 = 128 tokens of context each: 32,768
    # context tokens x 128 KiB = 4.0 GiB, which outweighs the graphs' own 0.52 GiB.
    config, layers = _qwen36()
    per_token = profile_rules("0.26.0").gdn_graph_transient_per_context_token
    assert per_token == 128 * 1024
    graphs = cudagraph_estimate(profile_rules("0.26.0"), 256, 32_768)
    for release, counted in (("0.25.1", False), ("0.26.0", True), ("0.28.0", True),
                             ("0.29.0", False), ("vllm-0.33", False)):  # fmt: skip
        estimate = estimate_overhead(config, layers, 1, 32_768, 256, release, max_model_len=32_768)
        expected = 256 * 128 * per_token if counted else graphs
        assert estimate.cudagraph_bytes == estimate.cudagraph_logged_bytes == expected, release
    # A model without GDN layers has none, whatever the release: on the V1 runner its
    # graphs alone; by default 0.26 runs a dense model on Model Runner V2, whose
    # estimate before 0.29 is 0 (profiling.graph_estimate_runs).
    llama = load_config(str(ROOT / "examples/models/llama-3.1-8b/config.json"))
    dense = estimate_overhead(
        llama, import_layers(llama), 1, 32_768, 256, "0.26.0", use_v2_model_runner=False
    )
    assert dense.cudagraph_bytes == graphs
    assert (
        estimate_overhead(llama, import_layers(llama), 1, 32_768, 256, "0.26.0").cudagraph_bytes
        == 0
    )


def test_the_transient_shows_past_the_graphs_as_vllm_52872_logged() -> None:
    # vllm#52872 (64-layer GDN hybrid, RTX 5090): graph memory 0.52 GiB at 2,048 and
    # 4,096 batched tokens, 0.89 at 8,192. kvplan: the larger of its graph figure and the
    # transient, 0.52 / 0.52 / 1.00 GiB.
    config, layers = _qwen36()
    logged = {2048: 0.52, 4096: 0.52, 8192: 0.89}
    for batched, gib in logged.items():
        estimate = estimate_overhead(config, layers, 1, batched, 256, "0.27.0")
        assert abs(estimate.cudagraph_bytes / GIB - gib) <= 0.12, (batched, estimate)


def test_the_context_of_the_long_sample() -> None:
    rules = profile_rules("0.27.0")
    per_token = rules.gdn_graph_transient_per_context_token
    _, layers = _qwen36()
    # A short max_model_len caps each request's context: min(1,024, 32,768 // 256).
    assert gdn_graph_transient(rules, layers, 256, 32_768, 100) == 256 * 100 * per_token
    # With a drafter of 3 tokens the FULL decode sizes run to 4 x 256 tokens, capped at
    # 512: that batch is 512 / 4 = 128 requests, each with 32,768 // 512 = 64 tokens of
    # context (vLLM's dispatcher and _dummy_run; the side check below runs them).
    _, mtp = _qwen36(Speculative("mtp", 3))
    assert gdn_graph_transient(rules, mtp, 256, 32_768, 32_768) == 128 * 64 * per_token
    # A release whose estimate runs no long sample (Model Runner V2 from 0.29): nothing.
    assert gdn_graph_transient(profile_rules("vllm-0.33"), layers, 256, 32_768, 32_768) == 0


# (max_num_seqs, max_num_batched_tokens, max_model_len, drafter tokens): vllm serve's
# GPU default, vllm#50780's graph set (PIECEWISE=7, FULL=5: 16 sequences), a short
# max_model_len that caps the context, and an MTP drafter of 3 tokens.
GRAPH_PROFILE_CASES = [
    (256, 8192, 32_768, 0),
    (16, 32_768, 262_144, 0),
    (256, 8192, 20, 0),
    (256, 8192, 32_768, 3),
    (64, 4096, 32_768, 1),
]


@pytest.mark.parametrize("release", ["0.33"])
def test_the_long_sample_is_the_one_vllms_v1_profiler_takes(release: str) -> None:
    # vLLM's own V1 profile_cudagraph_memory (0.33 still ships the V1 runner, with the
    # same profiler as 0.26-0.28's but for a ROCm stream fix; 0.32's passes too): exactly
    # one sample asks for a context, the first FULL one, and its requests x context is
    # what kvplan charges per token.
    script = str(Path(__file__).with_name("vllm_graph_profile_side.py"))
    answers = run_in_vllm(release, [script], GRAPH_PROFILE_CASES, timeout=240)
    rules = profile_rules("0.27.0")
    per_token = rules.gdn_graph_transient_per_context_token
    for (seqs, tokens, max_len, spec), samples in zip(GRAPH_PROFILE_CASES, answers, strict=True):
        long = [sample for sample in samples if sample[3] is not None]
        assert len(long) == 1, (release, seqs, samples)
        mode, num_tokens, requests, context = long[0]
        full = [sample for sample in samples if sample[0] == "FULL"]
        assert mode == "FULL" and full[0] == long[0], samples
        assert samples[0][0] == "PIECEWISE"  # the PIECEWISE samples run first
        # The dispatcher's requests for that batch are _dummy_run's: ceil(N / q), capped.
        assert requests == min(seqs, -(-num_tokens // (1 + spec))), long[0]
        _, layers = _qwen36(Speculative("mtp", spec) if spec else None)
        ours = gdn_graph_transient(rules, layers, seqs, tokens, max_len)
        assert ours == requests * context * per_token, (release, seqs, tokens, long[0])


def test_a_plan_for_a_0_27_engine_reserves_the_transient() -> None:
    # The path `plan --model`, `capacity` and `calibrate` take: the release and the
    # length reach the estimate, and the transient lands in the non-KV memory.
    from kvplan.models.request import ModelPlanOptions, build_plan_request

    config, layers = _qwen36()

    def non_kv(release: str, max_model_len: int) -> int:
        options = ModelPlanOptions(
            gpu="H100",
            max_model_len=max_model_len,
            max_num_seqs=256,
            max_num_batched_tokens=32_768,
            engine_release=release,
        )
        return build_plan_request(config, options)[1].non_kv_bytes

    rules = profile_rules("0.27.0")
    graphs = cudagraph_estimate(rules, 256, 32_768)
    # 256 requests x min(max_model_len, 32,768 // 256 = 128) tokens of context.
    for max_model_len, context in ((8192, 128), (64, 64)):
        transient = gdn_graph_transient(rules, layers, 256, 32_768, max_model_len)
        assert transient == 256 * context * rules.gdn_graph_transient_per_context_token
        added = non_kv("0.27.0", max_model_len) - non_kv("0.25.1", max_model_len)
        assert added == transient - graphs, max_model_len


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_the_releases_kvplan_plans_for_run_gdn_models_on_model_runner_v2(
    release: str, tmp_path: Path
) -> None:
    # Why the `v1` row (0.29 on) has no transient: vllm#53183 (0.29.0) made Model Runner
    # V2, whose graph profiler takes no long-context sample, the default for every
    # model. 0.32 and 0.33 still ship the V1 runner and pick V2 for Qwen3.6-27B; 0.34
    # ships only V2.
    side = str(Path(__file__).with_name("vllm_runner_choice_side.py"))
    path = str(ROOT / "examples/models/qwen3.6-27b")
    answer = run_in_vllm(release, [side], {"path": path}, cache_root=tmp_path)
    if release == "0.34":
        assert answer["v1_runner_shipped"] is False, answer
    else:
        assert answer == {"v1_runner_shipped": True, "v2_by_default": True, "unsupported": []}
    assert profile_rules(f"vllm-{release}").gdn_graph_transient_per_context_token == 0
