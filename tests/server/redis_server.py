"""A throwaway redis-server on a free loopback port, for the Redis store tests.

Without a `redis-server` binary the tests skip, unless CI or
KVPLAN_REQUIRE_REDIS=1 is set: then they fail, so a missing binary can never
pass silently (scripts/run-tests installs it and sets KVPLAN_REQUIRE_REDIS).
"""

from __future__ import annotations

import asyncio
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


def _dying_with_parent(command: list[str]) -> list[str]:
    """`command` run so that it is SIGKILLed when the test process dies, so a
    killed pytest leaves no redis-server behind (Linux, where util-linux's
    setpriv is; elsewhere `command` as it is). Linux ties this to the starting
    thread: start servers from the main one.

    Not a `preexec_fn` calling prctl: that makes subprocess fork() a process
    whose gRPC threads are running, gRPC's fork handlers then start threads in
    the child, and those abort it (SIGABRT, "epoll_wait error: Bad file
    descriptor") when the child closes its inherited descriptors before exec.
    Without a preexec_fn, subprocess uses vfork(), which runs no fork handlers."""
    setpriv = shutil.which("setpriv")
    if sys.platform != "linux" or setpriv is None:
        return command
    return [setpriv, "--pdeathsig", "KILL", "--", *command]


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

    def __init__(
        self, binary: str, directory: Path, *, appendonly: bool = False, save: str = ""
    ) -> None:
        self.binary = binary
        self.directory = directory
        self.appendonly = appendonly
        self.save = save  # RDB save points ("": none), e.g. "3600 1"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "redis.log"
        self.stderr_path = directory / "redis.stderr"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        command = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", self.save,
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
        # Its stderr in a file, not an unread pipe: what a dying start printed is
        # in the error below (and a full pipe can never block redis-server).
        with self.stderr_path.open("ab") as stderr:
            self.process = subprocess.Popen(
                _dying_with_parent(self._command()), stdout=subprocess.DEVNULL, stderr=stderr
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(self.port):
            exit_code = self.process.poll()
            if exit_code is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(self._start_failure(exit_code))
            time.sleep(0.01)

    def _start_failure(self, exit_code: int | None) -> str:
        if exit_code is None:
            how = f"did not answer PING within {START_TIMEOUT_S:g} s"
        elif exit_code < 0:
            how = f"was killed by {signal.Signals(-exit_code).name} before answering PING"
        else:
            how = f"exited with status {exit_code} before answering PING"
        log = self.log_path.read_text() if self.log_path.exists() else "(none)"
        stderr = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return (
            f"redis-server on port {self.port} {how}\n"
            f"--- stderr ({self.stderr_path}):\n{stderr[-2000:]}\n"
            f"--- log ({self.log_path}):\n{log[-2000:]}"
        )

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

    def restart(self, sig: signal.Signals = signal.SIGKILL) -> None:
        self.stop(sig)
        self.start()


@contextmanager
def running_redis(
    directory: Path, *, appendonly: bool = False, save: str = ""
) -> Iterator[RedisServer]:
    """A started redis-server, stopped on exit (skips when there is none)."""
    server = RedisServer(redis_server_binary(), directory, appendonly=appendonly, save=save)
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
