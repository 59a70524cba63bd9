"""The in-process store: the reference behaviour of the contract, nothing
survives a restart. `--store memory`, and the tests' baseline."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvplan.core.ledger import DeviceState, Lease, LeaseRequest, grant_leases
from kvplan.server.errors import ServiceError
from kvplan.server.store.base import (
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    Arrival,
    FinishedCallback,
    RendezvousResult,
)
from kvplan.server.store.bodies import PlanParts, SharedBodies, plan_parts


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass
class _Open:
    world_size: int
    template: bytes
    created: float
    workers: dict[int, bytes] = field(default_factory=dict)
    claimed_at: float | None = None


@dataclass(frozen=True)
class _Finished:
    template_digest: bytes
    worker_digests: dict[int, bytes]
    plan: bytes  # the plan, or the serialized error of a failed engine
    finished: float
    ok: bool = True


def check_compatible(
    engine_id: str,
    open_world_size: int,
    open_template: bytes,
    seen_worker: bytes | None,
    *,
    world_size: int,
    template: bytes,
    rank: int,
    worker: bytes,
) -> None:
    if world_size != open_world_size:
        raise ServiceError(
            "INVALID_ARGUMENT",
            f"engine {engine_id!r}: world_size {world_size} disagrees with {open_world_size} "
            "sent by the first rank",
            field="world_size",
        )
    if template != open_template:
        raise ServiceError(
            "INVALID_ARGUMENT",
            f"engine {engine_id!r}: rank {rank} sent engine options or a spec-decode config "
            "that differ from the other ranks'",
            field="options",
        )
    if seen_worker is not None and seen_worker != worker:
        raise ServiceError(
            "INVALID_ARGUMENT",
            f"engine {engine_id!r}: rank {rank} already joined with a different spec",
            field="workers[0].rank",
        )


def check_finished(
    engine_id: str,
    template_digest: bytes,
    worker_digest: bytes | None,
    *,
    template: bytes,
    rank: int,
    worker: bytes,
) -> None:
    """Rule 2 of `rendezvous_join`: only an unchanged rank joins a finished engine."""
    if worker_digest == digest(worker) and template_digest == digest(template):
        return
    raise ServiceError(
        "FAILED_PRECONDITION",
        f"engine {engine_id!r} was already planned and rank {rank}'s spec differs from the "
        "planned one; plan a changed engine under a new engine_id",
        field="workers[0]",
    )


def too_many_pending(pending: int, limit: int) -> ServiceError:
    return ServiceError(
        "RESOURCE_EXHAUSTED",
        f"{pending} engines are already waiting for ranks (limit {limit}, "
        "--max-pending-rendezvous); retry later",
        details={"pending": pending, "limit": "max_pending_rendezvous", "limit_value": limit},
    )


def same_ranks(
    template_digest: bytes, worker_digest: bytes | None, *, template: bytes, worker: bytes
) -> bool:
    """Rule 2b: the rank comes back to a failed engine unchanged."""
    return worker_digest == digest(worker) and template_digest == digest(template)


def no_leases(engine_id: str) -> ServiceError:
    return ServiceError("NOT_FOUND", f"engine {engine_id!r} holds no leases", field="engine_id")


def leases_expired(engine_id: str) -> ServiceError:
    return ServiceError(
        "FAILED_PRECONDITION",
        f"every lease of engine {engine_id!r} expired; its memory may be granted to another "
        "engine: plan again",
        field="engine_id",
    )


def renew_leases(
    engine_id: str,
    mine: Sequence[Lease],
    allocations: Mapping[int, int],
    now: float,
    ttl_s: float,
) -> tuple[Lease, ...]:
    """`renew`'s outcome for the engine's leases `mine`, in rank order: every live
    one pushed to now + ttl_s with its reported allocation (shared by the backends)."""
    if not mine:
        raise no_leases(engine_id)
    live = [lease for lease in mine if lease.live(now)]
    if not live:
        raise leases_expired(engine_id)
    return tuple(
        replace(
            lease,
            expires_at=now + ttl_s,
            allocated_bytes=allocations.get(lease.rank, lease.allocated_bytes),
        )
        for lease in sorted(live, key=lambda lease: lease.rank)
    )


class MemoryStore:
    kind = "memory"

    def __init__(
        self, max_plans: int = DEFAULT_MAX_PLANS, max_plan_bytes: int = DEFAULT_MAX_PLAN_BYTES
    ) -> None:
        self._max_plans = max_plans
        self._max_plan_bytes = max_plan_bytes
        # plan id -> engine id, head, body digest (oldest first); bodies shared.
        self._plans: OrderedDict[str, tuple[str, bytes, bytes]] = OrderedDict()
        self._bodies = SharedBodies()
        self._head_bytes = 0
        self._engine_plans: dict[str, str] = {}
        self._open: dict[str, _Open] = {}
        self._finished: dict[str, _Finished] = {}
        self._leases: dict[tuple[str, int], Lease] = {}
        self._subscribers: list[FinishedCallback] = []
        self._owners: dict[str, tuple[str, float]] = {}  # engine -> owner, expires

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    # --- plans ------------------------------------------------------------------

    async def put_plan(
        self, plan_id: str, engine_id: str, plan: bytes | PlanParts, now: float
    ) -> None:
        parts = plan_parts(plan_id, engine_id, plan)
        self._bodies.hold(parts)  # before the replaced plan lets go of an equal body
        self._drop_plan(plan_id)
        self._plans[plan_id] = (engine_id, parts.head, parts.digest)
        self._head_bytes += len(parts.head)
        if engine_id:
            self._engine_plans[engine_id] = plan_id
        # Oldest first; the newest plan always stays.
        while len(self._plans) > 1 and (
            len(self._plans) > self._max_plans or self._plan_bytes > self._max_plan_bytes
        ):
            self._drop_plan(next(iter(self._plans)))

    @property
    def _plan_bytes(self) -> int:
        """What the plans hold: their heads and each distinct body once."""
        return self._head_bytes + self._bodies.size_bytes

    def _drop_plan(self, plan_id: str) -> None:
        entry = self._plans.pop(plan_id, None)
        if entry is None:
            return
        engine_id, head, body_digest = entry
        self._head_bytes -= len(head)
        self._bodies.release(body_digest)
        if self._engine_plans.get(engine_id) == plan_id:
            del self._engine_plans[engine_id]

    async def get_plan(self, plan_id: str) -> bytes | None:
        entry = self._plans.get(plan_id)
        return entry[1] + self._bodies.body(entry[2]) if entry else None

    async def plan_for_engine(self, engine_id: str) -> bytes | None:
        plan_id = self._engine_plans.get(engine_id)
        return await self.get_plan(plan_id) if plan_id else None

    async def distinct_plan_bodies(self) -> int:
        return len(self._bodies)

    # --- rendezvous -------------------------------------------------------------

    def _expire(self, now: float, ttl_s: float) -> None:
        for engine_id in [e for e, entry in self._open.items() if now - entry.created > ttl_s]:
            del self._open[engine_id]
        for engine_id in [e for e, entry in self._finished.items() if now - entry.finished > ttl_s]:
            del self._finished[engine_id]

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
    ) -> Arrival:
        self._expire(now, ttl_s)
        finished = self._finished.get(engine_id)
        if finished is not None and not finished.ok:
            if same_ranks(
                finished.template_digest,
                finished.worker_digests.get(rank),
                template=template,
                worker=worker,
            ):
                return Arrival("finished", result=RendezvousResult(False, finished.plan))
            del self._finished[engine_id]
            finished = None
        if finished is not None:
            check_finished(
                engine_id,
                finished.template_digest,
                finished.worker_digests.get(rank),
                template=template,
                rank=rank,
                worker=worker,
            )
            return Arrival("finished", result=RendezvousResult(True, finished.plan))
        entry = self._open.get(engine_id)
        if entry is None:
            if len(self._open) >= max_pending:
                raise too_many_pending(len(self._open), max_pending)
            entry = self._open[engine_id] = _Open(world_size, template, created=now)
        check_compatible(
            engine_id,
            entry.world_size,
            entry.template,
            entry.workers.get(rank),
            world_size=world_size,
            template=template,
            rank=rank,
            worker=worker,
        )
        entry.workers[rank] = worker
        if len(entry.workers) < entry.world_size:
            return Arrival("waiting")
        if entry.claimed_at is not None and now - entry.claimed_at <= claim_timeout_s:
            return Arrival("waiting")
        entry.claimed_at = now
        return Arrival("plan", workers=tuple(entry.workers[r] for r in sorted(entry.workers)))

    async def rendezvous_leave(self, engine_id: str, rank: int) -> None:
        entry = self._open.get(engine_id)
        if entry is None or entry.claimed_at is not None:
            return
        entry.workers.pop(rank, None)
        if not entry.workers:
            del self._open[engine_id]

    async def rendezvous_finish(
        self,
        engine_id: str,
        result: RendezvousResult,
        now: float,
        *,
        remember_failure: bool = False,
    ) -> None:
        entry = self._open.pop(engine_id, None)
        if (result.ok or remember_failure) and entry is not None:
            self._finished.pop(engine_id, None)  # re-inserted last: in time order
            self._finished[engine_id] = _Finished(
                template_digest=digest(entry.template),
                worker_digests={rank: digest(w) for rank, w in entry.workers.items()},
                plan=result.payload,
                finished=now,
                ok=result.ok,
            )
        for callback in self._subscribers:
            callback(engine_id, result)

    def subscribe(self, callback: FinishedCallback) -> None:
        self._subscribers.append(callback)

    async def pending_engines(self) -> int:
        return len(self._open)

    # --- ownership --------------------------------------------------------------

    async def claim_engine(self, engine_id: str, identity: str, now: float, ttl_s: float) -> str:
        for engine in [e for e, (_, expires) in self._owners.items() if expires <= now]:
            del self._owners[engine]
        owner = self._owners.get(engine_id)
        if owner is not None and owner[0] != identity:
            return owner[0]
        self._owners[engine_id] = (identity, now + ttl_s)
        return identity

    async def engine_owner(self, engine_id: str, now: float) -> str | None:
        owner = self._owners.get(engine_id)
        return owner[0] if owner is not None and owner[1] > now else None

    async def rendezvous_ranks(self, engine_id: str) -> tuple[int, ...]:
        entry = self._open.get(engine_id)
        return tuple(sorted(entry.workers)) if entry is not None else ()

    # --- ledger -----------------------------------------------------------------

    async def grant(
        self,
        engine_id: str,
        requests: Sequence[LeaseRequest],
        devices: Mapping[str, DeviceState],
        now: float,
        ttl_s: float,
    ) -> tuple[Lease, ...]:
        granted = grant_leases(
            engine_id, requests, devices, tuple(self._leases.values()), now, ttl_s
        )
        for key in [key for key in self._leases if key[0] == engine_id]:
            del self._leases[key]
        for lease in granted:
            self._leases[(engine_id, lease.rank)] = lease
        return granted

    async def renew(
        self, engine_id: str, allocations: Mapping[int, int], now: float, ttl_s: float
    ) -> tuple[Lease, ...]:
        mine = [lease for key, lease in self._leases.items() if key[0] == engine_id]
        leases = renew_leases(engine_id, mine, allocations, now, ttl_s)
        for lease in leases:
            self._leases[(engine_id, lease.rank)] = lease
        return leases

    async def release(self, engine_id: str, rank: int | None, now: float) -> tuple[Lease, ...]:
        keys = [
            key for key in self._leases if key[0] == engine_id and (rank is None or key[1] == rank)
        ]
        released = tuple(self._leases.pop(key) for key in sorted(keys))
        return tuple(lease for lease in released if lease.live(now))

    async def leases(self, now: float) -> tuple[Lease, ...]:
        return tuple(lease for _, lease in sorted(self._leases.items()) if lease.live(now))

    async def sweep_expired(self, now: float) -> tuple[Lease, ...]:
        expired = [key for key, lease in self._leases.items() if not lease.live(now)]
        return tuple(self._leases.pop(key) for key in sorted(expired))
