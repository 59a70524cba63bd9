"""Thin client for engine workers: needs only grpcio and protobuf.

    with PlannerClient("planner:50051") as planner:
        plan = planner.plan(request)               # engine mode: all workers
        plan.group_of("model.layers.3.self_attn.attn")
        plan.draft_group_ids, plan.worker(rank).num_blocks

A plan whose workers named their devices (device.uuid) carries leases: keep
them with `LeaseKeeper(planner, plan)` (or `AsyncLeaseKeeper`), which renews
them in the background and releases them on exit. `AsyncPlannerClient` is the
asyncio twin. `build_plan_request(load_config(path), ModelPlanOptions(...))` builds the
request from a model's config.json (kvplan.models). Errors raise `PlannerError` with the
gRPC code and the server's field violations. `security=ChannelSecurity(...)`
(or `ChannelSecurity.from_env()`, KVPLAN_TLS_CA / KVPLAN_CLIENT_CERT /
KVPLAN_CLIENT_KEY / KVPLAN_TOKEN) adds TLS, a client certificate, a token.
"""

# vLLM imports the plugin's entry point (kvplan.client.vllm_plugin) in every process,
# with or without KVPLAN_ADDR: this package imports grpc and the stubs only when one
# of its names is first used, so an engine that does not use kvplan pays nothing and
# cannot be broken by it (an old protobuf, no grpcio).
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplan.client.errors import PlannerError, error_from_rpc
    from kvplan.client.leases import AsyncLeaseKeeper, LeaseKeeper
    from kvplan.client.model import PlanResult, WorkerView
    from kvplan.client.planner import (
        DEFAULT_TIMEOUT_S,
        AsyncPlannerClient,
        PlannerClient,
        channel_options,
    )
    from kvplan.client.security import ChannelSecurity
    from kvplan.models.request import ModelPlanOptions, build_plan_request

_MODULE_OF = {
    "PlannerError": "kvplan.client.errors",
    "error_from_rpc": "kvplan.client.errors",
    "AsyncLeaseKeeper": "kvplan.client.leases",
    "LeaseKeeper": "kvplan.client.leases",
    "PlanResult": "kvplan.client.model",
    "WorkerView": "kvplan.client.model",
    "DEFAULT_TIMEOUT_S": "kvplan.client.planner",
    "AsyncPlannerClient": "kvplan.client.planner",
    "PlannerClient": "kvplan.client.planner",
    "channel_options": "kvplan.client.planner",
    "ChannelSecurity": "kvplan.client.security",
    "ModelPlanOptions": "kvplan.models.request",
    "build_plan_request": "kvplan.models.request",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvplan.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain
    return value


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncLeaseKeeper",
    "AsyncPlannerClient",
    "ChannelSecurity",
    "LeaseKeeper",
    "ModelPlanOptions",
    "PlanResult",
    "PlannerClient",
    "PlannerError",
    "WorkerView",
    "build_plan_request",
    "channel_options",
    "error_from_rpc",
]
