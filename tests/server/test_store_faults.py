"""The stores under stress and failure: replicas racing for the last bytes of a
device, a server killed mid-life, Redis going away and coming back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplan.core.ledger import DeviceState, GrantRefused, Lease, LeaseRequest
from kvplan.server.store import StoreUnavailable
from kvplan.server.store import sqlite as sqlite_store
from kvplan.server.store.base import Arrival, RendezvousResult
from kvplan.server.store.redis import RedisStore
from kvplan.server.store.sqlite import SQLiteStore
from tests.server.redis_server import RedisServer, running_redis, wait_for_listeners

GIB = 1 << 30
REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_GIB = 60  # held by another engine before every trial


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def contested_device(trial: int) -> tuple[dict[str, DeviceState], str]:
    """A device on which one more 20 GiB lease fits next to the base lease, two
    do not; even trials are bound by the commit limit, odd ones by free memory
    (the base lease is not allocated yet, so its 60 GiB are still outstanding)."""
    if trial % 2 == 0:
        state, bound = DeviceState("gpu", 100 * GIB, 100 * GIB, 90 * GIB), "commit_limit"
    else:
        state, bound = DeviceState("gpu", 200 * GIB, 85 * GIB, 200 * GIB), "free_memory"
    return {"gpu": state}, bound


def last_bytes(rank: int = 0) -> list[LeaseRequest]:
    return [LeaseRequest(rank, "gpu", 20 * GIB)]


def committed(leases: tuple[Lease, ...]) -> int:
    return sum(lease.bytes for lease in leases if lease.device_uuid == "gpu")


# --- races -----------------------------------------------------------------------------


async def test_two_redis_replicas_race_for_the_last_bytes(redis_server: RedisServer) -> None:
    prefix = f"race-{uuid.uuid4().hex}:"
    first = RedisStore(redis_server.url, key_prefix=prefix)
    second = RedisStore(redis_server.url, key_prefix=prefix)
    await first.start()
    await second.start()
    try:
        base_devices, _ = contested_device(0)
        await first.grant("base", [LeaseRequest(0, "gpu", BASE_GIB * GIB)], base_devices, 0.0, 1e6)
        for trial in range(1000):
            gpus, bound = contested_device(trial)
            now = float(trial)
            contenders = [(first, f"a{trial}"), (second, f"b{trial}")]
            if trial % 4 >= 2:
                contenders.reverse()  # neither replica always goes first
            outcomes = await asyncio.gather(
                *(store.grant(name, last_bytes(), gpus, now, 30.0) for store, name in contenders),
                return_exceptions=True,
            )
            granted = [outcome for outcome in outcomes if isinstance(outcome, tuple)]
            refused = [outcome for outcome in outcomes if isinstance(outcome, GrantRefused)]
            assert len(granted) == 1 and len(refused) == 1, (trial, outcomes)
            assert refused[0].grant_reason == bound
            live = await second.leases(now)
            assert committed(live) == (BASE_GIB + 20) * GIB
            await first.release(granted[0][0].engine_id, None, now)
        # The race was real: EXECs lost to the other replica's and were re-decided.
        retries = first.transaction_retries + second.transaction_retries
        assert retries > 100
    finally:
        await first.close()
        await second.close()


def test_two_sqlite_connections_race_from_two_threads(tmp_path: Path) -> None:
    path = str(tmp_path / "kvplan.sqlite3")
    trials = 1000

    async def grant_base() -> None:
        store = SQLiteStore(path)
        await store.start()
        base_devices, _ = contested_device(0)
        await store.grant("base", [LeaseRequest(0, "gpu", BASE_GIB * GIB)], base_devices, 0, 1e9)
        await store.close()

    asyncio.run(grant_base())
    barrier = threading.Barrier(2, timeout=30)
    won: dict[str, list[bool]] = {"a": [], "b": []}
    most_committed: list[int] = []
    failures: list[BaseException] = []

    async def replica(name: str) -> None:
        store = SQLiteStore(path)  # its own connection to the shared file
        await store.start()
        try:
            for trial in range(trials):
                gpus, bound = contested_device(trial)
                # 10 s apart with 5 s leases: the previous trial's winner is expired.
                now = trial * 10.0
                barrier.wait()
                try:
                    await store.grant(f"{name}{trial}", last_bytes(), gpus, now, 5.0)
                    won[name].append(True)
                except GrantRefused as refused:
                    assert refused.grant_reason == bound
                    won[name].append(False)
                most_committed.append(committed(await store.leases(now)))
        finally:
            await store.close()

    def run(name: str) -> None:
        try:
            asyncio.run(replica(name))
        except BaseException as error:
            failures.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(name,)) for name in won]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert [a != b for a, b in zip(won["a"], won["b"], strict=True)] == [True] * trials
    assert max(most_committed) <= (BASE_GIB + 20) * GIB


# --- SQLite: a killed server ---------------------------------------------------------

_CHILD = """
import asyncio, sys
from kvplan.core.ledger import DeviceState, LeaseRequest
from kvplan.server.store.sqlite import SQLiteStore

GIB = 1 << 30

async def main(path):
    store = SQLiteStore(path)
    await store.start()
    gpus = {"gpu": DeviceState("gpu", 100 * GIB, 100 * GIB, 90 * GIB)}
    await store.grant(
        "engine-a", [LeaseRequest(0, "gpu", 50 * GIB), LeaseRequest(1, "gpu", 10 * GIB)],
        gpus, 1000.0, 60.0,
    )
    await store.put_plan("plan-1", "engine-a", b"the plan", 1000.0)
    for rank in (0, 1):
        arrival = await store.rendezvous_join(
            engine_id="engine-r", world_size=2, template=b"template", rank=rank,
            worker=b"worker-%d" % rank, now=1000.0, ttl_s=600.0, max_pending=16,
            claim_timeout_s=600.0,
        )
    assert arrival.state == "plan", arrival  # claimed by this process, which dies
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1]))
"""


async def test_sqlite_state_survives_a_killed_server(tmp_path: Path) -> None:
    path = str(tmp_path / "state" / "kvplan.sqlite3")  # the parent is created on start
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, path], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        ready = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert ready == b"ready\n"
        assert Path(path + "-wal").stat().st_size > 0  # the commits are in the WAL
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    store = SQLiteStore(path)
    await store.start()
    try:
        held = [(lease.engine_id, lease.rank, lease.bytes) for lease in await store.leases(1001.0)]
        assert held == [
            ("engine-a", 0, 50 * GIB),
            ("engine-a", 1, 10 * GIB),
        ]
        assert await store.get_plan("plan-1") == b"the plan"
        assert await store.plan_for_engine("engine-a") == b"the plan"
        assert await store.pending_engines() == 1
        # The dead server's claim was cleared: the next rank plans at once,
        # though the claim timeout is far off.
        arrival = await store.rendezvous_join(
            engine_id="engine-r",
            world_size=2,
            template=b"template",
            rank=1,
            worker=b"worker-1",
            now=1001.0,
            ttl_s=600.0,
            max_pending=16,
            claim_timeout_s=600.0,
        )
        assert arrival == Arrival("plan", workers=(b"worker-0", b"worker-1"))
        gpus = {"gpu": DeviceState("gpu", 100 * GIB, 100 * GIB, 90 * GIB)}
        with pytest.raises(GrantRefused) as refused:
            await store.grant("engine-b", [LeaseRequest(0, "gpu", 40 * GIB)], gpus, 1001.0, 60.0)
        assert refused.value.grant_reason == "commit_limit"
        assert refused.value.details["committed_bytes"] == 60 * GIB
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def write_locked_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[SQLiteStore, sqlite3.Connection]]:
    """A started SQLite store whose file another connection holds the write lock of
    (as another process would); that connection's ROLLBACK frees it."""
    monkeypatch.setattr(sqlite_store, "BUSY_TIMEOUT_S", 0.05)
    path = str(tmp_path / "kvplan.sqlite3")
    store = SQLiteStore(path)
    await store.start()
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield store, other
    finally:
        other.close()
        await store.close()


async def test_a_locked_sqlite_file_is_unavailable_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with write_locked_sqlite(tmp_path, monkeypatch) as (store, other):
        gpus, _ = contested_device(0)
        with pytest.raises(StoreUnavailable, match="locked"):
            await store.grant("e", last_bytes(), gpus, 0.0, 30.0)
        assert await store.leases(0.0) == ()  # readers are not blocked (WAL)
        other.execute("ROLLBACK")
        assert len(await store.grant("e", last_bytes(), gpus, 0.0, 30.0)) == 1


async def sqlite_join(
    store: SQLiteStore, engine_id: str, rank: int, world_size: int = 3
) -> Arrival | Exception:
    try:
        return await store.rendezvous_join(
            engine_id=engine_id,
            world_size=world_size,
            template=b"template",
            rank=rank,
            worker=f"worker-{rank}".encode(),
            now=0.0,
            ttl_s=600.0,
            max_pending=16,
            claim_timeout_s=10.0,
        )
    except Exception as error:
        return error


async def together(store: SQLiteStore, *calls: Awaitable[Any]) -> list[Any]:
    """Run `calls` while the store thread is held busy, so that they queue up and
    its next hop takes them all into one transaction."""
    release = threading.Event()
    held = asyncio.get_running_loop().run_in_executor(store._executor, release.wait)
    gathered = asyncio.gather(*calls, return_exceptions=True)
    await asyncio.sleep(0.05)  # every call reaches the queue
    assert len(store._queued) == len(calls)
    release.set()
    await held
    return await gathered


async def test_a_fault_in_a_shared_sqlite_transaction_is_its_own(tmp_path: Path) -> None:
    """Ranks arriving together share a transaction; an operation that fails for
    another reason than a refusal fails alone, the others are committed."""
    store = SQLiteStore(str(tmp_path / "kvplan.sqlite3"))
    await store.start()

    def faulty(db: sqlite3.Connection) -> None:
        db.execute("DELETE FROM rendezvous_open")  # undone: the fault is its own
        raise RuntimeError("a fault")

    try:
        outcomes = await together(
            store,
            sqlite_join(store, "e", 0),
            store._in_shared_transaction(faulty),
            sqlite_join(store, "e", 1),
            sqlite_join(store, "f", 0),
        )
        assert outcomes[0] == outcomes[2] == outcomes[3] == Arrival("waiting")
        assert isinstance(outcomes[1], RuntimeError)
        assert await store.rendezvous_ranks("e") == (0, 1)
        assert await store.pending_engines() == 2
    finally:
        await store.close()


async def test_an_outage_fails_every_sqlite_operation_of_a_shared_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with write_locked_sqlite(tmp_path, monkeypatch) as (store, other):
        outcomes = await together(store, *(sqlite_join(store, "e", rank) for rank in range(3)))
        assert all(isinstance(outcome, StoreUnavailable) for outcome in outcomes), outcomes
        other.execute("ROLLBACK")
        assert await store.pending_engines() == 0  # nothing of them was written
        # The ranks retry and meet, in one transaction.
        outcomes = await together(store, *(sqlite_join(store, "e", rank) for rank in range(3)))
        assert sorted(o.state for o in outcomes if isinstance(o, Arrival)) == [
            "plan",
            "waiting",
            "waiting",
        ]


async def test_sqlite_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = str(tmp_path / "kvplan.sqlite3")
    store = SQLiteStore(path)
    await store.start()
    await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == sqlite_store.SCHEMA_VERSION
        db.execute(f"PRAGMA user_version = {sqlite_store.SCHEMA_VERSION + 1}")
    with pytest.raises(StoreUnavailable, match="schema version"):
        await SQLiteStore(path).start()


# --- Redis going away ------------------------------------------------------------------


async def test_replicas_ride_out_a_redis_restart(tmp_path: Path) -> None:
    # Append-only with an fsync per write: what Redis acknowledged survives its SIGKILL.
    with running_redis(tmp_path / "redis", appendonly=True) as server:
        prefix = f"restart-{uuid.uuid4().hex}:"
        first = RedisStore(server.url, key_prefix=prefix)
        second = RedisStore(server.url, key_prefix=prefix)
        await first.start()
        await second.start()
        try:
            heard: list[tuple[str, RendezvousResult]] = []
            first.subscribe(lambda engine_id, result: heard.append((engine_id, result)))
            gpus, _ = contested_device(0)
            granted = await first.grant("a", last_bytes(), gpus, 0.0, 60.0)

            server.stop(signal.SIGKILL)
            down = [
                first.ping(),
                first.grant("b", last_bytes(), gpus, 1.0, 60.0),
                first.renew("a", {}, 1.0, 60.0),
                first.release("a", None, 1.0),
                first.leases(1.0),
                first.sweep_expired(1.0),
                first.put_plan("p", "a", b"plan", 1.0),
                first.get_plan("p"),
                first.plan_for_engine("a"),
                first.pending_engines(),
                first.rendezvous_join(
                    engine_id="r",
                    world_size=1,
                    template=b"t",
                    rank=0,
                    worker=b"w",
                    now=1.0,
                    ttl_s=600.0,
                    max_pending=16,
                    claim_timeout_s=10.0,
                ),
                first.rendezvous_leave("r", 0),
                first.rendezvous_finish("r", RendezvousResult(True, b"plan"), 1.0),
            ]
            for call in down:
                with pytest.raises(StoreUnavailable):
                    await call
            assert heard == []  # a finish that did not happen is no news

            server.start()
            await first.ping()  # the same store, no restart: dead connections replaced
            assert await second.leases(2.0) == granted  # survived (appendfsync always)
            with pytest.raises(GrantRefused):
                await second.grant("b", [LeaseRequest(0, "gpu", 80 * GIB)], gpus, 2.0, 60.0)
            # Both listeners resubscribed: a finish on one replica reaches the other.
            await wait_for_listeners(first, 2)
            arrival = await second.rendezvous_join(
                engine_id="r",
                world_size=1,
                template=b"t",
                rank=0,
                worker=b"w",
                now=2.0,
                ttl_s=600.0,
                max_pending=16,
                claim_timeout_s=10.0,
            )
            assert arrival.state == "plan"
            planned = RendezvousResult(True, b"plan")
            await second.rendezvous_finish("r", planned, 2.0)
            for _ in range(300):
                if heard:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert heard == [("r", planned)]
        finally:
            await first.close()
            await second.close()


async def test_a_redis_store_that_cannot_connect_does_not_start() -> None:
    from tests.server.redis_server import free_port

    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(StoreUnavailable):
        await store.start()
    await store.close()
