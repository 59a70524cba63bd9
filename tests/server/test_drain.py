"""SIGTERM drain of `kvplan serve`: calls the server received are served within
the grace period; none is cut off as CANCELLED."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from kvplan.client import error_from_rpc
from kvplan.server.main import start_server
from kvplan.v1 import service_pb2_grpc
from tests.server.conftest import TEST_SETTINGS, engine_request
from tests.server.test_load_and_lifecycle import _free_port, _wait_serving

CALLS = 120


def test_sigterm_serves_the_calls_it_received() -> None:
    port, metrics_port = _free_port(), _free_port()
    env = {**os.environ, "KVPLAN_PORT": str(port), "KVPLAN_STORE": "memory", "KVPLAN_GRACE_S": "30"}
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvplan"), "serve", "--metrics-port", str(metrics_port)],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_serving(port)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = service_pb2_grpc.KVCachePlannerStub(channel)
            # Distinct engines with many layers: each is planned afresh and takes a while,
            # so most calls are still queued in the server when SIGTERM arrives.
            calls = [
                stub.PlanKVCache.future(
                    engine_request(f"drain-{index}", layers=2400, kv_bytes=160 << 30), timeout=60
                )
                for index in range(CALLS)
            ]
            time.sleep(0.3)
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            codes: Counter[str] = Counter()
            for call in calls:
                try:
                    call.result()
                    codes["OK"] += 1
                except grpc.RpcError as error:
                    codes[error.code().name] += 1
        assert process.wait(timeout=45) == 0
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
    # Received calls are served; only a call still running at the end of the grace
    # period (none here, on an idle machine) may get UNAVAILABLE, never CANCELLED.
    assert codes["CANCELLED"] == 0, codes
    assert codes["OK"] + codes["UNAVAILABLE"] == CALLS, codes
    assert codes["OK"] >= CALLS - 10, (codes, took)
    # The drain ends when the last call is answered, not at the grace period
    # (generous, so that a busy machine serves every call before it ends).
    assert took < 32


async def test_a_call_still_running_at_the_end_of_the_grace_gets_unavailable() -> None:
    running = await start_server(replace(TEST_SETTINGS))

    async def slow(*args: object, **kwargs: object) -> bytes:
        await asyncio.sleep(30)
        return b""

    running.servicer._serve_plan = slow  # type: ignore[method-assign]
    # Without the client's retry policy, to see the server's own answer.
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{running.port}", options=[("grpc.enable_retries", 0)]
    ) as channel:
        stub = service_pb2_grpc.KVCachePlannerStub(channel)
        call = asyncio.ensure_future(stub.PlanKVCache(engine_request("slow"), timeout=10))
        await asyncio.sleep(0.3)
        started = asyncio.get_running_loop().time()
        await running.stop(0.5)
        assert asyncio.get_running_loop().time() - started < 3
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
    error = error_from_rpc(caught.value)
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert "shut down before this call finished" in error.details
    assert error.metadata["retry_after_s"] == "1"
