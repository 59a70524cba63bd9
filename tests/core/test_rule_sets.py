"""Engine-release rule sets: selection, the fields each release has, and vLLM
0.34's extensible KV cache. Plans per release are checked figure by figure in
tests/conformance (scenarios `release-*`) and against each vLLM in `make
conformance`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplan.convert import plan_from_proto
from kvplan.core.dtypes import StorageDtype
from kvplan.core.errors import ErrorCode, UnplannableSpecs
from kvplan.core.extensible import blocks_within, mapped_bytes, segment_strides
from kvplan.core.grouping import allocated_layer_spec
from kvplan.core.layout import KVCacheLayout, TensorPlacement
from kvplan.core.rules import RULE_SETS, DraftFlagRule, rule_set_for
from kvplan.core.specs import MLAAttentionSpec, SlidingWindowMLASpec
from kvplan.v1 import plan_pb2, spec_pb2
from tests.core.builders import planning_error

GIB = 1 << 30
MIB = 1 << 20


def _request(
    engine_version: str = "", layers: int = 4, kv_bytes: int = GIB
) -> plan_pb2.PlanRequest:
    request = plan_pb2.PlanRequest(engine_id="rules")
    request.options.max_model_len = 8192
    request.options.block_size = 16
    request.options.engine_version = engine_version
    worker = request.workers.add(rank=0)
    worker.memory.kv_cache_memory_bytes = kv_bytes
    for index in range(layers):
        layer = worker.layers.add(name=f"layers.{index}")
        layer.full_attention.attention.num_kv_heads = 8
        layer.full_attention.attention.head_size = 128
    return request


def test_registry_names_match_their_keys() -> None:
    assert set(RULE_SETS) == {"", "vllm-0.32", "vllm-0.33", "vllm-0.34"}
    for key, rules in RULE_SETS.items():
        assert rules.name == (key or "kvplan")
    assert rule_set_for("vllm-0.32").draft_rule is DraftFlagRule.SPEC_MARKER_AND_TRAILING
    assert rule_set_for("vllm-0.33").draft_rule is DraftFlagRule.IS_DRAFT_ONLY


@pytest.mark.parametrize("version", ["", "vllm-0.32", "vllm-0.33", "vllm-0.34"])
def test_the_response_names_its_rule_set(version: str) -> None:
    response = plan_from_proto(_request(version))
    assert response.rule_set == (version or "kvplan")
    expected_stage = (
        plan_pb2.PLAN_STAGE_EXTENSIBLE_RESERVATION
        if version == "vllm-0.34"
        else plan_pb2.PLAN_STAGE_CLASSIC
    )
    assert response.plan_stage == expected_stage


def test_vllm_0_34_settles_the_extensible_cache_off_for_a_block_override() -> None:
    """Sized from measured memory, 0.34's extensible cache cannot run with a block
    override: unset, it is off (the classic plan); asked for, the engine is refused."""
    request = _request("vllm-0.34")
    assert plan_from_proto(request).plan_stage == plan_pb2.PLAN_STAGE_EXTENSIBLE_RESERVATION
    request.options.num_gpu_blocks_override = 1024
    assert plan_from_proto(request).plan_stage == plan_pb2.PLAN_STAGE_CLASSIC
    request.options.extensible_kv_cache = True
    error = planning_error(request)
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "options.extensible_kv_cache"
    assert "num_gpu_blocks_override" in str(error)
    request.options.extensible_kv_cache = False
    assert plan_from_proto(request).plan_stage == plan_pb2.PLAN_STAGE_CLASSIC
    # Measured bytes belong to the extensible cache, which the override turned off.
    request.options.ClearField("extensible_kv_cache")
    request.workers[0].memory.measured_kv_cache_bytes = GIB
    error = planning_error(request)
    assert error.field == "workers[0].memory.measured_kv_cache_bytes"
    assert "block override" in str(error)


def test_an_unknown_engine_version_lists_the_supported_ones() -> None:
    error = planning_error(_request("vllm-0.31"))
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "options.engine_version"
    for known in ("'vllm-0.32'", "'vllm-0.33'", "'vllm-0.34'", "''"):
        assert known in error.message


def _mamba_layer(request: plan_pb2.PlanRequest) -> spec_pb2.LayerSpec:
    layer = request.workers[0].layers.add(name="mamba.0")
    state = layer.mamba.states.add(shape=[4, 100], dtype=spec_pb2.DTYPE_BFLOAT16)
    assert state.dtype == spec_pb2.DTYPE_BFLOAT16
    return layer


def _sw_mla_layer(request: plan_pb2.PlanRequest) -> spec_pb2.LayerSpec:
    layer = request.workers[0].layers.add(name="swmla.0")
    layer.sliding_window_mla.attention.num_kv_heads = 1
    layer.sliding_window_mla.attention.head_size = 576
    layer.sliding_window_mla.sliding_window = 128
    return layer


@pytest.mark.parametrize(
    ("version", "setup", "field"),
    [
        ("vllm-0.32", lambda r: setattr(r.workers[0].layers[1], "is_draft", True),
         "workers[0].layers[1].is_draft"),
        ("vllm-0.33", lambda r: setattr(
            r.workers[0].layers[0].full_attention.attention, "kv_head_major_slots", True),
         "workers[0].layers[0].full_attention.attention.kv_head_major_slots"),
        ("vllm-0.33", lambda r: setattr(_mamba_layer(r).mamba, "state_alignment_bytes", 256),
         "workers[0].layers[4].mamba.state_alignment_bytes"),
        ("", lambda r: setattr(_sw_mla_layer(r).sliding_window_mla,
                               "non_causal_multi_token_decode", True),
         "workers[0].layers[4].sliding_window_mla.non_causal_multi_token_decode"),
        ("vllm-0.33", lambda r: setattr(r.workers[0].memory, "measured_kv_cache_bytes", GIB),
         "workers[0].memory.measured_kv_cache_bytes"),
        ("vllm-0.32", lambda r: setattr(r.options, "extensible_kv_cache", True),
         "options.extensible_kv_cache"),
    ],
)  # fmt: skip
def test_a_field_the_release_lacks_is_invalid(version: str, setup: object, field: str) -> None:
    request = _request(version)
    setup(request)  # type: ignore[operator]
    error = planning_error(request)
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == field
    assert "does not exist in" in error.message


def test_topk_buffer_width_is_new_in_0_33() -> None:
    request = _request("vllm-0.32")
    layer = request.workers[0].layers.add(name="mla.0")
    layer.mla_attention.attention.num_kv_heads = 1
    layer.mla_attention.attention.head_size = 576
    layer.mla_attention.mla.topk_buffer_width = 2048
    error = planning_error(request)
    assert error.field == "workers[0].layers[4].mla_attention.mla.topk_buffer_width"
    request.options.engine_version = "vllm-0.33"
    assert plan_from_proto(request).rule_set == "vllm-0.33"


def test_measured_bytes_need_the_extensible_cache_and_every_worker() -> None:
    request = _request("vllm-0.34")
    request.options.extensible_kv_cache = False
    request.workers[0].memory.measured_kv_cache_bytes = GIB
    assert planning_error(request).field == "workers[0].memory.measured_kv_cache_bytes"

    request = _request("vllm-0.34")
    second = request.workers.add(rank=1)
    second.CopyFrom(request.workers[0])
    second.rank = 1
    request.options.parallel.tensor_parallel_size = 2
    request.workers[1].memory.measured_kv_cache_bytes = GIB
    assert planning_error(request).field == "workers[0].memory.measured_kv_cache_bytes"


def test_state_alignment_rounds_each_state_and_must_divide_the_padded_page() -> None:
    request = _request("vllm-0.34", layers=0)
    layer = _mamba_layer(request)
    layer.mamba.states.add(shape=[3], dtype=spec_pb2.DTYPE_FLOAT32)
    layer.mamba.state_alignment_bytes = 512
    # 800 bytes and 12 bytes, each rounded up to 512.
    assert plan_from_proto(request).groups[0].page_size_bytes == 1024 + 512
    layer.mamba.ClearField("state_alignment_bytes")
    assert plan_from_proto(request).groups[0].page_size_bytes == 812
    layer.mamba.state_alignment_bytes = 512
    layer.mamba.page_size_padded_bytes = 2000
    error = planning_error(request)
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "workers[0].layers[0].mamba.page_size_padded_bytes"


def test_kv_head_major_slots_layers_get_their_own_tensor() -> None:
    request = _request("vllm-0.34", layers=4)
    request.workers[0].layers[1].full_attention.attention.kv_head_major_slots = True
    worker = plan_from_proto(request).workers[0]
    assert [list(t.layer_names) for t in worker.tensors] == [
        ["layers.0", "layers.2", "layers.3"],
        ["layers.1"],
    ]
    page = 16 * 8 * 256 * 2
    assert worker.tensors[1].offset_bytes == 3 * worker.num_blocks * page


def test_the_0_34_reservation_uses_utilization_1_by_default() -> None:
    request = _request("vllm-0.34")
    request.workers[0].memory.ClearField("kv_cache_memory_bytes")
    request.workers[0].device.total_memory_bytes = 80 * GIB
    request.workers[0].device.free_memory_bytes = 10 * GIB  # a cap only: no error
    response = plan_from_proto(request)
    assert response.workers[0].budget.requested_bytes == 80 * GIB
    request.options.extensible_kv_cache = False
    assert planning_error(request).code is ErrorCode.RESOURCE_EXHAUSTED  # 0.92 of 80 GiB > free


def test_the_final_plan_takes_the_fewest_measured_blocks_and_keeps_strides() -> None:
    request = _request("vllm-0.34", kv_bytes=8 * GIB)
    reservation = plan_from_proto(request)
    page_bytes = 4 * 16 * 8 * 256 * 2  # four layers per block
    assert reservation.num_blocks == 8 * GIB // page_bytes
    request.workers[0].memory.measured_kv_cache_bytes = GIB + 12345
    final = plan_from_proto(request)
    assert final.plan_stage == plan_pb2.PLAN_STAGE_EXTENSIBLE_FINAL
    assert final.reserved_num_blocks == reservation.num_blocks
    # LBNHC maps one segment per layer, each rounded up to 2 MiB.
    per_layer = page_bytes // 4
    expected = max(
        n
        for n in range(0, GIB // page_bytes + 1)
        if 4 * (-(-n * per_layer // (2 * MIB))) * 2 * MIB <= GIB + 12345
    )
    assert final.num_blocks == expected
    tensor, reserved_tensor = final.workers[0].tensors[0], reservation.workers[0].tensors[0]
    assert tensor.layer_stride_bytes == reserved_tensor.layer_stride_bytes
    assert tensor.size_bytes == final.num_blocks * page_bytes
    request.workers[0].memory.measured_kv_cache_bytes = 64 * GIB
    assert plan_from_proto(request).num_blocks == reservation.num_blocks  # capped


def test_a_final_plan_too_small_for_one_request_is_resource_exhausted() -> None:
    request = _request("vllm-0.34", kv_bytes=8 * GIB)
    request.workers[0].memory.measured_kv_cache_bytes = 16 * MIB
    assert planning_error(request).code is ErrorCode.RESOURCE_EXHAUSTED


def test_measured_bytes_holding_no_block_past_the_null_one_say_what_to_change() -> None:
    """The budget did not make this pool, so raising utilization would not help: the
    advice names the measured bytes and the allocation granule."""
    request = _request("vllm-0.34", kv_bytes=8 * GIB)
    request.workers[0].memory.measured_kv_cache_bytes = 3 * MIB
    request.workers[0].memory.allocation_granule_bytes = 2 * MIB  # 4 layer segments each
    error = planning_error(request)
    assert error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "hold 0 block(s) at the fewest" in error.message
    assert "allocation granule" in error.message
    assert "gpu_memory_utilization" not in error.message


@given(
    strides=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=8),
    measured=st.integers(0, 1 << 34),
    granule=st.sampled_from([1, 4096, 64 << 10, 2 << 20]),
    cap=st.integers(1, 1 << 22),
)
def test_blocks_within_is_the_largest_count_that_maps(
    strides: list[int], measured: int, granule: int, cap: int
) -> None:
    count = blocks_within(strides, measured, granule, cap)
    assert 0 <= count <= cap
    assert count == 0 or mapped_bytes(strides, count, granule) <= measured
    assert count == cap or mapped_bytes(strides, count + 1, granule) > measured


def test_segments_of_block_outermost_and_layer_outer_layouts() -> None:
    tensors = [
        TensorPlacement(4 * 100 * 10, ("a", "b"), 100 * 10, 100, 0, 0),
        TensorPlacement(4 * 100 * 10, ("c",), 100 * 10, 100, 2000, 0),
    ]
    assert segment_strides(tensors, KVCacheLayout.LBNHC, 10) == [100, 100, 100]
    outer = [TensorPlacement(400 * 10, ("a", "b"), 100, 400, 0, 0)]
    assert segment_strides(outer, KVCacheLayout.BLHNC, 10) == [400]


def test_octave_quant_modes_are_new_in_0_33() -> None:
    request = _request("vllm-0.32")
    attention = request.workers[0].layers[2].full_attention.attention
    attention.kv_quant_mode = spec_pb2.KV_QUANT_MODE_OCTAVE_K3V3
    error = planning_error(request)
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "workers[0].layers[2].full_attention.attention.kv_quant_mode"
    request.options.engine_version = "vllm-0.33"
    assert plan_from_proto(request).rule_set == "vllm-0.33"


def test_only_0_34_promotes_a_bounded_replay_window_and_its_layer_is_then_cacheable() -> None:
    """promotion_drops_bounded_replay, through the one function both grouping and the
    scheduler's view of a group (kvplan.prefix_facts) read a promoted layer with: a
    bounded-replay sliding-window MLA layer (opted out of prefix caching) allocated
    as MLA is an MLA layer, cacheable, under 0.34; 0.33's MLA spec has no replay
    bound, so the promotion fails there as it does in vLLM 0.33 (a TypeError)."""
    declared = SlidingWindowMLASpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype=StorageDtype.BFLOAT16,
        sliding_window=128,
        bounded_replay=True,
    )
    assert not declared.prefix_cacheable
    allocated = allocated_layer_spec(declared, "mla_attention", rule_set_for("vllm-0.34"))
    assert type(allocated) is MLAAttentionSpec and allocated.prefix_cacheable
    assert (
        allocated_layer_spec(declared, "sliding_window_mla", rule_set_for("vllm-0.34")) is declared
    )
    with pytest.raises(UnplannableSpecs, match="bounded_replay has no counterpart"):
        allocated_layer_spec(declared, "mla_attention", rule_set_for("vllm-0.33"))
