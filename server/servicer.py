"""The KVCachePlanner servicer: convert, delegate to the core and the store,
respond. The flow of a plan, request -> authorize -> devices -> plan -> lease ->
respond, is one method: `_serve_plan`."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
import grpc.aio

from kvplan.convert import plan_from_proto
from kvplan.convert.keys import PlanKeys, plan_keys
from kvplan.convert.request import request_from_proto
from kvplan.convert.wire import WorkerBytes, encode_workers, encoded_now
from kvplan.core.errors import PlanningError
from kvplan.core.ledger import (
    MAX_LISTED_HOLDERS,
    NOTHING,
    DeviceAccount,
    DeviceState,
    GrantRefused,
    Lease,
    LeaseRequest,
    account,
    tally,
)
from kvplan.fieldcheck import MAX_64
from kvplan.model_cache import ModelCache
from kvplan.server.config import Settings
from kvplan.server.errors import RemoteStatus, ServiceError, to_status
from kvplan.server.fleet import FleetRecords
from kvplan.server.guard import current_identity, request_was_large
from kvplan.server.large_messages import (
    LARGE_MESSAGE_BYTES,
    copy_in_pieces,
    parse_message,
    serialize_in_pieces,
)
from kvplan.server.limits import RequestLimits
from kvplan.server.metrics import Metrics
from kvplan.server.plan_cache import PlanCache, PlanSummary
from kvplan.server.plan_call import Leasing, PlanCall
from kvplan.server.probes import DeviceMemory, DeviceProbe
from kvplan.server.rendezvous import Rendezvous
from kvplan.server.replies import lease_to_proto, only_rank, with_leases
from kvplan.server.store import Store, StoreUnavailable, TooManyEngines, TooManyLeases
from kvplan.server.store.base import LedgerView
from kvplan.server.store.bodies import PlanParts
from kvplan.v1 import plan_pb2, service_pb2, service_pb2_grpc

log = logging.getLogger("kvplan.server")

# Serialized bytes of one Lease in a reply besides its engine id and device uuid
# (numbers, timestamps, the device account, framing): a generous upper bound.
LEASE_REPLY_BYTES = 256
_OWNER_CACHE_SIZE = 65_536
_T = TypeVar("_T")
CHECKED_RANKS = 4096  # digests of rank requests already converted (_check_rank)


class PlannerServicer(service_pb2_grpc.KVCachePlannerServicer):
    def __init__(
        self, settings: Settings, metrics: Metrics, probe: DeviceProbe, store: Store
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._limits = RequestLimits(settings, metrics)
        self._probe = probe
        self._store = store
        self._cache = PlanCache(settings.plan_cache_size, settings.plan_cache_bytes)
        self._models = ModelCache(
            settings.model_cache_size,
            settings.model_cache_bytes,
            on_reuse=metrics.model_plans_reused.inc,
        )
        metrics.plan_cache_bytes.set_function(lambda: self._cache.size_bytes)  # read at scrape
        # engine -> (owner, when this server last confirmed it in the store, monotonic).
        # A caller's own engine confirmed within a tenth of the ownership TTL needs no
        # store round trip: its record cannot have expired or changed hands since.
        self._owners: dict[str, tuple[str, float]] = {}
        self._owner_fresh_s = settings.ownership_ttl_s / 10
        self._large_plans = asyncio.Semaphore(1)  # engines over --offload-layers
        # Digests of rank requests already converted (_check_rank), newest last.
        self._checked_ranks: OrderedDict[bytes, None] = OrderedDict()
        self.fleet = FleetRecords(store, settings, self._limits, self.authorize)
        self.rendezvous = Rendezvous(
            store,
            # Each rank's limits were checked when it arrived (world_size bounds the
            # worker count): the merged request is not walked again.
            lambda merged: self._serve_plan(
                PlanCall(merged, self._offloaded(merged), encode_workers(merged), merged=True)
            ),
            metrics,
            max_pending=settings.max_pending_rendezvous,
            max_pending_per_identity=settings.max_pending_rendezvous_per_identity,
            max_pending_bytes_per_identity=settings.max_pending_rendezvous_bytes_per_identity,
            max_pending_bytes=settings.max_pending_rendezvous_bytes,
            max_result_bytes=settings.rendezvous_result_bytes,
            ttl_s=settings.rendezvous_ttl_s,
            claim_timeout_s=settings.claim_timeout_s,
        )

    # --- the flow: request -> authorize -> devices -> plan -> lease -> respond -----

    async def _serve_plan(
        self, call: PlanCall, context: grpc.aio.ServicerContext | None = None
    ) -> bytes:
        """One engine (all its workers): the serialized PlanResponse, step by step:
        request (`_check_request`) -> authorize -> devices -> plan -> lease -> respond.

        A rank (world_size set) stops after authorize and waits for its engine's
        other ranks; the merged engine (`call.merged`) comes back in here, at
        devices. Workers that name a device (device.uuid) get their budget from the
        server's probe and ledger and a lease; the others are planned from the
        numbers they sent, and reserve nothing."""
        if not call.merged:
            await self._check_request(call)
            if call.request.engine_id:
                await self.authorize(call.request.engine_id, "plan", claim=True)
            if call.request.world_size:
                assert context is not None  # only a merged call comes without one
                return await self._join_rendezvous(call, context)
        named = [index for index, worker in enumerate(call.request.workers) if worker.device.uuid]
        if not named:
            plan, _ = await self._plan(call)
            return plan
        leasing = await self._devices(call, named)
        plan, response = await self._plan(leasing.call)
        leases = await self._lease(leasing, plan, response)
        return self._respond(leasing, plan, leases)

    async def _check_request(self, call: PlanCall) -> None:
        """The request's workers encoded once, and its limits checked."""
        call.encoded = await self._encoded_workers(call.request, call.in_thread)
        self._limits.check_request(call.request, call.encoded)

    async def _join_rendezvous(self, call: PlanCall, context: grpc.aio.ServicerContext) -> bytes:
        """A rank: checked alone, then its engine's plan once every rank is in."""
        await self._check_rank(call.request, call.encoded)
        encoded = call.encoded
        rank = self.rendezvous.rank_spec(
            call.request, encoded[0].data if len(encoded) == 1 else None
        )
        holder = self._holder(call.request.engine_id)
        del encoded
        call.let_go_of_request()  # main.py's handler and PlanKVCache let go of it too
        return await self.rendezvous.join_rank(rank, context.time_remaining(), holder)

    async def _devices(self, call: PlanCall, named: list[int]) -> Leasing:
        """The named devices' numbers in the request, and the call that plans it;
        the plan becomes the engine's (GetPlan, persisted) only once it is granted."""
        now = time.time()
        holder = self._holder(call.request.engine_id)
        resolved, devices, accounts, view = await self._resolve_devices(call, named, now)
        in_thread = call.in_thread
        encoded = await self._encoded_workers(resolved, in_thread)
        keys = await self._run(functools.partial(plan_keys, resolved, encoded), in_thread)
        planning = PlanCall(resolved, in_thread, encoded, keys=keys, publish=False)
        return Leasing(planning, named, devices, accounts, view, now, holder)

    async def _lease(
        self, leasing: Leasing, plan: bytes, response: plan_pb2.PlanResponse | None
    ) -> tuple[Lease, ...]:
        """The plan's leases granted, and the plan published as the engine's."""
        request = leasing.call.request
        keys = leasing.call.keys
        assert keys is not None  # the devices step computed them
        # Refused before anything is granted: a reply the caller cannot receive
        # must not leave leases behind.
        self._limits.check_reply_size(
            len(plan)
            + sum(
                LEASE_REPLY_BYTES + len(request.engine_id) + len(request.workers[i].device.uuid)
                for i in leasing.named
            )
        )
        leases = await self._grant(
            request,
            response or await self._parsed_plan(plan),
            leasing.devices,
            leasing.now,
            leasing.holder,
        )
        # The gauges from what this call read and wrote, not from a second reading.
        view = leasing.view
        self._metrics.leases_active.set(view.live_leases + len(leases))
        granted = tally(leases)
        for state in leasing.devices.values():
            after = view.devices[state.uuid] + granted.get(state.uuid, NOTHING)
            self._set_device_gauges(state, account(state, after))
        self._cache.name_engine(request.engine_id, keys.plan_id)
        await self._persist(keys.plan_id, request.engine_id, plan)
        return leases

    def _respond(self, leasing: Leasing, plan: bytes, leases: tuple[Lease, ...]) -> bytes:
        """The plan's bytes with its leases appended."""
        ttl_s = self._settings.lease_ttl_s
        return with_leases(
            plan,
            [lease_to_proto(lease, ttl_s, leasing.accounts[lease.device_uuid]) for lease in leases],
        )

    # --- ownership ----------------------------------------------------------------

    async def _owner_of(self, engine_id: str, now: float) -> str | None:
        known = self._owners.get(engine_id)
        if known is not None:
            return known[0]
        owner = await self._store.engine_owner(engine_id, now)
        if owner is not None:
            self._remember_owner(engine_id, owner, claimed=False)
        return owner

    def _remember_owner(self, engine_id: str, owner: str, *, claimed: bool) -> None:
        """`claimed`: the store just pushed the owner's expiry a full TTL ahead
        (a read says nothing about how long the record has left)."""
        if len(self._owners) >= _OWNER_CACHE_SIZE:
            self._owners.clear()
        self._owners[engine_id] = (owner, time.monotonic() if claimed else -math.inf)

    async def authorize(
        self, engine_id: str, action: str, *, claim: bool = False, must_be_owned: bool = False
    ) -> None:
        """Only the identity that owns an engine (created its plan or leases) may
        act on it; an operator may act on any, and that is logged. `claim`: an
        engine without a live owner becomes the caller's (its expiry pushed).
        `must_be_owned`: an engine whose ownership lapsed is an operator's alone
        (its plan outlives the record and is still its author's)."""
        identity = current_identity()
        if identity.method == "insecure":
            # Without authentication every caller is one identity: ownership decides
            # nothing, so none is recorded (records would grow with every engine id).
            return
        known = self._owners.get(engine_id)
        if (
            known is not None
            and known[0] == identity.name
            and time.monotonic() - known[1] < self._owner_fresh_s
        ):
            return
        now = time.time()
        if claim:
            try:
                owner: str | None = await self._store.claim_engine(
                    engine_id,
                    identity.name,
                    now,
                    self._settings.ownership_ttl_s,
                    self._settings.max_engines_per_identity,
                )
            except TooManyEngines as refusal:
                self._limits.limit(
                    "max_engines_per_identity",
                    refusal.held + 1,
                    f"engines identity {identity.name!r} would own with {engine_id!r} (reuse "
                    "engine ids, or let unused ones lapse: ownership ends --ownership-ttl-s "
                    "after an engine's last plan or renewal; or raise the limit)",
                    field="engine_id",
                )
                raise  # unreachable: the store refuses only at held >= the limit
            assert owner is not None
            if owner:  # "": unowned leases (store/base.py), not an identity to cache
                self._remember_owner(engine_id, owner, claimed=owner == identity.name)
        else:
            owner = await self._store.engine_owner(engine_id, now)
        if owner == identity.name or (owner is None and not must_be_owned):
            return
        if identity.operator:
            log.warning(
                "operator acts on another identity's engine",
                extra={
                    "identity": identity.name,
                    "owner": owner or "",
                    "engine_id": engine_id,
                    "action": action,
                },
            )
            return
        log.warning(
            "permission denied",
            extra={"identity": identity.name, "engine_id": engine_id, "action": action},
        )
        if owner == "":
            raise ServiceError(
                "PERMISSION_DENIED",
                f"engine {engine_id!r} holds leases granted without authentication; no "
                f"identity adopts them, so {identity.name!r} may not {action} it: they end "
                "--lease-ttl-s after their last renewal (plan the engine again then), or an "
                "operator releases them",
                field="engine_id",
            )
        if owner is None:
            raise ServiceError(
                "PERMISSION_DENIED",
                f"engine {engine_id!r} has no owner now (ownership ends --ownership-ttl-s "
                f"after its last plan or renewal); {identity.name!r} may not {action} it: "
                "plan the engine again to own it, or ask an operator",
                field="engine_id",
            )
        raise ServiceError(
            "PERMISSION_DENIED",
            f"engine {engine_id!r} belongs to another identity; {identity.name!r} may not "
            f"{action} it",
            field="engine_id",
        )

    def _holder(self, engine_id: str) -> str:
        """Whose quota an engine's leases count against: its owner as this server
        knows it (the caller, unless an operator acts on another's engine); "" on
        a server without authentication, where one identity holds every lease."""
        identity = current_identity()
        if identity.method == "insecure":
            return ""
        known = self._owners.get(engine_id)
        return known[0] if known is not None else identity.name

    def _refuse_over_quota(self, holder: str, refusal: TooManyLeases) -> None:
        """The store's refusal (it checks --max-leases-per-identity inside its grant
        transaction, so grants at once cannot overshoot) as the limit's error."""
        self._limits.limit(
            "max_leases_per_identity",
            refusal.held + refusal.wanted,
            f"live leases of identity {holder or current_identity().name!r} after this grant",
        )

    def _read_devices(self) -> tuple[DeviceMemory, ...]:
        """A fresh probe reading; a failing device or driver is the server's state,
        not the caller's mistake: UNAVAILABLE, so the client retries."""
        try:
            return self._probe.snapshot()
        except Exception as error:
            log.error("device probe failed", extra={"probe": self._probe.name, "error": str(error)})
            raise ServiceError(
                "UNAVAILABLE",
                f"the {self._probe.name} device probe failed ({error}); retry shortly",
                details={"retry_after_s": 1},
            ) from error

    def _device_state(self, device: DeviceMemory) -> DeviceState:
        return DeviceState(
            uuid=device.uuid,
            total_bytes=device.total_bytes,
            free_bytes=device.free_bytes,
            commit_limit_bytes=math.floor(device.total_bytes * self._settings.max_commit_fraction),
        )

    async def _resolve_devices(
        self, call: PlanCall, named: list[int], now: float
    ) -> tuple[plan_pb2.PlanRequest, dict[str, DeviceState], dict[str, DeviceAccount], LedgerView]:
        """The request with the named devices' numbers from the probe and ledger:
        the device's total memory, and for the free-fraction mode the bytes the
        ledger can still grant. Free memory a worker sent is dropped for named
        devices: the ledger, which knows the other engines' leases, decides."""
        request = call.request
        if not request.engine_id:
            raise ServiceError(
                "INVALID_ARGUMENT",
                "workers that name a device get leases, which are held per engine: set engine_id",
                field="engine_id",
            )
        snapshot = {device.uuid: device for device in self._read_devices()}
        resolved = await self._run(functools.partial(copy_in_pieces, request), call.in_thread)
        devices: dict[str, DeviceState] = {}
        for index in named:
            device_ref = resolved.workers[index].device
            found = snapshot.get(device_ref.uuid)
            if found is None:
                known = sorted(snapshot)
                raise ServiceError(
                    "NOT_FOUND",
                    f"worker rank {resolved.workers[index].rank} names device "
                    f"{device_ref.uuid!r}, which this server does not know (probe "
                    f"{self._probe.name}, {len(known)} devices"
                    + (f": {', '.join(known)}" if known else "")
                    + "); name one of them, or leave device.uuid empty to plan without a lease",
                    field=f"workers[{index}].device.uuid",
                    details={"known_uuids": ",".join(known), "probe": self._probe.name},
                )
            devices[found.uuid] = self._device_state(found)
            device_ref.total_memory_bytes = found.total_bytes
        # The other engines' totals (this engine's leases are replaced by its grant).
        view = await self._store.ledger_view(now, list(devices), engine_id=request.engine_id)
        accounts = {uuid: account(state, view.devices[uuid]) for uuid, state in devices.items()}
        for index in named:
            worker = resolved.workers[index]
            if worker.memory.WhichOneof("budget") == "free_memory_fraction":
                ledger = accounts[worker.device.uuid]
                # The lease covers what the worker already holds too, so that comes
                # off the policy room; physically it is already not free.
                worker.device.free_memory_bytes = max(
                    0,
                    min(
                        ledger.commit_limit_bytes
                        - ledger.committed_bytes
                        - worker.memory.device_bytes_in_use,
                        ledger.free_bytes - ledger.outstanding_bytes,
                    ),
                )
            else:
                worker.device.ClearField("free_memory_bytes")
        return resolved, devices, accounts, view

    async def _grant(
        self,
        request: plan_pb2.PlanRequest,
        plan: plan_pb2.PlanResponse,
        devices: dict[str, DeviceState],
        now: float,
        holder: str,
    ) -> tuple[Lease, ...]:
        """Leases for the workers that name a device, each its plan's footprint."""
        footprint = {worker.rank: worker.budget.footprint_bytes for worker in plan.workers}
        wanted = [
            LeaseRequest(
                rank=worker.rank,
                device_uuid=worker.device.uuid,
                bytes=footprint[worker.rank],
                in_use_bytes=worker.memory.device_bytes_in_use,
            )
            for worker in request.workers
            if worker.device.uuid
        ]
        try:
            leases = await self._store.grant(
                request.engine_id,
                wanted,
                devices,
                now,
                self._settings.lease_ttl_s,
                holder,
                max_identity_leases=self._settings.max_leases_per_identity,
            )
        except GrantRefused as refused:
            self._metrics.grants_refused.labels(refused.grant_reason).inc()
            raise await self._name_holders(refused, now) from None
        except TooManyLeases as refusal:
            self._refuse_over_quota(holder, refusal)
            raise  # unreachable: the store refuses only past the limit
        self._metrics.leases_granted.inc(len(leases))
        log.info(
            "leases granted",
            extra={
                "engine_id": request.engine_id,
                "identity": current_identity().name,
                "ranks": ",".join(str(lease.rank) for lease in leases),
                "bytes": ",".join(str(lease.bytes) for lease in leases),
                "ttl_s": self._settings.lease_ttl_s,
            },
        )
        return leases

    async def _name_holders(self, refused: GrantRefused, now: float) -> GrantRefused:
        """The refusal naming the holders the caller may see (docs/security.md):
        all without authentication or for an operator, else the caller's own."""
        identity = current_identity()
        if identity.method == "insecure" or identity.operator:
            return refused.naming(lambda engine_id: True)
        own: set[str] = set()
        for holding in refused.holdings[:MAX_LISTED_HOLDERS]:
            try:
                if await self._owner_of(holding.engine_id, now) == identity.name:
                    own.add(holding.engine_id)
            except StoreUnavailable:
                pass  # unknown owner: the id stays withheld
        return refused.naming(own.__contains__)

    async def _plan(self, call: PlanCall) -> tuple[bytes, plan_pb2.PlanResponse | None]:
        """The serialized plan: from the cache, reused from an earlier request with
        the same content (another engine of one model), or planned now; and the
        planned message (None when not planned here, which leaves only the bytes)."""
        request = call.request
        keys = call.keys
        if keys is None:
            if not call.merged and not call.in_thread:
                keys = self._cache.keys(request, call.digest, call.encoded)
            else:  # a large request's bytes are hashed in a thread
                keys = await self._run(
                    functools.partial(plan_keys, request, call.encoded), call.in_thread
                )
            call.keys = keys
        cached = self._cache.get(keys.plan_id)
        if cached is not None:
            self._metrics.cache_hits.inc()
            return cached, None
        start = time.perf_counter()
        response: plan_pb2.PlanResponse | None = None
        scope = current_identity().name
        known = self._cache.known_plan(keys, request.engine_id, scope)
        if known is not None:
            self._metrics.plans_reused.inc()
            parts, summary = known
        else:
            self._metrics.cache_misses.inc()
            response, parts = await self._planned(call, keys, scope)
            summary = PlanSummary.of(request, response)
        # Before anything keeps it: a reply the caller cannot receive is nobody's
        # plan, and must not replace the engine's last one.
        self._limits.check_reply_size(len(parts.plan))
        if known is None:
            self._cache.remember_content(keys.content, parts, summary, scope)
        self._cache.keep(keys.plan_id, request.engine_id, parts, name_engine=call.publish)
        self._record(
            request.engine_id,
            keys.plan_id,
            summary,
            time.perf_counter() - start,
            reused=known is not None,
        )
        if call.publish:
            await self._persist(keys.plan_id, request.engine_id, parts)
        return parts.plan, response

    async def _planned(
        self, call: PlanCall, keys: PlanKeys, scope: str
    ) -> tuple[plan_pb2.PlanResponse, PlanParts]:
        """Planned now, and serialized: of a model planned before (by the same
        identity, as with reused plans) only the budgets are. `call.in_thread`: planned
        in a thread, and serialized there, in pieces (a 52 MB plan: 1.1 s in one call).
        A shared-prefix what-if is planned in a thread too: its simulation may take a
        few hundred ms within its bound (docs/prefix-caching.md), which the event loop
        must not wait out."""
        request, encoded, offloaded = call.request, call.encoded, call.in_thread

        def planned() -> tuple[plan_pb2.PlanResponse, PlanParts]:
            response = plan_from_proto(
                request,
                plan_id=keys.plan_id,
                encoded_workers=encoded,
                models=self._models,
                model_key=(scope, keys.model),
            )
            serialized = (
                serialize_in_pieces(response) if offloaded else response.SerializeToString()
            )
            return response, PlanParts.of(keys.plan_id, request.engine_id, serialized)

        return await self._run(planned, offloaded or request.HasField("shared_prefix_tokens"))

    def _offloaded(self, request: plan_pb2.PlanRequest) -> bool:
        """An engine over --offload-layers: its heavy steps run in a worker thread."""
        return sum(len(worker.layers) for worker in request.workers) > self._settings.offload_layers

    async def _heavy(self, work: Callable[[], _T], request: plan_pb2.PlanRequest) -> _T:
        """`work` on a request: inline, or for one over --offload-layers in a thread,
        so that the event loop keeps serving, and one at a time. Threads share one
        GIL, so at once they finish no sooner, and each holds many times its request
        in memory (6 requests of 1024 workers x 2048 layers at once, server and
        client in one process: peak RSS 6.5 -> 5.7 GB, ListDevices worst 3.1 -> 1.5 s)."""
        return await self._run(work, self._offloaded(request))

    async def _run(self, work: Callable[[], _T], in_thread: bool) -> _T:
        """`work` inline, or in a worker thread, one large request's at a time."""
        if not in_thread:
            return work()
        async with self._large_plans:
            return await asyncio.to_thread(work)

    async def _parsed_plan(self, plan: bytes) -> plan_pb2.PlanResponse:
        """A serialized plan as a message (a large one in pieces, in a thread)."""
        parse = functools.partial(parse_message, plan_pb2.PlanResponse, plan)
        return await self._run(parse, len(plan) > LARGE_MESSAGE_BYTES)

    async def _encoded_workers(
        self, request: plan_pb2.PlanRequest, offloaded: bool
    ) -> list[WorkerBytes]:
        """`encode_workers(request)`; for an engine over --offload-layers with every
        worker's bytes and layer spans made in a thread (160 workers x 8,192 layers:
        1.1 s of serializing and scanning that held the event loop)."""
        if not offloaded:
            return encode_workers(request)  # made on first use: a cached plan needs none
        return await self._run(functools.partial(encoded_now, request), True)

    async def _persist(self, plan_id: str, engine_id: str, plan: bytes | PlanParts) -> None:
        try:
            await self._store.put_plan(plan_id, engine_id, plan, time.time())
        except StoreUnavailable as error:
            # The plan stands and is cached here; only GetPlan after a restart (or
            # on another replica) misses it.
            self._metrics.store_errors.inc()
            log.warning(
                "plan not persisted: store unavailable",
                extra={"plan_id": plan_id, "engine_id": engine_id, "error": str(error)},
            )

    def _record(
        self, engine_id: str, plan_id: str, summary: PlanSummary, seconds: float, *, reused: bool
    ) -> None:
        metrics = self._metrics
        metrics.plans.labels(summary.path).inc()
        if summary.draft_rule != "off":
            metrics.draft_annotations.labels(summary.draft_rule).inc()
        for code in summary.prefix_warnings:
            metrics.prefix_cache_warnings.labels(code).inc()
        if engine_id and metrics.engine_labels:
            metrics.record_engine(engine_id, summary.largest_tensor_bytes, summary.num_blocks)
        log.info(
            "plan reused" if reused else "plan computed",
            extra={
                "engine_id": engine_id,
                "plan_id": plan_id,
                "path": summary.path,
                "groups": summary.groups,
                "draft_rule": summary.draft_rule,
                "num_blocks": summary.num_blocks,
                "workers": summary.workers,
                "duration_ms": round(seconds * 1000, 3),
            },
        )

    # --- ledger upkeep ---------------------------------------------------------------

    def _set_device_gauges(self, device: DeviceState, ledger: DeviceAccount) -> None:
        metrics = self._metrics
        metrics.device_total.labels(device.uuid).set(device.total_bytes)
        metrics.device_free.labels(device.uuid).set(device.free_bytes)
        metrics.device_committed.labels(device.uuid).set(ledger.committed_bytes)
        metrics.device_available.labels(device.uuid).set(ledger.available_to_grant_bytes)

    async def refresh_device_metrics(self) -> list[service_pb2.Device]:
        """Every device with its ledger numbers; the device gauges follow."""
        now = time.time()
        found = self._read_devices()
        view = await self._store.ledger_view(now, [device.uuid for device in found])
        self._metrics.leases_active.set(view.live_leases)
        out = []
        for device in found:
            state = self._device_state(device)
            ledger = account(state, view.devices[device.uuid])
            self._set_device_gauges(state, ledger)
            out.append(
                service_pb2.Device(
                    uuid=device.uuid,
                    name=device.name,
                    index=device.index,
                    total_bytes=device.total_bytes,
                    free_bytes=device.free_bytes,
                    used_bytes=device.used_bytes,
                    committed_bytes=ledger.committed_bytes,
                    available_to_grant_bytes=ledger.available_to_grant_bytes,
                    commit_limit_bytes=ledger.commit_limit_bytes,
                    outstanding_bytes=ledger.outstanding_bytes,
                    live_leases=ledger.live_leases,
                    parent_uuid=device.parent_uuid,
                )
            )
        return out

    async def _refresh_quietly(self) -> None:
        """Gauges after a ledger change; the change stands even if they cannot be read."""
        try:
            await self.refresh_device_metrics()
        except (ServiceError, StoreUnavailable) as error:
            log.warning("device metrics not refreshed", extra={"error": str(error)})

    async def sweep_expired_leases(self) -> int:
        """Drop expired leases (they already count for nothing) and count them."""
        expired = await self._store.sweep_expired(time.time())
        if expired:
            self._metrics.leases_ended.labels("expired").inc(len(expired))
            for lease in expired:
                log.info(
                    "lease expired",
                    extra={
                        "engine_id": lease.engine_id,
                        "rank": lease.rank,
                        "device_uuid": lease.device_uuid,
                        "bytes": lease.bytes,
                    },
                )
            now = time.time()
            for engine_id in {lease.engine_id for lease in expired}:
                if not await self._store.engine_leases(engine_id, now):
                    self._metrics.forget_engine(engine_id)
            await self.refresh_device_metrics()
        return len(expired)

    # --- RPCs ---------------------------------------------------------------------

    async def _fail(
        self,
        context: grpc.aio.ServicerContext,
        error: PlanningError | ServiceError | RemoteStatus | StoreUnavailable,
    ) -> None:
        if isinstance(error, StoreUnavailable):
            self._metrics.store_errors.inc()
            error = ServiceError(
                "UNAVAILABLE",
                error.caller_message(),
                details={"retry_after_s": math.ceil(error.retry_after_s)},
            )
        reason = error.reason if isinstance(error, PlanningError) else error.code
        self._metrics.validation_errors.labels(reason).inc()
        await context.abort_with_status(to_status(error))

    # The stubs type the response as a message; main.add_planner_service also takes bytes.
    async def PlanKVCache(  # type: ignore[override]
        self,
        request: plan_pb2.PlanRequest,
        context: grpc.aio.ServicerContext,
        request_digest: bytes | None = None,
    ) -> bytes:
        """The plan, serialized (main.py registers a serializer that passes bytes on).

        `request_digest`: SHA-256 of the request's wire bytes, from main.py's
        deserializer, so that a repeated request is known without re-serializing it.
        """
        call = PlanCall(request, self._offloaded(request), digest=request_digest)
        del request  # the call holds it, and lets go of it while a rank waits
        try:
            return await self._serve_plan(call, context)
        except (PlanningError, ServiceError, RemoteStatus, StoreUnavailable) as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error

    async def _check_rank(
        self, request: plan_pb2.PlanRequest, encoded: Sequence[WorkerBytes]
    ) -> None:
        """A rank's own fields, converted as its engine's will be once merged: a
        mistake is its caller's INVALID_ARGUMENT now, with the paths of its own
        request, not a wait for the other ranks followed by an error every rank gets
        with the merged request's paths.

        What the conversion reads (options, spec decode, the worker but its rank) is
        checked once: tensor-parallel ranks and the engines of one model send the
        same, and converting each (175 µs for 65 layers) made a rendezvous of 256
        engines x 8 ranks 23% slower."""
        if len(encoded) != 1:
            return  # the rendezvous refuses it, naming the field
        (sent,) = encoded
        parts = (
            request.options.SerializeToString(deterministic=True),
            request.spec_decode.SerializeToString(deterministic=True),
            sent.data[sent.layers_start - len(sent.settings_key) :],  # all but the rank
        )
        key = hashlib.sha256(
            b"".join(len(part).to_bytes(8, "big") + part for part in parts)
        ).digest()
        if key in self._checked_ranks:
            self._checked_ranks.move_to_end(key)
            return
        await self._heavy(
            functools.partial(request_from_proto, request, encoded_workers=encoded), request
        )
        self._checked_ranks[key] = None
        if len(self._checked_ranks) > CHECKED_RANKS:
            self._checked_ranks.popitem(last=False)

    async def _find_plan(self, request: service_pb2.GetPlanRequest) -> bytes:
        self._limits.check_engine_id(request.engine_id)
        if len(request.plan_id) > 128:
            raise ServiceError("INVALID_ARGUMENT", "not a plan id (too long)", field="plan_id")
        if request.plan_id:
            engine_id = self._cache.engine_of(request.plan_id)
            plan = self._cache.get(request.plan_id) or await self._store.get_plan(request.plan_id)
            if plan is None:
                raise ServiceError("NOT_FOUND", f"no plan {request.plan_id!r}", field="plan_id")
            if engine_id is None:
                engine_id = (await self._parsed_plan(plan)).engine_id
            if engine_id:  # a plan of no engine (offline planning) is nobody's
                await self.authorize(engine_id, "read the plan of", must_be_owned=True)
            return plan
        if request.engine_id:
            plan = self._cache.for_engine(request.engine_id) or await self._store.plan_for_engine(
                request.engine_id
            )
            # A plan outlives its engine's ownership record: then only an operator
            # reads it (an engine id nobody owns and nobody planned is NOT_FOUND).
            await self.authorize(
                request.engine_id, "read the plan of", must_be_owned=plan is not None
            )
            if plan is None:
                raise ServiceError(
                    "NOT_FOUND",
                    f"engine {request.engine_id!r} has no plan (yet)",
                    field="engine_id",
                )
            now = time.time()
            ttl_s = self._settings.lease_ttl_s
            live = [
                lease_to_proto(lease, ttl_s)
                for lease in await self._store.engine_leases(request.engine_id, now)
            ]
            return with_leases(plan, live)
        raise ServiceError("INVALID_ARGUMENT", "give a plan_id or an engine_id", field="plan_id")

    async def GetPlan(  # type: ignore[override]
        self, request: service_pb2.GetPlanRequest, context: grpc.aio.ServicerContext
    ) -> plan_pb2.PlanResponse | bytes:
        """The plan (serialized when whole; one rank's view is built as a message).
        By engine id it carries the engine's live leases."""
        try:
            plan = await self._find_plan(request)
            if request.HasField("rank"):
                view = functools.partial(only_rank, plan, request.rank)
                return await self._run(view, len(plan) > LARGE_MESSAGE_BYTES)
            return plan
        except (ServiceError, StoreUnavailable) as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error

    def _allocations(self, request: service_pb2.RenewLeasesRequest) -> dict[int, int]:
        self._limits.limit(
            "max_workers_per_engine", len(request.allocations), "allocations", "allocations"
        )
        allocations = {}
        for index, item in enumerate(request.allocations):
            if item.allocated_bytes > MAX_64:
                raise ServiceError(
                    "INVALID_ARGUMENT",
                    f"{item.allocated_bytes} is out of range: allocated_bytes must be in "
                    f"[0, {MAX_64}]",
                    field=f"allocations[{index}].allocated_bytes",
                )
            if item.rank in allocations:
                raise ServiceError(
                    "INVALID_ARGUMENT",
                    f"rank {item.rank} is reported twice; send one allocation per rank",
                    field=f"allocations[{index}].rank",
                )
            allocations[item.rank] = item.allocated_bytes
        return allocations

    async def RenewLeases(
        self, request: service_pb2.RenewLeasesRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.RenewLeasesResponse:
        try:
            if not request.engine_id:
                raise ServiceError("INVALID_ARGUMENT", "give an engine_id", field="engine_id")
            self._limits.check_engine_id(request.engine_id)
            allocations = self._allocations(request)
            await self.authorize(request.engine_id, "renew the leases of")
            ttl_s = self._settings.lease_ttl_s
            leases = await self._store.renew(request.engine_id, allocations, time.time(), ttl_s)
            # The owner's heartbeat keeps its ownership too.
            await self.authorize(request.engine_id, "renew the leases of", claim=True)
            return service_pb2.RenewLeasesResponse(
                leases=[lease_to_proto(lease, ttl_s) for lease in leases]
            )
        except (ServiceError, StoreUnavailable) as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error

    async def ReleasePlan(
        self, request: service_pb2.ReleasePlanRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ReleasePlanResponse:
        try:
            if not request.engine_id:
                raise ServiceError("INVALID_ARGUMENT", "give an engine_id", field="engine_id")
            self._limits.check_engine_id(request.engine_id)
            await self.authorize(request.engine_id, "release the leases of")
            rank = request.rank if request.HasField("rank") else None
            released = await self._store.release(request.engine_id, rank, time.time())
            if released:
                self._metrics.leases_ended.labels("released").inc(len(released))
                log.info(
                    "leases released",
                    extra={
                        "engine_id": request.engine_id,
                        "identity": current_identity().name,
                        "ranks": ",".join(str(lease.rank) for lease in released),
                    },
                )
                if rank is None:
                    self._metrics.forget_engine(request.engine_id)
                await self._refresh_quietly()
            ttl_s = self._settings.lease_ttl_s
            return service_pb2.ReleasePlanResponse(
                released=[lease_to_proto(lease, ttl_s) for lease in released],
                released_bytes=sum(lease.bytes for lease in released),
            )
        except (ServiceError, StoreUnavailable) as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error

    async def ReportMeasurements(
        self, request: service_pb2.ReportMeasurementsRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ReportMeasurementsResponse:
        try:
            response = await self.fleet.report(request)
        except (ServiceError, StoreUnavailable) as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error
        self._metrics.measurements_reported.inc()
        return response

    async def GetMeasurements(
        self, request: service_pb2.GetMeasurementsRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.GetMeasurementsResponse:
        try:
            return await self.fleet.get(request)
        except (ServiceError, StoreUnavailable) as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error

    async def ListDevices(
        self, request: service_pb2.ListDevicesRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ListDevicesResponse:
        try:
            devices = await self.refresh_device_metrics()
        except (ServiceError, StoreUnavailable) as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error
        return service_pb2.ListDevicesResponse(probe=self._probe.name, devices=devices)

    async def Echo(  # type: ignore[override]
        self, request: plan_pb2.PlanRequest, context: grpc.aio.ServicerContext
    ) -> plan_pb2.PlanRequest | bytes:
        if request_was_large():  # parsed off the event loop: serialized off it too
            return await self._run(functools.partial(serialize_in_pieces, request), True)
        return request
