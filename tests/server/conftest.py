"""A real server on loopback, started inside each test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest_asyncio

from kvplan.client import AsyncPlannerClient
from kvplan.server.config import Settings
from kvplan.server.main import RunningServer, start_server
from kvplan.v1 import plan_pb2, spec_pb2

GIB = 1 << 30
TEST_SETTINGS = Settings(
    host="127.0.0.1", port=0, metrics_port=-1, grace_s=2.0, store="memory", probe="static"
)


@pytest_asyncio.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_server(replace(TEST_SETTINGS, devices="2xH100-80GB"))
    yield running
    await running.stop(0)


@pytest_asyncio.fixture
async def client(server: RunningServer) -> AsyncIterator[AsyncPlannerClient]:
    async with AsyncPlannerClient(f"127.0.0.1:{server.port}", timeout_s=10) as planner:
        yield planner


def full_layer(name: str, heads: int = 8) -> spec_pb2.LayerSpec:
    layer = spec_pb2.LayerSpec(name=name)
    layer.full_attention.attention.num_kv_heads = heads
    layer.full_attention.attention.head_size = 128
    return layer


def worker(rank: int, layers: list[spec_pb2.LayerSpec], kv_bytes: int = GIB) -> plan_pb2.WorkerSpec:
    spec = plan_pb2.WorkerSpec(rank=rank, layers=layers)
    spec.memory.kv_cache_memory_bytes = kv_bytes
    return spec


def engine_request(
    engine_id: str = "engine-a", stages: int = 1, kv_bytes: int = GIB, layers: int = 8
) -> plan_pb2.PlanRequest:
    request = plan_pb2.PlanRequest(engine_id=engine_id)
    request.options.max_model_len = 4096
    per_stage = layers // stages
    for rank in range(stages):
        names = range(rank * per_stage, (rank + 1) * per_stage)
        request.workers.append(
            worker(rank, [full_layer(f"model.layers.{i}.attn") for i in names], kv_bytes)
        )
    return request


def rank_request(
    engine_id: str, rank: int, world_size: int, layers_per_rank: int = 4, kv_bytes: int = GIB
) -> plan_pb2.PlanRequest:
    request = plan_pb2.PlanRequest(engine_id=engine_id, world_size=world_size)
    request.options.max_model_len = 4096
    names = range(rank * layers_per_rank, (rank + 1) * layers_per_rank)
    request.workers.append(
        worker(rank, [full_layer(f"model.layers.{i}.attn") for i in names], kv_bytes)
    )
    return request
