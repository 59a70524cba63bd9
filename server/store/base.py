"""The store contract: plans, rank-mode rendezvous state and the lease ledger.

Every backend (memory, SQLite, Redis) implements `Store` with the same
behaviour; tests/server/test_store_contract.py runs one suite against all.

- Every method is atomic: it sees and leaves a consistent state even when
  several servers (Redis) or threads (SQLite) call at once.
- Time is passed in (`now`, seconds since the epoch), so expiry is testable and
  all replicas measure against the same wall clock.
- Conflicts a caller can act on raise `ServiceError` with its gRPC code; a
  backend that cannot be reached raises `StoreUnavailable` (-> UNAVAILABLE),
  never a half-applied change.
- The ledger's arithmetic is `kvplan.core.ledger`: a backend keeps each
  device's `Totals` and each identity's live-lease count, changed by
  `changes` / `identity_changes` with every write, and calls `grant_leases` on
  them, in one transaction. No ledger call reads every lease: a grant, renewal,
  release or `ledger_view` costs the same with 10 or 10,000 live leases, plus
  the leases that fell due since the last call (an index on expires_at finds
  them). Only a refusal reads the refused device's leases, to name the holders,
  and `leases` (tests, diagnostics) reads them all.
- Expiry is exact: a call first expires what is due at its `now` (takes it out
  of the totals) and records the `now` it expired through; `counted` says which
  leases the totals hold. The rows stay until `sweep_expired` deletes and
  reports them. Grants and renewals are stamped at `ledger_time(now,
  expired_through)`, never behind that mark, so a clock stepped back (or a
  replica behind another) cannot write a lease the totals never count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, Protocol

from kvplan.core.ledger import DeviceState, Lease, LeaseRequest, Totals
from kvplan.server.store.bodies import PlanParts

DEFAULT_MAX_PLANS = 4096
# Serialized plans kept by a store. A 64-layer, 8-worker hybrid plan is ~35 KB,
# so the default holds ~1,900 of them.
DEFAULT_MAX_PLAN_BYTES = 64 * 1024 * 1024
# Finished rank-mode results (plans, remembered failures) kept for ranks that
# arrive late or retry, by the bytes they hold (kept_result_bytes).
DEFAULT_MAX_RESULT_BYTES = 64 * 1024 * 1024
# Fleet measurements (docs/capacity.md): configurations kept, and engines kept per
# configuration (newest first; an engine's new report replaces its old one). A
# record is one engine's serialized EngineMeasurement, at most a few KB.
DEFAULT_MAX_MEASURED_CONFIGS = 1024
DEFAULT_MAX_ENGINES_PER_CONFIG = 16
DIGEST_BYTES = 32  # SHA-256: of a template, of each rank's spec


def kept_result_bytes(engine_id: str, stored_payload_bytes: int, ranks: int) -> int:
    """What a finished engine's result counts against the bound: its engine id,
    its plan (or error) as the store keeps it, and the digests of its template
    and of each rank's spec (so that a flood of tiny results is bounded too)."""
    return len(engine_id.encode()) + stored_payload_bytes + DIGEST_BYTES * (ranks + 1)


class StoreUnavailable(Exception):
    """The backend cannot be reached or failed mid-call; nothing was changed."""

    retry_after_s = 1.0

    def caller_message(self) -> str:
        """What the caller is told, with UNAVAILABLE."""
        return f"the state store cannot be reached ({self}); retry shortly"


class StoreNotPersistent(StoreUnavailable):
    """The backend answers but would lose leases on a restart (Redis without
    AOF, found at a health tick): grants are refused until that is fixed."""

    retry_after_s = 10.0

    def caller_message(self) -> str:
        return f"grants are refused: {self}"


class StoreLostState(StoreUnavailable):
    """The store lost its data (a Redis restarted empty or replaced) and so the
    leases it held: grants are paused until `resume_at` (one lease TTL after
    the loss was found), so that no byte is promised twice."""

    def __init__(self, where: str, resume_at: float) -> None:
        resume = datetime.fromtimestamp(resume_at, UTC).strftime("%H:%M:%S UTC")
        left = max(0.0, resume_at - time.time())
        super().__init__(
            f"store {where} lost its data (restarted empty or replaced): the leases it "
            f"held are unknown, so grants are paused until {resume} (in {left:.0f} s, one "
            "lease TTL after the loss was found, when every lost lease has expired); "
            "retry then. Renewals of lost leases answer this too until then"
        )
        self.resume_at = resume_at
        self.retry_after_s = max(1.0, math.ceil(left))

    def caller_message(self) -> str:
        return str(self)


class TooManyEngines(Exception):
    """A claim of a new engine refused: the identity already owns `held` live
    engines, and `limit` is the most it may own."""

    def __init__(self, held: int, limit: int) -> None:
        super().__init__(f"identity owns {held} live engines; the limit is {limit}")
        self.held = held
        self.limit = limit


class TooManyLeases(Exception):
    """A grant refused by the lease quota: the identity holds `held` live leases
    of other engines, `wanted` more would take it past `limit`."""

    def __init__(self, held: int, wanted: int, limit: int) -> None:
        super().__init__(
            f"identity holds {held} live leases of other engines and asks for {wanted} more; "
            f"the limit is {limit}"
        )
        self.held = held
        self.wanted = wanted
        self.limit = limit


def check_lease_quota(
    identity: str, wanted: int, limit: int | None, *, identity_leases: int, live_leases: int
) -> None:
    """Raise TooManyLeases unless `identity` may hold `wanted` new leases.

    `identity_leases` / `live_leases`: the identity's and everyone's live leases,
    the granting engine's own left out (its grant replaces them). "" (a server
    without authentication, where one identity makes every call) counts every
    live lease. A store calls this inside its grant's atomic section, so grants
    at once cannot all pass it; `limit` None: no quota."""
    if limit is None or not wanted:
        return
    held = identity_leases if identity else live_leases
    if held + wanted > limit:
        raise TooManyLeases(held, wanted, limit)


@dataclass(frozen=True)
class RendezvousResult:
    """How a rendezvous ended: a plan (serialized PlanResponse) or an error
    (serialized google.rpc.Status)."""

    ok: bool
    payload: bytes


@dataclass(frozen=True)
class Arrival:
    """What `rendezvous_join` tells the joining rank.

    - "waiting": the engine is not complete; wait for `subscribe`'s callback.
    - "plan": this rank completed the engine (exactly one caller gets it, or a
      retry after the previous claimer vanished): plan `workers` (each rank's
      serialized WorkerSpec, in rank order) and call `rendezvous_finish`.
    - "finished": the engine was planned before and this rank's spec matches
      the planned one: `result` is the plan.
    """

    state: Literal["waiting", "plan", "finished"]
    workers: tuple[bytes, ...] = ()
    result: RendezvousResult | None = None


FinishedCallback = Callable[[str, RendezvousResult], None]


@dataclass(frozen=True)
class LedgerView:
    """The ledger at a moment, one engine's own leases left out (it is about to
    replace them; none when no engine is named)."""

    devices: Mapping[str, Totals]  # each asked device (NOTHING: no live lease on it)
    live_leases: int  # every live lease
    identity_leases: int  # live leases held by the asked identity


class Store(Protocol):
    """Backends: memory (tests, `--store memory`), SQLite (the embedded default),
    Redis (several replicas behind one address)."""

    kind: str  # "memory", "sqlite", "redis"

    async def start(self) -> None:
        """Connect / open; SQLite also drops rendezvous claims a killed server left."""

    async def close(self) -> None: ...

    async def ping(self) -> None:
        """Raise StoreUnavailable unless the backend answers."""

    async def check(self, now: float, ttl_s: float) -> None:
        """Every health tick: raise StoreUnavailable unless the backend answers and
        still keeps what it was given (Redis: its persistence, unless allowed off,
        and its epoch; StoreLostState while grants are paused after a loss, for
        `ttl_s`, one lease TTL, from when the loss was found)."""

    # --- plans ------------------------------------------------------------------

    async def put_plan(
        self, plan_id: str, engine_id: str, plan: bytes | PlanParts, now: float
    ) -> None:
        """Keep a serialized PlanResponse (or its parts, already split); `engine_id`
        (may be "") then names it. Kept by content (store/bodies.py): plans with
        equal bodies hold one copy. Durable once this returns (SQLite, Redis).
        Bounded: the oldest plans beyond the store's `max_plans`, or beyond
        `max_plan_bytes` of heads and distinct bodies, are dropped (the newest
        always stays)."""

    async def get_plan(self, plan_id: str) -> bytes | None: ...

    async def distinct_plan_bodies(self) -> int:
        """Plan bodies stored: plans of equal content share one (tests, diagnostics)."""

    async def plan_for_engine(self, engine_id: str) -> bytes | None:
        """The engine's newest plan (engine mode or a finished rendezvous)."""

    # --- rank-mode rendezvous ---------------------------------------------------

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
        """Record rank `rank`'s serialized WorkerSpec for `engine_id`, an engine
        of `identity` (its owner; "" without authentication).

        `template` is the deterministic serialization of the request without its
        workers (engine options, spec decode, world size): every rank must send
        the same. Rules, checked in this order:
        1. Open rendezvous older than `ttl_s` and finished engines older than
           `ttl_s` are forgotten first.
        2. A finished engine: a rank whose template and worker bytes equal the
           planned ones gets state "finished" (a late joiner or restarted
           rank); otherwise FAILED_PRECONDITION (field "workers[0]").
        2b. A failed engine (`remember_failure`): a rank whose template and
           worker bytes equal the failed ones gets state "finished" with the
           error as `result`; any other rank forgets the failure and goes on
           as for a new engine (a changed spec may succeed).
        3. An open one: world_size must match (INVALID_ARGUMENT, "world_size"),
           the template too (INVALID_ARGUMENT, "options"); a rank already there
           with other bytes is INVALID_ARGUMENT ("workers[0].rank"); with the
           same bytes it is a retry and is accepted.
        4. A new engine when `max_pending` engines are open, or when
           `max_pending_per_identity` of `identity`'s are (None: no share, as
           without authentication): RESOURCE_EXHAUSTED with the numbers. One
           tenant cannot fill the server's rendezvous and block the others.
        5. When all `world_size` ranks are present and nobody claimed the
           planning, or the claim is older than `claim_timeout_s` (its server
           died), this caller claims it: state "plan". Otherwise "waiting".
        """

    async def rendezvous_leave(self, engine_id: str, rank: int) -> None:
        """A waiting rank gave up (deadline, cancel): drop it from an open,
        unclaimed rendezvous; an empty rendezvous is deleted."""

    async def rendezvous_finish(
        self,
        engine_id: str,
        result: RendezvousResult,
        now: float,
        *,
        remember_failure: bool = False,
        max_kept_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> None:
        """The claimer's outcome. A plan: the engine becomes finished (its
        ranks' worker digests kept for rule 2, the plan kept to answer late
        joiners; `plan_for_engine` sees it through the servicer's `put_plan`,
        not through this). An error: the rendezvous is deleted, so the ranks
        can retry from scratch; with `remember_failure` it is kept as a failed
        engine instead (rule 2b). Either way every subscriber on every replica
        is called with `(engine_id, result)`.

        Kept results hold at most `max_kept_bytes` (`kept_result_bytes` each):
        the oldest finished engines are forgotten first, as if their TTL had
        passed. A result larger than the bound is not kept at all (and makes
        no other forgotten)."""

    def subscribe(self, callback: FinishedCallback) -> None:
        """Call `callback` (on the event loop) for every finished rendezvous,
        this replica's and the others'."""

    async def pending_engines(self) -> int: ...

    # --- engine ownership ---------------------------------------------------------

    async def claim_engine(
        self, engine_id: str, identity: str, now: float, ttl_s: float, max_engines: int
    ) -> str:
        """Atomically: the engine's owner. An engine without a live owner (none,
        or not used for `ttl_s`) becomes `identity`'s, unless `identity` already
        owns `max_engines` live engines (raises TooManyEngines; expired records
        do not count); the owner's own claim pushes its expiry to now + ttl_s and
        is never refused. Another identity's claim changes nothing and returns
        the owner.

        Unowned live leases are never adopted: an engine with no live owner
        record whose live leases are held by another identity (in practice "",
        leases granted while the server ran without authentication) is not
        claimed; the call returns that holder ("") and changes nothing. Only an
        operator acts on such an engine (without owning it); otherwise its leases
        expire after one lease TTL and the engine is free to claim."""

    async def engine_owner(self, engine_id: str, now: float) -> str | None:
        """The engine's live owner; without a live owner record, the holder of
        its live leases ("" for leases granted without authentication); None
        when neither exists."""

    async def rendezvous_ranks(self, engine_id: str) -> tuple[int, ...]:
        """Ranks present in the engine's open rendezvous (empty if none)."""

    # --- lease ledger -----------------------------------------------------------

    async def grant(
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
        """Atomically: expire what is due, check the quota with
        `check_lease_quota` (`identity`'s live leases of other engines plus
        `requests` at most `max_identity_leases`, else TooManyLeases; None: no
        quota), check `requests` with `grant_leases` against the other engines'
        totals (GrantRefused, naming the refused device's holdings, propagates),
        then replace every lease of `engine_id` by the new ones (allocated_bytes
        = in_use_bytes, expires_at = ledger_time + ttl_s, held by `identity`). A refusal
        changes nothing. Returns the new leases in request order."""

    async def renew(
        self,
        engine_id: str,
        allocations: Mapping[int, int],
        now: float,
        ttl_s: float,
    ) -> tuple[Lease, ...]:
        """Heartbeat: push expires_at of the engine's live leases to ledger_time + ttl_s;
        `allocations` (rank -> bytes held on the device) updates allocated_bytes
        of those ranks (others keep theirs). NOT_FOUND (field "engine_id") when
        the engine has no lease at all; FAILED_PRECONDITION when all its leases
        expired (the memory may be granted elsewhere: plan again)."""

    async def release(self, engine_id: str, rank: int | None, now: float) -> tuple[Lease, ...]:
        """Delete the engine's leases (or one rank's); returns the live ones deleted."""

    async def ledger_view(
        self,
        now: float,
        device_uuids: Sequence[str],
        *,
        engine_id: str = "",
        identity: str = "",
    ) -> LedgerView:
        """Expire what is due, then the totals of `device_uuids`, the live-lease
        count and `identity`'s, all without `engine_id`'s leases."""

    async def engine_leases(self, engine_id: str, now: float) -> tuple[Lease, ...]:
        """The engine's live leases, by rank."""

    async def leases(self, now: float) -> tuple[Lease, ...]:
        """Every live lease, by engine then rank (reads them all: tests, diagnostics)."""

    # --- fleet measurements -------------------------------------------------------

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
        """Atomically keep `record` (a serialized EngineMeasurement) as `engine_id`'s
        for `config_key`, replacing the engine's earlier one. Bounded: beyond
        `max_engines` the configuration's oldest reports are dropped, beyond
        `max_configs` the configurations reported to least recently. Returns the
        engines now kept for `config_key`."""

    async def measurements(self, config_key: str) -> tuple[bytes, ...]:
        """The records kept for `config_key`, newest first."""

    async def sweep_expired(self, now: float) -> tuple[Lease, ...]:
        """Expire what is due, then delete and return the leases whose expiry
        passed, by engine then rank (they already count for nothing; this is
        bookkeeping for metrics and disk)."""
