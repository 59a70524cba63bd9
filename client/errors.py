"""Typed errors carrying the gRPC code and the server's field violations."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2

from kvplan.v1 import rpc_status_pb2

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class Violation:
    field: str
    description: str


class PlannerError(Exception):
    """A failed planner call: `code` is the gRPC status code."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        violations: tuple[Violation, ...] = (),
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.violations = violations
        self.metadata: dict[str, str] = dict(metadata or {})

    @property
    def code_name(self) -> str:
        return str(self.code.name)


def _unpack_details(
    trailing: tuple[tuple[str, str | bytes], ...],
) -> tuple[tuple[Violation, ...], dict[str, str]]:
    violations: list[Violation] = []
    metadata: dict[str, str] = {}
    for key, value in trailing:
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = rpc_status_pb2.RpcStatus.FromString(value)
        for detail in status.details:
            _read_detail(detail, violations, metadata)
    return tuple(violations), metadata


# The server packs google.rpc messages; their wire-compatible mirrors read them.
_BAD_REQUEST = "type.googleapis.com/google.rpc.BadRequest"
_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"


def _read_detail(
    detail: any_pb2.Any, violations: list[Violation], metadata: dict[str, str]
) -> None:
    if detail.type_url == _BAD_REQUEST:
        bad_request = rpc_status_pb2.RpcBadRequest.FromString(detail.value)
        violations.extend(
            Violation(item.field, item.description) for item in bad_request.field_violations
        )
    elif detail.type_url == _ERROR_INFO:
        info = rpc_status_pb2.RpcErrorInfo.FromString(detail.value)
        metadata.update(info.metadata)
        metadata.setdefault("reason", info.reason)


def error_from_rpc(error: grpc.RpcError) -> PlannerError:
    """A PlannerError from a failed call (sync or asyncio)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    violations, metadata = _unpack_details(tuple(trailing or ()))
    return PlannerError(code, details or "", violations, metadata)
