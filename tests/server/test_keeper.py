"""The lease keepers never lose a lease silently (a real server on loopback)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import replace

import grpc
import pytest

from kvplan.client import AsyncLeaseKeeper, AsyncPlannerClient, LeaseKeeper, PlannerClient
from kvplan.client.errors import PlannerError
from kvplan.server.main import start_server
from kvplan.v1 import plan_pb2
from tests.server.conftest import TEST_SETTINGS
from tests.server.test_leases import device_uuids, leased_request


async def test_a_failing_allocation_callback_reaches_on_error_and_the_lease_lives() -> None:
    running = await start_server(replace(TEST_SETTINGS, devices="1xH100-80GB", lease_ttl_s=0.6))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuid = (await device_uuids(client))[0]
            plan = await client.plan(leased_request("engine-cb", uuid))
            errors: list[Exception] = []
            lost: list[PlannerError] = []

            def broken() -> Mapping[int, int]:
                raise RuntimeError("allocator is gone")

            async with AsyncLeaseKeeper(
                client, plan, allocations=broken, on_error=errors.append, on_lost=lost.append
            ) as keeper:
                await asyncio.sleep(1.5)  # more than two TTLs
                (device,) = (await client.list_devices()).devices
                assert device.live_leases == 1  # renewed without the report
                assert keeper.renewals >= 3
            assert errors and isinstance(errors[0], RuntimeError)
            assert not lost
            # Without a handler the error is raised at the next interaction.
            plan = await client.plan(leased_request("engine-cb", uuid))
            quiet = AsyncLeaseKeeper(client, plan, interval_s=0.05, allocations=broken).start()
            await asyncio.sleep(0.2)
            with pytest.raises(RuntimeError, match="allocator is gone"):
                quiet.check()
            await quiet.stop()
    finally:
        await running.stop(0)


async def test_renewal_retries_until_the_lease_would_expire_then_reports_it() -> None:
    running = await start_server(replace(TEST_SETTINGS, devices="1xH100-80GB", lease_ttl_s=1.0))
    client = AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=0.5)
    try:
        uuid = (await device_uuids(client))[0]
        plan = await client.plan(leased_request("engine-outage", uuid))
        lost: list[PlannerError] = []
        keeper = AsyncLeaseKeeper(client, plan, on_lost=lost.append, retry_s=0.1).start()
        await running.stop(0)  # the server goes away
        await asyncio.sleep(0.5)
        assert not lost and not keeper.lost  # still trying: the lease has not expired yet
        await asyncio.sleep(1.5)
        assert keeper.lost and len(lost) == 1
        assert lost[0].code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "expired while renewals failed" in lost[0].details
        await keeper.stop()  # lost: nothing to release, nothing raised
    finally:
        await client.close()


async def test_leaving_the_block_never_replaces_the_engines_exception() -> None:
    running = await start_server(replace(TEST_SETTINGS, devices="1xH100-80GB", lease_ttl_s=30))
    target = f"127.0.0.1:{running.port}"
    client = AsyncPlannerClient(target, timeout_s=0.5)
    try:
        uuid = (await device_uuids(client))[0]
        plan = await client.plan(leased_request("engine-exit", uuid))
        sync_plan = await client.plan(leased_request("engine-exit-sync", uuid, utilization=0.3))
        await running.stop(0)
        with pytest.raises(ZeroDivisionError) as caught:
            async with AsyncLeaseKeeper(client, plan):
                raise ZeroDivisionError("the engine's own failure")
        assert any("releasing the leases failed" in note for note in caught.value.__notes__)

        def sync_block() -> None:
            with (
                PlannerClient(target, timeout_s=0.5) as sync_client,
                LeaseKeeper(sync_client, sync_plan),
            ):
                raise KeyError("engine")

        with pytest.raises(KeyError):
            await asyncio.to_thread(sync_block)
        # Without an exception of its own, the failed release is raised.
        with pytest.raises(PlannerError) as release:
            async with AsyncLeaseKeeper(client, plan):
                pass
        assert release.value.code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    finally:
        await client.close()


async def test_leases_per_identity_are_bounded() -> None:
    running = await start_server(
        replace(TEST_SETTINGS, devices="2xH100-80GB", max_leases_per_identity=1)
    )
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuids = await device_uuids(client)
            await client.plan(leased_request("quota-a", uuids[0], utilization=0.3))
            await client.plan(leased_request("quota-a", uuids[0], utilization=0.35))  # replaces
            with pytest.raises(PlannerError) as caught:
                await client.plan(leased_request("quota-b", uuids[1], utilization=0.3))
            assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.metadata["limit"] == "max_leases_per_identity"
            await client.release_plan("quota-a")
            await client.plan(leased_request("quota-b", uuids[1], utilization=0.3))
    finally:
        await running.stop(0)


def two_rank_request(engine_id: str, uuids: list[str]) -> plan_pb2.PlanRequest:
    """One engine, two workers, each leasing memory on its own device."""
    request = leased_request(engine_id, uuids[0], layers=range(4))
    request.workers.append(
        leased_request(engine_id, uuids[1], rank=1, layers=range(4, 8)).workers[0]
    )
    return request


def assert_names_the_lost_rank(error: PlannerError, engine_id: str) -> None:
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION
    assert repr(engine_id) in error.details
    assert "rank(s) 1 " in error.details
    assert "may be granted to another engine" in error.details
    assert error.metadata["missing_ranks"] == "1"


async def test_sync_keeper_reports_a_rank_released_behind_its_back() -> None:
    running = await start_server(replace(TEST_SETTINGS, devices="2xH100-80GB", lease_ttl_s=30))
    target = f"127.0.0.1:{running.port}"

    def run_keeper() -> tuple[int, bool, bool, list[PlannerError]]:
        with PlannerClient(target, timeout_s=5) as client:
            uuids = [device.uuid for device in client.list_devices().devices]
            plan = client.plan(two_rank_request("engine-pair", uuids))
            assert sorted(lease.rank for lease in plan.leases) == [0, 1]
            lost: list[PlannerError] = []
            keeper = LeaseKeeper(client, plan, interval_s=0.05, on_lost=lost.append).start()
            deadline = time.monotonic() + 10
            while keeper.renewals < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            renewed_whole, lost_whole = keeper.renewals, keeper.lost
            client.release_plan("engine-pair", 1)  # one rank released elsewhere
            while not keeper.lost and time.monotonic() < deadline:
                time.sleep(0.02)
            keeper.stop()
            keeper.check()  # on_lost took the error: nothing left to raise
            return renewed_whole, lost_whole, keeper.lost, lost

    try:
        renewed_whole, lost_whole, lost, errors = await asyncio.to_thread(run_keeper)
    finally:
        await running.stop(0)
    assert renewed_whole >= 2 and not lost_whole  # both ranks answered: renewals
    assert lost and len(errors) == 1
    assert_names_the_lost_rank(errors[0], "engine-pair")


async def test_async_keeper_reports_a_regrant_with_fewer_ranks() -> None:
    running = await start_server(replace(TEST_SETTINGS, devices="2xH100-80GB", lease_ttl_s=30))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuids = await device_uuids(client)
            plan = await client.plan(two_rank_request("engine-shrunk", uuids))
            keeper = AsyncLeaseKeeper(client, plan, interval_s=0.05).start()  # no on_lost
            # The engine is planned again with one worker: rank 1's lease is gone.
            await client.plan(leased_request("engine-shrunk", uuids[0], layers=range(8)))
            deadline = time.monotonic() + 10
            while not keeper.lost and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert keeper.lost
            with pytest.raises(PlannerError) as caught:
                keeper.check()
            assert_names_the_lost_rank(caught.value, "engine-shrunk")
            await keeper.stop()  # lost: the new grant is not released by the old keeper
            devices = {d.uuid: d for d in (await client.list_devices()).devices}
            assert devices[uuids[0]].live_leases == 1
            assert devices[uuids[1]].live_leases == 0
    finally:
        await running.stop(0)


async def test_renew_now_that_finds_a_rank_gone_leaves_the_new_grant_alone() -> None:
    """The same loss found by an explicit renewal (no background beat yet): it is
    raised, and stop() does not release the engine's leases, now another grant's."""
    running = await start_server(replace(TEST_SETTINGS, devices="2xH100-80GB", lease_ttl_s=30))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuids = await device_uuids(client)
            plan = await client.plan(two_rank_request("engine-now", uuids))
            keeper = AsyncLeaseKeeper(client, plan, interval_s=60)  # never beats by itself
            await client.plan(leased_request("engine-now", uuids[0], layers=range(8)))
            with pytest.raises(PlannerError) as caught:
                await keeper.renew_now()
            assert_names_the_lost_rank(caught.value, "engine-now")
            assert keeper.lost
            await keeper.stop()
            devices = {d.uuid: d for d in (await client.list_devices()).devices}
            assert devices[uuids[0]].live_leases == 1
    finally:
        await running.stop(0)
