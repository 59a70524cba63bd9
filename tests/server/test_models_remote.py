"""A model config planned over the wire: the thin client's helper builds the request."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from kvplan.cli import main
from kvplan.client import (
    AsyncPlannerClient,
    ModelPlanOptions,
    PlannerError,
    build_plan_request,
)
from kvplan.convert import plan_from_proto
from kvplan.models import Speculative, load_config
from kvplan.server.main import RunningServer

MODELS = Path(__file__).parents[2] / "examples" / "models"


async def test_client_plans_a_model_config_on_the_server(client: AsyncPlannerClient) -> None:
    config = load_config(str(MODELS / "qwen3-next-80b-a3b" / "config.json"))
    options = ModelPlanOptions(
        tensor_parallel_size=4,
        max_model_len=32768,
        gpu="h200",  # the catalog's driver figure travels with the name
        gpu_memory_utilization=0.9,
        speculative=Speculative("mtp", 1),
        engine_id="qwen3-next-remote",
    )
    request, inputs = build_plan_request(config, options)
    remote = (await client.plan(request)).response
    local = plan_from_proto(request)
    assert remote.num_blocks == local.num_blocks > 0
    assert [list(g.layer_names) for g in remote.groups] == [
        list(g.layer_names) for g in local.groups
    ]
    draft = [g for g in remote.groups if g.is_draft]
    assert len(draft) == 1 and "mtp.layers.0.self_attn.attn" in draft[0].layer_names
    assert remote.workers[0].budget.non_kv_bytes == inputs.non_kv_bytes
    assert remote.workers[0].budget.total_bytes == 150_109_880_320  # the catalog's H200 figure


async def test_cli_plans_a_model_on_a_server(
    server: RunningServer, client: AsyncPlannerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100", "--tp", "2"]
    args += ["--max-model-len", "8K", "--target", f"127.0.0.1:{server.port}", "--json"]
    assert await asyncio.to_thread(main, args) == 0
    remote = json.loads(capsys.readouterr().out)
    assert await asyncio.to_thread(main, [*args[:-3], "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["capacity"] == local["capacity"]
    assert remote["capacity"]["kv_bytes_per_token"] == 32 * 4 * 128 * 2 * 2
    # A what-if: the same plan under no engine of the server's.
    assert (remote["num_blocks"], remote["groups"]) == (local["num_blocks"], local["groups"])
    assert "engine_id" not in remote and local["engine_id"] == "llama"
    with pytest.raises(PlannerError) as missing:
        await client.get_plan(engine_id=local["engine_id"])
    assert missing.value.code_name == "NOT_FOUND"


async def test_does_not_fit_on_a_server_is_said_as_locally(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # The server's RESOURCE_EXHAUSTED (its ErrorInfo numbers) gets the local answer:
    # where the memory went, a length that fits, the smallest TP and GPUs; exit 4.
    args = ["plan", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--max-model-len", "32K"]
    assert await asyncio.to_thread(main, args) == 4
    local = capsys.readouterr().err
    remote_args = [*args, "--target", f"127.0.0.1:{server.port}"]
    assert await asyncio.to_thread(main, remote_args) == 4
    assert capsys.readouterr().err == local
    assert "less than the 4.50 GiB one request" in local
    assert re.search(r"fits here with --max-model-len \d+ or shorter", local)


async def test_no_server_is_a_connection_error_only(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["plan", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--max-model-len", "8K"]
    assert await asyncio.to_thread(main, [*args, "--target", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "non-KV memory" not in err  # not a plan refusal


def _plans_answered(server: RunningServer) -> float:
    metrics = server.metrics
    counters = (metrics.cache_hits, metrics.cache_misses, metrics.plans_reused)
    return float(sum(counter._value.get() for counter in counters))


async def test_capacity_with_target_is_the_servers_answer(
    server: RunningServer,
    client: AsyncPlannerClient,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvplan.models.cli as models_cli

    # L4 at 32K does not fit at TP 1 (its advice plans other TPs and GPUs), the rest fits.
    args = ["capacity", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4,H100", "--tp", "1,2"]
    args += ["--max-model-len", "32K", "--engine-version", "vllm-0.33", "--json"]
    assert await asyncio.to_thread(main, args) == 0
    local = json.loads(capsys.readouterr().out)

    def in_process(request: object) -> object:
        raise AssertionError("capacity --target planned a row in-process")

    monkeypatch.setattr(models_cli, "_local_planner", in_process)
    before = _plans_answered(server)
    remote_args = [*args, "--target", f"127.0.0.1:{server.port}"]
    assert await asyncio.to_thread(main, remote_args) == 0
    remote = json.loads(capsys.readouterr().out)
    # Every fitting row, its auto-fit length and the no-fit row's candidates were answered
    # by the server, which gives what the same core gives in-process.
    assert _plans_answered(server) - before >= 2 * sum(row["status"] == "ok" for row in remote)
    assert remote == local
    statuses = {(row["gpu"], row["tp"]): row["status"] for row in remote}
    assert statuses[("L4-24GB", 1)] == models_cli.NO_FIT and statuses[("H100-80GB", 1)] == "ok"
    no_fit = next(row for row in remote if row["status"] == models_cli.NO_FIT)
    assert no_fit["fits_from_tp"] == 2 and no_fit["fits_on"]  # planned by the server too
    assert {row["rule_set"] for row in remote if row["status"] == "ok"} == {"vllm-0.33"}
    # A what-if names no engine: nothing published or claimed under the model's name.
    with pytest.raises(PlannerError) as missing:
        await client.get_plan(engine_id="qwen3")
    assert missing.value.code_name == "NOT_FOUND"

    assert await asyncio.to_thread(main, [arg for arg in remote_args if arg != "--json"]) == 0
    table = capsys.readouterr().out
    assert f"plans: asked of the kvplan server at 127.0.0.1:{server.port} (rule set " in table
    assert "vllm-0.33, as the server answered" in table


async def test_capacity_without_a_server_says_what_to_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["capacity", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--tp", "1,2"]
    assert await asyncio.to_thread(main, [*args, "--target", f"127.0.0.1:{port}"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # no table of rows nobody answered
    assert captured.err.startswith(f"error: 127.0.0.1:{port}: UNAVAILABLE")


@pytest.mark.parametrize("command", ["plan", "capacity"])
def test_a_channel_that_cannot_be_set_up_is_a_flag_error(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [command, "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--max-model-len", "8K"]
    missing = str(tmp_path / "missing-ca.pem")
    assert main([*args, "--target", "127.0.0.1:1", "--tls-ca", missing]) == 2
    assert f"KVPLAN_TLS_CA={missing}: No such file or directory (a TLS or token file)" in (
        capsys.readouterr().err
    )
    assert main([*args, "--target", "127.0.0.1:"]) == 2
    assert "empty port (give HOST:PORT, or HOST for 50051)" in capsys.readouterr().err


async def test_a_server_limit_is_not_a_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    # The server's own RESOURCE_EXHAUSTED (a request over --max-layers-per-worker) ends
    # the sweep with its message; it is not read as the memory's "does not fit".
    from dataclasses import replace

    from kvplan.server.main import start_server
    from tests.server.conftest import TEST_SETTINGS

    running = await start_server(replace(TEST_SETTINGS, max_layers_per_worker=8))
    try:
        target = ["--target", f"127.0.0.1:{running.port}"]
        args = ["--model", str(MODELS / "qwen3-8b"), "--gpu", "H100", "--max-model-len", "8K"]
        assert await asyncio.to_thread(main, ["capacity", *args, "--tp", "1", *target]) == 4
        err = capsys.readouterr().err
        assert "exceeds the server's limit of 8 (--max-layers-per-worker)" in err
        assert "does not fit" not in err
        assert await asyncio.to_thread(main, ["plan", *args, *target]) == 4
        err = capsys.readouterr().err
        assert "(--max-layers-per-worker)" in err and "does not fit" not in err
    finally:
        await running.stop(0)
