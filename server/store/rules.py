"""The rules every store applies alike: the rendezvous' checks on a joining rank,
the refusals a store raises, lease renewal, and what a grant keeps. The memory,
SQLite and Redis stores differ in where they keep things, not in these."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from kvplan.core.ledger import GrantRefused, Lease, counted, holdings, ledger_time
from kvplan.server.errors import ServiceError


def digest(data: bytes) -> bytes:
    """SHA-256: how stores compare templates and rank specs without keeping them."""
    return hashlib.sha256(data).digest()


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


def too_many_pending_of(identity: str, pending: int, limit: int) -> ServiceError:
    return ServiceError(
        "RESOURCE_EXHAUSTED",
        f"{pending} engines of {identity!r} are already waiting for ranks (limit {limit} per "
        "identity, --max-pending-rendezvous-per-identity); let them complete or time out, "
        "then retry",
        details={
            "pending": pending,
            "limit": "max_pending_rendezvous_per_identity",
            "limit_value": limit,
        },
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
    expired_through: float = -math.inf,
) -> tuple[Lease, ...]:
    """`renew`'s outcome for the engine's leases `mine`, in rank order: every live
    one pushed to `ledger_time` + ttl_s with its reported allocation (shared by the
    backends). A lease the store already expired (at or below `expired_through`)
    stays expired, whatever `now` says: its memory may have been granted since."""
    if not mine:
        raise no_leases(engine_id)
    held = {lease.rank for lease in mine}
    if not_held := sorted(set(allocations) - held):
        raise ServiceError(
            "FAILED_PRECONDITION",
            f"engine {engine_id!r} holds no lease for rank(s) "
            f"{', '.join(map(str, not_held))} (it holds {', '.join(map(str, sorted(held)))}); "
            "report allocations of held ranks only, or plan again",
            field="allocations",
        )
    now = ledger_time(now, expired_through)
    live = [lease for lease in mine if lease.live(now) and counted(lease, expired_through)]
    if not live:
        raise leases_expired(engine_id)
    return tuple(
        replace(
            lease,
            expires_at=now + ttl_s,
            # As at the grant: what a worker holds past its lease is not the lease's.
            allocated_bytes=min(allocations.get(lease.rank, lease.allocated_bytes), lease.bytes),
        )
        for lease in sorted(live, key=lambda lease: lease.rank)
    )


def naming_holders(
    refused: GrantRefused, leases: Iterable[Lease], engine_id: str, now: float
) -> GrantRefused:
    """A store's refusal with the other engines' live leases on the refused device."""
    return refused.held_by(holdings(refused.device_uuid, leases, now, exclude_engine=engine_id))


def last_per_rank(leases: Iterable[Lease]) -> tuple[Lease, ...]:
    """What a store keeps of a grant: a rank asked twice keeps its last request."""
    return tuple({lease.rank: lease for lease in leases}.values())
