"""The fleet's measurements: the bounded record in every store, and
ReportMeasurements / GetMeasurements through a real server and client."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import pytest

from kvplan.cli import main
from kvplan.client import AsyncPlannerClient, ChannelSecurity, PlannerError
from kvplan.client.fleet import config_key, fleet_figures, model_config_hash
from kvplan.models import load_config
from kvplan.server.main import RunningServer, start_server
from kvplan.v1 import service_pb2
from tests.server.conftest import GIB, TEST_SETTINGS
from tests.server.redis_server import RedisServer, running_redis
from tests.server.test_fuzz import ALLOWED, SERVICE, random_message
from tests.server.test_security import TOKEN_A, TOKEN_B, TOKEN_OPS, write_tokens
from tests.server.test_store_contract import OpenStore

pytest_plugins = ["tests.server.test_store_contract"]  # its open_store / redis_server fixtures

MODELS = Path(__file__).parents[2] / "examples" / "models"
HASH = model_config_hash({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32})


def fingerprint(tp: int = 1, **fields: object) -> service_pb2.ConfigFingerprint:
    values: dict[str, object] = {
        "model_config_hash": HASH,
        "engine_version": "vllm-0.33",
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": 1,
        "dtype": "bfloat16",
        "kv_cache_dtype": "auto",
        "max_num_batched_tokens": 8192,
        "cuda_graphs": "FULL_AND_PIECEWISE",
    }
    values.update(fields)
    return service_pb2.ConfigFingerprint(**values)  # type: ignore[arg-type]


def report(
    engine_id: str, kv: list[int], tp: int | None = None, **fields: object
) -> service_pb2.ReportMeasurementsRequest:
    request = service_pb2.ReportMeasurementsRequest(
        engine_id=engine_id,
        fingerprint=fingerprint(tp or len(kv), **fields),
        release="0.33.0",
    )
    for rank, available in enumerate(kv):
        worker = request.workers.add(
            rank=rank, available_kv_bytes=available, total_bytes=80 * GIB, requested_bytes=72 * GIB
        )
        worker.weights_bytes = 15 * GIB
        worker.activation_peak_bytes = 2 * GIB
        worker.cuda_graph_bytes = GIB // 2
    return request


# --- every store ---------------------------------------------------------------------------


async def test_a_store_keeps_a_bounded_record_per_configuration(open_store: OpenStore) -> None:
    store = await open_store()
    assert await store.measurements("cfg-a") == ()
    for index in range(5):
        kept = await store.put_measurement(
            "cfg-a", f"e{index}", b"r%d" % index, 1000.0 + index, max_configs=2, max_engines=3
        )
        assert kept == min(index + 1, 3)
    assert await store.measurements("cfg-a") == (b"r4", b"r3", b"r2")  # newest first
    # An engine's new report replaces its old one and becomes the newest.
    assert await store.put_measurement("cfg-a", "e3", b"r3'", 1, max_configs=2, max_engines=3) == 3
    assert await store.measurements("cfg-a") == (b"r3'", b"r4", b"r2")
    # Configurations: the least recently reported one goes past the bound.
    await store.put_measurement("cfg-b", "e0", b"b", 2000.0, max_configs=2, max_engines=3)
    await store.put_measurement("cfg-a", "e9", b"a9", 2001.0, max_configs=2, max_engines=3)
    await store.put_measurement("cfg-c", "e0", b"c", 2002.0, max_configs=2, max_engines=3)
    assert await store.measurements("cfg-b") == ()
    assert await store.measurements("cfg-a") == (b"a9", b"r3'", b"r4")
    assert await store.measurements("cfg-c") == (b"c",)


async def test_sqlite_keeps_measurements_across_a_restart(tmp_path: Path) -> None:
    from kvplan.server.store.sqlite import SQLiteStore

    path = str(tmp_path / "state.sqlite3")
    first = SQLiteStore(path)
    await first.start()
    await first.put_measurement("cfg-a", "e0", b"kept", 1.0)
    await first.close()
    second = SQLiteStore(path)
    await second.start()
    assert await second.measurements("cfg-a") == (b"kept",)
    await second.close()


# --- through a real server and client --------------------------------------------------------


@pytest.fixture(scope="module")
def redis_for_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis-fleet")) as server:
        yield server


@pytest.mark.parametrize("backend", ["memory", "sqlite", "redis"])
async def test_engines_report_and_the_fleet_answers(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store = {
        "memory": "memory",
        "sqlite": f"sqlite:///{tmp_path / 'state.sqlite3'}",
        "redis": request.getfixturevalue("redis_for_servers").url if backend == "redis" else "",
    }[backend]
    running = await start_server(
        replace(
            TEST_SETTINGS,
            store=store,
            max_measurements_per_config=2,
            redis_allow_no_persistence=True,
        )
    )
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            first = await client.report_measurements(report("a", [60 * GIB, 59 * GIB]))
            assert first.engines == 1
            assert first.config_key == config_key(fingerprint(2))
            await client.report_measurements(report("b", [61 * GIB, 61 * GIB]))
            other = await client.report_measurements(report("c", [40 * GIB]))  # TP 1
            assert other.engines == 1 and other.config_key != first.config_key
            # A third engine of the configuration: the oldest report is dropped.
            await client.report_measurements(
                report("d", [62 * GIB, 63 * GIB], max_num_batched_tokens=4096)
            )
            # Asked as a person would: an alias, any runtime.
            answer = await client.get_measurements(
                fingerprint(2, gpu_name="H100", max_num_batched_tokens=0, cuda_graphs="")
            )
            assert [engine.engine_id for engine in answer.engines] == ["d", "b"]
            figures = fleet_figures(answer.engines)
            assert figures is not None and figures.engines == 2
            assert figures.min_available_kv_bytes == 61 * GIB
            assert figures.weights_bytes == 15 * GIB
            assert figures.max_non_kv_bytes == 72 * GIB - 61 * GIB
            # The runtime fields, where given, select.
            only = await client.get_measurements(fingerprint(2, cuda_graphs=""))
            assert [engine.engine_id for engine in only.engines] == ["b"]
            none = await client.get_measurements(fingerprint(4))
            assert none.engines == [] and none.config_key
        reported = running.metrics.measurements_reported._value.get()
        assert reported == 4
    finally:
        await running.stop(0)


async def test_bad_reports_get_precise_statuses() -> None:
    running = await start_server(replace(TEST_SETTINGS, max_workers_per_engine=8))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            cases: list[tuple[service_pb2.ReportMeasurementsRequest, str, str]] = []
            no_id = report("a", [GIB])
            no_id.engine_id = ""
            cases.append((no_id, "INVALID_ARGUMENT", "engine_id"))
            no_fingerprint = report("a", [GIB])
            no_fingerprint.ClearField("fingerprint")
            cases.append((no_fingerprint, "INVALID_ARGUMENT", "fingerprint"))
            cases.append(
                (report("a", [GIB], model_config_hash="llama"), "INVALID_ARGUMENT",
                 "fingerprint.model_config_hash")
            )  # fmt: skip
            cases.append(
                (report("a", [GIB], engine_version="vllm-0.99"), "INVALID_ARGUMENT",
                 "fingerprint.engine_version")
            )  # fmt: skip
            cases.append((report("a", [GIB], dtype=""), "INVALID_ARGUMENT", "fingerprint.dtype"))
            cases.append(
                (report("a", [GIB], gpu_name="x" * 300), "RESOURCE_EXHAUSTED",
                 "fingerprint.gpu_name")
            )  # fmt: skip
            cases.append(
                (report("a", [GIB], limit_mm_per_prompt="{" * 300), "RESOURCE_EXHAUSTED",
                 "fingerprint.limit_mm_per_prompt")
            )  # fmt: skip
            cases.append((report("a", [GIB], tp=2), "INVALID_ARGUMENT", "workers"))
            cases.append((report("a", [GIB] * 16), "RESOURCE_EXHAUSTED",
                          "fingerprint.tensor_parallel_size"))  # fmt: skip
            repeated = report("a", [GIB, GIB])
            repeated.workers[1].rank = 0
            cases.append((repeated, "INVALID_ARGUMENT", "workers[1].rank"))
            too_much = report("a", [73 * GIB])
            cases.append((too_much, "INVALID_ARGUMENT", "workers[0].available_kv_bytes"))
            no_request = report("a", [GIB])
            no_request.workers[0].requested_bytes = 0
            cases.append((no_request, "INVALID_ARGUMENT", "workers[0].requested_bytes"))
            no_total = report("a", [GIB])
            no_total.workers[0].total_bytes = 0
            cases.append((no_total, "INVALID_ARGUMENT", "workers[0].total_bytes"))
            heavy = report("a", [GIB])
            heavy.workers[0].weights_bytes = 81 * GIB
            cases.append((heavy, "INVALID_ARGUMENT", "workers[0].weights_bytes"))
            for bad, code, field in cases:
                with pytest.raises(PlannerError) as caught:
                    await client.report_measurements(bad)
                assert caught.value.code_name == code, (field, caught.value)
                assert [v.field for v in caught.value.violations] == [field], caught.value
            with pytest.raises(PlannerError) as caught:
                await client.get_measurements(fingerprint(1, tensor_parallel_size=0))
            assert caught.value.code_name == "INVALID_ARGUMENT"
            assert "tensor_parallel_size" in str(caught.value)
    finally:
        await running.stop(0)


async def test_reports_are_authorized_per_engine(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a", f"{TOKEN_B} team-b", f"{TOKEN_OPS} ops operator")
    running = await start_server(replace(TEST_SETTINGS, token_file=str(tokens)))
    target = f"127.0.0.1:{running.port}"
    try:
        async with (
            AsyncPlannerClient(target, security=ChannelSecurity(token=TOKEN_A)) as team_a,
            AsyncPlannerClient(target, security=ChannelSecurity(token=TOKEN_B)) as team_b,
            AsyncPlannerClient(target, security=ChannelSecurity(token=TOKEN_OPS)) as ops,
        ):
            await team_a.report_measurements(report("chat", [60 * GIB]))
            with pytest.raises(PlannerError) as caught:
                await team_b.report_measurements(report("chat", [1 * GIB]))
            assert caught.value.code_name == "PERMISSION_DENIED"
            await team_b.report_measurements(report("code", [50 * GIB]))
            # Every identity reads the figures; engine ids only an operator.
            seen_by_b = await team_b.get_measurements(fingerprint(1))
            assert [e.engine_id for e in seen_by_b.engines] == ["", ""]
            assert [e.workers[0].available_kv_bytes for e in seen_by_b.engines] == [
                50 * GIB,
                60 * GIB,
            ]
            seen_by_ops = await ops.get_measurements(fingerprint(1))
            assert [e.engine_id for e in seen_by_ops.engines] == ["code", "chat"]
    finally:
        await running.stop(0)


# --- `kvplan plan --model` with the fleet --------------------------------------------------


async def test_plan_model_answers_measured_or_estimated(
    server: RunningServer, client: AsyncPlannerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    model = MODELS / "llama-3.1-8b"
    args = ["plan", "--model", str(model), "--gpu", "H100", "--max-model-len", "8k"]
    args += ["--gpu-memory-utilization", "0.9"]  # the engine's: requested = ceil(total x 0.9)
    remote = [*args, "--target", f"127.0.0.1:{server.port}"]
    assert await asyncio.to_thread(main, [*remote, "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert estimated["memory_source"]["source"] == "estimated"
    assert "no engine of this configuration" in estimated["memory_source"]["reason"]
    # Without --target nobody is asked, and the line says so.
    assert await asyncio.to_thread(main, args) == 0
    assert "memory per worker: estimated (no fleet asked: --target" in capsys.readouterr().out

    # An engine of this configuration reports (as the plugin does, CUDA's GPU name).
    total = 84_987_740_160  # what CUDA reported, below the catalog's figure
    requested = math.ceil(total * 0.9)
    available = requested - 17 * GIB
    measured = service_pb2.ReportMeasurementsRequest(
        engine_id="llama-1",
        release="0.34.0",
        fingerprint=service_pb2.ConfigFingerprint(
            model_config_hash=model_config_hash(load_config(str(model)).data),
            engine_version="vllm-0.34",
            gpu_name="NVIDIA H100 80GB HBM3",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            dtype="bfloat16",
            kv_cache_dtype="auto",
            max_num_batched_tokens=8192,
            cuda_graphs="FULL_AND_PIECEWISE:512",
        ),
    )
    measured.workers.add(
        rank=0, available_kv_bytes=available, total_bytes=total, requested_bytes=requested
    )
    await client.report_measurements(measured)

    assert await asyncio.to_thread(main, [*remote, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    source = answer["memory_source"]
    assert source["source"] == "measured" and source["engines"] == 1
    assert source["engine_version"] == "vllm-0.34"
    assert (source["non_kv_bytes"], source["total_bytes"]) == (17 * GIB, total)
    # Planned with the measured figures: the KV budget is what the engine measured.
    assert answer["capacity"]["available_kv_bytes"] == available
    assert answer["capacity"]["available_kv_bytes"] != estimated["capacity"]["available_kv_bytes"]
    assert await asyncio.to_thread(main, remote) == 0
    text = capsys.readouterr().out
    assert "memory per worker: measured on 1 engine: available KV" in text
    # Another TP is another configuration: estimated.
    assert await asyncio.to_thread(main, [*remote, "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_source"]["source"] == "estimated"


async def test_capacity_marks_each_row_measured_or_estimated(
    server: RunningServer, client: AsyncPlannerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    model = MODELS / "llama-3.1-8b"
    args = ["capacity", "--model", str(model), "--gpu", "H100,H200", "--tp", "1,2"]
    args += ["--max-model-len", "8k", "--gpu-memory-utilization", "0.9"]
    args += ["--target", f"127.0.0.1:{server.port}"]
    total = 84_987_740_160
    requested = math.ceil(total * 0.9)
    measured = service_pb2.ReportMeasurementsRequest(
        engine_id="llama-tp2",
        fingerprint=service_pb2.ConfigFingerprint(
            model_config_hash=model_config_hash(load_config(str(model)).data),
            engine_version="vllm-0.33",
            gpu_name="NVIDIA H100 80GB HBM3",
            tensor_parallel_size=2,
            pipeline_parallel_size=1,
            dtype="bfloat16",
        ),
    )
    for rank in range(2):
        measured.workers.add(
            rank=rank,
            available_kv_bytes=requested - 10 * GIB - rank * GIB,
            total_bytes=total,
            requested_bytes=requested,
        )
    await client.report_measurements(measured)
    assert await asyncio.to_thread(main, [*args, "--json"]) == 0
    rows = {(row["gpu"], row["tp"]): row for row in json.loads(capsys.readouterr().out)}
    assert rows["H100-80GB", 2]["memory"] == "measured on 1 engine"
    # The larger of the two ranks' non-KV memory: the budget every rank can hold.
    assert rows["H100-80GB", 2]["non_kv_bytes_per_worker"] == 11 * GIB
    assert rows["H100-80GB", 2]["kv_budget_bytes"] == requested - 11 * GIB
    for other in (("H100-80GB", 1), ("H200-141GB", 1), ("H200-141GB", 2)):
        assert rows[other]["memory"] == "estimated", other
    assert await asyncio.to_thread(main, args) == 0
    table = capsys.readouterr().out
    assert "measured on 1 engine" in table.splitlines()[2] and table.splitlines()[0].endswith(
        "memory"
    )


async def test_fuzzed_measurement_calls_get_explained_answers() -> None:
    # Random messages of both types, and mutated valid ones: every answer is a
    # status a caller can act on, never UNKNOWN / INTERNAL.
    rng = random.Random(29)
    running = await start_server(TEST_SETTINGS)
    codes: set[str] = set()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            calls = {
                name: channel.unary_unary(SERVICE + name)
                for name in ("ReportMeasurements", "GetMeasurements")
            }
            valid = report("fz", [GIB, GIB]).SerializeToString()
            for index in range(400):
                method = "ReportMeasurements" if index % 2 else "GetMeasurements"
                if index % 4 == 1:
                    body = bytearray(valid)
                    body[rng.randrange(len(body))] = rng.randrange(256)
                    message = bytes(body)
                else:
                    kind = (
                        service_pb2.ReportMeasurementsRequest
                        if method == "ReportMeasurements"
                        else service_pb2.GetMeasurementsRequest
                    )
                    message = random_message(kind, rng, ["GPU-0"]).SerializeToString()
                try:
                    await calls[method](message, timeout=10)
                    codes.add("OK")
                except grpc.aio.AioRpcError as error:
                    assert error.code() in ALLOWED, (method, error.code(), error.details())
                    codes.add(error.code().name)
    finally:
        await running.stop(0)
    assert running.metrics.unexpected_errors._value.get() == 0
    assert {"OK", "INVALID_ARGUMENT"} <= codes, codes


async def test_replicas_on_one_redis_share_the_record(redis_for_servers: RedisServer) -> None:
    settings = replace(TEST_SETTINGS, store=redis_for_servers.url, redis_allow_no_persistence=True)
    first, second = await start_server(settings), await start_server(settings)
    try:
        async with (
            AsyncPlannerClient(f"127.0.0.1:{first.port}", timeout_s=10) as one,
            AsyncPlannerClient(f"127.0.0.1:{second.port}", timeout_s=10) as other,
        ):
            await one.report_measurements(report("replica-a", [30 * GIB], model="shared"))
            await other.report_measurements(report("replica-b", [31 * GIB], model="shared"))
            for client in (one, other):
                answer = await client.get_measurements(fingerprint(1))
                assert {e.engine_id for e in answer.engines} >= {"replica-a", "replica-b"}
    finally:
        await first.stop(0)
        await second.stop(0)
