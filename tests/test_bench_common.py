"""bench.common.FreshContent: the benchmarks' uncached payloads are new engines with new
content, patched into one serialized template, and otherwise the base request."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.common import (
    NON_TORCH_BASE_BYTES,
    NON_TORCH_STEP_BYTES,
    NON_TORCH_VALUES,
    FreshContent,
    non_torch_bytes_of,
    with_engine_id,
)
from bench.engines import gemma_style, qwen3_next_tp8
from kvplan.convert import plan_from_proto
from kvplan.convert.keys import plan_keys
from kvplan.v1 import plan_pb2

# The 8-worker engine already reports 1 GiB of non-torch memory; the 64-layer one none.
BASES = {"qwen3-next-tp8": qwen3_next_tp8(), "gemma-64l-tp1": gemma_style(64)}


@pytest.fixture(scope="module", params=sorted(BASES))
def base(request: pytest.FixtureRequest) -> plan_pb2.PlanRequest:
    return BASES[request.param]


def non_torch(request: plan_pb2.PlanRequest) -> list[int]:
    return [worker.memory.non_kv.non_torch_bytes for worker in request.workers]


def without_fresh_fields(request: plan_pb2.PlanRequest) -> plan_pb2.PlanRequest:
    """`request` with what fresh content changes (engine id, non-torch bytes) cleared."""
    stripped = plan_pb2.PlanRequest()
    stripped.CopyFrom(request)
    stripped.engine_id = ""
    for worker in stripped.workers:
        worker.memory.non_kv.non_torch_bytes = 0
    return stripped


def test_payloads_parse_with_their_own_value_in_every_worker(base: plan_pb2.PlanRequest) -> None:
    fresh = FreshContent(base, "test")
    for serial in (1, 2, 3, 1000):
        parsed = plan_pb2.PlanRequest.FromString(fresh.payload(serial, f"engine-{serial}"))
        assert parsed.engine_id == f"engine-{serial}"
        expected = NON_TORCH_BASE_BYTES + serial * NON_TORCH_STEP_BYTES
        assert non_torch(parsed) == [expected] * len(base.workers)


def test_everything_else_is_the_base_request(base: plan_pb2.PlanRequest) -> None:
    fresh = FreshContent(base, "test")
    parsed = plan_pb2.PlanRequest.FromString(fresh.next())
    assert without_fresh_fields(parsed) == without_fresh_fields(base)
    # The memory messages still hold what the base gave besides non-torch bytes.
    for parsed_worker, base_worker in zip(parsed.workers, base.workers, strict=True):
        assert parsed_worker.memory.WhichOneof("budget") == base_worker.memory.WhichOneof("budget")
        assert parsed_worker.memory.non_kv.weights_bytes == base_worker.memory.non_kv.weights_bytes
    assert fresh.request == plan_pb2.PlanRequest.FromString(fresh.template)
    assert non_torch(fresh.request) == [NON_TORCH_BASE_BYTES] * len(base.workers)
    assert without_fresh_fields(fresh.request) == without_fresh_fields(base)


def test_next_gives_distinct_content_and_engine_ids(base: plan_pb2.PlanRequest) -> None:
    # Two generators of one base share the serials: one process never repeats content.
    first, second = FreshContent(base, "first"), FreshContent(base, "second")
    parsed = [plan_pb2.PlanRequest.FromString(f.next()) for f in (first, second) * 50]
    values = [non_torch(request)[0] for request in parsed]
    assert len(set(values)) == len(parsed)
    assert NON_TORCH_BASE_BYTES not in values  # the base's content is known content
    assert len({request.engine_id for request in parsed}) == len(parsed)
    for request in parsed:  # every worker of one payload: one figure
        assert len(set(non_torch(request))) == 1


def test_known_content_is_the_template_under_a_new_engine_id(base: plan_pb2.PlanRequest) -> None:
    fresh = FreshContent(base, "known")
    first, second = (plan_pb2.PlanRequest.FromString(fresh.known_content()) for _ in range(2))
    assert first.engine_id != second.engine_id
    for request in (first, second):
        request.engine_id = fresh.request.engine_id
        assert request == fresh.request
    assert fresh.known_content().startswith(fresh.template)


def test_payload_is_the_template_patched_in_place() -> None:
    """Same length as the template plus the appended engine id: no field moved."""
    fresh = FreshContent(BASES["qwen3-next-tp8"], "patch")
    payload = fresh.payload(7, "engine-7")
    appended = with_engine_id(b"", "engine-7")
    assert len(payload) == len(fresh.template) + len(appended)
    assert payload.endswith(appended)
    patched = payload[: len(fresh.template)]
    changed = [i for i, (a, b) in enumerate(zip(fresh.template, patched, strict=True)) if a != b]
    assert changed and all(
        any(offset <= i < offset + 5 for offset in fresh.offsets) for i in changed
    )
    assert len(fresh.offsets) == len(BASES["qwen3-next-tp8"].workers)


WIDE = FreshContent(gemma_style(4, tensor_parallel=3), "wide")  # 3 workers


@given(st.integers(min_value=0, max_value=10 * NON_TORCH_VALUES))
def test_values_stay_five_byte_varints_and_wrap(serial: int) -> None:
    value = non_torch_bytes_of(serial)
    assert 1 << 28 <= value < 1 << 35
    assert value == non_torch_bytes_of(serial % NON_TORCH_VALUES)
    parsed = plan_pb2.PlanRequest.FromString(WIDE.payload(serial, "wide"))
    assert non_torch(parsed) == [value] * len(WIDE.request.workers)


def test_wrapping_returns_to_the_base_value() -> None:
    assert non_torch_bytes_of(0) == NON_TORCH_BASE_BYTES
    assert non_torch_bytes_of(NON_TORCH_VALUES) == NON_TORCH_BASE_BYTES
    assert non_torch_bytes_of(NON_TORCH_VALUES - 1) == (1 << 35) - NON_TORCH_STEP_BYTES


def test_a_request_without_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        FreshContent(plan_pb2.PlanRequest(engine_id="empty"), "empty")


def test_a_new_model_is_fresh_content_of_a_model_never_seen(base: plan_pb2.PlanRequest) -> None:
    """Another model key each call, by an options field the planner never reads: the
    same plan as fresh content of the known model, planned from scratch."""
    fresh = FreshContent(base, "test")
    first, second = (plan_pb2.PlanRequest.FromString(fresh.new_model()) for _ in range(2))
    assert plan_keys(first).model != plan_keys(second).model
    assert plan_keys(first).model != plan_keys(plan_pb2.PlanRequest.FromString(fresh.next())).model
    assert first.engine_id != second.engine_id
    assert non_torch(first) != non_torch(second)
    stripped = without_fresh_fields(first)
    stripped.options.DiscardUnknownFields()
    assert stripped == without_fresh_fields(base)
    # The same plan as for the known model's fresh content of the same memory.
    memory = plan_pb2.PlanRequest()
    memory.CopyFrom(first)
    memory.options.DiscardUnknownFields()
    assert plan_from_proto(first, plan_id="p") == plan_from_proto(memory, plan_id="p")
