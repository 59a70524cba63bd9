"""`kvplan health`: grpc.health.v1 Check against a real server on loopback."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvplan.cli import build_parser, default_health_target, main
from kvplan.server.config import Settings
from kvplan.server.main import SERVICE_NAME, RunningServer, start_server
from tests.deploy.parsing import ROOT
from tests.deploy.tools import offline_plan


@pytest_asyncio.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_server(
        Settings(host="127.0.0.1", port=0, metrics_port=0, grace_s=1, store="memory")
    )
    yield running
    await running.stop(0)


async def health(*args: str) -> int:
    """The blocking command in a thread: the server lives on this event loop."""
    return await asyncio.to_thread(main, ["health", *args])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_serving(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert await health("--target", f"127.0.0.1:{server.port}") == 0
    out = capsys.readouterr().out
    assert out == f"127.0.0.1:{server.port} (server): SERVING\n"


async def test_planner_service(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    target = f"127.0.0.1:{server.port}"
    assert await health("--target", target, "--service", SERVICE_NAME, "--timeout", "2") == 0
    assert capsys.readouterr().out.strip().endswith(f"{SERVICE_NAME}: SERVING")


async def test_unknown_service(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert await health("--target", f"127.0.0.1:{server.port}", "--service", "no.Such") == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and "NOT_FOUND" in captured.err
    assert len(captured.err.splitlines()) == 1


async def test_draining_server_is_not_serving(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    await server.health.enter_graceful_shutdown()
    assert await health("--target", f"127.0.0.1:{server.port}") == 1
    assert capsys.readouterr().out.strip().endswith("(server): NOT_SERVING")


def test_nothing_listening(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert main(["health", "--target", f"127.0.0.1:{free_port()}", "--timeout", "2"]) == 1
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("error: ") and ("UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err)


@pytest.mark.parametrize("timeout", ["0", "-1", "soon"])
def test_bad_timeout(timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["health", "--timeout", timeout])
    assert exited.value.code == 2
    assert "--timeout" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("environ", "target"),
    [
        ({}, "127.0.0.1:50051"),
        ({"KVPLAN_PORT": "6000"}, "127.0.0.1:6000"),
        ({"KVPLAN_HOST": "0.0.0.0", "KVPLAN_PORT": "6000"}, "127.0.0.1:6000"),
        ({"KVPLAN_HOST": "::"}, "127.0.0.1:50051"),
        ({"KVPLAN_HOST": "10.1.2.3", "KVPLAN_PORT": "7"}, "10.1.2.3:7"),
        ({"KVPLAN_HOST": "::1"}, "[::1]:50051"),
        ({"KVPLAN_HOST": "planner.local"}, "planner.local:50051"),
    ],
)
def test_default_target_follows_the_server_settings(environ: dict[str, str], target: str) -> None:
    assert default_health_target(environ) == target


def test_default_target_in_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLAN_PORT", "50123")
    monkeypatch.delenv("KVPLAN_HOST", raising=False)
    args = build_parser().parse_args(["health"])
    assert (args.target, args.service, args.timeout) == ("127.0.0.1:50123", "", 3.0)


def test_plan_needs_no_health_stubs() -> None:
    """grpc_health is imported by `kvplan health` alone: with it missing, `plan` works
    and `health` says what to install."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["grpc_health"] = None  # import grpc_health now raises ImportError
        from kvplan.cli import main
        assert main(["plan", {str(ROOT / "examples" / "llama-3.1-8b.yaml")!r}]) == 0
        assert main(["health", "--target", "127.0.0.1:1"]) == 1
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    blocks = int(offline_plan(ROOT / "examples" / "llama-3.1-8b.yaml")["num_blocks"])
    assert f"num_blocks: {blocks:,}" in done.stdout
    assert "kvplan health needs grpcio-health-checking" in done.stderr
