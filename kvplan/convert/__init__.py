"""Proto <-> domain conversion: the only package that knows both.

One request, once through each step (`plan_from_proto`): its workers' bytes
(`wire.encode_workers`) -> checked and converted to an EngineRequest
(`request.request_from_proto`, with `checks`' per-release rules) -> planned
(`kvplan.core.planner.worker_budgets`, `plan_model`, `plan_engine`) -> rendered
(`render.plan_to_proto`). `keys.plan_keys` names the plan and its cached halves.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from kvplan.convert.keys import plan_id_for, plan_keys
from kvplan.convert.render import (
    plan_to_proto,
    prefix_cache_diagnostics,
    prefix_what_if_to_proto,
    render_groups,
)
from kvplan.convert.request import request_from_proto
from kvplan.convert.wire import WorkerBytes, encode_workers
from kvplan.core.errors import InvalidRequest
from kvplan.core.planner import plan_engine, plan_model, worker_budgets
from kvplan.model_cache import KnownModel, ModelCache
from kvplan.v1 import plan_pb2


def plan_from_proto(
    message: plan_pb2.PlanRequest,
    *,
    gpu_memory_table: Mapping[str, int] | None = None,
    plan_id: str | None = None,
    encoded_workers: Sequence[WorkerBytes] | None = None,
    models: ModelCache | None = None,
    model_key: Hashable | None = None,
) -> plan_pb2.PlanResponse:
    """request -> validate -> plan -> budget -> respond. `plan_id`: the request's
    `plan_id_for`, when the caller already has it; `encoded_workers`: its
    `encode_workers` (serialized once for the plan id and the conversion).

    `models`: where model plans are kept; `model_key`: this request's key there (by
    default its `PlanKeys.model`; a caller adds whatever scopes it). A known model is
    not converted or grouped again, only budgeted: the same plan, for less work.
    """
    encoded = encode_workers(message) if encoded_workers is None else encoded_workers
    known = None
    if models is not None:
        if model_key is None:
            model_key = plan_keys(message, encoded).model
        known = models.get(model_key)
    request = request_from_proto(
        message, gpu_memory_table=gpu_memory_table, encoded_workers=encoded, known_model=known
    )
    budgets = worker_budgets(request)  # as the workers start, before there is a model
    if known is not None:
        model, rendered_groups = known.plan, known.rendered_groups
    else:
        model, rendered_groups = plan_model(request), None
    plan = plan_engine(request, model, budgets)
    try:
        kept = None
        if known is None and models is not None:
            # Kept once an engine of it planned: rendering reads every page size, which
            # may raise an error that vLLM (and plan_engine) raises later than others.
            rendered_groups = render_groups(model.groups)
            kept = KnownModel.of(request, model, rendered_groups)
            models.put(model_key, kept)
        response = plan_to_proto(
            plan, plan_id=plan_id or plan_id_for(message, encoded), rendered_groups=rendered_groups
        )
        if known is not None and known.prefix_diagnostics:
            prefix = known.prefix_diagnostics
        else:
            options = message.options
            asked_off = options.HasField("enable_prefix_caching") and not (
                options.enable_prefix_caching
            )
            prefix = prefix_cache_diagnostics(request, response, asked_off=asked_off)
            if kept is not None and models is not None:
                models.put(model_key, kept.with_prefix_diagnostics(prefix))
        response.diagnostics.MergeFromString(prefix)
        if message.HasField("shared_prefix_tokens"):
            prefix_what_if_to_proto(request, response, message.shared_prefix_tokens)
        return response
    except ValueError as error:  # protobuf: a number outside its field's type
        raise InvalidRequest(
            "the plan's numbers do not fit the reply's 64-bit fields (a size or count "
            f"exceeds 2^64-1: {error}); the request's sizes, block counts or shapes are "
            "out of range",
            field=(
                "options.num_gpu_blocks_override"
                if message.options.HasField("num_gpu_blocks_override")
                else "workers"
            ),
        ) from error


__all__ = ["plan_from_proto"]
