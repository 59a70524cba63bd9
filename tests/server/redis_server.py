"""A throwaway redis-server on a free loopback port, for the Redis store tests.

Without a `redis-server` binary the tests skip, unless CI or
KVPLAN_REQUIRE_REDIS=1 is set: then they fail, so a missing binary can never
pass silently (scripts/run-tests installs it and sets KVPLAN_REQUIRE_REDIS).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvplan.server.store.redis import RedisStore

START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """The redis-server to run, or skip (fail where Redis is required)."""
    binary = shutil.which("redis-server")
    if binary is not None:
        return binary
    message = (
        "redis-server is not installed, so the Redis store tests cannot run; install it "
        "(Debian/Ubuntu: apt-get install -y redis-server) or run scripts/run-tests, which does"
    )
    if os.environ.get("CI") or os.environ.get("KVPLAN_REQUIRE_REDIS") == "1":
        pytest.fail(message + " (required here: CI or KVPLAN_REQUIRE_REDIS=1 is set)")
    pytest.skip(message)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, so a
    killed pytest leaves no redis-server behind (Linux; elsewhere a no-op).
    Linux ties this to the starting thread: start servers from the main one."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; `restart` brings it back on the same port."""

    def __init__(self, binary: str, directory: Path, *, appendonly: bool = False) -> None:
        self.binary = binary
        self.directory = directory
        self.appendonly = appendonly
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        if self.appendonly:
            # Every write on disk before the reply: state survives a SIGKILL.
            command += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            command += ["--appendonly", "no"]
        return command

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self._command(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = self.log_path.read_text() if self.log_path.exists() else ""
                self.stop()
                raise RuntimeError(
                    f"redis-server on port {self.port} did not answer PING:\n{log[-2000:]}"
                )
            time.sleep(0.01)

    def stop(self, sig: signal.Signals = signal.SIGKILL) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stderr is not None:
            process.stderr.close()

    def restart(self, sig: signal.Signals = signal.SIGKILL) -> None:
        self.stop(sig)
        self.start()


@contextmanager
def running_redis(directory: Path, *, appendonly: bool = False) -> Iterator[RedisServer]:
    """A started redis-server, stopped on exit (skips when there is none)."""
    server = RedisServer(redis_server_binary(), directory, appendonly=appendonly)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def wait_for_listeners(store: RedisStore, count: int, timeout_s: float = 5.0) -> None:
    """Until `count` replicas listen on the store's channel: subscribing is
    asynchronous, and news published before a subscription is missed."""
    client = store._redis()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        ((_, listening),) = await client.pubsub_numsub(store._channel)
        if listening >= count:
            return
        assert loop.time() < deadline, f"{listening} of {count} replicas listen"
        await asyncio.sleep(0.01)
