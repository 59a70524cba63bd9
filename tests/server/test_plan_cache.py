"""The servicer's plan cache (serialized plans, remembered plan ids) and the
rendezvous' expiry, below the RPC layer."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from kvplan.client import AsyncPlannerClient
from kvplan.convert import plan_from_proto
from kvplan.convert.keys import plan_id_for, plan_keys
from kvplan.server.errors import RemoteStatus, ServiceError
from kvplan.server.main import RunningServer
from kvplan.server.metrics import Metrics
from kvplan.server.plan_cache import PlanCache, PlanSummary
from kvplan.server.rendezvous import Rendezvous
from kvplan.server.store import RendezvousResult, StoreUnavailable
from kvplan.server.store.bodies import PlanParts
from kvplan.server.store.memory import MemoryStore
from kvplan.v1 import plan_pb2
from tests.server.conftest import GIB, engine_request, rank_request


def test_remembered_keys_are_plan_keys() -> None:
    cache = PlanCache(capacity=2)
    request = engine_request(stages=2)
    reordered = plan_pb2.PlanRequest()
    reordered.CopyFrom(request)
    reordered.workers.reverse()
    wire_digest = hashlib.sha256(request.SerializeToString()).digest()
    for _ in range(2):  # computed, then remembered
        assert cache.keys(request) == plan_keys(request)
        assert cache.keys(reordered) == plan_keys(request)
        assert cache.keys(request, wire_digest) == plan_keys(request)
    for engine in range(3):  # the memo is bounded like the plans
        cache.keys(engine_request(f"other-{engine}"))
    assert len(cache._keys) == 2
    assert cache.keys(reordered) == plan_keys(request)
    assert cache.keys(request).plan_id == plan_id_for(request)


def test_content_key_is_the_request_but_its_engine_id() -> None:
    keys = plan_keys(engine_request("engine-a"))
    assert plan_keys(engine_request("engine-b")).content == keys.content
    assert plan_keys(engine_request("engine-b")).plan_id != keys.plan_id
    assert plan_keys(engine_request("engine-a", kv_bytes=3 * GIB)).content != keys.content
    unnamed = engine_request("")
    assert plan_keys(unnamed).content == keys.content
    # Each worker's bytes count, whichever field differs.
    other_rank = engine_request("engine-a", stages=2)
    other_rank.workers[1].memory.non_kv.non_torch_bytes = 1
    assert plan_keys(other_rank).content != plan_keys(engine_request("engine-a", stages=2)).content


def _planned(cache: PlanCache, request: plan_pb2.PlanRequest) -> bytes:
    """What the servicer does on a miss: plan, keep, remember the content."""
    keys = plan_keys(request)
    response = plan_from_proto(request, plan_id=keys.plan_id)
    parts = PlanParts.of(keys.plan_id, request.engine_id, response.SerializeToString())
    cache.keep(keys.plan_id, request.engine_id, parts)
    cache.remember_content(keys.content, parts, PlanSummary.of(request, response), "team")
    return parts.plan


def test_a_known_content_is_the_plan_planning_gives() -> None:
    """Another engine of one model gets, byte for byte, what planning it would give."""
    cache = PlanCache(capacity=8)
    first = engine_request("engine-a", stages=2)
    _planned(cache, first)
    for engine_id in ("engine-b", "", "a much longer engine id " * 4):
        request = engine_request(engine_id, stages=2)
        keys = plan_keys(request)
        known = cache.known_plan(keys, engine_id, "team")
        assert known is not None
        parts, summary = known
        fresh = plan_from_proto(request, plan_id=keys.plan_id)
        assert parts.plan == fresh.SerializeToString()
        assert parts == PlanParts.of(keys.plan_id, engine_id, fresh.SerializeToString())
        assert summary == PlanSummary.of(request, fresh)
    assert cache.known_plan(plan_keys(engine_request("x", kv_bytes=3 * GIB)), "x", "team") is None
    # Another identity's plans are not reused: their timing would tell what it planned.
    assert cache.known_plan(plan_keys(engine_request("engine-b", stages=2)), "b", "other") is None


def test_known_contents_are_bounded_and_need_their_body() -> None:
    requests = [engine_request(f"engine-{n}", kv_bytes=(n + 1) * GIB) for n in range(3)]
    cache = PlanCache(capacity=2)
    for request in requests:
        _planned(cache, request)
    assert len(cache._known) == 2
    assert cache.known_plan(plan_keys(requests[0]), "new", "team") is None  # forgotten
    assert cache.known_plan(plan_keys(requests[2]), "new", "team") is not None
    # Bytes evict plans before contents are forgotten: a content whose body no
    # plan holds any more is planned again, and forgotten.
    tiny = PlanCache(capacity=10, max_bytes=1)  # keeps the newest plan only
    for request in requests:
        _planned(tiny, request)
    assert len(tiny._known) == 3
    assert tiny.known_plan(plan_keys(requests[0]), "new", "team") is None
    assert len(tiny._known) == 2
    assert tiny.known_plan(plan_keys(requests[2]), "new", "team") is not None


def test_cache_keeps_serialized_plans() -> None:
    cache = PlanCache(capacity=1)
    first = plan_from_proto(engine_request("engine-a"))
    assert cache.put(first) == first.SerializeToString()
    assert plan_pb2.PlanResponse.FromString(cache.get(first.plan_id) or b"") == first
    assert cache.for_engine("engine-a") == first.SerializeToString()
    second = plan_from_proto(engine_request("engine-b"))
    cache.put(second)
    assert cache.get(first.plan_id) is None and cache.for_engine("engine-a") is None


def test_cache_is_bounded_by_bytes() -> None:
    plans = [
        plan_from_proto(engine_request(f"engine-{n}", kv_bytes=(n + 1) * GIB)) for n in range(4)
    ]
    size = max(len(plan.SerializeToString()) for plan in plans)
    cache = PlanCache(capacity=100, max_bytes=2 * size)
    for plan in plans:
        cache.put(plan)
    assert cache.size_bytes <= 2 * size
    assert cache.get(plans[0].plan_id) is None and cache.get(plans[1].plan_id) is None
    assert cache.get(plans[3].plan_id) == plans[3].SerializeToString()
    tiny = PlanCache(capacity=100, max_bytes=1)  # the newest plan is always kept
    tiny.put(plans[0])
    assert tiny.get(plans[0].plan_id) is not None


def test_cache_holds_one_body_per_content() -> None:
    """Engines of one model: a body once, a head per engine; each plan exactly its own."""
    plans = [plan_from_proto(engine_request(f"engine-{n}")) for n in range(50)]
    size = len(plans[0].SerializeToString())
    cache = PlanCache(capacity=100, max_bytes=10 * size)  # not 50 whole plans
    for plan in plans:
        cache.put(plan)
    assert cache.distinct_bodies == 1
    assert cache.size_bytes < 10 * size
    for plan in plans:
        assert cache.get(plan.plan_id) == plan.SerializeToString()
        assert cache.for_engine(plan.engine_id) == plan.SerializeToString()
    other = plan_from_proto(engine_request("engine-other", kv_bytes=2 * GIB))
    cache.put(other)
    assert cache.distinct_bodies == 2
    small = PlanCache(capacity=2)  # the last plan holding a body lets it go
    for plan in (*plans[:2], other, plans[2]):
        small.put(plan)
    assert small.distinct_bodies == 2 and small.get(plans[1].plan_id) is None


def test_a_plan_kept_again_stays_its_engines() -> None:
    """Kept again before its leases are granted (name_engine=False), a plan that
    already was the engine's stays so; a new one becomes it only when named."""
    cache = PlanCache(capacity=4)
    plan = plan_from_proto(engine_request("engine-a"))
    cache.put(plan)
    cache.put(plan, name_engine=False)
    assert cache.for_engine("engine-a") == plan.SerializeToString()
    other = plan_from_proto(engine_request("engine-a", kv_bytes=2 * GIB))
    cache.put(other, name_engine=False)
    assert cache.for_engine("engine-a") == plan.SerializeToString()
    cache.name_engine("engine-a", other.plan_id)
    assert cache.for_engine("engine-a") == other.SerializeToString()


async def test_cache_hit_is_the_planned_response(
    client: AsyncPlannerClient, server: RunningServer
) -> None:
    planned = await client.plan(engine_request("engine-hit", stages=2))
    again = await client.plan(engine_request("engine-hit", stages=2))
    assert again.response == planned.response
    assert server.metrics.cache_hits._value.get() == 1
    by_rank = await client.get_plan(engine_id="engine-hit", rank=1)
    assert [w.rank for w in by_rank.response.workers] == [1]


async def test_expired_rendezvous_entries_are_forgotten() -> None:
    async def plan(request: plan_pb2.PlanRequest) -> bytes:
        return plan_from_proto(request).SerializeToString()

    store = MemoryStore()
    rendezvous = Rendezvous(store, plan, Metrics(), max_pending=16, ttl_s=0.05, claim_timeout_s=1.0)
    plan_bytes = await rendezvous.join(rank_request("done", 0, 1), timeout_s=1)
    assert await store.plan_for_engine("done") is None  # the servicer persists plans
    again = await rendezvous.join(rank_request("done", 0, 1), timeout_s=1)
    assert again == plan_bytes  # a finished engine answers a repeated rank
    # A rank's wait is bounded by the rendezvous TTL (not only by its deadline), and
    # its answer says which ranks are missing.
    with pytest.raises(ServiceError) as caught:
        await rendezvous.join(rank_request("stuck", 0, 2), timeout_s=5)
    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert caught.value.details["arrived_ranks"] == "0"
    assert caught.value.details["missing_ranks"] == "1"
    assert await rendezvous.pending_engines() == 0  # the rank left
    await asyncio.sleep(0.06)
    await rendezvous.join(rank_request("later", 0, 1), timeout_s=1)  # expires "done"
    # "done" is forgotten: a changed spec is a new engine, not a conflict.
    changed = await rendezvous.join(rank_request("done", 0, 1, kv_bytes=2 * GIB), timeout_s=1)
    assert changed != plan_bytes


async def test_a_store_outage_at_finish_reaches_the_waiting_ranks_at_once() -> None:
    class FinishFails(MemoryStore):
        async def rendezvous_finish(
            self,
            engine_id: str,
            result: RendezvousResult,
            now: float,
            *,
            remember_failure: bool = False,
            max_kept_bytes: int = 0,
        ) -> None:
            raise StoreUnavailable("connection refused")

    async def plan(request: plan_pb2.PlanRequest) -> bytes:
        return plan_from_proto(request).SerializeToString()

    rendezvous = Rendezvous(
        FinishFails(), plan, Metrics(), max_pending=16, ttl_s=60, claim_timeout_s=1.0
    )
    started = time.monotonic()
    results = await asyncio.gather(
        *(rendezvous.join(rank_request("outage", rank, 2), timeout_s=30) for rank in range(2)),
        return_exceptions=True,
    )
    assert time.monotonic() - started < 5  # not at the 30 s deadline
    for result in results:
        assert isinstance(result, RemoteStatus)
        assert result.code == "UNAVAILABLE"
        assert "connection refused" in result.status.message
