"""A schema-1 SQLite file (before engine ownership and failed rendezvous) opens
under schema 2 with its finished engines intact."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvplan.server.store import RendezvousResult
from kvplan.server.store.memory import digest
from kvplan.server.store.sqlite import SCHEMA_VERSION, SQLiteStore

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
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
