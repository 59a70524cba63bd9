"""Stopping a server ends its background tasks even when a cancellation is lost
inside a store call (Python 3.11's asyncio.wait_for loses one when it lands as
the inner call finishes; redis-py wraps its socket writes in wait_for)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvplan.server.main import start_server
from kvplan.server.tasks import cancel_and_wait
from tests.server.conftest import TEST_SETTINGS


async def test_stop_ends_a_sweeper_whose_cancellation_was_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A lease TTL of 0.2 s sweeps every 0.05 s.
    running = await start_server(replace(TEST_SETTINGS, devices="1xH100-80GB", lease_ttl_s=0.2))
    sweeping = asyncio.Event()
    lost = 0

    async def sweep_that_loses_one_cancellation() -> int:
        nonlocal lost
        sweeping.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if lost:
                raise
            lost += 1  # returns as if the call had finished, like wait_for on 3.11
        return 0

    monkeypatch.setattr(running.servicer, "sweep_expired_leases", sweep_that_loses_one_cancellation)
    await asyncio.wait_for(sweeping.wait(), timeout=5)
    # Before the fix the sweeper went back to its loop and stop() never returned.
    # (Not wait_for around stop(): the old stop() swallowed its own cancellation.)
    stopping = asyncio.create_task(running.stop(0))
    done, _ = await asyncio.wait({stopping}, timeout=10)
    if not done:
        await cancel_and_wait(stopping)  # cancels the awaited sweeper with it
    assert done, "stop() did not return: the sweeper runs on after its cancellation was lost"
    stopping.result()
    assert lost == 1
    assert running._sweeper is not None and running._sweeper.cancelled()


async def test_cancel_and_wait_ends_loops_around_wait_for() -> None:
    """The real race, not a stand-in: loops that keep calling wait_for on calls
    that finish at once; on Python 3.11 a single cancel() often leaves them
    running. cancel_and_wait ends every one."""

    async def finishes_at_once() -> None:
        return None

    async def loop_around_wait_for() -> None:
        while True:
            await asyncio.wait_for(finishes_at_once(), timeout=5)
            await asyncio.sleep(0.001)

    for phase in range(30):
        task = asyncio.create_task(loop_around_wait_for())
        await asyncio.sleep(0.0005 * (phase % 5))
        await asyncio.wait_for(cancel_and_wait(task), timeout=5)
        assert task.cancelled()
