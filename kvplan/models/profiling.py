"""What each vLLM release's memory profiling counts beside the weights, by release.

The profile run's sampler phase (`sampler_bytes_per_logit`, the Triton row buffer, Model
Runner V2's pass), the memory outside torch (`non_torch_bytes`, custom all-reduce), the
CUDA-graph estimate the release subtracts before sizing the cache (`cudagraph_estimate`,
`graph_estimate_runs`, the capture sizes) and which model runner the release gives a
model (`default_runner_is_v2`). The differences between releases live here, in
`PROFILES` and the functions that read the release; `weights.estimate_overhead` adds
them to the config's own terms. Each figure names the source it was read in.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile

from kvplan.gpus import GIB, MIB
from kvplan.models.importer import ModelLayers


@dataclass(frozen=True)
class ProfileRules:
    """How one vLLM release measures the memory outside the KV cache at start-up.

    The figures that are not derived from the config are runtime constants, measured
    once and named here with their source (docs/capacity.md lists which calibration
    records set them and which only check them)."""

    name: str
    # The V1 model runner's dummy sampler run: its peak per logit (max_num_seqs x vocab
    # logits) on the release's default top-k/top-p path, with 16-bit model logits: those
    # 2 B are held beside the sampler's float32 copy (`float32_logits_saving`).
    # 0.17-0.20's Triton kernel: 14 B, read in 0.19.0's sampler and checked on its logs
    # (`_TRITON_SAMPLER`); 0.21-0.33 sample twice, FlashInfer's and then the Triton
    # path, 14 B each (`_V1_TWO_PASS_SAMPLER`). Model Runner V2 has its own figure
    # (`mrv2_sampler_bytes_per_logit`; docs/capacity.md, "What the sampler terms rest on").
    sampler_bytes_per_logit: int
    # Memory outside torch's allocator that appears during the profile run (cuBLAS
    # workspaces and lazily loaded kernels; with TP > 1 also NCCL communicators and
    # custom all-reduce buffers). vLLM 0.19 on H100 logged 0.25 GiB at TP 1 and
    # 2.07 GiB at TP 2 for Llama-3.1-8B (0.25-0.27 and 2.07-2.13 on the other records).
    non_torch_single_gpu: int
    non_torch_tensor_parallel: int
    # CUDA-graph memory the release subtracts from the KV budget before allocating it
    # (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, on by default from vLLM 0.20.0; read in
    # the 0.20.0-0.31.0 wheels and the 0.32-0.34 venvs). The V1 runner
    # (gpu_model_runner.profile_cudagraph_memory, the same from 0.20 to 0.33) captures
    # the two largest sizes of each mode into a throwaway pool and reports the larger
    # first capture + (n - 1) x the second capture's cost, per mode. Model Runner V2
    # measures nothing before 0.29 (`return 0`: `graph_estimate_runs`); from 0.29
    # (gpu/cudagraph_utils.py) it runs one throwaway `capture_model()`, every PIECEWISE
    # size measured whole, FULL sampled on the two largest and extrapolated the same
    # way (the pass's whole drop, less the two FULL samples, plus the first and
    # (n_full - 1) x the second, at least 1 MiB); 0.34 skips it under the extensible KV
    # cache. kvplan prices V2's estimate with the V1 costs below: V2's two logs need a
    # second FULL sample no rule from the source gives (docs/capacity.md, "Model
    # Runner V2's estimate, from its source"). Either way the graphs counted
    # are every PIECEWISE size and every FULL size up to max_num_seqs
    # (`cudagraph_capture_sizes`). A FULL (decode) graph's cost grows with its batch, a
    # PIECEWISE one's hardly: logs of a hybrid 27B model whose graphs stop at 16 tokens
    # estimate 23-35 MiB per PIECEWISE graph (club-3090#104 and #127, gpustack/runner#251:
    # 0.13 GiB for 5, 0.17 for 5, 0.36 for 16). So the estimate is modelled as
    # n_piecewise x `cudagraph_bytes_per_piecewise_graph` + n_full x largest_full x
    # `cudagraph_bytes_per_full_graph_token` (`cudagraph_estimate`); both 0 where the
    # release does not subtract. Set by two logged estimates of an 8B dense model
    # (hidden 4,096): 0.84 GiB with 51 PIECEWISE + 51 FULL graphs to 512 tokens
    # (vLLM 0.19, H100, max_num_seqs 1,024) and 0.52 GiB with 51 + 35 to 256 (vLLM 0.21,
    # RTX A5000, max_num_seqs 256; LMCache#3430). The other 0.19 records logged
    # 0.57-1.69 GiB at 51 + 51 (kvplan 0.84): off by up to 0.85 GiB per worker (Llama at
    # TP 2). Within 0.4 GiB on every TP 1 log; a per-piece model (layers + 1 graphs per
    # PIECEWISE size) was tried and did no better (docs/capacity.md, "The CUDA-graph
    # estimate"). A TP group without custom all-reduce adds
    # `cudagraph_bytes_per_nccl_all_reduce` per all-reduce captured. The hybrid GDN
    # models' profiling transient that 0.26-0.28 count as graph memory (vllm#50780) is
    # `gdn_graph_transient_per_context_token`.
    cudagraph_bytes_per_piecewise_graph: int
    cudagraph_bytes_per_full_graph_token: int
    # Where vLLM runs no custom all-reduce (`custom_all_reduce_on`), every TP all-reduce
    # inside a captured graph is an NCCL kernel (pynccl, the dispatch's last resort in
    # 0.19 and 0.32-0.34; FlashInfer's PCIe IPC all-reduce is opt-in, off by default).
    # NCCL keeps state outside torch's allocator for each collective a graph captures
    # (a persistent work plan per captured launch; NVIDIA/nccl#1234), which the graph
    # estimate counts: it reads free device memory before and after each sample. Per
    # all-reduce captured (`nccl_all_reduces_per_graph` x the graphs), fitted on the one
    # dense log with the graph counts and the estimate printed: four PCIe L40S at TP 4,
    # Qwen2.5-72B (161 all-reduces a graph, 51 PIECEWISE + 35 FULL graphs), 2.73 GiB
    # logged against 0.52 for the graphs themselves: 167 KiB (166.9-167.7 within the
    # log's rounding). The club-3090 logs of a 64-layer hybrid on four RTX 3090s
    # (custom all-reduce off the same way) check it (docs/capacity.md). The figure
    # depends on the driver and NCCL (vllm#5517: 3.81 GiB of graphs on A10G with CUDA
    # 12.2 drivers, 1.14 with 12.4, nothing else changed); 0 = none counted.
    cudagraph_bytes_per_nccl_all_reduce: int = 0
    # The sampler's peak per logit when FlashInfer is not installed, where the release
    # then sorts the logits with torch.sort (`_SORT_SAMPLER`); 0 = the default's figure
    # (from the Triton kernel, vllm#33538, the fallback is Triton, not a sort).
    no_flashinfer_sampler_bytes_per_logit: int = 0
    # Whether the fused-MoE scratch is still held while the sampler runs: vLLM's
    # workspace manager (vllm#27532 calls it new, 2025-11) keeps it; before it, the
    # kernels' intermediate caches were freed with the forward pass.
    moe_workspace_held: bool = True
    # Bytes per context token of the transient a hybrid GDN model's first FULL graph
    # sample allocates, which the V1 runner's graph estimate counts (vllm#50780; 0 =
    # none). `gdn_graph_transient` says which context that sample runs.
    gdn_graph_transient_per_context_token: int = 0
    # Whether the V1 runner's top-k/top-p kernel keeps a float32 row buffer of the
    # vocabulary per program, one program per SM (the Triton kernel of 0.17 onward,
    # `triton_row_buffer_bytes`).
    sampler_row_buffer: bool = False
    # Model Runner V2's dummy sampler run (vllm/v1/worker/gpu/), where the release makes
    # it the default for the model (`default_runner_is_v2`): its peak per logit with
    # 16-bit logits (`_MRV2_SAMPLER_*`), 0 where the release defaults to V1 for every
    # model. Its dummy requests are never added, so they are greedy with no top-k, top-p
    # or logprobs; what is held differs by release.
    mrv2_sampler_bytes_per_logit: int = 0
    # Whether MRV2's peak is its Gumbel-max pass (`gumbel_sample`), which adds an int64
    # argmax and a float32 maximum per 1,024-logit block of each row (`_GUMBEL_BLOCK`).
    mrv2_gumbel_blocks: bool = False


# The profile run samples every request with top-k and top-p. Without FlashInfer, V1
# up to 0.10 logs "FlashInfer is not available. Falling back to the PyTorch-native
# implementation of top-p & top-k sampling" and sorts the logits. Its peak is at
# torch.sort, per logit, with 128 or more requests:
# - what vLLM's code holds then, measured by running its PyTorch path in the CPU venvs
#   (tests/models/test_sampler_against_vllm.py): the model-dtype logits (2 B, bf16),
#   their float32 copy (4 B), the sorted values (4 B) and the int64 indices (8 B);
# - what torch.sort's CUDA kernel allocates besides, which no CPU run shows (PyTorch's
#   SortStable.cu, segmented_sort_pairs, taken from 128 rows): an int64 iota of source
#   indices (8 B) and cub's alternate key and value buffers (4 + 8 B).
# 38 B; later steps (the top-k/top-p masks, softmax, the scatter back) hold less. Under
# 128 rows torch sorts by a full sort with segment ids instead; not modelled apart.
# (vllm#32558's GPU benchmark, 256 x 131,072 logits: 1.25 GB on this path, 40 B per
# logit with the benchmark's own inputs.)
_SORT_HELD_PER_LOGIT = 18  # the CPU-measured part
_CUDA_SORT_WORKSPACE_PER_LOGIT = 8 + 4 + 8
_SORT_SAMPLER = _SORT_HELD_PER_LOGIT + _CUDA_SORT_WORKSPACE_PER_LOGIT
# 0.17-0.19 (read in 0.19.0's wheel: gpu_model_runner._dummy_sampler_run, Sampler,
# topk_topp_sampler, topk_topp_triton): with 8 or more requests the top-k/top-p masks
# are applied in place by vllm#33538's Triton kernel, so nothing is sorted. At the
# peak, `random_sample`, the run holds the model-dtype logits (2 B; the dummy run
# keeps them), their float32 copy (4 B), the softmax probabilities (4 B) and the
# exponential noise they are divided by (4 B): 14 B. A float32 model's logits are
# that float32 copy (`Sampler.forward`'s `.to(torch.float32)` returns the tensor it is
# given, and compute_logits returns the model dtype): 2 B less (`float32_logits_saving`).
_TRITON_SAMPLER = 2 + 4 + 4 + 4
# 0.21-0.33's V1 runner (read in the 0.21.0-0.31.0 wheels and the 0.32 / 0.33 venvs:
# gpu_model_runner._dummy_sampler_run, the same function in all of them) samples the
# dummy batch twice, the second time with one request's generator set, "to warm
# forward_native". FlashInfer's sampler is the default on CUDA from 0.21 (vllm#40376;
# `VLLM_USE_FLASHINFER_SAMPLER` unset reads as on), so the first pass runs
# `flashinfer_sample` on the float32 logits with the top-k as a tensor:
# `top_k_top_p_sampling_from_logits` (alike in FlashInfer 0.6.8.post1 to 0.7.2.post1,
# every version 0.20-0.33 pin) takes its top-k-first path without the integer-k fast
# path (0.6.14 on; an integer k only), `top_k_mask_logits` writes a float32 masked copy
# (`torch.empty_like`) and `torch.softmax` the probabilities: 2 + 4 + 4 + 4 = 14 B (and
# a cached 1 MiB row-state buffer, not counted). The second pass falls back to
# `forward_native` (FlashInfer takes no generators): the Triton masks in place, the
# softmax and `random_sample`'s exponential noise, 14 B as in 0.19, with the Triton
# kernel's row buffer allocated then and cached. The peak is 14 B + the row buffer. Run
# in the 0.32 / 0.33 venvs (tests/models/test_sampler_by_release.py): 6.00 B per logit
# held at FlashInfer's call, 16.06 at the second pass with 256 requests and 132 rows.
_V1_TWO_PASS_SAMPLER = 2 + 4 + 4 + 4
# Model Runner V2 (v1/worker/gpu/model_runner.py `_dummy_sampler_run`, the same function
# in 0.22.0-0.32, which 0.33-0.34 extend by a pass) computes the logits from the
# requests' own hidden states (no random stand-in) and calls its Sampler with
# `InputBatch.make_dummy`, whose first-pass requests were never
# added: temperature 0 (SamplingStates' zeroed buffers), top-k = vocab, top-p 1, no
# logprobs or penalties, so the pass is greedy and `gumbel_sample` takes the argmax.
# - 0.22-0.25: `apply_sampling_params` first copies the logits to float32
#   (`torch.empty_like(..., dtype=float32).copy_`): 2 + 4 = 6 B.
# - 0.26: the copy is made only to return raw logprobs; 0.27 skips the processing when no
#   request needs it (`_requires_logits_processing`), 0.28-0.34 the same by
#   `needs_logits_processing`: the model-dtype logits alone, 2 B.
# - 0.33-0.34 then run a second pass with `SamplingParams.for_sampler_warmup()` added to
#   every request (top-k 50, top-p 0.9, min-p, penalties, logit bias, 5 logprobs): the
#   float32 copy (4 B) beside the logits (2 B), then FlashInfer's fused sampler (no
#   request greedy or seeded; FlashInfer 0.7.2.post1 / 0.7.3's top-k-first path as
#   above: masked copy 4 B + probabilities 4 B): 14 B, the larger pass. Run on the CPU
#   in the 0.32-0.34 venvs (tests/models/test_sampler_by_release.py): 2.01 B per logit
#   at the default pass, 6.00 held when FlashInfer's sampler is called.
_MRV2_SAMPLER_FLOAT32_COPY = 2 + 4
_MRV2_SAMPLER_GREEDY = 2
_MRV2_SAMPLER_WARMUP_PASS = 2 + 4 + 4 + 4
# `gumbel_sample`'s per-row block results: an int64 index and a float32 (float64 with
# use_fp64_gumbel) maximum per 1,024 logits (BLOCK_SIZE, 0.22.0-0.34.0).
_GUMBEL_BLOCK = 1024
_GUMBEL_BLOCK_BYTES = 8 + 4
# The Triton kernel's float32 buffer of min(next_pow2(min(SMs, requests)), SMs) rows
# of the vocabulary, cached for the process (0.17.0-0.19.0 topk_topp_triton.py
# `apply_top_k_top_p_triton`: `num_compute_units`, which CudaPlatform answers with
# torch's `multi_processor_count`). SMs is the part's (gpus.py `sm_count`); where the
# part is not known, the H100 / H200's 132, the parts of the logs.
_DEFAULT_SAMPLER_SMS = 132
# PyTorch's cuBLAS workspace (CublasHandlePool.cpp `parseChosenWorkspaceSize`,
# unified with cuBLASLt's), allocated through the caching allocator by the first GEMM
# after the profile's baseline, so it is in the activation peak: 32 MiB on compute
# capability 9, 10 and 12 (Hopper, Blackwell), 8 MiB + 128 KiB before. The 0.19 H100
# logs leave 29-39 MiB above the sampler phase's tensors on every dense model.
CUBLAS_WORKSPACE_HOPPER = 32 * MIB
CUBLAS_WORKSPACE_OLDER = 8 * MIB + 128 * 1024


_NON_TORCH_TP1 = round(0.25 * GIB)
_NON_TORCH_TP = round(2.07 * GIB)
_PIECEWISE_GRAPH = round(7.1 * MIB)
_FULL_GRAPH_TOKEN = round(19.6 * 1024)
_NCCL_GRAPH_ALL_REDUCE = 167 * 1024
# The V0 worker counts as non-torch everything the device has in use outside torch's
# allocator after the profile run (mem_get_info's used bytes less torch's allocated),
# so its figure includes the process's own CUDA context, which V1 leaves out (its
# baseline is taken after the context exists): 0.35 GiB on an RTX 3090 in both
# vllm#10517 logs ("non_torch_memory=0.35GiB"), against V1's 0.25 on an H100.
_NON_TORCH_V0_TP1 = round(0.35 * GIB)
PROFILES: dict[str, ProfileRules] = {
    # V0 (vLLM <= 0.7, VLLM_USE_V1=0): graphs captured after the KV cache, outside it.
    "v0": ProfileRules("vLLM V0 engine", 16, _NON_TORCH_V0_TP1, _NON_TORCH_TP, 0, 0),
    # V1 up to 0.11.0 (checked on 0.10.2's log and 0.11.0's wheel): FlashInfer's sampler
    # when it is installed, else the sort; no MoE workspace manager yet.
    "v1-0.10": ProfileRules(
        "vLLM V1 <= 0.11.0",
        16,
        _NON_TORCH_TP1,
        _NON_TORCH_TP,
        0,
        0,
        no_flashinfer_sampler_bytes_per_logit=_SORT_SAMPLER,
        moe_workspace_held=False,
    ),
    # 0.11.1 to 0.16 sort the logits by default, FlashInfer installed or not: vllm#26859
    # (2025-10) made FlashInfer's sampler opt-in (VLLM_USE_FLASHINFER_SAMPLER=1) and
    # the Triton kernel (vllm#33538) first shipped in 0.17.0 (read in the wheels of
    # 0.11.0, 0.11.1, 0.12.0, 0.13.0, 0.14.1, 0.15.1, 0.16.0 and 0.17.0). Their own PyTorch path
    # holds 18 B per logit at the sort, as 0.32-0.34's does (measured the same way on
    # 0.11.1's, 0.13.0's and 0.16.0's function). The fused-MoE kernels keep their
    # scratch in the workspace manager from 0.13.0 (absent from 0.12.0's fused_moe).
    "v1-sort-0.12": ProfileRules(
        "vLLM V1 0.11.1-0.12 (sampler sorts)",
        _SORT_SAMPLER,
        _NON_TORCH_TP1,
        _NON_TORCH_TP,
        0,
        0,
        moe_workspace_held=False,
    ),
    "v1-sort": ProfileRules(
        "vLLM V1 0.13-0.16 (sampler sorts)", _SORT_SAMPLER, _NON_TORCH_TP1, _NON_TORCH_TP, 0, 0
    ),
    # V1 0.17 to 0.19: the Triton top-k/top-p kernel; the CUDA-graph estimate is logged
    # but not subtracted (0.19.0's own line: "To try it now, set
    # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1").
    "v1-0.19": ProfileRules(
        "vLLM V1 0.17-0.19",
        _TRITON_SAMPLER,
        _NON_TORCH_TP1,
        _NON_TORCH_TP,
        0,
        0,
        sampler_row_buffer=True,
    ),
    # From 0.20 the release subtracts its CUDA-graph estimate: 0.20.0 already does (the
    # stock vllm/vllm-openai:v0.20.0 image, no environment override, prints "CUDA graph
    # memory profiling is enabled ... equivalent to --gpu-memory-utilization=0.8878": a
    # public log the code index found, id 51830815744), although the line names 0.21 as
    # the default's first release. The rows below differ in the sampler (read in each
    # release's source: the comments above `_V1_TWO_PASS_SAMPLER` and `_MRV2_SAMPLER_*`)
    # and, 0.26-0.28, the GDN graph transient. Which runner a model gets is
    # `default_runner_is_v2`'s; on Model Runner V2 before 0.29, and under 0.34's
    # extensible cache, no graph estimate is made at all (`graph_estimate_runs`).
    # 0.20-0.21: the V1 runner for every model (VLLM_USE_V2_MODEL_RUNNER defaults to 0).
    # 0.20 samples once with the Triton kernel (FlashInfer's sampler still opt-in),
    # 0.21 twice (`_V1_TWO_PASS_SAMPLER`): 14 B and the row buffer either way.
    "v1-0.21": ProfileRules(
        "vLLM 0.20-0.21",
        _TRITON_SAMPLER,
        _NON_TORCH_TP1,
        _NON_TORCH_TP,
        _PIECEWISE_GRAPH,
        _FULL_GRAPH_TOKEN,
        cudagraph_bytes_per_nccl_all_reduce=_NCCL_GRAPH_ALL_REDUCE,
        sampler_row_buffer=True,
    ),
    # 0.22-0.25: MRV2 the default for some models; its sampler copies the logits to
    # float32 first.
    "v1-0.25": ProfileRules(
        "vLLM 0.22-0.25",
        _V1_TWO_PASS_SAMPLER,
        _NON_TORCH_TP1,
        _NON_TORCH_TP,
        _PIECEWISE_GRAPH,
        _FULL_GRAPH_TOKEN,
        cudagraph_bytes_per_nccl_all_reduce=_NCCL_GRAPH_ALL_REDUCE,
        sampler_row_buffer=True,
        mrv2_sampler_bytes_per_logit=_MRV2_SAMPLER_FLOAT32_COPY,
        mrv2_gumbel_blocks=True,
    ),
    # 0.26 to 0.28 on hybrid GDN models (Qwen3-Next, Qwen3.5 / 3.6), which stay on the V1
    # runner there: vllm#50780, the V1 runner's graph estimate counts a transient of its
    # first FULL sample, about 128 KiB per context token of that sample (the issue's
    # measurement on Qwen3.5-122B-A10B; the op that allocates it is not named there).
    # 0.29 made Model Runner V2 the default for every model (vllm#53183), whose estimate
    # runs no long-context sample (`gdn_graph_transient`).
    "v1-0.26": ProfileRules(
        "vLLM 0.26-0.28",
        _V1_TWO_PASS_SAMPLER,
        _NON_TORCH_TP1,
        _NON_TORCH_TP,
        _PIECEWISE_GRAPH,
        _FULL_GRAPH_TOKEN,
        cudagraph_bytes_per_nccl_all_reduce=_NCCL_GRAPH_ALL_REDUCE,
        gdn_graph_transient_per_context_token=128 * 1024,
        sampler_row_buffer=True,
        mrv2_sampler_bytes_per_logit=_MRV2_SAMPLER_GREEDY,
        mrv2_gumbel_blocks=True,
    ),
    # 0.29-0.32: MRV2 for every model; one greedy pass on the model-dtype logits.
    "v1-0.32": ProfileRules(
        "vLLM 0.29-0.32",
        _V1_TWO_PASS_SAMPLER,
        _NON_TORCH_TP1,
        _NON_TORCH_TP,
        _PIECEWISE_GRAPH,
        _FULL_GRAPH_TOKEN,
        cudagraph_bytes_per_nccl_all_reduce=_NCCL_GRAPH_ALL_REDUCE,
        sampler_row_buffer=True,
        mrv2_sampler_bytes_per_logit=_MRV2_SAMPLER_GREEDY,
        mrv2_gumbel_blocks=True,
    ),
    # 0.33 onward, the newest (what kvplan plans for where no release is named): MRV2's
    # second, warm-up-parameter pass through FlashInfer's sampler. 0.34 has no V1
    # runner left (gpu_model_runner.py is gone from its wheel); 0.33's V1 fields apply
    # only where a feature forces it.
    "v1": ProfileRules(
        "vLLM >= 0.33",
        _V1_TWO_PASS_SAMPLER,
        _NON_TORCH_TP1,
        _NON_TORCH_TP,
        _PIECEWISE_GRAPH,
        _FULL_GRAPH_TOKEN,
        cudagraph_bytes_per_nccl_all_reduce=_NCCL_GRAPH_ALL_REDUCE,
        sampler_row_buffer=True,
        mrv2_sampler_bytes_per_logit=_MRV2_SAMPLER_WARMUP_PASS,
    ),
}


def release_version(release: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of `0.19.0`, `vllm-0.33`, `v0.11.1rc2` (patch 0 where not
    given); None where it does not parse."""
    parts = release.removeprefix("vllm-").removeprefix("v").split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
    patch = "".join(takewhile(str.isdigit, parts[2])) if len(parts) > 2 else ""
    return major, minor, int(patch or 0)


def profile_rules(release: str) -> ProfileRules:
    """The profile rules of a release: `0.19.0`, `vllm-0.33`, `v0` (the V0 engine);
    "" or an unparseable release: the newest (what kvplan plans for)."""
    if release == "v0":
        return PROFILES["v0"]
    version = release_version(release)
    if version is None:
        return PROFILES["v1"]
    if version <= (0, 11, 0):
        return PROFILES["v1-0.10"]
    if version < (0, 13, 0):
        return PROFILES["v1-sort-0.12"]
    if version < (0, 17, 0):
        return PROFILES["v1-sort"]
    if version < (0, 20, 0):
        return PROFILES["v1-0.19"]
    if version < (0, 22, 0):
        return PROFILES["v1-0.21"]
    if version < (0, 26, 0):
        return PROFILES["v1-0.25"]
    if version < (0, 29, 0):
        return PROFILES["v1-0.26"]
    return PROFILES["v1-0.32"] if version < (0, 33, 0) else PROFILES["v1"]


# The TP group sizes vLLM's custom all-reduce accepts (CustomAllreduce
# _SUPPORTED_WORLD_SIZES, the same in 0.32-0.34): any other size turns it off.
CUSTOM_ALL_REDUCE_WORLD_SIZES = (2, 4, 6, 8, 16)


def custom_all_reduce_on(
    tensor_parallel_size: int, pcie_only_gpu: bool, disabled: bool = False
) -> bool:
    """Whether vLLM runs its custom all-reduce on a TP group, by the conditions kvplan
    can know from its inputs (vLLM 0.32-0.34's CustomAllreduce and CudaCommunicator):
    off at TP 1 (no group), with --disable-custom-all-reduce (`disabled`: no
    communicator is built), at a TP size it does not support, and on more than two GPUs
    of a part without NVLink (NVML reports no NVLink between the pairs). vLLM also
    turns it off where its P2P probe fails (consumer GPUs without a bridge often do) or
    the group spans nodes without MNNVL; kvplan cannot see either and assumes it on
    (`calibrate` reads vLLM's own WARNING from a log)."""
    if tensor_parallel_size <= 1 or disabled:
        return False
    if tensor_parallel_size not in CUSTOM_ALL_REDUCE_WORLD_SIZES:
        return False
    return not (pcie_only_gpu and tensor_parallel_size > 2)


def non_torch_bytes(rules: ProfileRules, custom_all_reduce: bool) -> int:
    """The non-torch memory the profile run leaves per worker: the release's TP figure
    (0.19's H100 logs, custom all-reduce on) where vLLM runs custom all-reduce
    (`custom_all_reduce_on`), else what one GPU leaves. Where it is off the ranks
    all-reduce through NCCL, no symmetric-memory communicator runs on the parts kvplan's
    logs come from (its size table lists capabilities 9.0 and 10.x only) and no
    NVSwitch carries NVLink SHARP buffers: the logs without custom all-reduce leave
    about the TP 1 figure (the L40S TP 4 record about 0.25 GiB, vllm#29070's four A30s
    0.09 GiB)."""
    return rules.non_torch_tensor_parallel if custom_all_reduce else rules.non_torch_single_gpu


def sampler_bytes_per_logit(rules: ProfileRules, flashinfer: bool = True) -> int:
    """The dummy sampler's peak per logit, with FlashInfer installed (vLLM's wheels
    require it from 0.11, its images ship it) or not."""
    if not flashinfer and rules.no_flashinfer_sampler_bytes_per_logit:
        return rules.no_flashinfer_sampler_bytes_per_logit
    return rules.sampler_bytes_per_logit


def triton_row_buffer_bytes(
    rules: ProfileRules, max_num_seqs: int, vocab: int, gpu_sms: int = 0
) -> int:
    """The float32 row buffer `rules`' top-k/top-p kernel keeps on the V1 runner (0 where
    it has none): one vocabulary row per program, min(next_pow2(min(SMs, requests)), SMs)
    rows with SMs the part's streaming multiprocessors (`gpu_sms`; 0: not known, 132),
    and no kernel at all under 8 requests (0.17-0.30 then sort a small batch in torch;
    0.31-0.33's `apply_top_k_top_p` takes Triton at any size, a buffer of at most 8 rows
    that is not counted). The allocation is the same in every wheel from 0.17.0 to
    0.33 (`apply_top_k_top_p_triton`)."""
    if not rules.sampler_row_buffer or max_num_seqs < 8:
        return 0
    sms = gpu_sms if gpu_sms > 0 else _DEFAULT_SAMPLER_SMS
    programs = min(sms, max_num_seqs)
    rows = min(1 << (programs - 1).bit_length(), sms)
    return rows * vocab * 4


def mrv2_sampler_bytes(rules: ProfileRules, max_num_seqs: int, vocab: int, act_bytes: int) -> int:
    """Model Runner V2's dummy sampler at its peak: `rules`' bytes per logit, which count
    16-bit logits, plus 2 per logit for float32 ones (MRV2 keeps the model-dtype logits
    and its float32 copy is `torch.empty_like(...).copy_`, a new tensor whatever the
    dtype: 0.33's venv holds 4.01 B per logit at the default pass and 8.00 before
    FlashInfer's with float32 logits, against 2.01 and 6.00 with bf16), and the Gumbel
    pass's per-block results where that pass is the peak."""
    per_logit = rules.mrv2_sampler_bytes_per_logit + (2 if act_bytes == 4 else 0)
    total = max_num_seqs * vocab * per_logit
    if rules.mrv2_gumbel_blocks:
        total += max_num_seqs * -(-vocab // _GUMBEL_BLOCK) * _GUMBEL_BLOCK_BYTES
    return total


def float32_logits_saving(act_bytes: int) -> int:
    """Bytes per logit a float32 model's sampler holds fewer than the rules' figure,
    which counts 16-bit model logits beside their float32 copy: compute_logits returns
    the model dtype, and the V1 runner's `Sampler.forward` (v1/sample/sampler.py,
    0.11-0.33; 0.34 has no V1 sampler) casts with `.to(torch.float32)`, which returns
    float32 logits themselves, so no copy is made: 2 B (the model-dtype 2 B go, the
    copy's 4 B stay). FlashInfer's pass (0.21-0.33) takes those float32 logits as they
    are. Model Runner V2 is the other way round (`mrv2_sampler_bytes`)."""
    return 2 if act_bytes == 4 else 0


def cublas_workspace_bytes(gpu_arch: str) -> int:
    """PyTorch's cuBLAS workspace on a part of `gpu_arch` (the catalog's): 32 MiB on
    Hopper and Blackwell, and where the part is not known; 8 MiB + 128 KiB on Ampere
    and Ada."""
    return CUBLAS_WORKSPACE_OLDER if gpu_arch in ("ampere", "ada") else CUBLAS_WORKSPACE_HOPPER


# vLLM's default capture list (config/vllm.py `_set_cudagraph_sizes`, read in the 0.20.0
# to 0.31.0 wheels and the 0.32-0.34 venvs): 1, 2, 4, multiples of 8 below 256, then of
# 16, up to min(2 x max_num_seqs, the platform cap, max_num_batched_tokens); the cap is
# 512, and 1,024 on data-centre Blackwell (`is_device_capability_family(100)`: B200,
# B300; from 0.28.0). Appended where within that cap: max_num_batched_tokens (from
# 0.20.1; 0.20.0 has the grid only) and max_num_seqs (from 0.31.0, its
# `uniform_decode_sizes`). FULL graphs (uniform decode, FULL_AND_PIECEWISE, the default
# mode) stop at max_num_seqs, under either model runner (V1's CudagraphDispatcher keys;
# V2's `CudaGraphManager._init_candidates`). Not modelled: speculative decoding's
# decode sizes (multiples of the query length).
_DEFAULT_MAX_CAPTURE = 512
_BLACKWELL_MAX_CAPTURE = 1024


def cudagraph_capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, release: str = "", gpu_arch: str = ""
) -> list[int]:
    """The PIECEWISE capture sizes `release` (kvplan's newest where "" or unparsed)
    captures on a part of `gpu_arch` (the catalog's; "blackwell" is B200 / B300)."""
    version = release_version(release)  # None for "" and "v0"

    def since(first: tuple[int, int, int]) -> bool:  # kvplan's newest has every rule
        return version is None or version >= first

    cap = _DEFAULT_MAX_CAPTURE
    if gpu_arch == "blackwell" and since((0, 28, 0)):
        cap = _BLACKWELL_MAX_CAPTURE
    largest = min(2 * max_num_seqs, cap, max_num_batched_tokens)
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
    extra = []
    if since((0, 20, 1)):
        extra.append(max_num_batched_tokens)
    if since((0, 31, 0)):
        extra.append(max_num_seqs)
    return sorted({size for size in [*grid, *extra] if size <= largest})


# Model Runner V2's default (VllmConfig.use_v2_model_runner with
# VLLM_USE_V2_MODEL_RUNNER unset; read in each wheel's config/vllm.py): none before
# 0.22; then `_is_default_v2_model_runner_model`, a generating model of a listed
# architecture (0.22-0.24) or, from 0.25, any dense one; from 0.29 every model (vllm
# #53183), on CUDA. The lists, by the release that changed them:
_V2_LIST_0_23 = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"})
_V2_MOE_0_24 = frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"})
_V2_LIST_0_26 = _V2_MOE_0_24 | {
    "InklingForCausalLM",
    "InklingForConditionalGeneration",
    "LongcatFlashNgramForCausalLM",
}
_V2_LIST_0_27 = _V2_LIST_0_26 | {"KimiK3ForConditionalGeneration"}
_V2_DEFAULT_ARCHITECTURES: tuple[tuple[tuple[int, int, int], frozenset[str]], ...] = (
    ((0, 22, 0), frozenset({"Qwen3ForCausalLM"})),
    ((0, 23, 0), _V2_LIST_0_23),
    ((0, 24, 0), _V2_LIST_0_23 | _V2_MOE_0_24),
    ((0, 25, 0), _V2_MOE_0_24),  # with any dense model
    ((0, 26, 0), _V2_LIST_0_26),
    ((0, 27, 0), _V2_LIST_0_27),
    ((0, 28, 0), _V2_LIST_0_27 | {"DeepseekV4ForCausalLM"}),
)


@dataclass(frozen=True)
class RunnerModel:
    """What a release's runner default reads of the model (vLLM's ModelConfig)."""

    architecture: str  # the config's architectures[0]
    moe: bool  # is_moe
    quantized: bool  # is_quantized: the checkpoint's method or --quantization
    state_layers: bool  # Mamba / GDN mixers (has_inner_state)
    attention_layers: bool  # with state layers: is_hybrid; without any: attention-free


def default_runner_is_v2(release: str, model: RunnerModel) -> bool:
    """Whether `release` runs `model` on Model Runner V2 by default (kvplan's newest
    where the release is "" or does not parse: V2). What kvplan cannot see is left
    out: the features that send an engine back to V1 (an ngram or suffix drafter,
    custom logits processors, prompt embeds, DBO, ...; ROCm's exclusions; no Triton)."""
    version = release_version(release)  # None for "" and "v0"
    if version is None:
        return release != "v0"
    if version < (0, 22, 0):
        return False  # VLLM_USE_V2_MODEL_RUNNER defaults to 0
    if version >= (0, 29, 0):
        return True
    listed = [names for since, names in _V2_DEFAULT_ARCHITECTURES if since <= version][-1]
    in_list = model.architecture in listed
    hybrid = model.state_layers and model.attention_layers
    attention_free = not model.attention_layers
    if version < (0, 24, 0):
        # 0.22 / 0.23: listed, dense and unquantized (0.22 also refuses Mamba state).
        return in_list and not model.moe and not model.quantized and not model.state_layers
    if version < (0, 25, 0):
        return in_list
    if attention_free or (hybrid and (version < (0, 27, 0) or not in_list)):
        return False  # 0.25 / 0.26 refuse every hybrid, 0.27 / 0.28 the unlisted ones
    return in_list or not model.moe


def graph_estimate_runs(
    release: str, use_v2_model_runner: bool, extensible_kv_cache: bool | None = None
) -> bool:
    """Whether `release`'s `profile_cudagraph_memory` measures anything on the runner
    (vLLM >= 0.20 subtracts what it returns; 0.18-0.19 log it; 0.17 and the V0 engine
    have none). The V1 runner's measures (two captures per mode, extrapolated). Model
    Runner V2's returns 0 before 0.29 (gpu/model_runner.py: `return 0`, "TBD whether
    we keep this API"): those engines subtract nothing for graphs. From 0.29 V2
    measures one throwaway `capture_model()` pass (gpu/cudagraph_utils.py
    `profile_cudagraph_memory`). 0.34 returns 0 under the extensible KV cache (on
    unless `num_gpu_blocks_override` or `kv_cache_memory_bytes` is set:
    `extensible_kv_cache` None), which sizes the cache after the real capture instead
    (extensible_kv_cache.py `measure_kv_cache_bytes`)."""
    if release == "v0":
        return False
    version = release_version(release)
    if version is None:
        return True  # kvplan's own rules: 0.33's, no extensible cache
    if version < (0, 18, 0):
        return False  # profile_cudagraph_memory first ships in 0.18.0
    if not use_v2_model_runner:
        return True
    if version < (0, 29, 0):
        return False
    if version >= (0, 34, 0):
        return extensible_kv_cache is False
    return True


def cudagraph_estimate(
    rules: ProfileRules,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    nccl_all_reduces: int = 0,
    release: str = "",
    gpu_arch: str = "",
) -> int:
    """The CUDA-graph memory `rules`' release subtracts before sizing the KV cache, with
    `nccl_all_reduces` NCCL all-reduces in each graph (`nccl_all_reduces_per_graph`),
    for the capture sizes of `release` on `gpu_arch` (`cudagraph_capture_sizes`)."""
    piecewise = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens, release, gpu_arch)
    full = [size for size in piecewise if size <= max_num_seqs]
    return graph_counts_estimate(rules, len(piecewise), len(full), max(full, default=0),
                                 nccl_all_reduces)  # fmt: skip


def graph_counts_estimate(
    rules: ProfileRules,
    piecewise_graphs: int,
    full_graphs: int,
    largest_full: int,
    nccl_all_reduces: int = 0,
) -> int:
    """`cudagraph_estimate` for the graph counts a log prints ("Profiling CUDA graph
    memory: PIECEWISE=N (largest=L), FULL=M (largest=K)"), which speculative decoding
    and explicit capture sizes change. Every graph, PIECEWISE or FULL, runs the whole
    forward, so each captures `nccl_all_reduces` all-reduces."""
    if min(piecewise_graphs, full_graphs, largest_full, nccl_all_reduces) < 0:
        raise ValueError("graph counts, sizes and all-reduces must be >= 0")
    return (
        piecewise_graphs * rules.cudagraph_bytes_per_piecewise_graph
        + full_graphs * largest_full * rules.cudagraph_bytes_per_full_graph_token
        + (piecewise_graphs + full_graphs)
        * nccl_all_reduces
        * rules.cudagraph_bytes_per_nccl_all_reduce
    )


def nccl_all_reduces_per_graph(decoder_layers: int, tensor_parallel_size: int,
                               custom_all_reduce: bool) -> int:  # fmt: skip
    """The NCCL all-reduces one captured graph holds: none at TP 1 or where vLLM runs
    its custom all-reduce (`custom_all_reduce_on`); else two per decoder layer (the
    row-parallel output of its attention or Mamba / GDN mixer, and of its MLP or MoE
    block) and one for the vocab-parallel embedding. The LM head's logits are gathered
    outside the graphs. A whole model's layers: at PP > 1 a stage holds fewer."""
    if tensor_parallel_size <= 1 or custom_all_reduce:
        return 0
    return 2 * decoder_layers + 1


def gdn_graph_transient(
    rules: ProfileRules,
    layers: ModelLayers,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    release: str = "",
    gpu_arch: str = "",
) -> int:
    """The transient `rules`' release counts as CUDA-graph memory on a hybrid GDN model
    (vllm#50780), 0 where it has none. The V1 runner (0.26-0.28 gpu_model_runner.
    profile_cudagraph_memory) runs its first FULL sample, the largest FULL decode size N
    (capture sizes from q to q x max_num_seqs, q = 1 + the drafter's tokens), with every
    request's context at min(max_model_len, max_num_batched_tokens // N); `_dummy_run`
    makes that batch min(max_num_seqs, ceil(N / q)) requests. The transient is that
    context times the per-token figure. The capture sizes are the ones without a
    drafter (`cudagraph_capture_sizes`, `release`'s on `gpu_arch`, the estimate's own
    list: 0.26-0.28 add no off-grid max_num_seqs, so their largest FULL size is the
    grid's)."""
    per_token = rules.gdn_graph_transient_per_context_token
    gdn = [layer for layer in layers.layers if layer.mamba_type == "GDN_ATTENTION"]
    if not per_token or not gdn:
        return 0
    query_len = 1 + gdn[0].num_speculative_blocks
    sizes = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens, release, gpu_arch)
    full = [size for size in sizes
            if query_len <= size <= query_len * max_num_seqs]  # fmt: skip
    largest_full = max(full, default=0)
    if not largest_full:
        return 0
    requests = min(max_num_seqs, -(-largest_full // query_len))
    context = min(max_model_len, max_num_batched_tokens // largest_full)
    return requests * context * per_token
