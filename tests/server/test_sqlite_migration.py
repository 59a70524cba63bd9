"""Files of earlier schemas open under the current one with their state intact:
schema 1 (before engine ownership and failed rendezvous) keeps its finished
engines, schema 2 (before the ledger's totals) keeps its leases, now counted, and
its plans (stored whole, before plans of equal content shared their body);
schema 4 (before the per-identity counts of owned engines) keeps its owners,
now counted against --max-engines-per-identity; schema 6 (before finished
results were bounded by bytes) keeps its finished engines, now counted against
--rendezvous-result-bytes."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from kvplan.core.ledger import NOTHING, DeviceState, GrantRefused, LeaseRequest, Totals
from kvplan.server.errors import ServiceError
from kvplan.server.store import RendezvousResult, TooManyEngines
from kvplan.server.store.base import Arrival, kept_result_bytes
from kvplan.server.store.bodies import PlanParts
from kvplan.server.store.rules import digest
from kvplan.server.store.sqlite import CODEC_NONE, CODEC_ZLIB, SCHEMA_VERSION, SQLiteStore
from kvplan.v1 import plan_pb2
from tests.server.test_store_contract import join

V1_FINISHED = """
CREATE TABLE rendezvous_finished (
    engine_id TEXT PRIMARY KEY,
    template_digest BLOB NOT NULL,
    plan BLOB NOT NULL,
    finished REAL NOT NULL
);
CREATE TABLE rendezvous_finished_worker (
    engine_id TEXT NOT NULL REFERENCES rendezvous_finished (engine_id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    worker_digest BLOB NOT NULL,
    PRIMARY KEY (engine_id, rank)
) WITHOUT ROWID;
"""


async def test_a_schema_1_file_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "kvplan.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(V1_FINISHED)
        db.execute(
            "INSERT INTO rendezvous_finished VALUES (?, ?, ?, ?)",
            ("old", digest(b"template"), b"old plan", 0.0),
        )
        db.execute(
            "INSERT INTO rendezvous_finished_worker VALUES (?, ?, ?)",
            ("old", 0, digest(b"worker-0")),
        )
        db.execute("PRAGMA user_version = 1")
    store = SQLiteStore(str(path))
    await store.start()
    try:
        arrival = await join(store, "old", 0, world_size=1, now=1.0)
        assert arrival.result == RendezvousResult(True, b"old plan")
        assert await store.claim_engine("old", "team-a", 1.0, 60.0, 16) == "team-a"
    finally:
        await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7


# What schema 2 wrote of the ledger and of ownership (the rest does not matter here).
V2_LEDGER = """
CREATE TABLE engine_owner (
    engine_id TEXT PRIMARY KEY,
    identity TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE leases (
    engine_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    device_uuid TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    allocated_bytes INTEGER NOT NULL,
    granted_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (engine_id, rank)
) WITHOUT ROWID;
CREATE INDEX leases_by_expiry ON leases (expires_at);
"""
GIB = 1 << 30


async def test_a_schema_2_file_keeps_its_leases_and_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "kvplan.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(V2_LEDGER)
        db.executemany(
            "INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                ("a", 0, "gpu-0", 30 * GIB, 10 * GIB, 0.0, 100.0),
                ("a", 1, "gpu-1", 20 * GIB, 0, 0.0, 100.0),
                ("b", 0, "gpu-0", 40 * GIB, 0, 0.0, 200.0),
                ("old", 0, "gpu-0", 50 * GIB, 0, 0.0, 5.0),  # expired before the upgrade
            ],
        )
        db.execute("INSERT INTO engine_owner VALUES ('a', 'team-a', 1000.0)")
        db.execute("PRAGMA user_version = 2")
    store = SQLiteStore(str(path))
    await store.start()
    try:
        leases = await store.leases(10.0)
        assert [(lease.engine_id, lease.rank, lease.identity) for lease in leases] == [
            ("a", 0, "team-a"),  # the engine's owner holds its leases
            ("a", 1, "team-a"),
            ("b", 0, ""),
        ]
        view = await store.ledger_view(10.0, ["gpu-0", "gpu-1", "gpu-2"], identity="team-a")
        assert view.devices == {
            "gpu-0": Totals(70 * GIB, 60 * GIB, 2),
            "gpu-1": Totals(20 * GIB, 20 * GIB, 1),
            "gpu-2": NOTHING,
        }
        assert (view.live_leases, view.identity_leases) == (3, 2)
        # The kept leases bind new grants: 70 of gpu-0's 80 GiB are committed.
        gpu0 = {"gpu-0": DeviceState("gpu-0", 100 * GIB, 100 * GIB, 80 * GIB)}
        with pytest.raises(GrantRefused) as refused:
            await store.grant("c", [LeaseRequest(0, "gpu-0", 20 * GIB)], gpu0, 10.0, 60.0)
        assert refused.value.details["committed_bytes"] == 70 * GIB
        assert len(await store.sweep_expired(10.0)) == 1  # "old"
        later = await store.ledger_view(150.0, ["gpu-0"])  # a's leases expired meanwhile
        assert later.devices["gpu-0"] == Totals(40 * GIB, 40 * GIB, 1)
    finally:
        await store.close()


V2_PLANS = """
CREATE TABLE plans (
    seq INTEGER PRIMARY KEY,
    plan_id TEXT NOT NULL UNIQUE,
    engine_id TEXT NOT NULL,
    plan BLOB NOT NULL,
    stored_at REAL NOT NULL
);
CREATE INDEX plans_by_engine ON plans (engine_id, seq);
"""


def _plan(plan_id: str, engine_id: str) -> bytes:
    plan = plan_pb2.PlanResponse(plan_id=plan_id, engine_id=engine_id, num_blocks=4096)
    plan.workers.add(rank=0, num_blocks=4096)
    return plan.SerializeToString()


async def test_a_schema_2_file_keeps_its_plans_and_shares_their_bodies(tmp_path: Path) -> None:
    path = tmp_path / "kvplan.sqlite3"
    stored = {
        ("plan-a", "engine-a"): _plan("plan-a", "engine-a"),
        ("plan-b", "engine-b"): _plan("plan-b", "engine-b"),  # same body as plan-a
        ("plan-c", ""): b"bytes that are no plan",
    }
    with sqlite3.connect(path) as db:
        db.executescript(V2_PLANS)
        for seq, ((plan_id, engine_id), plan) in enumerate(stored.items()):
            db.execute(
                "INSERT INTO plans VALUES (?, ?, ?, ?, ?)", (seq, plan_id, engine_id, plan, 1.0)
            )
        db.execute("PRAGMA user_version = 2")
    store = SQLiteStore(str(path))
    await store.start()
    try:
        for (plan_id, engine_id), plan in stored.items():
            assert await store.get_plan(plan_id) == plan
            if engine_id:
                assert await store.plan_for_engine(engine_id) == plan
        assert await store.distinct_plan_bodies() == 2
        # The totals read back at start bound the migrated plans too.
        await store.put_plan("plan-d", "engine-d", _plan("plan-d", "engine-d"), 2.0)
        assert await store.distinct_plan_bodies() == 2
    finally:
        await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


async def test_a_schema_4_file_keeps_its_owners_and_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "kvplan.sqlite3"
    store = SQLiteStore(str(path))
    await store.start()
    for engine_id in ("a1", "a2", "a3"):
        assert await store.claim_engine(engine_id, "team-a", 1.0, 100.0, 16) == "team-a"
    assert await store.claim_engine("b1", "team-b", 1.0, 100.0, 16) == "team-b"
    await store.close()
    with sqlite3.connect(path) as db:  # back to what schema 4 wrote
        db.execute("DROP TABLE engine_owner_count")
        db.execute("UPDATE engine_owner SET expires_at = 50.0 WHERE engine_id = 'a3'")
        db.execute("PRAGMA user_version = 4")
    store = SQLiteStore(str(path))
    await store.start()
    try:
        for engine_id, owner in (("a1", "team-a"), ("a2", "team-a"), ("b1", "team-b")):
            assert await store.engine_owner(engine_id, 2.0) == owner
        # team-a's 3 records count (a3 until it expires); the next new engine is refused.
        with pytest.raises(TooManyEngines) as refused:
            await store.claim_engine("a4", "team-a", 2.0, 100.0, 3)
        assert (refused.value.held, refused.value.limit) == (3, 3)
        assert await store.claim_engine("a1", "team-a", 2.0, 100.0, 3) == "team-a"
        # Once a3 expired it stops counting: room for one more.
        assert await store.claim_engine("a4", "team-a", 60.0, 100.0, 3) == "team-a"
        assert await store.claim_engine("b2", "team-b", 60.0, 100.0, 2) == "team-b"
    finally:
        await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        counts = dict(db.execute("SELECT identity, engines FROM engine_owner_count").fetchall())
        assert counts == {"team-a": 3, "team-b": 2}


async def test_a_schema_5_file_serves_its_bodies_as_stored_and_compresses_new_ones(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvplan.sqlite3"
    store = SQLiteStore(str(path))
    await store.start()
    old_spec = _big_plan("a rank's spec", "")
    assert (await join(store, "ranked", 0, worker=old_spec)).state == "waiting"
    await store.close()
    old_plan = _plan("plan-a", "engine-a")
    old_parts = PlanParts.of("plan-a", "engine-a", old_plan)
    with sqlite3.connect(path) as db:  # back to what schema 5 wrote: blobs as they are
        db.execute("DROP TABLE plans")
        db.execute("DROP TABLE plan_bodies")
        db.executescript(V5_PLANS)
        db.execute("ALTER TABLE rendezvous_open_worker RENAME TO rendezvous_open_worker_6")
        db.executescript(V5_OPEN_WORKER)
        db.execute("INSERT INTO rendezvous_open_worker VALUES ('ranked', 0, ?)", (old_spec,))
        db.execute("DROP TABLE rendezvous_open_worker_6")
        db.execute("INSERT INTO plan_bodies VALUES (1, ?, ?)", (old_parts.digest, old_parts.body))
        db.execute(
            "INSERT INTO plans VALUES (1, 'plan-a', 'engine-a', ?, 1, 1.0)", (old_parts.head,)
        )
        db.execute("PRAGMA user_version = 5")
    store = SQLiteStore(str(path))
    await store.start()
    try:
        assert await store.get_plan("plan-a") == old_plan
        # Another engine of the same content shares the old body.
        await store.put_plan("plan-b", "engine-b", _plan("plan-b", "engine-b"), 2.0)
        assert await store.distinct_plan_bodies() == 1
        assert await store.plan_for_engine("engine-b") == _plan("plan-b", "engine-b")
        big = _big_plan("plan-c", "engine-c")
        await store.put_plan("plan-c", "engine-c", big, 3.0)
        assert await store.get_plan("plan-c") == big
        # A rank that waited across the upgrade is compared and planned as it came.
        assert (await join(store, "ranked", 0, worker=old_spec)).state == "waiting"
        completed = await join(store, "ranked", 1, worker=b"worker-1")
        assert completed == Arrival("plan", workers=(old_spec, b"worker-1"))
    finally:
        await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        codecs = dict(db.execute("SELECT id, codec FROM plan_bodies").fetchall())
        assert codecs == {1: CODEC_NONE, 2: CODEC_ZLIB}


# What schema 5 wrote of waiting ranks: specs without a codec.
V5_OPEN_WORKER = """
CREATE TABLE rendezvous_open_worker (
    engine_id TEXT NOT NULL REFERENCES rendezvous_open (engine_id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    worker BLOB NOT NULL,
    PRIMARY KEY (engine_id, rank)
) WITHOUT ROWID;
"""


# What schema 4 and 5 wrote of plans: bodies without a codec.
V5_PLANS = """
CREATE TABLE plan_bodies (
    id INTEGER PRIMARY KEY,
    digest BLOB NOT NULL UNIQUE,
    body BLOB NOT NULL
);
CREATE TABLE plans (
    seq INTEGER PRIMARY KEY,
    plan_id TEXT NOT NULL UNIQUE,
    engine_id TEXT NOT NULL,
    head BLOB NOT NULL,
    body_id INTEGER NOT NULL REFERENCES plan_bodies (id),
    stored_at REAL NOT NULL
);
CREATE INDEX plans_by_engine ON plans (engine_id, seq);
CREATE INDEX plans_by_body ON plans (body_id);
"""


def _big_plan(plan_id: str, engine_id: str, layers: int = 64) -> bytes:
    """A plan whose layer names repeat, as real plans' do."""
    plan = plan_pb2.PlanResponse(plan_id=plan_id, engine_id=engine_id, num_blocks=4096)
    group = plan.groups.add(group_id=0)
    group.layer_names.extend(f"model.layers.{index}.self_attn.attn" for index in range(layers))
    return plan.SerializeToString()


async def test_bodies_are_stored_compressed_when_smaller_and_counted_as_stored(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvplan.sqlite3"
    big = _big_plan("plan-a", "engine-a")
    small = b"\x30\x01"  # num_blocks = 1: zlib would only grow it
    store = SQLiteStore(str(path), max_plan_bytes=10 * 1024)
    await store.start()
    try:
        await store.put_plan("plan-a", "engine-a", big, 1.0)
        await store.put_plan("plan-s", "engine-s", small, 1.0)
        assert await store.get_plan("plan-a") == big
        assert await store.plan_for_engine("engine-a") == big
        assert await store.get_plan("plan-s") == small
        with sqlite3.connect(path) as db:
            rows = db.execute("SELECT length(body), codec FROM plan_bodies ORDER BY id").fetchall()
        big_body = len(PlanParts.of("plan-a", "engine-a", big).body)
        assert rows[0][1] == CODEC_ZLIB and rows[0][0] < big_body // 4, (rows, big_body)
        assert rows[1] == (len(small), CODEC_NONE)
        # The byte bound counts what is stored: far more than 10 KiB of plans fit.
        for index in range(20):
            plan = _big_plan(f"plan-{index}", "", 64 + index)
            await store.put_plan(f"plan-{index}", f"engine-{index}", plan, 2.0)
        assert 20 * big_body > 10 * 1024
        assert await store.get_plan("plan-19") == _big_plan("plan-19", "", 83)
        assert await store.get_plan("plan-10") == _big_plan("plan-10", "", 74)
        # A finished rendezvous keeps its plan compressed too, and answers it whole.
        assert (await join(store, "ranked", 0, world_size=1, now=3.0)).state == "plan"
        await store.rendezvous_finish("ranked", RendezvousResult(True, big), 3.0)
        again = await join(store, "ranked", 0, world_size=1, now=4.0)
        assert again.result == RendezvousResult(True, big)
    finally:
        await store.close()
    with sqlite3.connect(path) as db:
        stored = db.execute("SELECT length(plan), codec FROM rendezvous_finished").fetchall()
    assert stored[0][1] == CODEC_ZLIB and stored[0][0] < len(big) // 4, stored


async def test_waiting_rank_specs_are_stored_compressed_and_compared_whole(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvplan.sqlite3"
    specs = [_big_plan(f"rank-{rank}", "") for rank in range(2)]  # repetitive bytes
    store = SQLiteStore(str(path))
    await store.start()
    try:
        assert (await join(store, "e", 0, worker=specs[0])).state == "waiting"
        with sqlite3.connect(path) as db:
            query = "SELECT worker, codec FROM rendezvous_open_worker"
            (stored, codec) = db.execute(query).fetchone()
        assert codec == CODEC_ZLIB and len(stored) < len(specs[0]) // 4
        # A retry with the same bytes is the same rank; other bytes are refused.
        assert (await join(store, "e", 0, worker=specs[0])).state == "waiting"
        with pytest.raises(ServiceError) as refused:
            await join(store, "e", 0, worker=specs[1])
        assert refused.value.code == "INVALID_ARGUMENT"
        completed = await join(store, "e", 1, worker=specs[1])
        assert completed == Arrival("plan", workers=tuple(specs))
        planned = RendezvousResult(True, b"the plan")
        await store.rendezvous_finish("e", planned, 1.0)
        # The finished engine knows its ranks' specs: unchanged is answered, changed refused.
        assert (await join(store, "e", 1, worker=specs[1], now=2.0)).result == planned
        with pytest.raises(ServiceError):
            await join(store, "e", 1, worker=specs[0], now=2.0)
    finally:
        await store.close()


def _page_bytes(path: Path) -> int:
    with sqlite3.connect(path) as db:
        (page_bytes,) = db.execute("PRAGMA page_size").fetchone()
    return int(page_bytes)


async def test_page_size_new_files_small_existing_files_as_they_are(tmp_path: Path) -> None:
    """A new file gets 1 KiB pages (a plan's insert writes a quarter of the WAL
    bytes); a file of SQLite's default pages keeps them. Either checkpoints its WAL
    at 4 MiB."""
    new = SQLiteStore(str(tmp_path / "new.sqlite3"))
    await new.start()
    await new.put_plan("p1", "engine-a", b"plan", 1.0)
    connection = new._connection
    assert connection is not None
    assert connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 4096
    await new.close()
    assert _page_bytes(tmp_path / "new.sqlite3") == 1024

    old_path = tmp_path / "old.sqlite3"
    with sqlite3.connect(old_path) as db:
        db.execute("PRAGMA page_size = 4096")
        db.execute("CREATE TABLE before (x)")
    old = SQLiteStore(str(old_path))
    await old.start()
    await old.put_plan("p1", "engine-a", b"plan", 1.0)
    assert await old.get_plan("p1") == b"plan"
    connection = old._connection
    assert connection is not None
    assert connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1024
    await old.close()
    assert _page_bytes(old_path) == 4096


async def test_a_schema_6_file_counts_its_finished_results_against_the_bound(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvplan.sqlite3"
    plans = {engine: random.Random(engine).randbytes(1000) for engine in ("old-a", "old-b")}
    store = SQLiteStore(str(path))
    await store.start()
    for now, (engine, plan) in enumerate(plans.items()):
        await join(store, engine, 0, world_size=1, now=float(now))
        await store.rendezvous_finish(engine, RendezvousResult(True, plan), float(now))
    await store.close()
    with sqlite3.connect(path) as db:  # back to what schema 6 wrote: no sizes, no sum
        db.execute("ALTER TABLE rendezvous_finished DROP COLUMN size")
        db.execute("DROP TABLE rendezvous_finished_bytes")
        db.execute("PRAGMA user_version = 6")
    store = SQLiteStore(str(path))
    await store.start()
    try:
        size = kept_result_bytes("old-a", 1000, ranks=1)
        await join(store, "new", 0, world_size=1, now=2.0)
        new_plan = random.Random("new").randbytes(1000)
        # Room for two: the older of the migrated results goes.
        await store.rendezvous_finish(
            "new", RendezvousResult(True, new_plan), 2.0, max_kept_bytes=2 * size + 10
        )
        forgotten = await join(store, "old-a", 0, world_size=1, now=3.0)
        assert forgotten == Arrival("plan", workers=(b"worker-0",))
        kept = await join(store, "old-b", 0, world_size=1, now=3.0)
        assert kept.result == RendezvousResult(True, plans["old-b"])
    finally:
        await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        (kept_bytes,) = db.execute("SELECT bytes FROM rendezvous_finished_bytes").fetchone()
        (summed,) = db.execute("SELECT sum(size) FROM rendezvous_finished").fetchone()
        assert kept_bytes == summed == 2 * size - len("old-b") + len("new")
