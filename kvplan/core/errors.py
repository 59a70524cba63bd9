"""Planning errors. Each carries the gRPC-style status code the shell maps it to,
the request fields it concerns and, for memory errors, the numbers involved."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the request is malformed
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # well-formed, but cannot be planned
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # not enough memory
    NOT_FOUND = "NOT_FOUND"  # an unknown device / plan


@dataclass(frozen=True)
class FieldViolation:
    field: str  # request field path, e.g. "workers[1].layers[3].sliding_window"
    description: str


class PlanningError(Exception):
    """Base of every error a caller can act on."""

    code: ErrorCode = ErrorCode.FAILED_PRECONDITION

    def __init__(
        self,
        message: str,
        *,
        field: str = "",
        violations: list[FieldViolation] | None = None,
        details: dict[str, int | float | str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.violations: list[FieldViolation] = list(violations or [])
        if field and not self.violations:
            self.violations.append(FieldViolation(field, message))
        self.details: dict[str, int | float | str] = dict(details or {})

    @property
    def reason(self) -> str:
        return type(self).__name__


class InvalidRequest(PlanningError):
    """A field of the request is missing, out of range or contradicts another."""

    code = ErrorCode.INVALID_ARGUMENT


class UnplannableSpecs(PlanningError):
    """The layer specs are valid one by one but cannot be grouped or laid out."""

    code = ErrorCode.FAILED_PRECONDITION


class InsufficientMemory(PlanningError):
    """The budget cannot hold the cache (the numbers are in `details`)."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class UnknownDevice(PlanningError):
    code = ErrorCode.NOT_FOUND
