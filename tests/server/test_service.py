"""The service through a real server on loopback and the real client."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvplan.client import AsyncPlannerClient, PlannerClient, PlannerError
from kvplan.convert import plan_from_proto
from kvplan.server.main import RunningServer
from kvplan.v1 import plan_pb2
from tests.server.conftest import GIB, engine_request, full_layer, rank_request


async def test_engine_mode_and_cache(client: AsyncPlannerClient, server: RunningServer) -> None:
    first = await client.plan(engine_request(stages=2, layers=8))
    assert first.num_blocks == GIB // (4 * 65_536)
    assert first.group_of("model.layers.5.attn") == 0
    assert first.worker(1).num_blocks == first.num_blocks
    again = await client.plan(engine_request(stages=2, layers=8))
    assert again.plan_id == first.plan_id
    assert server.metrics.cache_hits._value.get() == 1
    assert server.metrics.cache_misses._value.get() == 1
    by_id = await client.get_plan(plan_id=first.plan_id)
    assert by_id.response == first.response
    by_rank = await client.get_plan(engine_id="engine-a", rank=1)
    assert [w.rank for w in by_rank.response.workers] == [1]


async def test_another_engine_of_one_model_reuses_its_plan(
    client: AsyncPlannerClient, server: RunningServer
) -> None:
    """A new engine whose request is another's but for the engine id gets, byte for
    byte, the plan planning would give it, without planning; in engine and rank mode."""
    await client.plan(engine_request("engine-a", stages=2))
    second = await client.plan(engine_request("engine-b", stages=2))
    assert server.metrics.cache_misses._value.get() == 1
    assert server.metrics.plans_reused._value.get() == 1
    expected = plan_from_proto(engine_request("engine-b", stages=2))
    assert second.response == expected
    assert (await client.get_plan(engine_id="engine-b")).response == expected
    assert (await client.get_plan(plan_id=expected.plan_id)).response == expected
    assert (await client.get_plan(engine_id="engine-a")).response.engine_id == "engine-a"

    other = await client.plan(engine_request("engine-c", stages=2, kv_bytes=2 * GIB))
    assert other.num_blocks == 2 * second.num_blocks  # other content: planned
    assert server.metrics.cache_misses._value.get() == 2

    for engine_id in ("ranked-a", "ranked-b"):
        ranks = await asyncio.gather(
            *(client.plan(rank_request(engine_id, rank, world_size=2)) for rank in range(2))
        )
        assert {plan.engine_id for plan in ranks} == {engine_id}
    # Two ranks merged are engine-a's request under another id: reused as well.
    assert server.metrics.cache_misses._value.get() == 2
    assert server.metrics.plans_reused._value.get() == 3
    merged = engine_request("ranked-b", stages=2)
    assert (await client.get_plan(engine_id="ranked-b")).response == plan_from_proto(merged)


async def test_another_engine_of_a_known_model_is_only_budgeted(
    client: AsyncPlannerClient, server: RunningServer
) -> None:
    """Engines of one model with other memory are planned from the kept model plan:
    the plan planning from scratch gives, in engine and rank mode."""
    await client.plan(engine_request("engine-a", stages=2))
    assert server.metrics.model_plans_reused._value.get() == 0
    bigger = await client.plan(engine_request("engine-b", stages=2, kv_bytes=3 * GIB))
    assert server.metrics.model_plans_reused._value.get() == 1
    assert server.metrics.plans_reused._value.get() == 0  # other content: planned
    assert bigger.response == plan_from_proto(
        engine_request("engine-b", stages=2, kv_bytes=3 * GIB)
    )
    with pytest.raises(PlannerError) as caught:  # a known model, too little memory
        await client.plan(engine_request("engine-c", stages=2, kv_bytes=1 << 20))
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.metrics.model_plans_reused._value.get() == 2

    ranks = [rank_request("ranked", rank, world_size=2, kv_bytes=2 * GIB) for rank in range(2)]
    await asyncio.gather(*(client.plan(rank) for rank in ranks))
    assert server.metrics.model_plans_reused._value.get() == 3
    merged = engine_request("ranked", stages=2, kv_bytes=2 * GIB)
    assert (await client.get_plan(engine_id="ranked")).response == plan_from_proto(merged)


async def test_invalid_argument_has_field_violations(client: AsyncPlannerClient) -> None:
    request = engine_request()
    request.workers[0].layers[0].full_attention.attention.num_kv_heads = 0
    with pytest.raises(PlannerError) as caught:
        await client.plan(request)
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.violations[0].field == (
        "workers[0].layers[0].full_attention.attention.num_kv_heads"
    )


async def test_resource_exhausted_carries_numbers(client: AsyncPlannerClient) -> None:
    with pytest.raises(PlannerError) as caught:
        await client.plan(engine_request(kv_bytes=1 << 20))
    error = caught.value
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "GiB" in error.details
    assert int(error.metadata["needed_bytes"]) > int(error.metadata["available_bytes"])


async def test_failed_precondition(client: AsyncPlannerClient) -> None:
    request = engine_request()
    request.options.layout = plan_pb2.KV_CACHE_LAYOUT_LHBNC
    request.workers[0].layers.append(full_layer("small", heads=4))
    with pytest.raises(PlannerError) as caught:
        await client.plan(request)
    assert caught.value.code is grpc.StatusCode.FAILED_PRECONDITION


async def test_not_found(client: AsyncPlannerClient) -> None:
    with pytest.raises(PlannerError) as caught:
        await client.get_plan(plan_id="plan-missing")
    assert caught.value.code is grpc.StatusCode.NOT_FOUND
    with pytest.raises(PlannerError) as caught:
        await client.get_plan()
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT


async def test_limits(server: RunningServer, client: AsyncPlannerClient) -> None:
    request = engine_request(layers=server.settings.max_layers_per_worker + 1)
    with pytest.raises(PlannerError) as caught:
        await client.plan(request)
    # A server limit: RESOURCE_EXHAUSTED naming its flag, the numbers and the field.
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.violations[0].field == "workers[0].layers"
    assert caught.value.metadata["limit"] == "max_layers_per_worker"
    assert "--max-layers-per-worker" in caught.value.details


async def test_rank_mode_same_plan_for_all(client: AsyncPlannerClient) -> None:
    results = await asyncio.gather(
        *(client.plan(rank_request("engine-r", rank, 4)) for rank in range(4))
    )
    assert len({r.plan_id for r in results}) == 1
    assert {r.num_blocks for r in results} == {GIB // (4 * 65_536)}
    late = await client.plan(rank_request("engine-r", 2, 4))
    assert late.plan_id == results[0].plan_id
    with pytest.raises(PlannerError) as caught:
        await client.plan(rank_request("engine-r", 2, 4, kv_bytes=2 * GIB))
    assert caught.value.code is grpc.StatusCode.FAILED_PRECONDITION
    fetched = await client.get_plan(engine_id="engine-r", rank=3)
    assert fetched.plan_id == results[0].plan_id


async def test_rank_mode_errors(client: AsyncPlannerClient) -> None:
    waiting = asyncio.ensure_future(client.plan(rank_request("engine-e", 0, 2)))
    await asyncio.sleep(0.05)
    with pytest.raises(PlannerError) as caught:
        await client.plan(rank_request("engine-e", 0, 2, kv_bytes=2 * GIB))
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT  # duplicate rank
    with pytest.raises(PlannerError) as caught:
        await client.plan(rank_request("engine-e", 1, 3))
    assert caught.value.violations[0].field == "world_size"
    await client.plan(rank_request("engine-e", 1, 2))
    assert (await waiting).num_blocks > 0
    with pytest.raises(PlannerError) as caught:
        await client.plan(rank_request("engine-x", 5, 2))
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT


async def test_rank_mode_conflicting_layer_reaches_every_rank(client: AsyncPlannerClient) -> None:
    rank0 = rank_request("engine-c", 0, 2)
    rank1 = rank_request("engine-c", 1, 2)
    rank1.workers[0].layers.append(full_layer("model.layers.0.attn", heads=4))
    results = await asyncio.gather(client.plan(rank0), client.plan(rank1), return_exceptions=True)
    for result in results:
        assert isinstance(result, PlannerError)
        assert result.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "model.layers.0.attn" in result.details


async def test_rank_mode_deadline_and_cancellation(
    client: AsyncPlannerClient, server: RunningServer
) -> None:
    with pytest.raises(PlannerError) as caught:
        await client.plan(rank_request("engine-d", 0, 2), timeout_s=0.3)
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.1)
    assert await server.servicer.rendezvous.pending_engines() == 0  # the rank left
    call = asyncio.ensure_future(client.plan(rank_request("engine-k", 0, 2)))
    await asyncio.sleep(0.1)
    assert await server.servicer.rendezvous.pending_engines() == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(50):
        if await server.servicer.rendezvous.pending_engines() == 0:
            break
        await asyncio.sleep(0.02)
    assert await server.servicer.rendezvous.pending_engines() == 0


async def test_a_rank_that_gives_up_leaves_the_others_of_its_engine_waiting(
    client: AsyncPlannerClient, server: RunningServer
) -> None:
    store = server.servicer.rendezvous._store

    async def ranks_become(expected: tuple[int, ...]) -> None:
        for _ in range(200):
            if await store.rendezvous_ranks("engine-g") == expected:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"ranks never became {expected}")

    gives_up = asyncio.ensure_future(client.plan(rank_request("engine-g", 0, 3)))
    stays = asyncio.ensure_future(client.plan(rank_request("engine-g", 1, 3)))
    await ranks_become((0, 1))
    gives_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gives_up
    await ranks_become((1,))  # it left; rank 1 waits on
    assert not stays.done()
    back, last = await asyncio.gather(
        client.plan(rank_request("engine-g", 0, 3)), client.plan(rank_request("engine-g", 2, 3))
    )
    assert (await stays).plan_id == back.plan_id == last.plan_id
    assert [worker.rank for worker in back.response.workers] == [0, 1, 2]


async def test_pending_rendezvous_limit(client: AsyncPlannerClient, server: RunningServer) -> None:
    limit = server.settings.max_pending_rendezvous
    server.servicer.rendezvous._max_pending = 2
    calls = [asyncio.ensure_future(client.plan(rank_request(f"p{i}", 0, 2))) for i in range(2)]
    await asyncio.sleep(0.1)
    with pytest.raises(PlannerError) as caught:
        await client.plan(rank_request("p-over", 0, 2))
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit 2" in caught.value.details
    server.servicer.rendezvous._max_pending = limit
    for index, call in enumerate(calls):
        await client.plan(rank_request(f"p{index}", 1, 2))
        await call


async def test_drain_releases_waiting_ranks(server: RunningServer) -> None:
    async with AsyncPlannerClient(f"127.0.0.1:{server.port}") as planner:
        waiting = asyncio.ensure_future(planner.plan(rank_request("engine-s", 0, 2)))
        await asyncio.sleep(0.1)
        server.servicer.rendezvous.drain()
        with pytest.raises(PlannerError) as caught:
            await waiting
        assert caught.value.code is grpc.StatusCode.UNAVAILABLE
        assert "retry" in caught.value.details


async def test_health_reflection_and_devices(
    server: RunningServer, client: AsyncPlannerClient
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(
            health_pb2.HealthCheckRequest(service="kvplan.v1.KVCachePlanner")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask() -> object:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = set()
        async for response in reflection.ServerReflectionInfo(ask()):
            names = {s.name for s in response.list_services_response.service}
        assert "kvplan.v1.KVCachePlanner" in names and "grpc.health.v1.Health" in names
    devices = await client.list_devices()
    assert [d.name for d in devices.devices] == ["H100-80GB", "H100-80GB"]
    assert devices.devices[0].uuid.startswith("GPU-")


async def test_metrics_scrape(server: RunningServer, client: AsyncPlannerClient) -> None:
    await client.plan(engine_request())
    await client.plan(engine_request())
    request = engine_request("engine-m")
    request.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_EAGLE
    request.spec_decode.num_speculative_tokens = 1  # a drafter drafts (vLLM wants > 0)
    request.workers[0].layers.append(full_layer("draft.0"))
    request.workers[0].layers[-1].is_draft = True
    await client.plan(request)
    with pytest.raises(PlannerError):
        await client.plan(engine_request(kv_bytes=1))
    body = await asyncio.to_thread(
        lambda: (
            urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics")
            .read()
            .decode()
        )
    )
    rpc = 'grpc_method="PlanKVCache",grpc_service="kvplan.v1.KVCachePlanner",grpc_type="unary"'
    expected = [
        f"grpc_server_started_total{{{rpc}}} 4.0",
        f'grpc_server_handled_total{{grpc_code="OK",{rpc}}} 3.0',
        f'grpc_server_handled_total{{grpc_code="RESOURCE_EXHAUSTED",{rpc}}} 1.0',
        f"grpc_server_handling_seconds_count{{{rpc}}} 4.0",
        'kvplan_plans_total{grouping_path="uniform_spec"} 2.0',
        'kvplan_draft_annotations_total{rule="is_draft"} 1.0',
        "kvplan_plan_cache_hits_total 1.0",
        "kvplan_plan_cache_misses_total 3.0",
        'kvplan_validation_errors_total{reason="InsufficientMemory"} 1.0',
        'kvplan_build_info{version="0.1.0"} 1.0',
        "kvplan_rendezvous_waiting_ranks 0.0",
    ]
    for line in expected:
        assert line in body, line
    cached_bytes = server.servicer._cache.size_bytes
    assert cached_bytes > 0
    assert f"kvplan_plan_cache_bytes {float(cached_bytes)}" in body


async def test_sync_client_in_thread(server: RunningServer) -> None:
    def call() -> int:
        with PlannerClient(f"127.0.0.1:{server.port}") as planner:
            result = planner.plan(engine_request("engine-sync"))
            assert planner.get_plan(engine_id="engine-sync").plan_id == result.plan_id
            try:
                planner.get_plan(plan_id="nope")
            except PlannerError as error:
                assert error.code is grpc.StatusCode.NOT_FOUND
            return result.num_blocks

    assert await asyncio.to_thread(call) == GIB // (8 * 65_536)


async def test_engine_version_selects_the_rule_set(client: AsyncPlannerClient) -> None:
    request = engine_request()
    request.options.engine_version = "vllm-0.33"
    plan = await client.plan(request)
    assert plan.response.rule_set == "vllm-0.33"
    request.options.engine_version = "vllm-9.99"
    with pytest.raises(PlannerError) as caught:
        await client.plan(request)
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.violations[0].field == "options.engine_version"
    assert "vllm-0.34" in caught.value.details


async def test_rank_mode_resolves_the_layout_from_every_ranks_list(
    client: AsyncPlannerClient,
) -> None:
    """Each pipeline stage sends the layouts its backends support; the merged
    engine is resolved by the named release (0.33: lists must match)."""
    lists = [
        [plan_pb2.KV_CACHE_LAYOUT_BLHNC, plan_pb2.KV_CACHE_LAYOUT_LBHNC],
        [plan_pb2.KV_CACHE_LAYOUT_LBHNC, plan_pb2.KV_CACHE_LAYOUT_BLHNC],
        [plan_pb2.KV_CACHE_LAYOUT_LBHNC],
    ]

    def ranks(engine_id: str, version: str) -> list[plan_pb2.PlanRequest]:
        requests = [rank_request(engine_id, rank, 3) for rank in range(3)]
        for request, layouts in zip(requests, lists, strict=True):
            request.options.engine_version = version
            request.workers[0].supported_layouts.extend(layouts)
        return requests

    plans = await asyncio.gather(*(client.plan(r) for r in ranks("engine-l34", "vllm-0.34")))
    assert len({plan.plan_id for plan in plans}) == 1
    diagnostics = plans[0].response.diagnostics
    assert diagnostics.kv_cache_layout == plan_pb2.KV_CACHE_LAYOUT_LBHNC
    assert list(diagnostics.layout_candidates) == [plan_pb2.KV_CACHE_LAYOUT_LBHNC]
    results = await asyncio.gather(
        *(client.plan(r) for r in ranks("engine-l33", "vllm-0.33")), return_exceptions=True
    )
    for result in results:
        assert isinstance(result, PlannerError)
        assert result.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "different KV cache layouts" in result.details
        assert {v.field for v in result.violations} == {
            "workers[0].supported_layouts",
            "workers[1].supported_layouts",
        }
