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
from collections import OrderedDict
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
        head = _head(plan_id, engine_id)
        head_length = len(head) if plan.startswith(head) else 0
        return cls(plan, head_length, hashlib.sha256(memoryview(plan)[head_length:]).digest())

    @classmethod
    def joined(cls, plan_id: str, engine_id: str, body: bytes, digest: bytes) -> PlanParts:
        """A kept body (named by `digest`) under these ids: another engine's plan."""
        head = _head(plan_id, engine_id)
        return cls(head + body, len(head), digest)

    @property
    def head(self) -> bytes:
        return self.plan[: self.head_length]

    @property
    def body(self) -> bytes:
        return self.plan[self.head_length :]


def _head(plan_id: str, engine_id: str) -> bytes:
    return plan_pb2.PlanResponse(plan_id=plan_id, engine_id=engine_id).SerializeToString()


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

    def get(self, digest: bytes) -> bytes | None:
        held = self._bodies.get(digest)
        return held[0] if held is not None else None


class KeptPlans:
    """Serialized plans by id, each distinct body held once (the servicer's plan
    cache and the memory store), and which plan is each engine's.

    Bounded by count and by bytes (heads plus distinct bodies): the least recently
    kept (or, with `touch`, read) go first; the newest plan always stays.
    """

    def __init__(self, max_plans: int, max_bytes: int) -> None:
        self._max_plans = max_plans
        self._max_bytes = max_bytes
        # plan id -> engine id, head, body digest (oldest first)
        self._plans: OrderedDict[str, tuple[str, bytes, bytes]] = OrderedDict()
        self._bodies = SharedBodies()
        self._head_bytes = 0
        self._by_engine: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, plan_id: str) -> bool:
        return plan_id in self._plans

    @property
    def size_bytes(self) -> int:
        return self._head_bytes + self._bodies.size_bytes

    @property
    def distinct_bodies(self) -> int:
        return len(self._bodies)

    def keep(
        self, plan_id: str, engine_id: str, parts: PlanParts, *, name_engine: bool = True
    ) -> None:
        """Keep a plan. `name_engine=False`: not yet the engine's plan (see
        `name_engine`), unless it already was (a plan kept again)."""
        already_named = self._by_engine.get(engine_id) == plan_id
        self._bodies.hold(parts)  # before a replaced plan lets go of an equal body
        self._drop(plan_id)
        self._plans[plan_id] = (engine_id, parts.head, parts.digest)
        self._head_bytes += len(parts.head)
        if engine_id and (name_engine or already_named):
            self._by_engine[engine_id] = plan_id
        while len(self._plans) > 1 and (
            len(self._plans) > self._max_plans or self.size_bytes > self._max_bytes
        ):
            self._drop(next(iter(self._plans)))

    def get(self, plan_id: str, *, touch: bool = False) -> bytes | None:
        """The serialized plan; `touch`: it counts as recently used."""
        entry = self._plans.get(plan_id)
        if entry is None:
            return None
        if touch:
            self._plans.move_to_end(plan_id)
        return entry[1] + self._bodies.body(entry[2])

    def body(self, digest: bytes) -> bytes | None:
        """A body some kept plan holds, by its digest."""
        return self._bodies.get(digest)

    def engine_of(self, plan_id: str) -> str | None:
        entry = self._plans.get(plan_id)
        return entry[0] if entry is not None else None

    def plan_of(self, engine_id: str) -> str | None:
        return self._by_engine.get(engine_id)

    def name_engine(self, engine_id: str, plan_id: str) -> None:
        """The engine's plan is this (kept) one from now on."""
        if engine_id and plan_id in self._plans:
            self._by_engine[engine_id] = plan_id

    def _drop(self, plan_id: str) -> None:
        entry = self._plans.pop(plan_id, None)
        if entry is None:
            return
        engine_id, head, body_digest = entry
        self._head_bytes -= len(head)
        self._bodies.release(body_digest)
        if self._by_engine.get(engine_id) == plan_id:
            del self._by_engine[engine_id]
