"""Small spec and request builders for core tests."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvplan.convert import plan_from_proto
from kvplan.core.dtypes import StorageDtype
from kvplan.core.errors import PlanningError
from kvplan.core.request import EngineOptions, EngineRequest, MemoryRequest, SpecDecode, WorkerInput
from kvplan.core.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvplan.v1 import plan_pb2

GIB = 1 << 30
BF16 = StorageDtype.BFLOAT16


def full(heads: int = 8, head: int = 128, block: int = 16, **extra: object) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block,
        num_kv_heads=heads,
        head_size=head,
        dtype=BF16,
        **extra,  # type: ignore[arg-type]
    )


def window(size: int, heads: int = 8, head: int = 128, block: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype=BF16, sliding_window=size
    )


def engine(
    layers: Sequence[tuple[str, KVCacheSpec]] | Sequence[Sequence[tuple[str, KVCacheSpec]]],
    memory: int | list[int],
    *,
    max_model_len: int = 8192,
    derived_max_model_len: int | None = None,
    spec_decode: SpecDecode | None = None,
    **options: object,
) -> EngineRequest:
    """One worker per layer list (pipeline stages), each with explicit KV bytes."""
    stages = layers if layers and isinstance(layers[0], list) else [layers]
    memories = memory if isinstance(memory, list) else [memory] * len(stages)
    workers = tuple(
        WorkerInput(
            rank=rank,
            layers=tuple(stage),  # type: ignore[arg-type]
            memory=MemoryRequest(kv_cache_memory_bytes=mem),
        )
        for rank, (stage, mem) in enumerate(zip(stages, memories, strict=True))
    )
    return EngineRequest(
        engine_id="test",
        options=EngineOptions(
            max_model_len=max_model_len,
            derived_max_model_len=derived_max_model_len or max_model_len,
            **options,  # type: ignore[arg-type]
        ),
        workers=workers,
        spec_decode=spec_decode or SpecDecode(),
    )


def planning_error(request: plan_pb2.PlanRequest) -> PlanningError:
    """The error `plan_from_proto` refuses `request` with (it must refuse it)."""
    with pytest.raises(PlanningError) as caught:
        plan_from_proto(request)
    return caught.value
