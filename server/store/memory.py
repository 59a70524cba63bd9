"""The in-process store: the reference behaviour of the contract, nothing
survives a restart. `--store memory`, and the tests' baseline."""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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
from kvplan.server.store.base import (
    DEFAULT_MAX_ENGINES_PER_CONFIG,
    DEFAULT_MAX_MEASURED_CONFIGS,
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    DEFAULT_MAX_RESULT_BYTES,
    Arrival,
    FinishedCallback,
    LedgerView,
    RendezvousResult,
    TooManyEngines,
    check_lease_quota,
    kept_result_bytes,
)
from kvplan.server.store.bodies import KeptPlans, PlanParts, plan_parts
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

_E = TypeVar("_E")
_K = TypeVar("_K")


@dataclass
class _Open:
    world_size: int
    template: bytes
    created: float
    workers: dict[int, bytes] = field(default_factory=dict)
    claimed_at: float | None = None
    identity: str = ""


@dataclass(frozen=True)
class _Finished:
    template_digest: bytes
    worker_digests: dict[int, bytes]
    plan: bytes  # the plan, or the serialized error of a failed engine
    finished: float
    ok: bool = True
    size: int = 0  # kept_result_bytes


class _TimeIndex(Generic[_K]):
    """Keys of a dict by a time of their entry (an expiry, a creation), so that
    what is due is found without looking at the other entries. A heap: an entry
    removed or re-timed meanwhile leaves a stale item behind, skipped when popped
    (the entry's time differs), and the heap is rebuilt before stale items
    outnumber the entries."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, _K]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, when: float, key: _K) -> None:
        heapq.heappush(self._heap, (when, key))

    def pop_due(
        self, is_due: Callable[[float], bool], time_of: Callable[[_K], float | None]
    ) -> Iterator[_K]:
        """The keys whose time is due, soonest first; `time_of`: the entry's time
        now (None: gone), so that stale items are skipped."""
        while self._heap and is_due(self._heap[0][0]):
            when, key = heapq.heappop(self._heap)
            if time_of(key) == when:
                yield key

    def compact(self, live: Callable[[], Iterable[tuple[float, _K]]], count: int) -> None:
        """Rebuild from the `count` live entries once stale items could outnumber them."""
        if len(self._heap) > 2 * count + 64:
            self._heap = list(live())
            heapq.heapify(self._heap)


def _forget_old(
    index: _TimeIndex[str],
    entries: dict[str, _E],
    made_of: Callable[[_E], float],
    now: float,
    ttl_s: float,
) -> list[_E]:
    """Delete the entries made more than `ttl_s` before `now` (the exact test);
    returns them."""

    def made(key: str) -> float | None:
        entry = entries.get(key)
        return made_of(entry) if entry is not None else None

    forgotten = [entries.pop(key) for key in index.pop_due(lambda when: now - when > ttl_s, made)]
    index.compact(lambda: ((made_of(entry), key) for key, entry in entries.items()), len(entries))
    return forgotten


class MemoryStore:
    kind = "memory"

    def __init__(
        self, max_plans: int = DEFAULT_MAX_PLANS, max_plan_bytes: int = DEFAULT_MAX_PLAN_BYTES
    ) -> None:
        self._plans = KeptPlans(max_plans, max_plan_bytes)  # oldest first
        self._open: dict[str, _Open] = {}
        self._open_of: Counter[str] = Counter()  # identity -> its engines in _open
        self._finished: dict[str, _Finished] = {}  # oldest first
        self._finished_bytes = 0  # their kept_result_bytes
        # The ledger: leases by engine then rank; the totals of the counted ones
        # (see kvplan.core.ledger) per device and per identity; every lease's expiry
        # in a heap (an entry is stale once its lease is gone or renewed); the
        # expired leases the next sweep deletes.
        self._engines: dict[str, dict[int, Lease]] = {}
        # The same leases by device: a refusal names the holders of one device.
        self._on_device: dict[str, dict[tuple[str, int], Lease]] = {}
        self._totals: dict[str, Totals] = {}
        self._identities: dict[str, int] = {}
        self._live = 0
        self._expired_through = -math.inf
        self._expiry: _TimeIndex[tuple[str, int]] = _TimeIndex()
        self._lease_count = 0
        self._to_sweep: dict[tuple[str, int], Lease] = {}
        self._open_by_age: _TimeIndex[str] = _TimeIndex()
        self._finished_by_age: _TimeIndex[str] = _TimeIndex()
        self._subscribers: list[FinishedCallback] = []
        self._owners: dict[str, tuple[str, float]] = {}  # engine -> owner, expires
        self._engines_owned: dict[str, int] = {}  # identity -> its records in _owners
        # Each record's expiry: expired records leave in expiry order, each claim
        # paying for its own.
        self._owner_expiry: _TimeIndex[str] = _TimeIndex()
        # Fleet measurements: config key -> engine -> record, least recent first.
        self._measured: OrderedDict[str, OrderedDict[str, bytes]] = OrderedDict()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def check(self, now: float, ttl_s: float) -> None:
        return None  # lives and dies with the process: nothing to lose under it

    # --- plans ------------------------------------------------------------------

    async def put_plan(
        self, plan_id: str, engine_id: str, plan: bytes | PlanParts, now: float
    ) -> None:
        self._plans.keep(plan_id, engine_id, plan_parts(plan_id, engine_id, plan))

    async def get_plan(self, plan_id: str) -> bytes | None:
        return self._plans.get(plan_id)

    async def plan_for_engine(self, engine_id: str) -> bytes | None:
        plan_id = self._plans.plan_of(engine_id)
        return self._plans.get(plan_id) if plan_id else None

    async def distinct_plan_bodies(self) -> int:
        return self._plans.distinct_bodies

    # --- rendezvous -------------------------------------------------------------

    def _expire(self, now: float, ttl_s: float) -> None:
        for entry in _forget_old(
            self._open_by_age, self._open, lambda entry: entry.created, now, ttl_s
        ):
            self._closed(entry)
        forgotten = _forget_old(
            self._finished_by_age, self._finished, lambda entry: entry.finished, now, ttl_s
        )
        self._finished_bytes -= sum(entry.size for entry in forgotten)

    def _closed(self, entry: _Open) -> None:
        """An open rendezvous left `_open`: its identity holds one fewer."""
        self._open_of[entry.identity] -= 1
        if not self._open_of[entry.identity]:
            del self._open_of[entry.identity]

    def _drop_open(self, engine_id: str) -> _Open | None:
        entry = self._open.pop(engine_id, None)
        if entry is not None:
            self._closed(entry)
        return entry

    def _drop_finished(self, engine_id: str) -> None:
        self._finished_bytes -= self._finished.pop(engine_id).size

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
            self._drop_finished(engine_id)
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
            held = self._open_of[identity]
            if max_pending_per_identity is not None and held >= max_pending_per_identity:
                raise too_many_pending_of(identity, held, max_pending_per_identity)
            entry = self._open[engine_id] = _Open(
                world_size, template, created=now, identity=identity
            )
            self._open_of[identity] = held + 1
            self._open_by_age.add(now, engine_id)
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
            self._drop_open(engine_id)

    async def rendezvous_finish(
        self,
        engine_id: str,
        result: RendezvousResult,
        now: float,
        *,
        remember_failure: bool = False,
        max_kept_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> None:
        entry = self._drop_open(engine_id)
        if (result.ok or remember_failure) and entry is not None:
            if engine_id in self._finished:
                self._drop_finished(engine_id)
            size = kept_result_bytes(engine_id, len(result.payload), len(entry.workers))
            if size <= max_kept_bytes:
                self._finished_by_age.add(now, engine_id)
                self._finished[engine_id] = _Finished(
                    template_digest=digest(entry.template),
                    worker_digests={rank: digest(w) for rank, w in entry.workers.items()},
                    plan=result.payload,
                    finished=now,
                    ok=result.ok,
                    size=size,
                )
                self._finished_bytes += size
                while self._finished_bytes > max_kept_bytes:  # the oldest go first
                    self._drop_finished(next(iter(self._finished)))
        for callback in self._subscribers:
            callback(engine_id, result)

    def subscribe(self, callback: FinishedCallback) -> None:
        self._subscribers.append(callback)

    async def pending_engines(self) -> int:
        return len(self._open)

    # --- ownership --------------------------------------------------------------

    async def claim_engine(
        self, engine_id: str, identity: str, now: float, ttl_s: float, max_engines: int
    ) -> str:
        self._expire_owners(now)
        owner = self._owners.get(engine_id)
        if owner is not None and owner[0] != identity:
            return owner[0]
        if owner is None:
            holder = self._lease_holder(engine_id, now)
            if holder is not None and holder != identity:
                return holder  # unowned live leases are never adopted (base.py)
            held = self._engines_owned.get(identity, 0)
            if held >= max_engines:
                raise TooManyEngines(held, max_engines)
            self._engines_owned[identity] = held + 1
        expires = now + ttl_s
        self._owners[engine_id] = (identity, expires)
        self._owner_expiry.add(expires, engine_id)
        self._owner_expiry.compact(
            lambda: ((expires, engine) for engine, (_, expires) in self._owners.items()),
            len(self._owners),
        )
        return identity

    def _expire_owners(self, now: float) -> None:
        """Forget the records expired by `now` (they stop counting for their owner)."""

        def expiry(engine_id: str) -> float | None:
            record = self._owners.get(engine_id)
            return record[1] if record is not None else None

        for engine_id in self._owner_expiry.pop_due(lambda expires: expires <= now, expiry):
            identity, _ = self._owners.pop(engine_id)
            left = self._engines_owned[identity] - 1
            if left:
                self._engines_owned[identity] = left
            else:
                del self._engines_owned[identity]

    async def engine_owner(self, engine_id: str, now: float) -> str | None:
        owner = self._owners.get(engine_id)
        if owner is not None and owner[1] > now:
            return owner[0]
        return self._lease_holder(engine_id, now)

    def _lease_holder(self, engine_id: str, now: float) -> str | None:
        """Who holds the engine's live leases (one grant: one identity), or None."""
        held = self._engines.get(engine_id, {})
        return next((lease.identity for lease in held.values() if lease.live(now)), None)

    async def rendezvous_ranks(self, engine_id: str) -> tuple[int, ...]:
        entry = self._open.get(engine_id)
        return tuple(sorted(entry.workers)) if entry is not None else ()

    # --- ledger -----------------------------------------------------------------

    def _lease(self, engine_id: str, rank: int) -> Lease | None:
        return self._engines.get(engine_id, {}).get(rank)

    def _count(self, removed: Iterable[Lease], added: Iterable[Lease]) -> None:
        """Take `removed` out of the totals and put `added` in (the counted ones)."""
        gone = [lease for lease in removed if counted(lease, self._expired_through)]
        new = [lease for lease in added if counted(lease, self._expired_through)]
        for uuid, change in changes(gone, new).items():
            after = self._totals.get(uuid, NOTHING) + change
            if after.live_leases:
                self._totals[uuid] = after
            else:
                self._totals.pop(uuid, None)
        for identity, step in identity_changes(gone, new).items():
            held = self._identities.get(identity, 0) + step
            if held:
                self._identities[identity] = held
            else:
                self._identities.pop(identity, None)
        self._live += len(new) - len(gone)

    def _put(self, lease: Lease) -> None:
        held = self._engines.setdefault(lease.engine_id, {})
        self._lease_count += lease.rank not in held
        if lease.rank in held:
            self._unindex(held[lease.rank])
        held[lease.rank] = lease
        self._on_device.setdefault(lease.device_uuid, {})[lease.engine_id, lease.rank] = lease
        self._expiry.add(lease.expires_at, (lease.engine_id, lease.rank))
        self._expiry.compact(
            lambda: (
                (lease.expires_at, (lease.engine_id, lease.rank))
                for leases in self._engines.values()
                for lease in leases.values()
            ),
            self._lease_count,
        )

    def _delete(self, engine_id: str, ranks: Iterable[int]) -> None:
        held = self._engines[engine_id]
        for rank in ranks:
            self._unindex(held.pop(rank))
            self._lease_count -= 1
        if not held:
            del self._engines[engine_id]

    def _unindex(self, lease: Lease) -> None:
        on_device = self._on_device[lease.device_uuid]
        del on_device[lease.engine_id, lease.rank]
        if not on_device:
            del self._on_device[lease.device_uuid]

    def _expire_due(self, now: float) -> None:
        """Take the leases due at `now` out of the totals (the heap's head only)."""

        def expiry(key: tuple[str, int]) -> float | None:
            lease = self._lease(*key)
            return lease.expires_at if lease is not None else None

        due: dict[tuple[str, int], Lease] = {}
        for key in self._expiry.pop_due(lambda expires_at: expires_at <= now, expiry):
            lease = self._lease(*key)
            assert lease is not None
            due[key] = lease  # a key pushed twice with one time is due once
        self._count(removed=due.values(), added=())
        self._to_sweep.update(due)
        self._expired_through = max(self._expired_through, now)

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
        self._expire_due(now)
        own = tuple(self._engines.get(engine_id, {}).values())
        mine = [lease for lease in own if counted(lease, self._expired_through)]
        # No await from here to the write: the check and the grant are one step.
        check_lease_quota(
            identity,
            len(requests),
            max_identity_leases,
            identity_leases=self._identities.get(identity, 0)
            - sum(lease.identity == identity for lease in mine),
            live_leases=self._live - len(mine),
        )
        others = excluding({uuid: self._totals.get(uuid, NOTHING) for uuid in devices}, mine)
        try:
            granted = grant_leases(
                engine_id,
                requests,
                devices,
                others,
                now,
                ttl_s,
                identity,
                expired_through=self._expired_through,
            )
        except GrantRefused as refused:
            on_device = self._on_device.get(refused.device_uuid, {}).values()
            raise naming_holders(refused, on_device, engine_id, now) from None
        kept = last_per_rank(granted)
        if own:
            self._delete(engine_id, [lease.rank for lease in own])
        for lease in kept:
            self._put(lease)
        self._count(removed=own, added=kept)
        return granted

    async def renew(
        self, engine_id: str, allocations: Mapping[int, int], now: float, ttl_s: float
    ) -> tuple[Lease, ...]:
        mine = sorted(self._engines.get(engine_id, {}).values(), key=lambda lease: lease.rank)
        renewed = renew_leases(engine_id, mine, allocations, now, ttl_s, self._expired_through)
        old = {lease.rank: lease for lease in mine}
        for lease in renewed:
            self._put(lease)
        self._count(removed=[old[lease.rank] for lease in renewed], added=renewed)
        return renewed

    async def release(self, engine_id: str, rank: int | None, now: float) -> tuple[Lease, ...]:
        held = self._engines.get(engine_id, {})
        released = tuple(held[key] for key in sorted(held) if rank is None or key == rank)
        if released:
            self._delete(engine_id, [lease.rank for lease in released])
            self._count(removed=released, added=())
        return tuple(lease for lease in released if lease.live(now))

    async def ledger_view(
        self,
        now: float,
        device_uuids: Sequence[str],
        *,
        engine_id: str = "",
        identity: str = "",
    ) -> LedgerView:
        self._expire_due(now)
        own = [
            lease
            for lease in self._engines.get(engine_id, {}).values()
            if counted(lease, self._expired_through)
        ]
        others = excluding({uuid: self._totals.get(uuid, NOTHING) for uuid in device_uuids}, own)
        return LedgerView(
            devices={uuid: others[uuid] for uuid in device_uuids},
            live_leases=self._live - len(own),
            identity_leases=self._identities.get(identity, 0)
            - sum(lease.identity == identity for lease in own),
        )

    async def engine_leases(self, engine_id: str, now: float) -> tuple[Lease, ...]:
        held = self._engines.get(engine_id, {})
        return tuple(held[rank] for rank in sorted(held) if held[rank].live(now))

    async def leases(self, now: float) -> tuple[Lease, ...]:
        return tuple(
            held[rank]
            for engine_id, held in sorted(self._engines.items())
            for rank in sorted(held)
            if held[rank].live(now)
        )

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
        engines = self._measured.setdefault(config_key, OrderedDict())
        self._measured.move_to_end(config_key)
        engines.pop(engine_id, None)
        engines[engine_id] = record
        while len(engines) > max_engines:
            engines.popitem(last=False)
        while len(self._measured) > max_configs:
            self._measured.popitem(last=False)
        return len(engines)

    async def measurements(self, config_key: str) -> tuple[bytes, ...]:
        return tuple(reversed(self._measured.get(config_key, {}).values()))

    async def sweep_expired(self, now: float) -> tuple[Lease, ...]:
        self._expire_due(now)
        swept: list[Lease] = []
        for key, lease in list(self._to_sweep.items()):
            if self._lease(*key) != lease:
                del self._to_sweep[key]  # released, re-granted or renewed since
            elif not lease.live(now):
                del self._to_sweep[key]
                self._delete(key[0], [key[1]])
                swept.append(lease)
        return tuple(sorted(swept, key=lambda lease: (lease.engine_id, lease.rank)))
