"""Memory outside the KV cache, estimated from the config (stated as estimates).

Weights: a parameter count by architecture (embeddings, attention / MLA / Mamba / GDN
projections, dense or MoE MLPs, MTP modules) times bytes per parameter for the
checkpoint's quantization, divided over tensor-parallel ranks (vocab-parallel embeddings
and sharded projections); MoE routers are replicated on every rank, MXFP4 experts padded
per rank as vLLM's MoE kernel needs; norms are negligible and left out.

Runtime overhead: the profiling run's activation peak plus non-torch memory, with the
formula in `OVERHEAD_FORMULA`; pass `--non-kv-bytes` for a measured figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from itertools import takewhile

from kvplan.models.config import HFConfig, ModelConfigError
from kvplan.models.encoder import (
    EncoderProfile,
    MultimodalOptions,
    deepstack_buffer_bytes,
    encoder_profile,
    is_llava_tower,
    llava_feature_layers,
    llava_tower_family,
    llava_vision_layers,
)
from kvplan.models.importer import ARCHITECTURES, ModelLayers, pipeline_stage_bounds, text_config

GIB = 1 << 30
MIB = 1 << 20


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


def _release_version(release: str) -> tuple[int, int, int] | None:
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
    version = _release_version(release)
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


# A pipeline stage's profile run (vLLM 0.19's gpu_model_runner.profile_run and
# _dummy_run): only the last stage runs the dummy sampler (`is_last_rank`), and every
# stage but the first keeps the tensors it receives, `make_empty_intermediate_tensors`
# of max_num_batched_tokens rows: hidden states and residual (the Llama-style
# families), zeros in the model dtype, held for the process. Llama-3.1-8B at PP 2
# (0.19, H100): the last stage logs 2.01 GiB, 1.89 (its TP 1 figure) + 2 x 8,192 x
# 4,096 x 2 B (0.125 GiB).
_PP_RECEIVED_TENSORS = 2


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


def moe_workspace_per_token(c: HFConfig, tensor_parallel_size: int) -> int:
    """Elements per batched token of the fused-MoE scratch vLLM's workspace manager
    keeps (0.19's modular TritonExperts, `workspace_shapes` and
    `_allocate_buffers`): workspace13, top_k x max(activation output, hidden), which
    the output (hidden) shares, and workspace2, top_k x max(gate-up output, hidden).
    The gate-up output is 2 x the expert size per rank for a gated activation, 1 x for
    relu^2; the activation's output 1 x. Checked on 0.19's H100 logs: Mixtral-8x7B at
    TP 2 672 MiB and Qwen3-30B-A3B 512 MiB above the dense terms, against 673 and 519."""
    hidden = c.integer("hidden_size")
    expert = c.integer("moe_intermediate_size") if c.has("moe_intermediate_size") else 0
    expert = (expert or c.integer("intermediate_size")) // tensor_parallel_size
    top_k = c.opt_integer("num_experts_per_tok") or c.opt_integer("moe_topk") or 1
    gate_up = (_matrices(c) - 1) * expert
    return top_k * (max(expert, hidden) + max(gate_up, hidden))


OVERHEAD_FORMULA = (
    "activation_peak = cuBLAS workspace (32 MiB; 8 MiB before Hopper) + max(tokens x"
    " (3 x hidden + max(attention_per_rank, mlp_per_rank)) x act_bytes, (tokens + 2 x"
    " max_num_seqs) x hidden x act_bytes [+ the fused-MoE workspace, tokens x top_k x"
    " (max(expert/tp, hidden) + max(gate_up/tp, hidden)) x act_bytes, from 0.13, not with"
    " MXFP4's monolithic kernels] + max_num_seqs x vocab x B, the V1 runner's B: 14 from"
    " vLLM 0.17 (its Triton kernel, + min(next_pow2(min(SMs, max_num_seqs)), SMs) x vocab"
    " x 4 B of row buffer, SMs the GPU's, 132 when not known), 38 on PyTorch's sort"
    " (0.11.1-0.16, and <= 0.11.0 without FlashInfer), 16 on FlashInfer's (<= 0.11.0),"
    " - 2 with float32 logits, which are the sampler's float32 copy; on Model Runner V2"
    " (its default models from 0.22, every model from 0.29) the requests' hidden states"
    " once (tokens + max_num_seqs), B 6 (0.22-0.25) / 2 (0.26-0.32) + 12 B per"
    " 1,024-logit block, 14 (from 0.33), + 2 with float32 logits, no row buffer);"
    " mlp_per_rank = matrices x ffn / tp, or top_k x (matrices x expert_ffn / tp + hidden)"
    " for MoE;  non_torch = 2.07 GiB where vLLM runs custom all-reduce (TP 2, 4, 6, 8, 16;"
    " not --disable-custom-all-reduce; not TP > 2 on GPUs without NVLink), else 0.25 GiB;"
    " CUDA graphs (from vLLM 0.20; 0 on Model Runner V2 before 0.29 and under 0.34's"
    " extensible cache) = n_piecewise x 7.1 MiB + n_full x largest_full x 19.6 KiB"
    " (+ (n_piecewise + n_full) x (2 x layers + 1) x 167 KiB where TP > 1 runs without"
    " custom all-reduce: NCCL's captured all-reduces)"
    " (0.26-0.28 with GDN layers: at least the first FULL sample's context x 128 KiB);"
    " a vision model: max(encoder inputs + encoder forward, inputs + embeddings + the above)"
    " (Qwen3-VL's deepstack levels x max_num_batched_tokens x text hidden x act_bytes are"
    " built with the model: in the weights)"
)

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
    version = _release_version(release) if release not in ("", "v0") else None

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


def runner_model(
    config: HFConfig, layers: ModelLayers, quantization: str | None = None
) -> RunnerModel:
    c = text_config(config, layers.architecture)
    state = any(layer.is_state for layer in layers.layers)
    return RunnerModel(
        layers.architecture,
        bool(_expert_count(c)),
        _quantization(config, quantization)[0] != "none",
        state,
        any(not layer.is_state for layer in layers.layers),
    )


def default_runner_is_v2(release: str, model: RunnerModel) -> bool:
    """Whether `release` runs `model` on Model Runner V2 by default (kvplan's newest
    where the release is "" or does not parse: V2). What kvplan cannot see is left
    out: the features that send an engine back to V1 (an ngram or suffix drafter,
    custom logits processors, prompt embeds, DBO, ...; ROCm's exclusions; no Triton)."""
    version = _release_version(release) if release not in ("", "v0") else None
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
    version = _release_version(release)
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
) -> int:
    """The transient `rules`' release counts as CUDA-graph memory on a hybrid GDN model
    (vllm#50780), 0 where it has none. The V1 runner (0.26-0.28 gpu_model_runner.
    profile_cudagraph_memory) runs its first FULL sample, the largest FULL decode size N
    (capture sizes from q to q x max_num_seqs, q = 1 + the drafter's tokens), with every
    request's context at min(max_model_len, max_num_batched_tokens // N); `_dummy_run`
    makes that batch min(max_num_seqs, ceil(N / q)) requests. The transient is that
    context times the per-token figure. The capture sizes are the ones without a
    drafter (`cudagraph_capture_sizes`, `release`'s: 0.26-0.28 add no off-grid
    max_num_seqs, so their largest FULL size is the grid's)."""
    per_token = rules.gdn_graph_transient_per_context_token
    gdn = [layer for layer in layers.layers if layer.mamba_type == "GDN_ATTENTION"]
    if not per_token or not gdn:
        return 0
    query_len = 1 + gdn[0].num_speculative_blocks
    sizes = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens, release)
    full = [size for size in sizes
            if query_len <= size <= query_len * max_num_seqs]  # fmt: skip
    largest_full = max(full, default=0)
    if not largest_full:
        return 0
    requests = min(max_num_seqs, -(-largest_full // query_len))
    context = min(max_model_len, max_num_batched_tokens // largest_full)
    return requests * context * per_token


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # embeddings + lm head
    attention: int
    mlp: int  # dense MLPs and routed / shared experts
    state_space: int  # Mamba / GDN mixers
    draft: int  # MTP modules
    router: int = 0  # MoE routers: replicated on every rank
    vision: int = 0  # a multimodal wrapper's vision tower and projector

    @property
    def total(self) -> int:
        return (
            self.embedding + self.attention + self.mlp + self.state_space + self.draft
            + self.router + self.vision
        )  # fmt: skip


@dataclass(frozen=True)
class WeightEstimate:
    params: ParamCount
    quantization: str  # "none", "fp8", "awq-int4", "gptq-int4", "mxfp4"
    bytes_total: int
    bytes_per_worker: int  # the largest stage's rank: what limits the KV cache
    # One rank of each pipeline stage, first to last (one entry without PP).
    bytes_per_stage: tuple[int, ...] = ()
    rope_cache_bytes: int = 0  # in every rank's figure (RoPE cos/sin caches)
    # Buffers the model allocates when it is built, so "Model loading took" counts them
    # (in every rank's figure): Qwen3-VL's deepstack input buffers.
    model_buffer_bytes: int = 0

    def stage_bytes(self, stage: int) -> int:
        return self.bytes_per_stage[stage] if self.bytes_per_stage else self.bytes_per_worker


@dataclass(frozen=True)
class OverheadEstimate:
    activation_peak_bytes: int
    non_torch_bytes: int
    cudagraph_bytes: int = 0  # what the release subtracts for CUDA graphs
    # The estimate vLLM logs ("Estimated CUDA graph memory"), subtracted or not.
    cudagraph_logged_bytes: int = 0
    formula: str = OVERHEAD_FORMULA
    release: str = "vLLM >= 0.20"
    # A multimodal model's encoder run (in the activation peak), None where none runs.
    encoder: EncoderProfile | None = None
    # The part of `cudagraph_bytes` for NCCL all-reduces captured in the graphs (a TP
    # group without custom all-reduce; `nccl_all_reduces_per_graph`).
    cudagraph_nccl_bytes: int = 0
    # The graphs the engine goes on to capture, by the same per-graph costs, whether or
    # not the release subtracts an estimate first: what vLLM 0.34's extensible cache
    # finds used after capture (kvplan/models/extensible.py).
    cudagraph_captured_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.activation_peak_bytes + self.non_torch_bytes + self.cudagraph_bytes


def _attention_params(c: HFConfig) -> int:
    hidden = c.integer("hidden_size")
    heads = c.integer("num_attention_heads")
    if c.has("kv_lora_rank"):  # MLA
        nope = c.integer("qk_nope_head_dim")
        rope = c.integer("qk_rope_head_dim")
        v_dim = c.integer("v_head_dim")
        latent = c.integer("kv_lora_rank")
        q_rank = c.size_or_none("q_lora_rank")
        q = (
            hidden * heads * (nope + rope)
            if q_rank is None
            else hidden * q_rank + q_rank * heads * (nope + rope)
        )
        return (
            q + hidden * (latent + rope) + latent * heads * (nope + v_dim) + heads * v_dim * hidden
        )
    head_dim = c.integer("head_dim") if c.has("head_dim") else hidden // heads
    kv_heads = c.integer("num_key_value_heads") if c.has("num_key_value_heads") else heads
    # Qwen3-Next / Qwen3.5 gate the attention output: the query projection also emits a
    # gate per head (vLLM's Qwen3NextAttention, `attn_output_gate`, default true).
    gate = (
        heads
        if _GATED_ATTENTION.get(c.text("model_type", ""), False)
        and c.flag("attn_output_gate", True)
        else 0
    )
    return hidden * head_dim * (2 * heads + 2 * kv_heads + gate)


_GATED_ATTENTION = {"qwen3_next": True, "qwen3_5_text": True, "qwen3_5_moe_text": True}


def _expert_count(c: HFConfig) -> int:
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        size = c.size_or_none(key)  # 0 / null: a dense model
        if size:
            return size
    return 0


# Families (model_type) whose MLP is one up and one down projection, no gate: Phi-1 /
# 1.5 / 2's fc1 and fc2 (vLLM's PhiMLP, `n_inner` wide, else 4 x hidden: the published
# Phi configs' `intermediate_size`).
_TWO_MATRIX_MLP = frozenset({"phi"})


def _matrices(c: HFConfig) -> int:
    """Gated MLPs (SiLU/GELU) hold gate, up and down; Nemotron-H's relu^2 MLPs and
    experts and the `_TWO_MATRIX_MLP` families only up and down (vLLM's NemotronHMLP /
    its experts, PhiMLP)."""
    relu2 = c.has("mlp_hidden_act") and c.text("mlp_hidden_act") == "relu2"
    return 2 if relu2 or c.text("model_type", "") in _TWO_MATRIX_MLP else 3


def _mlp_params(c: HFConfig, layer: int) -> tuple[int, int]:
    """(MLP / expert parameters, router parameters) of one decoder layer."""
    hidden = c.integer("hidden_size")
    experts = _expert_count(c)
    matrices = _matrices(c)
    if c.has("interleave_moe_layer_step"):  # Llama 4: MoE layers + a shared expert
        step = c.integer("interleave_moe_layer_step", minimum=0)
        if step == 0 or (layer + 1) % step:
            return 3 * hidden * c.integer("intermediate_size_mlp"), 0
        expert_size = c.integer("intermediate_size")
        return (experts + 1) * 3 * hidden * expert_size, hidden * experts
    dense_first = c.integer("first_k_dense_replace", 0, minimum=0)
    if c.has("expert_layer_period"):  # Jamba: experts every period-th layer from offset
        period = c.integer("expert_layer_period")
        if layer % period != c.integer("expert_layer_offset", 0, minimum=0):
            experts = 0
    if experts and layer >= dense_first:
        expert_size = (
            c.integer("moe_intermediate_size")
            if c.has("moe_intermediate_size")
            else c.integer("intermediate_size")
        )
        shared_count = c.integer("n_shared_experts", 0, minimum=0)
        # The shared expert's own size field where the config has one (Nemotron-H:
        # moe_shared_expert_intermediate_size; Qwen2/3-MoE: shared_expert_intermediate_size,
        # 0 = none); DeepSeek's n_shared_experts are routed-expert sized.
        shared_size = c.size_or_none("moe_shared_expert_intermediate_size")
        if shared_size is not None:
            shared = max(shared_count, 1) * matrices * hidden * shared_size
        elif shared_count:
            shared = shared_count * matrices * hidden * expert_size
        else:
            single = c.size_or_none("shared_expert_intermediate_size")
            shared = matrices * hidden * single if single else 0
        return experts * matrices * hidden * expert_size + shared, hidden * experts
    return matrices * hidden * c.integer("intermediate_size"), 0


def _state_params(c: HFConfig, kind: str) -> int:
    hidden = c.integer("hidden_size")
    if kind == "GDN_ATTENTION":
        k = c.integer("linear_num_key_heads") * c.integer("linear_key_head_dim")
        v = c.integer("linear_num_value_heads") * c.integer("linear_value_head_dim")
        return (
            hidden * (2 * k + 2 * v) + hidden * 2 * c.integer("linear_num_value_heads") + v * hidden
        )
    if kind == "MAMBA1":
        inner = c.integer("mamba_expand") * hidden
        rank = c.integer("mamba_dt_rank") if c.has("mamba_dt_rank") else -(-hidden // 16)
        state = c.integer("mamba_d_state")
        return (
            hidden * 2 * inner
            + inner * (rank + 2 * state)
            + rank * inner
            + inner * state
            + inner * hidden
        )
    inner = c.integer("mamba_num_heads") * c.integer("mamba_head_dim")
    groups = c.integer("n_groups")
    state = c.integer("ssm_state_size")
    in_proj = hidden * (2 * inner + 2 * groups * state + c.integer("mamba_num_heads"))
    return in_proj + inner * hidden


def _whisper_params(c: HFConfig) -> ParamCount:
    d = c.integer("d_model")
    encoder = c.integer("encoder_layers") * (4 * d * d + 2 * d * c.integer("encoder_ffn_dim"))
    encoder += 3 * d * (c.integer("num_mel_bins") + d)  # the two conv stem layers
    decoder = c.integer("decoder_layers") * (8 * d * d + 2 * d * c.integer("decoder_ffn_dim"))
    positions = (c.integer("max_source_positions") + c.integer("max_target_positions")) * d
    embedding = c.integer("vocab_size") * d + positions  # the output projection is tied
    # Encoder and decoder blocks (attention and MLP together) are counted as attention.
    return ParamCount(embedding, encoder + decoder, mlp=0, state_space=0, draft=0)


_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)


def padded_vocab(vocab: int) -> int:
    """The rows vLLM builds for a vocab-parallel embedding or LM head: the vocabulary
    rounded up to `_VOCAB_PADDING` (`pad_vocab_size` in vLLM's
    vocab_parallel_embedding.py), then split over the TP ranks. Granite 3.3's 49,159
    tokens become 49,216 rows; the other shipped decoder-only vocabularies are
    multiples of 64 (Whisper's token table is a plain `nn.Embedding`: not padded)."""
    return -(-vocab // _VOCAB_PADDING) * _VOCAB_PADDING


def count_params(config: HFConfig, layers: ModelLayers) -> ParamCount:
    c = text_config(config, layers.architecture)
    if layers.encoder_decoder:
        return _whisper_params(c)
    hidden = c.integer("hidden_size")
    vocab = padded_vocab(c.integer("vocab_size"))
    tied = c.flag("tie_word_embeddings", False)
    embedding = vocab * hidden * (1 if tied else 2)
    attention = mlp = state = draft = 0
    count = c.integer("num_hidden_layers")
    mamba_kinds = [layer.mamba_type for layer in layers.layers if layer.is_state]
    mamba_kind = mamba_kinds[0] if mamba_kinds else ""
    router = 0
    attention_layers = sum(
        1 for layer in layers.layers if not layer.is_draft and not layer.is_state
    )
    attention = attention_layers * _attention_params(c)
    state = len(mamba_kinds) * _state_params(c, mamba_kind) if mamba_kinds else 0
    pattern = c.text("hybrid_override_pattern", "") if c.has("hybrid_override_pattern") else ""
    for index in range(count):
        if pattern:
            if pattern[index] == "E":
                layer_mlp, layer_router = _mlp_params(c, index)
                mlp, router = mlp + layer_mlp, router + layer_router
            elif pattern[index] == "-":
                mlp += _matrices(c) * hidden * c.integer("intermediate_size")
            continue
        layer_mlp, layer_router = _mlp_params(c, index)
        mlp, router = mlp + layer_mlp, router + layer_router
    nextn = layers.num_nextn_predict_layers
    if nextn:
        draft = nextn * (_attention_params(c) + sum(_mlp_params(c, count)) + 2 * hidden * hidden)
    # A multimodal checkpoint's vision tower is loaded too (vLLM builds the whole
    # *ForConditionalGeneration model).
    return ParamCount(
        embedding, attention, mlp, state, draft, router, _vision_params(config, hidden)
    )


# Families whose vLLM model builds the embeddings only on the first pipeline stage and
# the LM head only on the last (LlamaModel, Qwen2Model, GraniteModel and DeepSeek-V2's
# `is_first_rank` / `is_last_rank` checks, and the models built on them); with tied embeddings the
# last stage builds its own copy for the head. Every other family builds both on every
# stage (vLLM 0.32-0.34: Mixtral, Qwen3-MoE, Gemma 2 / 3, gpt-oss, Qwen3-Next,
# Nemotron-H, Jamba). tests/models/test_against_vllm_pp.py counts vLLM's own modules.
_PP_EMBEDDINGS_AT_THE_ENDS = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "GraniteForCausalLM", "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "LlavaNextForConditionalGeneration", "LlavaForConditionalGeneration",
    "KimiVLForConditionalGeneration",
})  # fmt: skip
# Qwen3.5 / 3.6 build the embedding on every stage and the LM head on the last only
# (a tied head shares the last stage's embedding).
_PP_HEAD_ON_THE_LAST = frozenset({
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
})  # fmt: skip


def _decoder_layer_params(c: HFConfig, layers: ModelLayers) -> list[ParamCount]:
    """Each decoder layer's attention / mixer, MLP and router parameters, as
    `count_params` counts them (their sum is its attention + state + MLP + router)."""
    hidden = c.integer("hidden_size")
    count = c.integer("num_hidden_layers")
    attention_at = {layer.decoder_index for layer in layers.layers
                    if not layer.is_draft and not layer.is_state}  # fmt: skip
    state_kinds = {layer.decoder_index: layer.mamba_type for layer in layers.layers
                   if layer.is_state and not layer.is_draft}  # fmt: skip
    attention = _attention_params(c)
    pattern = c.text("hybrid_override_pattern", "") if c.has("hybrid_override_pattern") else ""
    result = []
    for index in range(count):
        mlp = router = 0
        if not pattern or pattern[index] == "E":
            mlp, router = _mlp_params(c, index)
        elif pattern[index] == "-":
            mlp = _matrices(c) * hidden * c.integer("intermediate_size")
        state = _state_params(c, state_kinds[index]) if index in state_kinds else 0
        result.append(ParamCount(0, attention if index in attention_at else 0, mlp, state, 0,
                                 router))  # fmt: skip
    return result


def stage_params(
    config: HFConfig, layers: ModelLayers, bounds: list[tuple[int, int]]
) -> list[ParamCount]:
    """The parameters each pipeline stage builds, for stages holding decoder layers
    [start, end): its layers, the embeddings where the family's vLLM model builds them
    (`_PP_EMBEDDINGS_AT_THE_ENDS`), MTP modules on the last stage and the vision tower
    on every stage (vLLM builds it without a stage check). One stage: `count_params`."""
    if len(bounds) == 1:
        return [count_params(config, layers)]
    c = text_config(config, layers.architecture)
    total = count_params(config, layers)
    table = padded_vocab(c.integer("vocab_size")) * c.integer("hidden_size")
    per_layer = _decoder_layer_params(c, layers)
    vision = _vision_params(config, c.integer("hidden_size"))
    stages = []
    for stage, (start, end) in enumerate(bounds):
        first, last = stage == 0, stage == len(bounds) - 1
        if layers.architecture in _PP_EMBEDDINGS_AT_THE_ENDS:
            embedding = table * (first + last)
        elif layers.architecture in _PP_HEAD_ON_THE_LAST:
            embedding = table * (1 + (last and not c.flag("tie_word_embeddings", False)))
        else:  # both tables (one if tied) on every stage
            embedding = total.embedding
        mine = per_layer[start:end]
        stages.append(ParamCount(
            embedding,
            sum(p.attention for p in mine),
            sum(p.mlp for p in mine),
            sum(p.state_space for p in mine),
            total.draft if last else 0,
            sum(p.router for p in mine),
            vision,
        ))  # fmt: skip
    return stages


def _qwen3_vision_params(vision: HFConfig) -> int:
    """Qwen3-VL's vision transformer, which Qwen3.5 / 3.6 load (vLLM's
    Qwen3_VisionTransformer): a Conv3d patch embedding, a learned position table, per
    block two LayerNorms, a fused QKV and an output projection and a two-matrix MLP
    (all with biases), then the patch merger (a LayerNorm and two linears over
    `spatial_merge_size`^2 patches into the text width) and one more merger per
    deepstack level."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    stem = vision.integer("in_channels", 3) * vision.integer("temporal_patch_size", 2)
    stem = stem * patch * patch * width + width
    positions = vision.integer("num_position_embeddings") * width
    block = 4 * width + 4 * width * width + 4 * width + 2 * width * inter + inter + width
    merged = width * vision.integer("spatial_merge_size", 2) ** 2
    out = vision.integer("out_hidden_size")
    merger = merged * merged + merged + merged * out + out
    deepstack = len(vision.items("deepstack_visual_indexes") or [])
    return (
        stem + positions + vision.integer("depth") * block
        + (merger + 2 * width) + deepstack * (merger + 2 * merged)
    )  # fmt: skip


def _qwen2_5_vision_params(vision: HFConfig) -> int:
    """Qwen2.5-VL's windowed vision transformer (vLLM's Qwen2_5_VisionTransformer): a
    Conv3d patch embedding without bias, per block two RMSNorms, a fused QKV and an
    output projection and a gated MLP (all with biases), then the patch merger (an
    RMSNorm and two linears over `spatial_merge_size`^2 patches into the text width)."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    stem = vision.integer("in_channels", 3) * vision.integer("temporal_patch_size", 2)
    stem = stem * patch * patch * width
    block = 2 * width + 4 * width * width + 4 * width + 3 * width * inter + 2 * inter + width
    merged = width * vision.integer("spatial_merge_size", 2) ** 2
    out = vision.integer("out_hidden_size")
    merger = width + merged * merged + merged + merged * out + out
    return stem + vision.integer("depth") * block + merger


def _llama4_vision_params(vision: HFConfig, text_hidden: int) -> int:
    """Llama 4's vision model (vLLM's Llama4VisionModel: an unfold patch embedding
    without bias, a class embedding and a position embedding per patch and CLS, pre and
    post LayerNorms, per layer Q/K/V/O and a two-matrix MLP with biases and two
    LayerNorms, the pixel-shuffle adapter's two bias-free linears) and the projector
    into the text width (Llama4MultiModalProjector, no bias)."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    patches = (vision.integer("image_size") // patch) ** 2 + 1
    stem = vision.integer("num_channels", 3) * patch * patch * width + width + patches * width
    layer = 4 * width * width + 4 * width + 2 * width * inter + inter + width + 4 * width
    projector_in = vision.integer("projector_input_dim")
    adapter = inter * projector_in + projector_in * vision.integer("projector_output_dim")
    projector = vision.integer("vision_output_dim") * text_hidden
    return stem + 4 * width + vision.integer("num_hidden_layers") * layer + adapter + projector


def _llava_tower_stem_params(vision: HFConfig) -> int:
    """The tower's parameters outside its encoder layers (vLLM's siglip.py / clip.py
    embeddings), by family (encoder.LLAVA_TOWERS): the patch convolution (SigLIP's with
    a bias), a position embedding per patch and for CLIP's class token, CLIP's class
    embedding and its pre-layernorm (`pre_layrnorm`)."""
    family = llava_tower_family(vision)
    width = vision.integer("hidden_size")
    patch = vision.integer("patch_size")
    positions = (vision.integer("image_size") // patch) ** 2 + family.class_token
    conv = vision.integer("num_channels", 3) * patch * patch * width + family.conv_bias * width
    return conv + positions * width + family.class_token * width + family.pre_norm * 2 * width


def _llava_vision_params(config: HFConfig, vision: HFConfig, text_hidden: int) -> int:
    """A LLaVA wrapper's tower and projector as vLLM builds them (llava.py
    `init_vision_tower_for_llava`, llava_next.py): the encoder layers up to the deepest
    feature layer only, per layer Q/K/V/O and fc1 / fc2 with biases and two LayerNorms
    (SigLIP and CLIP alike); the stem (`_llava_tower_stem_params`); the two-layer
    projector from the concatenated feature layers (LLaVA-Next with a list; one layer's
    width otherwise), with biases unless `multimodal_projector_bias` is false; and
    LLaVA-Next's image-newline vector."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    layer = 4 * width * width + 2 * width * inter + 9 * width + inter
    features = llava_feature_layers(config)
    bias = 2 * text_hidden if config.flag("multimodal_projector_bias", True) else 0
    projector = features * width * text_hidden + text_hidden * text_hidden + bias
    newline = text_hidden if config.text("model_type", "") == "llava_next" else 0
    return (
        llava_vision_layers(config, vision) * layer + _llava_tower_stem_params(vision)
        + projector + newline
    )  # fmt: skip


def replicated_params(config: HFConfig, layers: ModelLayers, stage_layers: int) -> int:
    """Parameters vLLM builds whole on every tensor-parallel rank, besides the MoE
    routers: MLA's down projections (deepseek_v2.py: `kv_a_proj_with_mqa` and, with a
    `q_lora_rank`, `q_a_proj`, fused as DeepSeekV2FusedQkvAProjLinear with
    `disable_tp=True`; ReplicatedLinear otherwise), per MLA layer of the stage; and
    Kimi-VL's MoonViT parts outside its parallel linears' sharded weights (moonvit.py,
    kimi_vl.py: the patch convolution, the position grid, the LayerNorms, the biases of
    the row-parallel `wo` and `fc1`, and the projector's ReplicatedLinear layers); and a
    LLaVA tower's (`_llava_whole_params`). Counted for unquantized checkpoints."""
    c = text_config(config, layers.architecture)
    whole = 0
    if c.has("kv_lora_rank"):
        hidden = c.integer("hidden_size")
        latent = c.integer("kv_lora_rank") + c.integer("qk_rope_head_dim")
        q_rank = c.size_or_none("q_lora_rank")
        whole += stage_layers * hidden * (latent + (q_rank or 0))
    vision = config.sub("vision_config")
    if vision is not None and config.text("model_type", "") == "kimi_vl":
        width = vision.integer("hidden_size")
        inter = vision.integer("intermediate_size")
        # sharded: the QKV, output and MLP matrices and the column-parallel biases (QKV,
        # fc0); the row-parallel ones' biases (wo, fc1) and the LayerNorms stay whole
        layer = 4 * width * width + 2 * width * inter + 3 * width + inter
        parallel = vision.integer("num_hidden_layers") * layer
        whole += _moonvit_params(vision, c.integer("hidden_size")) - parallel
    if vision is not None and is_llava_tower(config):
        whole += _llava_whole_params(config, vision, c.integer("hidden_size"))
    return whole


def _llava_whole_params(config: HFConfig, vision: HFConfig, text_hidden: int) -> int:
    """A LLaVA tower's parameters vLLM keeps whole on every tensor-parallel rank (its
    tower shards across the TP group unless `mm_encoder_tp_mode` is "data", which kvplan
    does not read): the stem (the patch convolution, position and class embeddings and
    CLIP's pre-layernorm are plain modules), per built layer the two LayerNorms and the
    row-parallel biases (out_proj, fc2), the projector's row-parallel linear_2 bias and
    LLaVA-Next's newline vector. 1,345,536 parameters for llava-v1.6-mistral-7b-hf."""
    width = vision.integer("hidden_size")
    layers = llava_vision_layers(config, vision) * 6 * width
    bias = text_hidden if config.flag("multimodal_projector_bias", True) else 0
    newline = text_hidden if config.text("model_type", "") == "llava_next" else 0
    return _llava_tower_stem_params(vision) + layers + bias + newline


def _moonvit_params(vision: HFConfig, text_hidden: int) -> int:
    """Kimi-VL's MoonViT and projector as vLLM builds them (moonvit.py, kimi_vl.py): the
    patch convolution with its bias and a learnable init_pos_emb_height x width position
    grid; per layer two LayerNorms, the fused QKV and the output projection with biases
    and the two-matrix MLP with biases; the final LayerNorm; the projector's LayerNorm
    and its two linears from the merged patches (hidden x the merge kernel's area)."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    layer = 4 * width * width + 2 * width * inter + 9 * width + inter
    positions = vision.integer("init_pos_emb_height") * vision.integer("init_pos_emb_width")
    stem = 3 * patch * patch * width + width + positions * width
    kernel = [int(k) for k in vision.items("merge_kernel_size") or [2, 2]]
    merged = width * kernel[0] * kernel[1]
    projector = 2 * width + merged * merged + merged + merged * text_hidden + text_hidden
    return vision.integer("num_hidden_layers") * layer + stem + 2 * width + projector


def _vision_params(config: HFConfig, text_hidden: int) -> int:
    """A SigLIP vision tower (Gemma 3's `vision_config`) and its projection into the
    text model: per encoder layer Q/K/V/O and a two-matrix MLP (with biases), the
    patch embedding and a position embedding per patch; or Qwen3-VL's, which Qwen3.5 /
    3.6 load too (`_qwen3_vision_params`); Qwen2.5-VL's (`_qwen2_5_vision_params`);
    Llama 4's (`_llama4_vision_params`); a LLaVA wrapper's SigLIP or CLIP tower
    (`_llava_vision_params`); Kimi-VL's MoonViT (`_moonvit_params`). Other vision towers
    are not counted (none of the supported families has one)."""
    vision = config.sub("vision_config")
    model_type = config.text("model_type", "")
    if vision is not None and model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_vl"):
        return _qwen3_vision_params(vision)
    if vision is not None and model_type == "qwen2_5_vl":
        return _qwen2_5_vision_params(vision)
    if vision is not None and model_type == "llama4":
        return _llama4_vision_params(vision, text_hidden)
    if vision is not None and is_llava_tower(config):
        return _llava_vision_params(config, vision, text_hidden)
    if vision is not None and model_type == "kimi_vl":
        return _moonvit_params(vision, text_hidden)
    if vision is None or vision.text("model_type", "") != "siglip_vision_model":
        return 0
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    layer = 4 * width * width + 2 * width * inter + 6 * width + inter
    patch = vision.integer("patch_size")
    patches = (vision.integer("image_size") // patch) ** 2
    stem = 3 * patch * patch * width + width + patches * width
    return vision.integer("num_hidden_layers") * layer + stem + width * text_hidden


# Families whose vLLM attention has no rotary embedding (Mamba layers carry position).
_NO_ROPE = frozenset({"JambaForCausalLM", "NemotronHForCausalLM",
                      "WhisperForConditionalGeneration"})  # fmt: skip


def _positive_number(c: HFConfig, key: str, default: float) -> float:
    value = c.raw(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ModelConfigError(f"expected a positive number, got {value!r}", c._where(key))
    return float(value)


def rope_cache_bytes(config: HFConfig, layers: ModelLayers) -> int:
    """The RoPE cos/sin caches vLLM builds with the model, on every rank: not
    parameters, but loaded with them ("Model loading took" counts them: Llama 3.1 8B's
    14.99 GiB against 14.96 of parameters). One cache per distinct rotary embedding
    (get_rope shares it between layers): positions x rotary dims in the model dtype
    (gpt-oss's in float32). Positions: max_position_embeddings, times the factor for
    linear / dynamic scaling, original_max_position_embeddings times the factor for
    YaRN. Gemma 3 holds a second, unscaled cache for its local layers. Checked against
    vLLM 0.34's model classes (tests/models/test_against_vllm_pp.py)."""
    if layers.architecture in _NO_ROPE:
        return 0
    c = text_config(config, layers.architecture)
    positions = c.opt_integer("max_position_embeddings") or layers.derived_max_model_len
    hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
    if c.has("kv_lora_rank"):  # MLA: only the rope part of each head rotates
        dims = c.integer("qk_rope_head_dim")
    else:
        head_dim = c.integer("head_dim") if c.has("head_dim") else hidden // heads
        dims = int(head_dim * _positive_number(c, "partial_rotary_factor", 1.0))
    scaling = c.sub("rope_scaling") or c.sub("rope_parameters")
    scaled = positions
    if scaling is not None:
        kind = scaling.text("rope_type", "") or scaling.text("type", "")
        if kind in ("linear", "dynamic"):
            scaled = int(positions * _positive_number(scaling, "factor", 1.0))
        elif kind in ("yarn", "deepseek_yarn"):
            original = scaling.integer("original_max_position_embeddings")
            scaled = int(original * _positive_number(scaling, "factor", 1.0))
    entries = scaled + (positions if layers.architecture.startswith("Gemma3") else 0)
    dtype_bytes = 4 if layers.architecture == "GptOssForCausalLM" else layers.model_dtype.size_bytes
    return entries * dims * dtype_bytes


# 4-bit weights + per 128-group an fp16 scale and a 4-bit zero point, packed eight to an
# int32 (vLLM 0.19's gptq_marlin / awq_marlin `create_weights`: `qzeros` is int32 of
# output / 8 per group, and a symmetric GPTQ checkpoint builds it too; the Machete and
# Marlin repacks keep both sizes). RedHatAI's GPTQ Llama 3.1 8B logs 5.38 GiB on 0.19.
_INT4_BYTES = 0.5 + 2.5 / 128


def _quantization(config: HFConfig, requested: str | None = None) -> tuple[str, float, bool]:
    """(name, bytes per quantized parameter, experts only). `requested` is vLLM's
    --quantization: it must name the checkpoint's method, or on an unquantized
    checkpoint `fp8` (quantized when loaded, one scale per tensor)."""
    quant = config.sub("quantization_config")
    if quant is None:
        if requested in (None, "none"):
            return ("none", 0.0, False)
        if requested == "fp8":
            return ("fp8", 1.0, False)
        if requested.startswith("modelopt"):
            raise ModelConfigError(
                f"--quantization {requested}: config.json has no quantization_config; vLLM then "
                "reads ModelOpt's settings from hf_quant_config.json, which kvplan does not: "
                "copy its 'quantization' section into config.json as quantization_config with "
                '"quant_method": "modelopt" (quant_algo, group_size, exclude_modules)'
            )
        raise ModelConfigError(
            f"--quantization {requested}: an unquantized checkpoint can be quantized on load "
            "only with fp8 in the weight estimate; pass --non-kv-bytes"
        )
    method = quant.text("quant_method")
    if requested == "modelopt" and method.startswith("modelopt"):
        requested = method  # vLLM's --quantization modelopt picks the checkpoint's algorithm
    if requested is not None and requested != method:
        raise ModelConfigError(
            f"--quantization {requested} does not match the checkpoint's {method!r} "
            "(vLLM refuses it too)",
            quant._where("quant_method"),
        )
    if method == "fp8":
        block = _fp8_block(quant)
        return ("fp8", 1 + (4 / (block[0] * block[1]) if block else 0.0), False)
    if method in ("awq", "gptq"):
        bits = quant.integer("bits", 4)
        if bits != 4:
            raise ModelConfigError(
                f"only 4-bit {method} is supported, got {bits}", quant._where("bits")
            )
        return (f"{method}-int4", _INT4_BYTES, False)
    if method == "mxfp4":
        return ("mxfp4", 0.5 + 1 / 32, True)  # e2m1 pairs + one e8m0 scale per 32
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "modelopt":
        return _modelopt(quant)
    raise ModelConfigError(
        f"quantization {method!r} is not supported by the weight estimate (fp8, awq, gptq, "
        "mxfp4, compressed-tensors, modelopt); pass --non-kv-bytes",
        quant._where("quant_method"),
    )


def _fp8_block(quant: HFConfig) -> tuple[int, int] | None:
    """An fp8 checkpoint's `weight_block_size` (output rows, input columns per scale);
    None: one scale per tensor."""
    block = quant.items("weight_block_size")
    if not block:
        return None
    if len(block) != 2 or not all(isinstance(side, int) and side > 0 for side in block):
        raise ModelConfigError(f"expected two positive sizes, got {block!r}",
                               quant._where("weight_block_size"))  # fmt: skip
    return int(block[0]), int(block[1])


# GPUs without fp8 tensor cores (compute capability below 8.9): vLLM serves fp8 weights
# there through its Marlin weight-only kernel (0.32-0.34 fp8.py picks
# MarlinFP8ScaledMMLinearKernel below 8.9).
_FP8_MARLIN_ARCHS = frozenset({"ampere"})
# Ada (8.9) has fp8 tensor cores, and its block-fp8 linear kernel depends on the
# release. 0.17.0-0.18.0 (fp8.py Fp8LinearMethod.__init__: `use_marlin` only below
# 8.9) and 0.19.0 (kernels/linear/scaled_mm/marlin.py
# MarlinFP8ScaledMMLinearKernel.is_supported refuses 8.9 and above) keep the block
# scales unless VLLM_TEST_FORCE_FP8_MARLIN is set (W8A8BlockFp8LinearOp).
# 0.32-0.34: Marlin's is_supported has no upper bound, and in
# kernels/linear/__init__.py `_POSSIBLE_FP8_BLOCK_KERNELS` every CUDA kernel ahead of
# it needs Hopper, Blackwell or 12.x (FlashInfer's and DeepGEMM's block GEMMs,
# CUTLASS's block kernel, B12x), so Ada's linear layers run Marlin. Their fp8 MoE
# oracle (fused_moe/oracle/fp8.py `_get_priority_backends`) lists TRITON before MARLIN
# and TritonExperts takes block fp8 from 8.9, so experts keep the block layout. Not
# read: 0.20-0.31 (planned with the block figure, as 0.19).
_FP8_MARLIN_ON_ADA_FROM = (0, 32, 0)


def _fp8_runs_marlin(c: HFConfig, gpu_arch: str, release: str) -> bool:
    """Whether vLLM `release` serves a block-fp8 checkpoint's weights through Marlin on
    a GPU of `gpu_arch`: always below capability 8.9; on Ada from 0.32 ("" or an
    unparseable release: the newest), for a model without experts (an MoE model's
    experts keep the block layout there, and its linear layers' Marlin scales are not
    counted apart)."""
    if gpu_arch in _FP8_MARLIN_ARCHS:
        return True
    if gpu_arch != "ada" or release == "v0" or _expert_count(c):
        return False
    version = _release_version(release)
    return version is None or version >= _FP8_MARLIN_ON_ADA_FROM


def _fp8_marlin_bytes(
    config: HFConfig, text: HFConfig, gpu_arch: str, model_dtype_bytes: int, release: str = ""
) -> float | None:
    """Bytes per fp8 weight as a block-quantized fp8 checkpoint is held on a GPU that
    runs it through Marlin (`_fp8_runs_marlin`, on its text config `text`), None
    elsewhere. vLLM's
    prepare_fp8_layer_for_marlin
    (marlin_utils_fp8.py, 0.32-0.34) turns the block scales into group scales Marlin
    reads: one per `block_k` input columns for every output row, in the model dtype,
    replacing the float32 block scales after loading (so "Model loading took" counts
    them): 1 + 2 / 128 bytes per weight for 128 x 128 blocks in bf16. A per-tensor
    checkpoint gets one scale per output row (negligible)."""
    quant = config.sub("quantization_config")
    if quant is None or not _fp8_runs_marlin(text, gpu_arch, release):
        return None
    block = _fp8_block(quant)
    return None if block is None else 1 + model_dtype_bytes / block[1]


def _modelopt(quant: HFConfig) -> tuple[str, float, bool]:
    """NVIDIA ModelOpt as config.json's quantization_config states it (vLLM's
    ModelOptQuantConfigBase.from_config): NVFP4 (and W4A16_NVFP4) store e2m1 pairs
    with one fp8 scale per `group_size` (16) weights; FP8 one byte per weight with a
    per-tensor scale. Mixed precision is per layer and not estimated."""
    algo = quant.text("quant_algo").upper()
    if algo in ("NVFP4", "W4A16_NVFP4"):
        group = quant.integer("group_size", 16)
        return ("modelopt-nvfp4", 0.5 + 1 / group, False)
    if algo == "FP8":
        return ("modelopt-fp8", 1.0, False)
    raise ModelConfigError(
        f"ModelOpt quant_algo {algo!r} is not estimated (NVFP4, W4A16_NVFP4, FP8); pass "
        "--non-kv-bytes",
        quant._where("quant_algo"),
    )


def _all_excluded(names: list[str], patterns: list[str], mixed: str) -> bool:
    """Whether the exclusion `patterns` name every one of `names` (the representatives
    of a part the estimate counts whole); `mixed` says what a split would mean."""
    hits = {any(_matches(name, pattern) for pattern in patterns) for name in names}
    if len(hits) > 1:
        raise ModelConfigError(f"{mixed}: pass --non-kv-bytes", "quantization_config")
    return hits == {True}


def _excluded_patterns(config: HFConfig) -> list[str]:
    """The modules a checkpoint leaves unquantized: fp8's `ignored_layers` (else
    `modules_to_not_convert`), ModelOpt's `ignore` (else `exclude_modules`)."""
    quant = config.sub("quantization_config")
    if quant is None:
        return []
    keys = ("ignore", "exclude_modules", "ignored_layers", "modules_to_not_convert")
    for key in keys:
        patterns = quant.items(key)
        if patterns:
            return [str(pattern) for pattern in patterns]
    return []


def _matches(name: str, pattern: str) -> bool:
    # vLLM's rules together: an exact or substring match of the module name
    # (is_layer_skipped, ModelOpt's legacy substring rule) or a wildcard (fnmatch).
    return pattern in name or fnmatch(name, pattern)


def _unquantized_parts(config: HFConfig, layers: ModelLayers) -> frozenset[str]:
    """The ParamCount parts a quantized checkpoint keeps in the model dtype: the
    embeddings and LM head and the MoE routers always, and Llama 4's vision model and
    projector (vLLM builds them with no quantization config); the vision tower, MTP modules,
    attention, GDN / Mamba mixers or MLPs when the exclusion list names them. A part
    is matched through the checkpoint names of its first and last layer; a list that
    excludes one of them only (part of a group) cannot be estimated per part."""
    patterns = _excluded_patterns(config)
    kept = {"embedding", "router"}
    if config.text("model_type", "") == "llama4":
        kept.add("vision")  # vLLM builds Llama 4's vision model and projector unquantized
    if not patterns:
        return frozenset(kept)
    nested = ARCHITECTURES[layers.architecture][1]
    root = "model.language_model.layers" if nested else "model.layers"
    c = text_config(config, layers.architecture)
    mlp = "mlp.experts.0.gate_proj" if _expert_count(c) else "mlp.gate_proj"
    target = [layer for layer in layers.layers if not layer.is_draft]
    attention = [layer.decoder_index for layer in target if not layer.is_state]
    state = [layer.decoder_index for layer in target if layer.is_state]
    count = c.integer("num_hidden_layers")
    representatives: dict[str, list[str]] = {
        "attention": [f"{root}.{i}.self_attn.q_proj" for i in (attention[:1] + attention[-1:])],
        "state_space": [f"{root}.{i}.linear_attn.in_proj_qkv" for i in (state[:1] + state[-1:])],
        "mlp": [f"{root}.0.{mlp}", f"{root}.{count - 1}.{mlp}"],
    }
    if _vision_params(config, c.integer("hidden_size")) and "vision" not in kept:
        representatives["vision"] = [
            "model.visual.blocks.0.attn.qkv",
            "model.visual.merger.linear_fc2",
        ]
    if layers.num_nextn_predict_layers:  # MTP modules are loaded
        representatives["draft"] = ["mtp.layers.0.self_attn.q_proj", f"mtp.layers.0.{mlp}"]
    for part, names in representatives.items():
        if not names:
            continue
        mixed = (f"excludes part of the {part} weights only ({names[0]} and {names[-1]} "
                 "differ); the estimate counts whole parts")  # fmt: skip
        if _all_excluded(names, patterns, mixed):
            kept.add(part)
    return frozenset(kept)


def _kept_modules_within(
    config: HFConfig, layers: ModelLayers, kept: frozenset[str]
) -> tuple[int, int]:
    """Parameters the exclusion list keeps in the model dtype inside parts that are
    otherwise quantized, as (per GDN layer, in the MTP modules): the GDN mixers'
    `in_proj_a` / `in_proj_b` (hidden x value heads each; vLLM fuses them into
    `in_proj_ba`, whose shards must agree) and the MTP `fc` (2 x hidden -> hidden).
    Qwen's own fp8 checkpoints of Qwen3-Next and Qwen3.5 / 3.6 keep both in bf16 and
    quantize the rest of the mixer and of the MTP layer."""
    patterns = _excluded_patterns(config)
    if not patterns:
        return 0, 0
    c = text_config(config, layers.architecture)
    hidden = c.integer("hidden_size")
    nested = ARCHITECTURES[layers.architecture][1]
    root = "model.language_model.layers" if nested else "model.layers"
    gdn = [layer.decoder_index for layer in layers.layers
           if layer.mamba_type == "GDN_ATTENTION" and not layer.is_draft]  # fmt: skip
    per_gdn_layer = 0
    if gdn and "state_space" not in kept:
        names = [f"{root}.{i}.linear_attn.in_proj_{side}" for i in (gdn[0], gdn[-1])
                 for side in "ab"]  # fmt: skip
        mixed = (f"keeps part of the GDN in_proj_a / in_proj_b only ({', '.join(names)}); "
                 "the estimate counts them for every layer")  # fmt: skip
        if _all_excluded(names, patterns, mixed):
            per_gdn_layer = 2 * hidden * c.integer("linear_num_value_heads")
    fc = 0
    mtp = layers.num_nextn_predict_layers
    if mtp and "draft" not in kept and any(_matches("mtp.fc", pattern) for pattern in patterns):
        fc = mtp * 2 * hidden * hidden
    return per_gdn_layer, fc


def _compressed_tensors(quant: HFConfig) -> tuple[str, float, bool]:
    """compressed-tensors: every config group's weights must share one bit width; a
    grouped scheme adds a 2-byte scale per `group_size` weights."""
    groups = quant.sub("config_groups")
    if groups is None or not groups.data:
        raise ModelConfigError("required for compressed-tensors", quant._where("config_groups"))
    schemes: set[tuple[int, int | None]] = set()
    for name in groups.data:
        group = groups.sub(name)
        weights = group.sub("weights") if group is not None else None
        if weights is None:
            raise ModelConfigError("required field is missing", groups._where(f"{name}.weights"))
        bits = weights.integer("num_bits")
        if bits not in (4, 8):
            raise ModelConfigError(f"only 4- and 8-bit weights are estimated, got {bits}",
                                   weights._where("num_bits"))  # fmt: skip
        schemes.add((bits, weights.opt_integer("group_size")))
    if len(schemes) != 1:
        raise ModelConfigError(
            f"groups quantize weights differently ({sorted(schemes, key=str)}); pass "
            "--non-kv-bytes",
            quant._where("config_groups"),
        )
    bits, group_size = schemes.pop()
    scale = 2 / group_size if group_size else 0.0
    return (f"compressed-tensors-w{bits}", bits / 8 + scale, False)


# vLLM pads each rank's MXFP4 expert shapes to its MoE kernel's tile (vLLM 0.34
# fused_moe/oracle/mxfp4.py, mxfp4_round_up_hidden_size_and_intermediate_size):
# (hidden alignment, per-rank intermediate alignment) by the backend the GPU selects.
_MXFP4_ALIGNMENT: dict[str, tuple[int, int]] = {
    "hopper": (1, 64),  # Triton (matmul_ogs): intermediate to 64, then its layout below
    "ampere": (256, 128),  # no FP4 compute: Marlin weight-only, hidden to 256
    "ada": (256, 128),  # Marlin as well
    "blackwell": (256, 128),  # FlashInfer TRT-LLM
    "cdna": (256, 256),  # ROCm: both to 256
}


def _round_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _hopper_mx_layout_bytes(k: int, n: int) -> int:
    """One expert matrix (reduction size k, output size n) as the Triton MoE kernel
    stores it on Hopper after vLLM swizzles it (_swizzle_mxfp4): triton_kernels'
    Hopper MX value layout pads the packed e2m1 bytes along k to 64 and n to 256
    (aligning each 4-packed row to a 64-byte load); the e8m0 scales (one per 32 along
    k, padded by vLLM to a multiple of 4 groups) take the Hopper scale layout, n
    padded to 256 (2 x 8 warps x 2 x 8). The copy of triton_kernels vLLM 0.34 vendors
    as a fallback pads less (to 16 / 32 only); an installed triton_kernels wins, and
    the padded figure is what a real H100 load logged (test_weights.py), so kvplan
    plans with it."""
    values = _round_up(k // 2, 64) * _round_up(n, 256)
    scales = _round_up(n, 256) * _round_up(_round_up(-(-k // 32), 4), 2)
    return values + scales


def _mxfp4_experts_per_rank(c: HFConfig, tp: int, arch: str) -> int:
    """Bytes of one rank's MXFP4 experts, all layers: fused gate_up + down in e2m1 with
    an e8m0 scale per 32, padded as the GPU's kernel wants, plus bf16 biases (gpt-oss)."""
    hidden_align, inter_align = _MXFP4_ALIGNMENT.get(arch, (1, 64))
    hidden = _round_up(c.integer("hidden_size"), hidden_align)
    inter = _round_up(-(-c.integer("intermediate_size") // tp), inter_align)
    experts = _expert_count(c)
    biases = experts * (2 * inter + hidden) * 2
    weights: float = experts * 3 * inter * hidden * (0.5 + 1 / 32)
    if arch == "hopper":  # gate_up (k = hidden, n = 2 x inter) and down (k = inter)
        gate_up = _hopper_mx_layout_bytes(hidden, 2 * inter)
        weights = experts * (gate_up + _hopper_mx_layout_bytes(inter, hidden))
    return int((weights + biases) * c.integer("num_hidden_layers"))


# PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, the same in the
# releases vLLM 0.19-0.34 ship; vLLM leaves expandable segments off): a request of
# 10 MiB (kMinLargeAlloc) or more gets a new segment rounded up to 2 MiB (kRoundLarge),
# and a block is split only where more than 1 MiB (kSmallSize) would remain
# (`should_split`). A tensor within 1 MiB under a 2 MiB multiple so holds the whole
# block, which torch counts as allocated and vLLM's "Model loading took" reads
# (torch.cuda.max_memory_allocated right after a peak reset).
_ALLOC_MIN_LARGE = 10 * MIB
_ALLOC_ROUND_LARGE = 2 * MIB
_ALLOC_SPLIT_REMAINDER = 1 * MIB


def allocator_rounding_bytes(nbytes: int) -> int:
    """What the caching allocator charges a fresh tensor of `nbytes` beyond its size."""
    if nbytes < _ALLOC_MIN_LARGE:
        return 0  # carved out of a 20 MiB segment and split: not modelled (small)
    remainder = -nbytes % _ALLOC_ROUND_LARGE
    return remainder if remainder <= _ALLOC_SPLIT_REMAINDER else 0


def weight_rounding_bytes(
    config: HFConfig, layers: ModelLayers, tp: int, start: int, end: int, stages: int
) -> int:
    """The caching allocator's rounding (`allocator_rounding_bytes`) over one rank's
    weight tensors of decoder layers [start, end) of a `stages`-stage pipeline, as vLLM
    builds them unquantized: the fused QKV and output projections, the fused gate-up
    and down projections (per layer, or per MoE layer the experts' w13 and w2 stacks),
    the vocab-parallel embedding on the first stage and the LM head on the last
    (vocabulary padded to 64). Checked on vLLM 0.19's logs: Qwen2.5-7B 57 / 21.5 / 0.2
    MiB at TP 1 / 2 / 4 against 54-64 / 15-25 / -9-1 MiB over the parameters, Phi-4
    80 (77-87), Qwen2.5-72B 80 at TP 2 and 120 at TP 4 (78-88, 118-128), Llama-3.1-8B,
    Qwen3-8B and Gemma 2 0-2 (within the logs' 0.01 GiB). 0 where the layout is not
    this one (MLA, state-space layers, shared experts, interleaved or periodic MoE
    layers, gated attention): not modelled there."""
    c = text_config(config, layers.architecture)
    if layers.encoder_decoder or any(layer.is_state for layer in layers.layers):
        return 0
    special = ("kv_lora_rank", "interleave_moe_layer_step", "expert_layer_period",
               "n_shared_experts", "moe_shared_expert_intermediate_size")  # fmt: skip
    if any(c.has(key) for key in special) or c.size_or_none("shared_expert_intermediate_size"):
        return 0
    if _GATED_ATTENTION.get(c.text("model_type", ""), False):
        return 0
    dtype = layers.model_dtype.size_bytes
    hidden = c.integer("hidden_size")
    heads = c.integer("num_attention_heads")
    head_dim = c.integer("head_dim") if c.has("head_dim") else hidden // heads
    kv_heads = c.integer("num_key_value_heads") if c.has("num_key_value_heads") else heads
    q, kv = heads // tp * head_dim, max(1, kv_heads // tp) * head_dim
    attention = allocator_rounding_bytes((q + 2 * kv) * hidden * dtype)
    attention += allocator_rounding_bytes(q * hidden * dtype)
    gate_up_matrices = _matrices(c) - 1

    def mlp(size: int, count: int) -> int:
        gate_up = count * gate_up_matrices * (size // tp) * hidden * dtype
        down = count * hidden * (size // tp) * dtype
        return allocator_rounding_bytes(gate_up) + allocator_rounding_bytes(down)

    experts = _expert_count(c)
    dense_first = c.integer("first_k_dense_replace", 0, minimum=0)
    expert_size = c.size_or_none("moe_intermediate_size") or c.integer("intermediate_size")
    dense_mlp = mlp(c.integer("intermediate_size"), 1)
    total = 0
    for layer in range(start, end):
        moe = experts and layer >= dense_first
        total += attention + (mlp(expert_size, experts) if moe else dense_mlp)
    rows = padded_vocab(c.integer("vocab_size")) // tp
    table = allocator_rounding_bytes(rows * hidden * dtype)
    tied = c.flag("tie_word_embeddings", False)
    first, last = start == 0, end == c.integer("num_hidden_layers")
    total += table * first + table * (last and (not tied or stages > 1))
    return total


def estimate_weights(
    config: HFConfig,
    layers: ModelLayers,
    tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
    gpu_arch: str = "",
    quantization: str | None = None,
    pp_layer_partition: tuple[int, ...] | None = None,
    release: str = "",
    max_num_batched_tokens: int = 0,
) -> WeightEstimate:
    """Bytes per worker: embeddings, LM head, attention, MLP and mixers shard over TP
    (vocab-parallel embeddings, column/row-parallel projections), routers are
    replicated on every rank. Each pipeline stage holds its decoder layers (vLLM's
    partition, or `pp_layer_partition` as VLLM_PP_LAYER_PARTITION gives it) and the
    embeddings where the family builds them (`stage_params`). MXFP4 experts are
    padded per rank for the GPU's (`gpu_arch`) MoE kernel; block-fp8 weights take
    Marlin's layout where `release` runs them through it (`_fp8_runs_marlin`). With
    `max_num_batched_tokens`, the buffers the model allocates when it is built, which
    vLLM's "Model loading took" counts: Qwen3-VL's deepstack input buffers
    (`deepstack_buffer_bytes`; `config` as loaded, without a tower vLLM skips)."""
    params = count_params(config, layers)
    dtype_bytes = layers.model_dtype.size_bytes
    name, quant_bytes, experts_only = _quantization(config, quantization)
    if name == "fp8":
        text = text_config(config, layers.architecture)
        marlin = _fp8_marlin_bytes(config, text, gpu_arch, dtype_bytes, release)
        quant_bytes = marlin or quant_bytes
    tp = tensor_parallel_size
    router_bytes = params.router * dtype_bytes
    kept = (
        _unquantized_parts(config, layers) if name != "none" and not experts_only else frozenset()
    )
    c = text_config(config, layers.architecture)
    gdn_kept, fc_kept = _kept_modules_within(config, layers, kept) if kept else (0, 0)
    gdn_params = _state_params(c, "GDN_ATTENTION") if gdn_kept else 0

    def kept_within(part: ParamCount) -> int:
        # The GDN layers a part holds, from its mixer parameters, and the MTP `fc` with
        # the MTP modules.
        layers_held = part.state_space // gdn_params if gdn_params else 0
        return layers_held * gdn_kept + (fc_kept if part.draft else 0)

    if name == "none":
        total = params.total * dtype_bytes
    elif experts_only:
        dense = (params.total - params.mlp - params.router) * dtype_bytes
        total = int(dense + params.mlp * quant_bytes) + router_bytes
    else:
        # Embeddings, the lm head and the routers stay in the model dtype, and what the
        # checkpoint's exclusion list names.
        unquantized = sum(getattr(params, part) for part in kept) - params.router
        unquantized += kept_within(params)
        quantized = params.total - unquantized - params.router
        total = int(unquantized * dtype_bytes + quantized * quant_bytes) + router_bytes
    num_layers = c.integer("num_hidden_layers") if not layers.encoder_decoder else 1
    if layers.encoder_decoder and pipeline_parallel_size > 1:
        raise ModelConfigError("pipeline parallelism is not estimated for encoder-decoder models")
    bounds = [
        pipeline_stage_bounds(num_layers, stage, pipeline_parallel_size, pp_layer_partition)
        for stage in range(pipeline_parallel_size)
    ]
    experts_all_layers = _mxfp4_experts_per_rank(c, tp, gpu_arch) if experts_only else 0
    rope = rope_cache_bytes(config, layers)
    # Built in Qwen3VLForConditionalGeneration.__init__ (0.19.0 and 0.32-0.34), inside
    # the runner's load_model: in the weights figure, and in the profile's baseline,
    # not its peak. Every stage builds the wrapper.
    buffers = deepstack_buffer_bytes(config, max_num_batched_tokens, dtype_bytes,
                                     MultimodalOptions())  # fmt: skip
    per_stage = []
    for (start, end), stage in zip(bounds, stage_params(config, layers, bounds), strict=True):
        stage_router = stage.router * dtype_bytes
        if name == "none":
            # What vLLM builds unsharded besides the routers (`replicated_params`).
            kept_whole = replicated_params(config, layers, end - start) if tp > 1 else 0
            sharded = (stage.total - stage.router - kept_whole) * dtype_bytes
            rank = -(-sharded // tp) + stage_router + kept_whole * dtype_bytes
        elif experts_only:
            dense = (stage.total - stage.mlp - stage.router) * dtype_bytes
            experts = experts_all_layers * (end - start) // num_layers
            rank = -(-dense // tp) + experts + stage_router
        else:
            unquantized = sum(getattr(stage, part) for part in kept) - stage.router
            unquantized += kept_within(stage)
            quantized = stage.total - unquantized - stage.router
            sharded = int(unquantized * dtype_bytes + quantized * quant_bytes)
            rank = -(-sharded // tp) + stage_router
        if name == "none":
            rank += weight_rounding_bytes(config, layers, tp, start, end, len(bounds))
        per_stage.append(rank + rope + buffers)
    return WeightEstimate(params, name, total, max(per_stage), tuple(per_stage), rope, buffers)


def _per_token_activation(c: HFConfig, tp: int) -> int:
    """Elements one token holds at the peak of a decoder layer's forward, per rank.

    Three hidden-size streams stay live through a layer (its input / residual, the
    normed input, the output being built); beside them the attention phase holds the
    QKV projection and the attention output, the MLP phase the up (and gate)
    projection and the activation's output, or for fused MoE the top-k copies of
    those and of the expert outputs (vLLM's fused_moe intermediate caches). The
    peak is the larger phase."""
    hidden = c.integer("hidden_size") if c.has("hidden_size") else c.integer("d_model")
    heads = c.opt_integer("num_attention_heads") or c.opt_integer("decoder_attention_heads") or 1
    head_dim = c.integer("head_dim") if c.has("head_dim") else hidden // heads
    kv_heads = c.opt_integer("num_key_value_heads") or heads
    attention = ((heads + 2 * kv_heads) * head_dim + heads * head_dim) // tp
    matrices = _matrices(c)
    ffn_keys = ("intermediate_size", "decoder_ffn_dim")
    ffn = next((c.integer(key) for key in ffn_keys if c.has(key)), 4 * hidden)
    if c.has("intermediate_size_mlp"):  # Llama 4: the dense layers' size
        ffn = max(ffn, c.integer("intermediate_size_mlp"))
    mlp = matrices * ffn // tp
    if _expert_count(c):
        expert = c.integer("moe_intermediate_size") if c.has("moe_intermediate_size") else ffn
        top_k = c.opt_integer("num_experts_per_tok") or c.opt_integer("moe_topk") or 1
        mlp = max(mlp, top_k * (matrices * expert // tp + hidden))
    return 3 * hidden + max(attention, mlp)


def estimate_overhead(
    config: HFConfig,
    layers: ModelLayers,
    tensor_parallel_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int = 256,
    release: str = "",
    flashinfer: bool = True,
    max_model_len: int | None = None,
    pcie_only_gpu: bool = False,
    multimodal: MultimodalOptions | None = None,
    disable_custom_all_reduce: bool = False,
    gpu_arch: str = "",
    pipeline_stage: int = 0,
    pipeline_parallel_size: int = 1,
    gpu_sms: int = 0,
    use_v2_model_runner: bool | None = None,
    extensible_kv_cache: bool | None = None,
    quantization: str | None = None,
) -> OverheadEstimate:
    """The profile run's peak over the weights: a forward pass of
    `max_num_batched_tokens` tokens (what the engine profiles; the V0 engine without
    chunked prefill profiled `max_model_len`), then the sampler's float32 logits for
    `max_num_seqs` requests while the forward's last hidden states are still held.
    The two do not overlap, so the peak is the larger. `release` picks the runtime
    allowances (`PROFILES`); `flashinfer` whether FlashInfer is installed (the
    sampler's path). `max_model_len` (default: the model's) bounds the context of the
    graph estimate's long sample where a release has one (`gdn_graph_transient`);
    `pcie_only_gpu` whether the GPU has no NVLink and `disable_custom_all_reduce`
    vLLM's flag (`custom_all_reduce_on`, `non_torch_bytes`); `gpu_arch` the catalog's
    architecture ("": not known), which sizes cuBLAS's workspace, and `gpu_sms` its
    streaming multiprocessors (0: not known), which size 0.17-0.19's sampler row
    buffer (`triton_row_buffer_bytes`); `use_v2_model_runner` the runner (None: the
    release's default for the model, `default_runner_is_v2`, which reads vLLM's
    --quantization, `quantization`) and `extensible_kv_cache` vLLM 0.34's cache (None:
    on), which decide whether a graph estimate runs at all (`graph_estimate_runs`);
    `pipeline_stage` of
    `pipeline_parallel_size` the stage whose worker this is (`stage_activation_terms`);
    `multimodal`,
    vLLM's flags, sets a multimodal model's encoder item count (kvplan.models.encoder):
    its encoder runs first, so the peak is then the larger of its inputs plus its
    forward, and its inputs and embeddings plus the decoder's phases, which run while
    the encoder cache holds them."""
    c = text_config(config, layers.architecture)
    hidden = c.integer("hidden_size") if c.has("hidden_size") else c.integer("d_model")
    act_bytes = layers.model_dtype.size_bytes
    forward = max_num_batched_tokens * _per_token_activation(c, tensor_parallel_size) * act_bytes
    rules = profile_rules(release)
    if use_v2_model_runner is None:
        use_v2_model_runner = default_runner_is_v2(release, runner_model(config, layers,
                                                                         quantization))  # fmt: skip
    # Model Runner V2's sampler where the release has a figure for it (0.22 on; an engine
    # forced onto V2 before that is planned with the V1 runner's).
    mrv2 = bool(rules.mrv2_sampler_bytes_per_logit) and use_v2_model_runner
    # The sampler phase holds the forward's hidden states, the requests' last hidden
    # states (`_dummy_run` returns them indexed out) and, on the V1 runner, the random
    # stand-in `_dummy_sampler_run` computes the logits from (Model Runner V2 computes
    # them from the requests' own).
    sampler = (max_num_batched_tokens + (1 if mrv2 else 2) * max_num_seqs) * hidden * act_bytes
    # MXFP4 experts run a monolithic kernel on Hopper and Blackwell (0.19's
    # oracle/mxfp4.py prefers OAITritonMxfp4ExpertsMonolithic, and FlashInfer's
    # TRT-LLM one), which takes no workspace from the manager.
    monolithic_moe = _quantization(config)[0] == "mxfp4"
    if _expert_count(c) and rules.moe_workspace_held and not monolithic_moe:
        # The fused-MoE kernels' scratch lives in vLLM's workspace manager, which keeps
        # it after the forward pass: it is still held while the sampler runs (where the
        # release has one: `moe_workspace_held`).
        per_token = moe_workspace_per_token(c, tensor_parallel_size)
        sampler += max_num_batched_tokens * per_token * act_bytes
    vocab = c.integer("vocab_size")
    logits = max_num_seqs * vocab
    if mrv2:
        sampler += mrv2_sampler_bytes(rules, max_num_seqs, vocab, act_bytes)
    else:
        # The rules count 16-bit model logits beside their float32 copy; float32 logits
        # are that copy.
        per_logit = sampler_bytes_per_logit(rules, flashinfer) - float32_logits_saving(act_bytes)
        sampler += logits * per_logit
        sampler += triton_row_buffer_bytes(rules, max_num_seqs, vocab, gpu_sms)
    custom_all_reduce = custom_all_reduce_on(
        tensor_parallel_size, pcie_only_gpu, disable_custom_all_reduce
    )
    non_torch = non_torch_bytes(rules, custom_all_reduce)
    decoder_layers = layers.num_hidden_layers or c.integer("num_hidden_layers")
    nccl = nccl_all_reduces_per_graph(decoder_layers, tensor_parallel_size, custom_all_reduce)
    sizes = (release, gpu_arch)  # the release's capture list on this part
    graphs = cudagraph_estimate(rules, max_num_seqs, max_num_batched_tokens, nccl, *sizes)
    logged = cudagraph_estimate(PROFILES["v1"], max_num_seqs, max_num_batched_tokens, nccl,
                                *sizes)  # fmt: skip
    # The PIECEWISE samples run first and their warmups leave activations cached in
    # torch's allocator; the FULL sample's transient reuses those before it draws new
    # memory, so it shows in the estimate only past the graphs' own figure: the larger
    # of the two (vllm#52872's 0.52 / 0.52 / 0.89 GiB at 2,048 / 4,096 / 8,192 batched
    # tokens has that shape).
    transient = gdn_graph_transient(
        rules, layers, max_num_seqs, max_num_batched_tokens,
        max_model_len if max_model_len and max_model_len > 0 else layers.derived_max_model_len,
        release,
    )  # fmt: skip
    nccl_bytes = graphs - cudagraph_estimate(rules, max_num_seqs, max_num_batched_tokens, 0,
                                             *sizes)  # fmt: skip
    graphs, logged = max(graphs, transient), max(logged, transient)
    captured = graphs
    if not graph_estimate_runs(release, use_v2_model_runner, extensible_kv_cache):
        # Model Runner V2 before 0.29, and 0.34's extensible cache: nothing is measured
        # before the cache is sized, so nothing is subtracted or logged.
        graphs = logged = nccl_bytes = 0
    encoder = encoder_profile(
        config,
        tensor_parallel_size,
        act_bytes,
        max_model_len if max_model_len and max_model_len > 0 else layers.derived_max_model_len,
        max_num_batched_tokens,
        max_num_seqs,
        multimodal or MultimodalOptions(),
    )
    last_stage = pipeline_stage == pipeline_parallel_size - 1
    peak = max(forward, sampler) if last_stage else forward
    if encoder is not None:  # every stage profiles the encoder (no stage check)
        peak = max(encoder.encoder_phase_bytes, encoder.held_bytes + peak)
    if pipeline_stage > 0:
        peak += _PP_RECEIVED_TENSORS * max_num_batched_tokens * hidden * act_bytes
    peak += cublas_workspace_bytes(gpu_arch)
    # Qwen3-VL's deepstack buffers are built with the model: in the weights figure
    # (`estimate_weights`), not the profile's peak.
    return OverheadEstimate(peak, non_torch, graphs, logged, release=rules.name, encoder=encoder,
                            cudagraph_nccl_bytes=nccl_bytes,
                            cudagraph_captured_bytes=captured)  # fmt: skip
