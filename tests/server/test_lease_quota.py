"""--max-leases-per-identity is exact: engines of one identity starting at once,
on one server (SQLite) or on two replicas sharing one real Redis, get exactly the
quota's worth of leases, the rest RESOURCE_EXHAUSTED naming the flag.

The quota is checked inside the store's grant transaction; a check against a
ledger reading taken before the grant lets every concurrent grant pass."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import redis

from kvplan.client import AsyncPlannerClient, ChannelSecurity, PlannerError, PlanResult
from kvplan.server.config import Settings
from kvplan.server.main import RunningServer, start_server
from tests.server.conftest import TEST_SETTINGS
from tests.server.redis_server import RedisServer, running_redis
from tests.server.test_leases import device_uuids, leased_request

TOKEN = "token-of-the-one-identity-0123"
ENGINES = 8  # started at once, one device each: the devices never refuse
QUOTA = 3
TRIALS = 20  # each trial starts ENGINES new engines; a race shows within a few


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis-quota")) as server:
        yield server


def quota_settings(tmp_path: Path, store: str, *, authenticated: bool) -> Settings:
    settings = replace(
        TEST_SETTINGS,
        devices=f"{ENGINES}xH100-80GB",
        store=store,
        max_leases_per_identity=QUOTA,
        # Every plan in a worker thread, as a large engine's: the event loop takes
        # the other engines' calls meanwhile, as it does under load.
        offload_layers=0,
        redis_allow_no_persistence=True,
    )
    if authenticated:
        tokens = tmp_path / "tokens"
        tokens.write_text(f"{TOKEN} team-a\n")
        tokens.chmod(0o600)
        settings = replace(settings, token_file=str(tokens))
    return settings


def refused_by_quota(server: RunningServer) -> float:
    value = server.metrics.registry.get_sample_value(
        "kvplan_limits_hit_total", {"limit": "max_leases_per_identity"}
    )
    return value or 0.0


async def start_at_once(
    clients: list[AsyncPlannerClient], uuids: list[str], trial: int
) -> tuple[list[PlanResult], list[PlannerError]]:
    """ENGINES new engines of one identity, each on its own device, spread over
    `clients` round robin, all sent at once."""
    results = await asyncio.gather(
        *(
            clients[index % len(clients)].plan(
                leased_request(
                    f"quota-{trial}-{index}",
                    uuids[index],
                    # A budget of its own: no plan comes from the cache, so each
                    # engine is planned (in a thread) between its reads and its grant.
                    utilization=0.3 + 0.001 * (trial * ENGINES + index),
                )
            )
            for index in range(ENGINES)
        ),
        return_exceptions=True,
    )
    granted = [result for result in results if isinstance(result, PlanResult)]
    refused = [result for result in results if isinstance(result, PlannerError)]
    assert len(granted) + len(refused) == ENGINES, results  # nothing else went wrong
    return granted, refused


def check_refusals(refused: list[PlannerError]) -> None:
    for error in refused:
        assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert error.metadata["limit"] == "max_leases_per_identity"
        assert error.metadata["limit_value"] == str(QUOTA)
        assert error.metadata["value"] == str(QUOTA + 1)  # QUOTA held, one more asked
        assert "max-leases-per-identity" in error.details


async def live_leases(client: AsyncPlannerClient) -> int:
    return sum(device.live_leases for device in (await client.list_devices()).devices)


@pytest.mark.parametrize("authenticated", [True, False], ids=["token", "insecure"])
async def test_engines_starting_at_once_on_one_server_get_exactly_the_quota(
    tmp_path: Path, authenticated: bool
) -> None:
    settings = quota_settings(
        tmp_path, f"sqlite://{tmp_path / 'kvplan.sqlite3'}", authenticated=authenticated
    )
    running = await start_server(settings)
    security = ChannelSecurity(token=TOKEN) if authenticated else None
    try:
        async with AsyncPlannerClient(
            f"127.0.0.1:{running.port}", timeout_s=30, security=security
        ) as client:
            uuids = await device_uuids(client)
            for trial in range(TRIALS):
                granted, refused = await start_at_once([client], uuids, trial)
                assert len(granted) == QUOTA, f"trial {trial}: {len(granted)} granted"
                check_refusals(refused)
                assert await live_leases(client) == QUOTA
                for result in granted:
                    await client.release_plan(result.engine_id)
                assert await live_leases(client) == 0
            assert refused_by_quota(running) == TRIALS * (ENGINES - QUOTA)
    finally:
        await running.stop(0)


async def test_engines_starting_at_once_on_two_replicas_get_exactly_the_quota(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis.Redis.from_url(redis_server.url).flushdb()
    settings = quota_settings(tmp_path, redis_server.url, authenticated=True)
    # The same inventory string gives both replicas the same device UUIDs.
    servers = [await start_server(settings) for _ in range(2)]
    clients = [
        AsyncPlannerClient(
            f"127.0.0.1:{server.port}", timeout_s=30, security=ChannelSecurity(token=TOKEN)
        )
        for server in servers
    ]
    try:
        uuids = await device_uuids(clients[0])
        assert uuids == await device_uuids(clients[1])
        for trial in range(TRIALS):
            granted, refused = await start_at_once(clients, uuids, trial)
            assert len(granted) == QUOTA, f"trial {trial}: {len(granted)} granted"
            check_refusals(refused)
            for client in clients:  # one ledger: both replicas see the same leases
                assert await live_leases(client) == QUOTA
            for result in granted:
                await clients[0].release_plan(result.engine_id)
            assert await live_leases(clients[1]) == 0
        assert sum(refused_by_quota(server) for server in servers) == TRIALS * (ENGINES - QUOTA)
    finally:
        for client in clients:
            await client.close()
        for server in servers:
            await server.stop(0)
