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

# A status travels in the trailers, which gRPC caps (8 KiB, 16 KiB at the most): one
# over the cap reaches the caller as "Stream removed" instead of the status. A message
# may repeat what the caller sent, so each text is clipped (UTF-8 bytes) and at most
# MAX_VIOLATIONS field violations are carried: at most about 6 KiB in all, and a
# rendezvous failure kept for the engine's ranks stays small.
MAX_MESSAGE_BYTES = 1024
MAX_DESCRIPTION_BYTES = 512
MAX_VIOLATIONS = 4


def clip(text: str, limit: int) -> str:
    """`text` within `limit` UTF-8 bytes (on a character boundary), saying what it left out."""
    encoded = text.encode()
    if len(encoded) <= limit:
        return text
    kept = encoded[:limit].decode(errors="ignore")
    return f"{kept}… ({len(encoded) - len(kept.encode())} more bytes)"


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
    status = status_pb2.Status(code=rpc_code, message=clip(error.message, MAX_MESSAGE_BYTES))
    violations = (
        [(v.field, v.description) for v in error.violations]
        if isinstance(error, PlanningError)
        else ([(error.field, error.message)] if error.field else [])
    )
    if violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=clip(field, MAX_DESCRIPTION_BYTES),
                    description=clip(text, MAX_DESCRIPTION_BYTES),
                )
                for field, text in violations[:MAX_VIOLATIONS]
            ]
        )
        packed = any_pb2.Any()
        packed.Pack(bad_request)
        status.details.append(packed)
    reason = error.reason if isinstance(error, PlanningError) else code_name
    metadata = {
        key: clip(str(value), MAX_DESCRIPTION_BYTES) for key, value in error.details.items()
    }
    if len(violations) > MAX_VIOLATIONS:
        metadata["violations"] = str(len(violations))  # how many there were in all
    info = error_details_pb2.ErrorInfo(reason=reason, domain="kvplan", metadata=metadata)
    packed_info = any_pb2.Any()
    packed_info.Pack(info)
    status.details.append(packed_info)
    return status
