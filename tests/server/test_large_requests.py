"""Requests over LARGE_MESSAGE_BYTES through a real server on loopback: parsed
after authentication, off the event loop and in pieces, planned and serialized in
a worker thread, and answered exactly as one parse and one serialization would
(how long they hold other calls: bench/rpc_bench.py, "large request")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import pytest

from kvplan.client import AsyncPlannerClient, PlannerError
from kvplan.convert import plan_from_proto
from kvplan.server.guard import LargeBody, _safe
from kvplan.server.large_messages import LARGE_MESSAGE_BYTES
from kvplan.server.main import start_server
from kvplan.v1 import plan_pb2
from tests.server.conftest import TEST_SETTINGS, full_layer, worker
from tests.server.test_leases import device_uuids, leased_request
from tests.server.test_security import TOKEN_A, write_tokens

SERVICE = "/kvplan.v1.KVCachePlanner/"
OPTIONS = [("grpc.max_send_message_length", 1 << 26), ("grpc.max_receive_message_length", 1 << 26)]


def large_request(engine_id: str = "engine-large") -> plan_pb2.PlanRequest:
    """Sixteen tensor-parallel workers of 2,100 layers: about 1.5 MB, over
    --offload-layers (2,048) and LARGE_MESSAGE_BYTES."""
    request = plan_pb2.PlanRequest(engine_id=engine_id)
    request.options.max_model_len = 4096
    layers = [full_layer(f"model.layers.{index}.self_attn.attn") for index in range(2100)]
    request.workers.extend(worker(rank, layers, kv_bytes=64 << 30) for rank in range(16))
    assert request.ByteSize() > LARGE_MESSAGE_BYTES
    return request


async def call(target: str, method: str, body: bytes, token: str = "") -> bytes:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
        reply: bytes = await channel.unary_unary(SERVICE + method)(
            body, timeout=60, metadata=metadata
        )
        return reply


async def test_a_large_request_is_planned_as_one_parse_and_serialization_would() -> None:
    server = await start_server(TEST_SETTINGS)
    target = f"127.0.0.1:{server.port}"
    try:
        request = large_request()
        reply = await call(target, "PlanKVCache", request.SerializeToString())
        plan = plan_pb2.PlanResponse.FromString(reply)
        expected = plan_from_proto(request, plan_id=plan.plan_id)
        assert reply == expected.SerializeToString()
        assert len(plan.workers) == 16 and plan.num_blocks > 0
        # Again: the same plan id and bytes, now from the plan cache.
        assert await call(target, "PlanKVCache", request.SerializeToString()) == reply
        # One rank's view of it, and a rank it does not have.
        assert len(reply) > LARGE_MESSAGE_BYTES  # parsed in pieces for a rank's view
        async with AsyncPlannerClient(target, timeout_s=60) as planner:
            view = (await planner.get_plan(plan_id=plan.plan_id, rank=3)).response
            whole = (await planner.get_plan(plan_id=plan.plan_id)).response
            with pytest.raises(PlannerError) as missing:
                await planner.get_plan(plan_id=plan.plan_id, rank=99)
        assert [worker.rank for worker in view.workers] == [3]
        assert view.workers[0] == plan.workers[3]
        assert view.groups == plan.groups and view.num_blocks == plan.num_blocks
        assert whole == plan
        assert missing.value.code is grpc.StatusCode.NOT_FOUND
        # Echo answers with the request's bytes.
        echoed = await call(target, "Echo", request.SerializeToString())
        assert echoed == request.SerializeToString()
    finally:
        await server.stop(0)


async def test_a_large_request_naming_devices_is_leased() -> None:
    """Workers naming devices: the request is copied for their budgets (in a
    thread, in pieces) and each worker gets its lease."""
    server = await start_server(replace(TEST_SETTINGS, devices="4xH200-141GB"))
    target = f"127.0.0.1:{server.port}"
    try:
        async with AsyncPlannerClient(target, timeout_s=10) as planner:
            uuids = await device_uuids(planner)
        request = plan_pb2.PlanRequest(engine_id="engine-devices")
        request.options.max_model_len = 256
        for rank, uuid in enumerate(uuids):
            request.workers.append(
                leased_request("engine-devices", uuid, rank=rank, layers=range(8000)).workers[0]
            )
        assert request.ByteSize() > LARGE_MESSAGE_BYTES
        plan = plan_pb2.PlanResponse.FromString(
            await call(target, "PlanKVCache", request.SerializeToString())
        )
        assert sorted((lease.rank, lease.device_uuid) for lease in plan.leases) == list(
            enumerate(uuids)
        )
        assert all(lease.bytes > 0 for lease in plan.leases)
    finally:
        await server.stop(0)


async def test_a_large_body_that_is_no_request_is_invalid_argument() -> None:
    server = await start_server(TEST_SETTINGS)
    target = f"127.0.0.1:{server.port}"
    try:
        body = large_request().SerializeToString()
        for broken in (body[:-3], body + b"\xff\xff", b"\x22\xff\xff\xff\x7f" + body):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(target, "PlanKVCache", broken)
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"the request body ({len(broken)} bytes) is not a valid PlanKVCache" in str(
                raised.value.details()
            )
    finally:
        await server.stop(0)


async def test_a_large_body_is_parsed_only_for_an_authenticated_caller(tmp_path: Path) -> None:
    """Without a token a large body is UNAUTHENTICATED, even one that does not parse:
    the server never read it. With one, it is parsed (and refused as unparseable)."""
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a")
    server = await start_server(replace(TEST_SETTINGS, token_file=str(tokens)))
    target = f"127.0.0.1:{server.port}"
    try:
        broken = large_request().SerializeToString()[:-3]
        codes = []
        for token in ("", TOKEN_A):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(target, "PlanKVCache", broken, token)
            codes.append(raised.value.code())
        assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT]
    finally:
        await server.stop(0)


def test_the_guard_defers_a_large_body_unparsed() -> None:
    parsed: list[bytes] = []

    def deserializer(raw: bytes) -> bytes:
        parsed.append(raw)
        return raw

    parse = _safe(deserializer)
    assert parse is not None
    large = bytes(LARGE_MESSAGE_BYTES + 1)
    deferred = parse(large)
    assert isinstance(deferred, LargeBody) and deferred.data is large
    assert parse(b"small") == b"small"
    assert parsed == [b"small"]
