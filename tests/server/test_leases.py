"""Budgets and leases through a real server and client: co-located engines,
unknown devices, re-planning, heartbeats, release, expiry, rank mode, metrics."""

from __future__ import annotations

import asyncio
import math
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvplan.client import (
    AsyncLeaseKeeper,
    AsyncPlannerClient,
    LeaseKeeper,
    PlannerClient,
    PlannerError,
)
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.server.main import RunningServer, start_server
from kvplan.v1 import plan_pb2
from tests.server.conftest import GIB, TEST_SETTINGS, full_layer

TOTAL = GPU_MEMORY_BYTES["H100-80GB"]  # H100-80GB in the static inventory
SHARE = math.ceil(TOTAL * 0.45)


@pytest_asyncio.fixture(params=["memory", "sqlite"])
async def ledger_server(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[RunningServer]:
    store = "memory" if request.param == "memory" else f"sqlite://{tmp_path / 'kvplan.sqlite3'}"
    running = await start_server(
        replace(TEST_SETTINGS, devices="2xH100-80GB", lease_ttl_s=30, store=store)
    )
    yield running
    await running.stop(0)


@pytest_asyncio.fixture
async def planner(ledger_server: RunningServer) -> AsyncIterator[AsyncPlannerClient]:
    async with AsyncPlannerClient(f"127.0.0.1:{ledger_server.port}", timeout_s=10) as client:
        yield client


async def device_uuids(client: AsyncPlannerClient) -> list[str]:
    return [device.uuid for device in (await client.list_devices()).devices]


def leased_request(
    engine_id: str,
    uuid: str,
    *,
    utilization: float = 0.45,
    rank: int = 0,
    world_size: int = 0,
    layers: range = range(8),
) -> plan_pb2.PlanRequest:
    request = plan_pb2.PlanRequest(engine_id=engine_id, world_size=world_size)
    request.options.max_model_len = 4096
    worker = request.workers.add(rank=rank)
    worker.device.uuid = uuid
    worker.memory.gpu_memory_utilization = utilization
    worker.memory.non_kv.weights_bytes = 16 * GIB
    worker.memory.non_kv.activation_peak_bytes = 2 * GIB
    worker.layers.extend(full_layer(f"model.layers.{i}.attn") for i in layers)
    return request


async def test_two_engines_share_a_device_a_third_waits_for_a_release(
    planner: AsyncPlannerClient, ledger_server: RunningServer
) -> None:
    uuid = (await device_uuids(planner))[0]
    first = await planner.plan(leased_request("engine-a", uuid))
    second = await planner.plan(leased_request("engine-b", uuid))
    for plan in (first, second):
        (lease,) = plan.leases
        assert (lease.device_uuid, lease.bytes) == (uuid, SHARE)
        budget = plan.worker(0).budget
        assert budget.mode == plan_pb2.BUDGET_MODE_UTILIZATION
        assert budget.requested_bytes == SHARE
        assert budget.available_bytes == SHARE - 18 * GIB
        assert budget.footprint_bytes == SHARE
    assert second.leases[0].account.committed_bytes == SHARE  # engine-a's, when granted
    # engine-b's request is engine-a's but for the id: its plan is reused, its lease its own.
    assert ledger_server.metrics.plans_reused._value.get() == 1
    assert second.leases[0].engine_id == "engine-b"

    with pytest.raises(PlannerError) as refused:
        await planner.plan(leased_request("engine-c", uuid))
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.metadata["committed_bytes"] == str(2 * SHARE)
    assert refused.value.metadata["requested_bytes"] == str(SHARE)
    assert refused.value.metadata["commit_limit_bytes"] == str(TOTAL)
    assert "engine 'engine-c'" in refused.value.details
    # Without authentication every caller is one identity: the holders are named.
    assert (
        f"Held by: engine 'engine-a' (rank 0) {SHARE / GIB:.2f} GiB, "
        f"engine 'engine-b' (rank 0) {SHARE / GIB:.2f} GiB."
    ) in refused.value.details, refused.value.details
    assert refused.value.metadata["holdings"] == f"engine-a|0|{SHARE};engine-b|0|{SHARE}"
    with pytest.raises(PlannerError) as missing:  # a refused engine has no plan to fetch
        await planner.get_plan(engine_id="engine-c")
    assert missing.value.code is grpc.StatusCode.NOT_FOUND

    released = await planner.release_plan("engine-a")
    assert released.released_bytes == SHARE
    third = await planner.plan(leased_request("engine-c", uuid))
    assert third.leases[0].bytes == SHARE
    (device,) = [d for d in (await planner.list_devices()).devices if d.uuid == uuid]
    assert (device.committed_bytes, device.live_leases) == (2 * SHARE, 2)
    assert device.available_to_grant_bytes == TOTAL - 2 * SHARE
    assert ledger_server.metrics.grants_refused.labels("commit_limit")._value.get() == 1


async def test_unknown_device_is_not_found_with_the_known_uuids(
    planner: AsyncPlannerClient,
) -> None:
    known = await device_uuids(planner)
    with pytest.raises(PlannerError) as caught:
        await planner.plan(leased_request("engine-u", "GPU-nope"))
    assert caught.value.code is grpc.StatusCode.NOT_FOUND
    assert caught.value.violations[0].field == "workers[0].device.uuid"
    assert caught.value.metadata["known_uuids"] == ",".join(sorted(known))


async def test_a_lease_needs_an_engine_id(planner: AsyncPlannerClient) -> None:
    uuid = (await device_uuids(planner))[0]
    with pytest.raises(PlannerError) as caught:
        await planner.plan(leased_request("", uuid))
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.violations[0].field == "engine_id"


async def test_replanning_an_engine_replaces_its_leases(planner: AsyncPlannerClient) -> None:
    uuid = (await device_uuids(planner))[0]
    await planner.plan(leased_request("engine-r", uuid, utilization=0.9))
    # A restart of the same engine: its own 0.9 does not count against it.
    again = await planner.plan(leased_request("engine-r", uuid, utilization=0.9))
    assert again.leases[0].account.committed_bytes == 0
    smaller = await planner.plan(leased_request("engine-r", uuid, utilization=0.5))
    (device,) = [d for d in (await planner.list_devices()).devices if d.uuid == uuid]
    assert device.committed_bytes == smaller.leases[0].bytes == math.ceil(TOTAL * 0.5)


async def test_heartbeat_reports_allocations_and_keeps_leases(
    planner: AsyncPlannerClient,
) -> None:
    uuid = (await device_uuids(planner))[0]
    plan = await planner.plan(leased_request("engine-h", uuid))
    first_expiry = plan.leases[0].expires_at.ToNanoseconds()
    await asyncio.sleep(0.01)
    (renewed,) = await planner.renew_leases("engine-h", {0: 20 * GIB})
    assert renewed.allocated_bytes == 20 * GIB
    assert renewed.expires_at.ToNanoseconds() > first_expiry
    (device,) = [d for d in (await planner.list_devices()).devices if d.uuid == uuid]
    assert device.outstanding_bytes == SHARE - 20 * GIB
    fetched = await planner.get_plan(engine_id="engine-h")
    assert [lease.allocated_bytes for lease in fetched.leases] == [20 * GIB]

    with pytest.raises(PlannerError) as caught:
        await planner.renew_leases("engine-none")
    assert caught.value.code is grpc.StatusCode.NOT_FOUND


async def test_free_fraction_mode_applies_to_what_the_ledger_can_grant(
    planner: AsyncPlannerClient,
) -> None:
    uuid = (await device_uuids(planner))[0]
    await planner.plan(leased_request("engine-a", uuid, utilization=0.5))
    request = leased_request("engine-f", uuid)
    worker = request.workers[0]
    worker.memory.free_memory_fraction = 0.9
    worker.memory.device_bytes_in_use = 18 * GIB
    plan = await planner.plan(request)
    budget = plan.worker(0).budget
    # min(limit - committed - in use, free - outstanding); the static probe's free is the total.
    available = TOTAL - math.ceil(TOTAL * 0.5) - 18 * GIB
    assert budget.mode == plan_pb2.BUDGET_MODE_FREE_FRACTION
    assert budget.free_bytes == available
    assert budget.available_bytes == math.floor(available * 0.9)
    assert plan.leases[0].bytes == 18 * GIB + math.floor(available * 0.9)
    assert plan.leases[0].allocated_bytes == 18 * GIB


async def test_rank_mode_grants_every_rank_once(planner: AsyncPlannerClient) -> None:
    uuids = await device_uuids(planner)
    results = await asyncio.gather(
        *(
            planner.plan(
                leased_request(
                    "engine-tp",
                    uuids[rank],
                    rank=rank,
                    world_size=2,
                    layers=range(4 * rank, 4 * rank + 4),
                )
            )
            for rank in range(2)
        )
    )
    assert results[0].plan_id == results[1].plan_id
    for result in results:
        assert sorted((lease.rank, lease.device_uuid) for lease in result.leases) == [
            (0, uuids[0]),
            (1, uuids[1]),
        ]
        assert result.worker(1).lease is not None
    devices = {d.uuid: d for d in (await planner.list_devices()).devices}
    assert [devices[uuid].committed_bytes for uuid in uuids] == [SHARE, SHARE]


async def test_lease_keeper_renews_in_the_background_and_releases() -> None:
    running = await start_server(replace(TEST_SETTINGS, devices="1xH100-80GB", lease_ttl_s=0.6))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuid = (await device_uuids(client))[0]
            plan = await client.plan(leased_request("engine-k", uuid))
            async with AsyncLeaseKeeper(client, plan, allocations=lambda: {0: GIB}) as keeper:
                await asyncio.sleep(1.5)  # more than two TTLs
                (device,) = (await client.list_devices()).devices
                assert device.committed_bytes == SHARE
                assert keeper.renewals >= 3
            (device,) = (await client.list_devices()).devices
            assert device.committed_bytes == 0  # released on exit
    finally:
        await running.stop(0)


async def test_expired_lease_returns_its_budget_within_ttl_plus_one_second() -> None:
    ttl_s = 1.0
    running = await start_server(replace(TEST_SETTINGS, devices="1xH100-80GB", lease_ttl_s=ttl_s))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuid = (await device_uuids(client))[0]
            await client.plan(leased_request("engine-dies", uuid, utilization=0.9))
            granted = time.monotonic()
            with pytest.raises(PlannerError):
                await client.plan(leased_request("engine-next", uuid, utilization=0.9))
            while True:
                try:
                    await client.plan(leased_request("engine-next", uuid, utilization=0.9))
                    break
                except PlannerError as error:
                    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.05)
            assert time.monotonic() - granted <= ttl_s + 1.0
            with pytest.raises(PlannerError) as caught:
                await client.renew_leases("engine-dies")
            # Swept already (NOT_FOUND) or not yet (FAILED_PRECONDITION): never renewed.
            assert caught.value.code in (
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION,
            )
    finally:
        await running.stop(0)


async def test_ledger_metrics_after_known_calls(
    planner: AsyncPlannerClient, ledger_server: RunningServer
) -> None:
    uuid = (await device_uuids(planner))[0]
    await planner.plan(leased_request("engine-m1", uuid))
    await planner.plan(leased_request("engine-m2", uuid))
    with pytest.raises(PlannerError):
        await planner.plan(leased_request("engine-m3", uuid))
    await planner.release_plan("engine-m2")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{ledger_server.metrics_port}/metrics", timeout=5) as page:
        text = page.read().decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    device = (("device_uuid", uuid),)
    assert samples[("kvplan_device_committed_bytes", device)] == SHARE
    assert samples[("kvplan_device_total_bytes", device)] == TOTAL
    assert samples[("kvplan_device_available_to_grant_bytes", device)] == TOTAL - SHARE
    assert samples[("kvplan_leases_active", ())] == 1
    assert samples[("kvplan_leases_granted_total", ())] == 2
    assert samples[("kvplan_leases_ended_total", (("reason", "released"),))] == 1
    assert samples[("kvplan_grants_refused_total", (("reason", "commit_limit"),))] == 1


async def test_concurrent_engines_never_over_commit(
    planner: AsyncPlannerClient,
) -> None:
    uuid = (await device_uuids(planner))[0]
    for trial in range(20):
        results = await asyncio.gather(
            *(
                planner.plan(leased_request(f"race-{trial}-{i}", uuid, utilization=0.3))
                for i in range(8)
            ),
            return_exceptions=True,
        )
        granted = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, PlannerError)]
        assert len(granted) == 3 and len(refused) == 5  # 3 x 0.3 <= 1 < 4 x 0.3
        (device,) = [d for d in (await planner.list_devices()).devices if d.uuid == uuid]
        assert device.committed_bytes == 3 * math.ceil(TOTAL * 0.3) <= TOTAL
        for result in granted:
            await planner.release_plan(result.engine_id)


class _BrokenProbe:
    """A driver that fails mid-run (e.g. a GPU fell off the bus)."""

    name = "nvml"

    def snapshot(self) -> tuple[()]:
        raise RuntimeError("NVML: GPU is lost")

    def close(self) -> None:
        return None


async def test_a_failing_probe_is_unavailable_not_internal(
    planner: AsyncPlannerClient, ledger_server: RunningServer
) -> None:
    uuid = (await device_uuids(planner))[0]
    ledger_server.servicer._probe = _BrokenProbe()
    for call in (
        planner.plan(leased_request("engine-lost", uuid), timeout_s=5),
        planner.list_devices(timeout_s=5),
    ):
        with pytest.raises(PlannerError) as caught:
            await call
        assert caught.value.code is grpc.StatusCode.UNAVAILABLE
        assert "GPU is lost" in caught.value.details


async def test_sync_lease_keeper_renews_releases_and_reports_a_lost_lease(
    planner: AsyncPlannerClient, ledger_server: RunningServer
) -> None:
    uuid = (await device_uuids(planner))[0]
    target = f"127.0.0.1:{ledger_server.port}"

    def run_keepers() -> tuple[int, int, bool, list[grpc.StatusCode]]:
        with PlannerClient(target, timeout_s=5) as client:
            plan = client.plan(leased_request("engine-sync", uuid))
            with LeaseKeeper(client, plan, interval_s=0.1, allocations=lambda: {0: GIB}) as kept:
                # Waits on what happened, not on a fixed time: a busy machine is slower.
                deadline = time.monotonic() + 10
                while kept.renewals < 3 and time.monotonic() < deadline:
                    time.sleep(0.02)
            committed_after_exit = client.list_devices().devices[0].committed_bytes
            lost_codes: list[grpc.StatusCode] = []
            plan = client.plan(leased_request("engine-sync", uuid))
            keeper = LeaseKeeper(
                client, plan, interval_s=0.1, on_lost=lambda error: lost_codes.append(error.code)
            ).start()
            client.release_plan("engine-sync")  # released behind the keeper's back
            deadline = time.monotonic() + 10
            while not keeper.lost and time.monotonic() < deadline:
                time.sleep(0.02)
            keeper.stop()
            return kept.renewals, committed_after_exit, keeper.lost, lost_codes

    renewals, committed, lost, codes = await asyncio.to_thread(run_keepers)
    assert renewals >= 3
    assert committed == 0  # released on exit
    assert lost and codes == [grpc.StatusCode.NOT_FOUND]
