"""The server's plan cache: plans by id, the engine each names, and plans reused
across engines of one model (`PlanCache`), with what metrics and logs say of a plan
(`PlanSummary`)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.descriptor import EnumDescriptor

from kvplan.convert.keys import PlanKeys, plan_keys
from kvplan.convert.wire import WorkerBytes
from kvplan.server.store.bodies import KeptPlans, PlanParts
from kvplan.v1 import plan_pb2

_SPEC_DECODE_ON = (
    plan_pb2.SPEC_DECODE_METHOD_EAGLE,
    plan_pb2.SPEC_DECODE_METHOD_EAGLE3,
    plan_pb2.SPEC_DECODE_METHOD_MTP,
    plan_pb2.SPEC_DECODE_METHOD_DSPARK,
    plan_pb2.SPEC_DECODE_METHOD_DFLASH,
)


@dataclass(frozen=True)
class PlanSummary:
    """What a plan's metrics and log line say of it: kept with a remembered plan,
    so that reusing it needs no parse of its bytes."""

    path: str
    draft_rule: str  # "off" (no spec decode), "none" (no draft group) or the rule
    groups: int
    workers: int
    num_blocks: int
    largest_tensor_bytes: int  # on the first worker (per-engine metrics)
    # The plan's prefix-cache warning codes as labels ("draft_drop", ...): a few.
    prefix_warnings: tuple[str, ...] = ()

    @classmethod
    def of(cls, request: plan_pb2.PlanRequest, response: plan_pb2.PlanResponse) -> PlanSummary:
        rule = "off"
        if request.spec_decode.method in _SPEC_DECODE_ON:
            flagged = [group for group in response.groups if group.is_draft]
            rule = _DRAFT_RULE_LABELS[flagged[0].draft_rule] if flagged else "none"
        tensors = response.workers[0].tensors if response.workers else ()
        return cls(
            path=_PATH_LABELS[response.diagnostics.grouping_path],
            draft_rule=rule,
            groups=len(response.groups),
            workers=len(response.workers),
            num_blocks=response.num_blocks,
            largest_tensor_bytes=max((t.size_bytes for t in tensors), default=0),
            prefix_warnings=tuple(
                sorted(
                    {
                        _PREFIX_WARNING_LABELS[w.code]
                        for w in response.diagnostics.warnings
                        if w.code in _PREFIX_WARNING_LABELS
                    }
                )
            ),
        )


class PlanCache:
    """Bounded, content-addressed plans: plan id -> serialized response, engine -> plan id.

    Plans are kept serialized: a cache hit goes out as these bytes with no
    re-serialization. Each distinct body is held once (store/bodies.py): a fleet of
    engines of one model costs a 60-byte head per engine, not a 35 KB plan
    (8 workers x 65 layers) each.

    It also remembers
    - the keys of recent requests by their bytes' digest: `plan_keys` walks the
      request and hashes it twice (38 µs for 8 workers x 65 layers, against 15 µs
      to hash its raw bytes once);
    - which body recent requests' content planned to (`PlanKeys.content`, the
      request without its engine id). A new engine whose request equals an earlier
      one but for the engine id gets that body under its own head instead of being
      planned again: a fleet's new replica of a model costs a lookup, not a plan.
      A body is reused only while the cache still holds it, and only within one
      `scope` (the caller's identity): how fast a plan comes back must not tell one
      tenant what another planned.
    """

    def __init__(self, capacity: int, max_bytes: int = 32 * 1024 * 1024) -> None:
        self._capacity = capacity
        # Plans of large engines are big: bound the bytes too (heads and distinct
        # bodies), so the server's memory stays flat whatever engines it sees.
        self._plans = KeptPlans(capacity, max_bytes)
        self._keys: OrderedDict[bytes, PlanKeys] = OrderedDict()  # request digest -> keys
        # (scope, content key) -> (body digest, summary): a few hundred bytes an entry.
        self._known: OrderedDict[tuple[str, bytes], tuple[bytes, PlanSummary]] = OrderedDict()

    def keys(
        self,
        request: plan_pb2.PlanRequest,
        request_digest: bytes | None = None,
        encoded_workers: Sequence[WorkerBytes] | None = None,
    ) -> PlanKeys:
        """`plan_keys(request)`, computed once per distinct request.

        `request_digest`: the SHA-256 of bytes that parse to `request` (the bytes it
        came in as); without it, of its deterministic serialization. Equal bytes are
        an equal request, so the digest stands for the request; remembered keys stay
        right after their plan is evicted. `encoded_workers`: see `plan_keys`.
        """
        digest = (
            request_digest or hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
        )
        keys = self._keys.get(digest)
        if keys is not None:
            self._keys.move_to_end(digest)
            return keys
        keys = plan_keys(request, encoded_workers)
        self._keys[digest] = keys
        if len(self._keys) > self._capacity:
            self._keys.popitem(last=False)
        return keys

    def known_plan(
        self, keys: PlanKeys, engine_id: str, scope: str
    ) -> tuple[PlanParts, PlanSummary] | None:
        """The plan of an earlier request with this content in this scope, under
        this engine's ids, if its body is still held."""
        known = (scope, keys.content)
        entry = self._known.get(known)
        if entry is None:
            return None
        body_digest, summary = entry
        body = self._plans.body(body_digest)
        if body is None:
            del self._known[known]
            return None
        self._known.move_to_end(known)
        return PlanParts.joined(keys.plan_id, engine_id, body, body_digest), summary

    def remember_content(
        self, content: bytes, parts: PlanParts, summary: PlanSummary, scope: str
    ) -> None:
        """`content` (a `PlanKeys.content`) plans to `parts`' body, in `scope`."""
        if not parts.head_length:
            return  # the body holds the ids (PlanParts.of): not another engine's plan
        known = (scope, content)
        self._known[known] = (parts.digest, summary)
        self._known.move_to_end(known)
        if len(self._known) > self._capacity:
            self._known.popitem(last=False)

    def engine_of(self, plan_id: str) -> str | None:
        return self._plans.engine_of(plan_id)

    def get(self, plan_id: str) -> bytes | None:
        """The serialized PlanResponse."""
        return self._plans.get(plan_id, touch=True)

    def for_engine(self, engine_id: str) -> bytes | None:
        plan_id = self._plans.plan_of(engine_id)
        return self.get(plan_id) if plan_id else None

    def name_engine(self, engine_id: str, plan_id: str) -> None:
        """`for_engine(engine_id)` answers with this (kept) plan from now on."""
        self._plans.name_engine(engine_id, plan_id)

    def put(self, plan: plan_pb2.PlanResponse, *, name_engine: bool = True) -> bytes:
        """Keep `plan`; returns its serialization (see `keep`)."""
        serialized = plan.SerializeToString()
        parts = PlanParts.of(plan.plan_id, plan.engine_id, serialized)
        self.keep(plan.plan_id, plan.engine_id, parts, name_engine=name_engine)
        return serialized

    def keep(
        self, plan_id: str, engine_id: str, parts: PlanParts, *, name_engine: bool = True
    ) -> None:
        """Keep a serialized plan. `name_engine=False`: not yet the engine's plan
        (its leases are not granted yet; see `name_engine`)."""
        self._plans.keep(plan_id, engine_id, parts, name_engine=name_engine)

    @property
    def size_bytes(self) -> int:
        return self._plans.size_bytes

    @property
    def distinct_bodies(self) -> int:
        return self._plans.distinct_bodies


def _labels(enum: EnumDescriptor, prefix: str) -> dict[int, str]:
    """Metric and log labels of an enum's values: GROUPING_PATH_HYBRID -> hybrid."""
    return {value.number: value.name.removeprefix(prefix).lower() for value in enum.values}


_PATH_LABELS = _labels(plan_pb2.DESCRIPTOR.enum_types_by_name["GroupingPath"], "GROUPING_PATH_")


_DRAFT_RULE_LABELS = _labels(plan_pb2.DESCRIPTOR.enum_types_by_name["DraftRule"], "DRAFT_RULE_")


_PREFIX_WARNING_LABELS = {
    number: label.removeprefix("prefix_")
    for number, label in _labels(
        plan_pb2.DESCRIPTOR.enum_types_by_name["WarningCode"], "WARNING_CODE_"
    ).items()
    if label.startswith("prefix_")
}
