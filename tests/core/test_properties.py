"""Invariants of the planner over generated engines (hypothesis)."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan.core.dtypes import StorageDtype
from kvplan.core.errors import PlanningError
from kvplan.core.groups import GroupingPath
from kvplan.core.layout import KVCacheLayout
from kvplan.core.planner import EnginePlan, PlanStage, plan_engine
from kvplan.core.request import EngineRequest, SpecDecode
from kvplan.core.rules import rule_set_for
from kvplan.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    StateShape,
)
from tests.core.builders import GIB, engine

DTYPES = [StorageDtype.BFLOAT16, StorageDtype.FLOAT16, StorageDtype.UINT8, StorageDtype.FLOAT32]


@st.composite
def layer_spec(draw: st.DrawFn, block_size: int) -> KVCacheSpec:
    kind = draw(st.sampled_from(["full", "sw", "chunked", "mamba", "mla"]))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head = draw(st.sampled_from([64, 96, 128, 256]))
    dtype = draw(st.sampled_from(DTYPES))
    common = {"block_size": block_size, "num_kv_heads": heads, "head_size": head, "dtype": dtype}
    if kind == "full":
        return FullAttentionSpec(**common)  # type: ignore[arg-type]
    if kind == "sw":
        window = draw(st.sampled_from([128, 512, 1024, 4096]))
        return SlidingWindowSpec(**common, sliding_window=window)  # type: ignore[arg-type]
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=8192)  # type: ignore[arg-type]
    if kind == "mla":
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=dtype)
    width = draw(st.sampled_from([512, 1024, 2048]))
    return MambaSpec(
        block_size=block_size,
        states=(StateShape((3, width), StorageDtype.BFLOAT16), StateShape((4, 64, 64), dtype)),
    )


@st.composite
def engines(draw: st.DrawFn) -> EngineRequest:
    block_size = draw(st.sampled_from([16, 32, 64]))
    # A few distinct specs repeated in a pattern, like real hybrid models.
    palette = draw(st.lists(layer_spec(block_size), min_size=1, max_size=3))
    num_layers = draw(st.integers(min_value=1, max_value=40))
    pattern = draw(st.lists(st.integers(0, len(palette) - 1), min_size=1, max_size=6))
    layers: list[tuple[str, KVCacheSpec]] = [
        (f"model.layers.{i}.attn", palette[pattern[i % len(pattern)]]) for i in range(num_layers)
    ]
    if draw(st.booleans()):
        # An EAGLE-style draft layer appended last.
        draft = replace(palette[0], is_draft=True)
        layers.append(("drafter.layers.0.attn", draft))
    stages = draw(st.integers(min_value=1, max_value=min(4, len(layers))))
    cut = [round(len(layers) * s / stages) for s in range(stages + 1)]
    split = [layers[cut[s] : cut[s + 1]] for s in range(stages)]
    memories = [draw(st.integers(min_value=4, max_value=64)) * GIB for _ in split]
    method = draw(st.sampled_from(["none", "eagle", "eagle3", "mtp", "dspark"]))
    return engine(
        split,
        memories,
        max_model_len=draw(st.sampled_from([2048, 8192, 32768])),
        layout=draw(st.sampled_from([KVCacheLayout.LBNHC, KVCacheLayout.BLHNC])),
        enable_prefix_caching=draw(st.booleans()),
        spec_decode=SpecDecode(method=method, num_speculative_tokens=1),
    )


def _plan_or_none(request: EngineRequest) -> EnginePlan | None:
    try:
        return plan_engine(request)
    except PlanningError:
        # A caller-facing error is a valid outcome; any other exception fails.
        return None


SETTINGS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,  # the same examples in CI as here
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(engines())
def test_every_layer_in_exactly_one_group(request: EngineRequest) -> None:
    plan = _plan_or_none(request)
    if plan is None:
        return
    names = [name for worker in request.workers for name, _ in worker.layers]
    grouped = [name for group in plan.groups for name in group.layer_names]
    assert sorted(grouped) == sorted(names)


@SETTINGS
@given(engines())
def test_hybrid_groups_share_one_page_size(request: EngineRequest) -> None:
    plan = _plan_or_none(request)
    if plan is None or plan.path is not GroupingPath.HYBRID:
        return
    assert len({group.spec.page_size_bytes for group in plan.groups}) == 1


@SETTINGS
@given(engines())
def test_tensors_fit_the_budget_and_ranks_agree(request: EngineRequest) -> None:
    plan = _plan_or_none(request)
    if plan is None:
        return
    assert len({worker.num_blocks for worker in plan.workers}) == 1
    for worker, given_worker in zip(plan.workers, request.workers, strict=True):
        budget = given_worker.memory.kv_cache_memory_bytes
        assert budget is not None
        for tensor in worker.tensors:
            assert tensor.size_bytes == worker.bytes_per_block * plan.num_blocks
            assert tensor.size_bytes <= budget
            # The last layer's last block ends inside the allocation.
            last = (
                tensor.offset_bytes
                + (len(tensor.layer_names) - 1) * tensor.layer_stride_bytes
                + (plan.num_blocks - 1) * tensor.block_stride_bytes
            )
            assert last < tensor.size_bytes


@SETTINGS
@given(engines(), st.randoms(use_true_random=False))
def test_deterministic_and_worker_order_invariant(
    request: EngineRequest, rng: random.Random
) -> None:
    first = _plan_or_none(request)
    assert first == _plan_or_none(request)
    shuffled = list(request.workers)
    rng.shuffle(shuffled)
    permuted = _plan_or_none(replace(request, workers=tuple(shuffled)))
    assert permuted == first


@SETTINGS
@given(engines(), st.sampled_from(["vllm-0.32", "vllm-0.33", "vllm-0.34"]))
def test_release_rule_sets_keep_the_invariants(request: EngineRequest, version: str) -> None:
    released = replace(request, rules=rule_set_for(version))
    plan = _plan_or_none(released)
    assert plan == _plan_or_none(released)
    if plan is None:
        return
    assert plan.rule_set == version
    names = sorted(name for worker in request.workers for name, _ in worker.layers)
    assert sorted(name for group in plan.groups for name in group.layer_names) == names
    assert len({worker.num_blocks for worker in plan.workers}) == 1
    for worker in plan.workers:
        for tensor in worker.tensors:
            assert tensor.size_bytes == worker.bytes_per_block * plan.num_blocks


@SETTINGS
@given(engines())
def test_0_32_and_0_33_differ_only_in_draft_flags(request: EngineRequest) -> None:
    """Same groups, blocks and lengths; 0.33 flags only groups holding is_draft."""
    plan_032 = _plan_or_none(replace(request, rules=rule_set_for("vllm-0.32")))
    plan_033 = _plan_or_none(replace(request, rules=rule_set_for("vllm-0.33")))
    if plan_032 is None or plan_033 is None:
        return
    assert [g.layer_names for g in plan_032.groups] == [g.layer_names for g in plan_033.groups]
    assert (plan_032.num_blocks, plan_032.max_model_len) == (
        plan_033.num_blocks,
        plan_033.max_model_len,
    )
    draft_layers = {
        name for worker in request.workers for name, spec in worker.layers if spec.is_draft
    }
    for group in plan_033.groups:
        if group.is_draft:
            assert draft_layers & set(group.layer_names)


@SETTINGS
@given(engines(), st.lists(st.integers(0, 80 * GIB), min_size=4, max_size=4))
def test_extensible_final_plans_never_exceed_the_reservation(
    request: EngineRequest, measured: list[int]
) -> None:
    request = replace(
        request,
        rules=rule_set_for("vllm-0.34"),
        options=replace(request.options, extensible_kv_cache=True),
    )
    reservation = _plan_or_none(request)
    if reservation is None:
        return
    assert reservation.stage is PlanStage.EXTENSIBLE_RESERVATION

    def final_with(extra: int) -> EnginePlan | None:
        workers = tuple(
            replace(
                worker,
                memory=replace(worker.memory, measured_kv_cache_bytes=measured[index] + extra),
            )
            for index, worker in enumerate(request.workers)
        )
        return _plan_or_none(replace(request, workers=workers))

    final, larger = final_with(0), final_with(GIB)
    if final is None:
        return
    assert final.stage is PlanStage.EXTENSIBLE_FINAL
    assert final.num_blocks <= reservation.num_blocks == final.reserved_num_blocks
    assert final.max_model_len <= reservation.max_model_len
    # More measured memory never yields fewer blocks.
    assert larger is not None and larger.num_blocks >= final.num_blocks
