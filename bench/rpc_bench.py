"""The gRPC service under load, against one `kvplan serve` in its own process.

    python -m bench.rpc_bench            # or: make bench-rpc
    RPC_BENCH_PROFILE=/tmp/prof python -m bench.rpc_bench   # the server under cProfile

One run measures, against one server spawned as `.venv/bin/kvplan serve` on free
ports (so the load generator does not share the server's GIL):

- PlanKVCache throughput and p50/p99 latency at concurrency 1, 16 and 64, cached
  (one request repeated: a content-addressed cache hit) and uncached (every request
  distinct), next to the bare Echo RPC carrying the same request payload, as ratios.
- Rank-mode rendezvous: 256 engines x 8 ranks arriving concurrently in random order.
- Cold start: spawn to health SERVING, median of 5 fresh processes.
- Server RSS after start and after the load; server CPU per call from /proc.

The engine is a 64-layer Qwen3-Next-style hybrid (3 Gated DeltaNet : 1 full attention,
plus its MTP layer) on 8 tensor-parallel workers, derived from
examples/qwen3-next-80b-a3b-mtp.yaml. The load generator uses raw grpc.aio
multicallables that send pre-serialized bytes and keep the reply as bytes, one
channel (one HTTP/2 connection) per concurrent caller, as each engine worker is
its own process with its own client: the client process then spends little CPU
per call and the figures are the server's. Results go to bench/results/rpc.json
and bench/results/rpc.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import pstats
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplan.cli import load_request
from kvplan.client import AsyncPlannerClient, PlannerError, channel_options
from kvplan.v1 import plan_pb2, spec_pb2

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
EXAMPLE = ROOT / "examples" / "qwen3-next-80b-a3b-mtp.yaml"
SERVICE = "kvplan.v1.KVCachePlanner"
PLAN_METHOD = f"/{SERVICE}/PlanKVCache"
ECHO_METHOD = f"/{SERVICE}/Echo"
PROFILE_ENV = "RPC_BENCH_PROFILE"  # a folder: run the main server under cProfile
CALL_TIMEOUT_S = 30.0
NUM_LAYERS = 64
NUM_WORKERS = 8
HYBRID_BLOCK_SIZE = 272  # 16 * cdiv(Mamba page 270,336 B, 16 * 1,024 B per attention token)
WEIGHTS_BYTES_PER_RANK = 20_000_000_000  # 80e9 params x 2 bytes / TP 8
SETTLE_S = 0.15  # after switching variants, before a slice's window opens
UNCACHED_WARMUP_S = 0.5

# Targets: (key, description).
TARGET_CACHED_OVER_ECHO = 0.8
TARGET_RENDEZVOUS_S = 5.0
TARGET_COLD_START_S = 1.5
TARGET_IDLE_RSS_MB = 120.0


# --- the engine ---------------------------------------------------------------------


def hybrid_request() -> plan_pb2.PlanRequest:
    """Qwen3-Next-80B-A3B + MTP rescaled to 64 layers on TP 8 (8 workers, all layers each).

    Per TP-8 rank: conv state (4, (2*16*128 + 32*128) / 8) = (4, 1024) bf16, temporal state
    (32 / 8, 128, 128) fp32: 270,336 bytes; attention 1 KV head x 256: 1,024 bytes per token,
    so the hybrid block is 272 tokens (page 278,528 bytes, the Mamba page padded to it).
    """
    example = load_request(str(EXAMPLE))
    source_layers = example.workers[0].layers
    mamba_layer = next(layer for layer in source_layers if layer.HasField("mamba"))
    attention_layer = next(layer for layer in source_layers if layer.HasField("full_attention"))
    mtp_layer = source_layers[-1]
    layers: list[spec_pb2.LayerSpec] = []
    for index in range(NUM_LAYERS):
        layer = spec_pb2.LayerSpec()
        if index % 4 == 3:
            layer.CopyFrom(attention_layer)
            layer.name = f"model.layers.{index}.self_attn.attn"
            layer.block_size = HYBRID_BLOCK_SIZE
        else:
            layer.CopyFrom(mamba_layer)
            layer.name = f"model.layers.{index}.linear_attn"
            conv_state, temporal_state = layer.mamba.states
            conv_state.shape[:] = [4, 1024]
            temporal_state.shape[:] = [4, 128, 128]
        layers.append(layer)
    mtp = spec_pb2.LayerSpec()
    mtp.CopyFrom(mtp_layer)
    mtp.block_size = HYBRID_BLOCK_SIZE
    layers.append(mtp)

    request = plan_pb2.PlanRequest()
    request.CopyFrom(example)
    request.engine_id = f"qwen3-next-{NUM_LAYERS}l-tp{NUM_WORKERS}"
    request.options.block_size = HYBRID_BLOCK_SIZE
    request.options.parallel.tensor_parallel_size = NUM_WORKERS
    template_worker = example.workers[0]
    del request.workers[:]
    for rank in range(NUM_WORKERS):
        worker = request.workers.add()
        worker.CopyFrom(template_worker)
        worker.rank = rank
        worker.memory.non_kv.weights_bytes = WEIGHTS_BYTES_PER_RANK
        del worker.layers[:]
        worker.layers.extend(layers)
    return request


def distinct_request(base: plan_pb2.PlanRequest, serial: int) -> plan_pb2.PlanRequest:
    """The same engine with 64 KiB more weights per `serial`: another plan id."""
    request = plan_pb2.PlanRequest()
    request.CopyFrom(base)
    for worker in request.workers:
        worker.memory.non_kv.weights_bytes = WEIGHTS_BYTES_PER_RANK + serial * 64 * 1024
    return request


def rank_request(base: plan_pb2.PlanRequest, engine_id: str, rank: int) -> plan_pb2.PlanRequest:
    """Rank mode: one worker of `base`, world_size = the engine's worker count."""
    request = plan_pb2.PlanRequest()
    request.CopyFrom(base)
    request.engine_id = engine_id
    request.world_size = len(base.workers)
    del request.workers[:]
    request.workers.append(base.workers[rank])
    return request


# --- the server process --------------------------------------------------------------


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
    spawn_to_serving_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ready_in_s(self) -> float | None:
        """The server's own 'ready in' figure: start_server alone, imports excluded."""
        # The text log's structured line: "... kvplan.server ready seconds=0.023".
        found = re.search(r" ready seconds=([0-9.]+)", self.log_path.read_text(errors="replace"))
        return float(found.group(1)) if found else None

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


def spawn_server(log_dir: Path, label: str, profile_to: Path | None = None) -> ServerProcess:
    """Start `kvplan serve` on free ports and wait for health SERVING."""
    port, metrics_port = free_port(), free_port()
    flags = ["serve", "--host", "127.0.0.1", "--port", str(port)]
    flags += ["--metrics-port", str(metrics_port)]
    # The embedded default store (SQLite), in a folder of this run's own.
    flags += ["--state-dir", str(log_dir / f"{label}-state")]
    if profile_to is None:
        command = [str(kvplan_executable()), *flags]
    else:
        command = [sys.executable, "-m", "cProfile", "-o", str(profile_to), "-m", "kvplan.cli"]
        command += flags
    log_path = log_dir / f"{label}.log"
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVPLAN_")}
    with log_path.open("wb") as log_file:
        started = time.perf_counter()
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env
        )
    server = ServerProcess(process, port, metrics_port, log_path)
    try:
        wait_serving(server, timeout_s=30.0)
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


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all threads."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields_after_name = stat.rsplit(")", 1)[1].split()
    user_ticks, system_ticks = int(fields_after_name[11]), int(fields_after_name[12])
    return (user_ticks + system_ticks) / CLOCK_TICKS_PER_S


def scrape_counter(server: ServerProcess, name: str) -> float:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = reply.read().decode()
    for line in body.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


# --- throughput and latency ----------------------------------------------------------


@dataclass
class LoadResult:
    variant: str  # "echo", "plan cached", "plan uncached"
    concurrency: int
    channels: int
    calls: int
    errors: int
    seconds: float
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    server_cpu_us_per_call: float
    server_cpu_cores: float  # mean cores busy in the server process
    client_cpu_cores: float  # the same for this (load generator) process
    steal_cores: float  # CPU the hypervisor gave other guests meanwhile (shared hosts)
    cache_hits: int = 0
    cache_misses: int = 0
    slice_rps: list[float] = field(default_factory=list)  # each slice's throughput
    errors_seen: list[str] = field(default_factory=list)


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def bench_channel_options() -> list[tuple[str, int | str]]:
    # The thin client's options; a local subchannel pool so each channel is its own
    # connection, as each engine worker process would have.
    return [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]


@dataclass(frozen=True)
class Variant:
    name: str  # "echo", "plan cached", "plan uncached"
    method: str
    next_payload: Callable[[], bytes]


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    steal_s: float = 0.0
    slice_rps: list[float] = field(default_factory=list)  # per slice, in time order


def steal_seconds() -> float:
    """CPU time the hypervisor gave to other guests, all CPUs (the `steal` of /proc/stat)."""
    fields_of_cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields_of_cpu[8]) / CLOCK_TICKS_PER_S


async def run_load(
    server: ServerProcess,
    variants: list[Variant],
    concurrency: int,
    rounds: int,
    slice_s: float,
    settle_s: float,
) -> list[LoadResult]:
    """`concurrency` callers, each on its own channel, calling back to back.

    With several variants the callers switch between them in `rounds` rounds of
    `slice_s` each (order alternating), so that the variants share the machine's
    conditions: on a shared host, CPU steal moves by the second. Only calls of the
    current variant that end inside a slice's window count; `settle_s` after each
    switch lets the previous variant's calls drain.
    """
    channels = [
        grpc.aio.insecure_channel(server.target, options=bench_channel_options())
        for _ in range(concurrency)
    ]
    current = variants[0]
    running = True
    finished: list[tuple[str, float, float]] = []  # (variant, end, latency)
    errors: dict[str, list[str]] = {variant.name: [] for variant in variants}
    tallies = {variant.name: _Tally() for variant in variants}

    async def caller(channel: grpc.aio.Channel) -> None:
        calls = {v.method: channel.unary_unary(v.method) for v in variants}  # bytes in and out
        while running:
            variant = current
            payload = variant.next_payload()
            start = time.perf_counter()
            try:
                await calls[variant.method](payload, timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as error:
                errors[variant.name].append(f"{error.code().name}: {error.details()}")
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
                server_cpu, client_cpu, steal = (
                    cpu_seconds(server.pid),
                    time.process_time(),
                    steal_seconds(),
                )
                first_unseen = len(finished)
                await asyncio.sleep(slice_s)
                window_end = time.perf_counter()
                tally = tallies[variant.name]
                tally.seconds += window_end - window_start
                tally.server_cpu_s += cpu_seconds(server.pid) - server_cpu
                tally.client_cpu_s += time.process_time() - client_cpu
                tally.steal_s += steal_seconds() - steal
                in_slice = [
                    latency
                    for name, end, latency in finished[first_unseen:]
                    if name == variant.name and window_start <= end <= window_end
                ]
                tally.latencies.extend(in_slice)
                tally.slice_rps.append(len(in_slice) / (window_end - window_start))
        running = False
        await asyncio.gather(*callers)
    finally:
        for channel in channels:
            await channel.close()
    results: list[LoadResult] = []
    for variant in variants:
        tally = tallies[variant.name]
        in_window = sorted(tally.latencies)
        calls = len(in_window)
        results.append(
            LoadResult(
                variant=variant.name,
                concurrency=concurrency,
                channels=len(channels),
                calls=calls,
                errors=len(errors[variant.name]),
                seconds=tally.seconds,
                throughput_rps=calls / tally.seconds,
                p50_ms=percentile(in_window, 0.50) * 1000,
                p99_ms=percentile(in_window, 0.99) * 1000,
                server_cpu_us_per_call=tally.server_cpu_s / max(calls, 1) * 1e6,
                server_cpu_cores=tally.server_cpu_s / tally.seconds,
                client_cpu_cores=tally.client_cpu_s / tally.seconds,
                steal_cores=tally.steal_s / tally.seconds,
                slice_rps=tally.slice_rps,
                errors_seen=sorted(set(errors[variant.name]))[:5],
            )
        )
    return results


async def check_replies(server: ServerProcess, payload: bytes) -> plan_pb2.PlanResponse:
    """One plan and one echo, parsed: the load below is of calls that do what they say."""
    async with grpc.aio.insecure_channel(server.target) as channel:
        plan_bytes = await channel.unary_unary(PLAN_METHOD)(payload, timeout=CALL_TIMEOUT_S)
        echo_bytes = await channel.unary_unary(ECHO_METHOD)(payload, timeout=CALL_TIMEOUT_S)
    plan = plan_pb2.PlanResponse.FromString(plan_bytes)
    if plan.num_blocks <= 0 or len(plan.workers) != NUM_WORKERS:
        raise RuntimeError(f"unexpected plan: {plan.num_blocks} blocks, {len(plan.workers)}")
    if plan_pb2.PlanRequest.FromString(echo_bytes) != plan_pb2.PlanRequest.FromString(payload):
        raise RuntimeError("Echo did not return its payload")
    return plan


async def measure_throughput(
    server: ServerProcess,
    base: plan_pb2.PlanRequest,
    concurrencies: list[int],
    rounds: int,
    slice_s: float,
    uncached_s: float,
) -> list[LoadResult]:
    """Per concurrency: echo and cached plan interleaved, then uncached plans alone
    (their calls take long enough to spill into a neighbouring slice)."""
    cached_payload = base.SerializeToString()
    serial = 0

    def same_payload() -> bytes:
        return cached_payload

    def distinct_payload() -> bytes:
        nonlocal serial
        serial += 1
        return distinct_request(base, serial).SerializeToString()

    echo = Variant("echo", ECHO_METHOD, same_payload)
    cached = Variant("plan cached", PLAN_METHOD, same_payload)
    uncached = Variant("plan uncached", PLAN_METHOD, distinct_payload)
    results: list[LoadResult] = []
    for concurrency in concurrencies:
        for variants, phase_rounds, phase_slice_s, settle_s in (
            ([echo, cached], rounds, slice_s, SETTLE_S),
            ([uncached], 1, uncached_s, UNCACHED_WARMUP_S),
        ):
            hits = scrape_counter(server, "kvplan_plan_cache_hits_total")
            misses = scrape_counter(server, "kvplan_plan_cache_misses_total")
            phase = await run_load(
                server, variants, concurrency, phase_rounds, phase_slice_s, settle_s
            )
            hits = scrape_counter(server, "kvplan_plan_cache_hits_total") - hits
            misses = scrape_counter(server, "kvplan_plan_cache_misses_total") - misses
            for result in phase:
                if result.variant != "echo":  # the phase's plan calls, warm-up included
                    result.cache_hits, result.cache_misses = round(hits), round(misses)
                print(
                    f"  c={concurrency:<3} {result.variant:<14} {result.throughput_rps:8.0f} "
                    f"req/s  p50 {result.p50_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms  "
                    f"server {result.server_cpu_us_per_call:6.0f} µs CPU/call "
                    f"({result.server_cpu_cores:.2f} cores), client "
                    f"{result.client_cpu_cores:.2f}, steal {result.steal_cores:.2f}, "
                    f"errors {result.errors}",
                    flush=True,
                )
            results.extend(phase)
    return results


# --- rendezvous -----------------------------------------------------------------------


@dataclass
class RendezvousResult:
    engines: int
    ranks_per_engine: int
    calls: int
    wall_s: float
    errors: int
    consistent: bool  # every rank of an engine: one plan id, one num_blocks
    distinct_plan_ids: int
    server_cpu_s: float
    client_cpu_s: float
    steal_cores: float
    clients: int
    errors_seen: list[str] = field(default_factory=list)


async def measure_rendezvous(
    server: ServerProcess, base: plan_pb2.PlanRequest, engines: int, clients: int
) -> RendezvousResult:
    """`engines` x world_size rank-mode calls at once, in random arrival order."""
    ranks = len(base.workers)
    arrivals = [(engine, rank) for engine in range(engines) for rank in range(ranks)]
    random.Random(0).shuffle(arrivals)
    requests = [
        (engine, rank, rank_request(base, f"rendezvous-{engine}", rank))
        for engine, rank in arrivals
    ]
    planners = [AsyncPlannerClient(server.target, timeout_s=60) for _ in range(clients)]
    errors: list[str] = []

    async def join(
        index: int, request: plan_pb2.PlanRequest
    ) -> tuple[str, int, frozenset[int]] | None:
        try:
            result = await planners[index % clients].plan(request)
        except PlannerError as error:
            errors.append(str(error))
            return None
        worker_blocks = frozenset(worker.num_blocks for worker in result.response.workers)
        return result.plan_id, result.num_blocks, worker_blocks

    try:
        await asyncio.gather(*(planner._channel.channel_ready() for planner in planners))
        cpu_start, client_cpu_start, steal_start = (
            cpu_seconds(server.pid),
            time.process_time(),
            steal_seconds(),
        )
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(join(index, request) for index, (_, _, request) in enumerate(requests))
        )
        wall_s = time.perf_counter() - start
        server_cpu_s = cpu_seconds(server.pid) - cpu_start
        client_cpu_s = time.process_time() - client_cpu_start
        steal_cores = (steal_seconds() - steal_start) / wall_s
    finally:
        for planner in planners:
            await planner.close()
    by_engine: dict[int, set[tuple[str, int, frozenset[int]]]] = {}
    for (engine, _, _), reply in zip(requests, replies, strict=True):
        if reply is not None:
            by_engine.setdefault(engine, set()).add(reply)
    consistent = len(by_engine) == engines and all(
        len(seen) == 1 and len(next(iter(seen))[2]) == 1 and next(iter(seen))[1] > 0
        for seen in by_engine.values()
    )
    plan_ids = {plan_id for seen in by_engine.values() for plan_id, _, _ in seen}
    return RendezvousResult(
        engines=engines,
        ranks_per_engine=ranks,
        calls=len(requests),
        wall_s=wall_s,
        errors=len(errors),
        consistent=consistent,
        distinct_plan_ids=len(plan_ids),
        server_cpu_s=server_cpu_s,
        client_cpu_s=client_cpu_s,
        steal_cores=steal_cores,
        clients=clients,
        errors_seen=sorted(set(errors))[:5],
    )


# --- cold start -------------------------------------------------------------------------


@dataclass
class ColdStartResult:
    runs_s: list[float]
    median_s: float
    ready_in_s: list[float]  # the server's own start_server time, imports excluded
    rss_after_start_mb: list[float]


def measure_cold_start(log_dir: Path, runs: int) -> ColdStartResult:
    spawn_to_serving: list[float] = []
    ready_in: list[float] = []
    rss: list[float] = []
    for run in range(runs):
        server = spawn_server(log_dir, f"cold-{run}")
        try:
            spawn_to_serving.append(server.spawn_to_serving_s)
            rss.append(rss_mb(server.pid))
        finally:
            server.stop()
        own = server.ready_in_s()
        if own is not None:
            ready_in.append(own)
        print(f"  start {run + 1}: {server.spawn_to_serving_s:.3f} s to SERVING", flush=True)
    return ColdStartResult(spawn_to_serving, statistics.median(spawn_to_serving), ready_in, rss)


# --- report ---------------------------------------------------------------------------


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def reference_parse_us(payload: bytes) -> float:
    """Machine speed now: median µs to parse the benchmark's request, in this process.

    On a shared host this moves by a factor of several within minutes; the figure
    at the start and at the end of the run says how fast the machine was meanwhile.
    """
    batches: list[float] = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(100):
            plan_pb2.PlanRequest.FromString(payload)
        batches.append((time.perf_counter() - start) / 100 * 1e6)
    return statistics.median(batches)


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


def ratios(results: list[LoadResult]) -> list[dict[str, Any]]:
    echo_of = {r.concurrency: r for r in results if r.variant == "echo"}
    rows: list[dict[str, Any]] = []
    for result in results:
        if result.variant == "echo":
            continue
        echo = echo_of[result.concurrency]
        # Interleaved slices pair up in time: the median of the pairs' ratios shrugs off
        # a burst of steal that a pooled ratio would take in. Alone (uncached): pooled.
        paired = len(result.slice_rps) > 1 and len(result.slice_rps) == len(echo.slice_rps)
        throughput_ratio = (
            statistics.median(
                plan / echo_rps
                for plan, echo_rps in zip(result.slice_rps, echo.slice_rps, strict=True)
            )
            if paired
            else result.throughput_rps / echo.throughput_rps
        )
        rows.append(
            {
                "variant": result.variant,
                "concurrency": result.concurrency,
                "throughput_over_echo": throughput_ratio,
                "throughput_over_echo_pooled": result.throughput_rps / echo.throughput_rps,
                "paired_slices": len(result.slice_rps) if paired else 0,
                "server_cpu_per_call_over_echo": result.server_cpu_us_per_call
                / echo.server_cpu_us_per_call,
                "p50_over_echo": result.p50_ms / echo.p50_ms,
                "p99_over_echo": result.p99_ms / echo.p99_ms,
            }
        )
    return rows


def evaluate_targets(
    ratio_rows: list[dict[str, Any]],
    rendezvous: RendezvousResult,
    cold: ColdStartResult,
    rss_start_mb: float,
    rss_after_mb: float,
) -> list[dict[str, Any]]:
    cached = [row for row in ratio_rows if row["variant"] == "plan cached"]
    cached_text = ", ".join(
        f"c={row['concurrency']}: {row['throughput_over_echo']:.2f}x" for row in cached
    )
    rendezvous_ok = (
        rendezvous.wall_s < TARGET_RENDEZVOUS_S and rendezvous.errors == 0 and rendezvous.consistent
    )
    return [
        {
            "target": f"cached plan throughput ≥ {TARGET_CACHED_OVER_ECHO}x echo (every c)",
            "measured": cached_text,
            "pass": all(row["throughput_over_echo"] >= TARGET_CACHED_OVER_ECHO for row in cached),
        },
        {
            "target": f"rendezvous of {rendezvous.calls} ranks < {TARGET_RENDEZVOUS_S:.0f} s, "
            "0 errors, one plan per engine",
            "measured": f"{rendezvous.wall_s:.2f} s, {rendezvous.errors} errors, "
            f"{'consistent' if rendezvous.consistent else 'INCONSISTENT'}",
            "pass": rendezvous_ok,
        },
        {
            "target": f"cold start to SERVING < {TARGET_COLD_START_S} s (median of "
            f"{len(cold.runs_s)})",
            "measured": f"{cold.median_s:.3f} s",
            "pass": cold.median_s < TARGET_COLD_START_S,
        },
        {
            "target": f"idle RSS < {TARGET_IDLE_RSS_MB:.0f} MB (after start / after load)",
            "measured": f"{rss_start_mb:.1f} MB / {rss_after_mb:.1f} MB",
            "pass": max(rss_start_mb, rss_after_mb) < TARGET_IDLE_RSS_MB,
        },
    ]


def render_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    engine = report["engine"]
    lines = [
        "## kvplan gRPC service benchmark",
        "",
        f"{report['date']} · {machine['cpus_usable']} CPUs ({machine['cpu_model']}) · "
        f"{machine['implementation']} {machine['python']} · grpcio {machine['grpcio']} · "
        f"machine speed: parsing the request took {machine['reference_parse_us_start']:.0f} µs "
        f"at the start, {machine['reference_parse_us_end']:.0f} µs at the end "
        "(a shared host: compare runs by this)",
        "",
        f"Engine: {engine['description']}; request {engine['request_bytes']:,} B, "
        f"plan response {engine['response_bytes']:,} B, {engine['num_blocks']:,} blocks. "
        f"One `kvplan serve` process; the load generator in another process with raw "
        f"grpc.aio calls (bytes in, bytes out), one channel per concurrent caller. "
        f"Echo and cached plan alternate in {report['settings']['rounds']} rounds of "
        f"{report['settings']['slice_s']:.2f} s slices per concurrency (so both see the "
        f"same CPU steal); uncached runs {report['settings']['uncached_s']:.1f} s alone. "
        "Server CPU per call is from /proc (all threads); steal is the host's, in cores "
        f"of {machine['cpus_usable']}. Cache hits/misses: the server's counters over the "
        "phase, warm-up included. vs echo req/s: for cached, the median over the paired "
        "(adjacent) slices of plan/echo throughput; req/s and the pooled ratio are over "
        "all slices. vs echo CPU: server CPU per call, plan over echo.",
        "",
        "### Throughput and latency",
        "",
        "| c | RPC | req/s | p50 ms | p99 ms | vs echo req/s (pooled) | vs echo p50 "
        "| vs echo p99 | server CPU µs/call | vs echo CPU | server cores | steal cores "
        "| cache hits/misses | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratio_of = {(row["variant"], row["concurrency"]): row for row in report["ratios"]}
    for result in report["load"]:
        ratio = ratio_of.get((result["variant"], result["concurrency"]))
        versus = (
            f"{ratio['throughput_over_echo']:.2f}x ({ratio['throughput_over_echo_pooled']:.2f}x)"
            f" | {ratio['p50_over_echo']:.2f}x | {ratio['p99_over_echo']:.2f}x"
            if ratio
            else "- | - | -"
        )
        cpu_versus = f"{ratio['server_cpu_per_call_over_echo']:.2f}x" if ratio else "-"
        cache = (
            f"{result['cache_hits']}/{result['cache_misses']}"
            if result["variant"] != "echo"
            else "-"
        )
        lines.append(
            f"| {result['concurrency']} | {result['variant']} | "
            f"{result['throughput_rps']:,.0f} | {result['p50_ms']:.2f} | {result['p99_ms']:.2f} | "
            f"{versus} | {result['server_cpu_us_per_call']:,.0f} | {cpu_versus} | "
            f"{result['server_cpu_cores']:.2f} | {result['steal_cores']:.2f} | {cache} | "
            f"{result['errors']} |"
        )
    rendezvous = report["rendezvous"]
    cold = report["cold_start"]
    lines += [
        "",
        "### Rendezvous, cold start, memory",
        "",
        "| measure | figure |",
        "|---|---|",
        f"| rendezvous: {rendezvous['engines']} engines x {rendezvous['ranks_per_engine']} "
        f"ranks ({rendezvous['calls']} calls at once, random order, "
        f"{rendezvous['clients']} AsyncPlannerClients) | {rendezvous['wall_s']:.2f} s wall, "
        f"{rendezvous['errors']} errors, {rendezvous['distinct_plan_ids']} plan ids, "
        f"{'every rank of an engine got the same plan id and num_blocks' if rendezvous['consistent'] else 'INCONSISTENT plans'}"  # noqa: E501
        f"; CPU: server {rendezvous['server_cpu_s']:.2f} s, load generator "
        f"{rendezvous['client_cpu_s']:.2f} s; steal {rendezvous['steal_cores']:.2f} cores |",
        f"| cold start, spawn to health SERVING | median {cold['median_s']:.3f} s of "
        + ", ".join(f"{seconds:.3f}" for seconds in cold["runs_s"])
        + (
            f" (start_server itself: median {statistics.median(cold['ready_in_s']):.3f} s; "
            "the rest is interpreter start and imports)"
            if cold["ready_in_s"]
            else ""
        )
        + " |",
        f"| server RSS after start (idle) | {report['rss_mb']['after_start']:.1f} MB |",
        f"| server RSS after the load (idle, {report['rss_mb']['plans_cached']} plans in the "
        f"cache) | {report['rss_mb']['after_load']:.1f} MB |",
        "",
        "### Targets",
        "",
        "| target | measured | result |",
        "|---|---|---|",
    ]
    for target in report["targets"]:
        lines.append(f"| {target['target']} | {target['measured']} | {verdict(target['pass'])} |")
    return "\n".join(lines) + "\n"


async def run_server_benchmarks(
    server: ServerProcess, args: argparse.Namespace, base: plan_pb2.PlanRequest
) -> tuple[list[LoadResult], RendezvousResult, plan_pb2.PlanResponse]:
    plan = await check_replies(server, base.SerializeToString())
    print("throughput and latency:", flush=True)
    load = await measure_throughput(
        server, base, args.concurrency, args.rounds, args.slice, args.uncached
    )
    print(f"rendezvous: {args.engines} engines x {len(base.workers)} ranks ...", flush=True)
    rendezvous = await measure_rendezvous(server, base, args.engines, args.clients)
    print(
        f"  {rendezvous.wall_s:.2f} s, {rendezvous.errors} errors, consistent "
        f"{rendezvous.consistent}",
        flush=True,
    )
    return load, rendezvous, plan


def print_profile(path: Path) -> None:
    if not path.exists():
        print(f"no profile at {path}")
        return
    print(f"\nserver profile ({path}), top 30 by own time:")
    pstats.Stats(str(path)).sort_stats("tottime").print_stats(30)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10, help="echo/cached alternations")
    parser.add_argument("--slice", type=float, default=0.3, help="measured seconds per slice")
    parser.add_argument("--uncached", type=float, default=3.0, help="uncached seconds per c")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--engines", type=int, default=256, help="rendezvous engines")
    parser.add_argument("--clients", type=int, default=16, help="rendezvous client channels")
    parser.add_argument("--cold-starts", type=int, default=5)
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args()

    base = hybrid_request()
    parse_us_start = reference_parse_us(base.SerializeToString())
    profile_dir = os.environ.get(PROFILE_ENV)
    profile_path = Path(profile_dir) / "server.prof" if profile_dir else None
    if profile_path is not None:
        profile_path.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvplan-rpc-bench-") as log_folder:
        log_dir = Path(log_folder)
        print(f"cold start ({args.cold_starts} fresh processes):", flush=True)
        cold = measure_cold_start(log_dir, args.cold_starts)
        server = spawn_server(log_dir, "main", profile_to=profile_path)
        try:
            time.sleep(0.5)
            rss_start = rss_mb(server.pid)
            load, rendezvous, plan = asyncio.run(run_server_benchmarks(server, args, base))
            time.sleep(1.0)
            rss_after = rss_mb(server.pid)
            plans_cached = round(
                scrape_counter(server, "kvplan_plan_cache_misses_total")
            )  # an upper bound: the cache keeps at most plan_cache_size of them
        finally:
            exit_code = server.stop()
        if exit_code != 0:
            print(server.log_path.read_text(errors="replace")[-3000:], file=sys.stderr)

    parse_us_end = reference_parse_us(base.SerializeToString())
    ratio_rows = ratios(load)
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            **machine_info(),
            "reference_parse_us_start": parse_us_start,
            "reference_parse_us_end": parse_us_end,
        },
        "engine": {
            "description": f"Qwen3-Next-style hybrid, {NUM_LAYERS} layers (3 Gated DeltaNet : "
            f"1 full attention) + MTP layer, {NUM_WORKERS} TP workers (from {EXAMPLE.name})",
            "request_bytes": base.ByteSize(),
            "response_bytes": plan.ByteSize(),
            "num_blocks": plan.num_blocks,
            "plan_id": plan.plan_id,
        },
        "settings": {
            "rounds": args.rounds,
            "slice_s": args.slice,
            "settle_s": SETTLE_S,
            "uncached_s": args.uncached,
            "concurrency": args.concurrency,
            "client": "raw grpc.aio multicallables, bytes in / bytes out, "
            "one channel (connection) per concurrent caller",
            "server": "kvplan serve (defaults, INFO text logs), its own process",
            "profiled": profile_path is not None,
        },
        "load": [asdict(result) for result in load],
        "ratios": ratio_rows,
        "rendezvous": asdict(rendezvous),
        "cold_start": asdict(cold),
        "rss_mb": {"after_start": rss_start, "after_load": rss_after, "plans_cached": plans_cached},
    }
    report["targets"] = evaluate_targets(ratio_rows, rendezvous, cold, rss_start, rss_after)
    report["total_s"] = time.perf_counter() - began
    markdown = render_markdown(report)
    print()
    print(markdown)
    if profile_path is None:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "rpc.json").write_text(json.dumps(report, indent=1) + "\n")
        (RESULTS / "rpc.md").write_text(markdown)
        print(f"wrote {RESULTS / 'rpc.json'} and {RESULTS / 'rpc.md'} ({report['total_s']:.0f} s)")
    else:
        print_profile(profile_path)
    failed = [target for target in report["targets"] if not target["pass"]]
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
