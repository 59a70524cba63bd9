"""How long one very large request holds every other call.

    python -m bench.large_request [--quick] [--repeats N]

One `kvplan serve` on the default store. Another process sends a PlanKVCache of
tensor-parallel workers of 8,192 layers each, as many as fit in 56 MB (under the
server's 64 MiB message limit; max_model_len 4,096: planned), while this one
calls Echo (empty payload) back to back on its own channel; the same for as long
just after is the control. The figure is the worst Echo during the large call
less the worst of the control: what a caller of any other RPC (a lease renewal,
a health check) waits because of it. Informational: no target of issue 11 names it.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc.aio

from bench.common import (
    ECHO_METHOD,
    PLAN_METHOD,
    Spread,
    bench_parser,
    new_report,
    repeats_of,
    spawn_server,
    write_results,
)
from bench.engines import qwen3_next_tp8
from bench.options import parse_arguments
from kvplan.v1 import plan_pb2

REQUEST_BYTES = 56 * 1000 * 1000  # under the server's 64 MiB message limit
QUICK_REQUEST_BYTES = 3 * 1000 * 1000
LAYERS = 8192  # per worker: --max-layers-per-worker
QUICK_LAYERS = 4096

SENDER = """
import sys, time, grpc
data = open(sys.argv[2], "rb").read()
limits = [("grpc.max_send_message_length", 1 << 27), ("grpc.max_receive_message_length", 1 << 27)]
with grpc.insecure_channel(sys.argv[1], options=limits) as channel:
    start = time.perf_counter()
    channel.unary_unary(sys.argv[3])(data, timeout=600)
    print(time.perf_counter() - start)
"""


def large_request(size: int, layers: int) -> bytes:
    """The Qwen3-Next-like engine's first worker's layers, repeated to `layers`
    (names made distinct), on as many tensor-parallel ranks as fit in `size` bytes."""
    request = qwen3_next_tp8()
    template = list(request.workers[0].layers)
    worker = plan_pb2.WorkerSpec()
    worker.CopyFrom(request.workers[0])
    del worker.layers[:]
    for index in range(layers):
        layer = worker.layers.add()
        layer.CopyFrom(template[index % len(template)])
        layer.name = f"model.layers.{index}.{layer.name.rsplit('.', 1)[-1]}"
    del request.workers[:]
    for rank in range(size // (worker.ByteSize() + 8)):
        request.workers.add().CopyFrom(worker)
        request.workers[-1].rank = rank
    request.engine_id = "large-request"
    request.options.max_model_len = 4096
    return request.SerializeToString()


async def echo_worst(channel: grpc.aio.Channel, until: asyncio.Future[Any] | float) -> float:
    """Echo back to back until `until` (a deadline, or a future that ends): the
    worst latency in seconds."""
    call = channel.unary_unary(ECHO_METHOD)
    worst = 0.0
    while not (until.done() if isinstance(until, asyncio.Future) else time.perf_counter() > until):
        start = time.perf_counter()
        await call(b"", timeout=600)
        worst = max(worst, time.perf_counter() - start)
    return worst


async def one_run(target: str, path: Path) -> dict[str, float]:
    async with grpc.aio.insecure_channel(target) as channel:
        await channel.channel_ready()
        started = time.perf_counter()
        sender = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SENDER,
            target,
            str(path),
            PLAN_METHOD,
            stdout=asyncio.subprocess.PIPE,
        )
        output = asyncio.ensure_future(sender.communicate())
        during = await echo_worst(channel, output)
        stdout, _ = await output
        if sender.returncode != 0:
            raise RuntimeError(f"the large request failed (exit {sender.returncode})")
        large_s = float(stdout)
        control = await echo_worst(channel, time.perf_counter() + (time.perf_counter() - started))
    return {"large_s": large_s, "worst_during_ms": during * 1e3, "worst_control_ms": control * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    args = parse_arguments(parser, argv)
    size, layers = (QUICK_REQUEST_BYTES, QUICK_LAYERS) if args.quick else (REQUEST_BYTES, LAYERS)
    data = large_request(size, layers)
    workers = len(plan_pb2.PlanRequest.FromString(data).workers)
    report = new_report("large_request", args, {"workers": workers, "layers": layers})
    report["title"] = "A very large request vs every other call"
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvplan-bench-large-") as folder:
        path = Path(folder) / "request.bin"
        path.write_bytes(data)
        server = spawn_server(Path(folder), "large")
        try:
            for repeat in range(repeats_of(args)):
                run = asyncio.run(one_run(server.target, path))
                print(
                    f"  repeat {repeat + 1}: planned in {run['large_s']:.2f} s; worst Echo "
                    f"{run['worst_during_ms']:.1f} ms during, {run['worst_control_ms']:.1f} ms "
                    "after",
                    flush=True,
                )
                runs.append(run)
        finally:
            server.stop()
    figures = {name: Spread.of([run[name] for run in runs]) for name in runs[0]}
    added = Spread.of([run["worst_during_ms"] - run["worst_control_ms"] for run in runs])
    report["request_bytes"] = len(data)
    report["figures"] = {name: spread.as_dict() for name, spread in figures.items()}
    report["added_ms"] = added.as_dict()
    report["targets"] = []
    lines = [
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        f"Request: {workers} workers x {layers:,} layers, {len(data) / 1e6:.1f} MB; "
        f"{len(runs)} repeats, median (min-max).",
        "",
        "| planned in s | worst Echo during, ms | worst Echo, control, ms | added ms |",
        "|---:|---:|---:|---:|",
        f"| {figures['large_s'].text()} | {figures['worst_during_ms'].text('.1f')} | "
        f"{figures['worst_control_ms'].text('.1f')} | {added.text('.1f')} |",
    ]
    write_results(args.results, "large_request", report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
