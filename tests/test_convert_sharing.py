"""Shared work for repeated content: workers that send one layer list (tensor-parallel
ranks) are converted and planned once, and must give exactly what converting and
planning every worker on its own gives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan.convert.keys import plan_id_for
from kvplan.convert.render import plan_to_proto, spec_to_proto
from kvplan.convert.request import (
    _Context,
    _prefix_caching,
    _target_kinds,
    layer_from_proto,
    request_from_proto,
)
from kvplan.convert.wire import WorkerBytes, encode_varint, encode_workers
from kvplan.core import model_plan, planner
from kvplan.core.errors import InvalidRequest, PlanningError
from kvplan.core.planner import plan_engine
from kvplan.core.request import EngineRequest
from kvplan.core.rules import rule_set_for
from kvplan.core.specs import EncoderOnlyAttentionSpec, KVCacheSpec
from kvplan.v1 import plan_pb2, spec_pb2

GIB = 1 << 30


def _layer(name: str, kind: int, heads: int, is_draft: bool) -> spec_pb2.LayerSpec:
    layer = spec_pb2.LayerSpec(name=name, is_draft=is_draft)
    if kind == 0:
        layer.full_attention.attention.num_kv_heads = heads
        layer.full_attention.attention.head_size = 128
    elif kind == 1:
        layer.sliding_window.attention.num_kv_heads = heads
        layer.sliding_window.attention.head_size = 128
        layer.sliding_window.sliding_window = 1024
    else:
        layer.encoder_only_attention.attention.num_kv_heads = heads
        layer.encoder_only_attention.attention.head_size = 128
    return layer


# One layer: (kind, KV heads, draft flag). Small ranges, so lists often repeat.
layer_params = st.tuples(st.integers(0, 2), st.sampled_from([4, 8]), st.booleans())


@st.composite
def engines(draw: st.DrawFn) -> plan_pb2.PlanRequest:
    """Workers drawing their layer lists from a few candidates (so some are equal, some
    differ in one field), with their own ranks, devices and budgets."""
    count = draw(st.integers(1, 4))
    candidates = draw(
        st.lists(st.lists(layer_params, min_size=1, max_size=6), min_size=1, max_size=3)
    )
    request = plan_pb2.PlanRequest(engine_id="sharing")
    request.options.max_model_len = 4096
    if draw(st.booleans()):  # auto-fit: a length search per worker
        request.options.max_model_len = -1
        request.options.derived_max_model_len = draw(st.sampled_from([4096, 1 << 20]))
    request.options.parallel.tensor_parallel_size = count
    ranks = draw(st.permutations(range(count)))
    for rank in ranks:
        params = candidates[draw(st.integers(0, len(candidates) - 1))]
        worker = request.workers.add(rank=rank)
        if draw(st.booleans()):  # unset or set
            worker.device.uuid = f"GPU-{rank}"
        worker.memory.kv_cache_memory_bytes = draw(st.sampled_from([GIB // 64, 4 * GIB, 8 * GIB]))
        worker.layers.extend(
            _layer(f"model.layers.{index}.attn", *param) for index, param in enumerate(params)
        )
        if draw(st.booleans()):
            worker.memory.non_kv.weights_bytes = 1  # a field before the layers
    return request


def _reference_layers(
    request: plan_pb2.PlanRequest,
) -> list[tuple[tuple[tuple[str, KVCacheSpec], ...], tuple[str, ...]]]:
    """Every worker's layers converted one by one, nothing shared or remembered."""
    rules = rule_set_for(request.options.engine_version)
    out = []
    for index, worker in enumerate(request.workers):
        ctx = _Context(
            request.options,
            rules,
            mamba_align_mode=_prefix_caching(
                request, _target_kinds(request, encode_workers(request))
            ),
        )
        layers, encoder_only = [], []
        for layer_index, layer in enumerate(worker.layers):
            spec = layer_from_proto(layer, f"workers[{index}].layers[{layer_index}]", ctx)
            if isinstance(spec, EncoderOnlyAttentionSpec):
                encoder_only.append(layer.name)
            else:
                layers.append((layer.name, spec))
        out.append((tuple(layers), tuple(encoder_only)))
    return out


def _wire(layers: tuple[tuple[str, KVCacheSpec], ...]) -> list[bytes]:
    # Spec equality ignores is_draft; the wire form does not.
    return [
        spec_to_proto(spec, name).SerializeToString(deterministic=True) for name, spec in layers
    ]


def _reference_plan(request: plan_pb2.PlanRequest) -> bytes | str:
    shared = request_from_proto(request)
    workers = tuple(
        replace(worker, layers=layers, encoder_only_layers=encoder_only)
        for worker, (layers, encoder_only) in zip(
            shared.workers, _reference_layers(request), strict=True
        )
    )
    return _plan_bytes(replace(shared, workers=workers), shared=False)


@contextmanager
def _nothing_shared() -> Iterator[None]:
    """plan_engine with every worker's projection a list of its own and every
    per-projection or per-layer-tuple step run for each worker."""
    project_all = model_plan._project_all

    def own_lists(*args: Any) -> list[list[Any]]:
        return [list(view) for view in project_all(*args)]

    def each(projected: list[Any], compute: Callable[[Any], Any]) -> list[Any]:
        return [compute(view) for view in projected]

    with (
        mock.patch.object(model_plan, "_project_all", own_lists),
        mock.patch.object(model_plan, "_per_projection", each),
        mock.patch.object(planner, "_per_projection", each),
        mock.patch.object(model_plan, "_distinct_layers", lambda worker, seen: True),
    ):
        yield


def _plan_bytes(domain: EngineRequest, *, shared: bool = True) -> bytes | str:
    try:
        if shared:
            plan = plan_engine(domain)
        else:
            with _nothing_shared():
                plan = plan_engine(domain)
    except PlanningError as error:
        return f"{type(error).__name__}: {error.field}: {error}"
    rendered = plan_to_proto(plan, plan_id="p").SerializeToString(deterministic=True)
    # Every worker's tensors and groups in tuples of its own: rendered worker by worker.
    unshared = replace(
        plan,
        workers=tuple(
            replace(worker, tensors=tuple(list(worker.tensors)), groups=tuple(list(worker.groups)))
            for worker in plan.workers
        ),
    )
    assert plan_to_proto(unshared, plan_id="p").SerializeToString(deterministic=True) == rendered
    return rendered


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engines())
def test_shared_layer_lists_convert_and_plan_as_each_worker_alone(
    request: plan_pb2.PlanRequest,
) -> None:
    shared = request_from_proto(plan_pb2.PlanRequest.FromString(request.SerializeToString()))
    for worker, (layers, encoder_only) in zip(
        shared.workers, _reference_layers(request), strict=True
    ):
        assert [name for name, _ in worker.layers] == [name for name, _ in layers]
        assert _wire(worker.layers) == _wire(layers)
        assert worker.layers == layers
        assert worker.encoder_only_layers == encoder_only
    assert _plan_bytes(shared) == _reference_plan(request)


def test_workers_with_equal_layer_lists_share_one_conversion() -> None:
    request = plan_pb2.PlanRequest(engine_id="tp")
    request.options.max_model_len = 4096
    for rank in range(4):
        worker = request.workers.add(rank=rank)
        worker.device.uuid = f"GPU-{rank}"  # different devices, equal layers
        worker.memory.kv_cache_memory_bytes = (rank + 1) * GIB
        worker.layers.extend(_layer(f"l{index}", 0, 8, False) for index in range(3))
    domain = request_from_proto(request)
    assert all(worker.layers is domain.workers[0].layers for worker in domain.workers)


def test_a_list_differing_in_one_spec_field_is_not_shared() -> None:
    request = plan_pb2.PlanRequest(engine_id="tp")
    request.options.max_model_len = 4096
    for rank, heads in enumerate((8, 8, 4)):
        worker = request.workers.add(rank=rank)
        worker.memory.kv_cache_memory_bytes = GIB
        worker.layers.extend([_layer("l0", 0, 8, False), _layer("l1", 0, heads, False)])
    domain = request_from_proto(request)
    assert domain.workers[1].layers is domain.workers[0].layers
    assert domain.workers[2].layers is not domain.workers[0].layers
    with pytest.raises(InvalidRequest) as caught:
        plan_engine(domain)
    assert caught.value.field == "workers[2].layers[1]"


def test_plan_id_is_a_content_hash_of_the_normalised_request() -> None:
    def tp_engine(engine_id: str, ranks: list[int]) -> plan_pb2.PlanRequest:
        request = plan_pb2.PlanRequest(engine_id=engine_id)
        request.options.max_model_len = 4096
        for rank in ranks:
            worker = request.workers.add(rank=rank)
            worker.memory.kv_cache_memory_bytes = GIB
            worker.layers.append(_layer("l0", 0, 8, False))
        return request

    first = tp_engine("a", [0, 1, 2])
    again = plan_pb2.PlanRequest.FromString(first.SerializeToString())
    assert plan_id_for(first) == plan_id_for(again)
    assert plan_id_for(first) == plan_id_for(tp_engine("a", [2, 0, 1]))
    assert plan_id_for(first) != plan_id_for(tp_engine("b", [0, 1, 2]))


def _tag(number: int, wire_type: int) -> bytes:
    return encode_varint(number << 3 | wire_type)


# Unknown fields as a newer client may send them (numbers no message here uses, with
# 2-byte tags): a varint, a fixed64, a fixed32, a length-delimited field, a group.
_UNKNOWN_FIELDS = b"".join(
    [
        _tag(2001, 0) + encode_varint(150),
        _tag(2002, 1) + bytes(range(8)),
        _tag(2003, 5) + bytes(range(4)),
        _tag(2004, 2) + bytes([3, 1, 2, 3]),
        _tag(2005, 3) + _tag(1, 0) + bytes([7]) + _tag(2005, 4),
    ]
)
names = st.text(min_size=0, max_size=150)  # empty, long (2-byte lengths), non-ASCII


@st.composite
def workers(draw: st.DrawFn) -> plan_pb2.WorkerSpec:
    worker = plan_pb2.WorkerSpec(rank=draw(st.integers(0, 300)))
    if draw(st.booleans()):
        worker.device.name = draw(st.sampled_from(["", "H100-80GB"]))
    if draw(st.booleans()):
        worker.memory.kv_cache_memory_bytes = draw(st.sampled_from([0, GIB]))
    for params in draw(st.lists(layer_params, max_size=4)):
        layer = _layer(draw(names), *params)
        if draw(st.booleans()):
            layer.MergeFromString(_UNKNOWN_FIELDS)
        worker.layers.append(layer)
    if draw(st.booleans()):
        worker.MergeFromString(_UNKNOWN_FIELDS)
    return worker


def _serialized_without(worker: plan_pb2.WorkerSpec, *names: str, unknown: bool) -> bytes:
    copy = plan_pb2.WorkerSpec()
    copy.CopyFrom(worker)
    for name in names:
        copy.ClearField(name)  # type: ignore[arg-type]
    if not unknown:
        copy.DiscardUnknownFields()
    return copy.SerializeToString(deterministic=True)


@settings(max_examples=200, deadline=None)
@given(workers())
def test_worker_bytes_cut_out_each_layer_and_key_exactly(worker: plan_pb2.WorkerSpec) -> None:
    encoded = WorkerBytes(worker)
    assert encoded.data == worker.SerializeToString(deterministic=True)
    assert [encoded.data[start:end] for start, end in encoded.layer_spans] == [
        layer.SerializeToString(deterministic=True) for layer in worker.layers
    ]
    # The layers (and unknown fields), and the device and memory, exactly as sent.
    assert encoded.layers_key == _serialized_without(
        worker, "rank", "device", "memory", unknown=True
    )
    assert encoded.settings_key == _serialized_without(worker, "rank", "layers", unknown=False)


def test_unknown_fields_change_the_plan_id_not_the_plan() -> None:
    request = plan_pb2.PlanRequest(engine_id="unknown-fields")
    request.options.max_model_len = 4096
    for rank in range(2):
        worker = request.workers.add(rank=rank)
        worker.memory.kv_cache_memory_bytes = GIB
        worker.layers.extend(_layer(f"l{index}", index % 2, 8, False) for index in range(4))
    marked = plan_pb2.PlanRequest()
    marked.CopyFrom(request)
    marked.workers[1].MergeFromString(_UNKNOWN_FIELDS)
    marked.workers[1].layers[2].MergeFromString(_UNKNOWN_FIELDS)
    assert plan_id_for(marked) != plan_id_for(request)
    plain = plan_to_proto(plan_engine(request_from_proto(request)), plan_id="p")
    with_unknown = plan_to_proto(plan_engine(request_from_proto(marked)), plan_id="p")
    assert with_unknown == plain
