"""Plans stored once by content: a serialized plan is its head and its body.

A PlanResponse serializes `plan_id` (field 1) and `engine_id` (field 2) first;
everything after them, the body, is the same for every engine planned from the
same specs (a fleet of one model, engines restarted under new ids). The stores
and the servicer's plan cache keep each distinct body once, by its SHA-256,
and per plan only its head (about 60 bytes): 8 workers x 65 layers is a 35 KB
body, written and held once instead of once per engine.

Bytes that do not start with the head their ids serialize to (never seen from
the servicer; arbitrary bytes in tests) are kept whole as the body, with an
empty head: still exact, merely unshared.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvplan.v1 import plan_pb2


@dataclass(frozen=True)
class PlanParts:
    """A serialized plan: its first `head_length` bytes are the head, the rest
    the body, which `digest` names. The body is copied out only where it is
    stored for the first time."""

    plan: bytes
    head_length: int
    digest: bytes

    @classmethod
    def of(cls, plan_id: str, engine_id: str, plan: bytes) -> PlanParts:
        head = plan_pb2.PlanResponse(plan_id=plan_id, engine_id=engine_id).SerializeToString()
        head_length = len(head) if plan.startswith(head) else 0
        return cls(plan, head_length, hashlib.sha256(memoryview(plan)[head_length:]).digest())

    @property
    def head(self) -> bytes:
        return self.plan[: self.head_length]

    @property
    def body(self) -> bytes:
        return self.plan[self.head_length :]


def plan_parts(plan_id: str, engine_id: str, plan: bytes | PlanParts) -> PlanParts:
    """`plan` as parts (split here unless the caller already did)."""
    return plan if isinstance(plan, PlanParts) else PlanParts.of(plan_id, engine_id, plan)


class SharedBodies:
    """Bodies by digest with the number of plans holding each (in-process stores)."""

    def __init__(self) -> None:
        self._bodies: dict[bytes, tuple[bytes, int]] = {}  # digest -> body, holders
        self.size_bytes = 0  # of the distinct bodies

    def __len__(self) -> int:
        return len(self._bodies)

    def hold(self, parts: PlanParts) -> None:
        held = self._bodies.get(parts.digest)
        if held is None:
            body = parts.body
            self.size_bytes += len(body)
            self._bodies[parts.digest] = (body, 1)
        else:
            self._bodies[parts.digest] = (held[0], held[1] + 1)

    def release(self, digest: bytes) -> None:
        body, holders = self._bodies[digest]
        if holders > 1:
            self._bodies[digest] = (body, holders - 1)
        else:
            del self._bodies[digest]
            self.size_bytes -= len(body)

    def body(self, digest: bytes) -> bytes:
        return self._bodies[digest][0]
