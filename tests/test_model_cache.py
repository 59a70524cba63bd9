"""Model plans kept across requests (kvplan.model_cache): an engine of a known model
is only budgeted, and gets byte for byte the plan (or the error) planning it from
scratch gives, over every engine of the conformance generator under each rule set."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.engines import gemma_style, gemma_style_pipeline, qwen3_next_tp8
from conformance.generate import generate_cases
from kvplan.convert import plan_from_proto
from kvplan.convert.keys import plan_keys
from kvplan.convert.render import render_groups
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import PlanningError
from kvplan.core.planner import plan_engine, plan_model
from kvplan.core.rules import RULE_SETS
from kvplan.model_cache import BYTES_PER_LAYER, KnownModel, ModelCache
from kvplan.v1 import plan_pb2

MIB = 1 << 20
Outcome = tuple[str, bytes | tuple[str, str, object]]


def _fields_of(error: PlanningError) -> object:
    return (error.field, [(v.field, v.description) for v in error.violations], error.details)


def _outcome(
    request: plan_pb2.PlanRequest, models: ModelCache | None = None, key: bytes | None = None
) -> Outcome:
    """The serialized plan, or the refusal as a caller sees it: planned with `models`
    under `key`, or from scratch."""
    try:
        planned = plan_from_proto(request, models=models, model_key=key)
    except PlanningError as error:
        return ("error", (type(error).__name__, str(error), _fields_of(error)))
    return ("plan", planned.SerializeToString())


def _with_memory(
    request: plan_pb2.PlanRequest, change: Callable[[int, plan_pb2.WorkerSpec], None]
) -> plan_pb2.PlanRequest:
    """Another engine of the same model: other memory and device figures."""
    other = plan_pb2.PlanRequest()
    other.CopyFrom(request)
    other.engine_id = request.engine_id + "/other"
    for index, worker in enumerate(other.workers):
        change(index, worker)
    return other


def _less_and_uneven(index: int, worker: plan_pb2.WorkerSpec) -> None:
    """Each worker a little less, and not the same as the others: a fleet's
    processes measure different free memory."""
    memory = worker.memory
    memory.non_kv.non_torch_bytes += (index + 1) * 4096 * 1024
    which = memory.WhichOneof("budget")
    if which == "kv_cache_memory_bytes":
        memory.kv_cache_memory_bytes = memory.kv_cache_memory_bytes * 3 // 4 + index
    elif which in ("gpu_memory_utilization", "free_memory_fraction"):
        setattr(memory, which, getattr(memory, which) * 0.97)
    if worker.device.total_memory_bytes:
        worker.device.total_memory_bytes += index * MIB


def _starved(index: int, worker: plan_pb2.WorkerSpec) -> None:
    """Too little memory for most engines: their refusals must match too."""
    worker.memory.kv_cache_memory_bytes = MIB + index


@pytest.mark.parametrize("rule_set", sorted(RULE_SETS), ids=lambda name: name or "kvplan")
def test_a_known_model_plans_as_planning_from_scratch(rule_set: str) -> None:
    reused: list[int] = []
    cache = ModelCache(capacity=8, on_reuse=lambda: reused.append(1))
    compared = refused = 0
    for case in generate_cases():
        first = plan_pb2.PlanRequest()
        first.CopyFrom(case.request)
        first.options.engine_version = rule_set
        key = plan_keys(first).model
        kept_before = len(cache)
        first_outcome = _outcome(first, cache, key)
        assert first_outcome == _outcome(first), case.id
        if cache.get(key) is None:
            refused += 1  # its model plan failed: nothing was kept
            assert first_outcome[0] == "error", case.id
            assert len(cache) <= kept_before
            continue
        for change in (_less_and_uneven, _starved):
            other = _with_memory(first, change)
            other_key = plan_keys(other).model
            assert other_key == key, case.id  # memory is not part of the model
            hits = len(reused)
            known = _outcome(other, cache, key)
            assert len(reused) == hits + 1, case.id
            assert known == _outcome(other), (case.id, change.__name__)
            compared += 1
    assert compared > 1000 and refused < compared, (compared, refused)


def test_the_model_key_leaves_out_memory_and_device_only() -> None:
    base = qwen3_next_tp8()
    key = plan_keys(base).model
    other_memory = _with_memory(base, _less_and_uneven)
    assert plan_keys(other_memory).model == key
    assert plan_keys(other_memory).content != plan_keys(base).content

    def changed(change: Callable[[plan_pb2.PlanRequest], None]) -> bytes:
        request = plan_pb2.PlanRequest()
        request.CopyFrom(base)
        change(request)
        return plan_keys(request).model

    assert changed(lambda r: setattr(r.workers[3].layers[0], "name", "renamed")) != key
    assert changed(lambda r: setattr(r.workers[3], "rank", 99)) != key
    assert (
        changed(lambda r: r.workers[3].supported_layouts.append(plan_pb2.KV_CACHE_LAYOUT_LHBNC))
        != key
    )
    assert changed(lambda r: setattr(r.options, "block_size", 16)) != key
    assert changed(lambda r: setattr(r.spec_decode, "num_speculative_tokens", 3)) != key
    assert changed(lambda r: setattr(r, "engine_id", "another")) == key
    assert changed(lambda r: setattr(r, "shared_prefix_tokens", 4096)) == key  # a what-if

    # Workers in another order are the same model, planned alike from the kept plan.
    reordered = _with_memory(base, _less_and_uneven)
    reordered.workers.reverse()
    assert plan_keys(reordered).model == key
    cache = ModelCache()
    plan_from_proto(base, models=cache, model_key=key)
    assert _outcome(reordered, cache, key) == _outcome(reordered)


@settings(max_examples=40, deadline=None)
@given(
    figures=st.lists(
        st.tuples(st.integers(0, 8 * 1024 * MIB), st.floats(0.5, 1.0)), min_size=8, max_size=8
    )
)
def test_any_memory_per_worker_plans_as_from_scratch(figures: list[tuple[int, float]]) -> None:
    base = qwen3_next_tp8()
    cache = ModelCache()
    key = plan_keys(base).model
    plan_from_proto(base, models=cache, model_key=key)

    def change(index: int, worker: plan_pb2.WorkerSpec) -> None:
        non_torch, utilization = figures[index]
        worker.memory.non_kv.non_torch_bytes = non_torch
        worker.memory.gpu_memory_utilization = utilization

    other = _with_memory(base, change)
    assert cache.get(key) is not None
    assert _outcome(other, cache, key) == _outcome(other)


def test_a_model_plan_of_another_model_is_refused() -> None:
    """plan_engine checks that the model plan it is given is this request's model's:
    a wrong memo is a bug, never a wrong plan."""
    request = request_from_proto(gemma_style(64))
    other = request_from_proto(gemma_style(32))
    with pytest.raises(ValueError, match="another model"):
        plan_engine(request, plan_model(other))
    assert plan_engine(request, plan_model(request)) == plan_engine(request)


def _known(request: plan_pb2.PlanRequest) -> KnownModel:
    domain = request_from_proto(request)
    model = plan_model(domain)
    return KnownModel.of(domain, model, render_groups(model.groups))


def test_bounded_by_count_and_bytes_least_recently_used_first() -> None:
    small = _known(gemma_style(8))
    assert small.weight == len(small.rendered_groups) + sum(
        BYTES_PER_LAYER + len(n) for n, _ in small.worker(0).layers
    )
    cache = ModelCache(capacity=2, max_bytes=10 * small.weight)
    for key in ("a", "b"):
        cache.put(key, small)
    assert cache.get("a") is small  # "a" is now the most recent
    cache.put("c", small)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (small, None, small)
    assert cache.size_bytes == 2 * small.weight

    by_bytes = ModelCache(capacity=100, max_bytes=3 * small.weight)
    for serial in range(5):
        by_bytes.put(serial, small)
    assert len(by_bytes) == 3 and by_bytes.size_bytes == 3 * small.weight
    assert by_bytes.get(0) is None and by_bytes.get(4) is small

    too_big = ModelCache(max_bytes=small.weight - 1)
    too_big.put("a", small)
    assert len(too_big) == 0 and too_big.size_bytes == 0
    none_kept = ModelCache(capacity=0)
    none_kept.put("a", small)
    assert none_kept.get("a") is None
    with pytest.raises(ValueError):
        ModelCache(capacity=-1)


def _held_bytes(build: Callable[[], plan_pb2.PlanRequest], models: int) -> tuple[int, int]:
    """(bytes `models` distinct models kept in a cache hold, their summed weight)."""
    requests = []
    for serial in range(models):
        request = build()
        request.options.max_num_batched_tokens = 4096 + serial  # another model each
        requests.append(request)
    cache = ModelCache(capacity=models, max_bytes=1 << 40)
    plan_from_proto(requests[0])  # module-level caches warm before measuring
    gc.collect()
    tracemalloc.start()
    try:
        for request in requests:
            plan_from_proto(request, models=cache, model_key=plan_keys(request).model)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(cache) == models
    return held, cache.size_bytes


def _every_layer_its_own_spec(name_chars: int) -> Callable[[], plan_pb2.PlanRequest]:
    def build() -> plan_pb2.PlanRequest:
        request = gemma_style(64)
        for index, layer in enumerate(request.workers[0].layers):
            layer.name = f"{index}." + "x" * name_chars
            body = (
                layer.sliding_window if layer.HasField("sliding_window") else layer.full_attention
            )
            body.attention.head_size = 64 + index
        return request

    return build


@pytest.mark.parametrize(
    "build",
    [
        lambda: gemma_style(64),
        qwen3_next_tp8,
        lambda: gemma_style_pipeline(32),
        _every_layer_its_own_spec(50),
        _every_layer_its_own_spec(1000),
    ],
    ids=["64-layers", "8-tp-ranks", "32-pp-stages", "own-specs", "own-specs-long-names"],
)
def test_the_byte_bound_over_estimates_what_models_hold(
    build: Callable[[], plan_pb2.PlanRequest],
) -> None:
    """What the bound counts (`KnownModel.weight`) is at least what kept models
    hold, measured: the cache never holds more than --model-cache-bytes."""
    held, counted = _held_bytes(build, models=20)
    assert held <= counted, (held, counted)


def test_planning_leaves_no_cyclic_garbage() -> None:
    """Everything a plan allocates is freed by reference counting, evicted models and
    refusals included: a dropped model's memory comes back at once, not at the cyclic
    collector's next pass."""
    cache = ModelCache(capacity=4)
    requests = []
    for case in generate_cases()[:200]:
        try:
            plan_from_proto(case.request)
        except PlanningError:
            continue
        requests.append(case.request)
    assert len(requests) > 100
    gc.collect()
    gc.disable()
    try:
        for request in requests:
            plan_from_proto(request, models=cache)  # kept, and evicted past 4
            _outcome(_with_memory(request, _less_and_uneven), cache)  # planned or refused
        assert gc.collect() == 0
    finally:
        gc.enable()
