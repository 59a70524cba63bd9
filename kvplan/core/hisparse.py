"""HiSparse (vLLM 0.32+): sparse-MLA KV in a host pool, GPU indexer / resident /
hot groups. Enabled by the engine's HiSparse configuration; its grouping path
runs before every other path.

Groups, in order: the host-resident source group (the sparse-MLA layers), the
indexer group, one resident group and one hot group per hot unit (source layers
packed up to the indexer page, a unit starting at each index-group leader), then
the engine's other layers grouped as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvplan.core.errors import InsufficientMemory, InvalidRequest, UnplannableSpecs
from kvplan.core.layout import KVCacheLayout
from kvplan.core.specs import (
    HISPARSE_SPECS,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeSpecs,
    cdiv,
    round_up,
)

HOT_SUFFIX = ".hisparse_hot"
RESIDENT_SUFFIX = ".hisparse_resident"
MAX_DEVICE_BUFFER_ROWS = 1 << 15  # hot-buffer slots are int16 indices
DEFAULT_HOST_PAGE_BYTES = 4096
# The layout HiSparse's KV connector asks the engine core for (every release); the
# layout resolution takes it when the workers' lists leave it.
CONNECTOR_LAYOUT = KVCacheLayout.BLHNC


class InsufficientHostMemory(InsufficientMemory):
    """The HiSparse host pool cannot hold one max_model_len request."""


@dataclass(frozen=True)
class HiSparseConfig:
    host_pool_gib: float
    device_buffer_size: int | None = None
    shared_host_pool: bool = False
    index_topk: int | None = None
    host_page_bytes: int = DEFAULT_HOST_PAGE_BYTES  # the shared region's alignment

    @property
    def host_pool_bytes(self) -> int:
        return int(self.host_pool_gib * 2**30)

    def host_block_stride(self, source_page_bytes: int) -> int:
        if self.shared_host_pool:
            return round_up(source_page_bytes, self.host_page_bytes)
        return source_page_bytes


@dataclass(frozen=True)
class HiSparseGrouping:
    """Named groups (layer names, spec, host resident) before ids and flags."""

    groups: list[tuple[tuple[str, ...], KVCacheSpec, bool]]
    regular_count: int  # the trailing groups that came from the regular paths


def _device_buffer_size(config: HiSparseConfig, top_k: int, max_decode_query_len: int) -> int:
    minimum = max_decode_query_len * top_k
    if minimum > MAX_DEVICE_BUFFER_ROWS:
        # No device_buffer_size can help: name what made the rows too many.
        raise InvalidRequest(
            f"HiSparse needs a device buffer of max decode query {max_decode_query_len} x "
            f"top-k {top_k} = {minimum} rows, over the int16 slot-index limit "
            f"({MAX_DEVICE_BUFFER_ROWS}): lower "
            + ("num_speculative_tokens" if max_decode_query_len > 1 else "index_topk"),
            field=(
                "spec_decode.num_speculative_tokens"
                if max_decode_query_len > 1
                else "options.hisparse.index_topk"
            ),
        )
    size = config.device_buffer_size
    if size is None:
        size = (max_decode_query_len + 1) * top_k
        if size > MAX_DEVICE_BUFFER_ROWS:
            raise InvalidRequest(
                f"HiSparse's default device buffer, (max decode query "
                f"{max_decode_query_len} + 1) x top-k {top_k} = {size} rows, is over the "
                f"int16 slot-index limit ({MAX_DEVICE_BUFFER_ROWS}): set device_buffer_size "
                f"between {minimum} and {MAX_DEVICE_BUFFER_ROWS}",
                field="options.hisparse.device_buffer_size",
            )
    if size < minimum:
        raise InvalidRequest(
            f"HiSparse device_buffer_size ({size}) must cover every decode query's top-k "
            f"rows: max decode query {max_decode_query_len} x index_topk {top_k} = {minimum}",
            field="options.hisparse.device_buffer_size",
        )
    if size > MAX_DEVICE_BUFFER_ROWS:
        raise InvalidRequest(
            f"HiSparse device_buffer_size ({size}) exceeds the int16 slot-index limit "
            f"({MAX_DEVICE_BUFFER_ROWS})",
            field="options.hisparse.device_buffer_size",
        )
    return size


_Member = tuple[str, MLAAttentionSpec]
_GroupEntry = tuple[tuple[str, ...], KVCacheSpec, bool]


def _packed_units(source: dict[str, MLAAttentionSpec], indexer_page: int) -> list[list[_Member]]:
    """The sparse-MLA layers in units (an index group leader starts one), packed in
    order into hot-cache groups of at most the indexer's page."""
    units: list[list[_Member]] = []
    for name, spec in source.items():
        if spec.is_index_group_leader or not units:
            units.append([])
        units[-1].append((name, spec))
    packed: list[list[_Member]] = []
    current: list[_Member] = []
    current_page = 0
    for unit in units:
        unit_page = sum(spec.page_size_bytes for _, spec in unit)
        if current and current_page + unit_page > indexer_page:
            packed.append(current)
            current, current_page = [], 0
        current.extend(unit)
        current_page += unit_page
    if current:
        packed.append(current)
    return packed


def _resident_and_hot_groups(
    packed: list[list[_Member]], block_size: int, hot_blocks: int
) -> tuple[list[_GroupEntry], list[_GroupEntry]]:
    """Per packed group, its device-resident group and its hot-cache group."""
    resident: list[_GroupEntry] = []
    hot: list[_GroupEntry] = []
    for members in packed:
        pages = {spec.page_size_bytes for _, spec in members}
        if len(pages) != 1:
            raise UnplannableSpecs(
                f"HiSparse hot-cache groups need one page size, got {sorted(pages)} bytes"
            )
        page = pages.pop()
        names = [name for name, _ in members]
        resident.append(
            (
                tuple(name + RESIDENT_SUFFIX for name in names),
                HiSparseResidentSpec(block_size=block_size, page_size=page),
                False,
            )
        )
        hot.append(
            (
                tuple(name + HOT_SUFFIX for name in names),
                HiSparseHotSpec(
                    block_size=block_size, page_size=page, blocks_per_request=hot_blocks
                ),
                False,
            )
        )
    return resident, hot


def hisparse_groups(
    specs: dict[str, KVCacheSpec],
    config: HiSparseConfig,
    *,
    max_decode_query_len: int,
    use_topk_buffer_width: bool,
    regular: Callable[[dict[str, KVCacheSpec]], list[tuple[tuple[str, ...], KVCacheSpec]]],
) -> HiSparseGrouping | None:
    """The HiSparse groups, or None when the engine has no MLA layer."""
    mla = {n: s for n, s in specs.items() if isinstance(s, MLAAttentionSpec)}
    others = {
        n: s
        for n, s in specs.items()
        if not isinstance(s, MLAAttentionSpec | HiSparseHotSpec | HiSparseResidentSpec)
    }
    if not mla:
        return None
    if UniformTypeSpecs.from_specs(mla) is None:
        raise UnplannableSpecs(
            "HiSparse needs the MLA layers to be of one type (one block size, one DCP sharding)"
        )
    regular_groups = regular(others) if others else []

    if any(spec.model_version == "deepseek_v4" for spec in mla.values()):
        raise UnplannableSpecs("HiSparse does not support DeepSeek V4 MLA layers")
    source = {n: s for n, s in mla.items() if s.cache_role is SparseCacheRole.SPARSE}
    indexer = {n: s for n, s in mla.items() if s.cache_role is SparseCacheRole.INDEXER}
    if not source or not indexer:
        raise UnplannableSpecs("HiSparse needs sparse-MLA layers and indexer layers")
    block_sizes = {spec.block_size for spec in (*source.values(), *indexer.values())}
    if len(block_sizes) != 1:
        raise UnplannableSpecs(
            f"HiSparse needs one GPU block size, got {sorted(block_sizes)} tokens"
        )
    block_size = block_sizes.pop()

    def layer_top_k(spec: MLAAttentionSpec) -> int:
        if use_topk_buffer_width and spec.topk_buffer_width is not None:
            return spec.topk_buffer_width
        if config.index_topk is None:
            raise InvalidRequest(
                "HiSparse needs the model's index_topk (or mla.topk_buffer_width on "
                "every sparse-MLA layer)",
                field="options.hisparse.index_topk",
            )
        return config.index_topk

    top_k = max(layer_top_k(spec) for spec in source.values())
    buffer_rows = _device_buffer_size(config, top_k, max_decode_query_len)
    hot_blocks = cdiv(buffer_rows, block_size)

    indexer_wrapper = UniformTypeSpecs.from_specs(indexer)
    if indexer_wrapper is None:
        raise UnplannableSpecs("HiSparse needs the indexer layers to be of one type")
    indexer_page = sum(spec.page_size_bytes for spec in indexer.values())

    resident, hot = _resident_and_hot_groups(
        _packed_units(source, indexer_page), block_size, hot_blocks
    )
    source_wrapper = UniformTypeSpecs.from_specs(source)
    if source_wrapper is None:
        raise UnplannableSpecs("HiSparse needs the sparse-MLA layers to be of one type")
    groups = [
        (tuple(source), source_wrapper, True),
        (tuple(indexer), indexer_wrapper, False),
        *resident,
        *hot,
        *((names, spec, False) for names, spec in regular_groups),
    ]
    return HiSparseGrouping(groups, len(regular_groups))


def host_num_blocks(config: HiSparseConfig, source_page_bytes: int) -> int:
    """Blocks of the host pool (0 or fewer: none allocatable)."""
    return config.host_pool_bytes // config.host_block_stride(source_page_bytes)


def check_host_pool(
    config: HiSparseConfig, source_page_bytes: int, block_size: int, max_model_len: int
) -> int:
    """The host pool's block count; it must hold one max_model_len request plus
    the null block and a copy-on-write tail."""
    blocks = host_num_blocks(config, source_page_bytes)
    if blocks <= 0:
        raise InsufficientHostMemory(
            f"the HiSparse host pool ({config.host_pool_gib} GiB) holds no block of "
            f"{config.host_block_stride(source_page_bytes)} bytes; increase host_pool_gib",
            field="options.hisparse.host_pool_gib",
            details={"host_num_blocks": blocks},
        )
    needed = cdiv(max_model_len, block_size) + 2
    if blocks < needed:
        raise InsufficientHostMemory(
            f"the HiSparse host pool has {blocks} blocks but max_model_len "
            f"({max_model_len}) needs {needed}; increase host_pool_gib or decrease "
            "max_model_len",
            field="options.hisparse.host_pool_gib",
            details={"host_num_blocks": blocks, "needed_host_blocks": needed},
        )
    return blocks


def is_hisparse_spec(spec: KVCacheSpec) -> bool:
    return isinstance(spec, HISPARSE_SPECS)
