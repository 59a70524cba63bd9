"""vLLM 0.34's extensible KV cache, estimated: the final size a worker settles on after
warm-up, from kvplan's estimates of the terms vLLM measures.

vLLM 0.34 (on CUDA and ROCm, unless --kv-cache-memory-bytes, --num-gpu-blocks-override
or --no-enable-extensible-kv-cache) sizes the cache twice. Before warm-up it reserves
address space for `ceil(total x utilization) - non-KV` (utilization 1.0 when unset; the
non-KV memory being the weights, the profiled activation peak and the non-torch memory,
no CUDA-graph estimate): the "Available KV cache memory" line, and the plan's reservation
(`reserved_num_blocks`). After warm-up and the real CUDA-graph capture it measures the
device and commits what `measured_kv_cache_bytes` below gives (vLLM's
`measure_kv_cache_bytes`), mapped in whole granules: the "Memory after warmup" and
"GPU KV cache size" lines, and the plan's `num_blocks`. That second number is the one
the operator gets; kvplan plans it by handing the planner the bytes estimated here as
each worker's `memory.measured_kv_cache_bytes`.

What is estimated, and by what:
* the memory free at the worker's start (`init_free_memory`): the device total less
  `startup_reserved_bytes` (the CUDA context and, on several GPUs, the communicators),
  read off public startup logs, not measured on the device that will run;
* the captured CUDA graphs: kvplan's graph estimate (profiling.py `cudagraph_estimate`,
  the per-graph costs of the release's capture list), which 0.34 never subtracts before
  sizing an extensible cache but then measures in the device's used memory;
* the transient peak kept free: kvplan's activation-peak estimate (the profile run's
  peak, which seeds vLLM's `reserved_headroom_bytes`; warm-up steps that peak higher
  raise vLLM's, not kvplan's); torch's reservation growth is taken as no larger;
* the multimodal IPC reservation (`reserve_mm_ipc_gpu_memory`): 0, vLLM's default
  (`mm_ipc_gpu_memory_gb` 0, no GPU video decoder), which kvplan has no flag for.
The margin and the arithmetic are vLLM's, exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

GIB = 1 << 30

# vLLM 0.34's headroom kept free beyond the transient peak when the cache is sized
# after warm-up (extensible_kv_cache.py KV_CACHE_MARGIN_FLOOR_BYTES / _FRACTION): the
# larger of a floor (1 GiB on CUDA, 3 GiB on ROCm, where kernel scratch is mapped
# outside the allocator) and 0.75 x the transient peak.
KV_CACHE_MARGIN_FLOOR_BYTES = {"cuda": 1 << 30, "rocm": 3 << 30}
KV_CACHE_MARGIN_FRACTION = 0.75


def kv_cache_margin_bytes(transient_peak_bytes: int, platform: str = "cuda") -> int:
    """The margin vLLM 0.34 keeps free below the device headroom."""
    floor = KV_CACHE_MARGIN_FLOOR_BYTES[platform]
    return max(floor, int(transient_peak_bytes * KV_CACHE_MARGIN_FRACTION))


def measured_kv_cache_bytes(
    *,
    requested_bytes: int,
    init_free_bytes: int,
    non_kv_used_bytes: int,
    transient_peak_bytes: int,
    torch_reserve_growth_bytes: int = 0,
    platform: str = "cuda",
) -> int:
    """vLLM 0.34's rule for the bytes an extensible KV cache may take after warm-up and
    CUDA-graph capture (`measure_kv_cache_bytes`), in the quantities a plan knows.

    `requested_bytes` is ceil(total x utilization) (1.0 when unset); `init_free_bytes`
    the memory free when the worker took its start-up snapshot (the total less the CUDA
    context and whatever else was on the device); `non_kv_used_bytes` everything the
    engine holds after warm-up besides the cache (weights, non-torch memory, the
    captured graphs), counted from that snapshot. The device headroom left is then
    init_free - non_kv_used. The cache gets the smaller of the budget's remainder and
    the headroom less the margin, less the larger of the transient peak and torch's
    reservation growth (both kept free in full), and never below 0. The planner then
    maps it in whole granules per layer segment (kvplan/core/extensible.py
    `blocks_within`)."""
    margin = kv_cache_margin_bytes(transient_peak_bytes, platform)
    within_budget = requested_bytes - non_kv_used_bytes
    within_device = init_free_bytes - non_kv_used_bytes - margin
    available = min(within_budget, within_device)
    available -= max(transient_peak_bytes, torch_reserve_growth_bytes)
    return max(available, 0)


# Device memory a vLLM worker finds taken when it takes its start-up snapshot, before
# any weights: the CUDA context and cuBLAS's handles, and on several GPUs NCCL's
# communicators and the custom all-reduce buffers (vLLM initialises the distributed
# environment first). vLLM prints the free figure in its "Free memory on device
# (FREE/TOTAL GiB) on startup" line (to 0.01 GiB); the calibration logs give
# (tests/models/test_extensible_final.py reads them again):
# * one GPU: 79.19 - 78.68 = 0.51 GiB on H100 80GB (vLLM 0.19, 11 logs of
#   llm-d-planner's accuracy/results/v0.19.0); 79.25 - 78.84 = 0.41 on an A100-80GB
#   (vLLM 0.31). kvplan takes the H100's 0.51 GiB for every device.
# * several GPUs: 79.19 - 77.64 = 1.55 GiB at TP 4 and 1.53 at TP 2 (dense models),
#   1.43 at PP 2, but 2.01-2.07 GiB for the MoE logs (TP 2 and 4). kvplan takes 1.55.
# No vLLM 0.34 log is at hand: the figure is an assumption of the plan, said in its
# output, and --non-kv-bytes cannot replace it.
STARTUP_RESERVED_ONE_GPU_BYTES = round(0.51 * GIB)
STARTUP_RESERVED_SEVERAL_GPUS_BYTES = round(1.55 * GIB)


def startup_reserved_bytes(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    """Memory not free when a worker starts (see the constants)."""
    if tensor_parallel_size * pipeline_parallel_size > 1:
        return STARTUP_RESERVED_SEVERAL_GPUS_BYTES
    return STARTUP_RESERVED_ONE_GPU_BYTES


@dataclass(frozen=True)
class FinalSizing:
    """vLLM 0.34's final KV cache size for one worker, each term as kvplan has it."""

    total_bytes: int
    utilization: float
    requested_bytes: int  # ceil(total x utilization): the budget, a cap
    startup_reserved_bytes: int  # estimated (STARTUP_RESERVED_*)
    init_free_bytes: int  # total - startup_reserved
    non_kv_used_bytes: int  # weights + non-torch + captured graphs, or the given figure
    graph_bytes: int  # the captured CUDA graphs in non_kv_used (estimated)
    transient_bytes: int  # the transient peak kept free (the activation-peak estimate)
    margin_bytes: int  # max(floor, 0.75 x transient): vLLM's, exact
    margin_floor_bytes: int  # 1 GiB on CUDA, 3 GiB on ROCm
    kv_cache_bytes: int  # the rule's result: what the cache may take
    # What a budget of all the start-up free memory would give (vLLM's comparison for
    # its warning on 0.7 < utilization < 1.0).
    unbounded_kv_cache_bytes: int

    @property
    def bound_by_utilization(self) -> bool:
        """The budget, not the device's headroom, decides the size."""
        return self.requested_bytes <= self.init_free_bytes - self.margin_bytes

    @property
    def withheld_bytes(self) -> int:
        """Free device memory the utilization keeps out of the cache."""
        return self.unbounded_kv_cache_bytes - self.kv_cache_bytes

    def utilization_warning(self) -> bool:
        """vLLM 0.34 warns when an explicit utilization just under 1.0 withholds at
        least 1 GiB (measure_kv_cache_blocks)."""
        return 0.7 < self.utilization < 1.0 and self.withheld_bytes >= GIB

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bound_by_utilization": self.bound_by_utilization}


def final_sizing(
    *,
    total_bytes: int,
    utilization: float,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    non_kv_used_bytes: int,
    graph_bytes: int,
    transient_bytes: int,
    platform: str = "cuda",
) -> FinalSizing:
    """One worker's final size under vLLM 0.34's rule, from kvplan's estimates."""
    requested = math.ceil(total_bytes * utilization)  # vLLM's request_memory
    reserved = startup_reserved_bytes(tensor_parallel_size, pipeline_parallel_size)
    init_free = total_bytes - reserved

    def rule(budget: int) -> int:
        return measured_kv_cache_bytes(
            requested_bytes=budget,
            init_free_bytes=init_free,
            non_kv_used_bytes=non_kv_used_bytes,
            transient_peak_bytes=transient_bytes,
            platform=platform,
        )

    return FinalSizing(
        total_bytes=total_bytes,
        utilization=utilization,
        requested_bytes=requested,
        startup_reserved_bytes=reserved,
        init_free_bytes=init_free,
        non_kv_used_bytes=non_kv_used_bytes,
        graph_bytes=graph_bytes,
        transient_bytes=transient_bytes,
        margin_bytes=kv_cache_margin_bytes(transient_bytes, platform),
        margin_floor_bytes=KV_CACHE_MARGIN_FLOOR_BYTES[platform],
        kv_cache_bytes=rule(requested),
        unbounded_kv_cache_bytes=rule(init_free),
    )


def final_sizing_note(sizing: FinalSizing, given: bool) -> str:
    """What the final figure assumes, for the plan's notes."""
    what = (
        "the given non-KV memory (--non-kv-bytes, taken as everything outside the cache, "
        "the transient peak included)"
        if given
        else f"the estimated weights, non-torch memory and {sizing.graph_bytes / GIB:.2f} GiB "
        f"of CUDA graphs, with the {sizing.transient_bytes / GIB:.2f} GiB activation-peak "
        "estimate kept free as the transient peak"
    )
    return (
        "vLLM 0.34 sizes its extensible KV cache after warm-up and CUDA-graph capture: "
        "the tokens are the final size, estimated from "
        f"{what}, a margin of {sizing.margin_bytes / GIB:.2f} GiB (vLLM's), and "
        f"{sizing.startup_reserved_bytes / GIB:.2f} GiB taken before the worker starts "
        "(CUDA context; assumed from vLLM 0.19 / 0.31 startup logs, not measured here); "
        "the reservation before warm-up is the cap"
    )


def utilization_warning_note(sizing: FinalSizing) -> str:
    """vLLM 0.34's WARNING for an explicit utilization just under 1.0, in substance."""
    return (
        f"gpu_memory_utilization={sizing.utilization} keeps about "
        f"{sizing.withheld_bytes / GIB:.2f} GiB of free device memory out of the KV cache: "
        "vLLM 0.34 warns so (its extensible cache measures its own headroom; leave the "
        "utilization unset unless something vLLM does not measure shares the GPU)"
    )
