"""The server's bounds on what a caller sends and gets back: each refusal is
RESOURCE_EXHAUSTED naming the flag that sets the bound (or INVALID_ARGUMENT for an
engine id no bound makes valid), and counted in the limits_hit metric."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvplan.convert.wire import WorkerBytes
from kvplan.server.config import Settings
from kvplan.server.errors import ServiceError, limit_exceeded
from kvplan.server.metrics import Metrics
from kvplan.v1 import plan_pb2

# C0 and C1 control characters: no engine id needs one, and they forge log lines.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class RequestLimits:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics

    def check_engine_id(self, engine_id: str, field: str = "engine_id") -> None:
        limit = self._settings.max_engine_id_chars
        if len(engine_id) > limit:
            self._metrics.limits_hit.labels("max_engine_id_chars").inc()
            raise limit_exceeded(
                "max_engine_id_chars", len(engine_id), limit, "engine_id length", field=field
            )
        if _CONTROL.search(engine_id):
            raise ServiceError(
                "INVALID_ARGUMENT",
                "engine_id contains a control character (newline, tab, ...); use printable "
                "characters",
                field=field,
            )

    def limit(self, flag: str, value: int, what: str, field: str = "") -> None:
        limit = getattr(self._settings, flag)
        if value > limit:
            self._metrics.limits_hit.labels(flag).inc()
            raise limit_exceeded(flag, value, limit, what, field=field)

    def check_request(self, request: plan_pb2.PlanRequest, encoded: Sequence[WorkerBytes]) -> None:
        """The server's bounds on one request (RESOURCE_EXHAUSTED naming the flag).
        `encoded`: `encode_workers(request)`."""
        settings = self._settings
        self.check_engine_id(request.engine_id)
        self.limit("max_workers_per_engine", len(request.workers), "workers", "workers")
        self.limit("max_workers_per_engine", request.world_size, "world_size", "world_size")
        # Strings that error messages and remembered rendezvous failures repeat (the
        # message is built only for a string over the limit: 16 -> 7 µs for 8 workers).
        identifier_limit = settings.max_identifier_chars
        for value, field in (
            (request.options.engine_version, "options.engine_version"),
            (request.spec_decode.target_model_type, "spec_decode.target_model_type"),
        ):
            if len(value) > identifier_limit:
                self.limit("max_identifier_chars", len(value), f"{field} length", field)
        name_limit = settings.max_layer_name_chars
        # Names are read (about 0.15 µs each) only where one could be too long: never
        # twice for the one list tensor-parallel ranks share, and not for a list whose
        # every layer is serialized in fewer bytes than the limit in characters
        # (8 workers x 65 layers: 88 -> 11 µs per request; 64 layers: 39 -> 10 µs).
        named_lists: set[bytes] = set()
        for index, (worker, worker_bytes) in enumerate(zip(request.workers, encoded, strict=True)):
            self.limit(
                "max_layers_per_worker",
                len(worker.layers),
                f"layers of worker rank {worker.rank}",
                f"workers[{index}].layers",
            )
            device = worker.device
            for value, part in ((device.uuid, "uuid"), (device.name, "name")):
                if len(value) <= identifier_limit:
                    continue
                self.limit(
                    "max_identifier_chars",
                    len(value),
                    f"device.{part} length of worker rank {worker.rank}",
                    f"workers[{index}].device.{part}",
                )
            if worker_bytes.layers_key in named_lists:
                continue
            named_lists.add(worker_bytes.layers_key)
            if all(end - start <= name_limit for start, end in worker_bytes.layer_spans):
                continue
            for layer_index, layer in enumerate(worker.layers):
                if len(layer.name) > name_limit:
                    self.limit(
                        "max_layer_name_chars",
                        len(layer.name),
                        "layer name length",
                        f"workers[{index}].layers[{layer_index}].name",
                    )

    def check_reply_size(self, reply_bytes: int) -> None:
        limit = self._settings.max_message_bytes
        if reply_bytes > limit:
            self._metrics.limits_hit.labels("max_message_bytes").inc()
            raise limit_exceeded(
                "max_message_bytes",
                reply_bytes,
                limit,
                "the plan's reply would be this many bytes; plan fewer workers or layers "
                "per call, or raise the limit on server and client",
            )
