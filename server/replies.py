"""What a PlanKVCache or GetPlan reply carries besides the plan's own bytes: the
leases, spliced into the serialized plan; one rank's view of a plan."""

from __future__ import annotations

from collections.abc import Sequence

from kvplan.convert.wire import encode_varint
from kvplan.core.ledger import (
    DeviceAccount,
    Lease,
)
from kvplan.server.errors import ServiceError
from kvplan.server.large_messages import (
    parse_message,
)
from kvplan.v1 import plan_pb2


def only_rank(serialized: bytes, rank: int) -> plan_pb2.PlanResponse:
    """One rank's view of a serialized plan: its workers and leases only."""
    view = parse_message(plan_pb2.PlanResponse, serialized)  # a fresh message: ours to cut
    for repeated in (view.workers, view.leases):
        for index in reversed(range(len(repeated))):
            if repeated[index].rank != rank:
                del repeated[index]
    if not view.workers:
        raise ServiceError("NOT_FOUND", f"plan {view.plan_id} has no rank {rank}", field="rank")
    return view


def lease_to_proto(
    lease: Lease, ttl_s: float, device_account: DeviceAccount | None = None
) -> plan_pb2.Lease:
    out = plan_pb2.Lease(
        engine_id=lease.engine_id,
        rank=lease.rank,
        device_uuid=lease.device_uuid,
        bytes=lease.bytes,
        allocated_bytes=lease.allocated_bytes,
        ttl_seconds=ttl_s,
    )
    out.granted_at.FromNanoseconds(int(lease.granted_at * 1e9))
    out.expires_at.FromNanoseconds(int(lease.expires_at * 1e9))
    if device_account is not None:
        out.account.CopyFrom(
            plan_pb2.DeviceAccount(
                total_bytes=device_account.total_bytes,
                free_bytes=device_account.free_bytes,
                commit_limit_bytes=device_account.commit_limit_bytes,
                committed_bytes=device_account.committed_bytes,
                outstanding_bytes=device_account.outstanding_bytes,
                available_to_grant_bytes=device_account.available_to_grant_bytes,
            )
        )
    return out


_LEASES_TAG = bytes([plan_pb2.PlanResponse.LEASES_FIELD_NUMBER << 3 | 2])


def with_leases(plan: bytes, leases: Sequence[plan_pb2.Lease]) -> bytes:
    """The serialized plan with `leases` appended: a repeated field's entries may
    follow the rest of a message, so the cached bytes are not parsed again."""
    parts = [plan]
    for lease in leases:
        body = lease.SerializeToString()
        parts.append(_LEASES_TAG + encode_varint(len(body)) + body)
    return b"".join(parts)
