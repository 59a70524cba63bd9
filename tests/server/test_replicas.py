"""Two server replicas on one real Redis: one rendezvous and one ledger across
both, and a Redis outage under running servers (UNAVAILABLE, then recovery)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import redis

from kvplan.client import AsyncPlannerClient, PlannerError
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.server.main import RunningServer, start_server
from tests.server.conftest import TEST_SETTINGS, rank_request
from tests.server.redis_server import RedisServer, running_redis
from tests.server.test_leases import leased_request

SHARE = math.ceil(GPU_MEMORY_BYTES["H100-80GB"] * 0.45)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis-replicas")) as server:
        yield server


@pytest_asyncio.fixture
async def replicas(
    redis_server: RedisServer,
) -> AsyncIterator[list[tuple[RunningServer, AsyncPlannerClient]]]:
    redis.Redis.from_url(redis_server.url).flushdb()
    # The same inventory string gives both replicas the same device UUIDs.
    settings = replace(
        TEST_SETTINGS,
        devices="1xH100-80GB",
        store=redis_server.url,
        redis_allow_no_persistence=True,
    )
    servers = [await start_server(settings) for _ in range(2)]
    clients = [AsyncPlannerClient(f"127.0.0.1:{s.port}", timeout_s=10) for s in servers]
    yield list(zip(servers, clients, strict=True))
    for client in clients:
        await client.close()
    for server in servers:
        await server.stop(0)


async def test_ranks_on_different_replicas_meet_in_one_rendezvous(
    replicas: list[tuple[RunningServer, AsyncPlannerClient]],
) -> None:
    (_, first), (_, second) = replicas
    results = await asyncio.gather(
        *(
            (first if rank % 2 else second).plan(rank_request(f"engine-{e}", rank, 4))
            for e in range(8)
            for rank in range(4)
        )
    )
    by_engine: dict[str, set[str]] = {}
    for result in results:
        by_engine.setdefault(result.engine_id, set()).add(result.plan_id)
        assert [worker.rank for worker in result.response.workers] == [0, 1, 2, 3]
    assert len(by_engine) == 8 and all(len(ids) == 1 for ids in by_engine.values())
    # Either replica finds a plan the other one made.
    fetched = await first.get_plan(engine_id="engine-3")
    assert fetched.plan_id in by_engine["engine-3"]


async def test_one_ledger_across_replicas(
    replicas: list[tuple[RunningServer, AsyncPlannerClient]],
) -> None:
    (_, first), (_, second) = replicas
    uuid = (await first.list_devices()).devices[0].uuid
    assert uuid == (await second.list_devices()).devices[0].uuid
    await first.plan(leased_request("engine-a", uuid))
    await second.plan(leased_request("engine-b", uuid))
    with pytest.raises(PlannerError) as refused:
        await first.plan(leased_request("engine-c", uuid))
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.metadata["committed_bytes"] == str(2 * SHARE)
    await second.release_plan("engine-a")  # released on the other replica
    await first.plan(leased_request("engine-c", uuid))
    (device,) = (await second.list_devices()).devices
    assert device.committed_bytes == 2 * SHARE


async def test_redis_outage_is_unavailable_then_recovers(
    replicas: list[tuple[RunningServer, AsyncPlannerClient]],
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    (_, first), (_, second) = replicas
    uuid = (await first.list_devices()).devices[0].uuid
    redis_server.stop()
    try:
        with pytest.raises(PlannerError) as caught:
            await first.plan(leased_request("engine-down", uuid), timeout_s=30)
        assert caught.value.code is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(PlannerError) as caught:
            await second.renew_leases("engine-down", timeout_s=30)
        assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    finally:
        redis_server.start()
    # This Redis keeps nothing across a restart: it came back empty, so grants are
    # paused for one lease TTL (test_store_loss.py); the pause is ended here by
    # hand, as if the TTL had passed.
    with pytest.raises(PlannerError) as caught:
        await first.plan(leased_request("engine-up", uuid))
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert "lost its data" in caught.value.details
    redis.Redis.from_url(redis_server.url).delete("kvplan:grants-paused")
    # Back: leases and rendezvous work again on both replicas, with no restart.
    for _ in range(100):
        try:
            plan = await first.plan(leased_request("engine-up", uuid))
            break
        except PlannerError as error:
            assert error.code is grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.05)
    else:
        raise AssertionError("the server never recovered from the Redis restart")
    assert plan.leases[0].bytes == SHARE
    for _ in range(100):  # the replicas' listeners resubscribe after the restart
        try:
            results = await asyncio.wait_for(
                asyncio.gather(
                    first.plan(rank_request("engine-after", 0, 2)),
                    second.plan(rank_request("engine-after", 1, 2)),
                ),
                timeout=2,
            )
            break
        except (TimeoutError, PlannerError):
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("cross-replica rendezvous never recovered")
    assert results[0].plan_id == results[1].plan_id
