"""The lease ledger's arithmetic: what a device can still grant, and whether a
set of new leases fits. Pure: the stores call it inside their transactions.

Per device, with every byte count in bytes and only live leases counted (a lease
is live until its expiry; the engine asking is left out, since a re-plan
replaces its own leases):

    committed   = sum(lease.bytes)                                 promised in all
    outstanding = sum(max(0, lease.bytes - lease.allocated_bytes)) promised, not yet
                                                                    held on the device
    available_to_grant = max(0, min(commit_limit - committed, free - outstanding))

`commit_limit` is total x max_commit_fraction (the policy). `free` is what the
probe reads now: memory held by processes kvplan has no lease for (and the
allocated part of every lease) is already missing from it, so it is never
granted again; `outstanding` is the part of leases that free memory still
shows but that is already promised.

A new set of leases for one engine fits a device when

    committed + sum(new.bytes)                     <= commit_limit
    sum(new.bytes - new.in_use_bytes) + outstanding <= free

`in_use_bytes` is what the asking worker already holds on the device (weights it
loaded before planning): that memory is in the device's used memory, so it is
not taken from free a second time.

The stores do not add the leases up at each grant: they keep each device's
`Totals` (and each identity's live-lease count) and change them by `changes`
with every grant, renewal, release and expiry, so a grant costs the same with
ten live leases or ten thousand. Expiry stays exact: before reading totals a
store expires what is due, found by an index on `expires_at`, and records the
`now` it expired through. A lease is counted while `counted(lease,
expired_through)`; `tally` is the recount the totals must always equal.

That mark only moves forward, so a store stamps grants and renewals at
`ledger_time`, never behind it: a clock stepped back by more than a lease's TTL
(or a replica that far behind another sharing the store) would otherwise write
leases born expired, never counted, and grant their memory a second time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvplan.core.errors import InsufficientMemory


@dataclass(frozen=True)
class DeviceState:
    """One device as the probe sees it now, with the commit policy applied."""

    uuid: str
    total_bytes: int
    free_bytes: int
    commit_limit_bytes: int  # total x max_commit_fraction


@dataclass(frozen=True)
class Lease:
    engine_id: str
    rank: int
    device_uuid: str
    bytes: int  # the worker's whole footprint on the device
    allocated_bytes: int  # of those, held on the device (last heartbeat)
    granted_at: float  # seconds since the epoch
    expires_at: float
    # Whose quota the lease counts against: the engine's owner when granted ("" on a
    # server without authentication, where one identity holds every lease).
    identity: str = ""

    def live(self, now: float) -> bool:
        return self.expires_at > now

    @property
    def outstanding_bytes(self) -> int:
        return max(0, self.bytes - self.allocated_bytes)


@dataclass(frozen=True)
class LeaseRequest:
    rank: int
    device_uuid: str
    bytes: int
    in_use_bytes: int = 0  # already held by this worker on the device


@dataclass(frozen=True)
class DeviceAccount:
    """A device's ledger view (bytes)."""

    uuid: str
    total_bytes: int
    free_bytes: int
    commit_limit_bytes: int
    committed_bytes: int
    outstanding_bytes: int
    live_leases: int

    @property
    def available_to_grant_bytes(self) -> int:
        return max(
            0,
            min(
                self.commit_limit_bytes - self.committed_bytes,
                self.free_bytes - self.outstanding_bytes,
            ),
        )


@dataclass(frozen=True)
class Totals:
    """What a set of live leases adds up to on one device."""

    committed_bytes: int = 0
    outstanding_bytes: int = 0
    live_leases: int = 0

    @classmethod
    def of(cls, lease: Lease) -> Totals:
        """One lease's share of its device's totals."""
        return cls(lease.bytes, lease.outstanding_bytes, 1)

    def __add__(self, other: Totals) -> Totals:
        return Totals(
            self.committed_bytes + other.committed_bytes,
            self.outstanding_bytes + other.outstanding_bytes,
            self.live_leases + other.live_leases,
        )

    def __sub__(self, other: Totals) -> Totals:
        return Totals(
            self.committed_bytes - other.committed_bytes,
            self.outstanding_bytes - other.outstanding_bytes,
            self.live_leases - other.live_leases,
        )


NOTHING = Totals()


def ledger_time(now: float, expired_through: float) -> float:
    """The time a store stamps a grant or a renewal with: `now`, unless the store
    already expired leases through a later time (the clock stepped back, or
    another replica runs ahead). Leases then live longer than their TTL by the
    step, which holds memory a while; stamped at `now`, they would hold none on
    the ledger while the engine uses it."""
    return max(now, expired_through)


def counted(lease: Lease, expired_through: float) -> bool:
    """Whether a store's totals count `lease`: from its grant until the store
    expired leases through a time at or past its expiry."""
    return lease.expires_at > expired_through


def tally(leases: Iterable[Lease]) -> dict[str, Totals]:
    """`leases` added up per device: the recount a store's totals equal."""
    out: dict[str, Totals] = {}
    for lease in leases:
        out[lease.device_uuid] = out.get(lease.device_uuid, NOTHING) + Totals.of(lease)
    return out


def changes(removed: Iterable[Lease], added: Iterable[Lease]) -> dict[str, Totals]:
    """Per device, what replacing counted leases `removed` by `added` does to the
    totals (negative where they shrink)."""
    out = tally(added)
    for uuid, gone in tally(removed).items():
        out[uuid] = out.get(uuid, NOTHING) - gone
    return out


def identity_changes(removed: Iterable[Lease], added: Iterable[Lease]) -> dict[str, int]:
    """Per identity, the change of its live-lease count (the quota's figure)."""
    out = Counter(lease.identity for lease in added)
    out.subtract(lease.identity for lease in removed)
    return dict(out)


def excluding(totals: Mapping[str, Totals], leases: Iterable[Lease]) -> dict[str, Totals]:
    """`totals` less `leases`, which they count (an engine's own, left out of its grant)."""
    out = dict(totals)
    for uuid, own in tally(leases).items():
        out[uuid] = out.get(uuid, NOTHING) - own
    return out


def account(device: DeviceState, totals: Totals) -> DeviceAccount:
    return DeviceAccount(
        uuid=device.uuid,
        total_bytes=device.total_bytes,
        free_bytes=device.free_bytes,
        commit_limit_bytes=device.commit_limit_bytes,
        committed_bytes=totals.committed_bytes,
        outstanding_bytes=totals.outstanding_bytes,
        live_leases=totals.live_leases,
    )


@dataclass(frozen=True)
class Holding:
    """What one other engine holds on a device: its live leases there."""

    engine_id: str
    ranks: tuple[int, ...]
    bytes: int


# Holders a refusal lists one by one; the rest are summed (the message stays bounded
# however many engines share a device).
MAX_LISTED_HOLDERS = 8
WITHHELD = "another identity's engine"


def holdings(
    device_uuid: str, leases: Iterable[Lease], now: float, *, exclude_engine: str
) -> tuple[Holding, ...]:
    """The live leases on `device_uuid` per engine (other than `exclude_engine`),
    largest first, then by engine id."""
    ranks: dict[str, list[int]] = {}
    held: dict[str, int] = {}
    for lease in leases:
        if lease.device_uuid != device_uuid or not lease.live(now):
            continue
        if lease.engine_id == exclude_engine:
            continue
        ranks.setdefault(lease.engine_id, []).append(lease.rank)
        held[lease.engine_id] = held.get(lease.engine_id, 0) + lease.bytes
    return tuple(
        sorted(
            (Holding(engine, tuple(sorted(ranks[engine])), held[engine]) for engine in held),
            key=lambda h: (-h.bytes, h.engine_id),
        )
    )


class GrantRefused(InsufficientMemory):
    """A lease set does not fit a device; `reason` says which bound.

    The message and details list the other engines' holdings on that device with
    every engine id withheld; `naming` gives the same refusal with the ids a caller
    may see (docs/security.md: its own engines', or all for an operator or a server
    without authentication)."""

    def __init__(
        self,
        summary: str,
        advice: str,
        *,
        reason: str,
        details: dict[str, int | float | str],
        holdings: tuple[Holding, ...] = (),
        named: frozenset[str] = frozenset(),
    ) -> None:
        listed, text = _describe(holdings, named)
        message = f"{summary} Held by: {text}. {advice}" if holdings else f"{summary} {advice}"
        super().__init__(message, details={**details, "holdings": listed} if holdings else details)
        self.grant_reason = reason
        self.summary = summary
        self.advice = advice
        self.holdings = holdings
        self.base_details = details

    @property
    def device_uuid(self) -> str:
        return str(self.base_details["device_uuid"])

    def held_by(self, holdings: tuple[Holding, ...]) -> GrantRefused:
        """This refusal listing `holdings` (the store reads the device's leases
        only when it refuses)."""
        return GrantRefused(
            self.summary,
            self.advice,
            reason=self.grant_reason,
            details=self.base_details,
            holdings=holdings,
        )

    def naming(self, visible: Callable[[str], bool]) -> GrantRefused:
        """This refusal with the engine ids for which `visible(engine_id)` holds."""
        return GrantRefused(
            self.summary,
            self.advice,
            reason=self.grant_reason,
            details=self.base_details,
            holdings=self.holdings,
            named=frozenset(h.engine_id for h in self.holdings if visible(h.engine_id)),
        )


def _describe(holdings: tuple[Holding, ...], named: frozenset[str]) -> tuple[str, str]:
    """(details' `holdings`: `engine|ranks|bytes` per holder joined by `;`, the
    message's list), ids not in `named` withheld."""
    listed: list[str] = []
    text: list[str] = []
    for holding in holdings[:MAX_LISTED_HOLDERS]:
        ranks = " ".join(str(rank) for rank in holding.ranks)
        engine = holding.engine_id if holding.engine_id in named else ""
        listed.append(f"{engine}|{ranks}|{holding.bytes}")
        who = f"engine {engine!r}" if engine else WITHHELD
        plural = "s" if len(holding.ranks) > 1 else ""
        text.append(f"{who} (rank{plural} {_ranks(list(holding.ranks))}) {_gib(holding.bytes)} GiB")
    rest = holdings[MAX_LISTED_HOLDERS:]
    if rest:
        rest_bytes = sum(h.bytes for h in rest)
        listed.append(f"+{len(rest)}||{rest_bytes}")
        text.append(f"{len(rest)} more engine(s) {_gib(rest_bytes)} GiB")
    return ";".join(listed), ", ".join(text)


def check_grant(
    engine_id: str,
    requests: Sequence[LeaseRequest],
    devices: Mapping[str, DeviceState],
    others: Mapping[str, Totals],
) -> dict[str, DeviceAccount]:
    """Raise GrantRefused unless every device can take the engine's new leases;
    `others` are the totals of every other engine's live leases per device (a
    device missing from it holds none). Returns each touched device's account
    without the engine's own leases. The refusal lists no holdings: a store adds
    them with `held_by(holdings(...))`."""
    by_device: dict[str, list[LeaseRequest]] = {}
    for request in requests:
        by_device.setdefault(request.device_uuid, []).append(request)
    accounts: dict[str, DeviceAccount] = {}
    for uuid, wanted in by_device.items():
        device = devices[uuid]
        current = account(device, others.get(uuid, NOTHING))
        accounts[uuid] = current
        ranks = sorted(request.rank for request in wanted)
        asked = sum(request.bytes for request in wanted)
        new_outstanding = sum(max(0, r.bytes - r.in_use_bytes) for r in wanted)
        details: dict[str, int | float | str] = {
            "device_uuid": uuid,
            "ranks": _ranks(ranks),
            "requested_bytes": asked,
            "in_use_bytes": asked - new_outstanding,
            "total_bytes": device.total_bytes,
            "free_bytes": device.free_bytes,
            "commit_limit_bytes": device.commit_limit_bytes,
            "committed_bytes": current.committed_bytes,
            "outstanding_bytes": current.outstanding_bytes,
            "available_to_grant_bytes": current.available_to_grant_bytes,
        }
        who = f"engine {engine_id!r} rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"
        if current.committed_bytes + asked > device.commit_limit_bytes:
            raise GrantRefused(
                f"{who} asks for {_gib(asked)} GiB on device {uuid}, but "
                f"{_gib(current.committed_bytes)} GiB of its commit limit "
                f"{_gib(device.commit_limit_bytes)} GiB (total {_gib(device.total_bytes)} GiB) "
                f"are leased to {current.live_leases} other worker(s): "
                f"{_gib(device.commit_limit_bytes - current.committed_bytes)} GiB left.",
                "Lower gpu_memory_utilization, or release or wait for another engine's leases.",
                reason="commit_limit",
                details=details,
            )
        if new_outstanding + current.outstanding_bytes > device.free_bytes:
            raise GrantRefused(
                f"{who} needs {_gib(new_outstanding)} GiB more on device {uuid}, but only "
                f"{_gib(device.free_bytes)} GiB are free and {_gib(current.outstanding_bytes)} "
                "GiB of that are promised to other leases not yet allocated: "
                f"{_gib(current.available_to_grant_bytes)} GiB can be granted.",
                "Memory used by processes without a lease counts as taken. Lower "
                "gpu_memory_utilization or free memory on the device.",
                reason="free_memory",
                details=details,
            )
    return accounts


def grant_leases(
    engine_id: str,
    requests: Sequence[LeaseRequest],
    devices: Mapping[str, DeviceState],
    others: Mapping[str, Totals],
    now: float,
    ttl_s: float,
    identity: str = "",
    *,
    expired_through: float = -math.inf,
) -> tuple[Lease, ...]:
    """`check_grant`, then the engine's new leases (in request order), held by
    `identity` and stamped at `ledger_time`: what a store writes in place of the
    engine's old ones, in the same transaction."""
    check_grant(engine_id, requests, devices, others)
    now = ledger_time(now, expired_through)
    return tuple(
        Lease(
            engine_id=engine_id,
            rank=request.rank,
            device_uuid=request.device_uuid,
            bytes=request.bytes,
            allocated_bytes=min(request.in_use_bytes, request.bytes),
            granted_at=now,
            expires_at=now + ttl_s,
            identity=identity,
        )
        for request in requests
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f}"
