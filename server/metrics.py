"""Prometheus metrics: the standard gRPC server set plus kvplan's own."""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
)

from kvplan import __version__


class Metrics:
    """All metrics of one server, in its own registry."""

    def __init__(self, *, engine_labels: bool = False, max_engine_series: int = 4096) -> None:
        self.registry = CollectorRegistry()
        # Engines with series, oldest first: at most max_engine_series of them.
        self._engines: OrderedDict[str, None] = OrderedDict()
        self._max_engine_series = max_engine_series
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter(
            "grpc_server_started_total",
            "RPCs started on the server.",
            labels,
            registry=self.registry,
        )
        self.handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by status code.",
            [*labels, "grpc_code"],
            registry=self.registry,
        )
        self.handling = Histogram(
            "grpc_server_handling_seconds",
            "Time to handle an RPC on the server.",
            labels,
            buckets=(
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
            ),
            registry=self.registry,
        )
        self.plans = Counter(
            "kvplan_plans_total",
            "Plans computed, by grouping path.",
            ["grouping_path"],
            registry=self.registry,
        )
        self.draft_annotations = Counter(
            "kvplan_draft_annotations_total",
            "Plans with spec decode on, by the rule that identified the draft group "
            '("none": no group identified).',
            ["rule"],
            registry=self.registry,
        )
        self.prefix_cache_warnings = Counter(
            "kvplan_prefix_cache_warnings_total",
            "Engines planned with each prefix-cache warning code (docs/prefix-caching.md): "
            "cache_off, unidentified_drafter, large_hit_unit, boundary_only, draft_drop.",
            ["code"],
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "kvplan_plan_cache_hits_total", "Plans served from the cache.", registry=self.registry
        )
        self.cache_misses = Counter(
            "kvplan_plan_cache_misses_total", "Plans computed afresh.", registry=self.registry
        )
        self.plan_cache_bytes = Gauge(
            "kvplan_plan_cache_bytes",
            "Bytes of serialized plans the in-memory plan cache holds: heads and distinct "
            "bodies, at most --plan-cache-bytes.",
            registry=self.registry,
        )
        self.plans_reused = Counter(
            "kvplan_plans_reused_total",
            "Plans of new engines reused from an earlier request equal to theirs but for "
            "the engine id (another engine of one model), not planned again.",
            registry=self.registry,
        )
        self.model_plans_reused = Counter(
            "kvplan_model_plans_reused_total",
            "Plans of a model planned before (another engine, other memory): budgeted only.",
            registry=self.registry,
        )
        self.rendezvous_waiting = Gauge(
            "kvplan_rendezvous_waiting_ranks",
            "Ranks waiting for their engine's other ranks.",
            registry=self.registry,
        )
        self.rendezvous_wait = Histogram(
            "kvplan_rendezvous_wait_seconds",
            "Time a rank waited for its engine's plan.",
            registry=self.registry,
        )
        # Per-engine series only when asked (--metrics-engine-labels): engine ids are
        # the callers' names, and one series per engine grows without bound. Their
        # series are removed when the engine's leases end (forget_engine).
        self.kv_bytes: Gauge | None = None
        self.blocks: Gauge | None = None
        if engine_labels:
            self.kv_bytes = Gauge(
                "kvplan_planned_kv_bytes",
                "KV cache bytes planned per worker, by engine.",
                ["engine_id"],
                registry=self.registry,
            )
            self.blocks = Gauge(
                "kvplan_planned_blocks",
                "KV cache blocks planned per rank, by engine.",
                ["engine_id"],
                registry=self.registry,
            )
        self.validation_errors = Counter(
            "kvplan_validation_errors_total",
            "Rejected requests, by reason.",
            ["reason"],
            registry=self.registry,
        )
        # The ledger (issue: budgets and leases).
        self.device_total = Gauge(
            "kvplan_device_total_bytes",
            "Device memory, by device.",
            ["device_uuid"],
            registry=self.registry,
        )
        self.device_free = Gauge(
            "kvplan_device_free_bytes",
            "Free device memory as the probe last read it, by device.",
            ["device_uuid"],
            registry=self.registry,
        )
        self.device_committed = Gauge(
            "kvplan_device_committed_bytes",
            "Bytes promised to live leases, by device.",
            ["device_uuid"],
            registry=self.registry,
        )
        self.device_available = Gauge(
            "kvplan_device_available_to_grant_bytes",
            "Bytes a new lease could still get, by device.",
            ["device_uuid"],
            registry=self.registry,
        )
        self.leases_active = Gauge("kvplan_leases_active", "Live leases.", registry=self.registry)
        self.leases_granted = Counter(
            "kvplan_leases_granted_total", "Leases granted.", registry=self.registry
        )
        self.leases_ended = Counter(
            "kvplan_leases_ended_total",
            'Leases that ended, by how ("released", "expired", "replaced").',
            ["reason"],
            registry=self.registry,
        )
        self.measurements_reported = Counter(
            "kvplan_measurements_reported_total",
            "Engines' start-up measurements kept (ReportMeasurements).",
            registry=self.registry,
        )
        self.grants_refused = Counter(
            "kvplan_grants_refused_total",
            'Lease grants refused, by the bound hit ("commit_limit", "free_memory").',
            ["reason"],
            registry=self.registry,
        )
        self.store_errors = Counter(
            "kvplan_store_errors_total",
            "Calls that failed because the store could not be reached.",
            registry=self.registry,
        )
        self.store_grants_paused = Gauge(
            "kvplan_store_grants_paused",
            "1 while grants are paused because the store lost its data (a Redis restarted "
            "empty or replaced), for one lease TTL; else 0.",
            registry=self.registry,
        )
        self.store_losses = Counter(
            "kvplan_store_losses_total",
            "Pauses of grants this replica's health ticks saw begin: the store lost its data.",
            registry=self.registry,
        )
        self.limits_hit = Counter(
            "kvplan_limits_hit_total",
            "Calls refused by a server limit, by the limit's setting (max_message_bytes: "
            "--max-message-bytes).",
            ["limit"],
            registry=self.registry,
        )
        self.unexpected_errors = Counter(
            "kvplan_unexpected_errors_total",
            "Handler exceptions answered INTERNAL (each logged with its request id).",
            registry=self.registry,
        )
        self.store_up = Gauge(
            "kvplan_store_up",
            "1 while the store answers the health check's ping, 0 while it does not (the "
            "planner service is NOT_SERVING then).",
            registry=self.registry,
        )
        self.store_up.set(1)
        # process_cpu_seconds_total, process_resident_memory_bytes, ... (Linux /proc):
        # the registry is the server's own, so the default one's collector is not in it.
        ProcessCollector(registry=self.registry)
        build = Info("kvplan_build", "kvplan build information.", registry=self.registry)
        build.info({"version": __version__})

    @property
    def engine_labels(self) -> bool:
        """Whether per-engine series are kept (--metrics-engine-labels)."""
        return self.kv_bytes is not None

    def record_engine(self, engine_id: str, kv_bytes: int, blocks: int) -> None:
        if self.kv_bytes is None or self.blocks is None:
            return
        self.kv_bytes.labels(engine_id).set(kv_bytes)
        self.blocks.labels(engine_id).set(blocks)
        self._engines[engine_id] = None
        self._engines.move_to_end(engine_id)
        while len(self._engines) > self._max_engine_series:
            self.forget_engine(next(iter(self._engines)))

    def forget_engine(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)
        for gauge in (self.kv_bytes, self.blocks):
            if gauge is not None:
                with contextlib.suppress(KeyError):
                    gauge.remove(engine_id)


def _split(method: str) -> tuple[str, str]:
    _, service, name = method.split("/", 2)
    return service, name


HandlerCache = dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]]


def wrapped_once(
    cache: HandlerCache,
    method: str,
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[grpc.RpcMethodHandler, str], grpc.RpcMethodHandler],
) -> grpc.RpcMethodHandler:
    """`wrap(handler, method)`, built once per method and served from `cache` while
    the server hands out the same handler (interceptors see every call)."""
    known = cache.get(method)
    if known is not None and known[0] is handler:
        return known[1]
    wrapped = wrap(handler, method)
    cache[method] = (handler, wrapped)
    return wrapped


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every unary RPC with the usual grpc_server_* names.

    Each method's handler is wrapped once, with its label children bound once: the
    wrapping and the label lookups are per-method work, not per-call work.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        # method -> (the handler as served, the observed handler wrapping it)
        self._observed: HandlerCache = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        return wrapped_once(self._observed, handler_call_details.method, handler, self._observe)

    def _observe(self, handler: grpc.RpcMethodHandler, full_method: str) -> grpc.RpcMethodHandler:
        service, method = _split(full_method)
        metrics = self._metrics
        inner = handler.unary_unary
        started = metrics.started.labels("unary", service, method)
        handling = metrics.handling.labels("unary", service, method)
        handled: dict[grpc.StatusCode, Any] = {}  # code -> its counter child

        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started.inc()
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return await inner(request, context)
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                if code is grpc.StatusCode.OK and context.code() is not None:
                    code = context.code()
                if not isinstance(code, grpc.StatusCode):
                    code = grpc.StatusCode.UNKNOWN
                counter = handled.get(code)
                if counter is None:
                    counter = handled[code] = metrics.handled.labels(
                        "unary", service, method, code.name
                    )
                counter.inc()
                handling.observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(
            observed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
