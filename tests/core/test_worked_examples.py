"""The reference's worked examples and conformance list (§5.8, §7), end to end."""

from __future__ import annotations

import pytest

from kvplan.core.dtypes import StorageDtype
from kvplan.core.errors import InsufficientMemory, UnplannableSpecs
from kvplan.core.groups import GroupingPath
from kvplan.core.layout import KVCacheLayout
from kvplan.core.planner import plan_engine
from kvplan.core.specs import FullAttentionSpec, MambaSpec, StateShape
from tests.core.builders import GIB, engine, full, window

LLAMA = [(f"model.layers.{i}.self_attn.attn", full()) for i in range(32)]


def test_llama_54_gib() -> None:
    plan = plan_engine(engine(LLAMA, 54 * GIB))
    assert plan.path is GroupingPath.UNIFORM_SPEC
    worker = plan.workers[0]
    assert worker.bytes_per_block == 2_097_152
    assert plan.num_blocks == 27_648
    assert plan.kv_cache_size_tokens == 442_368
    assert plan.max_concurrency == pytest.approx(54.0)
    (tensor,) = worker.tensors
    assert tensor.layer_stride_bytes == 1_811_939_328
    assert tensor.block_stride_bytes == 65_536
    assert tensor.size_bytes == 57_982_058_496


def test_override_sets_blocks() -> None:
    plan = plan_engine(engine(LLAMA, 54 * GIB, num_gpu_blocks_override=1000))
    assert plan.num_blocks == 1000
    assert plan.workers[0].tensors[0].size_bytes == 2_097_152_000
    assert plan.max_concurrency == pytest.approx(1.953125)
    assert plan.kv_cache_size_tokens == 16_000


def test_not_enough_memory_reports_numbers() -> None:
    with pytest.raises(InsufficientMemory) as caught:
        plan_engine(engine(LLAMA, 512 << 20))
    assert "1.0 GiB" in caught.value.message and "0.5 GiB" in caught.value.message
    assert caught.value.details["estimated_max_model_len"] == 4080


def test_no_memory() -> None:
    with pytest.raises(InsufficientMemory, match="No available memory"):
        plan_engine(engine(LLAMA, 0))


def test_auto_fit() -> None:
    plan = plan_engine(engine(LLAMA, 5 * GIB, max_model_len=-1, derived_max_model_len=131_072))
    assert plan.max_model_len == 40_944
    assert plan.num_blocks == 2560
    assert plan.kv_cache_size_tokens == 40_960


def test_full_sliding_hybrid() -> None:
    layers = [(f"l{i}", full() if i % 3 == 0 else window(4096)) for i in range(30)]
    plan = plan_engine(engine(layers, 54 * GIB, max_model_len=32_768))
    assert plan.path is GroupingPath.HYBRID
    assert [len(g.layer_names) for g in plan.groups] == [10, 10, 10]
    assert plan.workers[0].bytes_per_block == 655_360
    assert plan.num_blocks == 88_473
    assert plan.blocks_per_request == 2048 + 769 + 769
    assert plan.kv_cache_size_tokens == 808_444
    with pytest.raises(InsufficientMemory) as caught:
        plan_engine(engine(layers, 2 * GIB, max_model_len=32_768))
    assert caught.value.details["estimated_max_model_len"] == 27_792


def test_gemma3_pattern() -> None:
    layers = [(f"l{i}", full(16) if i % 6 == 5 else window(1024, 16)) for i in range(62)]
    plan = plan_engine(engine(layers, 40 * GIB, max_model_len=131_072))
    assert [len(g.layer_names) for g in plan.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert plan.num_blocks == 32_768
    assert plan.blocks_per_request == 6 * 577 + 8192
    assert plan.kv_cache_size_tokens == 368_540
    assert any("8 padding layers" in w.message and "15.38%" in w.message for w in plan.warnings)


def test_gated_delta_net_hybrid() -> None:
    bf16, fp32 = StorageDtype.BFLOAT16, StorageDtype.FLOAT32
    mamba = MambaSpec(
        block_size=272,
        states=(StateShape((3, 2048), bf16), StateShape((8, 128, 128), fp32)),
        page_size_padded=557_056,
    )
    attention = FullAttentionSpec(block_size=272, num_kv_heads=2, head_size=256, dtype=bf16)
    layers = [(f"l{i}", attention if i % 4 == 3 else mamba) for i in range(48)]
    plan = plan_engine(engine(layers, 40 * GIB, max_model_len=32_768, enable_prefix_caching=True))
    assert len(plan.groups) == 4
    assert plan.workers[0].bytes_per_block == 6_684_672
    assert plan.num_blocks == 6425
    assert plan.blocks_per_request == 127
    assert plan.kv_cache_size_tokens == 1_657_751
    assert plan.workers[0].needed_per_request_bytes == 848_953_344


def test_uniform_type_offsets_and_layouts() -> None:
    layers = [("a", full()), ("b", full()), ("c", full(4)), ("d", full(4))]
    plan = plan_engine(engine(layers, GIB))
    assert plan.path is GroupingPath.UNIFORM_TYPE
    assert plan.num_blocks == 5461
    offsets = [t.offset_bytes for t in plan.workers[0].tensors]
    assert offsets == [0, 715_784_192]
    # Block-outermost: one block holds all four pages (checked against vLLM 0.33).
    packed = plan_engine(engine(layers, GIB, layout=KVCacheLayout.BLHNC))
    assert packed.num_blocks == 5461
    assert [t.offset_bytes for t in packed.workers[0].tensors] == [0, 131_072]
    assert {t.block_stride_bytes for t in packed.workers[0].tensors} == {196_608}
    with pytest.raises(UnplannableSpecs, match="LHBNC"):
        plan_engine(engine(layers, GIB, layout=KVCacheLayout.LHBNC))


def test_pipeline_stages_share_blocks() -> None:
    stage0 = [(f"l{i}", full()) for i in range(16)]
    stage1 = [(f"l{i}", full()) for i in range(16, 32)]
    plan = plan_engine(engine([stage0, stage1], [20 * GIB, 10 * GIB]))
    assert [w.num_blocks for w in plan.workers] == [10_240, 10_240]
    for worker in plan.workers:
        (tensor,) = worker.tensors
        assert tensor.size_bytes == 10_737_418_240
        assert tensor.layer_stride_bytes == 671_088_640
    assert plan.max_concurrency == pytest.approx(20.0)


def test_attention_free() -> None:
    # vLLM turns prefix caching off for models without attention.
    plan = plan_engine(engine([], GIB, enable_prefix_caching=False))
    assert plan.path is GroupingPath.ATTENTION_FREE
    assert plan.num_blocks == 1
    assert plan.workers[0].tensors == ()
