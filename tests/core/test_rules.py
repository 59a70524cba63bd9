"""Unit tests of the core's rules: page sizes, approx_gcd, merging, draft guard."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from kvplan.core.draft import annotate_draft_groups
from kvplan.core.dtypes import StorageDtype, storage_dtype_for_cache_dtype
from kvplan.core.errors import InvalidRequest
from kvplan.core.grouping import GroupingResult, approximate_gcd, group_layers
from kvplan.core.groups import DraftRule
from kvplan.core.layout import KVCacheLayout
from kvplan.core.request import SpecDecode
from kvplan.core.specs import (
    ConflictingWindows,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    PlanningContext,
    StateShape,
    UniformTypeSpecs,
)
from tests.core.builders import BF16, full, window

FP32 = StorageDtype.FLOAT32


def test_attention_page_sizes() -> None:
    assert full().page_size_bytes == 65_536
    assert replace(full(), dtype=StorageDtype.UINT8).page_size_bytes == 32_768
    helper = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=FP32)
    assert helper.page_size_bytes == 16_384
    per_token_head = replace(full(), dtype=StorageDtype.INT8, state_content_bytes=264)
    assert per_token_head.page_size_bytes == 33_792


def test_mla_page_sizes() -> None:
    latent = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=BF16)
    assert latent.page_size_bytes == 73_728
    assert replace(latent, dtype=StorageDtype.UINT8).page_size_bytes == 36_864
    assert replace(latent, state_content_bytes=656).page_size_bytes == 41_984
    assert replace(latent, state_content_bytes=352).page_size_bytes == 22_528
    assert replace(latent, tokens_per_state=4).page_size_bytes == 18_432
    # Alignment pads the page at construction.
    padded = replace(latent, state_content_bytes=656, alignment=4096)
    assert padded.page_size_bytes == 45_056
    # Several states per token (block pooling).
    pooled = replace(full(), tokens_per_state=Fraction(1, 2))
    assert pooled.page_size_bytes == 2 * 65_536


def test_mamba_page_sizes() -> None:
    helper = MambaSpec(
        block_size=16, states=(StateShape((2, 512), FP32), StateShape((3, 32, 32), FP32))
    )
    assert helper.page_size_bytes == 16_384
    gdn = MambaSpec(
        block_size=16,
        states=(StateShape((3, 2048), BF16), StateShape((8, 128, 128), FP32)),
    )
    assert gdn.page_size_bytes == 536_576


def test_cache_dtype_storage() -> None:
    assert storage_dtype_for_cache_dtype("auto", BF16) is BF16
    assert storage_dtype_for_cache_dtype("fp8_e5m2", BF16) is StorageDtype.UINT8
    assert storage_dtype_for_cache_dtype("int8_per_token_head", BF16) is StorageDtype.INT8
    assert storage_dtype_for_cache_dtype("fp8_inc", BF16) is StorageDtype.FLOAT8_E4M3FN


def test_stride_alignment() -> None:
    assert full().stride_alignment_bytes() == 1
    assert replace(full(), block_stride_alignment=4096).stride_alignment_bytes() == 4096
    # Kernel blocks of 8 tokens inside a 16-token block: one 8-token page.
    assert replace(full(), block_stride_alignment=MultipleOf(8)).stride_alignment_bytes() == 32_768
    assert replace(full(), block_stride_alignment=MultipleOf(32)).stride_alignment_bytes() == 1
    with pytest.raises(InvalidRequest):
        replace(full(), block_stride_alignment=0)


def test_sliding_window_bounds() -> None:
    ctx = PlanningContext(max_model_len=32_768, max_in_flight_tokens=2048)
    spec = window(4096)
    assert spec.max_memory_usage_bytes(ctx) == 385 * spec.page_size_bytes
    retained = replace(spec, extra_retained_tokens=2)
    assert retained.max_memory_usage_bytes(ctx) == 386 * spec.page_size_bytes


@pytest.mark.parametrize(
    ("values", "lower", "expected"),
    [([8, 12], 4, 4), ([6, 10], 3, 6), ([7], 2, 7), ([5, 7], 1, 1), ([3], 9, 9)],
)
def test_approximate_gcd(values: list[int], lower: int, expected: int) -> None:
    assert approximate_gcd(values, lower_bound=lower) == expected


@pytest.mark.parametrize("values", [[], [0, 3]])
def test_approximate_gcd_rejects(values: list[int]) -> None:
    with pytest.raises(InvalidRequest):
        approximate_gcd(values)


def test_full_merge_rules() -> None:
    merged = FullAttentionSpec.merge([full(), full(sliding_window=1024)])
    assert isinstance(merged, FullAttentionSpec) and merged.sliding_window == 1024
    with pytest.raises(ConflictingWindows):
        FullAttentionSpec.merge([full(sliding_window=512), full(sliding_window=1024)])


def test_uniform_type_wrapper() -> None:
    specs = {"a": full(), "b": full(), "c": full(4), "d": full(4)}
    wrapper = UniformTypeSpecs.from_specs(specs)
    assert wrapper is not None and wrapper.page_size_bytes == 196_608
    assert UniformTypeSpecs.from_specs({"a": full(), "s": window(128)}) is None


def test_identical_specs_split_by_group_size() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=BF16)
    small = window(1024, heads=1, head=16)
    small = replace(small, page_size_padded=mla.page_size_bytes)
    result = group_layers(
        {"m0": mla, "m1": mla, "s0": small}, layout=KVCacheLayout.LBNHC, disable_hybrid=False
    )
    assert [g.layer_names for g in result.groups] == [("m0",), ("m1",), ("s0",)]


def _qwen_grouping() -> GroupingResult:
    mamba = MambaSpec(
        block_size=16, states=(StateShape((2, 512), FP32), StateShape((3, 32, 32), FP32))
    )
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=FP32)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(8):
        if i in (3, 7):
            specs[f"model.layers.{i}.self_attn.attn"] = attention
        else:
            specs[f"model.layers.{i}.linear_attn"] = mamba
    specs["mtp.layers.0.self_attn.attn"] = attention
    return group_layers(specs, layout=KVCacheLayout.LBNHC, disable_hybrid=False)


def test_trailing_rule_flags_the_mtp_group() -> None:
    result = _qwen_grouping()
    groups, warnings = annotate_draft_groups(result, SpecDecode("mtp", 1, "qwen3_5"))
    assert [g.is_draft for g in groups] == [False, False, True]
    assert groups[2].draft_rule is DraftRule.TRAILING_LAYER
    assert warnings == []


def test_partition_guard_blocks_the_trailing_rule() -> None:
    """Seed row 9: a layer missing from the groups disables the positional rule."""
    result = _qwen_grouping()
    first = result.groups[0]
    broken = replace(
        first,
        layer_names=tuple(n for n in first.layer_names if n != "model.layers.0.linear_attn"),
    )
    result.groups = [broken, *result.groups[1:]]
    groups, warnings = annotate_draft_groups(result, SpecDecode("mtp", 1, "qwen3_5"))
    assert not any(g.is_draft for g in groups)
    assert [w.code.value for w in warnings] == ["no_draft_group_mamba"]
