"""One contract suite for every store: memory (the reference), SQLite, Redis.

Each test runs against all three backends and checks a rule of the docstrings
in server/store/base.py; the Hypothesis tests run random call sequences on
SQLite and Redis next to memory and require the same answer to every call.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan.core.ledger import (
    NOTHING,
    DeviceState,
    GrantRefused,
    Lease,
    LeaseRequest,
    Totals,
    tally,
)
from kvplan.server.errors import ServiceError
from kvplan.server.store.base import (
    Arrival,
    RendezvousResult,
    Store,
    TooManyEngines,
    TooManyLeases,
    kept_result_bytes,
)
from kvplan.server.store.memory import MemoryStore
from kvplan.server.store.redis import RedisStore
from kvplan.server.store.sqlite import SQLiteStore
from kvplan.v1 import plan_pb2
from tests.server.redis_server import RedisServer, running_redis, wait_for_listeners

BACKENDS = ["memory", "sqlite", "redis"]
TTL_S = 600.0
CLAIM_TIMEOUT_S = 10.0
LEASE_TTL_S = 30.0
GIB = 1 << 30


class OpenStore(Protocol):
    async def __call__(self, max_plans: int = ..., max_plan_bytes: int = ...) -> Store: ...


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def new_store(
    backend: str,
    directory: Path,
    redis_url: str | None,
    max_plans: int = 4096,
    max_plan_bytes: int = 1 << 30,
) -> Store:
    if backend == "memory":
        return MemoryStore(max_plans=max_plans, max_plan_bytes=max_plan_bytes)
    if backend == "sqlite":
        path = str(directory / "kvplan.sqlite3")
        return SQLiteStore(path, max_plans=max_plans, max_plan_bytes=max_plan_bytes)
    assert redis_url is not None
    # A fresh prefix: every test sees an empty Redis.
    return RedisStore(
        redis_url,
        max_plans=max_plans,
        max_plan_bytes=max_plan_bytes,
        key_prefix=f"test-{uuid.uuid4().hex}:",
    )


@pytest_asyncio.fixture(params=BACKENDS)
async def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OpenStore]:
    backend: str = request.param
    redis_url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    opened: list[Store] = []

    async def open_one(max_plans: int = 4096, max_plan_bytes: int = 1 << 30) -> Store:
        store = new_store(backend, tmp_path, redis_url, max_plans, max_plan_bytes)
        await store.start()
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        await store.close()


@pytest_asyncio.fixture
async def store(open_store: OpenStore) -> Store:
    return await open_store()


async def settle(store: Store) -> None:
    """Give a Redis store's pub/sub echo of its own finish time to arrive (and be
    ignored), so a test can tell "called once" from "not called twice yet"."""
    if store.kind == "redis":
        await asyncio.sleep(0.1)


async def join(
    store: Store,
    engine_id: str,
    rank: int,
    *,
    world_size: int = 2,
    template: bytes = b"template",
    worker: bytes | None = None,
    now: float = 0.0,
    ttl_s: float = TTL_S,
    max_pending: int = 16,
    claim_timeout_s: float = CLAIM_TIMEOUT_S,
    identity: str = "",
    share: int | None = None,
) -> Arrival:
    return await store.rendezvous_join(
        engine_id=engine_id,
        world_size=world_size,
        template=template,
        rank=rank,
        worker=worker if worker is not None else f"worker-{rank}".encode(),
        now=now,
        ttl_s=ttl_s,
        max_pending=max_pending,
        claim_timeout_s=claim_timeout_s,
        identity=identity,
        max_pending_per_identity=share,
    )


def device(uuid_: str, *, total: int = 100, free: int = 100, limit: int = 90) -> DeviceState:
    return DeviceState(uuid_, total * GIB, free * GIB, limit * GIB)


def devices(*states: DeviceState) -> dict[str, DeviceState]:
    return {state.uuid: state for state in states}


def ask(rank: int, uuid_: str, gib: int, in_use_gib: int = 0) -> LeaseRequest:
    return LeaseRequest(
        rank=rank, device_uuid=uuid_, bytes=gib * GIB, in_use_bytes=in_use_gib * GIB
    )


def committed(leases: Sequence[Lease], uuid_: str) -> int:
    return sum(lease.bytes for lease in leases if lease.device_uuid == uuid_)


# --- plans -------------------------------------------------------------------------


async def test_put_and_get_plan(store: Store) -> None:
    await store.put_plan("p1", "engine-a", b"plan-1", 1.0)
    await store.put_plan("p-anonymous", "", b"plan-anonymous", 2.0)
    assert await store.get_plan("p1") == b"plan-1"
    assert await store.get_plan("p-anonymous") == b"plan-anonymous"
    assert await store.get_plan("unknown") is None
    assert await store.plan_for_engine("engine-a") == b"plan-1"
    assert await store.plan_for_engine("") is None  # "" names no engine
    assert await store.plan_for_engine("engine-b") is None
    await store.put_plan("p2", "engine-a", b"plan-2", 3.0)
    assert await store.plan_for_engine("engine-a") == b"plan-2"  # the newest
    assert await store.get_plan("p1") == b"plan-1"


async def test_plans_are_bounded_oldest_first(open_store: OpenStore) -> None:
    store = await open_store(max_plans=3)
    for index in range(5):
        await store.put_plan(f"p{index}", f"engine-{index}", f"plan-{index}".encode(), index)
    assert [await store.get_plan(f"p{index}") for index in range(5)] == [
        None,
        None,
        b"plan-2",
        b"plan-3",
        b"plan-4",
    ]
    assert await store.plan_for_engine("engine-0") is None
    assert await store.plan_for_engine("engine-4") == b"plan-4"
    # A plan put again is the newest: p3 goes next, not p2.
    await store.put_plan("p2", "engine-2", b"plan-2", 5.0)
    await store.put_plan("p5", "engine-5", b"plan-5", 6.0)
    assert await store.get_plan("p3") is None
    assert await store.get_plan("p2") == b"plan-2"


def _incompressible(size: int, seed: int) -> bytes:
    """Bytes no store can keep in fewer (SQLite compresses what shrinks)."""
    return random.Random(seed).randbytes(size)


async def test_plans_are_bounded_by_bytes_oldest_first(open_store: OpenStore) -> None:
    store = await open_store(max_plan_bytes=250)
    plans = [_incompressible(100, index) for index in range(4)]
    for index, plan in enumerate(plans):
        await store.put_plan(f"p{index}", f"engine-{index}", plan, index)
    # 100-byte plans under a 250-byte bound: the two newest stay.
    assert [await store.get_plan(f"p{index}") is not None for index in range(4)] == [
        False,
        False,
        True,
        True,
    ]
    # Replacing a plan counts its new size, not both.
    smaller, larger, big = _incompressible(50, 5), _incompressible(150, 6), _incompressible(1000, 7)
    await store.put_plan("p3", "engine-3", smaller, 5.0)
    await store.put_plan("p4", "engine-4", larger, 6.0)
    assert await store.get_plan("p2") is None
    assert await store.get_plan("p3") == smaller
    assert await store.get_plan("p4") == larger
    # A plan larger than the bound is kept alone: the newest always stays.
    await store.put_plan("big", "engine-big", big, 7.0)
    assert await store.get_plan("big") == big
    assert await store.get_plan("p4") is None


async def test_sqlite_plan_bounds_survive_a_restart(tmp_path: Path) -> None:
    """The SQLite store keeps its totals in memory: a restart reads them back."""
    path = str(tmp_path / "kvplan.sqlite3")
    first = SQLiteStore(path, max_plans=3, max_plan_bytes=1 << 20)
    await first.start()
    for index in range(3):
        await first.put_plan(f"p{index}", "", b"plan", index)
    await first.close()
    second = SQLiteStore(path, max_plans=3, max_plan_bytes=1 << 20)
    await second.start()
    try:
        await second.put_plan("p3", "", b"plan", 3.0)
        assert await second.get_plan("p0") is None
        assert [await second.get_plan(f"p{index}") for index in (1, 2, 3)] == [b"plan"] * 3
    finally:
        await second.close()


async def test_dropping_an_older_plan_keeps_the_engines_newest(open_store: OpenStore) -> None:
    store = await open_store(max_plans=2)
    await store.put_plan("old", "engine-a", b"old", 1.0)
    await store.put_plan("new", "engine-a", b"new", 2.0)
    await store.put_plan("other", "engine-b", b"other", 3.0)
    assert await store.get_plan("old") is None
    assert await store.plan_for_engine("engine-a") == b"new"


def real_plan(plan_id: str, engine_id: str, num_blocks: int = 4096) -> bytes:
    """A serialized PlanResponse: its body is shared by plans of equal content."""
    plan = plan_pb2.PlanResponse(plan_id=plan_id, engine_id=engine_id, num_blocks=num_blocks)
    plan.workers.add(rank=0, num_blocks=num_blocks)
    return plan.SerializeToString()


async def test_plans_of_equal_content_share_one_body(open_store: OpenStore) -> None:
    store = await open_store(max_plans=3)
    plans = {f"p{index}": real_plan(f"p{index}", f"engine-{index}") for index in range(3)}
    for now, (plan_id, plan) in enumerate(plans.items()):
        await store.put_plan(plan_id, f"engine-{plan_id[1:]}", plan, now)
    assert await store.distinct_plan_bodies() == 1
    for plan_id, plan in plans.items():
        assert await store.get_plan(plan_id) == plan  # each with its own ids
    assert await store.plan_for_engine("engine-1") == plans["p1"]
    # Another content: a second body; p0 is dropped, the shared body stays for p1, p2.
    other = real_plan("p3", "engine-3", num_blocks=1)
    await store.put_plan("p3", "engine-3", other, 3.0)
    assert await store.get_plan("p0") is None
    assert await store.distinct_plan_bodies() == 2
    assert await store.get_plan("p2") == plans["p2"]
    # Put again with the same body: the body stays.
    await store.put_plan("p2", "engine-2", plans["p2"], 4.0)
    assert await store.get_plan("p2") == plans["p2"]
    # The last plans holding the first body go (p1, then p3 and p2): so does the body.
    for index in (4, 5, 6):
        await store.put_plan(f"p{index}", "", real_plan(f"p{index}", "", num_blocks=1), index)
    assert [await store.get_plan(f"p{index}") is None for index in range(7)] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert await store.distinct_plan_bodies() == 1


async def test_the_byte_bound_counts_a_shared_body_once(open_store: OpenStore) -> None:
    def head_bytes(index: int) -> int:
        head = plan_pb2.PlanResponse(plan_id=f"p{index}", engine_id=f"engine-{index}")
        return len(head.SerializeToString())

    body_bytes = len(real_plan("p0", "engine-0")) - head_bytes(0)
    # Room for one body and the heads of 8 plans, not for 8 bodies.
    store = await open_store(max_plan_bytes=body_bytes + sum(map(head_bytes, range(8))))
    for index in range(8):
        await store.put_plan(
            f"p{index}", f"engine-{index}", real_plan(f"p{index}", f"engine-{index}"), index
        )
    assert all([await store.get_plan(f"p{index}") is not None for index in range(8)])
    # A plan of other content does not fit beside them: the oldest make room.
    await store.put_plan("other", "", real_plan("other", "", num_blocks=7), 9.0)
    assert await store.get_plan("p0") is None
    assert await store.get_plan("other") is not None


async def test_concurrent_plans_are_all_kept(open_store: OpenStore) -> None:
    """Plans put at once (SQLite commits them together) are each stored."""
    store = await open_store()
    plans = {
        f"p{index}": real_plan(f"p{index}", f"engine-{index}", index % 3) for index in range(40)
    }
    await asyncio.gather(
        *(
            store.put_plan(plan_id, f"engine-{plan_id[1:]}", plan, 1.0)
            for plan_id, plan in plans.items()
        )
    )
    assert {plan_id: await store.get_plan(plan_id) for plan_id in plans} == plans
    assert await store.distinct_plan_bodies() == 3


async def test_sqlite_plans_survive_a_restart(tmp_path: Path) -> None:
    """A plan is committed once put_plan returns: a new store on the file has it."""
    path = str(tmp_path / "kvplan.sqlite3")
    first = SQLiteStore(path)
    await first.start()
    plans = {f"p{index}": real_plan(f"p{index}", f"engine-{index}") for index in range(20)}
    await asyncio.gather(
        *(
            first.put_plan(plan_id, f"engine-{plan_id[1:]}", plan, 1.0)
            for plan_id, plan in plans.items()
        )
    )
    second = SQLiteStore(path)  # the first is not closed: as after kill -9
    await second.start()
    try:
        assert {plan_id: await second.get_plan(plan_id) for plan_id in plans} == plans
        assert await second.plan_for_engine("engine-7") == plans["p7"]
        assert await second.distinct_plan_bodies() == 1
    finally:
        await second.close()
        await first.close()


# --- rendezvous ----------------------------------------------------------------------


async def test_complete_engine_is_planned_exactly_once(store: Store) -> None:
    assert await join(store, "e", 2, world_size=3) == Arrival("waiting")
    assert await join(store, "e", 0, world_size=3) == Arrival("waiting")
    assert await store.pending_engines() == 1
    completing = await join(store, "e", 1, world_size=3)
    assert completing == Arrival("plan", workers=(b"worker-0", b"worker-1", b"worker-2"))
    # Every later arrival (retries included) waits for the claimer's result.
    for rank in range(3):
        assert await join(store, "e", rank, world_size=3, now=1.0) == Arrival("waiting")
    assert await store.pending_engines() == 1


async def test_retry_of_a_present_rank_is_accepted(store: Store) -> None:
    assert await join(store, "e", 0) == Arrival("waiting")
    assert await join(store, "e", 0, now=1.0) == Arrival("waiting")
    assert await store.pending_engines() == 1
    assert await join(store, "e", 1, now=2.0) == Arrival("plan", workers=(b"worker-0", b"worker-1"))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"world_size": 3}, "world_size"),
        ({"template": b"other options"}, "options"),
        ({"rank": 0, "worker": b"another spec"}, "workers[0].rank"),
    ],
)
async def test_a_rank_that_disagrees_with_the_open_rendezvous_is_refused(
    store: Store, change: dict[str, Any], field: str
) -> None:
    await join(store, "e", 0)
    arguments: dict[str, Any] = {"rank": 1, **change}
    with pytest.raises(ServiceError) as refused:
        await join(store, "e", **arguments)
    assert (refused.value.code, refused.value.field) == ("INVALID_ARGUMENT", field)
    assert "'e'" in refused.value.message
    # Nothing changed: the right rank 1 still completes the engine with rank 0's spec.
    assert await join(store, "e", 1) == Arrival("plan", workers=(b"worker-0", b"worker-1"))


async def test_finished_engine_answers_an_unchanged_late_rank(store: Store) -> None:
    await join(store, "e", 0)
    await join(store, "e", 1)
    planned = RendezvousResult(True, b"the plan, " * 100)  # SQLite stores it compressed
    await store.rendezvous_finish("e", planned, 5.0)
    assert await store.pending_engines() == 0
    assert await store.plan_for_engine("e") is None  # that is the servicer's put_plan
    for rank in (0, 1):
        assert await join(store, "e", rank, now=6.0) == Arrival("finished", result=planned)


@pytest.mark.parametrize(
    "change",
    [
        {"rank": 0, "worker": b"a changed spec"},
        {"rank": 1, "template": b"changed options"},
        {"rank": 2, "world_size": 3},  # a rank the planned engine did not have
    ],
)
async def test_finished_engine_refuses_a_changed_spec(store: Store, change: dict[str, Any]) -> None:
    await join(store, "e", 0)
    await join(store, "e", 1)
    await store.rendezvous_finish("e", RendezvousResult(True, b"the plan"), 5.0)
    with pytest.raises(ServiceError) as refused:
        await join(store, "e", **{"now": 6.0, **change})
    assert (refused.value.code, refused.value.field) == ("FAILED_PRECONDITION", "workers[0]")
    assert await store.pending_engines() == 0


async def test_old_rendezvous_and_finished_engines_are_forgotten(store: Store) -> None:
    await join(store, "open", 0, now=0.0)
    await join(store, "done", 0, world_size=1, now=0.0)
    await store.rendezvous_finish("done", RendezvousResult(True, b"plan"), 0.0)
    # Exactly ttl_s old: still kept.
    await join(store, "other", 0, now=TTL_S)
    assert await store.pending_engines() == 2
    with pytest.raises(ServiceError):
        await join(store, "done", 0, world_size=1, worker=b"changed", now=TTL_S)
    # Older: forgotten before anything else is decided.
    await join(store, "other", 1, now=TTL_S + 0.5)  # completes "other"
    assert await store.pending_engines() == 1  # "open" is gone
    changed = await join(store, "done", 0, world_size=1, worker=b"changed", now=TTL_S + 0.5)
    assert changed == Arrival("plan", workers=(b"changed",))  # a new engine, no conflict
    assert await join(store, "open", 1, now=TTL_S + 0.5) == Arrival("waiting")  # rank 0 forgotten


async def test_forgetting_is_exact_whatever_the_order_of_arrival(store: Store) -> None:
    # Replicas' clocks differ: engines need not arrive in the order of their times.
    for engine_id, made in (("a", 500.0), ("b", 100.0), ("c", 300.0), ("d", 100.5)):
        await join(store, engine_id, 0, now=made)
    await join(store, "done-late", 0, world_size=1, now=400.0)
    await store.rendezvous_finish("done-late", RendezvousResult(True, b"plan"), 400.0)
    await join(store, "done-early", 0, world_size=1, now=50.0)
    await store.rendezvous_finish("done-early", RendezvousResult(True, b"plan"), 50.0)
    await join(store, "x", 0, now=100.0 + TTL_S + 0.25)  # b and done-early are older
    assert await store.pending_engines() == 4  # a, c, d and x
    assert await store.rendezvous_ranks("b") == ()
    assert await store.rendezvous_ranks("d") == (0,)
    later = 100.0 + TTL_S + 0.25
    changed = await join(store, "done-early", 0, world_size=1, worker=b"changed", now=later)
    assert changed == Arrival("plan", workers=(b"changed",))  # forgotten: a new engine
    with pytest.raises(ServiceError):  # still finished: a changed rank is refused
        await join(store, "done-late", 0, world_size=1, worker=b"changed", now=later)


async def test_finished_results_are_kept_within_their_byte_bound(store: Store) -> None:
    """A flood of rank-mode engines cannot make the store hold every plan for a whole
    TTL: past the bound the oldest results are forgotten, and a late rank of one of
    them is a new engine. Random plans, so that SQLite's compression keeps sizes."""
    plans = {f"e{index}": random.Random(index).randbytes(1000) for index in range(5)}
    size = kept_result_bytes("e0", 1000, ranks=1)
    bound = 3 * size + size // 2
    for index, (engine, plan) in enumerate(plans.items()):
        await join(store, engine, 0, world_size=1, now=float(index))
        await store.rendezvous_finish(
            engine, RendezvousResult(True, plan), float(index), max_kept_bytes=bound
        )
    for engine in ("e2", "e3", "e4"):
        kept = await join(store, engine, 0, world_size=1, now=10.0)
        assert kept == Arrival("finished", result=RendezvousResult(True, plans[engine]))
    for engine in ("e0", "e1"):
        forgotten = await join(store, engine, 0, world_size=1, now=10.0)
        assert forgotten == Arrival("plan", workers=(b"worker-0",))
    # A result over the bound by itself is not kept, and forgets no other.
    await join(store, "huge", 0, world_size=1, now=11.0)
    await store.rendezvous_finish(
        "huge", RendezvousResult(True, random.randbytes(bound)), 11.0, max_kept_bytes=bound
    )
    assert await join(store, "huge", 0, world_size=1, now=12.0) == Arrival(
        "plan", workers=(b"worker-0",)
    )
    assert (await join(store, "e4", 0, world_size=1, now=12.0)).state == "finished"
    # Results forgotten by their TTL leave the bound: three new ones fit again.
    later = 20.0 + TTL_S
    for index in range(3):
        engine = f"new{index}"
        await join(store, engine, 0, world_size=1, now=later)
        await store.rendezvous_finish(
            engine, RendezvousResult(True, plans[f"e{index}"]), later, max_kept_bytes=bound
        )
    for index in range(3):
        again = await join(store, f"new{index}", 0, world_size=1, now=later)
        assert again.state == "finished"


async def test_a_result_is_kept_however_many_ranks_its_engine_has(store: Store) -> None:
    """Every rank's digest is kept with the result (Redis writes them in slices: one
    Lua call takes a few thousand values at most)."""
    ranks = 4096
    for rank in range(ranks):
        await join(store, "wide", rank, world_size=ranks, max_pending=1)
    planned = RendezvousResult(True, b"the plan")
    await store.rendezvous_finish("wide", planned, 1.0)
    assert await store.pending_engines() == 0
    for rank in (0, ranks - 1):
        late = await join(store, "wide", rank, world_size=ranks, now=2.0)
        assert late == Arrival("finished", result=planned)


async def test_the_result_just_kept_is_not_the_one_forgotten(store: Store) -> None:
    """A server whose clock is behind (stepped back, or a replica behind another)
    finishes an engine with an earlier time than the results kept: past the bound,
    an older result goes, not the one its ranks are about to ask for."""
    plans = {engine: random.Random(engine).randbytes(1000) for engine in ("ahead", "behind")}
    bound = kept_result_bytes("ahead", 1000, ranks=1) + 100  # room for one
    for engine, now in (("ahead", 100.0), ("behind", 50.0)):
        await join(store, engine, 0, world_size=1, now=now)
        await store.rendezvous_finish(
            engine, RendezvousResult(True, plans[engine]), now, max_kept_bytes=bound
        )
    kept = await join(store, "behind", 0, world_size=1, now=101.0)
    assert kept == Arrival("finished", result=RendezvousResult(True, plans["behind"]))
    assert (await join(store, "ahead", 0, world_size=1, now=101.0)).state == "plan"


async def test_memory_store_keeps_its_age_index_bounded() -> None:
    store = MemoryStore()
    for engine in range(2000):  # opened and finished at once: nothing old to forget
        await join(store, f"e{engine}", 0, world_size=1, now=1.0)
        await store.rendezvous_finish(f"e{engine}", RendezvousResult(True, b"plan"), 1.0)
    # Each finished engine left a stale item in the index of open ones: dropped.
    assert len(store._open_by_age._heap) <= 65
    await join(store, "late", 0, now=2.0 + TTL_S)
    assert len(store._finished) == 0  # every finished engine forgotten by one join
    assert len(store._finished_by_age._heap) == 0


async def test_too_many_pending_engines(store: Store) -> None:
    await join(store, "a", 0, max_pending=2)
    await join(store, "b", 0, max_pending=2)
    with pytest.raises(ServiceError) as refused:
        await join(store, "c", 0, max_pending=2)
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert refused.value.details == {
        "pending": 2,
        "limit": "max_pending_rendezvous",
        "limit_value": 2,
    }
    assert await store.pending_engines() == 2
    # An engine already open is not new: it may complete at the limit.
    assert (await join(store, "a", 1, max_pending=2)).state == "plan"
    await store.rendezvous_finish("a", RendezvousResult(True, b"plan"), 1.0)
    assert await join(store, "c", 0, max_pending=2) == Arrival("waiting")


async def test_forgetting_comes_before_the_pending_limit(store: Store) -> None:
    await join(store, "stale", 0, now=0.0, max_pending=1)
    assert await join(store, "new", 0, now=TTL_S + 1, max_pending=1) == Arrival("waiting")
    assert await store.pending_engines() == 1


async def test_a_waiting_rank_leaves(store: Store) -> None:
    await join(store, "e", 0, world_size=3)
    await join(store, "e", 1, world_size=3)
    await store.rendezvous_leave("e", 1)
    assert await store.pending_engines() == 1
    # Rank 1 is gone, so another spec for it is a new arrival, not a conflict.
    assert await join(store, "e", 1, world_size=3, worker=b"new spec") == Arrival("waiting")
    await store.rendezvous_leave("e", 0)
    await store.rendezvous_leave("e", 1)
    assert await store.pending_engines() == 0  # an empty rendezvous is deleted
    await store.rendezvous_leave("e", 0)  # nothing there: no-op
    await store.rendezvous_leave("never-joined", 0)


async def test_leaving_a_claimed_rendezvous_changes_nothing(store: Store) -> None:
    await join(store, "e", 0)
    assert (await join(store, "e", 1)).state == "plan"
    await store.rendezvous_leave("e", 0)
    await store.rendezvous_leave("e", 1)
    assert await store.pending_engines() == 1
    # The claimer died: after the claim timeout a retry plans with both specs.
    later = CLAIM_TIMEOUT_S + 1
    assert await join(store, "e", 0, now=later) == Arrival(
        "plan", workers=(b"worker-0", b"worker-1")
    )


async def test_a_stale_claim_is_taken_over(store: Store) -> None:
    assert (await join(store, "e", 0, world_size=1, now=0.0)).state == "plan"
    assert await join(store, "e", 0, world_size=1, now=CLAIM_TIMEOUT_S) == Arrival("waiting")
    retaken = await join(store, "e", 0, world_size=1, now=CLAIM_TIMEOUT_S + 0.5)
    assert retaken == Arrival("plan", workers=(b"worker-0",))
    # The new claim starts its own timeout.
    assert await join(store, "e", 0, world_size=1, now=CLAIM_TIMEOUT_S + 1) == Arrival("waiting")


async def test_an_error_result_deletes_the_rendezvous(store: Store) -> None:
    heard: list[tuple[str, RendezvousResult]] = []
    store.subscribe(lambda engine_id, result: heard.append((engine_id, result)))
    await join(store, "e", 0)
    await join(store, "e", 1)
    failed = RendezvousResult(False, b"serialized google.rpc.Status")
    await store.rendezvous_finish("e", failed, 1.0)
    assert heard == [("e", failed)]
    assert await store.pending_engines() == 0
    # The ranks retry from scratch; a changed spec is welcome now.
    assert await join(store, "e", 0, worker=b"fixed spec", now=2.0) == Arrival("waiting")


async def test_a_remembered_failure_answers_unchanged_ranks(store: Store) -> None:
    heard: list[tuple[str, RendezvousResult]] = []
    store.subscribe(lambda engine_id, result: heard.append((engine_id, result)))
    await join(store, "e", 0)
    await join(store, "e", 1)
    failed = RendezvousResult(False, b"serialized google.rpc.Status")
    await store.rendezvous_finish("e", failed, 1.0, remember_failure=True)
    await settle(store)
    assert heard == [("e", failed)]
    assert await store.pending_engines() == 0
    # Rule 2b: a rank back unchanged gets the same error, at once.
    assert await join(store, "e", 1, now=2.0) == Arrival("finished", result=failed)
    assert await join(store, "e", 0, now=2.0) == Arrival("finished", result=failed)
    # A changed spec forgets the failure: a new rendezvous.
    assert await join(store, "e", 0, worker=b"fixed spec", now=3.0) == Arrival("waiting")
    assert await join(store, "e", 1, now=3.0) == Arrival(
        "plan", workers=(b"fixed spec", b"worker-1")
    )


async def test_every_subscriber_hears_each_finish_once(store: Store) -> None:
    first: list[tuple[str, RendezvousResult]] = []
    second: list[tuple[str, RendezvousResult]] = []
    store.subscribe(lambda engine_id, result: first.append((engine_id, result)))
    store.subscribe(lambda engine_id, result: second.append((engine_id, result)))
    await join(store, "e", 0, world_size=1)
    planned = RendezvousResult(True, b"plan")
    await store.rendezvous_finish("e", planned, 1.0)
    # A finish for a rendezvous that is gone (forgotten meanwhile) is still news.
    lost = RendezvousResult(False, b"status")
    await store.rendezvous_finish("gone", lost, 2.0)
    await settle(store)
    assert first == second == [("e", planned), ("gone", lost)]


async def test_pending_engines_counts_open_rendezvous(store: Store) -> None:
    assert await store.pending_engines() == 0
    await join(store, "a", 0)
    await join(store, "b", 0)
    await join(store, "b", 1)  # complete and claimed: still open until finished
    assert await store.pending_engines() == 2
    await store.rendezvous_finish("b", RendezvousResult(True, b"plan"), 1.0)
    assert await store.pending_engines() == 1


async def test_one_identity_cannot_take_every_pending_rendezvous(store: Store) -> None:
    """Each identity's waiting engines are counted apart: past its share, a new
    engine of that identity is refused while other identities still open theirs."""
    for engine in ("a1", "a2"):
        await join(store, engine, 0, identity="alice", share=2)
    with pytest.raises(ServiceError) as refused:
        await join(store, "a3", 0, identity="alice", share=2)
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert refused.value.details == {
        "pending": 2,
        "limit": "max_pending_rendezvous_per_identity",
        "limit_value": 2,
    }
    assert "'alice'" in refused.value.message
    assert await join(store, "b1", 0, identity="bob", share=2) == Arrival("waiting")
    # Ranks of an engine already open are not new engines.
    assert (await join(store, "a1", 1, identity="alice", share=2)).state == "plan"
    # Each way an engine stops waiting gives its place back: finished, left, forgotten.
    await store.rendezvous_finish("a1", RendezvousResult(True, b"plan"), 1.0)
    assert await join(store, "a3", 0, identity="alice", share=2) == Arrival("waiting")
    await store.rendezvous_leave("a3", 0)
    assert await join(store, "a4", 0, identity="alice", share=2, now=1.0) == Arrival("waiting")
    with pytest.raises(ServiceError):
        await join(store, "a5", 0, identity="alice", share=2, now=1.0)
    later = 2.0 + TTL_S  # a2 and a4 forgotten
    assert await join(store, "a5", 0, identity="alice", share=2, now=later) == Arrival("waiting")
    assert await join(store, "a6", 0, identity="alice", share=2, now=later) == Arrival("waiting")
    # No share (a server without authentication): only the server-wide limit.
    for engine in ("x1", "x2", "x3"):
        assert await join(store, engine, 0, now=later) == Arrival("waiting")


# --- engine ownership: at most max_engines live engines per identity ------------
# Times are the wall clock: Redis expires ownership on its own clock.


async def test_an_identity_owns_at_most_max_engines(store: Store) -> None:
    now = time.time()
    assert await store.claim_engine("a1", "alice", now, TTL_S, 2) == "alice"
    assert await store.claim_engine("a2", "alice", now, TTL_S, 2) == "alice"
    with pytest.raises(TooManyEngines) as refused:
        await store.claim_engine("a3", "alice", now, TTL_S, 2)
    assert (refused.value.held, refused.value.limit) == (2, 2)
    assert await store.engine_owner("a3", now) is None  # the refusal took nothing
    # Re-claiming an engine the identity owns is never refused, even over the limit.
    assert await store.claim_engine("a1", "alice", now, TTL_S, 2) == "alice"
    assert await store.claim_engine("a2", "alice", now, TTL_S, 1) == "alice"
    # Another identity has its own count; its claim of alice's engine changes nothing.
    assert await store.claim_engine("b1", "bob", now, TTL_S, 2) == "bob"
    assert await store.claim_engine("a1", "bob", now, TTL_S, 2) == "alice"
    assert await store.claim_engine("b2", "bob", now, TTL_S, 2) == "bob"
    with pytest.raises(TooManyEngines):
        await store.claim_engine("a3", "alice", now, TTL_S, 2)


async def test_unowned_live_leases_are_never_adopted(store: Store) -> None:
    """Leases granted without authentication ("") have no owner record; under
    authentication no identity claims their engine while they live (it would
    then renew or release another's memory), and the refusal records nothing."""
    now = time.time()
    gpus = devices(device("gpu-0"))
    await store.grant("old", [ask(0, "gpu-0", 40)], gpus, now, 30.0)
    assert await store.engine_owner("old", now) == ""
    assert await store.claim_engine("old", "bob", now, TTL_S, 2) == ""
    assert await store.claim_engine("old", "alice", now, TTL_S, 2) == ""
    assert await store.engine_owner("old", now) == ""
    # Once the leases expire (one lease TTL) the engine is free to claim.
    later = now + 31.0
    assert await store.engine_owner("old", later) is None
    assert await store.claim_engine("old", "bob", later, TTL_S, 2) == "bob"
    # An identity's own leases whose owner record lapsed stay its own.
    await store.grant("mine", [ask(0, "gpu-0", 10)], gpus, now, 30.0, "carol")
    assert await store.engine_owner("mine", now) == "carol"
    assert await store.claim_engine("mine", "bob", now, TTL_S, 2) == "carol"
    assert await store.claim_engine("mine", "carol", now, TTL_S, 2) == "carol"


async def test_an_expired_ownership_stops_counting_at_once(store: Store) -> None:
    now = time.time()
    assert await store.claim_engine("short", "alice", now, 0.3, 2) == "alice"
    assert await store.claim_engine("renewed", "alice", now, 0.3, 2) == "alice"
    assert await store.claim_engine("renewed", "alice", now, TTL_S, 2) == "alice"
    with pytest.raises(TooManyEngines):
        await store.claim_engine("new", "alice", now, TTL_S, 2)
    await asyncio.sleep(0.5)
    later = time.time()
    assert await store.engine_owner("short", later) is None
    # "short" expired (never deleted by anyone): one new engine fits, not two.
    assert await store.claim_engine("new", "alice", later, TTL_S, 2) == "alice"
    with pytest.raises(TooManyEngines) as refused:
        await store.claim_engine("newer", "alice", later, TTL_S, 2)
    assert refused.value.held == 2


async def test_an_expired_engine_taken_by_another_leaves_its_old_owners_count(
    store: Store,
) -> None:
    now = time.time()
    assert await store.claim_engine("x", "alice", now, 0.3, 1) == "alice"
    await asyncio.sleep(0.5)
    later = time.time()
    assert await store.claim_engine("x", "bob", later, TTL_S, 1) == "bob"
    assert await store.claim_engine("y", "alice", later, TTL_S, 1) == "alice"
    with pytest.raises(TooManyEngines):
        await store.claim_engine("z", "bob", later, TTL_S, 1)


async def test_the_engine_bound_is_exact_for_claims_at_once(store: Store) -> None:
    now = time.time()

    async def claim(engine_id: str) -> bool:
        try:
            return await store.claim_engine(engine_id, "alice", now, TTL_S, 5) == "alice"
        except TooManyEngines:
            return False

    claimed = await asyncio.gather(*(claim(f"e{n}") for n in range(20)))
    assert sum(claimed) == 5
    owned = [await store.engine_owner(f"e{n}", now) for n in range(20)]
    assert owned.count("alice") == 5 and owned.count(None) == 15


async def test_memory_store_keeps_its_ownership_expiry_index_bounded() -> None:
    store = MemoryStore()
    for renewal in range(2000):  # one engine renewed over and over
        await store.claim_engine("e", "alice", float(renewal), TTL_S, 1)
    assert len(store._owner_expiry) <= 2 + 64
    assert store._engines_owned == {"alice": 1}
    await store.claim_engine("other", "bob", 4000.0 + TTL_S, TTL_S, 1)
    assert store._engines_owned == {"bob": 1}  # alice's record expired and left


async def arrive_at_once(
    stores: Sequence[Store], engines: int, world_size: int, *, max_pending: int = 4096
) -> list[tuple[str, int, Arrival | ServiceError]]:
    """Every rank of `engines` engines joins at once (spread over `stores`), in a
    shuffled order; each engine's claimer finishes it. Every join's outcome."""
    arrivals = [(f"e{engine}", rank) for engine in range(engines) for rank in range(world_size)]
    random.Random(7).shuffle(arrivals)

    async def one(index: int, engine_id: str, rank: int) -> Arrival | ServiceError:
        store = stores[index % len(stores)]
        try:
            arrival = await join(
                store, engine_id, rank, world_size=world_size, max_pending=max_pending
            )
        except ServiceError as refusal:
            return refusal
        if arrival.state == "plan":
            await store.rendezvous_finish(engine_id, RendezvousResult(True, b"plan"), 1.0)
        return arrival

    outcomes = await asyncio.gather(
        *(one(index, engine_id, rank) for index, (engine_id, rank) in enumerate(arrivals))
    )
    return [(e, r, outcome) for (e, r), outcome in zip(arrivals, outcomes, strict=True)]


async def test_ranks_arriving_at_once_plan_each_engine_exactly_once(store: Store) -> None:
    # More calls at once than a Redis replica has connections, one engine's ranks
    # interleaved with the others' (the SQLite store shares transactions among them).
    outcomes = await arrive_at_once([store], engines=40, world_size=4)
    claims = [
        (engine_id, arrival)
        for engine_id, _, arrival in outcomes
        if isinstance(arrival, Arrival) and arrival.state == "plan"
    ]
    assert sorted(engine_id for engine_id, _ in claims) == sorted(f"e{e}" for e in range(40))
    for _, arrival in claims:  # the claimer gets every rank's spec, in rank order
        assert arrival.workers == tuple(f"worker-{rank}".encode() for rank in range(4))
    assert all(isinstance(arrival, Arrival) for _, _, arrival in outcomes)
    assert await store.pending_engines() == 0
    # Each engine is finished: a late unchanged rank hears the plan.
    assert await join(store, "e3", 2, world_size=4) == Arrival(
        "finished", result=RendezvousResult(True, b"plan")
    )


async def test_the_pending_limit_is_exact_for_engines_arriving_at_once(store: Store) -> None:
    # 30 new engines at once, one rank each (none completes): exactly 5 open.
    async def first_rank(engine: int) -> Arrival | ServiceError:
        try:
            return await join(store, f"e{engine}", 0, max_pending=5)
        except ServiceError as refusal:
            return refusal

    outcomes = await asyncio.gather(*(first_rank(engine) for engine in range(30)))
    assert [o for o in outcomes if isinstance(o, Arrival)] == [Arrival("waiting")] * 5
    refusals = [o for o in outcomes if isinstance(o, ServiceError)]
    assert len(refusals) == 25
    assert {(r.code, r.details["pending"]) for r in refusals} == {("RESOURCE_EXHAUSTED", 5)}
    assert await store.pending_engines() == 5


async def test_a_refusal_among_ranks_arriving_at_once_is_its_own(store: Store) -> None:
    await join(store, "e", 0, world_size=3)

    async def conflicting() -> Arrival | ServiceError:
        try:
            return await join(store, "e", 0, world_size=3, worker=b"another spec")
        except ServiceError as refusal:
            return refusal

    outcomes = await asyncio.gather(
        join(store, "e", 1, world_size=3), conflicting(), join(store, "e", 2, world_size=3)
    )
    assert isinstance(outcomes[1], ServiceError)
    assert outcomes[1].field == "workers[0].rank"
    assert sorted(o.state for o in outcomes if isinstance(o, Arrival)) == ["plan", "waiting"]
    claim = next(o for o in outcomes if isinstance(o, Arrival) and o.state == "plan")
    assert claim.workers == (b"worker-0", b"worker-1", b"worker-2")


# --- lease ledger ----------------------------------------------------------------------


async def test_grant_returns_the_new_leases_in_request_order(store: Store) -> None:
    gpus = devices(device("gpu-0"), device("gpu-1"))
    granted = await store.grant(
        "e", [ask(1, "gpu-1", 30, in_use_gib=5), ask(0, "gpu-0", 20, in_use_gib=40)], gpus, 10.0,
        LEASE_TTL_S,
    )  # fmt: skip
    assert granted == (
        Lease("e", 1, "gpu-1", 30 * GIB, 5 * GIB, 10.0, 10.0 + LEASE_TTL_S),
        # In use beyond the footprint counts as allocated up to the footprint.
        Lease("e", 0, "gpu-0", 20 * GIB, 20 * GIB, 10.0, 10.0 + LEASE_TTL_S),
    )
    assert await store.leases(10.0) == (granted[1], granted[0])  # by engine, then rank


async def test_a_grant_over_the_commit_limit_changes_nothing(store: Store) -> None:
    gpus = devices(device("gpu-0", limit=90), device("gpu-1"))
    await store.grant("a", [ask(0, "gpu-0", 60)], gpus, 0.0, LEASE_TTL_S)
    before_b = await store.grant("b", [ask(0, "gpu-1", 10)], gpus, 0.0, LEASE_TTL_S)
    before = await store.leases(1.0)
    with pytest.raises(GrantRefused) as refused:
        await store.grant("b", [ask(0, "gpu-1", 10), ask(1, "gpu-0", 40)], gpus, 1.0, LEASE_TTL_S)
    assert refused.value.grant_reason == "commit_limit"
    assert refused.value.details["committed_bytes"] == 60 * GIB
    assert refused.value.details["device_uuid"] == "gpu-0"
    assert await store.leases(1.0) == before  # b keeps its old lease, a its own
    assert before_b[0] in before


async def test_a_grant_beyond_free_memory_is_refused(store: Store) -> None:
    gpus = devices(device("gpu-0", free=50, limit=100))
    await store.grant("a", [ask(0, "gpu-0", 40)], gpus, 0.0, LEASE_TTL_S)  # 40 outstanding
    with pytest.raises(GrantRefused) as refused:
        await store.grant("b", [ask(0, "gpu-0", 20)], gpus, 0.0, LEASE_TTL_S)
    assert refused.value.grant_reason == "free_memory"
    assert refused.value.details["outstanding_bytes"] == 40 * GIB
    # Memory b already holds is in the device's used memory, not taken twice.
    granted = await store.grant("b", [ask(0, "gpu-0", 20, in_use_gib=15)], gpus, 0.0, LEASE_TTL_S)
    assert [lease.engine_id for lease in await store.leases(0.0)] == ["a", "b"]
    assert granted[0].allocated_bytes == 15 * GIB


async def test_a_regrant_replaces_the_engines_own_leases(store: Store) -> None:
    gpus = devices(device("gpu-0", limit=90), device("gpu-1"))
    await store.grant("a", [ask(0, "gpu-0", 60), ask(1, "gpu-1", 10)], gpus, 0.0, LEASE_TTL_S)
    # 80 fits in 90 only because a's 60 are not counted a second time.
    regranted = await store.grant("a", [ask(0, "gpu-0", 80)], gpus, 5.0, LEASE_TTL_S)
    assert await store.leases(5.0) == regranted  # rank 1 is gone too
    with pytest.raises(GrantRefused):
        await store.grant("b", [ask(0, "gpu-0", 20)], gpus, 5.0, LEASE_TTL_S)
    # An empty grant leaves the engine with no lease at all.
    assert await store.grant("a", [], gpus, 6.0, LEASE_TTL_S) == ()
    assert await store.leases(6.0) == ()


async def test_renew_extends_live_leases_and_updates_allocations(store: Store) -> None:
    gpus = devices(device("gpu-0"), device("gpu-1"))
    await store.grant("e", [ask(0, "gpu-0", 20), ask(1, "gpu-1", 30)], gpus, 0.0, LEASE_TTL_S)
    renewed = await store.renew("e", {1: 25 * GIB}, 20.0, LEASE_TTL_S)
    assert renewed == (
        Lease("e", 0, "gpu-0", 20 * GIB, 0, 0.0, 20.0 + LEASE_TTL_S),
        Lease("e", 1, "gpu-1", 30 * GIB, 25 * GIB, 0.0, 20.0 + LEASE_TTL_S),
    )
    assert await store.leases(45.0) == renewed  # past the first expiry, still live
    again = await store.renew("e", {0: 5 * GIB}, 40.0, LEASE_TTL_S)
    assert [lease.allocated_bytes for lease in again] == [5 * GIB, 25 * GIB]  # others keep theirs


async def test_renew_without_leases_is_not_found(store: Store) -> None:
    with pytest.raises(ServiceError) as refused:
        await store.renew("nobody", {}, 0.0, LEASE_TTL_S)
    assert (refused.value.code, refused.value.field) == ("NOT_FOUND", "engine_id")


async def test_renew_after_every_lease_expired_is_a_failed_precondition(store: Store) -> None:
    await store.grant("e", [ask(0, "gpu-0", 20)], devices(device("gpu-0")), 0.0, LEASE_TTL_S)
    with pytest.raises(ServiceError) as refused:
        await store.renew("e", {0: GIB}, LEASE_TTL_S, LEASE_TTL_S)  # expires_at == now: expired
    assert (refused.value.code, refused.value.field) == ("FAILED_PRECONDITION", "engine_id")
    assert await store.leases(LEASE_TTL_S) == ()
    # Once swept, the engine holds nothing at all.
    assert len(await store.sweep_expired(LEASE_TTL_S)) == 1
    with pytest.raises(ServiceError) as gone:
        await store.renew("e", {}, LEASE_TTL_S, LEASE_TTL_S)
    assert gone.value.code == "NOT_FOUND"


async def test_a_renewal_stamped_behind_an_expiry_does_not_bring_the_lease_back(
    store: Store,
) -> None:
    """A heartbeat through a replica whose clock is a little behind (or after a step
    back): the lease already expired elsewhere and its memory went to another engine,
    so renewing it would over-commit the device."""
    gpu = devices(device("gpu-0", limit=90))
    await store.grant("a", [ask(0, "gpu-0", 60)], gpu, 0.0, LEASE_TTL_S)
    await store.grant("b", [ask(0, "gpu-0", 60)], gpu, LEASE_TTL_S + 0.01, LEASE_TTL_S)
    with pytest.raises(ServiceError) as refused:
        await store.renew("a", {0: 60 * GIB}, LEASE_TTL_S - 0.01, LEASE_TTL_S)
    assert refused.value.code == "FAILED_PRECONDITION"
    view = await store.ledger_view(LEASE_TTL_S + 0.02, ["gpu-0"])
    assert view.devices["gpu-0"].committed_bytes == 60 * GIB
    assert [lease.engine_id for lease in await store.leases(LEASE_TTL_S + 0.02)] == ["b"]


async def test_a_clock_stepped_back_past_a_lease_ttl_still_counts_what_it_grants(
    store: Store,
) -> None:
    """The server's clock steps back by more than a lease TTL (an NTP correction, or a
    replica that far behind another sharing Redis). Stamped by that clock, a grant or
    a renewal would expire below the time the store already expired leases through:
    never counted, its memory would be granted again."""
    gpus = devices(device("gpu-0", limit=80), device("gpu-1"))
    ahead = 1000.0
    await store.grant("early", [ask(0, "gpu-1", 1)], gpus, 0.0, LEASE_TTL_S)
    await store.sweep_expired(ahead)  # expired through 1000 s
    (lease,) = await store.grant("a", [ask(0, "gpu-0", 60)], gpus, 0.0, LEASE_TTL_S)
    assert lease.expires_at > ahead  # stamped at the store's time, not the clock's
    with pytest.raises(GrantRefused) as refused:
        await store.grant("b", [ask(0, "gpu-0", 60)], gpus, 0.0, LEASE_TTL_S)
    assert refused.value.details["committed_bytes"] == 60 * GIB
    (renewed,) = await store.renew("a", {0: 60 * GIB}, 5.0, LEASE_TTL_S)
    assert renewed.expires_at > ahead
    with pytest.raises(GrantRefused):
        await store.grant("b", [ask(0, "gpu-0", 60)], gpus, 10.0, LEASE_TTL_S)
    view = await store.ledger_view(10.0, ["gpu-0"])
    assert (view.devices["gpu-0"].committed_bytes, view.live_leases) == (60 * GIB, 1)
    # Its memory comes back once the store's time passes the renewed expiry.
    later = renewed.expires_at
    granted = await store.grant("b", [ask(0, "gpu-0", 60)], gpus, later, LEASE_TTL_S)
    assert await store.leases(later) == granted


async def test_release_one_rank_or_all(store: Store) -> None:
    gpus = devices(device("gpu-0"), device("gpu-1"))
    first, second = await store.grant(
        "e", [ask(0, "gpu-0", 20), ask(1, "gpu-1", 30)], gpus, 0.0, LEASE_TTL_S
    )
    other = await store.grant("other", [ask(0, "gpu-0", 10)], gpus, 0.0, LEASE_TTL_S)
    assert await store.release("e", 1, 1.0) == (second,)
    assert await store.release("e", 1, 1.0) == ()
    assert await store.leases(1.0) == (first, *other)
    assert await store.release("e", None, 1.0) == (first,)
    assert await store.leases(1.0) == other
    # An expired lease is deleted but not reported: it held nothing any more.
    assert await store.release("other", None, 100.0) == ()
    assert await store.sweep_expired(100.0) == ()


async def test_an_expired_lease_counts_for_nothing(store: Store) -> None:
    gpus = devices(device("gpu-0", limit=90))
    (lease,) = await store.grant("a", [ask(0, "gpu-0", 60)], gpus, 0.0, LEASE_TTL_S)
    with pytest.raises(GrantRefused):
        await store.grant("b", [ask(0, "gpu-0", 60)], gpus, LEASE_TTL_S - 0.5, LEASE_TTL_S)
    assert await store.leases(LEASE_TTL_S - 0.5) == (lease,)
    assert await store.leases(LEASE_TTL_S) == ()  # live while expires_at > now
    granted = await store.grant("b", [ask(0, "gpu-0", 60)], gpus, LEASE_TTL_S, LEASE_TTL_S)
    assert await store.leases(LEASE_TTL_S) == granted


async def test_sweep_expired_deletes_and_returns_the_dead(store: Store) -> None:
    gpus = devices(device("gpu-0"), device("gpu-1"))
    (early,) = await store.grant("early", [ask(0, "gpu-0", 10)], gpus, 0.0, LEASE_TTL_S)
    late = await store.grant("late", [ask(0, "gpu-1", 10), ask(1, "gpu-0", 10)], gpus, 20.0, 30.0)
    assert await store.sweep_expired(LEASE_TTL_S - 1) == ()
    assert await store.sweep_expired(40.0) == (early,)
    assert await store.sweep_expired(40.0) == ()
    assert await store.leases(40.0) == late
    assert await store.sweep_expired(60.0) == late


# --- the lease quota: checked inside the grant, exact for grants at once ---------------


async def ledger_state(store: Store, now: float, identity: str) -> tuple[object, ...]:
    """What a refusal must leave unchanged: the live leases and the ledger's totals
    (per device, everyone's and the identity's live leases)."""
    view = await store.ledger_view(now, ["gpu-0", "gpu-1"], identity=identity)
    return await store.leases(now), view


async def test_the_lease_quota_refuses_past_the_bound(store: Store) -> None:
    gpus = devices(device("gpu-0"), device("gpu-1"))

    async def grant(engine_id: str, ranks: int, identity: str = "alice") -> tuple[Lease, ...]:
        requests = [ask(rank, f"gpu-{rank % 2}", 1) for rank in range(ranks)]
        return await store.grant(
            engine_id, requests, gpus, 0.0, LEASE_TTL_S, identity, max_identity_leases=3
        )

    assert len(await grant("a1", 2)) == 2
    assert len(await grant("a2", 1)) == 1  # 2 + 1: at the bound, granted
    with pytest.raises(TooManyLeases) as refused:
        await grant("a3", 1)  # other engines of the identity count
    assert (refused.value.held, refused.value.wanted, refused.value.limit) == (3, 1, 3)
    # Another identity has a quota of its own.
    assert len(await grant("b1", 3, identity="bob")) == 3
    # The engine's own leases are replaced by its grant: they do not count.
    assert len(await grant("a1", 2)) == 2
    with pytest.raises(TooManyLeases) as refused:
        await grant("a1", 3)
    assert (refused.value.held, refused.value.wanted) == (1, 3)  # a2's one lease
    # Without a quota (None), nothing is counted.
    await store.grant("a4", [ask(0, "gpu-0", 1)], gpus, 0.0, LEASE_TTL_S, "alice")
    view = await store.ledger_view(0.0, ["gpu-0"], identity="alice")
    assert (view.identity_leases, view.live_leases) == (4, 7)
    # An empty grant asks for nothing new (it drops the engine's leases): never refused.
    assert await store.grant("a1", [], gpus, 0.0, LEASE_TTL_S, "alice", max_identity_leases=0) == ()
    assert len(await store.leases(0.0)) == 5


async def test_a_grant_refused_by_the_quota_changes_nothing(store: Store) -> None:
    gpus = devices(device("gpu-0"), device("gpu-1"))
    await store.grant(
        "a1", [ask(0, "gpu-0", 10), ask(1, "gpu-1", 10)], gpus, 0.0, LEASE_TTL_S, "alice"
    )
    await store.grant("a2", [ask(0, "gpu-0", 10)], gpus, 0.0, LEASE_TTL_S, "alice")
    before = await ledger_state(store, 1.0, "alice")
    for engine_id, requests in (
        ("a3", [ask(0, "gpu-1", 10)]),  # a new engine
        ("a1", [ask(0, "gpu-0", 5), ask(1, "gpu-1", 5), ask(2, "gpu-1", 5)]),  # a re-plan
        ("a3", [ask(0, "gpu-0", 200)]),  # over the device too: the quota is checked first
    ):
        with pytest.raises(TooManyLeases):
            await store.grant(
                engine_id, requests, gpus, 1.0, LEASE_TTL_S, "alice", max_identity_leases=3
            )
        assert await ledger_state(store, 1.0, "alice") == before
    # a1 keeps its old leases: it renews them, and they expire as granted.
    assert len(await store.renew("a1", {}, 2.0, LEASE_TTL_S)) == 2
    assert [lease.engine_id for lease in await store.sweep_expired(LEASE_TTL_S)] == ["a2"]


async def test_expired_leases_do_not_count_against_the_quota(store: Store) -> None:
    gpus = devices(device("gpu-0"))
    short = [ask(0, "gpu-0", 1), ask(1, "gpu-0", 1)]
    await store.grant("short", short, gpus, 0.0, 10.0, "alice", max_identity_leases=3)
    await store.grant("long", [ask(0, "gpu-0", 1)], gpus, 0.0, 60.0, "alice", max_identity_leases=3)
    with pytest.raises(TooManyLeases):
        await store.grant("new", short, gpus, 9.5, 60.0, "alice", max_identity_leases=3)
    # At 10.0 "short" has expired (expires_at == now), never released nor swept: the
    # grant's own expiry takes it out of the count first.
    granted = await store.grant("new", short, gpus, 10.0, 60.0, "alice", max_identity_leases=3)
    assert len(granted) == 2
    assert {lease.engine_id for lease in await store.leases(10.0)} == {"long", "new"}


async def test_without_an_identity_every_live_lease_counts(store: Store) -> None:
    """A server without authentication grants for "": one identity makes every
    call there, so the quota bounds all live leases, whoever holds them."""
    gpus = devices(device("gpu-0"))
    two = [ask(0, "gpu-0", 1), ask(1, "gpu-0", 1)]
    await store.grant("bob-1", two, gpus, 0.0, LEASE_TTL_S, "bob", max_identity_leases=3)
    await store.grant("x", [ask(0, "gpu-0", 1)], gpus, 0.0, LEASE_TTL_S, max_identity_leases=3)
    with pytest.raises(TooManyLeases) as refused:
        await store.grant("y", [ask(0, "gpu-0", 1)], gpus, 0.0, LEASE_TTL_S, max_identity_leases=3)
    assert refused.value.held == 3
    # An authenticated identity counts only its own.
    await store.grant("a", two, gpus, 0.0, LEASE_TTL_S, "alice", max_identity_leases=3)
    # 5 live now; x's own lease does not count for "" either: 4 + 2 fit in 6.
    assert len(await store.grant("x", two, gpus, 0.0, LEASE_TTL_S, max_identity_leases=6)) == 2


async def test_the_lease_quota_is_exact_for_grants_at_once(store: Store) -> None:
    gpus = devices(device("gpu-0"), device("gpu-1"))

    async def grant(engine: int) -> bool:
        requests = [ask(0, f"gpu-{engine % 2}", 1)]
        try:
            await store.grant(
                f"e{engine}", requests, gpus, 0.0, LEASE_TTL_S, "alice", max_identity_leases=5
            )
        except TooManyLeases:
            return False
        return True

    granted = await asyncio.gather(*(grant(engine) for engine in range(20)))
    assert sum(granted) == 5
    assert len(await store.leases(0.0)) == 5
    view = await store.ledger_view(0.0, ["gpu-0", "gpu-1"], identity="alice")
    assert view.identity_leases == view.live_leases == 5


async def test_totals_stay_exact_through_many_renewals_and_expiries(store: Store) -> None:
    """Heartbeats replace each lease many times over (and leave stale expiry entries
    behind in the memory store); the totals still equal the recount at every step."""
    gpus = devices(device("gpu-0"), device("gpu-1"))
    now = 0.0
    for index in range(6):
        uuid_ = f"gpu-{index % 2}"
        await store.grant(f"e{index}", [ask(0, uuid_, 1), ask(1, uuid_, 2)], gpus, now, 10.0)
    for beat in range(60):
        now += 1.0
        # e0..e2 keep beating (allocations vary); e3..e5 stop after 20 beats and expire.
        for index in range(6 if beat < 20 else 3):
            await store.renew(f"e{index}", {beat % 2: (beat % 3) * GIB}, now, 10.0)
        view = await store.ledger_view(now, ["gpu-0", "gpu-1"], identity="")
        live = await store.leases(now)
        recount = tally(live)
        assert view.devices == {u: recount.get(u, NOTHING) for u in ("gpu-0", "gpu-1")}
        assert view.live_leases == view.identity_leases == len(live)
        if beat % 7 == 0:
            await store.sweep_expired(now)
    assert {lease.engine_id for lease in await store.leases(now)} == {"e0", "e1", "e2"}
    assert len(await store.sweep_expired(now)) == 0  # the dead were swept on the way
    assert await store.leases(now + 100) == ()
    assert (await store.ledger_view(now + 100, ["gpu-0", "gpu-1"])).live_leases == 0


# --- Hypothesis: same answers as the reference ---------------------------------------

LEDGER_DEVICES = {
    "gpu-0": DeviceState("gpu-0", total_bytes=100, free_bytes=100, commit_limit_bytes=80),
    "gpu-1": DeviceState("gpu-1", total_bytes=100, free_bytes=100, commit_limit_bytes=100),
}
ENGINES = ("a", "b", "c")
IDENTITY_OF = {"a": "alice", "b": "bob", "c": "alice"}  # whose quota each engine's leases use

lease_requests = st.lists(
    st.builds(
        LeaseRequest,
        rank=st.integers(0, 2),
        device_uuid=st.sampled_from(sorted(LEDGER_DEVICES)),
        bytes=st.sampled_from([30, 40, 50, 10, 20]),
        in_use_bytes=st.sampled_from([0, 0, 5, 10, 60]),
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda request: request.rank,
)
ledger_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("grant"),
            st.sampled_from(ENGINES),
            lease_requests,
            st.sampled_from([100, 100, 50, 20]),  # what the probe reads as free on every device
            st.sampled_from([None, 4, 3, 2]),  # the lease quota (alice's two engines meet it)
        ),
        st.tuples(
            st.just("renew"),
            st.sampled_from(ENGINES),
            st.dictionaries(st.integers(0, 2), st.sampled_from([0, 10, 50]), max_size=2),
        ),
        st.tuples(
            st.just("release"), st.sampled_from(ENGINES), st.one_of(st.none(), st.integers(0, 2))
        ),
        st.tuples(st.just("advance"), st.sampled_from([5.0, 15.0, 31.0])),
        st.tuples(st.just("sweep")),
    ),
    min_size=4,
    max_size=14,
)


def outcome_of_error(error: Exception) -> tuple[object, ...]:
    """What a caller sees of a refusal: everything but the object's identity."""
    if isinstance(error, GrantRefused):
        return ("GrantRefused", error.grant_reason, error.message, error.details)
    if isinstance(error, TooManyLeases):
        return ("TooManyLeases", error.held, error.wanted, error.limit)
    if isinstance(error, ServiceError):
        return ("ServiceError", error.code, error.message, error.field, error.details)
    raise error


async def run_ledger(store: Store, ops: list[tuple[Any, ...]]) -> list[object]:
    """Apply `ops`; every call's outcome and the live leases after it."""
    now = 1000.0
    trace: list[object] = []
    for op in ops:
        result: object
        try:
            match op:
                case ("grant", engine_id, requests, free, quota):
                    seen = {
                        uuid_: DeviceState(uuid_, state.total_bytes, free, state.commit_limit_bytes)
                        for uuid_, state in LEDGER_DEVICES.items()
                    }
                    holder = IDENTITY_OF[engine_id]
                    result = await store.grant(
                        engine_id,
                        requests,
                        seen,
                        now,
                        30.0,
                        holder,
                        max_identity_leases=quota,
                    )
                    held = sum(lease.identity == holder for lease in await store.leases(now))
                    assert quota is None or held <= quota
                case ("renew", engine_id, allocations):
                    result = await store.renew(engine_id, allocations, now, 30.0)
                case ("release", engine_id, rank):
                    result = await store.release(engine_id, rank, now)
                case ("advance", seconds):
                    now += seconds
                    result = now
                case ("sweep",):
                    result = await store.sweep_expired(now)
        except (GrantRefused, TooManyLeases, ServiceError) as error:
            result = outcome_of_error(error)
        live = await store.leases(now)
        for uuid_, state in LEDGER_DEVICES.items():
            # The ledger's promise: never more committed than the commit limit.
            assert committed(live, uuid_) <= state.commit_limit_bytes
        # The store's totals are the recount of its live leases, with or without an
        # engine's own, per device and per identity.
        for engine_id in ("", *ENGINES):
            for identity in sorted(set(IDENTITY_OF.values())):
                view = await store.ledger_view(
                    now, sorted(LEDGER_DEVICES), engine_id=engine_id, identity=identity
                )
                others = [lease for lease in live if lease.engine_id != engine_id]
                recount = tally(others)
                assert view.devices == {u: recount.get(u, NOTHING) for u in LEDGER_DEVICES}
                assert view.live_leases == len(others)
                assert view.identity_leases == sum(lease.identity == identity for lease in others)
        trace.append((op[0], result, live))
    return trace


rendezvous_joins = st.tuples(
    st.just("join"),
    st.sampled_from(["x", "x", "y"]),
    st.integers(0, 1),
    st.sampled_from([2, 2, 2, 1]),  # world size, mostly the agreed one
    st.sampled_from([b"t", b"t", b"other"]),  # template
    st.sampled_from([b"", b"", b"-changed"]),  # worker spec variant
)
rendezvous_ops = st.lists(
    st.one_of(
        rendezvous_joins,
        rendezvous_joins,  # joins twice as often as the rest
        st.tuples(st.just("leave"), st.sampled_from(["x", "y"]), st.integers(0, 1)),
        st.tuples(st.just("finish"), st.sampled_from(["x", "y"]), st.booleans(), st.booleans()),
        st.tuples(st.just("advance"), st.sampled_from([0.0, 4.0, 6.0, 700.0])),
    ),
    min_size=4,
    max_size=16,
)


async def run_rendezvous(store: Store, ops: list[tuple[Any, ...]]) -> list[object]:
    heard: list[tuple[str, RendezvousResult]] = []
    store.subscribe(lambda engine_id, result: heard.append((engine_id, result)))
    now = 1000.0
    trace: list[object] = []
    for step, op in enumerate(ops):
        result: object = None
        try:
            match op:
                case ("join", engine_id, rank, world_size, template, variant):
                    result = await join(
                        store,
                        engine_id,
                        rank,
                        world_size=world_size,
                        template=template,
                        worker=f"worker-{rank}".encode() + variant,
                        now=now,
                        max_pending=1,
                        claim_timeout_s=5.0,
                    )
                case ("leave", engine_id, rank):
                    await store.rendezvous_leave(engine_id, rank)
                case ("finish", engine_id, ok, remember):
                    outcome = RendezvousResult(ok, f"result-{step}".encode())
                    await store.rendezvous_finish(
                        engine_id, outcome, now, remember_failure=remember
                    )
                case ("advance", seconds):
                    now += seconds
        except ServiceError as error:
            result = outcome_of_error(error)
        trace.append((op[0], result, await store.pending_engines(), list(heard)))
    return trace


plan_ops = st.lists(st.tuples(st.sampled_from(["", "e0", "e1"]), st.integers(0, 2)), max_size=12)


async def run_plans(store: Store, ops: list[tuple[str, int]]) -> list[object]:
    trace: list[object] = []
    ids = [f"{engine}-{n}" for engine in ("", "e0", "e1") for n in range(3)]
    for step, (engine_id, n) in enumerate(ops):
        # A plan id stands for one request, so for one engine.
        await store.put_plan(f"{engine_id}-{n}", engine_id, f"plan-{step}".encode(), step)
        trace.append(
            (
                [await store.get_plan(plan_id) for plan_id in ids],
                [await store.plan_for_engine(e) for e in ("", "e0", "e1")],
            )
        )
    return trace


Runner = Callable[[Store, list[Any]], Awaitable[list[object]]]


def agree_with_memory(
    backend: str, redis_url: str | None, runner: Runner, ops: list[Any], max_plans: int = 4096
) -> None:
    async def both() -> None:
        with tempfile.TemporaryDirectory() as directory:
            reference = MemoryStore(max_plans=max_plans)
            candidate = new_store(backend, Path(directory), redis_url, max_plans)
            await candidate.start()
            try:
                expected = await runner(reference, ops)
                assert await runner(candidate, ops) == expected
            finally:
                await candidate.close()

    asyncio.run(both())


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def candidate(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """A backend compared with memory, and its Redis URL."""
    if request.param == "redis":
        return "redis", request.getfixturevalue("redis_server").url
    return "sqlite", None


@FAST
@given(ops=ledger_ops)
def test_ledger_sequences_agree_with_memory(
    candidate: tuple[str, str | None], ops: list[tuple[Any, ...]]
) -> None:
    agree_with_memory(*candidate, run_ledger, ops)


@FAST
@given(ops=rendezvous_ops)
def test_rendezvous_sequences_agree_with_memory(
    candidate: tuple[str, str | None], ops: list[tuple[Any, ...]]
) -> None:
    agree_with_memory(*candidate, run_rendezvous, ops)


@FAST
@given(ops=plan_ops)
def test_plan_sequences_agree_with_memory(
    candidate: tuple[str, str | None], ops: list[tuple[str, int]]
) -> None:
    agree_with_memory(*candidate, run_plans, ops, max_plans=3)


# --- Redis: what only several replicas show --------------------------------------------


@pytest_asyncio.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    prefix = f"test-{uuid.uuid4().hex}:"
    first, second = (
        RedisStore(redis_server.url, key_prefix=prefix),
        RedisStore(redis_server.url, key_prefix=prefix),
    )
    await first.start()
    await second.start()
    await wait_for_listeners(first, 2)
    yield first, second
    await first.close()
    await second.close()


async def test_a_finish_reaches_every_replica_once(
    replicas: tuple[RedisStore, RedisStore],
) -> None:
    first, second = replicas
    heard: dict[str, list[tuple[str, RendezvousResult]]] = {"first": [], "second": []}
    first.subscribe(lambda engine_id, result: heard["first"].append((engine_id, result)))
    second.subscribe(lambda engine_id, result: heard["second"].append((engine_id, result)))
    await join(first, "e", 0)
    assert (await join(second, "e", 1)).state == "plan"  # the ranks met across replicas
    planned = RendezvousResult(True, b"plan")
    await second.rendezvous_finish("e", planned, 1.0)
    assert heard["second"] == [("e", planned)]  # delivered at once on the finishing replica
    for _ in range(200):
        if heard["first"]:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # room for a duplicate to show up
    assert heard == {"first": [("e", planned)], "second": [("e", planned)]}
    assert await join(first, "e", 0, now=2.0) == Arrival("finished", result=planned)


async def test_ranks_arriving_at_once_on_two_replicas_meet(
    replicas: tuple[RedisStore, RedisStore],
) -> None:
    # Each engine's ranks alternate between the replicas; more calls at once than
    # either replica has connections.
    outcomes = await arrive_at_once(replicas, engines=40, world_size=4)
    claimed = sorted(
        engine_id
        for engine_id, _, arrival in outcomes
        if isinstance(arrival, Arrival) and arrival.state == "plan"
    )
    assert claimed == sorted(f"e{engine}" for engine in range(40))
    assert all(isinstance(arrival, Arrival) for _, _, arrival in outcomes)
    assert await replicas[0].pending_engines() == 0

    async def first_rank(engine: int) -> Arrival | ServiceError:
        try:
            return await join(replicas[engine % 2], f"new-{engine}", 0, max_pending=5)
        except ServiceError as refusal:
            return refusal

    # The pending limit is one count for all replicas, exact at once.
    opened = await asyncio.gather(*(first_rank(engine) for engine in range(30)))
    assert sum(isinstance(outcome, Arrival) for outcome in opened) == 5
    assert await replicas[1].pending_engines() == 5


async def test_replicas_share_one_ledger(replicas: tuple[RedisStore, RedisStore]) -> None:
    first, second = replicas
    gpus = devices(device("gpu-0", limit=90))
    granted = await first.grant("a", [ask(0, "gpu-0", 60)], gpus, 0.0, LEASE_TTL_S)
    assert await second.leases(0.0) == granted
    with pytest.raises(GrantRefused):
        await second.grant("b", [ask(0, "gpu-0", 40)], gpus, 0.0, LEASE_TTL_S)
    await second.renew("a", {0: 60 * GIB}, 10.0, LEASE_TTL_S)
    assert (await first.leases(LEASE_TTL_S + 5))[0].allocated_bytes == 60 * GIB


async def test_the_lease_quota_is_exact_for_grants_at_once_on_two_replicas(
    replicas: tuple[RedisStore, RedisStore],
) -> None:
    gpus = devices(device("gpu-0"))

    async def grant(engine: int) -> bool:
        try:
            await replicas[engine % 2].grant(
                f"e{engine}", [ask(0, "gpu-0", 1)], gpus, 0.0, LEASE_TTL_S, "alice",
                max_identity_leases=5,
            )  # fmt: skip
        except TooManyLeases:
            return False
        return True

    granted = await asyncio.gather(*(grant(engine) for engine in range(20)))
    assert sum(granted) == 5
    assert len(await replicas[1].leases(0.0)) == 5


# The ledger's keys once a lease is granted on gpu-0; "ledger:expired-through" joins
# them when a lease first falls due.
LEDGER_KEYS = (
    "lease-expiry",
    "lease-device:gpu-0",
    "ledger:committed",
    "ledger:outstanding",
    "ledger:live",
    "ledger:identity",
)


async def test_redis_drops_a_dead_engines_leases_by_itself(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, key_prefix=f"test-{uuid.uuid4().hex}:", expiry_grace_s=0.0)
    await store.start()
    try:
        client = store._redis()
        gpus = devices(device("gpu-0"))
        ledger = [store._key(name) for name in (*LEDGER_KEYS, "ledger:expired-through")]
        # Alone: the engine's hash and the ledger's index and totals all go.
        await store.grant("e", [ask(0, "gpu-0", 10)], gpus, 0.0, 0.3)
        for key in (store._lease_key("e"), *ledger[:-1]):
            assert 0 < await client.pttl(key) <= 300, key
        await asyncio.sleep(0.5)
        assert not await client.exists(store._lease_key("e"), *ledger)  # gone from Redis itself
        assert await store.sweep_expired(1.0) == ()
        # Next to a longer lease: only the engine's hash goes; the index still holds
        # the dead lease's share, so the totals stay exact and the sweep drops it.
        (kept,) = await store.grant("long", [ask(0, "gpu-0", 20)], gpus, 1.0, 60.0)
        await store.grant("f", [ask(0, "gpu-0", 10)], gpus, 1.0, 0.3)
        await asyncio.sleep(0.5)
        assert not await client.exists(store._lease_key("f"))
        view = await store.ledger_view(2.0, ["gpu-0"])
        assert (view.devices["gpu-0"].committed_bytes, view.live_leases) == (20 * GIB, 1)
        assert await client.pttl(store._key("ledger:expired-through")) > 0  # as the index's
        assert await store.sweep_expired(2.0) == ()  # its hash is gone: nothing to report
        assert await client.zcard(store._key("lease-expiry")) == 1
        assert await store.leases(2.0) == (kept,)
    finally:
        await store.close()


async def test_result_sizes_left_by_an_earlier_release_are_recounted(
    redis_server: RedisServer,
) -> None:
    """A replica of an earlier release forgets results by their TTL without their
    sizes. Their bytes must not stay in the sum: past the bound it is recounted from
    the results still kept, and the new ones are kept as before."""
    store = RedisStore(redis_server.url, key_prefix=f"test-{uuid.uuid4().hex}:")
    await store.start()
    try:
        client = store._redis()
        size = kept_result_bytes("e0", 1000, ranks=1)
        bound = 2 * size + 100  # room for two
        for index in range(3):
            engine = f"e{index}"
            await join(store, engine, 0, world_size=1, now=float(index))
            plan = random.Random(index).randbytes(1000)
            await store.rendezvous_finish(
                engine, RendezvousResult(True, plan), float(index), max_kept_bytes=bound
            )
        # What an earlier release's forgetting does: the result goes, its size stays.
        for engine in ("e1", "e2"):
            await client.zrem(store._key("rdv:done"), engine)
            await client.delete(store._done_key(engine))
        await join(store, "new", 0, world_size=1, now=5.0)
        plan = random.Random("new").randbytes(1000)
        await store.rendezvous_finish(
            "new", RendezvousResult(True, plan), 5.0, max_kept_bytes=bound
        )
        assert (await join(store, "new", 0, world_size=1, now=6.0)).state == "finished"
        assert await client.get(store._key("rdv:done-bytes")) == str(size - 2 + 3).encode()
        assert set(await client.hkeys(store._key("rdv:done-size"))) == {b"new"}
    finally:
        await store.close()


async def test_owners_of_the_layout_before_the_engine_bound_count(
    redis_server: RedisServer,
) -> None:
    """Owner keys a server before --max-engines-per-identity left (no per-identity
    index): a new server indexes them once at start, so they count for their owner."""
    prefix = f"test-{uuid.uuid4().hex}:"
    old = RedisStore(redis_server.url, key_prefix=prefix)
    await old.start()
    client = old._redis()
    for engine_id in ("a1", "a2"):
        await client.set(prefix + "owner:" + engine_id, "team-a", px=600_000)
    await client.set(prefix + "owner:b1", "team-b", px=600_000)
    await client.delete(prefix + "owners-indexed")
    await old.close()
    store = RedisStore(redis_server.url, key_prefix=prefix)
    await store.start()
    try:
        now = time.time()
        with pytest.raises(TooManyEngines) as refused:
            await store.claim_engine("a3", "team-a", now, TTL_S, 2)
        assert refused.value.held == 2
        assert await store.claim_engine("a1", "team-a", now, TTL_S, 2) == "team-a"
        assert await store.claim_engine("b2", "team-b", now, TTL_S, 2) == "team-b"
        assert await store._redis().pttl(prefix + "owned:team-b") > 0  # goes with its records
        # A second start indexes nothing again.
        again = RedisStore(redis_server.url, key_prefix=prefix)
        await again.start()
        assert await again._redis().zcard(prefix + "owned:team-a") == 2
        await again.close()
    finally:
        await store.close()


async def test_leases_of_the_layout_before_the_totals_are_kept_and_counted(
    redis_server: RedisServer,
) -> None:
    """What a server before the ledger's totals left in Redis: one hash per engine
    with [device_uuid, bytes, allocated_bytes, granted_at, expires_at] per rank, and
    the set of engines. A new server converts it at start and counts it."""
    prefix = f"test-{uuid.uuid4().hex}:"
    old = RedisStore(redis_server.url, key_prefix=prefix)
    await old.start()
    client = old._redis()
    await client.hset(
        prefix + "lease:a",
        mapping={"0": f'["gpu-0",{30 * GIB},{10 * GIB},0.0,100.0]', "1": '["gpu-1",5,5,0.0,50.0]'},
    )
    await client.hset(prefix + "lease:b", mapping={"0": f'["gpu-0",{20 * GIB},0,0.0,300.0]'})
    await client.sadd(prefix + "lease-engines", "a", "b")
    await client.set(prefix + "owner:a", "team-a")
    await old.close()
    store = RedisStore(redis_server.url, key_prefix=prefix)
    await store.start()
    try:
        client = store._redis()
        assert not await client.exists(prefix + "lease-engines")
        assert [
            (lease.engine_id, lease.rank, lease.identity) for lease in await store.leases(60.0)
        ] == [
            ("a", 0, "team-a"),
            ("b", 0, ""),
        ]
        view = await store.ledger_view(60.0, ["gpu-0", "gpu-1"], identity="team-a")
        assert view.devices["gpu-0"] == Totals(50 * GIB, 40 * GIB, 2)
        assert view.devices["gpu-1"] == NOTHING  # expired at 50
        assert (view.live_leases, view.identity_leases) == (2, 1)
        renewed = await store.renew("a", {0: 30 * GIB}, 60.0, LEASE_TTL_S)
        assert [lease.rank for lease in renewed] == [0]
        view = await store.ledger_view(60.0, ["gpu-0"])
        assert view.devices["gpu-0"] == Totals(50 * GIB, 20 * GIB, 2)
        # A second start finds nothing left to convert.
        again = RedisStore(redis_server.url, key_prefix=prefix)
        await again.start()
        assert await again.ledger_view(60.0, ["gpu-0"]) == view
        await again.close()
    finally:
        await store.close()


async def test_every_key_lives_under_the_prefix(redis_server: RedisServer) -> None:
    prefix = f"test-{uuid.uuid4().hex}:"
    store = RedisStore(redis_server.url, key_prefix=prefix)
    await store.start()
    try:
        await store.put_plan("p", "e", b"plan", 0.0)
        await join(store, "e", 0, world_size=1)
        await store.rendezvous_finish("e", RendezvousResult(True, b"plan"), 0.0)
        await join(store, "f", 0)
        await store.grant("e", [ask(0, "gpu-0", 10)], devices(device("gpu-0")), 0.0, 60.0)
        # "e" holds leases of no identity: never adopted (owner records of "g").
        assert await store.claim_engine("e", "team-a", 0.0, 60.0, 16) == ""
        await store.claim_engine("g", "team-a", 0.0, 60.0, 16)
        keys = {key.decode() async for key in store._redis().scan_iter(match=prefix + "*")}
        assert {key.removeprefix(prefix) for key in keys} == {
            "plans",
            "plans-seq",
            "plans-bytes",
            "plan:p",
            "plan-body:" + hashlib.sha256(b"plan").hexdigest(),
            "engine-plan:e",
            "rdv:open",
            "rdv:open:f",
            "rdv:open-of:",  # the engines waiting of identity "" (no authentication)
            "rdv:done",
            "rdv:done:e",
            "rdv:done-size",
            "rdv:done-bytes",
            "lease:e",
            "lease-version",
            *LEDGER_KEYS,
            "owner:g",
            "owned:team-a",
            "owners-indexed",  # one marker, kept
            "epoch",  # kept: its loss is how a Redis that lost its data is found
            "epoch:" + store._epoch,
        }
        for janitored in (
            "rdv:open:f",
            "rdv:open-of:",
            "rdv:done:e",
            "lease:e",
            *LEDGER_KEYS,
            "owner:g",
            "owned:team-a",
        ):
            assert await store._redis().pttl(prefix + janitored) > 0  # Redis expires them too
    finally:
        await store.close()
