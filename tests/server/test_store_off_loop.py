"""A stalled SQLite store delays only its own callers, never the event loop."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace
from pathlib import Path

from kvplan.client import AsyncPlannerClient
from kvplan.server.main import start_server

from .conftest import TEST_SETTINGS, engine_request


async def test_unrelated_rpcs_are_served_while_the_store_waits_for_a_lock(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvplan.sqlite3"
    running = await start_server(replace(TEST_SETTINGS, store=f"sqlite://{path}"))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=30) as client:
            await client.plan(engine_request("warm-up"))  # the schema and a first plan exist
            # Another connection takes the file's write lock: the next plan's store
            # write waits for it (up to the busy timeout).
            blocker = sqlite3.connect(path, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")
            try:
                planning = asyncio.create_task(client.plan(engine_request("stalled")))
                await asyncio.sleep(0.3)  # the plan has reached its store write
                assert not planning.done()
                # With the loop free, an unrelated call completes while the lock is held.
                echoed = await asyncio.wait_for(client.echo(engine_request("echo")), 3.0)
                assert echoed.engine_id == "echo"
                assert not planning.done()
            finally:
                blocker.execute("ROLLBACK")
                blocker.close()
            response = await planning
            assert response.engine_id == "stalled"
    finally:
        await running.stop(0)
