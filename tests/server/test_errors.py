"""Statuses fit gRPC's trailers whatever the caller sent."""

from __future__ import annotations

from google.rpc import error_details_pb2
from hypothesis import given
from hypothesis import strategies as st

from kvplan.core.errors import FieldViolation, PlanningError
from kvplan.server.errors import (
    MAX_DESCRIPTION_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_VIOLATIONS,
    ServiceError,
    clip,
    to_rpc_status,
)

# gRPC's default soft cap on metadata a peer accepts (GRPC_ARG_MAX_METADATA_SIZE).
TRAILER_SOFT_CAP_BYTES = 8 * 1024


@given(st.text(), st.integers(min_value=0, max_value=64))
def test_clip_keeps_a_prefix_within_the_limit(text: str, limit: int) -> None:
    clipped = clip(text, limit)
    if len(text.encode()) <= limit:
        assert clipped == text
        return
    kept, _, said = clipped.rpartition("… (")
    assert text.startswith(kept) and len(kept.encode()) <= limit
    assert said == f"{len(text.encode()) - len(kept.encode())} more bytes)"


def test_a_status_repeating_huge_strings_stays_small() -> None:
    long_text = "é" * 50_000  # two bytes each: clipped on a character boundary
    error = PlanningError(
        long_text,
        field="workers[0].layers[0].name",
        violations=[FieldViolation(f"workers[0].layers[{i}].name", long_text) for i in range(100)],
    )
    status = to_rpc_status(error)
    assert len(status.message.encode()) <= MAX_MESSAGE_BYTES + 32
    assert status.message.endswith(" more bytes)")
    bad_request = error_details_pb2.BadRequest()
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(bad_request)
    status.details[1].Unpack(info)
    assert len(bad_request.field_violations) == MAX_VIOLATIONS
    assert [v.field for v in bad_request.field_violations] == [
        f"workers[0].layers[{i}].name" for i in range(MAX_VIOLATIONS)
    ]
    for violation in bad_request.field_violations:
        assert len(violation.description.encode()) <= MAX_DESCRIPTION_BYTES + 32
    assert info.metadata["violations"] == "100"
    # grpc-message (percent-encoded: at most 3 bytes a byte) and the details (base64).
    trailers = 3 * len(status.message.encode()) + len(status.SerializeToString()) * 4 // 3
    assert trailers < TRAILER_SOFT_CAP_BYTES


def test_short_statuses_are_unchanged() -> None:
    error = ServiceError("NOT_FOUND", "no device 'GPU-1'", field="workers[0].device.uuid")
    status = to_rpc_status(error)
    assert status.message == "no device 'GPU-1'"
    bad_request = error_details_pb2.BadRequest()
    status.details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].description == "no device 'GPU-1'"
