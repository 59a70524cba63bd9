"""The KVCachePlanner servicer: convert, delegate to the core, respond."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict

import grpc
import grpc.aio

from kvplan.convert import plan_from_proto, plan_id_for
from kvplan.core.errors import PlanningError
from kvplan.server.config import Settings
from kvplan.server.devices import Device
from kvplan.server.errors import ServiceError, to_status
from kvplan.server.metrics import Metrics
from kvplan.server.rendezvous import Rendezvous
from kvplan.v1 import plan_pb2, service_pb2, service_pb2_grpc

log = logging.getLogger("kvplan.server")


class PlanCache:
    """Bounded, content-addressed plans: plan id -> serialized response, engine -> plan id.

    Plans are kept serialized: a cache hit goes out as these bytes with no
    re-serialization, and the bytes take less than half the memory of the message
    (about 33 KB against 80 KB for 8 workers x 65 layers).

    It also remembers the plan id of recent requests by their bytes' digest:
    `plan_id_for` copies and re-sorts the request (about 180 µs for 8 workers x
    65 layers, against 23 µs to hash the raw bytes), more than the rest of a cache
    hit costs the server.
    """

    def __init__(self, capacity: int, max_bytes: int = 32 * 1024 * 1024) -> None:
        self._capacity = capacity
        # Plans of large engines are big: bound the bytes too, so the server's memory
        # stays flat whatever engines it sees (the newest plan is always kept).
        self._max_bytes = max_bytes
        self._bytes = 0
        self._plans: OrderedDict[str, tuple[str, bytes]] = OrderedDict()  # id -> engine, plan
        self._by_engine: dict[str, str] = {}
        self._plan_ids: OrderedDict[bytes, str] = OrderedDict()  # request digest -> plan id

    def plan_id(self, request: plan_pb2.PlanRequest, request_digest: bytes | None = None) -> str:
        """`plan_id_for(request)`, computed once per distinct request.

        `request_digest`: the SHA-256 of bytes that parse to `request` (the bytes it
        came in as); without it, of its deterministic serialization. Equal bytes are
        an equal request, so the digest stands for the request; a remembered id stays
        right after its plan is evicted.
        """
        digest = (
            request_digest or hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
        )
        plan_id = self._plan_ids.get(digest)
        if plan_id is not None:
            self._plan_ids.move_to_end(digest)
            return plan_id
        plan_id = plan_id_for(request)
        self._plan_ids[digest] = plan_id
        if len(self._plan_ids) > self._capacity:
            self._plan_ids.popitem(last=False)
        return plan_id

    def get(self, plan_id: str) -> bytes | None:
        """The serialized PlanResponse."""
        entry = self._plans.get(plan_id)
        if entry is None:
            return None
        self._plans.move_to_end(plan_id)
        return entry[1]

    def for_engine(self, engine_id: str) -> bytes | None:
        plan_id = self._by_engine.get(engine_id)
        return self.get(plan_id) if plan_id else None

    def put(self, plan: plan_pb2.PlanResponse) -> bytes:
        """Keep `plan`; returns its serialization."""
        serialized = plan.SerializeToString()
        previous = self._plans.get(plan.plan_id)
        if previous is not None:
            self._bytes -= len(previous[1])
        self._plans[plan.plan_id] = (plan.engine_id, serialized)
        self._bytes += len(serialized)
        self._plans.move_to_end(plan.plan_id)
        if plan.engine_id:
            self._by_engine[plan.engine_id] = plan.plan_id
        while len(self._plans) > 1 and (
            len(self._plans) > self._capacity or self._bytes > self._max_bytes
        ):
            evicted_id, (evicted_engine, evicted) = self._plans.popitem(last=False)
            self._bytes -= len(evicted)
            if self._by_engine.get(evicted_engine) == evicted_id:
                del self._by_engine[evicted_engine]
        return serialized

    @property
    def size_bytes(self) -> int:
        return self._bytes


def _only_rank(plan: plan_pb2.PlanResponse, rank: int) -> plan_pb2.PlanResponse:
    view = plan_pb2.PlanResponse()
    view.CopyFrom(plan)
    del view.workers[:]
    view.workers.extend(worker for worker in plan.workers if worker.rank == rank)
    if not view.workers:
        raise ServiceError("NOT_FOUND", f"plan {plan.plan_id} has no rank {rank}", field="rank")
    return view


def _enum(message: object, field: str) -> str:
    descriptor = message.DESCRIPTOR.fields_by_name[field].enum_type  # type: ignore[attr-defined]
    return str(descriptor.values_by_number[getattr(message, field)].name)


class PlannerServicer(service_pb2_grpc.KVCachePlannerServicer):
    def __init__(self, settings: Settings, metrics: Metrics, devices: list[Device]) -> None:
        self._settings = settings
        self._metrics = metrics
        self._devices = devices
        self._cache = PlanCache(settings.plan_cache_size, settings.plan_cache_bytes)
        self.rendezvous = Rendezvous(
            self._plan_in_background,
            metrics,
            max_pending=settings.max_pending_rendezvous,
            ttl_s=settings.rendezvous_ttl_s,
        )

    # --- the flow: request -> validate -> plan -> budget -> respond -------------

    def _check_limits(self, request: plan_pb2.PlanRequest) -> None:
        settings = self._settings
        if len(request.workers) > settings.max_workers_per_engine:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"{len(request.workers)} workers exceed the limit of "
                f"{settings.max_workers_per_engine} per engine",
                field="workers",
            )
        for index, worker in enumerate(request.workers):
            if len(worker.layers) > settings.max_layers_per_worker:
                raise ServiceError(
                    "INVALID_ARGUMENT",
                    f"worker rank {worker.rank} sends {len(worker.layers)} layers, more than the "
                    f"limit of {settings.max_layers_per_worker}",
                    field=f"workers[{index}].layers",
                )

    async def _plan(
        self,
        request: plan_pb2.PlanRequest,
        *,
        repeats: bool = True,
        request_digest: bytes | None = None,
    ) -> bytes:
        """The serialized PlanResponse, from the cache or planned now.

        `repeats`: the same request may come again, so remember its plan id. A merged
        rendezvous request does not (a rank that comes again joins the finished engine).
        `request_digest`: see PlanCache.plan_id.
        """
        self._check_limits(request)
        plan_id = self._cache.plan_id(request, request_digest) if repeats else plan_id_for(request)
        cached = self._cache.get(plan_id)
        if cached is not None:
            self._metrics.cache_hits.inc()
            return cached
        self._metrics.cache_misses.inc()
        start = time.perf_counter()
        layers = sum(len(worker.layers) for worker in request.workers)
        if layers > self._settings.offload_layers:
            # Large engines take milliseconds: keep the event loop serving.
            response = await asyncio.to_thread(plan_from_proto, request, plan_id=plan_id)
        else:
            response = plan_from_proto(request, plan_id=plan_id)
        serialized = self._cache.put(response)
        self._record(request, response, time.perf_counter() - start)
        return serialized

    def _plan_in_background(self, request: plan_pb2.PlanRequest) -> asyncio.Future[bytes]:
        """The rendezvous' planner: a merged engine."""
        return asyncio.ensure_future(self._plan(request, repeats=False))

    def _record(
        self, request: plan_pb2.PlanRequest, response: plan_pb2.PlanResponse, seconds: float
    ) -> None:
        metrics = self._metrics
        path = _enum(response.diagnostics, "grouping_path").removeprefix("GROUPING_PATH_").lower()
        metrics.plans.labels(path).inc()
        flagged = [group for group in response.groups if group.is_draft]
        rule = "none"
        if flagged:
            rule = _enum(flagged[0], "draft_rule").removeprefix("DRAFT_RULE_").lower()
        spec_decode_on = request.spec_decode.method in (
            plan_pb2.SPEC_DECODE_METHOD_EAGLE,
            plan_pb2.SPEC_DECODE_METHOD_EAGLE3,
            plan_pb2.SPEC_DECODE_METHOD_MTP,
            plan_pb2.SPEC_DECODE_METHOD_DSPARK,
            plan_pb2.SPEC_DECODE_METHOD_DFLASH,
        )
        if spec_decode_on:
            metrics.draft_annotations.labels(rule).inc()
        engine = response.engine_id or "-"
        if response.workers:
            metrics.kv_bytes.labels(engine).set(
                max(t.size_bytes for t in response.workers[0].tensors)
                if response.workers[0].tensors
                else 0
            )
        metrics.blocks.labels(engine).set(response.num_blocks)
        log.info(
            "plan engine=%s plan_id=%s path=%s groups=%d draft_rule=%s num_blocks=%d "
            "workers=%d duration_ms=%.3f",
            engine,
            response.plan_id,
            path,
            len(response.groups),
            rule if spec_decode_on else "off",
            response.num_blocks,
            len(response.workers),
            seconds * 1000,
        )

    async def _fail(
        self, context: grpc.aio.ServicerContext, error: PlanningError | ServiceError
    ) -> None:
        self._metrics.validation_errors.labels(
            error.reason if isinstance(error, PlanningError) else error.code
        ).inc()
        await context.abort_with_status(to_status(error))

    # --- RPCs ---------------------------------------------------------------------

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
        try:
            if request.world_size:
                return await self.rendezvous.join(request, context.time_remaining())
            return await self._plan(request, request_digest=request_digest)
        except (PlanningError, ServiceError) as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error

    async def GetPlan(  # type: ignore[override]
        self, request: service_pb2.GetPlanRequest, context: grpc.aio.ServicerContext
    ) -> plan_pb2.PlanResponse | bytes:
        """The plan (serialized when whole; one rank's view is built as a message)."""
        try:
            plan: bytes | None = None
            if request.plan_id:
                plan = self._cache.get(request.plan_id)
                if plan is None:
                    raise ServiceError("NOT_FOUND", f"no plan {request.plan_id!r}", field="plan_id")
            elif request.engine_id:
                plan = self._cache.for_engine(request.engine_id) or self.rendezvous.finished_plan(
                    request.engine_id
                )
                if plan is None:
                    raise ServiceError(
                        "NOT_FOUND",
                        f"engine {request.engine_id!r} has no plan (yet)",
                        field="engine_id",
                    )
            else:
                raise ServiceError(
                    "INVALID_ARGUMENT", "give a plan_id or an engine_id", field="plan_id"
                )
            if request.HasField("rank"):
                return _only_rank(plan_pb2.PlanResponse.FromString(plan), request.rank)
            return plan
        except ServiceError as error:
            await self._fail(context, error)
            raise AssertionError("unreachable") from error

    async def ListDevices(
        self, request: service_pb2.ListDevicesRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ListDevicesResponse:
        return service_pb2.ListDevicesResponse(
            probe="static",
            devices=[
                service_pb2.Device(
                    uuid=device.uuid,
                    name=device.name,
                    index=device.index,
                    total_bytes=device.total_bytes,
                    free_bytes=device.total_bytes,
                    committed_bytes=0,
                    available_to_grant_bytes=device.total_bytes,
                )
                for device in self._devices
            ],
        )

    async def Echo(
        self, request: plan_pb2.PlanRequest, context: grpc.aio.ServicerContext
    ) -> plan_pb2.PlanRequest:
        return request
