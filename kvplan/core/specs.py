"""Layer KV-cache specs: page sizes, per-request memory bounds, merge rules.

The class tree, the merge rules and the "uniform type" rules follow vLLM
0.33's semantics exactly, since which layers may share a block table is decided
by them. Specs are immutable values compared by value; `is_draft` takes no part
in equality, so marking a drafter's layer never changes how layers group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from fractions import Fraction
from typing import Any, ClassVar, Self

from kvplan.core.cached import cached_value
from kvplan.core.dtypes import StorageDtype
from kvplan.core.errors import InvalidRequest, UnplannableSpecs
from kvplan.core.rules import KVPLAN, RuleSet


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    return cdiv(value, multiple) * multiple


class IncompatibleSpecs(UnplannableSpecs):
    """Specs that cannot share one group (vLLM signals this with an assertion)."""


class ConflictingWindows(UnplannableSpecs):
    """Mergeable full-attention specs that carry two different window sizes."""


class SpecInvariantError(UnplannableSpecs):
    """A spec rule of the reference engine does not hold for these inputs."""


@dataclass(frozen=True)
class MultipleOf:
    """Block stride must be a whole number of kernel blocks of `base` tokens."""

    base: int


@dataclass(frozen=True)
class PlanningContext:
    """Engine settings that bound how much cache one request can need."""

    max_model_len: int  # tokens
    max_in_flight_tokens: int  # tokens scheduled but not yet settled
    dcp_size: int = 1
    mamba_align_mode: bool = False
    max_num_encoder_input_tokens: int = 0

    def with_max_model_len(self, max_model_len: int) -> PlanningContext:
        return replace(self, max_model_len=max_model_len)


class SparseCacheRole(StrEnum):
    SPARSE = "sparse"
    INDEXER = "indexer"


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """One layer's cache format."""

    kind: ClassVar[str] = "spec"

    block_size: int  # tokens per block
    dcp_sharded: bool = False  # token positions sharded across DCP ranks
    block_stride_alignment: int | MultipleOf | None = None  # bytes between blocks
    is_draft: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        alignment = self.block_stride_alignment
        if isinstance(alignment, int) and alignment <= 0:
            raise InvalidRequest("block_stride_alignment must be positive")

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def num_heads(self) -> int:
        raise NotImplementedError

    @property
    def state_content_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def states_per_block(self) -> int:
        return 1

    @property
    def padded_page_bytes(self) -> int | None:
        return None

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def has_layer_views(self) -> bool:
        """Each layer's pages form a tensor view (not so for HiSparse hot / resident)."""
        return True

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        """Bytes one request of `ctx.max_model_len` tokens can hold at most."""
        raise NotImplementedError

    def block_table_width(self, ctx: PlanningContext, max_len: int) -> int:
        return cdiv(max_len, self.block_size)

    def with_block_size(self, block_size: int) -> Self:
        return replace(self, block_size=block_size)

    def stride_alignment_bytes(self) -> int:
        alignment = self.block_stride_alignment
        if not isinstance(alignment, MultipleOf):
            return alignment or 1
        kernel_block_size = math.gcd(alignment.base, self.block_size)
        if kernel_block_size == self.block_size:
            return 1
        kernel_page = self.with_block_size(kernel_block_size).page_size_bytes
        if kernel_page <= 0:
            # vLLM divides by it (round_up in _get_layer_block_stride): ZeroDivisionError.
            raise SpecInvariantError(
                f"a kernel block of {kernel_block_size} tokens holds no state, so it "
                "cannot give the block stride alignment (multiple_of_kernel_block_tokens)"
            )
        return kernel_page

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec], rules: RuleSet = KVPLAN) -> KVCacheSpec:
        """One spec standing for all `specs`; raises IncompatibleSpecs if none can."""
        first = specs[0]
        if not all(spec is first or spec == first for spec in specs[1:]):
            raise IncompatibleSpecs("all layers of one KV cache group must have the same spec")
        return specs[0]

    @classmethod
    def grouping_base(cls) -> type[KVCacheSpec]:
        """The class whose instances count as the same "type" as this one."""
        raise SpecInvariantError(f"{cls.__name__} takes no part in grouping")

    def is_uniform_with(self, specs: Iterable[KVCacheSpec]) -> bool:
        base = self.grouping_base()
        return all(isinstance(spec, base) for spec in specs)


# Attention fields that must agree for layers to share one spec.
_ATTENTION_IDENTITY_FIELDS = (
    "block_size",
    "dcp_sharded",
    "block_stride_alignment",
    "max_tp_shards",
    "num_kv_heads",
    "head_size",
    "dtype",
    "head_size_v",
    "kv_quant_mode",
    "page_size_padded",
    "num_head_slots",
    "state_content_bytes",
    "tokens_per_state",
    "kv_head_major_slots",
)

# What a merged full-attention spec takes from the group's first layer.
_FULL_MERGE_FIELDS = (
    "block_size",
    "block_stride_alignment",
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "kv_quant_mode",
    "dcp_sharded",
    "max_tp_shards",
    "page_size_padded",
    "num_head_slots",
    "state_content_bytes",
    "tokens_per_state",
    "kv_head_major_slots",
)


def _take(spec: KVCacheSpec, names: Iterable[str]) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in names}


def _single(values: Iterable[object], what: str) -> Any:
    distinct = set(values)
    if len(distinct) != 1:
        raise IncompatibleSpecs(f"all layers of one KV cache group must share one {what}")
    return distinct.pop()


def _merge_window(values: Iterable[int | None]) -> int | None:
    windows = {value for value in values if value is not None}
    if len(windows) > 1:
        raise ConflictingWindows(
            "all attention layers of one KV cache group must have the same window size, "
            f"got {sorted(windows)}"
        )
    return windows.pop() if windows else None


def _check_attention_identity(specs: Sequence[KVCacheSpec], merged: KVCacheSpec) -> None:
    for spec in specs:
        for name in _ATTENTION_IDENTITY_FIELDS:
            if getattr(spec, name) != getattr(merged, name):
                raise IncompatibleSpecs(
                    "all attention layers of one KV cache group must have the same "
                    f"attention spec ({name} differs)"
                )


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    kind: ClassVar[str] = "attention"

    dcp_sharded: bool = True
    max_tp_shards: int | None = None
    num_kv_heads: int
    head_size: int  # elements
    dtype: StorageDtype
    head_size_v: int | None = None  # None: same as head_size
    kv_quant_mode: int = 0
    page_size_padded: int | None = None  # bytes
    num_head_slots: int | None = None
    state_content_bytes: int | None = None  # bytes per (head slot, state) cell
    tokens_per_state: int | Fraction = 1
    # vLLM 0.34+: head slots grouped by KV head; part of the identity only.
    kv_head_major_slots: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def num_heads(self) -> int:
        return self.num_head_slots if self.num_head_slots is not None else self.num_kv_heads

    @property
    def states_per_block(self) -> int:
        if self.tokens_per_state > 0:
            return int(self.block_size // self.tokens_per_state)
        return 1

    @cached_value
    def state_content_size_bytes(self) -> int:
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        head_size_v = self.head_size_v if self.head_size_v is not None else self.head_size
        return (self.head_size + head_size_v) * self.dtype.size_bytes

    @cached_value
    def unpadded_page_size_bytes(self) -> int:
        return self.num_heads * self.states_per_block * self.state_content_size_bytes

    @cached_value
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            if self.page_size_padded < self.unpadded_page_size_bytes:
                raise SpecInvariantError(
                    f"padded page ({self.page_size_padded} bytes) is smaller than the "
                    f"page it pads ({self.unpadded_page_size_bytes} bytes)"
                )
            return self.page_size_padded
        return self.unpadded_page_size_bytes

    @property
    def padded_page_bytes(self) -> int | None:
        return self.page_size_padded

    def block_table_width(self, ctx: PlanningContext, max_len: int) -> int:
        shards = ctx.dcp_size if self.dcp_sharded else 1
        return cdiv(max_len, self.block_size * shards)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Global attention. A window / chunk size here is metadata of local attention
    allocated as full (hybrid manager off); it does not change the page."""

    kind: ClassVar[str] = "full_attention"

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        max_len = ctx.max_model_len
        if self.dcp_sharded and ctx.dcp_size > 1:
            max_len = cdiv(max_len, ctx.dcp_size)
        return cdiv(max_len, self.block_size) * self.page_size_bytes

    @classmethod
    def grouping_base(cls) -> type[KVCacheSpec]:
        return FullAttentionSpec

    @classmethod
    def _check_full_family(cls, specs: Sequence[KVCacheSpec]) -> list[FullAttentionSpec]:
        full_specs = [spec for spec in specs if isinstance(spec, FullAttentionSpec)]
        if len(full_specs) != len(specs):
            raise IncompatibleSpecs("all layers of the group must be full attention")
        if any(isinstance(spec, MLAAttentionSpec) for spec in full_specs):
            raise IncompatibleSpecs("MLA layers merge only with MLA layers")
        return full_specs

    @staticmethod
    def _check_window_xor_chunk(merged: FullAttentionSpec) -> None:
        if merged.sliding_window is not None and merged.attention_chunk_size is not None:
            raise IncompatibleSpecs(
                "sliding-window and chunked-local layers cannot share one full-attention group"
            )

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec], rules: RuleSet = KVPLAN) -> KVCacheSpec:
        only = specs[0]
        if len(specs) == 1 and type(only) is cls and not only.is_draft:
            # One spec merges into an equal one, its draft flag cleared: itself when
            # unflagged (no rebuild, once per hybrid bucket).
            assert isinstance(only, FullAttentionSpec)
            cls._check_window_xor_chunk(only)
            return only
        full_specs = cls._check_full_family(specs)
        merged = cls(
            **_take(full_specs[0], _FULL_MERGE_FIELDS),
            sliding_window=_merge_window(spec.sliding_window for spec in full_specs),
            attention_chunk_size=_merge_window(spec.attention_chunk_size for spec in full_specs),
            non_causal=any(spec.non_causal for spec in full_specs),
        )
        _check_attention_identity(specs, merged)
        cls._check_window_xor_chunk(merged)
        return merged


def _pad_to_alignment(spec: MLAAttentionSpec | SlidingWindowMLASpec) -> None:
    # MLA pages are padded to their row alignment at construction.
    if spec.alignment is None:
        return
    padded = round_up(spec.unpadded_page_size_bytes, spec.alignment)
    if padded != spec.unpadded_page_size_bytes:
        object.__setattr__(spec, "page_size_padded", padded)


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per state, no separate V."""

    kind: ClassVar[str] = "mla_attention"

    cache_dtype_str: str | None = None
    topk_buffer_width: int | None = None
    alignment: int | None = None  # bytes
    model_version: str | None = None
    cache_role: SparseCacheRole = SparseCacheRole.SPARSE
    is_index_group_leader: bool = False
    # Spec marker of a drafter layer (non-causal query block decoded as rows).
    non_causal_multi_token_decode: bool = False
    head_size_v: int | None = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _pad_to_alignment(self)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec], rules: RuleSet = KVPLAN) -> KVCacheSpec:
        mla_specs = [spec for spec in specs if isinstance(spec, MLAAttentionSpec)]
        if len(mla_specs) != len(specs):
            raise IncompatibleSpecs("MLA layers merge only with MLA layers")
        first = mla_specs[0]
        merged = cls(
            **_take(
                first,
                (
                    "block_size",
                    "num_kv_heads",
                    "head_size",
                    "dtype",
                    "kv_quant_mode",
                    "dcp_sharded",
                    "max_tp_shards",
                    "page_size_padded",
                    "num_head_slots",
                    "state_content_bytes",
                    "kv_head_major_slots",
                ),
            ),
            cache_dtype_str=_single((s.cache_dtype_str for s in mla_specs), "cache dtype"),
            topk_buffer_width=_single((s.topk_buffer_width for s in mla_specs), "top-k width"),
            tokens_per_state=_single((s.tokens_per_state for s in mla_specs), "tokens per state"),
            model_version=_single((s.model_version for s in mla_specs), "model version"),
            cache_role=_single((s.cache_role for s in mla_specs), "cache role"),
            is_index_group_leader=_single(
                (s.is_index_group_leader for s in mla_specs), "index-sharing role"
            ),
            block_stride_alignment=_single(
                (s.block_stride_alignment for s in mla_specs), "block stride alignment"
            ),
            non_causal_multi_token_decode=any(s.non_causal_multi_token_decode for s in mla_specs),
        )
        _check_attention_identity(specs, merged)
        return merged


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Hidden-state extraction cache: MLA page format, always a group of its own."""

    kind: ClassVar[str] = "hidden_state_cache"


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention; planning does not count the window."""

    kind: ClassVar[str] = "rswa"

    rswa_window: int

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec], rules: RuleSet = KVPLAN) -> KVCacheSpec:
        rswa_specs = [spec for spec in specs if isinstance(spec, RSWASpec)]
        if len(rswa_specs) != len(specs):
            raise IncompatibleSpecs("R-SWA layers merge only with R-SWA layers")
        window = _single((spec.rswa_window for spec in rswa_specs), "rswa_window")
        base = FullAttentionSpec.merge(specs, rules)
        return cls(
            **_take(
                base,
                (*_FULL_MERGE_FIELDS, "sliding_window", "attention_chunk_size", "non_causal"),
            ),
            rswa_window=window,
        )


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with attention sinks; planning does not count the sink."""

    kind: ClassVar[str] = "sink_full_attention"

    sink_len: int | None = None

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec], rules: RuleSet = KVPLAN) -> KVCacheSpec:
        full_specs = cls._check_full_family(specs)
        first = full_specs[0]
        # Like vLLM 0.33, the merged sink spec keeps the default tokens_per_state.
        merged = cls(
            **_take(first, [name for name in _FULL_MERGE_FIELDS if name != "tokens_per_state"]),
            sink_len=getattr(first, "sink_len", None),
            sliding_window=_merge_window(spec.sliding_window for spec in full_specs),
            attention_chunk_size=_merge_window(spec.attention_chunk_size for spec in full_specs),
            non_causal=any(spec.non_causal for spec in full_specs),
        )
        _check_attention_identity(specs, merged)
        cls._check_window_xor_chunk(merged)
        return merged


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    kind: ClassVar[str] = "chunked_local_attention"

    attention_chunk_size: int

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        tokens = min(self.attention_chunk_size + ctx.max_in_flight_tokens, ctx.max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes

    def is_uniform_with(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(
            isinstance(spec, ChunkedLocalAttentionSpec)
            and spec.attention_chunk_size == self.attention_chunk_size
            for spec in specs
        )


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    kind: ClassVar[str] = "sliding_window"

    sliding_window: int
    # Trailing tokens kept below the window for multi-module MTP re-prefill;
    # set by the planner, not by the caller.
    extra_retained_tokens: int = 0

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        if self.dcp_sharded and ctx.dcp_size > 1:
            raise UnplannableSpecs(
                "decode context parallelism does not support sliding-window attention "
                "(set dcp_sharded=false on the layer or decode_context_parallel_size=1)"
            )
        tokens = min(
            self.sliding_window - 1 + self.extra_retained_tokens + ctx.max_in_flight_tokens,
            ctx.max_model_len,
        )
        # +1: the window may start in the middle of a block.
        return (cdiv(tokens, self.block_size) + 1) * self.page_size_bytes

    def is_uniform_with(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(
            isinstance(spec, SlidingWindowSpec) and spec.sliding_window == self.sliding_window
            for spec in specs
        )


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    kind: ClassVar[str] = "sliding_window_mla"

    cache_dtype_str: str | None = None
    alignment: int | None = None  # bytes
    model_version: str | None = None
    bounded_replay: bool = False
    head_size_v: int | None = 0
    # vLLM 0.34+: the spec marker of a windowed drafter layer (OR-ed by merge).
    non_causal_multi_token_decode: bool = False

    def __post_init__(self) -> None:
        if self.model_version not in (None, "deepseek_v4"):
            raise InvalidRequest(
                f"sliding-window MLA supports model_version '' or 'deepseek_v4', "
                f"got {self.model_version!r}"
            )
        super().__post_init__()
        _pad_to_alignment(self)

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec], rules: RuleSet = KVPLAN) -> KVCacheSpec:
        sw_specs = [spec for spec in specs if isinstance(spec, SlidingWindowMLASpec)]
        if len(sw_specs) != len(specs):
            raise IncompatibleSpecs("sliding-window MLA layers merge only with their own kind")
        _single((s.dcp_sharded for s in sw_specs), "DCP sharding")
        _single((s.max_tp_shards for s in sw_specs), "TP shard count")
        first = sw_specs[0]
        # vLLM 0.32 / 0.33 carry only these fields (the merged spec has the default
        # quant mode and no alignment); 0.34 requires and keeps equal ones.
        kept: dict[str, Any] = {}
        if rules.sw_mla_merge_keeps_quant_and_alignment:
            kept["kv_quant_mode"] = _single((s.kv_quant_mode for s in sw_specs), "KV quant mode")
            kept["alignment"] = _single((s.alignment for s in sw_specs), "alignment")
        return cls(
            **kept,
            **_take(
                first,
                (
                    "block_size",
                    "num_kv_heads",
                    "head_size",
                    "dtype",
                    "dcp_sharded",
                    "max_tp_shards",
                    "page_size_padded",
                    "num_head_slots",
                    "state_content_bytes",
                    "kv_head_major_slots",
                ),
            ),
            non_causal_multi_token_decode=any(s.non_causal_multi_token_decode for s in sw_specs),
            block_stride_alignment=_single(
                (s.block_stride_alignment for s in sw_specs), "block stride alignment"
            ),
            sliding_window=_single((s.sliding_window for s in sw_specs), "sliding window"),
            extra_retained_tokens=_single(
                (s.extra_retained_tokens for s in sw_specs), "retained token count"
            ),
            cache_dtype_str=_single((s.cache_dtype_str for s in sw_specs), "cache dtype"),
            tokens_per_state=_single((s.tokens_per_state for s in sw_specs), "tokens per state"),
            model_version=_single((s.model_version for s in sw_specs), "model version"),
            bounded_replay=_single((s.bounded_replay for s in sw_specs), "replay policy"),
        )

    def is_uniform_with(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(
            isinstance(spec, SlidingWindowMLASpec)
            and spec.sliding_window == self.sliding_window
            and spec.bounded_replay == self.bounded_replay
            for spec in specs
        )


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """One ring block per request for its whole lifetime."""

    kind: ClassVar[str] = "circular_buffer"

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        return self.page_size_bytes

    def block_table_width(self, ctx: PlanningContext, max_len: int) -> int:
        return 1

    def is_uniform_with(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(isinstance(spec, CircularBufferSpec) for spec in specs)


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Needs no KV cache; never enters grouping."""

    kind: ClassVar[str] = "encoder_only_attention"

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        return 0


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross attention: caches the encoder's states."""

    kind: ClassVar[str] = "cross_attention"

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        return cdiv(ctx.max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes

    @classmethod
    def grouping_base(cls) -> type[KVCacheSpec]:
        return CrossAttentionSpec


@dataclass(frozen=True)
class StateShape:
    """One recurrent state tensor of a Mamba-style layer."""

    shape: tuple[int, ...]
    dtype: StorageDtype

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size_bytes


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Mamba / gated-delta-net / linear-attention state: one page per state."""

    kind: ClassVar[str] = "mamba"

    states: tuple[StateShape, ...]
    page_size_padded: int | None = None  # bytes
    mamba_type: str = "MAMBA2"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None  # tokens
    num_state_heads: int = 1  # H of the logical page
    tp_replicated: bool = False
    state_alignment: int = 1  # vLLM 0.34+: bytes each state is rounded up to

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.state_alignment <= 0:
            raise InvalidRequest("state_alignment_bytes must be >= 1")
        padded = self.page_size_padded
        if padded is not None and padded % self.state_alignment:
            raise InvalidRequest(
                f"page_size_padded_bytes ({padded}) must be a multiple of "
                f"state_alignment_bytes ({self.state_alignment})"
            )

    @property
    def num_heads(self) -> int:
        return self.num_state_heads

    @cached_value
    def state_content_size_bytes(self) -> int:
        return sum(round_up(state.size_bytes, self.state_alignment) for state in self.states)

    @cached_value
    def page_size_bytes(self) -> int:
        real_page = self.state_content_size_bytes
        if self.page_size_padded is not None:
            if self.page_size_padded < real_page:
                raise SpecInvariantError(
                    f"padded Mamba page ({self.page_size_padded} bytes) is smaller than "
                    f"its states ({real_page} bytes)"
                )
            return self.page_size_padded
        return real_page

    @property
    def padded_page_bytes(self) -> int | None:
        return self.page_size_padded

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        if ctx.mamba_align_mode:
            pages = 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        else:
            pages = 1 + self.num_speculative_blocks
        return pages * self.page_size_bytes

    def block_table_width(self, ctx: PlanningContext, max_len: int) -> int:
        if ctx.mamba_align_mode:
            return cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return cdiv(self.max_memory_usage_bytes(ctx), self.page_size_bytes)

    def is_uniform_with(self, specs: Iterable[KVCacheSpec]) -> bool:
        page = self.page_size_bytes
        return all(
            isinstance(spec, MambaSpec)
            and spec.num_speculative_blocks == self.num_speculative_blocks
            and spec.num_prefill_checkpoint_blocks == self.num_prefill_checkpoint_blocks
            and spec.prefill_checkpoint_alignment == self.prefill_checkpoint_alignment
            and spec.page_size_bytes == page
            and spec.state_alignment == self.state_alignment
            and spec.tp_replicated == self.tp_replicated
            for spec in specs
        )


@dataclass(frozen=True, kw_only=True)
class HiSparseHotSpec(KVCacheSpec):
    """HiSparse hot cache of sparse-MLA layers: a fixed number of GPU blocks per
    request, addressed without per-layer views."""

    kind: ClassVar[str] = "hisparse_hot"

    page_size: int  # bytes
    blocks_per_request: int

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        return self.blocks_per_request * self.page_size

    def block_table_width(self, ctx: PlanningContext, max_len: int) -> int:
        return self.blocks_per_request

    @property
    def has_layer_views(self) -> bool:
        return False

    def stride_alignment_bytes(self) -> int:
        # The block stride holds whole hot pages.
        return math.lcm(self.page_size, super().stride_alignment_bytes())


@dataclass(frozen=True, kw_only=True)
class HiSparseResidentSpec(KVCacheSpec):
    """HiSparse reclaimable GPU-resident pages: the tokens in flight."""

    kind: ClassVar[str] = "hisparse_resident"

    page_size: int  # bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        tokens = min(ctx.max_in_flight_tokens, ctx.max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size

    @property
    def has_layer_views(self) -> bool:
        return False


HISPARSE_SPECS = (HiSparseHotSpec, HiSparseResidentSpec)


@dataclass(frozen=True, kw_only=True)
class UniformTypeSpecs(KVCacheSpec):
    """A group of one layer type whose layers keep their own specs (pages may differ)."""

    kind: ClassVar[str] = "uniform_type"

    layer_specs: tuple[tuple[str, KVCacheSpec], ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_specs:
            object.__setattr__(self, "dcp_sharded", self.first_spec.dcp_sharded)

    @cached_value
    def specs_by_layer(self) -> dict[str, KVCacheSpec]:
        return dict(self.layer_specs)

    @property
    def first_spec(self) -> KVCacheSpec:
        return self.layer_specs[0][1]

    @property
    def prefix_cacheable(self) -> bool:
        return all(spec.prefix_cacheable for _, spec in self.layer_specs)

    @cached_value
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for _, spec in self.layer_specs)

    def max_memory_usage_pages(self, ctx: PlanningContext) -> int:
        return max(
            cdiv(spec.max_memory_usage_bytes(ctx), spec.page_size_bytes)
            for _, spec in self.layer_specs
        )

    def max_memory_usage_bytes(self, ctx: PlanningContext) -> int:
        return self.max_memory_usage_pages(ctx) * self.page_size_bytes

    def block_table_width(self, ctx: PlanningContext, max_len: int) -> int:
        widths = {spec.block_table_width(ctx, max_len) for _, spec in self.layer_specs}
        if len(widths) != 1:
            raise SpecInvariantError(
                f"layers of one group need different block-table widths: {sorted(widths)}"
            )
        return widths.pop()

    def max_layers_per_page_size(self) -> int:
        counts: dict[int, int] = {}
        for _, spec in self.layer_specs:
            counts[spec.page_size_bytes] = counts.get(spec.page_size_bytes, 0) + 1
        return max(counts.values())

    @staticmethod
    def is_uniform_type(
        specs: Mapping[str, KVCacheSpec], distinct: Sequence[KVCacheSpec] | None = None
    ) -> bool:
        """`distinct`: each spec object of `specs` once, in first-seen order, when the
        caller has them (layers share spec objects)."""
        values = distinct
        if values is None:
            values = list({id(spec): spec for spec in specs.values()}.values())
        if len({spec.block_size for spec in values}) > 1:
            return False
        if len({spec.dcp_sharded for spec in values}) > 1:
            return False
        return values[0].is_uniform_with(values)

    @classmethod
    def from_specs(
        cls, specs: Mapping[str, KVCacheSpec], distinct: Sequence[KVCacheSpec] | None = None
    ) -> UniformTypeSpecs | None:
        if not cls.is_uniform_type(specs, distinct):
            return None
        first = next(iter(specs.values()))
        return cls(block_size=first.block_size, layer_specs=tuple(specs.items()))


def layer_specs_of(spec: KVCacheSpec) -> list[KVCacheSpec]:
    """The per-layer specs a group spec stands for."""
    if isinstance(spec, UniformTypeSpecs):
        return [layer_spec for _, layer_spec in spec.layer_specs]
    return [spec]


def init_field_names(spec: KVCacheSpec) -> list[str]:
    return [f.name for f in fields(spec) if f.init]
