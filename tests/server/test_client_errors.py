"""What a person reads when a call to a server fails: the client library and the CLI,
against a real server on loopback (issue 31 §5)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from kvplan.cli import main
from kvplan.client import AsyncPlannerClient, PlannerClient, PlannerError
from kvplan.client.planner import retry_attempts
from kvplan.client.targets import DEFAULT_PORT, with_default_port
from kvplan.client.vllm_plugin.settings import Settings
from kvplan.server.main import RunningServer
from tests.server.conftest import engine_request


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_refusal_names_its_code_once(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = engine_request()
    request.workers[0].device.uuid = "GPU-nobody-has"
    path = tmp_path / "request.json"
    path.write_text(json_format.MessageToJson(request))
    code = await asyncio.to_thread(
        main, ["plan", str(path), "--target", f"127.0.0.1:{server.port}"]
    )
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("error: NOT_FOUND: workers[0].device.uuid: worker rank 0 names")
    assert err.count("NOT_FOUND") == 1, err
    async with AsyncPlannerClient(f"127.0.0.1:{server.port}", timeout_s=10) as client:
        with pytest.raises(PlannerError) as caught:
            await client.plan(request)
    assert str(caught.value).count("NOT_FOUND") == 1
    assert "grpc_message" not in caught.value.metadata  # the server answered


def test_an_unreachable_target_says_what_to_check(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{_closed_port()}"
    request = str(Path(__file__).parents[2] / "examples" / "llama-3.1-8b.yaml")
    assert main(["plan", request, "--target", target]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: UNAVAILABLE: no kvplan server answered at {target} ")
    for what in ("connection refused", "address and port", "TLS vs plaintext", "token"):
        assert what in err, (what, err)
    assert "failed to connect to all addresses" not in err  # gRPC's own text is not shown
    with PlannerClient(target, timeout_s=5) as client, pytest.raises(PlannerError) as caught:
        client.list_devices()
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert "Connection refused" in caught.value.metadata["grpc_message"]  # kept for logs
    assert "no kvplan server answered" in caught.value.details


async def test_a_host_without_a_port_goes_to_kvplans_port(server: RunningServer) -> None:
    """Not 443 (gRPC's default): `kvplan serve` listens on 50051. The server here has a
    free port, so the host alone is checked through `dns:` and the resolved target."""
    assert with_default_port("planner") == f"planner:{DEFAULT_PORT}"
    assert with_default_port("planner:7000") == "planner:7000"
    assert with_default_port("::1") == f"[::1]:{DEFAULT_PORT}"
    assert with_default_port("[::1]") == f"[::1]:{DEFAULT_PORT}"
    assert with_default_port("[::1]:7000") == "[::1]:7000"
    assert with_default_port("dns:///planner") == f"dns:///planner:{DEFAULT_PORT}"
    assert with_default_port("unix:/run/kvplan.sock") == "unix:/run/kvplan.sock"
    with pytest.raises(ValueError, match="empty port"):
        with_default_port("planner:")
    with PlannerClient("localhost", timeout_s=2) as client:
        assert client.target == f"localhost:{DEFAULT_PORT}"
    # A given port is kept: the real server answers there.
    async with AsyncPlannerClient(f"localhost:{server.port}", timeout_s=10) as client:
        assert (await client.list_devices()).devices


def test_health_names_the_default_port(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["health", "--target", "nohost.invalid", "--timeout", "5"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"no kvplan server answered at nohost.invalid:{DEFAULT_PORT}" in err, err


class _CountingBrokenProbe:
    """A device driver that fails on every reading (the server answers UNAVAILABLE,
    which clients retry): counts the readings, one per attempt."""

    name = "nvml"

    def __init__(self) -> None:
        self.readings = 0

    def snapshot(self) -> tuple[()]:
        self.readings += 1
        raise RuntimeError("NVML: GPU is lost")

    def close(self) -> None:
        return None


@pytest.mark.parametrize(("timeout_s", "attempts"), [(2.0, 3), (1.0, 2), (0.3, 1)])
async def test_plugin_retries_fit_a_quarter_of_its_timeout(
    server: RunningServer, timeout_s: float, attempts: int
) -> None:
    """A dead server cost every engine start 0.6-0.8 s of retries (4 attempts): the
    plugin's waits between retries are bounded by KVPLAN_TIMEOUT_S / 4."""
    settings = Settings(addr=f"127.0.0.1:{_closed_port()}", timeout_s=timeout_s)
    started = time.monotonic()
    with settings.planner_client() as client, pytest.raises(PlannerError) as caught:
        await asyncio.to_thread(client.list_devices)
    took = time.monotonic() - started
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE  # not DEADLINE_EXCEEDED
    assert took < timeout_s / 4 * 1.2 + 0.2, took  # gRPC's jitter, and a busy machine
    # The attempts, counted by a real server whose device probe fails.
    probe = _CountingBrokenProbe()
    server.servicer._probe = probe
    settings = Settings(addr=f"127.0.0.1:{server.port}", timeout_s=timeout_s)
    with settings.planner_client() as client, pytest.raises(PlannerError) as caught:
        await asyncio.to_thread(client.list_devices)
    assert "GPU is lost" in caught.value.details
    assert probe.readings == attempts == retry_attempts(settings.retry_budget_s)
    assert retry_attempts(None) == 4  # the library's own default is unchanged
