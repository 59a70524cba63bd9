"""`kill -9` of a `kvplan serve` on the embedded SQLite store, then a restart on
the same state directory: leases, plans and an open rendezvous are all there,
and nothing is granted twice."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from kvplan.client import PlannerClient, PlannerError
from kvplan.gpus import GPU_MEMORY_BYTES
from tests.server.conftest import rank_request
from tests.server.test_leases import leased_request

TOTAL = GPU_MEMORY_BYTES["H100-80GB"]
SHARE = math.ceil(TOTAL * 0.45)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Served:
    def __init__(self, state_dir: Path) -> None:
        self.port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLAN_")}
        self.process = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "kvplan"),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--metrics-port",
                "0",
                "--devices",
                "1xH100-80GB",
                "--state-dir",
                str(state_dir),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.client = PlannerClient(f"127.0.0.1:{self.port}", timeout_s=10)
        deadline = time.monotonic() + 30
        while True:
            assert self.process.poll() is None, self.process.stderr.read()  # type: ignore[union-attr]
            try:
                self.client.list_devices(timeout_s=0.5)
                return
            except PlannerError:
                assert time.monotonic() < deadline, "server never answered"
                time.sleep(0.1)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"


def test_kill_9_loses_no_lease_plan_or_rendezvous(state_dir: Path) -> None:
    first = Served(state_dir)
    try:
        uuid = first.client.list_devices().devices[0].uuid
        plan_a = first.client.plan(leased_request("engine-a", uuid))
        first.client.plan(leased_request("engine-b", uuid))
        with ThreadPoolExecutor(1) as pool:
            # Rank 0 of a two-rank engine waits when the server dies.
            waiting = pool.submit(
                first.client.plan,
                rank_request("engine-rv", 0, 2),
                timeout_s=20,
            )
            time.sleep(0.5)
            first.kill()
            with pytest.raises(PlannerError) as lost:
                waiting.result(timeout=20)
            assert lost.value.code is grpc.StatusCode.UNAVAILABLE
    finally:
        if first.process.poll() is None:
            first.kill()
        first.client.close()

    second = Served(state_dir)
    try:
        (device,) = second.client.list_devices().devices
        assert (device.committed_bytes, device.live_leases) == (2 * SHARE, 2)
        with pytest.raises(PlannerError) as refused:
            second.client.plan(leased_request("engine-c", uuid))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.metadata["committed_bytes"] == str(2 * SHARE)

        assert second.client.get_plan(plan_id=plan_a.plan_id).response.workers
        by_engine = second.client.get_plan(engine_id="engine-a")
        assert [lease.bytes for lease in by_engine.leases] == [SHARE]

        # Rank 0's spec survived: rank 1 alone completes the engine, and rank 0
        # coming back (its client retries) gets the same plan.
        rank1 = second.client.plan(rank_request("engine-rv", 1, 2))
        assert [worker.rank for worker in rank1.response.workers] == [0, 1]
        rank0 = second.client.plan(rank_request("engine-rv", 0, 2))
        assert rank0.plan_id == rank1.plan_id

        # A restarted engine replaces its own lease; it is never counted twice.
        second.client.plan(leased_request("engine-a", uuid))
        (device,) = second.client.list_devices().devices
        assert device.committed_bytes == 2 * SHARE
    finally:
        second.kill()
        second.client.close()
