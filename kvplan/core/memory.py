"""Memory planning: worker budgets, blocks per request, the one-request check,
max_model_len auto-fit, and capacity."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from kvplan.core.errors import InsufficientMemory, InvalidRequest
from kvplan.core.groups import KVCacheGroup
from kvplan.core.request import DEFAULT_GPU_MEMORY_UTILIZATION, WorkerInput
from kvplan.core.specs import KVCacheSpec, PlanningContext, UniformTypeSpecs, cdiv

GIB = 1 << 30


def format_gib(num_bytes: int) -> float:
    return round(num_bytes / GIB, 2)


class BudgetMode(Enum):
    UTILIZATION = "utilization"
    EXPLICIT_BYTES = "explicit_bytes"
    BLOCKS_OVERRIDE = "blocks_override"
    FREE_FRACTION = "free_fraction"


@dataclass(frozen=True)
class Budget:
    """Every number that went into one worker's KV budget (bytes)."""

    mode: BudgetMode
    available_bytes: int  # what planning divides into blocks
    total_bytes: int = 0
    gpu_memory_utilization: float = 0.0
    requested_bytes: int = 0
    non_kv_bytes: int = 0
    free_bytes: int = 0
    free_memory_fraction: float = 0.0
    in_use_bytes: int = 0

    def footprint_bytes(self, kv_tensor_bytes: int) -> int:
        """What the worker's instance holds on its device at most (weights,
        activations, KV cache): the bytes a lease reserves for it."""
        if self.mode is BudgetMode.UTILIZATION:
            return self.requested_bytes
        if self.mode is BudgetMode.EXPLICIT_BYTES:
            return self.available_bytes + self.non_kv_bytes
        if self.mode is BudgetMode.FREE_FRACTION:
            return self.in_use_bytes + self.available_bytes
        return self.non_kv_bytes + kv_tensor_bytes  # blocks override: what it allocates


def worker_budget(worker: WorkerInput, index: int, *, extensible: bool = False) -> Budget:
    """KV budget = ceil(total * utilization) - non-KV bytes, explicit bytes, or
    floor(free * free_memory_fraction). An extensible cache (vLLM 0.34) reserves
    at utilization 1.0 unless told otherwise, and its budget is only a cap, so
    free memory below it is no error."""
    memory = worker.memory
    device = worker.device
    if memory.kv_cache_memory_bytes is not None:
        return Budget(
            BudgetMode.EXPLICIT_BYTES,
            available_bytes=memory.kv_cache_memory_bytes,
            total_bytes=device.total_memory_bytes or 0,
            non_kv_bytes=memory.non_kv.total_bytes,
            in_use_bytes=memory.device_bytes_in_use,
        )
    if memory.free_memory_fraction is not None:
        free = device.free_memory_bytes
        if free is None:
            raise InvalidRequest(
                f"worker rank {worker.rank} plans by free_memory_fraction but the free memory "
                "of its device is unknown: name a device the server probes (device.uuid) or "
                "set device.free_memory_bytes",
                field=f"workers[{index}].device.free_memory_bytes",
            )
        return Budget(
            BudgetMode.FREE_FRACTION,
            # The worker's non-KV memory is already allocated, so not in `free`.
            available_bytes=math.floor(free * memory.free_memory_fraction),
            total_bytes=device.total_memory_bytes or 0,
            non_kv_bytes=memory.non_kv.total_bytes,
            free_bytes=free,
            free_memory_fraction=memory.free_memory_fraction,
            in_use_bytes=memory.device_bytes_in_use,
        )
    default_utilization = 1.0 if extensible else DEFAULT_GPU_MEMORY_UTILIZATION
    utilization = memory.gpu_memory_utilization or default_utilization
    total = device.total_memory_bytes
    if total is None:
        raise InvalidRequest(
            f"worker rank {worker.rank} plans by gpu_memory_utilization but its device's "
            "total memory is unknown: set device.total_memory_bytes, a known device.name, "
            "or memory.kv_cache_memory_bytes",
            field=f"workers[{index}].device.total_memory_bytes",
        )
    requested = math.ceil(total * utilization)
    free = device.free_memory_bytes
    if free is not None and free < requested and not extensible:
        raise InsufficientMemory(
            f"worker rank {worker.rank}: free memory on the device ({format_gib(free)}/"
            f"{format_gib(total)} GiB) is below the desired GPU memory utilization "
            f"({utilization}, {format_gib(requested)} GiB); lower gpu_memory_utilization "
            "or free memory on the device",
            field=f"workers[{index}].memory.gpu_memory_utilization",
            details={"free_bytes": free, "total_bytes": total, "requested_bytes": requested},
        )
    non_kv = memory.non_kv.total_bytes
    return Budget(
        BudgetMode.UTILIZATION,
        available_bytes=requested - non_kv,
        total_bytes=total,
        gpu_memory_utilization=utilization,
        requested_bytes=requested,
        non_kv_bytes=non_kv,
        in_use_bytes=memory.device_bytes_in_use,
    )


def group_blocks_per_request(group: KVCacheGroup, ctx: PlanningContext) -> int:
    return spec_blocks_per_request(group.spec, ctx)


def spec_blocks_per_request(spec: KVCacheSpec, ctx: PlanningContext) -> int:
    """Blocks one max_model_len request holds in a group of `spec`."""
    if isinstance(spec, UniformTypeSpecs):
        return spec.max_memory_usage_pages(ctx)
    return cdiv(spec.max_memory_usage_bytes(ctx), spec.page_size_bytes)


def needed_bytes(groups: Sequence[KVCacheGroup], block_bytes: int, ctx: PlanningContext) -> int:
    """Bytes one max_model_len request needs: every group draws its blocks from
    the one pool, so a request costs the sum over groups."""
    # Hybrid groups repeat one spec object: its blocks are counted once (Gemma-3-style,
    # 64 layers: 7 groups, 2 specs, 5.4 -> 3.3 µs a call; an auto-fit search calls
    # this about 17 times).
    blocks_of: dict[int, int] = {}
    total = 0
    for group in groups:
        blocks = blocks_of.get(id(group.spec))
        if blocks is None:
            blocks = blocks_of[id(group.spec)] = group_blocks_per_request(group, ctx)
        total += blocks
    return block_bytes * total


def estimate_max_model_len(fits: Callable[[int], bool], upper_bound: int) -> int:
    """The largest length in [1, upper_bound] that fits; 0 if even 1 does not."""
    if not fits(1):
        return 0
    low, high, best = 1, upper_bound, 1
    while low <= high:
        middle = (low + high) // 2
        if fits(middle):
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


def check_one_request_fits(
    *,
    rank: int,
    check_bytes: int,
    needed: Callable[[], int],
    max_model_len: int,
    estimate: Callable[[int], int],
    blocks_override: int | None = None,
    no_memory_advice: str | None = None,
) -> int:
    """The pool minus the null block must hold one max_model_len request; returns the
    bytes that request needs. `needed` is only evaluated once memory is known to be
    positive, so an empty budget is reported before any spec's own limits.
    `blocks_override`: num_gpu_blocks_override, which then made the pool;
    `no_memory_advice`: what to change when the pool is empty, where the budget is
    not what made it (the measured bytes of an extensible cache)."""
    if check_bytes <= 0:
        if no_memory_advice is not None:
            advice = no_memory_advice
        elif blocks_override is not None:
            advice = (
                f"num_gpu_blocks_override {blocks_override} leaves no block after the null "
                "block: set it to at least 2, or unset it."
            )
        else:
            advice = (
                "Increase gpu_memory_utilization or kv_cache_memory_bytes, or reduce the "
                "non-KV memory."
            )
        # A budget below the non-KV memory (or below one block) is said as the positive
        # shortfall: "-30064836608 bytes" is arithmetic, not an answer.
        left = (
            f"after any non-KV memory the budget falls {-check_bytes:,} bytes "
            f"({format_gib(-check_bytes)} GiB) short of one block"
            if check_bytes < 0
            else "0 bytes are left after the null block"
        )
        raise InsufficientMemory(
            f"No available memory for the cache blocks on worker rank {rank}: {left}. {advice}",
            details={
                "rank": rank,
                "available_bytes": max(check_bytes, 0),
                "shortfall_bytes": max(-check_bytes, 0),
            },
        )
    request_bytes = needed()
    if request_bytes > check_bytes:
        estimated = estimate(check_bytes)
        hint = (
            f" Based on the available memory, the estimated maximum model length is {estimated}."
            if estimated > 0
            else ""
        )
        raise InsufficientMemory(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{format_gib(request_bytes)} GiB KV cache is needed, which is larger than the "
            f"available KV cache memory ({format_gib(check_bytes)} GiB) on worker rank "
            f"{rank}.{hint} "
            "Increase gpu_memory_utilization or decrease max_model_len.",
            details={
                "rank": rank,
                "max_model_len": max_model_len,
                "needed_bytes": request_bytes,
                "available_bytes": check_bytes,
                "estimated_max_model_len": estimated,
            },
        )
    return request_bytes
