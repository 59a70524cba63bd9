"""PlanningError -> gRPC status with google.rpc rich details."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvplan.core.errors import PlanningError

_CODES = {
    "INVALID_ARGUMENT": (grpc.StatusCode.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT),
    "FAILED_PRECONDITION": (grpc.StatusCode.FAILED_PRECONDITION, code_pb2.FAILED_PRECONDITION),
    "RESOURCE_EXHAUSTED": (grpc.StatusCode.RESOURCE_EXHAUSTED, code_pb2.RESOURCE_EXHAUSTED),
    "NOT_FOUND": (grpc.StatusCode.NOT_FOUND, code_pb2.NOT_FOUND),
    "UNAVAILABLE": (grpc.StatusCode.UNAVAILABLE, code_pb2.UNAVAILABLE),
    "DEADLINE_EXCEEDED": (grpc.StatusCode.DEADLINE_EXCEEDED, code_pb2.DEADLINE_EXCEEDED),
    "ALREADY_EXISTS": (grpc.StatusCode.ALREADY_EXISTS, code_pb2.ALREADY_EXISTS),
    "PERMISSION_DENIED": (grpc.StatusCode.PERMISSION_DENIED, code_pb2.PERMISSION_DENIED),
    "UNAUTHENTICATED": (grpc.StatusCode.UNAUTHENTICATED, code_pb2.UNAUTHENTICATED),
    "INTERNAL": (grpc.StatusCode.INTERNAL, code_pb2.INTERNAL),
}


_NAME_BY_RPC_CODE = {rpc_code: name for name, (_, rpc_code) in _CODES.items()}


class ServiceError(Exception):
    """An error of the service layer itself (rendezvous, limits, lookups)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        field: str = "",
        details: dict[str, int | float | str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.details = dict(details or {})


def limit_exceeded(
    flag: str, value: int, limit: int, what: str, *, field: str = ""
) -> ServiceError:
    """RESOURCE_EXHAUSTED naming the server limit (its flag) and the numbers."""
    return ServiceError(
        "RESOURCE_EXHAUSTED",
        f"{what}: {value} exceeds the server's limit of {limit} (--{flag.replace('_', '-')})",
        field=field,
        details={"limit": flag, "limit_value": limit, "value": value},
    )


class RemoteStatus(Exception):
    """A status decided elsewhere (another replica's rendezvous), passed on as is."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status
        self.code = _NAME_BY_RPC_CODE.get(status.code, "UNKNOWN")


def to_status(error: PlanningError | ServiceError | RemoteStatus) -> grpc.Status:
    """The status to abort with."""
    if isinstance(error, RemoteStatus):
        return rpc_status.to_status(error.status)
    return rpc_status.to_status(to_rpc_status(error))


def to_rpc_status(error: PlanningError | ServiceError) -> status_pb2.Status:
    """google.rpc.Status: code, message, BadRequest / ErrorInfo details."""
    code_name = str(error.code)
    _, rpc_code = _CODES[code_name]
    status = status_pb2.Status(code=rpc_code, message=error.message)
    violations = (
        [(v.field, v.description) for v in error.violations]
        if isinstance(error, PlanningError)
        else ([(error.field, error.message)] if error.field else [])
    )
    if violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=field, description=text)
                for field, text in violations
            ]
        )
        packed = any_pb2.Any()
        packed.Pack(bad_request)
        status.details.append(packed)
    reason = error.reason if isinstance(error, PlanningError) else code_name
    info = error_details_pb2.ErrorInfo(
        reason=reason,
        domain="kvplan",
        metadata={key: str(value) for key, value in error.details.items()},
    )
    packed_info = any_pb2.Any()
    packed_info.Pack(info)
    status.details.append(packed_info)
    return status
