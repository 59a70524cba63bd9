"""vLLM 0.34's extensible KV cache: from a reservation to the final block count.

Before warm-up the planner only reserves address space (the plan's tensors, at
the reservation's block count). After warm-up each worker measures the bytes
its KV cache may take; the cache is mapped per layer segment in whole
allocation granules, so a worker holds the most blocks whose segments, each
rounded up to the granule, fit in those bytes. Every rank takes the smallest
count, never above the reservation.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplan.core.errors import UnplannableSpecs
from kvplan.core.layout import KVCacheLayout, TensorPlacement
from kvplan.core.specs import cdiv

DEFAULT_ALLOCATION_GRANULE_BYTES = 2 << 20  # CUDA virtual-memory mapping granule


def segment_strides(
    tensors: Sequence[TensorPlacement], layout: KVCacheLayout, reserved_blocks: int
) -> list[int]:
    """Block stride of every separately mapped segment of one worker's cache.

    Block-compact layer-outer layouts map each layer's region on its own (groups
    alias the same regions); other layouts map one block stride over the whole
    allocation."""
    if not tensors:
        return []
    if not layout.is_block_compact or layout.is_block_outermost:
        strides = {tensor.block_stride_bytes for tensor in tensors}
        if len(strides) != 1:
            raise UnplannableSpecs(
                f"the extensible KV cache needs one block stride on layout {layout.name}, "
                f"got {sorted(strides)}; use a block-compact layer-outer layout such as LBNHC "
                "or extensible_kv_cache=false"
            )
        stride = strides.pop()
        segment_bytes = reserved_blocks * stride
        size = tensors[0].size_bytes
        if size % segment_bytes:
            raise UnplannableSpecs(
                f"a KV cache of {size} bytes is not a whole number of {reserved_blocks}-block "
                "segments, which the extensible KV cache needs"
            )
        return [stride] * (size // segment_bytes)
    regions: dict[int, int] = {}
    for tensor in tensors:
        for index in range(len(tensor.layer_names)):
            offset = tensor.offset_bytes + index * tensor.layer_stride_bytes
            stride = regions.setdefault(offset, tensor.block_stride_bytes)
            if stride != tensor.block_stride_bytes:
                raise UnplannableSpecs(
                    f"KV cache tensors alias offset {offset} with different block strides, "
                    "which the extensible KV cache cannot map"
                )
    return [regions[offset] for offset in sorted(regions)]


def mapped_bytes(strides: Sequence[int], num_blocks: int, granule: int) -> int:
    """Bytes a commit of `num_blocks` maps: each segment rounded up to the granule."""
    return sum(cdiv(num_blocks * stride, granule) * granule for stride in strides)


def blocks_within(strides: Sequence[int], measured_bytes: int, granule: int, cap: int) -> int:
    """The most blocks (at most `cap`) whose mapped segments fit `measured_bytes`."""
    per_block = sum(strides)
    if per_block <= 0:
        return cap
    # Mapped bytes never fall as blocks grow: the largest fitting count lies in
    # [0, the unrounded estimate] (a binary search bounds the cost; vLLM steps down).
    low, high = 0, min(measured_bytes // per_block, cap)
    while low < high:
        middle = (low + high + 1) // 2
        if mapped_bytes(strides, middle, granule) <= measured_bytes:
            low = middle
        else:
            high = middle - 1
    return low
