"""Every answer explained: the issue's repros as regression tests, through a real
server on loopback (bodies that do not parse, unknown enums, 64-bit overflows,
replies over the message limit, unexpected exceptions, limits, logs)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from kvplan.client import AsyncPlannerClient, PlannerError
from kvplan.server.logs import TextFormatter, json_formatter
from kvplan.server.main import RunningServer, start_server
from kvplan.server.store import open_store
from kvplan.v1 import plan_pb2, service_pb2, spec_pb2
from tests.server.conftest import GIB, TEST_SETTINGS, engine_request, full_layer, rank_request
from tests.server.redis_server import running_redis
from tests.server.test_leases import device_uuids, leased_request

SERVICE = "/kvplan.v1.KVCachePlanner/"
METHODS = (
    "PlanKVCache",
    "GetPlan",
    "ListDevices",
    "RenewLeases",
    "ReleasePlan",
    "Echo",
    "ReportMeasurements",
    "GetMeasurements",
)


async def raw_call(port: int, method: str, body: bytes) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(SERVICE + method)
        try:
            await call(body, timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def scrape(server: RunningServer) -> str:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())


async def test_unparseable_bodies_are_invalid_argument_and_counted(server: RunningServer) -> None:
    garbage = b"\xff\xff\xff\xff\x0f"  # a truncated varint: parses as nothing
    for method in METHODS:
        if method == "ListDevices":
            continue  # an empty message: every body of unknown fields parses
        assert await raw_call(server.port, method, garbage) is grpc.StatusCode.INVALID_ARGUMENT
    body = await scrape(server)
    assert (
        'grpc_server_handled_total{grpc_code="INVALID_ARGUMENT",grpc_method="PlanKVCache",'
        'grpc_service="kvplan.v1.KVCachePlanner",grpc_type="unary"} 1.0'
    ) in body


ENUM_FIELDS: dict[str, Callable[[plan_pb2.PlanRequest], None]] = {
    "options.cache_dtype": lambda r: setattr(r.options, "cache_dtype", 999),
    "options.layout": lambda r: setattr(r.options, "layout", 999),
    "options.model_dtype": lambda r: setattr(r.options, "model_dtype", 999),
    "options.mamba_cache_mode": lambda r: setattr(r.options, "mamba_cache_mode", 999),
    "spec_decode.method": lambda r: setattr(r.spec_decode, "method", 999),
    "workers[0].supported_layouts[1]": lambda r: r.workers[0].supported_layouts.extend(
        [plan_pb2.KV_CACHE_LAYOUT_LBHNC, 999]  # type: ignore[list-item]
    ),
    "workers[0].layers[0].full_attention.attention.dtype": lambda r: setattr(
        r.workers[0].layers[0].full_attention.attention, "dtype", 999
    ),
    "workers[0].layers[0].full_attention.attention.kv_quant_mode": lambda r: setattr(
        r.workers[0].layers[0].full_attention.attention, "kv_quant_mode", 999
    ),
}


def mla_request(**mla: int) -> plan_pb2.PlanRequest:
    request = engine_request()
    layer = spec_pb2.LayerSpec(name="mla")
    layer.mla_attention.attention.num_kv_heads = 1
    layer.mla_attention.attention.head_size = 576
    for name, value in mla.items():
        if name == "cache_role":
            layer.mla_attention.cache_role = value  # type: ignore[assignment]
        else:
            setattr(layer.mla_attention.mla, name, value)
    del request.workers[0].layers[:]
    request.workers[0].layers.append(layer)
    return request


def mamba_request(mamba_type: int = 0, state_dtype: int = 2) -> plan_pb2.PlanRequest:
    request = engine_request()
    layer = spec_pb2.LayerSpec(name="mamba")
    layer.mamba.states.add(shape=[16, 64], dtype=state_dtype)
    layer.mamba.mamba_type = mamba_type  # type: ignore[assignment]
    request.workers[0].layers.append(layer)
    return request


async def test_every_unknown_enum_value_names_its_field(client: AsyncPlannerClient) -> None:
    cases = {}
    for path, mutate in ENUM_FIELDS.items():
        request = engine_request()
        mutate(request)
        cases[path] = request
    cases["workers[0].layers[0].mla_attention.mla.cache_dtype"] = mla_request(cache_dtype=999)
    cases["workers[0].layers[0].mla_attention.cache_role"] = mla_request(cache_role=999)
    cases["workers[0].layers[8].mamba.mamba_type"] = mamba_request(mamba_type=999)
    cases["workers[0].layers[8].mamba.states[0].dtype"] = mamba_request(state_dtype=999)
    for path, request in cases.items():
        with pytest.raises(PlannerError) as caught:
            await client.plan(request)
        assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT, path
        assert caught.value.violations[0].field == path
        assert "999" in caught.value.details


async def test_integer_ranges_and_reply_overflows(
    client: AsyncPlannerClient, server: RunningServer
) -> None:
    huge = engine_request()
    huge.workers[0].memory.kv_cache_memory_bytes = 2**64 - 1
    huge.workers[0].memory.non_kv.weights_bytes = GIB
    override = engine_request()
    override.options.num_gpu_blocks_override = 2**50
    # Every number in range, but their product is not: the reply's own check.
    product = engine_request()
    product.options.num_gpu_blocks_override = 2**31
    for layer in product.workers[0].layers:
        layer.full_attention.attention.num_kv_heads = 2**31
        layer.full_attention.attention.head_size = 2**31
    world = rank_request("wide", 0, 2**32 - 1)
    expected = {
        "workers[0].memory.kv_cache_memory_bytes": (huge, grpc.StatusCode.INVALID_ARGUMENT),
        "options.num_gpu_blocks_override": (override, grpc.StatusCode.INVALID_ARGUMENT),
        "options.num_gpu_blocks_override ": (product, grpc.StatusCode.INVALID_ARGUMENT),
        "world_size": (world, grpc.StatusCode.RESOURCE_EXHAUSTED),
    }
    for path, (request, code) in expected.items():
        with pytest.raises(PlannerError) as caught:
            await client.plan(request)
        assert caught.value.code is code, path
        assert caught.value.violations[0].field == path.strip()
    assert server.metrics.unexpected_errors._value.get() == 0


async def test_renew_allocated_bytes_beyond_64_bits_on_sqlite(tmp_path: Path) -> None:
    running = await start_server(
        replace(
            TEST_SETTINGS, devices="1xH100-80GB", store=f"sqlite://{tmp_path / 'kvplan.sqlite3'}"
        )
    )
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuid = (await device_uuids(client))[0]
            await client.plan(leased_request("big-renew", uuid))
            for value in (2**63, 2**64 - 1):
                with pytest.raises(PlannerError) as caught:
                    await client.renew_leases("big-renew", {0: value})
                assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.violations[0].field == "allocations[0].allocated_bytes"
            assert (await client.renew_leases("big-renew", {0: GIB}))[0].allocated_bytes == GIB
    finally:
        await running.stop(0)


async def test_a_rank_with_a_bad_field_is_refused_at_once_with_its_own_path(
    server: RunningServer, client: AsyncPlannerClient
) -> None:
    """Rank mode converts each rank's own request on arrival: a bad field is the
    caller's INVALID_ARGUMENT at once (it waited for the other ranks, then every
    rank heard of it under the merged request's paths)."""
    bad_dtype = rank_request("bad-rank", 1, world_size=2)
    bad_dtype.workers[0].layers[2].full_attention.attention.dtype = 999  # type: ignore[assignment]
    started = asyncio.get_running_loop().time()
    with pytest.raises(PlannerError) as caught:
        await client.plan(bad_dtype, timeout_s=30)
    assert asyncio.get_running_loop().time() - started < 5
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.violations[0].field == "workers[0].layers[2].full_attention.attention.dtype"
    unnamed = rank_request("bad-rank", 0, world_size=2)
    unnamed.workers[0].layers[0].name = ""
    with pytest.raises(PlannerError) as caught:
        await client.plan(unnamed, timeout_s=30)
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.violations[0].field.startswith("workers[0].layers[0]")
    assert await server.store.pending_engines() == 0  # neither rank holds a place


async def test_renew_allocations_must_name_each_held_rank_once() -> None:
    """A rank reported twice is INVALID_ARGUMENT on its entry; a rank the engine holds
    no lease for is FAILED_PRECONDITION listing the held ones (both were dropped or
    overwritten without a word); an allocation past the lease counts as the lease."""
    running = await start_server(replace(TEST_SETTINGS, devices="1xH100-80GB"))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuid = (await device_uuids(client))[0]
            (lease,) = (await client.plan(leased_request("renewed", uuid))).leases
            twice = service_pb2.RenewLeasesRequest(engine_id="renewed")
            twice.allocations.add(rank=0, allocated_bytes=GIB)
            twice.allocations.add(rank=0, allocated_bytes=2 * GIB)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                renew = channel.unary_unary(
                    SERVICE + "RenewLeases",
                    request_serializer=service_pb2.RenewLeasesRequest.SerializeToString,
                    response_deserializer=service_pb2.RenewLeasesResponse.FromString,
                )
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await renew(twice, timeout=5)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            status = rpc_status.from_call(caught.value)
            assert status is not None
            bad_request = error_details_pb2.BadRequest()
            assert any(detail.Unpack(bad_request) for detail in status.details)
            assert bad_request.field_violations[0].field == "allocations[1].rank"
            with pytest.raises(PlannerError) as refused:
                await client.renew_leases("renewed", {0: GIB, 7: GIB})
            assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.violations[0].field == "allocations"
            assert "rank(s) 7 (it holds 0)" in refused.value.details
            (renewed,) = await client.renew_leases("renewed", {0: 2**50})
            assert renewed.allocated_bytes == lease.bytes
    finally:
        await running.stop(0)


async def test_a_reply_over_the_limit_is_refused_before_any_lease() -> None:
    running = await start_server(
        replace(TEST_SETTINGS, devices="1xH100-80GB", max_message_bytes=256 * 1024)
    )
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            uuid = (await device_uuids(client))[0]
            request = leased_request("too-big", uuid, layers=range(600))
            for layer in request.workers[0].layers:
                layer.name = f"model.layers.{layer.name}." + "x" * 200
            with pytest.raises(PlannerError) as caught:
                await client.plan(request)
            assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.metadata["limit"] == "max_message_bytes"
            (device,) = (await client.list_devices()).devices
            assert device.committed_bytes == 0 and device.live_leases == 0
            with pytest.raises(PlannerError) as missing:
                await client.get_plan(engine_id="too-big")
            assert missing.value.code is grpc.StatusCode.NOT_FOUND
    finally:
        await running.stop(0)


async def test_a_reply_over_the_limit_leaves_the_engines_last_plan_in_place() -> None:
    """Without leases too: the refused plan is not kept, not persisted and not the
    engine's plan, which GetPlan still returns (it once returned the refused one,
    which the transport then could not send)."""
    running = await start_server(replace(TEST_SETTINGS, max_message_bytes=256 * 1024))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            good = await client.plan(engine_request("kept", kv_bytes=64 * GIB))
            big = engine_request("kept", kv_bytes=64 * GIB, layers=600)
            for layer in big.workers[0].layers:
                layer.name += "." + "x" * 200
            with pytest.raises(PlannerError) as caught:
                await client.plan(big)
            assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.metadata["limit"] == "max_message_bytes"
            assert (await client.get_plan(engine_id="kept")).plan_id == good.plan_id
            assert await running.store.plan_for_engine("kept") is not None
            stored = plan_pb2.PlanResponse.FromString(
                await running.store.plan_for_engine("kept") or b""
            )
            assert stored.plan_id == good.plan_id
            # Rank mode's engines are planned the same way.
            ranked = rank_request(
                "kept-ranked", 0, world_size=1, layers_per_rank=600, kv_bytes=64 * GIB
            )
            for layer in ranked.workers[0].layers:
                layer.name += "." + "x" * 200
            with pytest.raises(PlannerError) as caught:
                await client.plan(ranked)
            assert caught.value.metadata["limit"] == "max_message_bytes"
            with pytest.raises(PlannerError) as missing:
                await client.get_plan(engine_id="kept-ranked")
            assert missing.value.code is grpc.StatusCode.NOT_FOUND
    finally:
        await running.stop(0)


async def test_an_unexpected_exception_is_logged_and_answered_internal_with_its_id(
    server: RunningServer, client: AsyncPlannerClient, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*args: object) -> object:
        raise ZeroDivisionError("a bug")

    server.servicer.refresh_device_metrics = broken  # type: ignore[method-assign,assignment]
    with (
        caplog.at_level(logging.ERROR, logger="kvplan.server"),
        pytest.raises(PlannerError) as caught,
    ):
        await client.list_devices()
    assert caught.value.code is grpc.StatusCode.INTERNAL
    (record,) = [r for r in caplog.records if r.getMessage() == "unexpected error in a handler"]
    request_id = getattr(record, "request_id", "")
    assert request_id and request_id in caught.value.details
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError
    assert server.metrics.unexpected_errors._value.get() == 1


async def test_identifier_limits(client: AsyncPlannerClient, server: RunningServer) -> None:
    with pytest.raises(PlannerError) as caught:
        await client.plan(engine_request("e" * (server.settings.max_engine_id_chars + 1)))
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.metadata["limit"] == "max_engine_id_chars"
    with pytest.raises(PlannerError) as caught:
        await client.release_plan("x" * 100_000)
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(PlannerError) as caught:
        await client.plan(engine_request('forged\n{"level": "INFO"}'))
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    long_name = engine_request()
    long_name.workers[0].layers.append(full_layer("n" * (server.settings.max_layer_name_chars + 1)))
    with pytest.raises(PlannerError) as caught:
        await client.plan(long_name)
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.violations[0].field == "workers[0].layers[8].name"
    # Each worker's list is read once however many ranks share it; a later worker
    # with a list of its own is still read.
    long_later = engine_request(stages=2)
    long_later.workers.add().CopyFrom(long_later.workers[0])
    long_later.workers[2].rank = 2
    long_later.workers[1].layers[2].name = "n" * (server.settings.max_layer_name_chars + 1)
    with pytest.raises(PlannerError) as caught:
        await client.plan(long_later)
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.violations[0].field == "workers[1].layers[2].name"


async def test_strings_that_errors_repeat_are_bounded(
    client: AsyncPlannerClient, server: RunningServer
) -> None:
    """Strings an error message (or a remembered rendezvous failure) repeats: each
    over --max-identifier-chars is refused naming its field, rather than answered
    with a status too big for gRPC's trailers ("Stream removed")."""
    too_long = "v" * 100_000
    cases: dict[str, plan_pb2.PlanRequest] = {}
    version = engine_request("long-version")
    version.options.engine_version = too_long
    cases["options.engine_version"] = version
    model_type = engine_request("long-model-type")
    model_type.spec_decode.target_model_type = too_long
    cases["spec_decode.target_model_type"] = model_type
    for part in ("uuid", "name"):
        device = engine_request(f"long-device-{part}", stages=2)
        setattr(device.workers[1].device, part, too_long)
        cases[f"workers[1].device.{part}"] = device
    rank = rank_request("long-version-rank", 0, 2)
    rank.options.engine_version = too_long
    cases["options.engine_version (a rank)"] = rank
    for field, request in cases.items():
        with pytest.raises(PlannerError) as caught:
            await client.plan(request)
        assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED, field
        assert caught.value.metadata["limit"] == "max_identifier_chars", field
        assert caught.value.violations[0].field == field.removesuffix(" (a rank)")
        assert "100000 exceeds the server's limit of 256" in caught.value.details
    # At the limit, the field is planned (or refused for what it says, not its length).
    at_limit = engine_request("version-at-limit")
    at_limit.options.engine_version = "v" * server.settings.max_identifier_chars
    with pytest.raises(PlannerError) as caught:
        await client.plan(at_limit)
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.violations[0].field == "options.engine_version"


def test_log_lines_cannot_be_forged() -> None:
    record = logging.LogRecord("kvplan.server", logging.INFO, __file__, 1, "plan", None, None)
    forged = 'evil\n2026 INFO kvplan.server "forged"'
    record.__dict__["engine_id"] = forged
    text = TextFormatter().format(record)
    assert "\n" not in text and 'engine_id="evil\\n2026' in text
    line = json_formatter().format(record)
    assert "\n" not in line
    assert json.loads(line)["engine_id"] == forged
    assert json.loads(line)["message"] == "plan"


async def test_pending_rendezvous_bounded_by_bytes() -> None:
    running = await start_server(replace(TEST_SETTINGS, max_pending_rendezvous_bytes=64 * 1024))
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            first = asyncio.ensure_future(
                client.plan(rank_request("big", 0, 2, 200, kv_bytes=16 * GIB))
            )
            await asyncio.sleep(0.2)
            with pytest.raises(PlannerError) as caught:
                await client.plan(rank_request("bigger", 0, 2, 2000))
            assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.metadata["limit"] == "max_pending_rendezvous_bytes"
            await client.plan(
                rank_request("big", 1, 2, 200, kv_bytes=16 * GIB)
            )  # the first engine completes
            await first
    finally:
        await running.stop(0)


async def test_a_late_rank_gets_the_failed_plans_error(client: AsyncPlannerClient) -> None:
    def failing(rank: int) -> plan_pb2.PlanRequest:
        return rank_request("doomed", rank, 2, kv_bytes=1 << 20)  # too little memory

    results = await asyncio.gather(
        *(client.plan(failing(rank)) for rank in range(2)), return_exceptions=True
    )
    assert all(isinstance(r, PlannerError) for r in results)
    started = asyncio.get_running_loop().time()
    with pytest.raises(PlannerError) as caught:
        await client.plan(failing(1), timeout_s=5)  # a retry alone: answered at once
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert asyncio.get_running_loop().time() - started < 2
    # A changed spec is a new rendezvous, not the remembered failure.
    waiting = asyncio.ensure_future(client.plan(rank_request("doomed", 0, 2), timeout_s=5))
    await client.plan(rank_request("doomed", 1, 2))
    await waiting


async def test_the_server_says_which_ranks_are_missing(client: AsyncPlannerClient) -> None:
    with pytest.raises(PlannerError) as caught:
        await client.plan(rank_request("partial", 1, 4), timeout_s=2)
    error = caught.value
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.metadata["arrived_ranks"] == "1"
    assert error.metadata["missing_ranks"] == "0,2-3"


async def test_health_is_not_serving_while_the_store_is_unreachable(tmp_path: Path) -> None:
    with running_redis(tmp_path, appendonly=True) as redis_server:
        settings = replace(TEST_SETTINGS, store=redis_server.url, health_interval_s=0.1)
        running = await start_server(settings)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)

                async def status() -> int:
                    request = health_pb2.HealthCheckRequest(service="kvplan.v1.KVCachePlanner")
                    return int((await health.Check(request, timeout=5)).status)

                async def becomes(wanted: int) -> None:
                    for _ in range(100):
                        if await status() == wanted:
                            return
                        await asyncio.sleep(0.1)
                    raise AssertionError(f"health never became {wanted}")

                assert await status() == health_pb2.HealthCheckResponse.SERVING
                await asyncio.to_thread(redis_server.stop)
                await becomes(health_pb2.HealthCheckResponse.NOT_SERVING)
                assert running.metrics.store_up._value.get() == 0  # the dashboard's health
                overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert overall.status == health_pb2.HealthCheckResponse.SERVING  # liveness
                await asyncio.to_thread(redis_server.start)
                await becomes(health_pb2.HealthCheckResponse.SERVING)
                assert running.metrics.store_up._value.get() == 1
        finally:
            await running.stop(0)


async def test_redis_without_persistence_is_refused_unless_allowed(tmp_path: Path) -> None:
    with running_redis(tmp_path, appendonly=False) as redis_server:
        store = open_store(redis_server.url, str(tmp_path))
        with pytest.raises(ValueError, match="appendonly"):
            await store.start()
        allowed = open_store(redis_server.url, str(tmp_path), redis_allow_no_persistence=True)
        await allowed.start()
        await allowed.close()


async def test_a_fault_while_planning_a_rendezvous_reaches_every_rank(
    server: RunningServer, client: AsyncPlannerClient, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*args: object, **kwargs: object) -> bytes:
        raise KeyError("a bug")

    # Only the merged engine is planned (each rank is checked and waits).
    server.servicer._plan = broken  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.ERROR, logger="kvplan.server"):
        results = await asyncio.gather(
            *(client.plan(rank_request("faulty", rank, 2), timeout_s=5) for rank in range(2)),
            return_exceptions=True,
        )
    assert all(
        isinstance(r, PlannerError) and r.code is grpc.StatusCode.INTERNAL for r in results
    ), results
    (record,) = [
        r for r in caplog.records if r.getMessage() == "unexpected error planning a rendezvous"
    ]
    assert getattr(record, "request_id", "") in str(results[0])
