"""Physical layout of a worker's KV cache: bytes per block, strides, tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from kvplan.core.errors import UnplannableSpecs
from kvplan.core.groups import KVCacheGroup
from kvplan.core.specs import HiSparseHotSpec, KVCacheSpec, SpecInvariantError, round_up

AXIS_L, AXIS_B, AXIS_H, AXIS_N, AXIS_C = 0, 1, 2, 3, 4


class KVCacheLayout(Enum):
    """Physical order of the logical [L, B, H, N, C] axes, outermost first."""

    LBNHC = (AXIS_L, AXIS_B, AXIS_N, AXIS_H, AXIS_C)
    LBHNC = (AXIS_L, AXIS_B, AXIS_H, AXIS_N, AXIS_C)
    LHBNC = (AXIS_L, AXIS_H, AXIS_B, AXIS_N, AXIS_C)
    BLHNC = (AXIS_B, AXIS_L, AXIS_H, AXIS_N, AXIS_C)
    BLNHC = (AXIS_B, AXIS_L, AXIS_N, AXIS_H, AXIS_C)
    BHLNC = (AXIS_B, AXIS_H, AXIS_L, AXIS_N, AXIS_C)

    # `_value_`, not `value`: Enum.value is a descriptor call (0.3 µs), and these
    # are asked several times per group.
    @property
    def is_layer_compact(self) -> bool:
        return self._value_[0] == AXIS_L

    @property
    def is_block_compact(self) -> bool:
        """Each page is one contiguous run: L and B are the two outer axes."""
        return set(self._value_[:2]) == {AXIS_L, AXIS_B}

    @property
    def is_block_outermost(self) -> bool:
        return self._value_[0] == AXIS_B


@dataclass(frozen=True)
class TensorPlacement:
    """Layer `layer_names[l]`, block `b` starts at
    offset_bytes + l * layer_stride_bytes + b * block_stride_bytes."""

    size_bytes: int
    layer_names: tuple[str, ...]
    layer_stride_bytes: int
    block_stride_bytes: int
    offset_bytes: int
    group_id: int
    host_resident: bool = False  # HiSparse host pool


def layer_block_stride(spec: KVCacheSpec) -> int:
    """A layer-outer block stride: the page rounded up to its alignment."""
    return round_up(spec.page_size_bytes, spec.stride_alignment_bytes())


def bytes_per_block(
    groups: list[KVCacheGroup], layout: KVCacheLayout, *, hot_pages_align_pool: bool = True
) -> int:
    """Bytes one block id costs the pool: the widest group's footprint."""
    if not layout.is_block_outermost:
        return max(
            sum(len(names) * layer_block_stride(spec) for spec, names in group.layer_runs)
            for group in groups
        )
    widest = max(
        sum(len(names) * spec.page_size_bytes for spec, names in group.layer_runs)
        for group in groups
    )
    if widest <= 0:
        raise UnplannableSpecs("a worker without layers cannot hold a block-outermost cache")
    alignments = [spec.stride_alignment_bytes() for group in groups for spec, _ in group.layer_runs]
    if hot_pages_align_pool:
        # vLLM 0.32 / 0.33 align the pool to every HiSparse hot group's page, also
        # on a worker (pipeline stage) that holds none of its layers (0.34: only
        # the worker's own layers' alignments).
        alignments += [
            group.spec.page_size_bytes
            for group in groups
            if not group.layer_names and isinstance(group.spec, HiSparseHotSpec)
        ]
    return round_up(widest, math.lcm(*alignments)) if alignments else widest


def validate_layout(layout: KVCacheLayout, groups: list[KVCacheGroup]) -> None:
    """Mixed page sizes pack pages side by side inside a block, and padded pages
    pad a page grid: the layout must be able to express both. (vLLM 0.33+ places
    one block's tensors to size a block, before its memory checks: a padded page
    the layout cannot express stops it there.)"""
    for group in groups:
        for spec, _ in group.layer_runs:
            check_page_padding(spec, layout)
    check_mixed_page_sizes(layout, groups)


def check_mixed_page_sizes(layout: KVCacheLayout, groups: list[KVCacheGroup]) -> None:
    """Mixed page sizes pack pages side by side inside a block: a block-compact
    layout, and with several groups the layer axis inside the block axis (vLLM's
    validate_kv_cache_layout, a ValueError)."""
    page_sizes = {spec.page_size_bytes for group in groups for spec, _ in group.layer_runs}
    if len(page_sizes) <= 1:
        return
    if not layout.is_block_compact or (len(groups) > 1 and layout.is_layer_compact):
        raise UnplannableSpecs(
            f"KV cache layout {layout.name} cannot express mixed page sizes "
            f"{sorted(page_sizes)} bytes; use a block-outermost layout such as BLHNC"
        )


def check_page_padding(
    spec: KVCacheSpec, layout: KVCacheLayout, *, num_blocks: int | None = None
) -> None:
    """Pages the layout must be able to pad. A padded page pads the grid of layers
    and blocks: the layout may put no axis but L and B in front of the later of the
    two unless it has one element (of the six layouts, LHBNC and BHLNC put H there),
    and what it lays out behind the grid must fit the padded page or be a multiple
    of it. Padding to a stride alignment needs a block-compact layout (or a
    block-outermost one, whose blocks interleave). `num_blocks` 0: a pool of no
    blocks, whose page grid is empty whatever axes it holds (only the tail counts)."""
    padded = spec.padded_page_bytes
    if padded is not None:
        order = layout._value_
        grid_end = max(order.index(AXIS_L), order.index(AXIS_B)) + 1
        if AXIS_H in order[:grid_end] and spec.num_heads != 1 and num_blocks != 0:
            raise SpecInvariantError(
                f"layout {layout.name} cannot pad pages of layers with "
                f"{spec.num_heads} head slots; use a block-compact layout such as LBNHC"
            )
        # vLLM's compute_layout_strides: the stride after the page tail (H, N, C
        # behind the grid) must be a multiple of the padded page. A Mamba page
        # counts its states once whatever its head slots, so its tail can pass it.
        dims = {
            AXIS_H: spec.num_heads,
            AXIS_N: spec.states_per_block,
            AXIS_C: spec.state_content_size_bytes,
        }
        tail = math.prod(dims[axis] for axis in order[grid_end:])
        if tail > padded and tail % padded:
            raise SpecInvariantError(
                f"layout {layout.name} cannot pad a page it lays out as {tail} bytes "
                f"({spec.num_heads} head slots) to {padded} bytes: the padded page size "
                "must be at least that, or divide it"
            )
    if (
        not layout.is_block_outermost
        and not layout.is_block_compact
        and layer_block_stride(spec) != spec.page_size_bytes
    ):
        # vLLM 0.33+ places one block before its memory checks (0.32: while
        # building each worker's config), and asserts there.
        raise UnplannableSpecs(
            f"layout {layout.name} cannot pad {spec.page_size_bytes}-byte pages to their "
            f"{layer_block_stride(spec)}-byte stride alignment; use a block-compact layout "
            "such as LBNHC"
        )


def layout_strides(
    spec: KVCacheSpec,
    num_blocks: int,
    num_layers: int,
    layout: KVCacheLayout,
    fixed_block_stride: int | None,
) -> tuple[int, int]:
    """(layer stride, block stride) in bytes for `num_layers` layers of `spec`, in a
    layout `validate_layout` accepted for it (a padded page: `check_page_padding`)."""
    shape = (
        num_layers,
        num_blocks,
        spec.num_heads,
        spec.states_per_block,
        spec.state_content_size_bytes,
    )
    order = layout._value_
    padded_page = spec.padded_page_bytes
    page_grid_end = max(order.index(AXIS_L), order.index(AXIS_B)) + 1
    strides = [0] * 5
    running = 1
    for position in range(len(order) - 1, -1, -1):
        axis = order[position]
        if padded_page is not None and position == page_grid_end - 1:
            running = max(running, padded_page)
        fixed = fixed_block_stride if axis == AXIS_B else None
        strides[axis] = fixed or running
        running = strides[axis] * shape[axis]
    return strides[AXIS_L], strides[AXIS_B]


def place_tensors(
    groups: list[KVCacheGroup],
    num_blocks: int,
    layout: KVCacheLayout,
    block_bytes: int,
    *,
    own_layers_only: bool = True,
) -> list[TensorPlacement]:
    """Tensors of one worker. Every group starts at byte 0 (groups alias the pool:
    a block id belongs to one group at a time); inside a group each run of
    identically specced layers follows the previous one. Without
    `own_layers_only` (vLLM 0.32 / 0.33), a uniform-type group the worker holds
    no layer of places tensors for all of the group's layers."""
    size = block_bytes * num_blocks
    interleaved_stride = block_bytes if layout.is_block_outermost else None
    placements: list[TensorPlacement] = []
    # Hybrid groups repeat one spec object and layer count: strides computed once
    # per pair (Gemma-3-style, 64 layers: 7 groups, 2 computations; place_tensors
    # 25 -> 19 µs).
    strides_of: dict[tuple[int, int], tuple[int, int]] = {}
    for group in groups:
        # Only this worker's layers: a group with no layer here gets no tensor
        # (vLLM 0.33 would place the whole wrapper's foreign layers here).
        offset = 0
        runs = group.layer_runs
        if not own_layers_only and not group.layer_names:
            runs = group.wrapper_layer_runs
        for spec, names in runs:
            if not spec.has_layer_views:
                # HiSparse hot / resident pages: addressed by page, strided by block.
                if not layout.is_block_outermost:
                    raise UnplannableSpecs(
                        f"HiSparse needs a block-outermost KV cache layout, got {layout.name}"
                    )
                placements.append(
                    TensorPlacement(
                        size_bytes=size,
                        layer_names=tuple(names),
                        layer_stride_bytes=spec.page_size_bytes,
                        block_stride_bytes=block_bytes,
                        offset_bytes=offset,
                        group_id=group.group_id,
                    )
                )
                offset += len(names) * spec.page_size_bytes
                continue
            strides = strides_of.get((id(spec), len(names)))
            if strides is None:
                block_stride = interleaved_stride
                padded_stride = layer_block_stride(spec)
                if block_stride is None and padded_stride != spec.page_size_bytes:
                    block_stride = padded_stride  # a block-compact layout (validate_layout)
                strides = strides_of[(id(spec), len(names))] = layout_strides(
                    spec, num_blocks, len(names), layout, block_stride
                )
            layer_stride, block_stride = strides
            placements.append(
                TensorPlacement(
                    size_bytes=size,
                    layer_names=tuple(names),
                    layer_stride_bytes=layer_stride,
                    block_stride_bytes=block_stride,
                    offset_bytes=offset,
                    group_id=group.group_id,
                )
            )
            advance = spec.page_size_bytes if layout.is_block_outermost else layer_stride
            offset += len(names) * advance
    return placements
