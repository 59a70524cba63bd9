"""What the image does, without Docker: the wheel from the build context, installed with
its server extra into a fresh venv, started with the Dockerfile's ENTRYPOINT and ENV."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import parsing
from tests.deploy.parsing import ROOT
from tests.deploy.tools import offline_plan

EXAMPLE = ROOT / "examples" / "llama-3.1-8b.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run(
    command: list[str],
    timeout: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


class Timer:
    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks.append((name, now - self._last))
        self._last = now

    def report(self) -> str:
        total = sum(seconds for _, seconds in self.marks)
        steps = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.marks)
        return f"wheel smoke: {total:.1f}s ({steps})"


@pytest.fixture
def timer() -> Iterator[Timer]:
    watch = Timer()
    yield watch
    print(watch.report())  # shown with -s or -rP, and in the durations table's test


def copy_context(destination: Path) -> None:
    """What `docker build .` sends, laid out as COPY . . does in the builder stage."""
    for relative in parsing.build_context():
        source = ROOT / relative
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)


def container_env(venv: Path, grpc_port: int, metrics_port: int) -> dict[str, str]:
    """The image's ENV on top of this environment, PATH pointing into the venv, and
    the ports moved to free ones on loopback."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update({k: v for k, v in parsing.env().items() if k != "PATH"})
    env["PATH"] = (
        parsing.env()["PATH"]
        .replace("/opt/kvplan", str(venv))
        .replace("$PATH", os.environ.get("PATH", ""))
    )
    env.update(
        KVPLAN_HOST="127.0.0.1",
        KVPLAN_METRICS_HOST="127.0.0.1",
        KVPLAN_PORT=str(grpc_port),
        KVPLAN_METRICS_PORT=str(metrics_port),
    )
    # The image's state volume, moved beside the venv.
    env["KVPLAN_STATE_DIR"] = str(venv.parent / "state")
    return env


def scrape(port: int) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
        return text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wheel_runs_like_the_image(tmp_path: Path, timer: Timer) -> None:
    context = tmp_path / "context"
    copy_context(context)
    wheels = tmp_path / "wheels"
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), "."],
        timeout=180,
        cwd=context,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("kvplan-*.whl")
    timer.mark("wheel")

    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)], timeout=60)
    assert made.returncode == 0, made.stderr
    bin_dir = venv / "bin"
    pip = [str(bin_dir / "python"), "-m", "pip", "--disable-pip-version-check"]
    installed = run([*pip, "install", "-q", f"{wheel}[server]"], timeout=180)
    assert installed.returncode == 0, installed.stderr
    timer.mark("venv+install")

    listed = run([*pip, "list", "--format", "json"], timeout=60)
    names = {re.sub(r"[-_.]+", "-", entry["name"]).lower() for entry in json.loads(listed.stdout)}
    assert {"kvplan", "grpcio-health-checking", "prometheus-client"} <= names
    assert not {n for n in names if re.match(r"(torch|triton|nvidia-cu)", n)}, names
    no_torch = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    assert run([str(bin_dir / "python"), "-c", no_torch], timeout=30).returncode == 0

    grpc_port, metrics_port = free_port(), free_port()
    env = container_env(venv, grpc_port, metrics_port)
    command = parsing.entrypoint()  # ["kvplan", "serve"], exactly as the image runs it
    executable = shutil.which(command[0], path=env["PATH"])
    assert executable is not None and Path(executable).parent == bin_dir
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [executable, *command[1:]], env=env, cwd=tmp_path, stdout=log, stderr=log
        )
    try:
        target = f"127.0.0.1:{grpc_port}"
        kvplan = str(bin_dir / "kvplan")
        deadline = time.monotonic() + 30
        while True:
            assert server.poll() is None, (
                f"server exited {server.returncode}: {log_path.read_text()}"
            )
            probe = run([kvplan, "health", "--target", target, "--timeout", "1"], timeout=30)
            if probe.returncode == 0:
                break
            assert time.monotonic() < deadline, f"never SERVING: {probe.stderr}"
            time.sleep(0.2)
        assert probe.stdout == f"{target} (server): SERVING\n"
        timer.mark("serving")

        # The image's own HEALTHCHECK command, which finds the port from KVPLAN_PORT.
        _, health_command = parsing.healthcheck()
        healthy = run([str(bin_dir / health_command[0]), *health_command[1:]], timeout=30, env=env)
        assert healthy.returncode == 0, healthy.stderr
        assert healthy.stdout.strip() == f"{target} (server): SERVING"

        planned = run([kvplan, "plan", str(EXAMPLE), "--target", target, "--json"], timeout=60)
        assert planned.returncode == 0, planned.stderr
        plan = json.loads(planned.stdout)
        assert plan["engine_id"] == "llama-3.1-8b"
        llama_blocks = int(offline_plan(EXAMPLE)["num_blocks"])
        assert int(plan["num_blocks"]) == llama_blocks
        text = run([kvplan, "plan", str(EXAMPLE), "--target", target], timeout=60)
        assert text.returncode == 0, text.stderr
        assert f"num_blocks: {llama_blocks:,}" in text.stdout

        metrics = scrape(metrics_port)
        handled = [
            line
            for line in metrics.splitlines()
            if line.startswith("grpc_server_handled_total{")
            and 'grpc_method="PlanKVCache"' in line
            and 'grpc_code="OK"' in line
        ]
        assert handled, metrics
        assert sum(float(line.rsplit(" ", 1)[1]) for line in handled) >= 2
        timer.mark("plan+scrape")

        server.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        assert server.wait(timeout=10) == 0, log_path.read_text()
        assert time.monotonic() - stopping < 5
        timer.mark("sigterm")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)

    # KVPLAN_LOG_FORMAT=json from the image: every log line is one JSON object.
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    messages = [str(record["message"]) for record in records]
    # Structured: the event in "message", its facts as fields.
    assert any(
        record["message"] == "serving" and record["host"] == "127.0.0.1" for record in records
    ), messages
    assert messages[-1] == "stopped"
