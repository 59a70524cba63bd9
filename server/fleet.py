"""The fleet's measurements: ReportMeasurements and GetMeasurements.

An engine's plugin reports what vLLM measured at its start (each worker's
available KV memory and, where the release exposes them, weights, activation
peak, CUDA-graph memory) under its configuration's fingerprint; the store keeps
a bounded record per configuration (store/base.py, `put_measurement`). The
servicer validates, authorizes and delegates here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable

from kvplan.client.fleet import config_key, normalized, runtime_matches
from kvplan.core.rules import RULE_SETS
from kvplan.fieldcheck import MAX_64
from kvplan.server.config import Settings
from kvplan.server.errors import ServiceError
from kvplan.server.guard import current_identity
from kvplan.server.limits import RequestLimits
from kvplan.server.store.base import Store
from kvplan.v1 import service_pb2

Authorize = Callable[..., Awaitable[None]]
_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_RELEASES = sorted(key for key in RULE_SETS if key)


def _invalid(field: str, message: str) -> ServiceError:
    return ServiceError("INVALID_ARGUMENT", message, field=field)


class FleetRecords:
    def __init__(
        self, store: Store, settings: Settings, limits: RequestLimits, authorize: Authorize
    ) -> None:
        self._store = store
        self._settings = settings
        self._limits = limits
        self._authorize = authorize

    def _text(self, value: str, field: str, *, required: bool) -> None:
        if required and not value.strip():
            raise _invalid(field, f"{field} is required")
        limit = self._settings.max_identifier_chars
        if len(value) > limit:
            self._limits.limit("max_identifier_chars", len(value), f"{field} length", field)

    def check_fingerprint(self, fingerprint: service_pb2.ConfigFingerprint, where: str) -> None:
        """Every configuration field is required: a record under a partial key would
        answer for configurations it was never measured on."""
        if not _HEX_DIGEST.match(fingerprint.model_config_hash.strip().lower()):
            raise _invalid(
                f"{where}.model_config_hash",
                "expected the SHA-256 hex digest of the model's config.json "
                "(kvplan.client.fleet.model_config_hash), 64 hex digits, got "
                f"{fingerprint.model_config_hash[:80]!r}",
            )
        if fingerprint.engine_version.strip().lower() not in _RELEASES:
            raise _invalid(
                f"{where}.engine_version",
                f"expected one of {', '.join(_RELEASES)} (the release that measured), got "
                f"{fingerprint.engine_version[:80]!r}",
            )
        for name in ("gpu_name", "dtype"):
            self._text(getattr(fingerprint, name), f"{where}.{name}", required=True)
        for name in (
            "kv_cache_dtype",
            "quantization",
            "cuda_graphs",
            "model",
            "limit_mm_per_prompt",
        ):
            self._text(getattr(fingerprint, name), f"{where}.{name}", required=False)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(fingerprint, name) < 1:
                raise _invalid(f"{where}.{name}", f"{name} must be at least 1")
        workers = fingerprint.tensor_parallel_size * fingerprint.pipeline_parallel_size
        self._limits.limit(
            "max_workers_per_engine", workers, "workers (TP x PP)", f"{where}.tensor_parallel_size"
        )

    def _check_workers(self, request: service_pb2.ReportMeasurementsRequest) -> None:
        fingerprint = request.fingerprint
        expected = fingerprint.tensor_parallel_size * fingerprint.pipeline_parallel_size
        if len(request.workers) != expected:
            raise _invalid(
                "workers",
                f"{len(request.workers)} workers reported; TP {fingerprint.tensor_parallel_size}"
                f" x PP {fingerprint.pipeline_parallel_size} is {expected}: report every rank once",
            )
        seen: set[int] = set()
        for index, worker in enumerate(request.workers):
            where = f"workers[{index}]"
            if worker.rank >= expected or worker.rank in seen:
                raise _invalid(
                    f"{where}.rank",
                    f"rank {worker.rank} is out of range or repeated: ranks are 0..{expected - 1}",
                )
            seen.add(worker.rank)
            if not 0 < worker.total_bytes <= MAX_64:
                raise _invalid(f"{where}.total_bytes", "the device's total must be given (> 0)")
            if not 0 < worker.requested_bytes <= worker.total_bytes:
                raise _invalid(
                    f"{where}.requested_bytes",
                    f"{worker.requested_bytes} must be in [1, total_bytes = {worker.total_bytes}]"
                    ": what vLLM requested, ceil(total x gpu_memory_utilization)",
                )
            if not 0 < worker.available_kv_bytes <= worker.requested_bytes:
                raise _invalid(
                    f"{where}.available_kv_bytes",
                    f"{worker.available_kv_bytes} must be in [1, requested_bytes = "
                    f"{worker.requested_bytes}]",
                )
            for name in ("weights_bytes", "activation_peak_bytes", "cuda_graph_bytes"):
                if worker.HasField(name) and getattr(worker, name) > worker.total_bytes:
                    raise _invalid(
                        f"{where}.{name}",
                        f"{getattr(worker, name)} exceeds the device's total {worker.total_bytes}",
                    )

    async def report(
        self, request: service_pb2.ReportMeasurementsRequest
    ) -> service_pb2.ReportMeasurementsResponse:
        if not request.engine_id:
            raise _invalid("engine_id", "give the engine_id that measured")
        self._limits.check_engine_id(request.engine_id)
        if not request.HasField("fingerprint"):
            raise _invalid("fingerprint", "give the configuration's fingerprint")
        self.check_fingerprint(request.fingerprint, "fingerprint")
        self._text(request.release, "release", required=False)
        self._check_workers(request)
        # An engine's report is an act on the engine: its owner's, as a plan is.
        await self._authorize(request.engine_id, "report the measurements of", claim=True)
        key = config_key(request.fingerprint)
        now = time.time()
        record = service_pb2.EngineMeasurement(
            engine_id=request.engine_id,
            release=request.release,
            reported_at=now,
            max_num_batched_tokens=request.fingerprint.max_num_batched_tokens,
            cuda_graphs=request.fingerprint.cuda_graphs,
            workers=sorted(request.workers, key=lambda worker: worker.rank),
        )
        engines = await self._store.put_measurement(
            key,
            request.engine_id,
            record.SerializeToString(deterministic=True),
            now,
            max_configs=self._settings.max_measured_configs,
            max_engines=self._settings.max_measurements_per_config,
        )
        return service_pb2.ReportMeasurementsResponse(config_key=key, engines=engines)

    async def get(
        self, request: service_pb2.GetMeasurementsRequest
    ) -> service_pb2.GetMeasurementsResponse:
        if not request.HasField("fingerprint"):
            raise _invalid("fingerprint", "give the configuration's fingerprint")
        fingerprint = normalized(request.fingerprint)
        self.check_fingerprint(fingerprint, "fingerprint")
        key = config_key(fingerprint)
        identity = current_identity()
        # Engine ids name other tenants' engines: shown where holders are (security.md).
        show_ids = identity.method == "insecure" or identity.operator
        engines = []
        for record in await self._store.measurements(key):
            engine = service_pb2.EngineMeasurement.FromString(record)
            if not runtime_matches(
                engine, fingerprint.max_num_batched_tokens, fingerprint.cuda_graphs
            ):
                continue
            if not show_ids:
                engine.engine_id = ""
            engines.append(engine)
        return service_pb2.GetMeasurementsResponse(config_key=key, engines=engines)
