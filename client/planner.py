"""Sync and asyncio planner clients over one reused channel each."""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import TracebackType
from typing import Self

import grpc
import grpc.aio

from kvplan.client.errors import PlannerError, error_from_rpc
from kvplan.client.model import PlanResult
from kvplan.client.security import ChannelSecurity, resolve_security
from kvplan.client.targets import with_default_port
from kvplan.v1 import plan_pb2, service_pb2, service_pb2_grpc

DEFAULT_TIMEOUT_S = 30.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Keepalive the server permits (server/config.py sets the matching policy).
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000

_SERVICE = "kvplan.v1.KVCachePlanner"
# Retries with backoff on UNAVAILABLE, for calls that are safe to repeat. A plan
# is content-addressed and a repeated rank with the same spec joins the same
# rendezvous, so PlanKVCache is idempotent too. Renewing and releasing leases are
# idempotent as well.
_RETRIED_METHODS = ("PlanKVCache", "GetPlan", "ListDevices", "Echo", "RenewLeases", "ReleasePlan")
MAX_ATTEMPTS = 4
INITIAL_BACKOFF_S = 0.1
BACKOFF_MULTIPLIER = 2


def retry_attempts(retry_budget_s: float | None) -> int:
    """Attempts of one call (1 = no retry): MAX_ATTEMPTS, or fewer when the longest
    waits between them (0.1 s, 0.2 s, 0.4 s, each with gRPC's jitter) would
    add up past `retry_budget_s`."""
    attempts, waited, backoff = 1, 0.0, INITIAL_BACKOFF_S
    while attempts < MAX_ATTEMPTS and (
        retry_budget_s is None or waited + backoff <= retry_budget_s + 1e-9
    ):
        attempts, waited, backoff = attempts + 1, waited + backoff, backoff * BACKOFF_MULTIPLIER
    return attempts


def _service_config(attempts: int) -> dict[str, object]:
    if attempts < 2:  # gRPC takes no retry policy of one attempt
        return {}
    return {
        "methodConfig": [
            {
                "name": [{"service": _SERVICE, "method": method} for method in _RETRIED_METHODS],
                "retryPolicy": {
                    "maxAttempts": attempts,
                    "initialBackoff": f"{INITIAL_BACKOFF_S}s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": BACKOFF_MULTIPLIER,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }


def channel_options(retry_budget_s: float | None = None) -> list[tuple[str, int | str]]:
    """`retry_budget_s`: the most the waits between retries of one call may add (None:
    MAX_ATTEMPTS attempts, at most 0.7 s of waits)."""
    attempts = retry_attempts(retry_budget_s)
    return [
        ("grpc.service_config", json.dumps(_service_config(attempts))),
        ("grpc.enable_retries", 1 if attempts > 1 else 0),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


def _renew_request(
    engine_id: str, allocations: Mapping[int, int] | None
) -> service_pb2.RenewLeasesRequest:
    return service_pb2.RenewLeasesRequest(
        engine_id=engine_id,
        allocations=[
            service_pb2.WorkerAllocation(rank=rank, allocated_bytes=allocated)
            for rank, allocated in sorted((allocations or {}).items())
        ],
    )


def _release_request(engine_id: str, rank: int | None) -> service_pb2.ReleasePlanRequest:
    request = service_pb2.ReleasePlanRequest(engine_id=engine_id)
    if rank is not None:
        request.rank = rank
    return request


def _plan_get_request(
    plan_id: str = "", engine_id: str = "", rank: int | None = None
) -> service_pb2.GetPlanRequest:
    request = service_pb2.GetPlanRequest(plan_id=plan_id, engine_id=engine_id)
    if rank is not None:
        request.rank = rank
    return request


class PlannerClient:
    """Blocking client. Use as a context manager or call close()."""

    def _error(self, error: grpc.RpcError) -> PlannerError:
        return error_from_rpc(
            error,
            target=self.target,
            tls=self.security.tls,
            token=self.security.token is not None,
        )

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        security: ChannelSecurity | None = None,
        retry_budget_s: float | None = None,
    ) -> None:
        """`target`: HOST:PORT (HOST alone: port 50051, see kvplan.client.targets).
        `security`: TLS, client certificate and bearer token (see
        kvplan.client.security; `ChannelSecurity.from_env()` reads KVPLAN_*).
        Default: plaintext, no token. `retry_budget_s`: the most the waits between
        retries on UNAVAILABLE may add to one call (see channel_options). The
        `tls`/`root_certificates`/... keywords remain for older callers."""
        self.timeout_s = timeout_s
        self.security = resolve_security(
            security, tls, root_certificates, private_key, certificate_chain
        )
        self._metadata = self.security.metadata()
        self.target = target = with_default_port(target)
        options = channel_options(retry_budget_s) + self.security.channel_options()
        creds = self.security.credentials()
        if creds is not None:
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = service_pb2_grpc.KVCachePlannerStub(self._channel)

    def plan(self, request: plan_pb2.PlanRequest, *, timeout_s: float | None = None) -> PlanResult:
        """Engine mode (all workers) or rank mode (one worker and world_size)."""
        try:
            response = self._stub.PlanKVCache(
                request, timeout=timeout_s or self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise self._error(error) from None
        return PlanResult(response)

    def get_plan(
        self,
        *,
        plan_id: str = "",
        engine_id: str = "",
        rank: int | None = None,
        timeout_s: float | None = None,
    ) -> PlanResult:
        try:
            response = self._stub.GetPlan(
                _plan_get_request(plan_id, engine_id, rank),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise self._error(error) from None
        return PlanResult(response)

    def list_devices(self, *, timeout_s: float | None = None) -> service_pb2.ListDevicesResponse:
        try:
            return self._stub.ListDevices(
                service_pb2.ListDevicesRequest(),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise self._error(error) from None

    def renew_leases(
        self,
        engine_id: str,
        allocations: Mapping[int, int] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> tuple[plan_pb2.Lease, ...]:
        """Heartbeat: extend the engine's leases; `allocations` (rank -> bytes the
        worker holds on its device now) tells the ledger what is no longer only
        promised."""
        try:
            response = self._stub.RenewLeases(
                _renew_request(engine_id, allocations),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise self._error(error) from None
        return tuple(response.leases)

    def release_plan(
        self, engine_id: str, rank: int | None = None, *, timeout_s: float | None = None
    ) -> service_pb2.ReleasePlanResponse:
        """Give the engine's leases (or one rank's) back."""
        try:
            return self._stub.ReleasePlan(
                _release_request(engine_id, rank),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise self._error(error) from None

    def report_measurements(
        self, request: service_pb2.ReportMeasurementsRequest, *, timeout_s: float | None = None
    ) -> service_pb2.ReportMeasurementsResponse:
        """Keep what an engine's workers measured at start (kvplan.client.fleet)."""
        try:
            return self._stub.ReportMeasurements(
                request, timeout=timeout_s or self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None

    def get_measurements(
        self, fingerprint: service_pb2.ConfigFingerprint, *, timeout_s: float | None = None
    ) -> service_pb2.GetMeasurementsResponse:
        """The measurements kept for a configuration (runtime fields 0 / "": any)."""
        try:
            return self._stub.GetMeasurements(
                service_pb2.GetMeasurementsRequest(fingerprint=fingerprint),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AsyncPlannerClient:
    """asyncio client. Use `async with` or await close()."""

    def _error(self, error: grpc.RpcError) -> PlannerError:
        return error_from_rpc(
            error,
            target=self.target,
            tls=self.security.tls,
            token=self.security.token is not None,
        )

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        security: ChannelSecurity | None = None,
        retry_budget_s: float | None = None,
    ) -> None:
        """See PlannerClient."""
        self.timeout_s = timeout_s
        self.security = resolve_security(
            security, tls, root_certificates, private_key, certificate_chain
        )
        self._metadata = self.security.metadata()
        self.target = target = with_default_port(target)
        options = channel_options(retry_budget_s) + self.security.channel_options()
        creds = self.security.credentials()
        if creds is not None:
            self._channel = grpc.aio.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stub = service_pb2_grpc.KVCachePlannerStub(self._channel)

    async def plan(
        self, request: plan_pb2.PlanRequest, *, timeout_s: float | None = None
    ) -> PlanResult:
        try:
            response = await self._stub.PlanKVCache(
                request, timeout=timeout_s or self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise self._error(error) from None
        return PlanResult(response)

    async def get_plan(
        self,
        *,
        plan_id: str = "",
        engine_id: str = "",
        rank: int | None = None,
        timeout_s: float | None = None,
    ) -> PlanResult:
        try:
            response = await self._stub.GetPlan(
                _plan_get_request(plan_id, engine_id, rank),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise self._error(error) from None
        return PlanResult(response)

    async def list_devices(
        self, *, timeout_s: float | None = None
    ) -> service_pb2.ListDevicesResponse:
        try:
            return await self._stub.ListDevices(
                service_pb2.ListDevicesRequest(),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise self._error(error) from None

    async def renew_leases(
        self,
        engine_id: str,
        allocations: Mapping[int, int] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> tuple[plan_pb2.Lease, ...]:
        """See PlannerClient.renew_leases."""
        try:
            response = await self._stub.RenewLeases(
                _renew_request(engine_id, allocations),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise self._error(error) from None
        return tuple(response.leases)

    async def release_plan(
        self, engine_id: str, rank: int | None = None, *, timeout_s: float | None = None
    ) -> service_pb2.ReleasePlanResponse:
        try:
            return await self._stub.ReleasePlan(
                _release_request(engine_id, rank),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise self._error(error) from None

    async def report_measurements(
        self, request: service_pb2.ReportMeasurementsRequest, *, timeout_s: float | None = None
    ) -> service_pb2.ReportMeasurementsResponse:
        """See PlannerClient.report_measurements."""
        try:
            return await self._stub.ReportMeasurements(
                request, timeout=timeout_s or self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None

    async def get_measurements(
        self, fingerprint: service_pb2.ConfigFingerprint, *, timeout_s: float | None = None
    ) -> service_pb2.GetMeasurementsResponse:
        """See PlannerClient.get_measurements."""
        try:
            return await self._stub.GetMeasurements(
                service_pb2.GetMeasurementsRequest(fingerprint=fingerprint),
                timeout=timeout_s or self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None

    async def echo(self, request: plan_pb2.PlanRequest) -> plan_pb2.PlanRequest:
        return await self._stub.Echo(request, timeout=self.timeout_s, metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
