"""Why a deployment does not fit, and what would: the smallest TP, the catalog GPUs.

Used by `plan --model` and `capacity` when planning fails for lack of memory: the
answer says where the memory went (device total x utilization, weights, activations
and runtime, what one request needs) in plain positive figures, and which TP size and
which catalog GPUs would hold the same deployment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from kvplan.gpus import CATALOG, GpuModel, UnknownGpu, lookup_gpu
from kvplan.models.config import HFConfig, ModelConfigError
from kvplan.models.request import (
    ModelPlanInputs,
    ModelPlanOptions,
    auto_fit_request,
    build_plan_request,
    extensible_cache_on,
)
from kvplan.v1 import plan_pb2

GIB = 1 << 30
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
Planner = Callable[[plan_pb2.PlanRequest], plan_pb2.PlanResponse]


def _gib(value: int) -> str:
    return f"{value / GIB:,.2f} GiB"


def default_utilization(options: ModelPlanOptions) -> float:
    """What the planner applies without --gpu-memory-utilization (0.34's extensible
    cache reserves the whole device)."""
    if options.gpu_memory_utilization is not None:
        return options.gpu_memory_utilization
    return 1.0 if extensible_cache_on(options) else 0.92


def catalog_name(gpu: GpuModel) -> str | None:
    """The catalog name of `gpu`, or None for a size given on the command line."""
    with contextlib.suppress(UnknownGpu):
        if lookup_gpu(gpu.name) is gpu:
            return gpu.name
    return None


def fits(config: HFConfig, options: ModelPlanOptions, planner: Planner) -> bool:
    from kvplan.core.errors import PlanningError

    try:
        planner(build_plan_request(config, options)[0])
    except (PlanningError, ModelConfigError):
        return False
    return True


def name_gpus(names: list[str], shown: int = 4) -> str:
    """The smallest few GPUs that fit (the list is smallest first), and how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} larger" if more > 0 else "")


def _utilization_budget(
    options: ModelPlanOptions, gpu: GpuModel, inputs: ModelPlanInputs | None, short: str
) -> list[str]:
    """The device's usable share, the non-KV memory in it, and what is left."""
    utilization = default_utilization(options)
    usable = -(-gpu.total_memory_bytes * int(utilization * 10**6) // 10**6)
    where = [
        f"  per worker: {utilization:.0%} of {gpu.name}'s {_gib(gpu.total_memory_bytes)}"
        f" = {_gib(usable)} usable"
    ]
    if inputs is None:
        return where
    if inputs.weights is not None and inputs.overhead is not None:
        overhead = inputs.overhead
        where.append(
            f"  weights {_gib(inputs.weights.bytes_per_worker)} + activation peak "
            f"{_gib(overhead.activation_peak_bytes)} + CUDA graphs "
            f"{_gib(overhead.cudagraph_bytes)} + runtime {_gib(overhead.non_torch_bytes)}"
            f" (estimated) = {_gib(inputs.non_kv_bytes)} non-KV"
        )
    else:
        where.append(f"  non-KV memory (given): {_gib(inputs.non_kv_bytes)}")
    if inputs.non_kv_bytes >= usable:
        where.append(
            f"  the non-KV memory alone exceeds it by {_gib(inputs.non_kv_bytes - usable)}:"
            " nothing is left for the KV cache"
        )
    elif (sizing := inputs.limiting_sizing) is not None:
        # vLLM 0.34's extensible cache: the reservation is only the cap.
        where.append(
            f"  {_gib(usable - inputs.non_kv_bytes)} reserved for the KV cache before warm-up; "
            f"after it (vLLM 0.34) {_gib(sizing.kv_cache_bytes)} once the CUDA graphs "
            f"({_gib(sizing.graph_bytes)}), the margin ({_gib(sizing.margin_bytes)}) and the "
            f"CUDA context ({_gib(sizing.startup_reserved_bytes)}, assumed) are taken, {short}"
        )
    else:
        where.append(f"  {_gib(usable - inputs.non_kv_bytes)} left for the KV cache, {short}")
    return where


def _final_auto_fit(config: HFConfig, options: ModelPlanOptions, planner: Planner) -> int | None:
    """The longest max_model_len a final extensible plan holds (None: none)."""
    from kvplan.core.errors import PlanningError

    try:
        return planner(auto_fit_request(build_plan_request(config, options)[0])).max_model_len
    except (PlanningError, ModelConfigError):
        return None


@dataclass(frozen=True)
class NoFit:
    where: list[str]  # where the memory went, one line each
    smallest_tp: int | None  # on the same GPU, with every other setting unchanged
    gpus: list[str]  # catalog GPUs that hold it at the same TP
    # The longest max_model_len that fits here (None: none, or not known); for vLLM
    # 0.34's extensible cache, after warm-up.
    max_model_len: int | None = None

    def lines(self) -> list[str]:
        out = list(self.where)
        if self.smallest_tp is not None:
            out.append(f"  fits from --tensor-parallel-size {self.smallest_tp} on this GPU")
        else:
            out.append(f"  no TP size up to {TP_CANDIDATES[-1]} fits on this GPU")
        if self.gpus:
            out.append(f"  fits at this TP on: {name_gpus(self.gpus)}")
        else:
            out.append("  no catalog GPU holds it at this TP")
        return out


def explain_no_fit(
    config: HFConfig,
    options: ModelPlanOptions,
    gpu: GpuModel,
    inputs: ModelPlanInputs | None,
    planner: Planner,
    refusal: Mapping[str, int | float | str] | None = None,
) -> NoFit:
    """Where the memory of a worker went, and the smallest TP / the catalog GPUs that
    would hold the deployment (each candidate planned for real, not guessed), smallest
    device first. `refusal`: the planner's error details (needed_bytes: what one request
    of max_model_len needs; estimated_max_model_len: the longest that fits)."""
    details = refusal or {}
    needed = details.get("needed_bytes")
    longest = details.get("estimated_max_model_len")
    needs = f"the {_gib(needed)} " if isinstance(needed, int) and needed > 0 else ""
    short = f"less than {needs}one request of the chosen max_model_len needs"
    where: list[str] = []
    if options.num_gpu_blocks_override is not None:
        # The pool is the override, whatever the device holds.
        blocks = options.num_gpu_blocks_override
        where.append(
            f"  --num-gpu-blocks-override {blocks} sets the pool: {max(blocks - 1, 0):,} usable"
            f" block{'s' if blocks != 2 else ''} (one is the null block), {short}"
        )
    elif options.kv_cache_memory_bytes is not None:
        where.append(
            f"  --kv-cache-memory-bytes sets the KV cache: {_gib(options.kv_cache_memory_bytes)}"
            f" per worker (the device and the non-KV memory do not change it), {short}"
        )
    else:
        where += _utilization_budget(options, gpu, inputs, short)
    if inputs is not None and inputs.final_sizings and isinstance(longest, int):
        # vLLM 0.34 refuses on the reservation first; the length that also fits after
        # warm-up is what auto-fit settles on then.
        longest = _final_auto_fit(config, options, planner) or 0
    if isinstance(longest, int) and longest > 0:
        where.append(f"  fits here with --max-model-len {longest} or shorter (or auto)")
    tp = options.tensor_parallel_size
    on_gpu = replace(options, gpu_memory_bytes=gpu.total_memory_bytes)
    smallest = next(
        (
            size
            for size in TP_CANDIDATES
            if size > tp and fits(config, replace(on_gpu, tensor_parallel_size=size), planner)
        ),
        None,
    )
    holders = [
        other.name
        for other in sorted(CATALOG, key=lambda device: device.total_memory_bytes)
        if other.total_memory_bytes > gpu.total_memory_bytes
        and fits(
            config,
            replace(options, gpu=other.name, gpu_memory_bytes=other.total_memory_bytes),
            planner,
        )
    ]
    fitting = longest if isinstance(longest, int) and longest > 0 else None
    return NoFit(where, smallest, holders, fitting)
