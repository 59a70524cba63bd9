"""The engine's KV cache layout resolved from the workers' supported layouts
(kvplan/core/layout_resolution.py): the merge of each rule set, the narrowing,
the asked-for layout and the request's validation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplan.convert import plan_from_proto
from kvplan.core.dtypes import StorageDtype
from kvplan.core.errors import ErrorCode, PlanningError
from kvplan.core.layout import KVCacheLayout
from kvplan.core.layout_resolution import (
    NO_PREFERENCE,
    TIE_BREAK_ORDER,
    WorkerLayouts,
    merge_by_first_choice,
    resolve_layout,
)
from kvplan.core.rules import KVPLAN, VLLM_0_32, VLLM_0_33, VLLM_0_34, RuleSet
from kvplan.core.specs import FullAttentionSpec, KVCacheSpec
from kvplan.v1 import plan_pb2
from tests.core.builders import planning_error

L = KVCacheLayout
BF16 = StorageDtype.BFLOAT16
SPECS: list[KVCacheSpec] = [
    FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16)
]
VOTING = [VLLM_0_34, KVPLAN]
EQUAL_ONLY = [VLLM_0_32, VLLM_0_33]

layout_lists = st.lists(
    st.lists(st.sampled_from(list(KVCacheLayout)), min_size=1, max_size=6, unique=True).map(tuple),
    min_size=1,
    max_size=5,
)


def _workers(lists: Sequence[Sequence[KVCacheLayout]]) -> list[WorkerLayouts]:
    return [WorkerLayouts(index, index, tuple(layouts)) for index, layouts in enumerate(lists)]


def _resolve(
    lists: Sequence[Sequence[KVCacheLayout]],
    rules: RuleSet,
    requested: KVCacheLayout | None = None,
    specs: list[KVCacheSpec] = SPECS,
) -> tuple[KVCacheLayout, tuple[KVCacheLayout, ...]]:
    resolution = resolve_layout(_workers(lists), specs, requested, rules)
    return resolution.layout, resolution.candidates


@given(layout_lists)
def test_the_merge_keeps_exactly_the_shared_layouts_best_voted_first(
    lists: list[tuple[KVCacheLayout, ...]],
) -> None:
    merged = merge_by_first_choice(lists)
    assert set(merged) == set(lists[0]).intersection(*lists)
    votes = Counter(layouts[0] for layouts in lists)
    assert [votes[x] for x in merged] == sorted((votes[x] for x in merged), reverse=True)
    if any(layouts != lists[0] for layouts in lists):
        # Equal votes keep vLLM's enum order.
        for a, b in pairwise(merged):
            if votes[a] == votes[b]:
                assert TIE_BREAK_ORDER.index(a) < TIE_BREAK_ORDER.index(b)
    else:
        assert merged == list(lists[0])


@pytest.mark.parametrize("rules", VOTING, ids=lambda r: r.name)
@given(lists=layout_lists)
def test_a_voting_release_plans_a_layout_every_voting_worker_supports(
    rules: RuleSet, lists: list[tuple[KVCacheLayout, ...]]
) -> None:
    voting = [x for x in lists if x != NO_PREFERENCE] or lists
    shared = set(voting[0]).intersection(*voting)
    if not shared:
        with pytest.raises(PlanningError) as caught:
            _resolve(lists, rules)
        assert caught.value.code is ErrorCode.FAILED_PRECONDITION
        assert len(caught.value.violations) == len(voting)
        return
    layout, candidates = _resolve(lists, rules)
    assert all(layout in layouts for layouts in voting)
    assert set(candidates) == shared and layout == candidates[0]


@pytest.mark.parametrize("rules", EQUAL_ONLY, ids=lambda r: r.name)
@given(lists=layout_lists)
def test_0_32_and_0_33_need_equal_lists(
    rules: RuleSet, lists: list[tuple[KVCacheLayout, ...]]
) -> None:
    if all(layouts == lists[0] for layouts in lists):
        assert _resolve(lists, rules) == (lists[0][0], lists[0])
    else:
        with pytest.raises(PlanningError) as caught:
            _resolve(lists, rules)
        assert caught.value.code is ErrorCode.FAILED_PRECONDITION
        assert "different KV cache layouts" in caught.value.message


def test_ties_go_to_vllms_enum_order_and_the_default_list_does_not_vote() -> None:
    assert _resolve([(L.LBNHC, L.LBHNC), (L.LBHNC, L.LBNHC)], VLLM_0_34) == (
        L.LBHNC,
        (L.LBHNC, L.LBNHC),
    )
    # Alone, LHBNC's one vote would tie with LBNHC's; the default list is left out.
    assert _resolve([NO_PREFERENCE, (L.LHBNC, L.LBHNC, L.LBNHC)], VLLM_0_34)[0] is L.LHBNC
    assert _resolve([NO_PREFERENCE, NO_PREFERENCE], VLLM_0_34)[0] is L.LBNHC


def test_the_asked_for_layout_must_be_a_candidate() -> None:
    lists = [(L.LBHNC, L.LBNHC)] * 2
    assert _resolve(lists, VLLM_0_33, L.LBNHC)[0] is L.LBNHC
    with pytest.raises(PlanningError) as caught:
        _resolve(lists, VLLM_0_33, L.BLHNC)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.field == "options.layout"
    assert "LBHNC, LBNHC" in caught.value.message


def test_without_lists_the_layout_is_taken_as_given() -> None:
    assert resolve_layout(_workers([(), ()]), SPECS, None, VLLM_0_34).layout is L.LBNHC
    resolution = resolve_layout(_workers([()]), SPECS, L.LHBNC, VLLM_0_33)
    assert (resolution.layout, resolution.candidates) == (L.LHBNC, ())


def test_mixed_page_shapes_keep_block_compact_layouts() -> None:
    mixed = [*SPECS, FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=BF16)]
    lists = [(L.LHBNC, L.BHLNC, L.LBHNC, L.BLNHC)]
    assert _resolve(lists, VLLM_0_33, specs=mixed)[1] == (L.LBHNC, L.BLNHC)
    with pytest.raises(PlanningError) as caught:
        _resolve([(L.LHBNC, L.BHLNC)], VLLM_0_33, specs=mixed)
    assert caught.value.code is ErrorCode.FAILED_PRECONDITION
    assert "block-compact" in caught.value.message


def test_dcp_sharded_and_replicated_mixed_pages_keep_block_outermost_layouts() -> None:
    replicated = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype=BF16, dcp_sharded=False
    )
    lists = [(L.LBNHC, L.BHLNC, L.BLHNC)]
    # Mixed shapes drop BHLNC first (not block-compact), DCP then LBNHC.
    assert _resolve(lists, VLLM_0_34, specs=[*SPECS, replicated])[1] == (L.BLHNC,)


def test_an_extensible_cache_behind_a_connector_keeps_block_compact_layouts() -> None:
    workers = _workers([(L.BHLNC, L.BLHNC)])
    plain = resolve_layout(workers, SPECS, None, VLLM_0_34)
    assert plain.layout is L.BHLNC
    narrowed = resolve_layout(workers, SPECS, None, VLLM_0_34, connector_needs_block_compact=True)
    assert narrowed.candidates == (L.BLHNC,)


def test_a_connectors_layout_wins_when_it_is_a_candidate() -> None:
    workers = _workers([(L.BLNHC, L.BLHNC)])
    wins = resolve_layout(workers, SPECS, None, VLLM_0_33, connector_layout=L.BLHNC)
    assert wins.layout is L.BLHNC
    dropped = resolve_layout(workers, SPECS, None, VLLM_0_33, connector_layout=L.LBHNC)
    assert dropped.layout is L.BLNHC
    # The asked-for layout comes first.
    asked = resolve_layout(workers, SPECS, L.BLNHC, VLLM_0_33, connector_layout=L.BLHNC)
    assert asked.layout is L.BLNHC


# --- through the wire format ----------------------------------------------------------


def _request(
    lists: Sequence[Sequence[int]], engine_version: str = "vllm-0.34", layers: int = 1
) -> plan_pb2.PlanRequest:
    request = plan_pb2.PlanRequest(engine_id="layouts")
    request.options.max_model_len = 8192
    request.options.engine_version = engine_version
    request.options.parallel.pipeline_parallel_size = len(lists)
    for rank, layouts in enumerate(lists):
        worker = request.workers.add(rank=rank)
        worker.memory.kv_cache_memory_bytes = 1 << 30
        worker.supported_layouts.extend(layouts)  # type: ignore[arg-type]
        for index in range(layers):
            layer = worker.layers.add(name=f"stage{rank}.{index}.attn")
            layer.full_attention.attention.num_kv_heads = 8
            layer.full_attention.attention.head_size = 128
    return request


def test_the_response_reports_the_resolved_layout_and_candidates() -> None:
    both = [plan_pb2.KV_CACHE_LAYOUT_BLHNC, plan_pb2.KV_CACHE_LAYOUT_LBHNC]
    response = plan_from_proto(_request([both, both[::-1], both[::-1]]))
    assert response.diagnostics.kv_cache_layout == plan_pb2.KV_CACHE_LAYOUT_LBHNC
    assert list(response.diagnostics.layout_candidates) == both[::-1]
    # Without lists: the given layout, no candidates.
    plain = _request([[]])
    plain.options.layout = plan_pb2.KV_CACHE_LAYOUT_LHBNC
    response = plan_from_proto(plain)
    assert response.diagnostics.kv_cache_layout == plan_pb2.KV_CACHE_LAYOUT_LHBNC
    assert not response.diagnostics.layout_candidates


def test_the_resolved_layout_shapes_the_tensors() -> None:
    page = 8 * 64 * (128 + 128) * 2  # 0.34's default block size, 64 tokens
    outer = plan_from_proto(_request([[plan_pb2.KV_CACHE_LAYOUT_BLHNC]], layers=2))
    tensor = outer.workers[0].tensors[0]
    assert (tensor.layer_stride_bytes, tensor.block_stride_bytes) == (page, 2 * page)
    inner = plan_from_proto(_request([[plan_pb2.KV_CACHE_LAYOUT_LBNHC]], layers=2))
    tensor = inner.workers[0].tensors[0]
    assert (tensor.layer_stride_bytes, tensor.block_stride_bytes) == (
        inner.num_blocks * page,
        page,
    )


@pytest.mark.parametrize(
    ("lists", "field"),
    [
        ([[plan_pb2.KV_CACHE_LAYOUT_LBHNC], []], "workers[1].supported_layouts"),
        (
            [[plan_pb2.KV_CACHE_LAYOUT_LBHNC, plan_pb2.KV_CACHE_LAYOUT_LBHNC]],
            "workers[0].supported_layouts[1]",
        ),
        ([[plan_pb2.KV_CACHE_LAYOUT_LBHNC, 999]], "workers[0].supported_layouts[1]"),
        ([[plan_pb2.KV_CACHE_LAYOUT_LBHNC] * 100_000], "workers[0].supported_layouts"),
    ],
    ids=["one-worker-without", "twice", "unknown-value", "longer-than-the-enum"],
)
@pytest.mark.parametrize("version", ["", "vllm-0.32", "vllm-0.33", "vllm-0.34"])
def test_bad_lists_are_invalid_argument_with_the_field(
    lists: Sequence[Sequence[int]], field: str, version: str
) -> None:
    error = planning_error(_request(lists, version))
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == field


def test_differing_lists_fail_under_0_33_and_plan_under_0_34() -> None:
    lists = [
        [plan_pb2.KV_CACHE_LAYOUT_LBHNC],
        [plan_pb2.KV_CACHE_LAYOUT_LBHNC, plan_pb2.KV_CACHE_LAYOUT_LBNHC],
    ]
    error = planning_error(_request(lists, "vllm-0.33"))
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert [v.field for v in error.violations] == [
        "workers[0].supported_layouts",
        "workers[1].supported_layouts",
    ]
    response = plan_from_proto(_request(lists, "vllm-0.34"))
    assert response.diagnostics.kv_cache_layout == plan_pb2.KV_CACHE_LAYOUT_LBHNC
