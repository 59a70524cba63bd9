"""The servicer's plan cache (serialized plans, remembered plan ids) and the
rendezvous' expiry, below the RPC layer."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from kvplan.client import AsyncPlannerClient
from kvplan.convert import plan_from_proto, plan_id_for
from kvplan.server.errors import RemoteStatus, ServiceError
from kvplan.server.main import RunningServer
from kvplan.server.metrics import Metrics
from kvplan.server.rendezvous import Rendezvous
from kvplan.server.servicer import PlanCache
from kvplan.server.store import RendezvousResult, StoreUnavailable
from kvplan.server.store.memory import MemoryStore
from kvplan.v1 import plan_pb2
from tests.server.conftest import GIB, engine_request, rank_request


def test_remembered_plan_id_is_plan_id_for() -> None:
    cache = PlanCache(capacity=2)
    request = engine_request(stages=2)
    reordered = plan_pb2.PlanRequest()
    reordered.CopyFrom(request)
    reordered.workers.reverse()
    wire_digest = hashlib.sha256(request.SerializeToString()).digest()
    for _ in range(2):  # computed, then remembered
        assert cache.plan_id(request) == plan_id_for(request)
        assert cache.plan_id(reordered) == plan_id_for(request)
        assert cache.plan_id(request, wire_digest) == plan_id_for(request)
    for engine in range(3):  # the memo is bounded like the plans
        cache.plan_id(engine_request(f"other-{engine}"))
    assert len(cache._plan_ids) == 2
    assert cache.plan_id(reordered) == plan_id_for(request)
    assert cache.plan_id(request) == plan_id_for(request)


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
