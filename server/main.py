"""`kvplan serve`: the gRPC service with health, reflection and metrics."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
import grpc.aio
from google.protobuf import message, message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kvplan import __version__
from kvplan.server import heap
from kvplan.server.config import Settings, parse_settings
from kvplan.server.guard import Drain, GuardInterceptor
from kvplan.server.large_messages import parse_message
from kvplan.server.logs import configure_logging as _configure_logging
from kvplan.server.metrics import Metrics, MetricsInterceptor
from kvplan.server.probes import DeviceProbe, ProbeUnavailable, open_probe
from kvplan.server.security import Authenticator, bind_host, is_loopback, warn_if_exposed
from kvplan.server.servicer import PlannerServicer
from kvplan.server.store import Store, StoreLostState, StoreUnavailable, open_store
from kvplan.server.tasks import cancel_and_wait
from kvplan.v1 import plan_pb2, service_pb2

log = logging.getLogger("kvplan.server")
SERVICE = service_pb2.DESCRIPTOR.services_by_name["KVCachePlanner"]
SERVICE_NAME = SERVICE.full_name
# Calls gRPC core holds before the event loop picks them up. Its default (1,000, with
# early drops above it) cancels ranks when a fleet's engines start at once: 256
# engines x 8 ranks is 2,048 calls in a burst, and a dropped rank strands its engine.
MAX_PENDING_CALLS = 16_384
MAX_PENDING_CALLS_HARD_LIMIT = 32_768
HEAP_TRIM_INTERVAL_S = 0.5  # ticks of the quiet-server heap trim (heap.py)


def configure_logging(settings: Settings) -> None:
    _configure_logging(settings.log_format, settings.log_level)


def server_options(settings: Settings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # Let clients ping every 30 s (the thin client's keepalive), no faster than 10 s.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS_HARD_LIMIT),
    ]


def _serializer(
    response_class: type[message.Message],
) -> Callable[[message.Message | bytes], bytes]:
    serialize = response_class.SerializeToString

    def serialized(response: message.Message | bytes) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return serialized


def _deserializer(request_class: type[message.Message]) -> Callable[[bytes], message.Message]:
    """A large body in pieces (the guard calls this in a worker thread for one)."""

    def deserialize(raw: bytes) -> message.Message:
        return parse_message(request_class, raw)

    return deserialize


class ReceivedPlanRequest:
    """PlanKVCache's request as received: the message and the SHA-256 of its wire
    bytes. gRPC and the interceptors keep what the deserializer returned until the
    call is answered; the handler takes the message out of it, so that only the
    servicer decides how long the parsed message lives (a waiting rank drops it)."""

    __slots__ = ("digest", "message")

    def __init__(self, request: message.Message, digest: bytes) -> None:
        self.message: message.Message | None = request
        self.digest = digest

    def take(self) -> message.Message:
        taken, self.message = self.message, None
        assert taken is not None, "the request was taken already"
        return taken


def _digesting_deserializer(
    request_class: type[message.Message],
) -> Callable[[bytes], ReceivedPlanRequest]:
    def deserialize(raw: bytes) -> ReceivedPlanRequest:
        return ReceivedPlanRequest(parse_message(request_class, raw), hashlib.sha256(raw).digest())

    return deserialize


def _plan_with_digest(
    servicer: PlannerServicer,
) -> Callable[[ReceivedPlanRequest, grpc.aio.ServicerContext], Awaitable[bytes]]:
    async def plan(received: ReceivedPlanRequest, context: grpc.aio.ServicerContext) -> bytes:
        # No local keeps the message: PlanKVCache alone decides how long it lives.
        return await servicer.PlanKVCache(
            cast(plan_pb2.PlanRequest, received.take()), context, request_digest=received.digest
        )

    return plan


def add_planner_service(servicer: PlannerServicer, server: grpc.aio.Server) -> None:
    """The generated add_KVCachePlannerServicer_to_server, except that a method may
    return its response already serialized (cached plans go out as stored bytes), and
    PlanKVCache gets the digest of its request's wire bytes with the request: the plan
    cache knows a repeated request by it without serializing the request again."""
    handlers = {}
    for method in SERVICE.methods:
        if method.client_streaming or method.server_streaming:
            raise TypeError(f"{method.full_name}: only unary methods are served")
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        behaviour: Callable[..., Awaitable[Any]] = getattr(servicer, method.name)
        deserializer: Callable[[bytes], Any] = _deserializer(request_class)
        if method.name == "PlanKVCache":
            behaviour = _plan_with_digest(servicer)
            deserializer = _digesting_deserializer(request_class)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=deserializer,
            response_serializer=_serializer(response_class),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    metrics_port: int
    health: health.aio.HealthServicer
    servicer: PlannerServicer
    metrics: Metrics
    settings: Settings
    probe: DeviceProbe
    store: Store
    drain: Drain
    host: str = ""
    _http: object | None = None
    _sweeper: asyncio.Task[None] | None = None
    _health_watch: asyncio.Task[None] | None = None
    _heap_trimmer: asyncio.Task[None] | None = None
    health_server: grpc.aio.Server | None = None
    health_port: int = 0

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: NOT_SERVING, waiting ranks get UNAVAILABLE; every call received
        is served until none is in flight or the grace period ends; calls still
        running then are answered UNAVAILABLE with a retry hint."""
        grace = self.settings.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        self.servicer.rendezvous.drain()
        cut = await self.drain.wait(grace)
        if cut:
            log.warning("drain: grace period over", extra={"answered_unavailable": cut})
        await self.server.stop(0)
        if self.health_server is not None:
            await self.health_server.stop(0)
        for task in (self._sweeper, self._health_watch, self._heap_trimmer):
            if task is not None:
                await cancel_and_wait(task)
        await self.store.close()
        self.probe.close()
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]
            self._http.server_close()  # type: ignore[attr-defined]  # its listening socket


async def _sweep_leases(servicer: PlannerServicer, interval_s: float) -> None:
    """Expired leases already count for nothing; this drops them and keeps the
    lease and device metrics current."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await servicer.sweep_expired_leases()
        except Exception as error:  # a store outage must not end the sweeper
            log.warning("lease sweep failed", extra={"error": str(error)})


async def _return_freed_memory(
    drain: Drain, interval_s: float, parked: Callable[[], int] = lambda: 0
) -> None:
    """Once the server goes quiet after calls (`parked` calls, ranks waiting for
    their engines, count as quiet): the freed heap back to the OS (server/heap.py),
    so the idle server's RSS does not keep a burst's peak."""
    quiet_trim = heap.QuietTrim(drain, parked=parked)
    while True:
        await asyncio.sleep(interval_s)
        quiet_trim.tick()


async def _watch_store(
    store: Store,
    health_servicer: health.aio.HealthServicer,
    metrics: Metrics,
    interval_s: float,
    ttl_s: float,
) -> None:
    """The planner service (kvplan.v1.KVCachePlanner) is NOT_SERVING while its
    store does not answer, keeps no data across a restart (Redis), or lost its
    data and pauses grants (store.check); the server's overall status ("") is
    not changed."""
    serving = True
    paused = False  # grants paused after the store lost its data (StoreLostState)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.wait_for(store.check(time.time(), ttl_s), timeout=max(interval_s, 1.0))
            healthy = True
            paused = False
            metrics.store_grants_paused.set(0)
        except Exception as error:
            healthy = False
            paused_now = isinstance(error, StoreLostState)
            if paused_now and not paused:
                metrics.store_losses.inc()
            paused = paused_now
            metrics.store_grants_paused.set(1 if paused else 0)
            if serving:
                log.error("store unusable: NOT_SERVING", extra={"error": str(error)})
        if healthy != serving:
            serving = healthy
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if healthy
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            # The planner service only: "" stays the process's liveness, which a
            # restart would not improve while the store is away.
            await health_servicer.set(SERVICE_NAME, status)
            metrics.store_up.set(1 if healthy else 0)
            if healthy:
                log.info("store usable again: SERVING")


async def start_server(settings: Settings) -> RunningServer:
    metrics = Metrics(
        engine_labels=settings.metrics_engine_labels, max_engine_series=settings.plan_cache_size
    )
    authenticator = Authenticator(settings)
    probe = open_probe(settings.probe, settings.devices)
    store = open_store(
        settings.store,
        settings.state_dir,
        max_plans=settings.plan_cache_size,
        max_plan_bytes=settings.store_plan_bytes,
        redis_allow_no_persistence=settings.redis_allow_no_persistence,
    )
    await store.start()
    servicer = PlannerServicer(settings, metrics, probe, store)
    drain = Drain()
    server = grpc.aio.server(
        # Metrics outermost: they count what the guard answers too.
        interceptors=[MetricsInterceptor(metrics), GuardInterceptor(authenticator, drain, metrics)],
        options=server_options(settings),
    )
    add_planner_service(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    host = bind_host(settings)
    address = f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"
    if authenticator.certificates is not None:
        port = server.add_secure_port(address, authenticator.certificates.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    warn_if_exposed(host, authenticator, tls=authenticator.certificates is not None)
    http = None
    metrics_port = 0
    if settings.metrics_port != 0:  # -1: any free port (tests)
        metrics_host = settings.metrics_host or host
        http, _ = start_http_server(
            max(settings.metrics_port, 0), addr=metrics_host, registry=metrics.registry
        )
        metrics_port = http.server_port
        if settings.metrics_engine_labels and not is_loopback(metrics_host):
            log.warning(
                "metrics carry engine ids and are served beyond loopback",
                extra={"metrics_host": metrics_host},
            )
    await server.start()
    health_server, health_port = await _start_health_server(settings, host, health_servicer)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    devices = await servicer.refresh_device_metrics()
    sweeper = asyncio.create_task(
        _sweep_leases(servicer, min(5.0, settings.lease_ttl_s / 4)), name="kvplan-lease-sweeper"
    )
    health_watch = asyncio.create_task(
        _watch_store(
            store, health_servicer, metrics, settings.health_interval_s, settings.lease_ttl_s
        ),
        name="kvplan-store-health",
    )
    heap_trimmer = asyncio.create_task(
        _return_freed_memory(drain, HEAP_TRIM_INTERVAL_S, servicer.rendezvous.waiting),
        name="kvplan-heap-trim",
    )
    log.info(
        "serving",
        extra={
            "version": __version__,
            "host": host,
            "port": port,
            "metrics_port": metrics_port,
            "health_port": health_port,
            "security": authenticator.mode,
            "probe": probe.name,
            "devices": len(devices),
            "store": store.kind,
        },
    )
    return RunningServer(
        server,
        port,
        metrics_port,
        health_servicer,
        servicer,
        metrics,
        settings,
        probe,
        store,
        drain,
        host,
        http,
        sweeper,
        health_watch,
        heap_trimmer,
        health_server,
        health_port,
    )


async def _start_health_server(
    settings: Settings, host: str, health_servicer: health.aio.HealthServicer
) -> tuple[grpc.aio.Server | None, int]:
    """The plaintext health-only listener (--health-port), or none. It shares the main
    server's HealthServicer, so it reports the same SERVING / NOT_SERVING (the planner
    service follows the store); it serves nothing else, so it needs no credentials."""
    if settings.health_port == 0:
        return None, 0
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4096)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address_host = settings.metrics_host or host
    port_wanted = max(settings.health_port, 0)
    address = (
        f"[{address_host}]:{port_wanted}"
        if ":" in address_host
        else f"{address_host}:{port_wanted}"
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the health port to {address}")
    await server.start()
    return server, port


async def _serve(settings: Settings) -> None:
    started = time.perf_counter()
    running = await start_server(settings)
    log.info("ready", extra={"seconds": round(time.perf_counter() - started, 3)})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining", extra={"grace_s": settings.grace_s})
    await running.stop()
    log.info("stopped")


# The cyclic collector's thresholds in the server process. Thousands of calls in
# flight at once (a rendezvous of a fleet) hold many live containers, which every
# full collection walks: at Python's default (700, 10, 10), 5 rendezvous of 256
# engines x 8 ranks made 16 full collections (0.46 s of 7.4 s of CPU), here none.
# Measured on the 2-core host, 2 servers x 4 rendezvous after 8,000 plans had filled
# the caches: wall 1.46-1.61 s -> 1.33-1.45 s. Plans at concurrency 1 and 16 (make
# bench-rpc, 700 / 5,000 / 20,000) moved within noise.
# Planning makes no cyclic garbage (tests/test_model_cache.py), so memory is still
# freed as soon as it is unreferenced.
GC_THRESHOLDS = (20_000, 20, 20)


def serve_main(argv: Sequence[str]) -> int:
    settings = parse_settings(argv)
    configure_logging(settings)
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        asyncio.run(_serve(settings))
    except (OSError, ProbeUnavailable, ValueError, StoreUnavailable) as error:
        log.error("cannot start", extra={"error": str(error)})
        return 1
    return 0


__all__ = ["RunningServer", "add_planner_service", "serve_main", "start_server"]
