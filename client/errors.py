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


def error_from_rpc(
    error: grpc.RpcError, *, target: str | None = None, tls: bool = False, token: bool = False
) -> PlannerError:
    """A PlannerError from a failed call (sync or asyncio). With `target` (and how the
    channel was secured), a call that never reached a kvplan server says so and what
    to check, instead of gRPC's transport text (kept in metadata["grpc_message"])."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    trailing = tuple(
        (error.trailing_metadata() if hasattr(error, "trailing_metadata") else None) or ()
    )
    violations, metadata = _unpack_details(trailing)
    answered = any(key == _STATUS_DETAILS_KEY for key, _ in trailing)  # kvplan always packs them
    if target is not None and code is grpc.StatusCode.UNAVAILABLE and not answered:
        metadata["grpc_message"] = details or ""
        details = unreachable_text(target, details or "", tls=tls, token=token)
    return PlannerError(code, details or "", violations, metadata)


# gRPC's transport text -> the likely cause, in the order they are tried.
_CAUSES = (
    ("Connection refused", "connection refused: nothing listens on that port"),
    ("DNS resolution failed", "the host name does not resolve"),
    ("Domain name not found", "the host name does not resolve"),
    ("Ssl handshake failed", "the TLS handshake failed: a plaintext server, or a server "
     "certificate this client does not trust"),
    ("Socket closed", "the server closed the connection at once: a TLS server reached in "
     "plaintext, a client certificate it refused, or not a gRPC server"),
    ("Connection reset", "the connection was reset: a TLS server reached in plaintext, or "
     "not a gRPC server"),
    ("timed out", "the connection timed out: a wrong address or a firewall"),
)  # fmt: skip


def unreachable_text(target: str, raw: str, *, tls: bool, token: bool) -> str:
    """What to check when no kvplan server answered at `target`."""
    cause = next((why for marker, why in _CAUSES if marker in raw), None)
    if cause is None:
        cause = " ".join(raw.rpartition("last error: ")[2].split()) or "no answer"
    security = "TLS" if tls else "plaintext"
    flip = "plaintext (no --tls / KVPLAN_TLS)" if tls else "TLS (--tls or --tls-ca)"
    return (
        f"no kvplan server answered at {target} ({cause}). Check the address and port "
        f"(kvplan serve listens on 50051 by default), that the server runs, TLS vs "
        f"plaintext (this client used {security}; the server may want {flip}), and the "
        f"token ({'one was sent' if token else 'none was sent'}: KVPLAN_TOKEN or "
        "--token-file when the server has --token-file)"
    )
