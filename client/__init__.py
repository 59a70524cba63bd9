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
