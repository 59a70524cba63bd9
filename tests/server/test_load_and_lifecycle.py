"""Rank mode under load, the process lifecycle, and the client's minimal deps."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvplan.server.servicer as servicer_module
from kvplan.client import AsyncPlannerClient
from kvplan.convert import plan_from_proto
from kvplan.server.main import RunningServer, start_server
from tests.server.conftest import GIB, TEST_SETTINGS, engine_request, rank_request

ROOT = Path(__file__).resolve().parents[2]


async def test_64_engines_by_8_ranks(server: RunningServer) -> None:
    async with AsyncPlannerClient(f"127.0.0.1:{server.port}", timeout_s=60) as planner:
        calls = [
            planner.plan(rank_request(f"load-{engine}", rank, 8, kv_bytes=GIB + engine * (1 << 20)))
            for engine in range(64)
            for rank in range(8)
        ]
        results = await asyncio.gather(*calls)
    by_engine: dict[str, set[str]] = {}
    for result in results:
        by_engine.setdefault(result.response.engine_id, set()).add(result.plan_id)
        assert [w.rank for w in result.response.workers] == list(range(8))
        assert len({w.num_blocks for w in result.response.workers}) == 1
    assert len(by_engine) == 64
    assert all(len(plan_ids) == 1 for plan_ids in by_engine.values())
    assert await server.servicer.rendezvous.pending_engines() == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_serving(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == 1:
                    return
            except grpc.RpcError:
                time.sleep(0.05)
    raise AssertionError("server never became SERVING")


def test_serve_command_drains_on_sigterm() -> None:
    port, metrics_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "KVPLAN_PORT": str(port),
        "KVPLAN_LOG_FORMAT": "json",
        "KVPLAN_STORE": "memory",
    }
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvplan"), "serve", "--metrics-port", str(metrics_port)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_serving(port)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            from kvplan.v1 import service_pb2_grpc

            stub = service_pb2_grpc.KVCachePlannerStub(channel)
            waiting = stub.PlanKVCache.future(rank_request("drain", 0, 2), timeout=10)
            time.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            try:
                waiting.result()
                raise AssertionError("a waiting rank should be released")
            except grpc.RpcError as error:
                assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
    log = process.stderr.read() if process.stderr else ""
    assert '"message": "stopped"' in log and '"message": "serving"' in log


def test_client_needs_only_grpcio_and_protobuf(tmp_path: Path) -> None:
    """The client imports and plans with every server-side package unimportable."""
    script = textwrap.dedent(
        """
        import sys
        blocked = ("prometheus_client", "yaml", "torch", "grpc_health", "grpc_reflection",
                   "grpc_status", "redis", "pynvml", "google.rpc", "kvplan.server",
                   "kvplan.core", "kvplan.convert")
        class Block:
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in blocked):
                    raise ImportError(f"blocked {name}")
                return None
        sys.meta_path.insert(0, Block())
        from kvplan.client import PlannerClient, PlannerError
        from kvplan.v1 import plan_pb2
        request = plan_pb2.PlanRequest(engine_id="dep-check")
        request.options.max_model_len = 4096
        worker = request.workers.add(rank=0)
        worker.memory.kv_cache_memory_bytes = 1 << 30
        layer = worker.layers.add(name="l0")
        layer.full_attention.attention.num_kv_heads = 8
        layer.full_attention.attention.head_size = 128
        with PlannerClient(sys.argv[1]) as planner:
            print(planner.plan(request).num_blocks)
            layer.full_attention.attention.num_kv_heads = 0
            try:
                planner.plan(request)
            except PlannerError as error:
                print(error.code.name, error.violations[0].field)
        """
    )
    port = _free_port()
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "kvplan"),
            "serve",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--store",
            "memory",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_serving(port)
        result = subprocess.run(
            [sys.executable, "-c", script, f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=15)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[0] == str((1 << 30) // 65_536)
    assert lines[1:] == [
        "INVALID_ARGUMENT",
        "workers[0].layers[0].full_attention.attention.num_kv_heads",
    ]


def test_a_log_reader_that_stops_reading_stalls_no_rpc_nor_the_exit() -> None:
    """stderr is a pipe nobody reads: once it is full, writing a log line blocks.
    The writing is the log thread's, so the server keeps answering (and drops log
    records once its queue is full, counting them), and SIGTERM still ends it: exit
    waits for the blocked writer for logs.EXIT_FLUSH_S, not for ever."""
    port, metrics_port = _free_port(), _free_port()
    env = {**os.environ, "KVPLAN_PORT": str(port), "KVPLAN_STORE": "memory"}
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvplan"), "serve", "--metrics-port", str(metrics_port)],
        env=env,
        stderr=subprocess.PIPE,  # never read until the end
    )
    try:
        _wait_serving(port)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            from kvplan.v1 import service_pb2_grpc

            stub = service_pb2_grpc.KVCachePlannerStub(channel)
            # Each new engine logs a line of about 250 bytes: 2,000 of them are far
            # more than a pipe holds (64 KiB on Linux).
            for index in range(2000):
                stub.PlanKVCache(engine_request(f"quiet-reader-{index}"), timeout=5)
            assert stub.PlanKVCache(engine_request("after"), timeout=5).num_blocks > 0
        process.send_signal(signal.SIGTERM)
        # No call in flight: the drain ends at once, then at most EXIT_FLUSH_S (5 s).
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        if process.stderr:
            process.stderr.close()


async def test_large_engines_are_planned_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines over --offload-layers are planned in a thread, one at a time: each may
    hold many times its request in memory, and threads share one GIL anyway."""
    planning = 0
    most = 0
    lock = threading.Lock()
    real = plan_from_proto

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal planning, most
        with lock:
            planning += 1
            most = max(most, planning)
        try:
            time.sleep(0.05)
            return real(*args, **kwargs)
        finally:
            with lock:
                planning -= 1

    monkeypatch.setattr(servicer_module, "plan_from_proto", counted)
    running = await start_server(replace(TEST_SETTINGS, offload_layers=4))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=30) as client:
            plans = await asyncio.gather(
                *(client.plan(engine_request(f"large-{index}", layers=8)) for index in range(4))
            )
            assert len({plan.engine_id for plan in plans}) == 4
            await client.plan(engine_request("small", layers=2))  # inline, not counted apart
    finally:
        await running.stop(0)
    assert most == 1
