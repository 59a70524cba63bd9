"""What every benchmark program shares: the server process, /proc readers, statistics,
interleaved load, targets and result files.

Every program measures the service as users meet it: one `kvplan serve` in its own
process on the default store (SQLite in a state folder of the run's own), driven over
loopback by this process with raw bytes-in / bytes-out gRPC calls. A figure that is a
ratio is measured against its baseline in the same run, in alternating slices, so both
see the same machine; each is repeated (3 times by default) and reported as the median
with its spread (min-max over the repeats).

Quick mode (`--quick`, or KVPLAN_BENCH_QUICK=1) shrinks counts and durations so a
program finishes in well under a minute: for smoke tests, never for figures.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.options import add_output_arguments
from kvplan.client import channel_options
from kvplan.convert.wire import encode_varint
from kvplan.v1 import plan_pb2

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "kvplan.v1.KVCachePlanner"
PLAN_METHOD = f"/{SERVICE}/PlanKVCache"
ECHO_METHOD = f"/{SERVICE}/Echo"
LIST_DEVICES_METHOD = f"/{SERVICE}/ListDevices"
RELEASE_METHOD = f"/{SERVICE}/ReleasePlan"
CALL_TIMEOUT_S = 60.0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


# --- command line ---------------------------------------------------------------------


def bench_parser(description: str | None) -> argparse.ArgumentParser:
    """A benchmark program's arguments: its docstring as help, and the common ones."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser)
    return parser


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    add_output_arguments(parser)
    parser.add_argument("--repeats", type=int, default=None, help="repeats (default 3)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")


def repeats_of(args: argparse.Namespace) -> int:
    return int(args.repeats) if args.repeats else (2 if args.quick else 3)


# --- the server process -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kvplan_executable() -> Path:
    beside_python = Path(sys.executable).parent / "kvplan"
    return beside_python if beside_python.exists() else ROOT / ".venv" / "bin" / "kvplan"


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_path: Path
    state_dir: Path
    spawn_to_serving_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sqlite_path(self) -> Path:
        """The default store's file (open_store: STATE_DIR/kvplan.sqlite3)."""
        return self.state_dir / "kvplan.sqlite3"

    def sqlite_bytes(self) -> int:
        """The store's size on disk: the database and its write-ahead log."""
        if not self.sqlite_path.exists():
            raise RuntimeError(f"no SQLite store at {self.sqlite_path}: has its path changed?")
        wal = self.sqlite_path.with_name(self.sqlite_path.name + "-wal")
        return self.sqlite_path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

    def ready_in_s(self) -> float | None:
        """The server's own 'ready in' figure: start_server alone, imports excluded."""
        # The text log's structured line: "... kvplan.server ready seconds=0.023".
        found = re.search(r" ready seconds=([0-9.]+)", self.log_path.read_text(errors="replace"))
        return float(found.group(1)) if found else None

    def cpu_s(self) -> float:
        return cpu_seconds(self.pid)

    def rss_mb(self) -> float:
        return rss_mb(self.pid)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


def spawn_server(
    log_dir: Path,
    label: str,
    extra_flags: Sequence[str] = (),
    profile_to: Path | None = None,
    instrument_to: Path | None = None,
) -> ServerProcess:
    """Start `kvplan serve` on free loopback ports and wait for health SERVING.

    The store is the embedded default (SQLite) in a state folder of its own, as
    `make run` uses it; `extra_flags` add to the command line (e.g. --devices).
    """
    port, metrics_port = free_port(), free_port()
    state_dir = log_dir / f"{label}-state"
    flags = ["serve", "--host", "127.0.0.1", "--port", str(port)]
    flags += ["--metrics-port", str(metrics_port), "--state-dir", str(state_dir)]
    flags += list(extra_flags)
    if profile_to is not None:
        command = [sys.executable, "-m", "cProfile", "-o", str(profile_to), "-m", "kvplan.cli"]
        command += flags
    elif instrument_to is not None:  # bench/instrumented_server.py
        command = [sys.executable, "-m", "bench.instrumented_server", str(instrument_to), *flags]
    else:
        command = [str(kvplan_executable()), *flags]
    log_path = log_dir / f"{label}.log"
    # The embedded defaults, whatever this shell's KVPLAN_* variables say.
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVPLAN_")}
    if instrument_to is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with log_path.open("wb") as log_file:
        started = time.perf_counter()
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env
        )
    server = ServerProcess(process, port, metrics_port, log_path, state_dir)
    try:
        wait_serving(server, timeout_s=60.0)
    except BaseException:
        server.stop()
        raise
    server.spawn_to_serving_s = time.perf_counter() - started
    return server


def wait_serving(server: ServerProcess, timeout_s: float) -> None:
    """Poll grpc.health.v1 Check for the planner service until SERVING."""
    options = [
        ("grpc.use_local_subchannel_pool", 1),
        # Reconnect at once when the port is not open yet (default backoff: 1 s).
        ("grpc.initial_reconnect_backoff_ms", 5),
        ("grpc.min_reconnect_backoff_ms", 5),
        ("grpc.max_reconnect_backoff_ms", 10),
    ]
    deadline = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=SERVICE)
    with grpc.insecure_channel(server.target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"kvplan serve exited with {server.process.returncode}: "
                    + server.log_path.read_text(errors="replace")[-2000:]
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"kvplan serve not SERVING after {timeout_s:.0f} s")
            try:
                reply = stub.Check(request, timeout=min(remaining, 0.25), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.002)


# --- /proc and /metrics -----------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all threads."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields_after_name = stat.rsplit(")", 1)[1].split()
    user_ticks, system_ticks = int(fields_after_name[11]), int(fields_after_name[12])
    return (user_ticks + system_ticks) / CLOCK_TICKS_PER_S


def steal_seconds() -> float:
    """CPU time the hypervisor gave to other guests, all CPUs (the `steal` of /proc/stat)."""
    fields_of_cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields_of_cpu[8]) / CLOCK_TICKS_PER_S


@dataclass(frozen=True)
class Scrape:
    body: str
    seconds: float

    @property
    def size_bytes(self) -> int:
        return len(self.body.encode())

    def value(self, name: str) -> float:
        """A sample without labels (`name value`), 0 when absent."""
        for line in self.body.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        return 0.0

    def series(self) -> int:
        return sum(1 for line in self.body.splitlines() if line and not line.startswith("#"))


def scrape(server: ServerProcess) -> Scrape:
    """GET /metrics, timed as a Prometheus scraper meets it."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as reply:
        body = reply.read().decode()
    return Scrape(body, time.perf_counter() - start)


# --- statistics -------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of `values` (sorted here); nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


@dataclass(frozen=True)
class Spread:
    """A figure over repeats: the median and the range it moved in."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        finite = [value for value in values if math.isfinite(value)]
        if not finite:
            return cls(float("nan"), float("nan"), float("nan"), tuple(values))
        return cls(statistics.median(finite), min(finite), max(finite), tuple(values))

    @classmethod
    def from_dict(cls, figure: dict[str, Any]) -> Spread:
        """Back from `as_dict` (as the JSON report holds it)."""
        values = tuple(figure.get("values", ()))
        return cls(figure["median"], figure["low"], figure["high"], values)

    def text(self, fmt: str = ".2f", unit: str = "") -> str:
        return f"{self.median:{fmt}}{unit} ({self.low:{fmt}} – {self.high:{fmt}})"

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "low": self.low, "high": self.high, "values": self.values}


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) on log(x): 1.0 is linear growth."""
    log_x = [math.log(x) for x in xs]
    log_y = [math.log(y) for y in ys]
    mean_x, mean_y = statistics.fmean(log_x), statistics.fmean(log_y)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(log_x, log_y, strict=True))
    variance = sum((x - mean_x) ** 2 for x in log_x)
    return covariance / variance


# --- load -------------------------------------------------------------------------------


def bench_channel(target: str) -> grpc.aio.Channel:
    """The thin client's options; a local subchannel pool so each channel is its own
    connection, as each engine worker process would have."""
    return grpc.aio.insecure_channel(
        target, options=[*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    )


def with_engine_id(base_bytes: bytes, engine_id: str) -> bytes:
    """`base_bytes` (a serialized PlanRequest) naming another engine, without
    re-serializing it: a scalar field's last occurrence wins when protobuf parses
    concatenated messages, so appending the engine_id field renames the engine.
    The load generator then spends microseconds, not the server's parse time, on it."""
    return base_bytes + plan_pb2.PlanRequest(engine_id=engine_id).SerializeToString()


class EngineIds:
    """Engine ids never seen by the server: a run prefix and a serial."""

    def __init__(self, prefix: str) -> None:
        self.prefix = f"{prefix}-{os.getpid()}-{time.time_ns() % 10**9}"
        self.serial = 0

    def next(self) -> str:
        self.serial += 1
        return f"{self.prefix}-{self.serial}"


# Fresh content: each worker's non-torch memory (CUDA context, NCCL, cuBLAS), which
# real GPUs report differently by MiBs. 1 GiB plus a 4 KiB step per serial, kept inside
# [2^28, 2^35), where a uint64 varint is 5 bytes, so patching it moves no other byte.
NON_TORCH_BASE_BYTES = 1 << 30
NON_TORCH_STEP_BYTES = 4096
_FIVE_BYTE_VARINTS = range(1 << 28, 1 << 35)
NON_TORCH_VALUES = (_FIVE_BYTE_VARINTS.stop - NON_TORCH_BASE_BYTES) // NON_TORCH_STEP_BYTES
_NON_TORCH_MARKER = _FIVE_BYTE_VARINTS.stop - 1  # every one of its 5 bytes differs from BASE's
# The largest field number protobuf allows: no kvplan release will define it.
UNKNOWN_OPTIONS_FIELD = (1 << 29) - 1
_fresh_serials = itertools.count(1)  # shared: no two payloads of one process repeat content


def non_torch_bytes_of(serial: int) -> int:
    """Serial k's non-torch figure: BASE + k * 4 KiB, wrapping after NON_TORCH_VALUES
    (about 8 million) serials; serial 0 (and its wraps) is the base itself."""
    return NON_TORCH_BASE_BYTES + (serial % NON_TORCH_VALUES) * NON_TORCH_STEP_BYTES


def next_fresh_serial() -> int:
    """A serial no other fresh payload of this process has used."""
    return next(_fresh_serials)


def _varint5(value: int) -> bytes:
    """The protobuf varint of `value`, which must take exactly 5 bytes."""
    if value not in _FIVE_BYTE_VARINTS:
        raise ValueError(f"{value} is not a 5-byte varint")
    return encode_varint(value)


class FreshContent:
    """Payloads of a new engine with new content: what a plan the server cannot have
    seen costs (a new engine id alone is known content, which the server may answer
    from memory). The content is new in its memory figures, as another engine of a
    fleet's model is: the server keeps the model's grouping (kvplan.model_cache) and
    budgets it. `new_model()` is a model never seen as well: planned from scratch.

    Built from a base PlanRequest: `template` is the base with every worker's
    memory.non_kv.non_torch_bytes = NON_TORCH_BASE_BYTES, serialized once.
    `payload(serial, engine_id)` patches that field's varint in a copy of the
    template to non_torch_bytes_of(serial) in every worker and appends the engine id
    as `with_engine_id` does; nothing is re-serialized. Measured once (timeit, the
    2-core development host): `next()` costs about 4 µs for the 29 KB 8-worker
    Qwen3-Next request (parsing that request: about 50 µs) and 2 µs for the 3 KB
    64-layer engine, so the load generator takes little of the server's CPU.
    """

    def __init__(self, base: plan_pb2.PlanRequest, prefix: str) -> None:
        request = plan_pb2.PlanRequest()
        request.CopyFrom(base)
        if not request.workers:
            raise ValueError("fresh content needs at least one worker")
        for worker in request.workers:
            worker.memory.non_kv.non_torch_bytes = NON_TORCH_BASE_BYTES
        self.request = request
        self.template = request.SerializeToString()
        self.offsets = self._varint_offsets(request)
        self.ids = EngineIds(prefix)
        self._check_patch()

    def _varint_offsets(self, request: plan_pb2.PlanRequest) -> tuple[int, ...]:
        """Where each worker's non-torch varint starts in `template`: serialized again
        with a marker value of the same width, the two differ in exactly those bytes."""
        marked = plan_pb2.PlanRequest()
        marked.CopyFrom(request)
        for worker in marked.workers:
            worker.memory.non_kv.non_torch_bytes = _NON_TORCH_MARKER
        marked_bytes = marked.SerializeToString()
        if len(marked_bytes) != len(self.template):
            raise RuntimeError("the non-torch varint changed the request's length")
        pairs = zip(self.template, marked_bytes, strict=True)
        differing = [index for index, (plain, mark) in enumerate(pairs) if plain != mark]
        offsets = tuple(differing[::5])
        whole_varints = [offset + i for offset in offsets for i in range(5)]
        if len(offsets) != len(request.workers) or differing != whole_varints:
            raise RuntimeError(
                f"expected one 5-byte non-torch varint per worker ({len(request.workers)}), "
                f"found differing bytes at {differing[:20]}"
            )
        return offsets

    def _check_patch(self) -> None:
        """A probe value patched in must reach every worker and change nothing else."""
        probe = non_torch_bytes_of(NON_TORCH_VALUES - 1)
        parsed = plan_pb2.PlanRequest.FromString(bytes(self._patched(probe)))
        patched_values = [worker.memory.non_kv.non_torch_bytes for worker in parsed.workers]
        if patched_values != [probe] * len(self.request.workers):
            raise RuntimeError("the patched varints are not every worker's non-torch bytes")
        for worker in parsed.workers:
            worker.memory.non_kv.non_torch_bytes = NON_TORCH_BASE_BYTES
        if parsed != self.request:
            raise RuntimeError("patching the non-torch varints changed other fields")

    def _patched(self, non_torch_bytes: int) -> bytearray:
        patched = bytearray(self.template)
        varint = _varint5(non_torch_bytes)
        for offset in self.offsets:
            patched[offset : offset + 5] = varint
        return patched

    def payload(self, serial: int, engine_id: str) -> bytes:
        """The template with serial's non-torch figure in every worker, named `engine_id`."""
        return with_engine_id(bytes(self._patched(non_torch_bytes_of(serial))), engine_id)

    def next(self) -> bytes:
        """A new engine id and a serial this process has not sent yet."""
        return self.payload(next_fresh_serial(), self.ids.next())

    def known_content(self) -> bytes:
        """A new engine id, the template's content: a new replica of a model on GPUs
        that report the same memory, whose whole plan the server may reuse."""
        return with_engine_id(self.template, self.ids.next())

    def new_model(self) -> bytes:
        """`next()` of a model the server has not seen: its options carry a serial in
        a field no kvplan release defines, which the planner never reads but which is
        part of the model key (PlanKeys.model), so nothing kept applies. Appended as
        an options message, which protobuf merges into the request's options."""
        serial = encode_varint(UNKNOWN_OPTIONS_FIELD << 3) + encode_varint(next_fresh_serial())
        options = encode_varint(plan_pb2.PlanRequest.OPTIONS_FIELD_NUMBER << 3 | 2)
        return self.next() + options + encode_varint(len(serial)) + serial


@dataclass(frozen=True)
class Variant:
    """One kind of call in an interleaved load: a method and its next payload."""

    name: str
    method: str
    next_payload: Callable[[], bytes]


@dataclass
class SliceTally:
    """One variant's figures over all its slices of one interleaved run."""

    latencies_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    server_cpu_s: float = 0.0
    steal_s: float = 0.0
    calls: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def throughput_rps(self) -> float:
        return self.calls / self.seconds if self.seconds else float("nan")

    @property
    def server_cpu_us_per_call(self) -> float:
        return self.server_cpu_s / self.calls * 1e6 if self.calls else float("nan")

    def summary(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "seconds": self.seconds,
            "throughput_rps": self.throughput_rps,
            "p50_ms": percentile(self.latencies_s, 0.50) * 1e3,
            "p99_ms": percentile(self.latencies_s, 0.99) * 1e3,
            "server_cpu_us_per_call": self.server_cpu_us_per_call,
            "server_cores": self.server_cpu_s / self.seconds if self.seconds else float("nan"),
            "steal_cores": self.steal_s / self.seconds if self.seconds else float("nan"),
            "errors": len(self.errors),
            "errors_seen": sorted(set(self.errors))[:5],
        }


async def run_interleaved(
    server: ServerProcess,
    variants: Sequence[Variant],
    concurrency: int,
    rounds: int,
    slice_s: float,
    settle_s: float,
) -> dict[str, SliceTally]:
    """`concurrency` callers, each on its own channel, calling back to back.

    The callers switch between the variants in `rounds` rounds of `slice_s` each
    (order alternating), so the variants share the machine's conditions: on a
    shared host, CPU steal moves by the second. Only calls of the current variant
    that end inside a slice's window count, and the server's CPU over the window is
    charged to them; `settle_s` after each switch lets the previous variant's calls
    drain first.
    """
    channels = [bench_channel(server.target) for _ in range(concurrency)]
    current = variants[0]
    running = True
    finished: list[tuple[str, float, float]] = []  # successful calls: (variant, end, latency)
    tallies = {variant.name: SliceTally() for variant in variants}

    async def caller(channel: grpc.aio.Channel) -> None:
        calls = {v.method: channel.unary_unary(v.method) for v in variants}  # bytes in and out
        while running:
            variant = current
            payload = variant.next_payload()
            start = time.perf_counter()
            try:
                await calls[variant.method](payload, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as error:  # counted apart: a failed call is no throughput
                tallies[variant.name].errors.append(f"{error.code().name}: {error.details()}")
                continue
            end = time.perf_counter()
            finished.append((variant.name, end, end - start))

    try:
        for channel in channels:
            await channel.channel_ready()
        callers = [asyncio.create_task(caller(channel)) for channel in channels]
        for round_index in range(rounds):
            order = variants if round_index % 2 == 0 else variants[::-1]
            for variant in order:
                current = variant
                await asyncio.sleep(settle_s)
                window_start = time.perf_counter()
                server_cpu, steal = server.cpu_s(), steal_seconds()
                first_unseen = len(finished)
                await asyncio.sleep(slice_s)
                window_end = time.perf_counter()
                tally = tallies[variant.name]
                tally.seconds += window_end - window_start
                tally.server_cpu_s += server.cpu_s() - server_cpu
                tally.steal_s += steal_seconds() - steal
                in_slice = [
                    latency
                    for name, end, latency in finished[first_unseen:]
                    if name == variant.name and window_start <= end <= window_end
                ]
                tally.latencies_s.extend(in_slice)
                tally.calls += len(in_slice)
        running = False
        await asyncio.gather(*callers)
    finally:
        for channel in channels:
            await channel.close()
    return tallies


async def timed_calls(
    channel: grpc.aio.Channel,
    method: str,
    payloads: Callable[[], bytes],
    seconds: float,
    min_calls: int = 3,
) -> list[float]:
    """Back-to-back calls of one method for `seconds` (and at least `min_calls`):
    each call's latency in seconds. Errors raise: these figures must be of calls
    that did what they say."""
    call = channel.unary_unary(method)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(latencies) < min_calls:
        payload = payloads()
        start = time.perf_counter()
        await call(payload, timeout=CALL_TIMEOUT_S)
        latencies.append(time.perf_counter() - start)
    return latencies


# --- machine ----------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "grpcio": grpc.__version__,
        "platform": platform.platform(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def reference_parse_us(payload: bytes) -> float:
    """Machine speed now: median µs to parse `payload` as a PlanRequest, in this process.

    On a shared host this moves by a factor of several within minutes; the figure
    at the start and at the end of a run says how fast the machine was meanwhile.
    """
    batches: list[float] = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            plan_pb2.PlanRequest.FromString(payload)
        batches.append((time.perf_counter() - start) / 20 * 1e6)
    return statistics.median(batches)


def machine_line(machine: dict[str, Any]) -> str:
    return (
        f"{machine['cpus_usable']} CPUs ({machine['cpu_model']}) · "
        f"{machine['implementation']} {machine['python']} · grpcio {machine['grpcio']}"
    )


# --- targets and results ----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One target of issue 11: what it asks, what was measured, met or not.

    `passed` is None when the figure could not be measured in this run (say, no
    vLLM environment); the report then says NOT RUN and why in `measured`.
    """

    name: str
    measured: str
    passed: bool | None
    figure: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "NOT RUN" if self.passed is None else ("PASS" if self.passed else "FAIL")

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.name,
            "measured": self.measured,
            "pass": self.passed,
            "verdict": self.verdict,
            "figure": self.figure,
        }


def targets_table(targets: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| target | measured: median (min-max) | result |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['verdict']} |" for t in targets]
    return lines


def print_targets(targets: Sequence[Target]) -> None:
    for target in targets:
        print(f"{target.verdict:>7}  {target.name}: {target.measured}", flush=True)


def new_report(name: str, args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "machine": machine_info(),
        "settings": {"repeats": repeats_of(args), **settings},
    }


def _json_safe(value: Any) -> Any:
    """JSON without NaN/Infinity (not JSON): those become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def write_results(
    folder: Path, name: str, report: dict[str, Any], markdown_body: Sequence[str]
) -> None:
    """bench/results/NAME.json (everything) and NAME.md (a title, the body, targets)."""
    folder.mkdir(parents=True, exist_ok=True)
    header = [
        f"## {report['title']}",
        "",
        f"{report['date']} · {machine_line(report['machine'])}"
        + (" · **quick mode: smoke-test scale, not figures**" if report["quick"] else ""),
        "",
    ]
    lines = [*header, *markdown_body]
    if report["targets"]:
        lines += ["", "### Targets", "", *targets_table(report["targets"])]
    (folder / f"{name}.json").write_text(
        json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n"
    )
    (folder / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {folder / (name + '.json')} and {folder / (name + '.md')}", flush=True)


def exit_code(targets: Sequence[Target], strict: bool) -> int:
    return 1 if strict and any(target.passed is False for target in targets) else 0
