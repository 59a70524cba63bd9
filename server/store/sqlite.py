"""The embedded store: one SQLite file, served by one server process.

Durability: WAL journal with synchronous=NORMAL. A commit is in the WAL (in the
OS page cache) before the call returns, so it survives the server being killed
(kill -9, OOM) without an fsync per commit. It does not cover an OS crash or a
power loss: the last commits before one may be lost (the file stays consistent).

Every call runs in the store's own thread, never on the event loop: a write
that waits for another connection's lock (up to the busy timeout), a slow disk
or a large plan delays only the store's callers, not unrelated RPCs. One thread
because one connection serializes its transactions anyway. Write transactions
start with BEGIN IMMEDIATE, so several connections (threads, processes, a CLI)
on one file serialize on SQLite's write lock instead of failing on a lock
upgrade. Rendezvous writes queued while the thread is busy (the ranks of many
engines arrive together) share one thread hop and one transaction.

Plans are bounded by count and by bytes; the server keeps both totals (one
server per file), so an insert evicts the oldest plans by an index range
instead of counting the table. Each distinct plan body is stored once
(store/bodies.py): a new engine of a known model writes a row of about 100
bytes, not its 7-35 KB plan.

Plans queued while the store thread is busy are committed together: one
transaction and one wake-up of the event loop for a burst of new engines.
Each caller still returns only once its plan is committed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import sqlite3
import threading
import zlib
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvplan.core.ledger import (
    NOTHING,
    DeviceState,
    GrantRefused,
    Lease,
    LeaseRequest,
    Totals,
    changes,
    counted,
    excluding,
    grant_leases,
    identity_changes,
)
from kvplan.server.errors import ServiceError
from kvplan.server.store.base import (
    DEFAULT_MAX_ENGINES_PER_CONFIG,
    DEFAULT_MAX_MEASURED_CONFIGS,
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    DEFAULT_MAX_RESULT_BYTES,
    DIGEST_BYTES,
    Arrival,
    FinishedCallback,
    LedgerView,
    RendezvousResult,
    StoreUnavailable,
    TooManyEngines,
    check_lease_quota,
    kept_result_bytes,
)
from kvplan.server.store.bodies import PlanParts, plan_parts
from kvplan.server.store.rules import (
    check_compatible,
    check_finished,
    digest,
    last_per_rank,
    naming_holders,
    renew_leases,
    same_ranks,
    too_many_pending,
    too_many_pending_of,
)

log = logging.getLogger(__name__)

# 2: engine_owner, rendezvous_finished.ok; 3: the ledger's totals, leases.identity;
# 4: plan_bodies (each distinct plan body once); 5: engine_owner_count;
# 6: plan_bodies.codec, rendezvous_finished.codec, rendezvous_open_worker.codec
# (plans and rank specs stored compressed); 7: rendezvous_finished.size and
# rendezvous_finished_bytes (finished results bounded by bytes),
# rendezvous_open.identity (each identity's share of waiting engines)
SCHEMA_VERSION = 7
BUSY_TIMEOUT_S = 5.0  # how long a writer waits for another connection's transaction
# Pages of a new file. A plan's insert (and the eviction of the oldest) changes a
# few rows in about seven pages, each written whole to the WAL: 26.7 KB per plan
# with SQLite's default 4 KiB pages, 7.9 KB with 1 KiB ones (measured, 10,000
# plans). Checkpoints, which stall the commit that triggers them for 2-4 ms, come
# 3.4x less often: 15 instead of 48 in 5,000 plans, put_plan p99 540 -> 158 µs.
PAGE_BYTES = 1024
# The WAL is checkpointed into the file once it holds this much (SQLite's default
# of 1,000 pages of 4 KiB), whatever the file's page size.
CHECKPOINT_WAL_BYTES = 4 * 1024 * 1024
# How plan bodies are stored (the codec). Plans repeat their layer names and specs, so zlib's
# fastest level shrinks them: an 8-worker x 65-layer body from 34.7 KB to 1.4 KB
# (28 µs), a 64-layer one from 6.8 KB to 0.8 KB (14 µs), in the store thread. Each
# plan then writes a few pages to the WAL instead of dozens of overflow pages,
# checkpoints come that much less often, and the file holds more plans within
# --store-plan-bytes (which counts stored bytes). A finished rendezvous' plan and
# each waiting rank's spec (3.6 KB -> 0.4 KB for one of 65 layers) are kept the same
# way: a rendezvous of 256 engines x 8 such ranks spends 0.16 s instead of 0.22 s in
# the store (in process, compression included).
CODEC_NONE, CODEC_ZLIB = 0, 1
# Slack on the index range of the expiry scan: covers float rounding of now - ttl.
_EXPIRY_MARGIN_S = 1.0

# Fleet measurements (docs/capacity.md): one row per configuration and engine; a
# configuration's `touched_at` orders configurations for the bound.
_FLEET_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS fleet_measurement (config_key TEXT NOT NULL, "
    "engine_id TEXT NOT NULL, reported_at REAL NOT NULL, seq INTEGER NOT NULL, "
    "record BLOB NOT NULL, PRIMARY KEY (config_key, engine_id))",
    "CREATE TABLE IF NOT EXISTS fleet_config (config_key TEXT PRIMARY KEY, "
    "touched_seq INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS fleet_config_by_touch ON fleet_config (touched_seq)",
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS engine_owner (
    engine_id TEXT PRIMARY KEY,
    identity TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS engine_owner_by_expiry ON engine_owner (expires_at);
-- Rows of engine_owner per identity (expired rows count until a claim deletes
-- them, which it does before counting): --max-engines-per-identity.
CREATE TABLE IF NOT EXISTS engine_owner_count (
    identity TEXT PRIMARY KEY,
    engines INTEGER NOT NULL
) WITHOUT ROWID;
-- A plan is its head (plan and engine id) and a body shared by every plan of
-- the same content (store/bodies.py), deleted with the last plan holding it.
CREATE TABLE IF NOT EXISTS plan_bodies (
    id INTEGER PRIMARY KEY,
    digest BLOB NOT NULL UNIQUE,      -- SHA-256 of the body as served
    body BLOB NOT NULL,
    codec INTEGER NOT NULL DEFAULT 0  -- CODEC_NONE or CODEC_ZLIB
);
CREATE TABLE IF NOT EXISTS plans (
    seq INTEGER PRIMARY KEY,          -- insertion order: the oldest are dropped first
    plan_id TEXT NOT NULL UNIQUE,
    engine_id TEXT NOT NULL,
    head BLOB NOT NULL,
    body_id INTEGER NOT NULL REFERENCES plan_bodies (id),
    stored_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS plans_by_engine ON plans (engine_id, seq);
CREATE INDEX IF NOT EXISTS plans_by_body ON plans (body_id);

CREATE TABLE IF NOT EXISTS rendezvous_open (
    engine_id TEXT PRIMARY KEY,
    world_size INTEGER NOT NULL,
    template BLOB NOT NULL,
    created REAL NOT NULL,
    claimed_at REAL,                  -- NULL: nobody is planning it
    identity TEXT NOT NULL DEFAULT '' -- the engine's owner ('' without authentication)
);
CREATE INDEX IF NOT EXISTS rendezvous_open_by_identity ON rendezvous_open (identity);
CREATE TABLE IF NOT EXISTS rendezvous_open_worker (
    engine_id TEXT NOT NULL REFERENCES rendezvous_open (engine_id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    worker BLOB NOT NULL,             -- the rank's serialized WorkerSpec
    codec INTEGER NOT NULL DEFAULT 0, -- of worker: CODEC_NONE or CODEC_ZLIB
    PRIMARY KEY (engine_id, rank)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS rendezvous_finished (
    engine_id TEXT PRIMARY KEY,
    template_digest BLOB NOT NULL,
    plan BLOB NOT NULL,               -- the plan, or the serialized error when ok = 0
    finished REAL NOT NULL,
    ok INTEGER NOT NULL DEFAULT 1,
    codec INTEGER NOT NULL DEFAULT 0, -- of plan: CODEC_NONE or CODEC_ZLIB
    size INTEGER NOT NULL DEFAULT 0   -- kept_result_bytes, as stored
);
-- The sizes of rendezvous_finished added up, changed with every insert and delete
-- (_drop_finished): the bound is checked without summing the table.
CREATE TABLE IF NOT EXISTS rendezvous_finished_bytes (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    bytes INTEGER NOT NULL
);
-- Expiry runs on every join: an index range finds the (usually no) old rows.
CREATE INDEX IF NOT EXISTS rendezvous_open_by_created ON rendezvous_open (created);
CREATE INDEX IF NOT EXISTS rendezvous_finished_by_time ON rendezvous_finished (finished);
CREATE TABLE IF NOT EXISTS rendezvous_finished_worker (
    engine_id TEXT NOT NULL REFERENCES rendezvous_finished (engine_id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    worker_digest BLOB NOT NULL,
    PRIMARY KEY (engine_id, rank)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS leases (
    engine_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    device_uuid TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    allocated_bytes INTEGER NOT NULL,
    granted_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    identity TEXT NOT NULL DEFAULT '',  -- whose quota it counts against
    PRIMARY KEY (engine_id, rank)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS leases_by_expiry ON leases (expires_at);
-- A refusal names the holders on its device.
CREATE INDEX IF NOT EXISTS leases_by_device ON leases (device_uuid);

-- The totals of the counted leases (kvplan.core.ledger), changed with every ledger
-- write: leases with expires_at > ledger_clock.expired_through.
CREATE TABLE IF NOT EXISTS ledger_device (
    device_uuid TEXT PRIMARY KEY,
    committed_bytes INTEGER NOT NULL,
    outstanding_bytes INTEGER NOT NULL,
    live_leases INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ledger_identity (
    identity TEXT PRIMARY KEY,
    live_leases INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ledger_clock (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    expired_through REAL NOT NULL     -- the latest `now` due leases were expired at
);
"""

_LEASE_COLUMNS = (
    "engine_id, rank, device_uuid, bytes, allocated_bytes, granted_at, expires_at, identity"
)


def _lease(row: tuple[Any, ...]) -> Lease:
    engine_id, rank, device_uuid, size, allocated, granted_at, expires_at, identity = row
    return Lease(
        engine_id=engine_id,
        rank=rank,
        device_uuid=device_uuid,
        bytes=size,
        allocated_bytes=allocated,
        granted_at=float(granted_at),
        expires_at=float(expires_at),
        identity=identity,
    )


def _row(lease: Lease) -> tuple[Any, ...]:
    return (
        lease.engine_id,
        lease.rank,
        lease.device_uuid,
        lease.bytes,
        lease.allocated_bytes,
        lease.granted_at,
        lease.expires_at,
        lease.identity,
    )


def _expired_through(db: sqlite3.Connection) -> float:
    return float(db.execute("SELECT expired_through FROM ledger_clock").fetchone()[0])


def _count(db: sqlite3.Connection, removed: Iterable[Lease], added: Iterable[Lease]) -> None:
    """Take `removed` out of the totals and put `added` in (the counted ones)."""
    through = _expired_through(db)
    gone = [lease for lease in removed if counted(lease, through)]
    new = [lease for lease in added if counted(lease, through)]
    for uuid, change in changes(gone, new).items():
        db.execute(
            "INSERT INTO ledger_device VALUES (?, ?, ?, ?) ON CONFLICT (device_uuid) DO UPDATE "
            "SET committed_bytes = committed_bytes + excluded.committed_bytes, "
            "outstanding_bytes = outstanding_bytes + excluded.outstanding_bytes, "
            "live_leases = live_leases + excluded.live_leases",
            (uuid, change.committed_bytes, change.outstanding_bytes, change.live_leases),
        )
        db.execute("DELETE FROM ledger_device WHERE device_uuid = ? AND live_leases = 0", (uuid,))
    for identity, step in identity_changes(gone, new).items():
        db.execute(
            "INSERT INTO ledger_identity VALUES (?, ?) ON CONFLICT (identity) DO UPDATE "
            "SET live_leases = live_leases + excluded.live_leases",
            (identity, step),
        )
        db.execute(
            "DELETE FROM ledger_identity WHERE identity = ? AND live_leases = 0", (identity,)
        )


def _due(db: sqlite3.Connection, now: float, *, limit: int | None = None) -> list[Lease]:
    """Counted leases whose expiry is at or before `now` (an index range)."""
    return [
        _lease(row)
        for row in db.execute(
            f"SELECT {_LEASE_COLUMNS} FROM leases WHERE expires_at > ? AND expires_at <= ?"
            + (f" LIMIT {limit}" if limit is not None else ""),
            (_expired_through(db), now),
        )
    ]


def _expire_due(db: sqlite3.Connection, now: float) -> float:
    """Take the leases due at `now` out of the totals; the time expired through."""
    due = _due(db, now)
    if due:
        _count(db, removed=due, added=())
    through = max(_expired_through(db), now)
    db.execute("UPDATE ledger_clock SET expired_through = ?", (through,))
    return through


def _device_totals(db: sqlite3.Connection, uuids: Iterable[str]) -> dict[str, Totals]:
    out = {}
    for uuid in uuids:
        row = db.execute(
            "SELECT committed_bytes, outstanding_bytes, live_leases FROM ledger_device "
            "WHERE device_uuid = ?",
            (uuid,),
        ).fetchone()
        out[uuid] = Totals(*row) if row else NOTHING
    return out


def _live_leases(db: sqlite3.Connection, identity: str) -> tuple[int, int]:
    """(every counted lease, `identity`'s), from the totals."""
    (live,) = db.execute("SELECT total(live_leases) FROM ledger_device").fetchone()
    held = db.execute(
        "SELECT live_leases FROM ledger_identity WHERE identity = ?", (identity,)
    ).fetchone()
    return int(live), int(held[0]) if held else 0


def _lease_holder(db: sqlite3.Connection, engine_id: str, now: float) -> str | None:
    """Who holds the engine's live leases (one grant: one identity), or None."""
    row = db.execute(
        "SELECT identity FROM leases WHERE engine_id = ? AND expires_at > ? LIMIT 1",
        (engine_id, now),
    ).fetchone()
    return str(row[0]) if row else None


def _recount_owners(db: sqlite3.Connection) -> None:
    """The per-identity counts of ownership records recounted (schema 5 added them)."""
    db.execute("DELETE FROM engine_owner_count")
    db.execute(
        "INSERT INTO engine_owner_count (identity, engines) "
        "SELECT identity, count(*) FROM engine_owner GROUP BY identity"
    )


def _recount_finished(db: sqlite3.Connection) -> None:
    """Each finished result's size and their sum recounted (schema 7 added them)."""
    db.execute(
        "UPDATE rendezvous_finished SET size = length(CAST(engine_id AS BLOB)) + length(plan) "
        f"+ {DIGEST_BYTES} * (1 + (SELECT count(*) FROM rendezvous_finished_worker AS w "
        "WHERE w.engine_id = rendezvous_finished.engine_id))"
    )
    db.execute(
        "INSERT OR REPLACE INTO rendezvous_finished_bytes (id, bytes) "
        "SELECT 0, coalesce(sum(size), 0) FROM rendezvous_finished"
    )


def _drop_finished(db: sqlite3.Connection, where: str, params: Sequence[object]) -> None:
    """Delete the finished results `where` holds for, and their bytes from the sum."""
    db.execute(
        "UPDATE rendezvous_finished_bytes SET bytes = bytes - "
        f"(SELECT coalesce(sum(size), 0) FROM rendezvous_finished WHERE {where})",
        params,
    )
    db.execute(f"DELETE FROM rendezvous_finished WHERE {where}", params)


def _keep_within(db: sqlite3.Connection, max_bytes: int) -> None:
    """Forget the oldest finished results until they hold at most `max_bytes`: the
    first kept (rowid order, as the memory store's), never the one just kept, which
    has the highest rowid even when this server's clock stepped back."""
    (kept,) = db.execute("SELECT bytes FROM rendezvous_finished_bytes").fetchone()
    while kept > max_bytes:
        oldest, size = db.execute(
            "SELECT engine_id, size FROM rendezvous_finished ORDER BY rowid LIMIT 1"
        ).fetchone()
        _drop_finished(db, "engine_id = ?", (oldest,))
        kept -= size


def _rebuild_totals(db: sqlite3.Connection) -> None:
    """The totals recounted from the leases (a file of schema 2 had none)."""
    db.execute("INSERT OR IGNORE INTO ledger_clock VALUES (0, ?)", (-math.inf,))
    db.execute("DELETE FROM ledger_device")
    db.execute("DELETE FROM ledger_identity")
    through = _expired_through(db)
    leases = [_lease(row) for row in db.execute(f"SELECT {_LEASE_COLUMNS} FROM leases")]
    _count(db, removed=(), added=[lease for lease in leases if counted(lease, through)])


def _unavailable(error: BaseException, path: str) -> StoreUnavailable:
    return StoreUnavailable(f"SQLite store {path}: {error}")


def _is_outage(error: BaseException) -> bool:
    """The file cannot be used now (locked, I/O error, disk full, corrupt), as
    opposed to a statement this module got wrong, which stays a loud error."""
    return isinstance(error, sqlite3.Error) and not isinstance(
        error, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError
    )


# plan id, engine id, parts, now, the caller's future (set once committed)
_QueuedPlan = tuple[str, str, PlanParts, float, "asyncio.Future[None]"]


def _settle_queued_plans(batch: list[_QueuedPlan], error: BaseException | None) -> None:
    """On the event loop: tell each caller of a committed batch (or its error)."""
    for *_, committed in batch:
        if committed.done():  # its caller was cancelled; the plan is committed anyway
            continue
        if error is None:
            committed.set_result(None)
        else:
            committed.set_exception(error)


def _pack(blob: bytes) -> tuple[bytes, int]:
    """A plan, plan body or rank spec as stored, and its codec: compressed unless that
    is no smaller."""
    packed = zlib.compress(blob, 1)
    return (packed, CODEC_ZLIB) if len(packed) < len(blob) else (blob, CODEC_NONE)


def _unpack(stored: bytes, codec: int) -> bytes:
    """What `_pack` stored, as it was."""
    return zlib.decompress(stored) if codec == CODEC_ZLIB else bytes(stored)


def _served(head: bytes, body: bytes, codec: int) -> bytes:
    """A stored plan as served: its head and its body."""
    return bytes(head) + _unpack(body, codec)


def _old_plans(db: sqlite3.Connection) -> list[tuple[str, str, bytes, float]]:
    """Schema 1-3 kept each plan whole in `plans`: read them and drop that table
    (with its index), so that schema 4's tables can take them split."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(plans)")}
    if "plan" not in columns:
        return []
    rows = db.execute(
        "SELECT plan_id, engine_id, plan, stored_at FROM plans ORDER BY seq"
    ).fetchall()
    db.execute("DROP TABLE plans")
    return [
        (plan_id, engine_id, bytes(plan), stored_at) for plan_id, engine_id, plan, stored_at in rows
    ]


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _in_store_thread(
    method: Callable[Concatenate[SQLiteStore, _P], _R],
) -> Callable[Concatenate[SQLiteStore, _P], Coroutine[Any, Any, _R]]:
    """Run a store method in the store's thread, off the event loop."""

    async def off_loop(store: SQLiteStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        call = functools.partial(method, store, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(store._executor, call)

    return off_loop


@dataclass(frozen=True)
class _Outcome:
    """What one operation of a shared transaction returned or raised."""

    value: Any = None
    error: Exception | None = None


_Operation = Callable[[sqlite3.Connection], Any]


def _settle(
    batch: Sequence[tuple[_Operation, asyncio.Future[Any]]], outcomes: list[_Outcome]
) -> None:
    """On the event loop: each caller hears its own operation's outcome."""
    for (_, future), outcome in zip(batch, outcomes, strict=True):
        if future.done():  # the caller was cancelled meanwhile
            continue
        if outcome.error is not None:
            future.set_exception(outcome.error)
        else:
            future.set_result(outcome.value)


class SQLiteStore:
    kind = "sqlite"

    def __init__(
        self,
        path: str,
        max_plans: int = DEFAULT_MAX_PLANS,
        max_plan_bytes: int = DEFAULT_MAX_PLAN_BYTES,
    ) -> None:
        self._path = path
        self._max_plans = max_plans
        self._max_plan_bytes = max_plan_bytes
        # Totals of the plans table, read at start and kept by put_plan.
        self._plan_count = 0
        self._plan_bytes = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvplan-sqlite")
        self._connection: sqlite3.Connection | None = None
        # One connection per store; the lock keeps its transactions from
        # interleaving when the store is used from several threads.
        self._lock = threading.Lock()
        self._subscribers: list[FinishedCallback] = []
        # Rendezvous writes waiting for the store thread (see _in_shared_transaction).
        self._queued: list[tuple[_Operation, asyncio.Future[Any]]] = []
        self._queued_lock = threading.Lock()
        # Plans waiting for the store thread (put_plan); the lock guards the handover.
        self._queued_plans: list[_QueuedPlan] = []
        self._queue_lock = threading.Lock()

    # --- connection and transactions ----------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions, every BEGIN is ours.
        connection = sqlite3.connect(
            self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        try:
            connection.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            # Takes effect only on a new, empty file; an existing one keeps its pages.
            connection.execute(f"PRAGMA page_size = {PAGE_BYTES}")
            mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("SQLite store %s: journal mode %s, not WAL", self._path, mode)
            (page_bytes,) = connection.execute("PRAGMA page_size").fetchone()
            connection.execute(
                f"PRAGMA wal_autocheckpoint = {CHECKPOINT_WAL_BYTES // int(page_bytes)}"
            )
            connection.execute("PRAGMA synchronous = NORMAL")
            connection.execute("PRAGMA foreign_keys = ON")
        except BaseException:
            connection.close()
            raise
        return connection

    @contextmanager
    def _transaction(
        self, *, write: bool, commit_on: tuple[type[Exception], ...] = ()
    ) -> Iterator[sqlite3.Connection]:
        """One transaction: committed when the body returns or raises one of
        `commit_on` (a refusal after bookkeeping that must stay), else rolled back.
        SQLite errors become StoreUnavailable."""
        with self._lock:
            connection = self._connection
            if connection is None:
                raise StoreUnavailable(f"SQLite store {self._path} is not open")
            try:
                connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.Error as error:
                raise _unavailable(error, self._path) from error
            try:
                yield connection
            except commit_on:
                self._commit(connection)
                raise
            except BaseException as error:
                self._rollback(connection)
                if _is_outage(error):
                    raise _unavailable(error, self._path) from error
                raise
            else:
                self._commit(connection)

    def _commit(self, connection: sqlite3.Connection) -> None:
        try:
            connection.execute("COMMIT")
        except sqlite3.Error as error:
            self._rollback(connection)
            raise _unavailable(error, self._path) from error

    def _rollback(self, connection: sqlite3.Connection) -> None:
        if connection.in_transaction:
            try:
                connection.execute("ROLLBACK")
            except sqlite3.Error as error:  # SQLite may have rolled back already
                log.warning("SQLite store %s: rollback failed: %s", self._path, error)

    # --- shared write transactions ------------------------------------------------

    async def _in_shared_transaction(self, operation: Callable[[sqlite3.Connection], _R]) -> _R:
        """Run `operation` in the store thread, in one write transaction with the
        other operations queued while the thread was busy: a rendezvous's ranks
        arrive together, and one thread hop and one commit for all of them cost a
        fraction of one each. Each operation still sees those before it, and its
        caller hears of it only once it is committed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_R] = loop.create_future()
        with self._queued_lock:
            self._queued.append((operation, future))
            first = len(self._queued) == 1
        if first:  # else the hop already scheduled takes it along
            loop.run_in_executor(self._executor, self._run_queued, loop)
        return await future

    def _run_queued(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._queued_lock:
            queued, self._queued = self._queued, []
        # A caller cancelled before its turn is dropped, as run_in_executor does.
        batch = [(operation, future) for operation, future in queued if not future.cancelled()]
        outcomes = self._run_together([operation for operation, _ in batch])
        loop.call_soon_threadsafe(_settle, batch, outcomes)

    def _run_together(self, operations: Sequence[_Operation]) -> list[_Outcome]:
        """One transaction for all. A refusal (ServiceError) is its operation's
        outcome and keeps its bookkeeping, as alone; an outage (the file locked
        past the busy timeout, an I/O error, a failed commit) fails them all,
        nothing committed. Any other failure, a fault of one operation, rolls
        the transaction back and runs each operation in a transaction of its
        own, so that the fault is the failing operation's alone."""
        if len(operations) > 1:
            outcomes: list[_Outcome] = []
            try:
                with self._transaction(write=True) as db:
                    for operation in operations:
                        try:
                            outcomes.append(_Outcome(value=operation(db)))
                        except ServiceError as refusal:
                            outcomes.append(_Outcome(error=refusal))
                return outcomes
            except StoreUnavailable as outage:
                return [_Outcome(error=StoreUnavailable(str(outage))) for _ in operations]
            except Exception:
                log.warning("SQLite store %s: a shared transaction failed; one by one", self._path)
        return [self._run_alone(operation) for operation in operations]

    def _run_alone(self, operation: _Operation) -> _Outcome:
        try:
            with self._transaction(write=True, commit_on=(ServiceError,)) as db:
                return _Outcome(value=operation(db))
        except Exception as error:
            return _Outcome(error=error)

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        with self._lock:
            if self._connection is not None:
                return
            try:
                self._connection = self._connect()
            except (sqlite3.Error, OSError) as error:
                raise StoreUnavailable(f"SQLite store {self._path}: {error}") from error
        with self._transaction(write=True) as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreUnavailable(
                    f"SQLite store {self._path} has schema version {version}; this server "
                    f"knows {SCHEMA_VERSION}: upgrade the server or point it at another file"
                )
            if version == 1:  # the v1 table gains the failed-engine flag
                db.execute(
                    "ALTER TABLE rendezvous_finished ADD COLUMN ok INTEGER NOT NULL DEFAULT 1"
                )
            # Schema < 6 stored these as they are.
            for table in ("plan_bodies", "rendezvous_finished", "rendezvous_open_worker"):
                columns = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
                if columns and "codec" not in columns:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN codec INTEGER NOT NULL DEFAULT 0")
            finished_columns = {
                row[1] for row in db.execute("PRAGMA table_info(rendezvous_finished)")
            }
            if finished_columns and "size" not in finished_columns:  # schema < 7
                db.execute(
                    "ALTER TABLE rendezvous_finished ADD COLUMN size INTEGER NOT NULL DEFAULT 0"
                )
            open_columns = {row[1] for row in db.execute("PRAGMA table_info(rendezvous_open)")}
            if open_columns and "identity" not in open_columns:  # schema < 7
                db.execute(
                    "ALTER TABLE rendezvous_open ADD COLUMN identity TEXT NOT NULL DEFAULT ''"
                )
            lease_columns = {row[1] for row in db.execute("PRAGMA table_info(leases)")}
            identity_added = bool(lease_columns) and "identity" not in lease_columns
            if identity_added:  # schema 1 or 2
                db.execute("ALTER TABLE leases ADD COLUMN identity TEXT NOT NULL DEFAULT ''")
            old_plans = _old_plans(db) if version < 4 else []
            if version < SCHEMA_VERSION:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                if identity_added:
                    db.execute(
                        "UPDATE leases SET identity = coalesce((SELECT identity FROM "
                        "engine_owner WHERE engine_owner.engine_id = leases.engine_id), '')"
                    )
                _rebuild_totals(db)
                _recount_owners(db)
                _recount_finished(db)
                for plan_id, engine_id, plan, stored_at in old_plans:
                    self._insert_plan(
                        db, plan_id, engine_id, plan_parts(plan_id, engine_id, plan), stored_at
                    )
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            # One server per file: a claim left in it is from a server that was
            # killed while planning, so the next rank to arrive plans again.
            db.execute("UPDATE rendezvous_open SET claimed_at = NULL WHERE claimed_at IS NOT NULL")
            # Added tables need no migration: created where missing, at any version.
            for statement in _FLEET_SCHEMA:
                db.execute(statement)
            count, heads = db.execute("SELECT count(*), total(length(head)) FROM plans").fetchone()
            (bodies,) = db.execute("SELECT total(length(body)) FROM plan_bodies").fetchone()
            self._plan_count, self._plan_bytes = int(count), int(heads + bodies)

    async def close(self) -> None:
        # After the store thread's queued calls, so none finds the connection gone.
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close_connection)

    def _close_connection(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    @_in_store_thread
    def ping(self) -> None:
        with self._transaction(write=False) as db:
            db.execute("SELECT 1").fetchone()

    async def check(self, now: float, ttl_s: float) -> None:
        # The open connection keeps its file even when the path is deleted or
        # replaced under it, so this server never sees the ledger vanish; a fresh
        # file at start looks like first use (docs/deployment.md).
        await self.ping()

    # --- plans --------------------------------------------------------------------

    async def put_plan(
        self, plan_id: str, engine_id: str, plan: bytes | PlanParts, now: float
    ) -> None:
        """Queued for the store thread, which commits every plan queued by the time
        it gets to them in one transaction; returns once this one is committed."""
        loop = asyncio.get_running_loop()
        committed = loop.create_future()
        queued = (plan_id, engine_id, plan_parts(plan_id, engine_id, plan), now, committed)
        with self._queue_lock:
            self._queued_plans.append(queued)
            first = len(self._queued_plans) == 1
        if first:  # else a commit is already on its way to the store thread
            self._executor.submit(self._commit_queued_plans, loop)
        await committed

    def _commit_queued_plans(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the store thread: commit the queue, then tell its callers in one
        call on the event loop."""
        with self._queue_lock:
            batch, self._queued_plans = self._queued_plans, []
        error: BaseException | None = None
        try:
            count, size = self._plan_count, self._plan_bytes
            with self._transaction(write=True) as db:
                for plan_id, engine_id, parts, now, _ in batch:
                    count, size = self._keep_plan(db, plan_id, engine_id, parts, now, count, size)
            self._plan_count, self._plan_bytes = count, size
        except BaseException as caught:  # each caller gets it (StoreUnavailable, mostly)
            error = caught
        loop.call_soon_threadsafe(_settle_queued_plans, batch, error)

    def _keep_plan(
        self,
        db: sqlite3.Connection,
        plan_id: str,
        engine_id: str,
        parts: PlanParts,
        now: float,
        count: int,
        size: int,
    ) -> tuple[int, int]:
        """Insert one plan and drop the oldest beyond the bounds; the new totals."""
        # Delete and insert: a plan put again becomes the newest.
        replaced = db.execute(
            "DELETE FROM plans WHERE plan_id = ? RETURNING length(head), body_id", (plan_id,)
        ).fetchall()
        added = self._insert_plan(db, plan_id, engine_id, parts, now)
        count, size = count + 1, size + added
        for head_length, body_id in replaced:
            count, size = count - 1, size - head_length - self._drop_unheld_body(db, body_id)
        # Oldest first, a few rows per index lookup; the newest plan always stays.
        while count > 1 and (count > self._max_plans or size > self._max_plan_bytes):
            for seq, head_length, body_id in db.execute(
                "SELECT seq, length(head), body_id FROM plans ORDER BY seq LIMIT 16"
            ).fetchall():
                if count <= 1 or (count <= self._max_plans and size <= self._max_plan_bytes):
                    break
                db.execute("DELETE FROM plans WHERE seq = ?", (seq,))
                count, size = count - 1, size - head_length - self._drop_unheld_body(db, body_id)
        return count, size

    @staticmethod
    def _insert_plan(
        db: sqlite3.Connection, plan_id: str, engine_id: str, parts: PlanParts, now: float
    ) -> int:
        """The plan's row, and its body unless stored already; the bytes added."""
        added = len(parts.head)
        row = db.execute("SELECT id FROM plan_bodies WHERE digest = ?", (parts.digest,)).fetchone()
        if row is None:
            body, codec = _pack(parts.body)
            body_id = db.execute(
                "INSERT INTO plan_bodies (digest, body, codec) VALUES (?, ?, ?)",
                (parts.digest, body, codec),
            ).lastrowid
            added += len(body)
        else:
            body_id = row[0]
        db.execute(
            "INSERT INTO plans (plan_id, engine_id, head, body_id, stored_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (plan_id, engine_id, parts.head, body_id, now),
        )
        return added

    @staticmethod
    def _drop_unheld_body(db: sqlite3.Connection, body_id: int) -> int:
        """Delete the body if no plan holds it any more; the bytes freed."""
        if db.execute("SELECT 1 FROM plans WHERE body_id = ? LIMIT 1", (body_id,)).fetchone():
            return 0
        row = db.execute(
            "DELETE FROM plan_bodies WHERE id = ? RETURNING length(body)", (body_id,)
        ).fetchone()
        return int(row[0]) if row else 0

    @_in_store_thread
    def get_plan(self, plan_id: str) -> bytes | None:
        with self._transaction(write=False) as db:
            row = db.execute(
                "SELECT head, body, codec FROM plans JOIN plan_bodies ON plan_bodies.id = body_id "
                "WHERE plan_id = ?",
                (plan_id,),
            ).fetchone()
        return _served(*row) if row else None

    @_in_store_thread
    def plan_for_engine(self, engine_id: str) -> bytes | None:
        if not engine_id:
            return None
        with self._transaction(write=False) as db:
            row = db.execute(
                "SELECT head, body, codec FROM plans JOIN plan_bodies ON plan_bodies.id = body_id "
                "WHERE engine_id = ? ORDER BY seq DESC LIMIT 1",
                (engine_id,),
            ).fetchone()
        return _served(*row) if row else None

    @_in_store_thread
    def distinct_plan_bodies(self) -> int:
        with self._transaction(write=False) as db:
            return int(db.execute("SELECT count(*) FROM plan_bodies").fetchone()[0])

    # --- rendezvous ---------------------------------------------------------------
    # Writes share transactions (_in_shared_transaction); reads run alone.

    async def rendezvous_join(
        self,
        *,
        engine_id: str,
        world_size: int,
        template: bytes,
        rank: int,
        worker: bytes,
        now: float,
        ttl_s: float,
        max_pending: int,
        claim_timeout_s: float,
        identity: str = "",
        max_pending_per_identity: int | None = None,
    ) -> Arrival:
        return await self._in_shared_transaction(
            lambda db: self._join(
                db,
                engine_id=engine_id,
                world_size=world_size,
                template=template,
                rank=rank,
                worker=worker,
                now=now,
                ttl_s=ttl_s,
                max_pending=max_pending,
                claim_timeout_s=claim_timeout_s,
                identity=identity,
                max_pending_per_identity=max_pending_per_identity,
            )
        )

    @staticmethod
    def _join(
        db: sqlite3.Connection,
        *,
        engine_id: str,
        world_size: int,
        template: bytes,
        rank: int,
        worker: bytes,
        now: float,
        ttl_s: float,
        max_pending: int,
        claim_timeout_s: float,
        identity: str,
        max_pending_per_identity: int | None,
    ) -> Arrival:
        """The join's reads and writes; a refusal keeps rule 1's forgetting, as
        the memory store does (the shared transaction commits it)."""
        # `created < now - ttl + margin` narrows by the index; the exact test,
        # the memory store's, decides.
        horizon = now - ttl_s + _EXPIRY_MARGIN_S
        db.execute(
            "DELETE FROM rendezvous_open WHERE created < ? AND ? - created > ?",
            (horizon, now, ttl_s),
        )
        _drop_finished(db, "finished < ? AND ? - finished > ?", (horizon, now, ttl_s))
        finished = db.execute(
            "SELECT template_digest, plan, ok, codec FROM rendezvous_finished WHERE engine_id = ?",
            (engine_id,),
        ).fetchone()
        if finished is not None:
            worker_digest = db.execute(
                "SELECT worker_digest FROM rendezvous_finished_worker "
                "WHERE engine_id = ? AND rank = ?",
                (engine_id, rank),
            ).fetchone()
            planned_digest = bytes(worker_digest[0]) if worker_digest else None
            if finished[2]:
                check_finished(
                    engine_id,
                    bytes(finished[0]),
                    planned_digest,
                    template=template,
                    rank=rank,
                    worker=worker,
                )
                plan = _unpack(finished[1], finished[3])
                return Arrival("finished", result=RendezvousResult(True, plan))
            if same_ranks(bytes(finished[0]), planned_digest, template=template, worker=worker):
                error = _unpack(finished[1], finished[3])
                return Arrival("finished", result=RendezvousResult(False, error))
            # A changed rank forgets the failure and joins as for a new engine.
            _drop_finished(db, "engine_id = ?", (engine_id,))
        entry = db.execute(
            "SELECT world_size, template, claimed_at FROM rendezvous_open WHERE engine_id = ?",
            (engine_id,),
        ).fetchone()
        if entry is None:
            pending = db.execute("SELECT count(*) FROM rendezvous_open").fetchone()[0]
            if pending >= max_pending:
                raise too_many_pending(pending, max_pending)
            if max_pending_per_identity is not None:
                (held,) = db.execute(
                    "SELECT count(*) FROM rendezvous_open WHERE identity = ?", (identity,)
                ).fetchone()
                if held >= max_pending_per_identity:
                    raise too_many_pending_of(identity, held, max_pending_per_identity)
            db.execute(
                "INSERT INTO rendezvous_open (engine_id, world_size, template, created, identity) "
                "VALUES (?, ?, ?, ?, ?)",
                (engine_id, world_size, template, now, identity),
            )
            open_world_size, open_template, claimed_at = world_size, template, None
        else:
            open_world_size, open_template, claimed_at = int(entry[0]), bytes(entry[1]), entry[2]
        # The engine-wide checks first (nothing written before them), then the
        # rank's: a rank already there is a retry if it sent the same bytes.
        agree = functools.partial(
            check_compatible,
            engine_id,
            open_world_size,
            open_template,
            world_size=world_size,
            template=template,
            rank=rank,
            worker=worker,
        )
        agree(None)
        inserted = db.execute(
            "INSERT INTO rendezvous_open_worker (engine_id, rank, worker, codec) "
            "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (engine_id, rank, *_pack(worker)),
        ).rowcount
        if not inserted:
            seen = db.execute(
                "SELECT worker, codec FROM rendezvous_open_worker WHERE engine_id = ? AND rank = ?",
                (engine_id, rank),
            ).fetchone()
            agree(_unpack(*seen))
        (arrived,) = db.execute(
            "SELECT count(*) FROM rendezvous_open_worker WHERE engine_id = ?", (engine_id,)
        ).fetchone()
        if arrived < open_world_size:
            return Arrival("waiting")
        if claimed_at is not None and now - float(claimed_at) <= claim_timeout_s:
            return Arrival("waiting")
        workers = db.execute(
            "SELECT worker, codec FROM rendezvous_open_worker WHERE engine_id = ? ORDER BY rank",
            (engine_id,),
        ).fetchall()
        db.execute(
            "UPDATE rendezvous_open SET claimed_at = ? WHERE engine_id = ?", (now, engine_id)
        )
        return Arrival("plan", workers=tuple(_unpack(*row) for row in workers))

    async def rendezvous_leave(self, engine_id: str, rank: int) -> None:
        await self._in_shared_transaction(lambda db: self._leave(db, engine_id, rank))

    @staticmethod
    def _leave(db: sqlite3.Connection, engine_id: str, rank: int) -> None:
        entry = db.execute(
            "SELECT claimed_at FROM rendezvous_open WHERE engine_id = ?", (engine_id,)
        ).fetchone()
        if entry is None or entry[0] is not None:
            return
        db.execute(
            "DELETE FROM rendezvous_open_worker WHERE engine_id = ? AND rank = ?",
            (engine_id, rank),
        )
        left = db.execute(
            "SELECT count(*) FROM rendezvous_open_worker WHERE engine_id = ?", (engine_id,)
        ).fetchone()[0]
        if not left:
            db.execute("DELETE FROM rendezvous_open WHERE engine_id = ?", (engine_id,))

    async def rendezvous_finish(
        self,
        engine_id: str,
        result: RendezvousResult,
        now: float,
        *,
        remember_failure: bool = False,
        max_kept_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> None:
        await self._in_shared_transaction(
            lambda db: self._finish(db, engine_id, result, now, remember_failure, max_kept_bytes)
        )
        # One server per file: its own subscribers are all there are. They run on
        # the event loop, where the waiting ranks' futures live.
        for callback in list(self._subscribers):
            try:
                callback(engine_id, result)
            except Exception:  # one broken waiter must not hide the outcome from the rest
                log.exception("rendezvous subscriber failed", extra={"engine_id": engine_id})

    @staticmethod
    def _finish(
        db: sqlite3.Connection,
        engine_id: str,
        result: RendezvousResult,
        now: float,
        remember_failure: bool,
        max_kept_bytes: int,
    ) -> None:
        entry = db.execute(
            "SELECT template FROM rendezvous_open WHERE engine_id = ?", (engine_id,)
        ).fetchone()
        if (result.ok or remember_failure) and entry is not None:
            workers = db.execute(
                "SELECT rank, worker, codec FROM rendezvous_open_worker WHERE engine_id = ?",
                (engine_id,),
            ).fetchall()
            _drop_finished(db, "engine_id = ?", (engine_id,))
            payload, codec = _pack(result.payload)
            size = kept_result_bytes(engine_id, len(payload), len(workers))
            if size <= max_kept_bytes:
                db.execute(
                    "INSERT INTO rendezvous_finished "
                    "(engine_id, template_digest, plan, finished, ok, codec, size) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (engine_id, digest(bytes(entry[0])), payload, now, int(result.ok), codec, size),
                )
                db.executemany(
                    "INSERT INTO rendezvous_finished_worker (engine_id, rank, worker_digest) "
                    "VALUES (?, ?, ?)",
                    [
                        (engine_id, rank, digest(_unpack(spec, codec)))
                        for rank, spec, codec in workers
                    ],
                )
                db.execute("UPDATE rendezvous_finished_bytes SET bytes = bytes + ?", (size,))
                _keep_within(db, max_kept_bytes)
        db.execute("DELETE FROM rendezvous_open WHERE engine_id = ?", (engine_id,))

    def subscribe(self, callback: FinishedCallback) -> None:
        self._subscribers.append(callback)

    @_in_store_thread
    def claim_engine(
        self, engine_id: str, identity: str, now: float, ttl_s: float, max_engines: int
    ) -> str:
        # A refusal keeps the expiry done before it.
        with self._transaction(write=True, commit_on=(TooManyEngines,)) as db:
            # Expired rows leave their owners' counts first (an index range: usually none).
            expired = db.execute(
                "SELECT identity, count(*) FROM engine_owner WHERE expires_at <= ? "
                "GROUP BY identity",
                (now,),
            ).fetchall()
            if expired:
                db.executemany(
                    "UPDATE engine_owner_count SET engines = engines - ? WHERE identity = ?",
                    [(count, owner) for owner, count in expired],
                )
                db.execute("DELETE FROM engine_owner_count WHERE engines <= 0")
                db.execute("DELETE FROM engine_owner WHERE expires_at <= ?", (now,))
            row = db.execute(
                "SELECT identity FROM engine_owner WHERE engine_id = ?", (engine_id,)
            ).fetchone()
            if row is not None and row[0] != identity:
                return str(row[0])
            if row is None:
                holder = _lease_holder(db, engine_id, now)
                if holder is not None and holder != identity:
                    return holder  # unowned live leases are never adopted (base.py)
                count = db.execute(
                    "SELECT engines FROM engine_owner_count WHERE identity = ?", (identity,)
                ).fetchone()
                held = int(count[0]) if count else 0
                if held >= max_engines:
                    raise TooManyEngines(held, max_engines)
                db.execute(
                    "INSERT INTO engine_owner_count (identity, engines) VALUES (?, 1) "
                    "ON CONFLICT (identity) DO UPDATE SET engines = engines + 1",
                    (identity,),
                )
            db.execute(
                "INSERT OR REPLACE INTO engine_owner (engine_id, identity, expires_at) "
                "VALUES (?, ?, ?)",
                (engine_id, identity, now + ttl_s),
            )
        return identity

    @_in_store_thread
    def engine_owner(self, engine_id: str, now: float) -> str | None:
        with self._transaction(write=False) as db:
            row = db.execute(
                "SELECT identity FROM engine_owner WHERE engine_id = ? AND expires_at > ?",
                (engine_id, now),
            ).fetchone()
            return str(row[0]) if row else _lease_holder(db, engine_id, now)

    async def put_measurement(
        self,
        config_key: str,
        engine_id: str,
        record: bytes,
        now: float,
        *,
        max_configs: int = DEFAULT_MAX_MEASURED_CONFIGS,
        max_engines: int = DEFAULT_MAX_ENGINES_PER_CONFIG,
    ) -> int:
        def put(db: sqlite3.Connection) -> int:
            # A sequence, not the clock, orders reports: a clock stepped back
            # must not make the newest report the first one dropped.
            (seq,) = db.execute(
                "SELECT coalesce(max(touched_seq), 0) + 1 FROM fleet_config"
            ).fetchone()
            db.execute(
                "INSERT OR REPLACE INTO fleet_measurement VALUES (?, ?, ?, ?, ?)",
                (config_key, engine_id, now, seq, record),
            )
            db.execute("INSERT OR REPLACE INTO fleet_config VALUES (?, ?)", (config_key, seq))
            db.execute(
                "DELETE FROM fleet_measurement WHERE config_key = ? AND engine_id NOT IN "
                "(SELECT engine_id FROM fleet_measurement WHERE config_key = ? "
                "ORDER BY seq DESC LIMIT ?)",
                (config_key, config_key, max_engines),
            )
            dropped = db.execute(
                "SELECT config_key FROM fleet_config ORDER BY touched_seq DESC LIMIT -1 OFFSET ?",
                (max_configs,),
            ).fetchall()
            for (key,) in dropped:
                db.execute("DELETE FROM fleet_config WHERE config_key = ?", (key,))
                db.execute("DELETE FROM fleet_measurement WHERE config_key = ?", (key,))
            (kept,) = db.execute(
                "SELECT count(*) FROM fleet_measurement WHERE config_key = ?", (config_key,)
            ).fetchone()
            return int(kept)

        return int(await self._in_shared_transaction(put))

    @_in_store_thread
    def measurements(self, config_key: str) -> tuple[bytes, ...]:
        with self._transaction(write=False) as db:
            rows = db.execute(
                "SELECT record FROM fleet_measurement WHERE config_key = ? ORDER BY seq DESC",
                (config_key,),
            ).fetchall()
        return tuple(bytes(row[0]) for row in rows)

    @_in_store_thread
    def rendezvous_ranks(self, engine_id: str) -> tuple[int, ...]:
        with self._transaction(write=False) as db:
            rows = db.execute(
                "SELECT rank FROM rendezvous_open_worker WHERE engine_id = ? ORDER BY rank",
                (engine_id,),
            ).fetchall()
        return tuple(int(row[0]) for row in rows)

    @_in_store_thread
    def pending_engines(self) -> int:
        with self._transaction(write=False) as db:
            return int(db.execute("SELECT count(*) FROM rendezvous_open").fetchone()[0])

    # --- ledger -------------------------------------------------------------------

    @_in_store_thread
    def grant(
        self,
        engine_id: str,
        requests: Sequence[LeaseRequest],
        devices: Mapping[str, DeviceState],
        now: float,
        ttl_s: float,
        identity: str = "",
        *,
        max_identity_leases: int | None = None,
    ) -> tuple[Lease, ...]:
        with self._transaction(write=True) as db:
            through = _expire_due(db, now)
            own = [
                _lease(row)
                for row in db.execute(
                    f"SELECT {_LEASE_COLUMNS} FROM leases WHERE engine_id = ?", (engine_id,)
                )
            ]
            mine = [lease for lease in own if counted(lease, through)]
            if max_identity_leases is not None:
                # In the grant's BEGIN IMMEDIATE transaction: no other grant between.
                live, held = _live_leases(db, identity)
                check_lease_quota(
                    identity,
                    len(requests),
                    max_identity_leases,
                    identity_leases=held - sum(lease.identity == identity for lease in mine),
                    live_leases=live - len(mine),
                )
            others = excluding(_device_totals(db, devices), mine)
            try:
                granted = grant_leases(
                    engine_id,
                    requests,
                    devices,
                    others,
                    now,
                    ttl_s,
                    identity,
                    expired_through=through,
                )
            except GrantRefused as refused:
                holders = [
                    _lease(row)
                    for row in db.execute(
                        f"SELECT {_LEASE_COLUMNS} FROM leases WHERE device_uuid = ?",
                        (refused.device_uuid,),
                    )
                ]
                raise naming_holders(refused, holders, engine_id, now) from None
            db.execute("DELETE FROM leases WHERE engine_id = ?", (engine_id,))
            # OR REPLACE: a rank asked twice keeps its last request, as in memory.
            db.executemany(
                f"INSERT OR REPLACE INTO leases ({_LEASE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [_row(lease) for lease in granted],
            )
            _count(db, removed=own, added=last_per_rank(granted))
        return granted

    @_in_store_thread
    def renew(
        self, engine_id: str, allocations: Mapping[int, int], now: float, ttl_s: float
    ) -> tuple[Lease, ...]:
        with self._transaction(write=True) as db:
            mine = [
                _lease(row)
                for row in db.execute(
                    f"SELECT {_LEASE_COLUMNS} FROM leases WHERE engine_id = ? ORDER BY rank",
                    (engine_id,),
                )
            ]
            renewed = renew_leases(engine_id, mine, allocations, now, ttl_s, _expired_through(db))
            db.executemany(
                "UPDATE leases SET expires_at = ?, allocated_bytes = ? "
                "WHERE engine_id = ? AND rank = ?",
                [
                    (lease.expires_at, lease.allocated_bytes, engine_id, lease.rank)
                    for lease in renewed
                ],
            )
            old = {lease.rank: lease for lease in mine}
            _count(db, removed=[old[lease.rank] for lease in renewed], added=renewed)
        return renewed

    @_in_store_thread
    def release(self, engine_id: str, rank: int | None, now: float) -> tuple[Lease, ...]:
        where = "engine_id = ?" if rank is None else "engine_id = ? AND rank = ?"
        params: tuple[object, ...] = (engine_id,) if rank is None else (engine_id, rank)
        with self._transaction(write=True) as db:
            released = [
                _lease(row)
                for row in db.execute(
                    f"SELECT {_LEASE_COLUMNS} FROM leases WHERE {where} ORDER BY rank", params
                )
            ]
            db.execute(f"DELETE FROM leases WHERE {where}", params)
            _count(db, removed=released, added=())
        return tuple(lease for lease in released if lease.live(now))

    @_in_store_thread
    def ledger_view(
        self,
        now: float,
        device_uuids: Sequence[str],
        *,
        engine_id: str = "",
        identity: str = "",
    ) -> LedgerView:
        # A read unless something fell due since the last ledger call.
        with self._transaction(write=False) as db:
            if not _due(db, now, limit=1):
                return self._view(db, device_uuids, engine_id, identity)
        with self._transaction(write=True) as db:
            _expire_due(db, now)
            return self._view(db, device_uuids, engine_id, identity)

    @staticmethod
    def _view(
        db: sqlite3.Connection, device_uuids: Sequence[str], engine_id: str, identity: str
    ) -> LedgerView:
        through = _expired_through(db)
        own = [
            lease
            for lease in map(
                _lease,
                db.execute(
                    f"SELECT {_LEASE_COLUMNS} FROM leases WHERE engine_id = ?", (engine_id,)
                ),
            )
            if counted(lease, through)
        ]
        others = excluding(_device_totals(db, device_uuids), own)
        live, held = _live_leases(db, identity)
        return LedgerView(
            devices={uuid: others[uuid] for uuid in device_uuids},
            live_leases=live - len(own),
            identity_leases=held - sum(lease.identity == identity for lease in own),
        )

    @_in_store_thread
    def engine_leases(self, engine_id: str, now: float) -> tuple[Lease, ...]:
        with self._transaction(write=False) as db:
            return tuple(
                _lease(row)
                for row in db.execute(
                    f"SELECT {_LEASE_COLUMNS} FROM leases WHERE engine_id = ? AND expires_at > ? "
                    "ORDER BY rank",
                    (engine_id, now),
                )
            )

    @_in_store_thread
    def leases(self, now: float) -> tuple[Lease, ...]:
        with self._transaction(write=False) as db:
            return tuple(
                _lease(row)
                for row in db.execute(
                    f"SELECT {_LEASE_COLUMNS} FROM leases WHERE expires_at > ? "
                    "ORDER BY engine_id, rank",
                    (now,),
                )
            )

    @_in_store_thread
    def sweep_expired(self, now: float) -> tuple[Lease, ...]:
        with self._transaction(write=True) as db:
            _expire_due(db, now)
            expired = tuple(
                _lease(row)
                for row in db.execute(
                    f"SELECT {_LEASE_COLUMNS} FROM leases WHERE expires_at <= ? "
                    "ORDER BY engine_id, rank",
                    (now,),
                )
            )
            db.execute("DELETE FROM leases WHERE expires_at <= ?", (now,))
        return expired
