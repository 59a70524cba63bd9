"""The layers an import produces: plain values with their page sizes, rendered as the
proto `LayerSpec`s a PlanRequest carries. Stdlib + protobuf only (the thin client uses
this), so the page formulas here are the reference's, restated for the kinds an import
can produce: attention `H x block x (K + V) x dtype`, MLA `block x latent x dtype`, state
`sum(prod(shape) x dtype)`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum

from kvplan.v1 import spec_pb2


class Dtype(Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    UINT8 = "uint8"

    @property
    def size_bytes(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}[self.value]

    @property
    def proto(self) -> int:
        return int(spec_pb2.Dtype.Value(f"DTYPE_{self.name}"))


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: Dtype) -> Dtype:
    """What an attention layer stores for the engine's `kv_cache_dtype` (1-byte fp8)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("float32", "float16", "bfloat16"):
        return Dtype(kv_cache_dtype)
    return Dtype.UINT8  # fp8, fp8_e4m3, fp8_e5m2: raw bytes


@dataclass(frozen=True)
class StateTensor:
    shape: tuple[int, ...]
    dtype: Dtype

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size_bytes


ATTENTION_KINDS = ("full_attention", "sliding_window", "chunked_local_attention", "cross_attention")


@dataclass(frozen=True)
class ImportedLayer:
    name: str
    kind: str  # one of ATTENTION_KINDS, "mla_attention" or "mamba"
    block_size: int
    is_draft: bool = False
    num_kv_heads: int = 0
    head_size: int = 0
    dtype: Dtype = Dtype.BFLOAT16
    max_tp_shards: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    cache_dtype: str = "auto"  # MLA: the kv_cache_dtype setting the backend sees
    states: tuple[StateTensor, ...] = ()
    mamba_type: str = ""
    num_speculative_blocks: int = 0
    page_size_padded: int | None = None

    @property
    def is_state(self) -> bool:
        return self.kind == "mamba"

    @property
    def decoder_index(self) -> int:
        """The decoder layer this cache belongs to (`...layers.{i}...` in its name)."""
        match = re.search(r"layers\.(\d+)\.", self.name)
        if match is None:
            raise ValueError(f"layer {self.name!r} names no decoder layer index")
        return int(match.group(1))

    @property
    def per_token_bytes(self) -> int:
        """Bytes one token costs this attention layer (0 for state layers)."""
        if self.kind == "mla_attention":
            return self.head_size * self.dtype.size_bytes
        if self.kind in ATTENTION_KINDS:
            return self.num_kv_heads * 2 * self.head_size * self.dtype.size_bytes
        return 0

    @property
    def real_page_bytes(self) -> int:
        if self.is_state:
            return sum(state.size_bytes for state in self.states)
        return self.block_size * self.per_token_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.real_page_bytes

    def to_proto(self, *, with_draft_flag: bool = True) -> spec_pb2.LayerSpec:
        """The layer spec; `with_draft_flag=False` for releases without `is_draft`
        (vLLM 0.32), which find draft groups by position instead."""
        layer = spec_pb2.LayerSpec(
            name=self.name, is_draft=self.is_draft and with_draft_flag, block_size=self.block_size
        )
        if self.is_state:
            body = layer.mamba
            for state in self.states:
                body.states.add(shape=state.shape, dtype=state.dtype.proto)
            if self.page_size_padded is not None:
                body.page_size_padded_bytes = self.page_size_padded
            body.mamba_type = spec_pb2.MambaType.Value(f"MAMBA_TYPE_{self.mamba_type}")
            body.num_speculative_blocks = self.num_speculative_blocks
            return layer
        if self.kind == "mla_attention":
            params = layer.mla_attention.attention
            layer.mla_attention.mla.cache_dtype = spec_pb2.KVCacheDtype.Value(
                f"KV_CACHE_DTYPE_{self.cache_dtype.upper()}"
            )
            params.head_size_v = 0
        elif self.kind == "sliding_window":
            params = layer.sliding_window.attention
            layer.sliding_window.sliding_window = self.sliding_window or 0
        elif self.kind == "cross_attention":
            params = layer.cross_attention.attention
        elif self.kind == "chunked_local_attention":
            params = layer.chunked_local_attention.attention
            layer.chunked_local_attention.attention_chunk_size = self.attention_chunk_size or 0
        else:
            params = layer.full_attention.attention
        params.num_kv_heads = self.num_kv_heads
        params.head_size = self.head_size
        params.dtype = self.dtype.proto  # type: ignore[assignment]
        if self.max_tp_shards is not None:
            params.max_tp_shards = self.max_tp_shards
        return layer

    def aligned(self, block_size: int, page_size_padded: int | None = None) -> ImportedLayer:
        from dataclasses import replace

        return replace(self, block_size=block_size, page_size_padded=page_size_padded)
