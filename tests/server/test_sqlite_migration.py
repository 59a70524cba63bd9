"""Older SQLite files open under the current schema with their contents intact:
schema 1 (before engine ownership and failed rendezvous), schema 2 (each plan
stored whole, before plans of equal content shared their body)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvplan.server.store import RendezvousResult
from kvplan.server.store.memory import digest
from kvplan.server.store.sqlite import SCHEMA_VERSION, SQLiteStore
from kvplan.v1 import plan_pb2

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
        arrival = await store.rendezvous_join(
            engine_id="old",
            world_size=1,
            template=b"template",
            rank=0,
            worker=b"worker-0",
            now=1.0,
            ttl_s=600.0,
            max_pending=16,
            claim_timeout_s=10.0,
        )
        assert arrival.result == RendezvousResult(True, b"old plan")
        assert await store.claim_engine("old", "team-a", 1.0, 60.0) == "team-a"
    finally:
        await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3


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
