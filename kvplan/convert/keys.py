"""What names a request's plan: its content address and the keys of its cached
halves, hashed from the workers' serialized bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvplan.convert.wire import WorkerBytes, encode_workers
from kvplan.v1 import plan_pb2


@dataclass(frozen=True)
class PlanKeys:
    """What names a request's plan.

    `plan_id`: the content address of the whole request, engine id included.
    `content`: the SHA-256 of everything a plan depends on, which is the request
    without its engine id. Two engines with equal `content` get equal plans apart
    from the ids: a fleet's new replica of a model it has already planned.
    `model`: the SHA-256 of what its model plan (`plan_model`) depends on, which is
    `content` without the workers' device and memory settings. Engines with equal
    `model` and any memory share one model plan.
    """

    plan_id: str
    content: bytes
    model: bytes


def plan_keys(
    message: plan_pb2.PlanRequest, encoded_workers: Sequence[WorkerBytes] | None = None
) -> PlanKeys:
    """Both keys of a request in one walk: every set field in deterministic bytes,
    workers in rank order (so worker order does not change them). Each part is framed
    with its field number and length; nothing is copied. `encoded_workers`: the
    request's `encode_workers`, when the caller has them."""
    encoded = encode_workers(message) if encoded_workers is None else encoded_workers
    whole, content, model = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    workers_field = plan_pb2.PlanRequest.WORKERS_FIELD_NUMBER
    engine_id_field = plan_pb2.PlanRequest.ENGINE_ID_FIELD_NUMBER
    # A what-if question changes the diagnostics, not the model plan.
    shared_prefix_field = plan_pb2.PlanRequest.SHARED_PREFIX_TOKENS_FIELD_NUMBER
    for field, value in message.ListFields():
        if field.number == workers_field:
            continue
        part = (
            value.SerializeToString(deterministic=True)
            if field.message_type is not None
            else repr(value).encode()
        )
        framed = b"%d:%d:" % (field.number, len(part)) + part
        whole.update(framed)
        if field.number != engine_id_field:
            content.update(framed)
            if field.number != shared_prefix_field:
                model.update(framed)
    ranks = [worker.rank for worker in message.workers]
    for index in sorted(range(len(ranks)), key=ranks.__getitem__):
        part = encoded[index].data
        frame = b"%d:%d:" % (workers_field, len(part))
        whole.update(frame)
        whole.update(part)
        content.update(frame)
        content.update(part)
    # Each distinct layer list hashed once (tensor-parallel ranks share one).
    layer_digests: dict[bytes, bytes] = {}
    for index in sorted(range(len(ranks)), key=ranks.__getitem__):
        layers = encoded[index].layers_key
        digest = layer_digests.get(layers)
        if digest is None:
            digest = layer_digests[layers] = hashlib.sha256(layers).digest()
        model.update(b"%d:%d:" % (workers_field, ranks[index]) + digest)
    return PlanKeys(f"plan-{whole.hexdigest()[:32]}", content.digest(), model.digest())


def plan_id_for(
    message: plan_pb2.PlanRequest, encoded_workers: Sequence[WorkerBytes] | None = None
) -> str:
    """The request's content address (`PlanKeys.plan_id`)."""
    return plan_keys(message, encoded_workers).plan_id
