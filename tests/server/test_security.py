"""Identity and authorization through a real server on loopback: mutual TLS with
certificates made here, bearer tokens, per-engine ownership, reloads."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import os
import sqlite3
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from cryptography import x509
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvplan.client import AsyncPlannerClient, ChannelSecurity, PlannerError
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.server.config import Settings, parse_settings
from kvplan.server.main import RunningServer, start_server
from kvplan.server.metrics import Metrics
from kvplan.server.security import Authenticator, bind_host, warn_if_exposed
from tests.server.certs import Authority
from tests.server.conftest import GIB, TEST_SETTINGS, engine_request, rank_request
from tests.server.test_leases import device_uuids, leased_request

TOKEN_A = "token-of-engine-a-0123456789"
TOKEN_B = "token-of-engine-b-0123456789"
TOKEN_OPS = "token-of-operator-0123456789"


@dataclass
class Pki:
    authority: Authority
    directory: Path
    server_cert: Path
    server_key: Path
    client_ca: Path

    def client(
        self, name: str, alternative_names: Sequence[x509.GeneralName] | None = None
    ) -> ChannelSecurity:
        pair = self.authority.issue(name, server=False, alternative_names=alternative_names)
        return ChannelSecurity(
            tls=True,
            root_certificates=self.authority.cert_pem,
            private_key=pair.key_pem,
            certificate_chain=pair.cert_pem,
        )


def make_pki(directory: Path) -> Pki:
    authority = Authority()
    cert, key = authority.issue("kvplan-server", server=True).write(directory, "server")
    client_ca = directory / "clients-ca.crt"
    client_ca.write_bytes(authority.cert_pem)
    return Pki(authority, directory, cert, key, client_ca)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest_asyncio.fixture
async def mtls_server(pki: Pki) -> AsyncIterator[RunningServer]:
    running = await start_server(
        replace(
            TEST_SETTINGS,
            devices="1xH100-80GB",
            tls_cert=str(pki.server_cert),
            tls_key=str(pki.server_key),
            tls_client_ca=str(pki.client_ca),
            operators="ops",
        )
    )
    yield running
    await running.stop(0)


def write_tokens(path: Path, *lines: str) -> None:
    path.write_text("# token identity [operator]\n" + "\n".join(lines) + "\n")


@pytest_asyncio.fixture
async def token_server(tmp_path: Path) -> AsyncIterator[RunningServer]:
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a", f"{TOKEN_B} team-b", f"{TOKEN_OPS} ops operator")
    running = await start_server(
        replace(TEST_SETTINGS, devices="1xH100-80GB", token_file=str(tokens))
    )
    yield running
    await running.stop(0)


def client_for(server: RunningServer, security: ChannelSecurity) -> AsyncPlannerClient:
    return AsyncPlannerClient(f"127.0.0.1:{server.port}", timeout_s=5, security=security)


async def test_mutual_tls_identities_own_their_engines(
    mtls_server: RunningServer, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        client_for(mtls_server, pki.client("engine-a")) as victim,
        client_for(mtls_server, pki.client("engine-b")) as attacker,
        client_for(mtls_server, pki.client("ops")) as operator,
    ):
        uuid = (await device_uuids(victim))[0]
        plan = await victim.plan(leased_request("victim", uuid, utilization=0.45))
        assert plan.leases
        # Every way to touch another identity's engine is refused.
        attempts = {
            "release": attacker.release_plan("victim"),
            "renew": attacker.renew_leases("victim", {0: 1}),
            "read by engine": attacker.get_plan(engine_id="victim"),
            "read by plan id": attacker.get_plan(plan_id=plan.plan_id),
            "re-plan": attacker.plan(leased_request("victim", uuid, utilization=0.05)),
        }
        for what, call in attempts.items():
            with pytest.raises(PlannerError) as caught:
                await call
            assert caught.value.code is grpc.StatusCode.PERMISSION_DENIED, what
            assert "engine-b" in caught.value.details
        # The victim's lease is untouched, and the owner still may do everything.
        (device,) = (await victim.list_devices()).devices
        assert device.committed_bytes == plan.leases[0].bytes
        assert (await victim.renew_leases("victim", {0: 1}))[0].engine_id == "victim"
        assert (await victim.get_plan(engine_id="victim")).plan_id == plan.plan_id
        # The operator may act on any engine, and the log says so.
        with caplog.at_level(logging.WARNING, logger="kvplan.server"):
            released = await operator.release_plan("victim")
        assert released.released_bytes == plan.leases[0].bytes
        assert any(
            record.getMessage() == "operator acts on another identity's engine"
            and getattr(record, "owner", "") == "engine-a"
            for record in caplog.records
        )


async def test_mutual_tls_identity_is_the_first_dns_or_uri_name(
    mtls_server: RunningServer, pki: Pki
) -> None:
    """An email or IP SAN is not an identity, even listed first: an email SAN spelling
    an operator's name ("ops") must not act as the operator."""
    email_first = pki.client("cn-x", [x509.RFC822Name("ops"), x509.DNSName("engine-b")])
    ip_first = pki.client(
        "cn-y", [x509.IPAddress(ipaddress.ip_address("10.1.2.3")), x509.DNSName("engine-a")]
    )
    uri_first = pki.client(
        "cn-z", [x509.UniformResourceIdentifier("spiffe://corp/team-c"), x509.DNSName("x")]
    )
    async with (
        client_for(mtls_server, pki.client("engine-a")) as victim,
        client_for(mtls_server, email_first) as attacker,
        client_for(mtls_server, ip_first) as victim_again,
        client_for(mtls_server, uri_first) as team_c,
    ):
        uuid = (await device_uuids(victim))[0]
        plan = await victim.plan(leased_request("victim", uuid, utilization=0.45))
        with pytest.raises(PlannerError) as caught:
            await attacker.release_plan("victim")
        assert caught.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert "engine-b" in caught.value.details
        # The IP SAN is skipped: the DNS name after it is the owner.
        assert (await victim_again.get_plan(engine_id="victim")).plan_id == plan.plan_id
        with pytest.raises(PlannerError) as caught:
            await team_c.get_plan(engine_id="victim")
        assert "spiffe://corp/team-c" in caught.value.details


async def test_mutual_tls_refuses_clients_without_a_certificate(
    mtls_server: RunningServer, pki: Pki
) -> None:
    no_certificate = ChannelSecurity(tls=True, root_certificates=pki.authority.cert_pem)
    stranger = Authority("another CA")
    foreign_pair = stranger.issue("engine-a", server=False)
    foreign = ChannelSecurity(
        tls=True,
        root_certificates=pki.authority.cert_pem,
        private_key=foreign_pair.key_pem,
        certificate_chain=foreign_pair.cert_pem,
    )
    for security in (ChannelSecurity(), no_certificate, foreign):
        async with AsyncPlannerClient(
            f"127.0.0.1:{mtls_server.port}", timeout_s=2, security=security
        ) as client:
            with pytest.raises(PlannerError) as caught:
                await client.list_devices()
            assert caught.value.code is grpc.StatusCode.UNAVAILABLE  # the handshake failed
    async with client_for(mtls_server, pki.client("engine-a")) as trusted:
        assert (await trusted.list_devices()).devices


async def test_certificates_are_reloaded_without_a_restart(
    mtls_server: RunningServer, pki: Pki
) -> None:
    async with client_for(mtls_server, pki.client("engine-a")) as before:
        assert (await before.list_devices()).devices
    # Rotate to a new CA: the server's certificate and the CA it trusts for clients.
    rotated = Authority("rotated CA")
    time.sleep(0.01)  # a distinct mtime
    rotated.issue("kvplan-server", server=True).write(pki.directory, "server")
    pki.client_ca.write_bytes(rotated.cert_pem)
    os.utime(pki.server_cert)
    new_pki = replace(pki, authority=rotated)
    async with client_for(mtls_server, new_pki.client("engine-a")) as after:
        assert (await after.list_devices()).devices
    async with AsyncPlannerClient(
        f"127.0.0.1:{mtls_server.port}", timeout_s=2, security=pki.client("engine-a")
    ) as old:
        with pytest.raises(PlannerError) as caught:
            await old.list_devices()
        assert caught.value.code is grpc.StatusCode.UNAVAILABLE


async def test_the_cli_tells_refused_credentials_by_its_exit_code(
    token_server: RunningServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`kvplan plan --target`: no token is UNAUTHENTICATED, exit 6 (it was 1, the
    code of an internal error or an unreachable server)."""
    from kvplan.cli import main

    monkeypatch.delenv("KVPLAN_TOKEN", raising=False)
    request = tmp_path / "request.json"
    request.write_text(json_format.MessageToJson(engine_request("cli-engine")), encoding="utf-8")
    target = f"127.0.0.1:{token_server.port}"
    assert await asyncio.to_thread(main, ["plan", str(request), "--target", target]) == 6


async def test_bearer_tokens_authenticate_and_own_engines(token_server: RunningServer) -> None:
    target = f"127.0.0.1:{token_server.port}"
    for security in (ChannelSecurity(), ChannelSecurity(token="not-a-known-token-at-all")):
        async with AsyncPlannerClient(target, timeout_s=5, security=security) as stranger:
            with pytest.raises(PlannerError) as caught:
                await stranger.list_devices()
            assert caught.value.code is grpc.StatusCode.UNAUTHENTICATED
    async with (
        AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=TOKEN_A)) as a,
        AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=TOKEN_B)) as b,
    ):
        uuid = (await device_uuids(a))[0]
        await a.plan(leased_request("engine-a", uuid))
        with pytest.raises(PlannerError) as caught:
            await b.release_plan("engine-a")
        assert caught.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert (await a.release_plan("engine-a")).released_bytes > 0


async def test_a_plan_is_reused_within_an_identity_never_across(
    token_server: RunningServer,
) -> None:
    """Another engine of one model reuses its plan, but only for the identity that
    planned it: a fast answer would tell one tenant what another planned."""
    target = f"127.0.0.1:{token_server.port}"
    async with (
        AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=TOKEN_A)) as a,
        AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=TOKEN_B)) as b,
    ):
        first = await a.plan(engine_request("a-1"))
        other_tenant = await b.plan(engine_request("b-1"))
        assert token_server.metrics.plans_reused._value.get() == 0
        assert token_server.metrics.model_plans_reused._value.get() == 0  # nor its model
        assert token_server.metrics.cache_misses._value.get() == 2
        same_tenant = await a.plan(engine_request("a-2"))
        assert token_server.metrics.plans_reused._value.get() == 1
        for plan in (other_tenant, same_tenant):  # the same plan either way
            assert plan.num_blocks == first.num_blocks
            assert plan.response.groups == first.response.groups

        # A known model with other memory: its model plan, too, is the identity's own.
        await b.plan(engine_request("b-2", kv_bytes=3 * GIB))
        assert token_server.metrics.model_plans_reused._value.get() == 1  # b's own
        await a.plan(engine_request("a-3", kv_bytes=2 * GIB))
        assert token_server.metrics.model_plans_reused._value.get() == 2


async def test_a_refused_lease_names_only_the_holders_the_caller_may_see(
    token_server: RunningServer,
) -> None:
    target = f"127.0.0.1:{token_server.port}"
    share = math.ceil(GPU_MEMORY_BYTES["H100-80GB"] * 0.45)

    def client(token: str) -> AsyncPlannerClient:
        return AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=token))

    async with client(TOKEN_A) as a, client(TOKEN_B) as b, client(TOKEN_OPS) as ops:
        uuid = (await device_uuids(a))[0]
        await a.plan(leased_request("engine-a", uuid))
        await b.plan(leased_request("engine-b", uuid))
        seen: dict[str, PlannerError] = {}
        for name, caller in (("a", a), ("b", b), ("ops", ops)):
            with pytest.raises(PlannerError) as caught:
                await caller.plan(leased_request(f"engine-{name}-2", uuid))
            assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            seen[name] = caught.value
        # team-a sees its own engine by name and team-b's amount without its id.
        assert "engine 'engine-a' (rank 0)" in seen["a"].details
        assert "engine-b" not in seen["a"].details + str(seen["a"].metadata)
        assert "another identity's engine (rank 0)" in seen["a"].details
        assert seen["a"].metadata["holdings"] == f"engine-a|0|{share};|0|{share}"
        assert "engine 'engine-b' (rank 0)" in seen["b"].details
        assert "engine-a" not in seen["b"].details + str(seen["b"].metadata)
        assert seen["b"].metadata["holdings"] == f"|0|{share};engine-b|0|{share}"
        # The operator sees every holder.
        assert "engine 'engine-a' (rank 0)" in seen["ops"].details
        assert "engine 'engine-b' (rank 0)" in seen["ops"].details
        assert "another identity" not in seen["ops"].details
        for engine_id in ("engine-a", "engine-b"):
            await ops.release_plan(engine_id)


@contextlib.asynccontextmanager
async def teams(
    tmp_path: Path, **settings: Any
) -> AsyncIterator[
    tuple[RunningServer, AsyncPlannerClient, AsyncPlannerClient, AsyncPlannerClient]
]:
    """A server with tokens (and `settings`), and clients of team-a, team-b and an
    operator."""
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a", f"{TOKEN_B} team-b", f"{TOKEN_OPS} ops operator")
    running = await start_server(replace(TEST_SETTINGS, token_file=str(tokens), **settings))
    target = f"127.0.0.1:{running.port}"

    def client(token: str) -> AsyncPlannerClient:
        return AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=token))

    try:
        async with client(TOKEN_A) as a, client(TOKEN_B) as b, client(TOKEN_OPS) as ops:
            yield running, a, b, ops
    finally:
        await running.stop(0)


async def test_a_plan_outliving_its_engines_ownership_is_an_operators_to_read(
    tmp_path: Path,
) -> None:
    """Once an engine's ownership lapses (--ownership-ttl-s after its last use), its
    plan, still kept, is not anyone's to read: only an operator's, until the engine
    is planned again (which makes it its planner's)."""
    async with teams(tmp_path, ownership_ttl_s=0.5) as (_, a, b, ops):
        plan = await a.plan(engine_request("job-42"))
        await asyncio.sleep(0.7)  # team-a's ownership lapses; the plan stays
        for engine_id, plan_id in (("job-42", ""), ("", plan.plan_id)):
            with pytest.raises(PlannerError) as refused:
                await b.get_plan(engine_id=engine_id, plan_id=plan_id)
            assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
            assert "has no owner now" in refused.value.details
            read = await ops.get_plan(engine_id=engine_id, plan_id=plan_id)
            assert read.plan_id == plan.plan_id
        # An engine id nobody planned is still simply not found.
        with pytest.raises(PlannerError) as missing:
            await b.get_plan(engine_id="never-planned")
        assert missing.value.code is grpc.StatusCode.NOT_FOUND
        # Planning it again makes it team-b's.
        await b.plan(engine_request("job-42"))
        assert (await b.get_plan(engine_id="job-42")).engine_id == "job-42"


async def test_the_lease_bound_counts_each_identitys_own_leases(tmp_path: Path) -> None:
    """--max-leases-per-identity bounds the live leases of one identity's engines (the
    store's per-identity count): another identity is not held back by them, and a
    re-plan replaces the engine's own leases instead of adding to them."""
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a", f"{TOKEN_B} team-b")
    settings = replace(
        TEST_SETTINGS, devices="1xH100-80GB", token_file=str(tokens), max_leases_per_identity=2
    )
    running = await start_server(settings)
    target = f"127.0.0.1:{running.port}"

    def client(token: str) -> AsyncPlannerClient:
        return AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=token))

    try:
        async with client(TOKEN_A) as a, client(TOKEN_B) as b:
            uuid = (await device_uuids(a))[0]
            for engine_id in ("a-1", "a-2"):
                await a.plan(leased_request(engine_id, uuid, utilization=0.24))
            with pytest.raises(PlannerError) as refused:
                await a.plan(leased_request("a-3", uuid, utilization=0.24))
            assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.metadata["limit"] == "max_leases_per_identity"
            assert "team-a" in refused.value.details
            await b.plan(leased_request("b-1", uuid, utilization=0.24))  # team-b holds none
            await a.plan(leased_request("a-1", uuid, utilization=0.3))  # replaces a-1's lease
            await a.release_plan("a-2")
            await a.plan(leased_request("a-3", uuid, utilization=0.24))
            (device,) = (await a.list_devices()).devices
            assert device.live_leases == 3
    finally:
        await running.stop(0)


async def test_the_engine_bound_counts_each_identitys_own_engines(tmp_path: Path) -> None:
    """--max-engines-per-identity bounds the engines one identity owns (its live
    ownership records): the next new engine is refused, naming the flag and the
    numbers, while re-plans of its own engines and another identity go on; an
    operator's own engines are bounded the same way."""
    async with teams(tmp_path, max_engines_per_identity=2) as (running, a, b, ops):
        for engine_id in ("a-1", "a-2"):
            await a.plan(engine_request(engine_id))
        with pytest.raises(PlannerError) as refused:
            await a.plan(engine_request("a-3"))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.metadata["limit"] == "max_engines_per_identity"
        assert "3 exceeds the server's limit of 2" in refused.value.details
        assert "--max-engines-per-identity" in refused.value.details
        assert "team-a" in refused.value.details
        assert "--ownership-ttl-s" in refused.value.details
        await a.plan(engine_request("a-1"))  # its own engine: never refused
        for engine_id in ("b-1", "b-2"):  # team-b is not held back by team-a
            await b.plan(engine_request(engine_id))
        await ops.plan(engine_request("a-2"))  # another's engine: not the operator's
        for engine_id in ("ops-1", "ops-2"):
            await ops.plan(engine_request(engine_id))
        with pytest.raises(PlannerError) as refused:
            await ops.plan(engine_request("ops-3"))
        assert refused.value.metadata["limit"] == "max_engines_per_identity"
        hits = running.metrics.registry.get_sample_value(
            "kvplan_limits_hit_total", {"limit": "max_engines_per_identity"}
        )
        assert hits == 2


async def test_one_identity_cannot_fill_the_pending_rendezvous(tmp_path: Path) -> None:
    """--max-pending-rendezvous-per-identity: a tenant whose engines wait for ranks
    up to its share is refused a new one, naming the flag, while another tenant's
    rank-mode engines are planned."""
    async with teams(tmp_path, max_pending_rendezvous_per_identity=2) as (running, a, b, _):
        waiting = [
            asyncio.create_task(a.plan(rank_request(engine_id, 0, world_size=2), timeout_s=30))
            for engine_id in ("a-1", "a-2")
        ]
        while await running.store.pending_engines() < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(PlannerError) as refused:
            await a.plan(rank_request("a-3", 0, world_size=2))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.metadata["limit"] == "max_pending_rendezvous_per_identity"
        assert "--max-pending-rendezvous-per-identity" in refused.value.details
        hits = running.metrics.registry.get_sample_value(
            "kvplan_limits_hit_total", {"limit": "max_pending_rendezvous_per_identity"}
        )
        assert hits == 1
        planned = await asyncio.gather(
            *(b.plan(rank_request("b-1", rank, world_size=2)) for rank in range(2))
        )
        assert planned[0].plan_id == planned[1].plan_id
        # a-1 completes: its place is free again.
        await a.plan(rank_request("a-1", 1, world_size=2))
        await waiting[0]
        third = asyncio.create_task(a.plan(rank_request("a-3", 0, world_size=2), timeout_s=30))
        await a.plan(rank_request("a-3", 1, world_size=2))
        await third
        waiting[1].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting[1]


async def test_one_identity_cannot_fill_the_pending_rendezvous_bytes(tmp_path: Path) -> None:
    """--max-pending-rendezvous-bytes-per-identity: a tenant's waiting rank specs
    beyond its share are refused, while another tenant's ranks still wait and
    complete; a rank that stops waiting gives its bytes back."""
    async with teams(tmp_path, max_pending_rendezvous_bytes_per_identity=1) as (_, a, _, _):
        with pytest.raises(PlannerError) as measured:  # how many bytes one rank holds
            await a.plan(rank_request("a-0", 0, world_size=2))
    share = int(measured.value.metadata["value"]) * 5 // 2  # two ranks fit, three do not
    async with teams(tmp_path, max_pending_rendezvous_bytes_per_identity=share) as (
        running,
        a,
        b,
        _,
    ):
        first, second = (
            asyncio.create_task(a.plan(rank_request(engine_id, 0, world_size=2), timeout_s=30))
            for engine_id in ("a-1", "a-2")
        )
        while await running.store.pending_engines() < 2:  # both ranks wait, bytes held
            await asyncio.sleep(0.01)
        with pytest.raises(PlannerError) as refused:
            await a.plan(rank_request("a-3", 0, world_size=2))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.metadata["limit"] == "max_pending_rendezvous_bytes_per_identity"
        assert "identity 'team-a'" in refused.value.details
        await asyncio.gather(
            *(b.plan(rank_request("b-1", rank, world_size=2)) for rank in range(2))
        )
        second.cancel()  # a-2's rank gives up: its bytes are team-a's again
        with contextlib.suppress(asyncio.CancelledError):
            await second
        await asyncio.sleep(0.2)
        await a.plan(rank_request("a-1", 1, world_size=2))
        await first


async def test_reflection_needs_credentials_and_health_stays_open(
    token_server: RunningServer,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{token_server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def list_services(metadata: tuple[tuple[str, str], ...]) -> list[str]:
            call = reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=metadata,
                timeout=5,
            )
            return [
                service.name
                async for response in call
                for service in response.list_services_response.service
            ]

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await list_services(())
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        names = await list_services((("authorization", f"Bearer {TOKEN_A}"),))
        assert "kvplan.v1.KVCachePlanner" in names


async def test_token_file_is_reloaded_and_a_bad_edit_keeps_the_old_tokens(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a")
    running = await start_server(replace(TEST_SETTINGS, token_file=str(tokens)))
    target = f"127.0.0.1:{running.port}"
    try:
        async with (
            AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=TOKEN_A)) as a,
            AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=TOKEN_B)) as b,
        ):
            with pytest.raises(PlannerError):
                await b.list_devices()
            write_tokens(tokens, f"{TOKEN_A} team-a", f"{TOKEN_B} team-b")
            await asyncio.sleep(1.1)
            await b.list_devices()
            tokens.write_text("this line is not a token entry at all, it has too many words\n")
            await asyncio.sleep(1.1)
            await a.list_devices()  # the last good table stays
    finally:
        await running.stop(0)


def test_insecure_beyond_loopback_is_said_loudly(caplog: pytest.LogCaptureFixture) -> None:
    insecure = Authenticator(Settings())
    with caplog.at_level(logging.WARNING, logger="kvplan.server.security"):
        warn_if_exposed("127.0.0.1", insecure, tls=False)
        assert not caplog.records
        warn_if_exposed("0.0.0.0", insecure, tls=False)
    assert "INSECURE" in caplog.records[0].getMessage()


def test_default_binds(tmp_path: Path) -> None:
    assert parse_settings([], environ={}).host == "127.0.0.1"  # make run
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a")
    # The image's "auto": all interfaces only where callers must authenticate.
    assert bind_host(parse_settings(["--host", "auto"], environ={})) == "127.0.0.1"
    assert (
        bind_host(parse_settings(["--host", "auto", "--token-file", str(tokens)], environ={}))
        == "0.0.0.0"
    )
    # TLS alone encrypts but authenticates no caller: still loopback.
    tls_only = ["--host", "auto", "--tls-cert", "c", "--tls-key", "k"]
    assert bind_host(parse_settings(tls_only, environ={})) == "127.0.0.1"
    assert bind_host(parse_settings([*tls_only, "--tls-client-ca", "ca"], environ={})) == "0.0.0.0"
    with pytest.raises(SystemExit):
        parse_settings(["--tls-cert", "x"], environ={})  # a certificate needs its key
    # Ownership outlives a lease, or a live engine's leases would be anyone's.
    for ownership in ("0", "-1", "59"):
        with pytest.raises(SystemExit):
            parse_settings(["--ownership-ttl-s", ownership], environ={})
    assert parse_settings(["--ownership-ttl-s", "60"], environ={}).ownership_ttl_s == 60.0
    # Switches stand alone or take a value; the environment spells them out.
    assert parse_settings(["--redis-allow-no-persistence"], environ={}).redis_allow_no_persistence
    assert not parse_settings(
        ["--metrics-engine-labels", "false"], environ={}
    ).metrics_engine_labels
    assert parse_settings([], environ={"KVPLAN_METRICS_ENGINE_LABELS": "1"}).metrics_engine_labels
    # The engine bound: a flag or its environment variable, and positive.
    assert parse_settings([], environ={}).max_engines_per_identity == 65536
    engines = {"KVPLAN_MAX_ENGINES_PER_IDENTITY": "100"}
    assert parse_settings([], environ=engines).max_engines_per_identity == 100
    assert (
        parse_settings(
            ["--max-engines-per-identity", "7"], environ=engines
        ).max_engines_per_identity
        == 7
    )
    with pytest.raises(SystemExit):
        parse_settings(["--max-engines-per-identity", "0"], environ={})


async def test_metrics_carry_no_engine_ids_by_default(server: RunningServer) -> None:
    async with AsyncPlannerClient(f"127.0.0.1:{server.port}", timeout_s=5) as client:
        await client.plan(engine_request("secret-engine-name"))
    body = await asyncio.to_thread(
        lambda: (
            urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics")
            .read()
            .decode()
        )
    )
    assert "secret-engine-name" not in body
    assert "engine_id" not in body


async def test_per_engine_series_when_asked_are_removed_on_release() -> None:
    running = await start_server(
        replace(TEST_SETTINGS, devices="1xH100-80GB", metrics_engine_labels=True)
    )
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=5) as client:
            uuid = (await device_uuids(client))[0]
            await client.plan(leased_request("labelled", uuid))
            gauge = running.metrics.blocks
            assert gauge is not None
            assert any(
                s.labels == {"engine_id": "labelled"} for s in next(iter(gauge.collect())).samples
            )
            await client.release_plan("labelled")
            assert not next(iter(gauge.collect())).samples
    finally:
        await running.stop(0)


def test_per_engine_series_are_bounded() -> None:
    metrics = Metrics(engine_labels=True, max_engine_series=3)
    for index in range(10):
        metrics.record_engine(f"engine-{index}", 1, 1)
    assert metrics.blocks is not None
    engines = {s.labels["engine_id"] for s in next(iter(metrics.blocks.collect())).samples}
    assert engines == {"engine-7", "engine-8", "engine-9"}


def test_channel_security_from_the_environment(pki: Pki) -> None:
    assert ChannelSecurity.from_env({}) == ChannelSecurity()
    pair = pki.authority.issue("engine-a", server=False)
    cert, key = pair.write(pki.directory, "client")
    token_file = pki.directory / "client-token"
    token_file.write_text(TOKEN_A + "\n")
    security = ChannelSecurity.from_env(
        {
            "KVPLAN_TLS_CA": str(pki.client_ca),
            "KVPLAN_CLIENT_CERT": str(cert),
            "KVPLAN_CLIENT_KEY": str(key),
            "KVPLAN_TLS_SERVER_NAME": "localhost",
            "KVPLAN_CLIENT_TOKEN_FILE": str(token_file),
        }
    )
    assert security.tls and security.certificate_chain == pair.cert_pem
    assert security.metadata() == (("authorization", f"Bearer {TOKEN_A}"),)
    assert security.channel_options() == [("grpc.ssl_target_name_override", "localhost")]
    assert ChannelSecurity.from_env({"KVPLAN_TOKEN": "t" * 20}).token == "t" * 20
    with pytest.raises(ValueError):
        ChannelSecurity(private_key=b"key only")


async def test_health_and_plan_commands_speak_mutual_tls(
    mtls_server: RunningServer, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvplan.cli import main

    cert, key = pki.authority.issue("ops", server=False).write(pki.directory, "cli")
    monkeypatch.setenv("KVPLAN_TLS_CA", str(pki.client_ca))
    monkeypatch.setenv("KVPLAN_CLIENT_CERT", str(cert))
    monkeypatch.setenv("KVPLAN_CLIENT_KEY", str(key))
    target = f"127.0.0.1:{mtls_server.port}"
    assert await asyncio.to_thread(main, ["health", "--target", target]) == 0
    monkeypatch.delenv("KVPLAN_CLIENT_CERT")
    monkeypatch.delenv("KVPLAN_CLIENT_KEY")
    assert await asyncio.to_thread(main, ["health", "--target", target, "--timeout", "2"]) == 1


def test_secret_files_readable_by_others_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a")
    tokens.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvplan.server.security"):
        Authenticator(Settings(token_file=str(tokens)))
    assert any("readable by other users" in r.getMessage() for r in caplog.records)
    caplog.clear()
    tokens.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="kvplan.server.security"):
        Authenticator(Settings(token_file=str(tokens)))
    assert not caplog.records


async def test_without_authentication_no_ownership_is_recorded(tmp_path: Path) -> None:
    """Every caller is one identity when the server runs insecure: ownership decides
    nothing there, so distinct engine ids leave no records behind (they would grow
    the store with every engine), and the lease bound counts every live lease."""
    path = tmp_path / "kvplan.sqlite3"
    settings = replace(
        TEST_SETTINGS,
        store=f"sqlite://{path}",
        devices="1xH100-80GB",
        max_leases_per_identity=2,
    )
    running = await start_server(settings)
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
            for index in range(5):
                await client.plan(engine_request(f"engine-{index}"))
            (uuid,) = await device_uuids(client)
            await client.plan(leased_request("leased-a", uuid, utilization=0.3))
            await client.plan(leased_request("leased-b", uuid, utilization=0.3))
            with pytest.raises(PlannerError) as refused:
                await client.plan(leased_request("leased-c", uuid, utilization=0.3))
            assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max-leases-per-identity" in refused.value.details
    finally:
        await running.stop(0)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM engine_owner").fetchone() == (0,)


async def test_the_health_port_answers_kubelet_in_plaintext_beside_a_tls_port(pki: Pki) -> None:
    # kubelet's built-in gRPC probe speaks no TLS: --health-port gives it a plaintext
    # listener that serves grpc.health.v1 and nothing else.
    running = await start_server(
        replace(
            TEST_SETTINGS,
            devices="1xH100-80GB",
            tls_cert=str(pki.server_cert),
            tls_key=str(pki.server_key),
            tls_client_ca=str(pki.client_ca),
            health_port=-1,
        )
    )
    try:
        assert running.health_port not in (0, running.port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.health_port}") as channel:
            health_stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "kvplan.v1.KVCachePlanner"):
                answer = await health_stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=2
                )
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in reflection.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=2
                ):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await running.health.enter_graceful_shutdown()
            answer = await health_stub.Check(
                health_pb2.HealthCheckRequest(service="kvplan.v1.KVCachePlanner"), timeout=2
            )
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await running.stop(0)


async def test_leases_granted_without_authentication_are_adopted_by_no_identity(
    tmp_path: Path,
) -> None:
    """Issue 31 item 3: a lease granted while the server ran insecure, then the
    server restarted on the same state with tokens. Identity B must not renew
    it into its own, nor release it (it would free A's memory), nor plan over
    it; nobody adopts it (A cannot prove it granted it either). An operator
    may release it; otherwise it ends one lease TTL after its last renewal."""
    path = tmp_path / "kvplan.sqlite3"
    tokens = tmp_path / "tokens"
    write_tokens(tokens, f"{TOKEN_A} team-a", f"{TOKEN_B} team-b", f"{TOKEN_OPS} ops operator")
    base = replace(TEST_SETTINGS, store=f"sqlite://{path}", devices="1xH100-80GB")
    insecure = await start_server(base)
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{insecure.port}", timeout_s=10) as anyone:
            (uuid,) = await device_uuids(anyone)
            granted = await anyone.plan(leased_request("engine-a", uuid, utilization=0.5))
    finally:
        await insecure.stop(0)
    held = sum(lease.bytes for lease in granted.response.leases)  # half the catalog's H100
    secured = await start_server(replace(base, token_file=str(tokens)))
    target = f"127.0.0.1:{secured.port}"
    try:
        async with (
            AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=TOKEN_A)) as a,
            AsyncPlannerClient(target, timeout_s=5, security=ChannelSecurity(token=TOKEN_B)) as b,
            AsyncPlannerClient(
                target, timeout_s=5, security=ChannelSecurity(token=TOKEN_OPS)
            ) as operator,
        ):
            attempts: tuple[Callable[[], Awaitable[object]], ...] = (
                lambda: b.renew_leases("engine-a"),
                lambda: b.release_plan("engine-a"),
                lambda: b.plan(leased_request("engine-a", uuid, utilization=0.5)),
                lambda: a.renew_leases("engine-a"),
            )
            for attempt in attempts:
                with pytest.raises(PlannerError) as denied:
                    await attempt()
                assert denied.value.code is grpc.StatusCode.PERMISSION_DENIED
                assert "granted without authentication" in denied.value.details
                assert "--lease-ttl-s" in denied.value.details
            # Nothing was taken: the lease is still there, held by nobody's identity.
            released = await operator.release_plan("engine-a")
            assert released.released_bytes == held > 40 * 10**9
            # Freed, the engine id is anyone's to plan (and own) again.
            await b.plan(leased_request("engine-a", uuid, utilization=0.5))
            with pytest.raises(PlannerError) as denied:
                await a.release_plan("engine-a")
            assert denied.value.code is grpc.StatusCode.PERMISSION_DENIED
    finally:
        await secured.stop(0)
