"""The prefix-cache prediction through a real server on loopback and the real
client: the PlanResponse's prefix_cache diagnostics and prefix warnings, the
shared-prefix what-if, the client's rule helper, cached and reused replies, and the
per-code metric."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from conformance.generate import W, full, hidden, sw
from conformance.generate import request as generated_request
from kvplan.cli import load_request
from kvplan.client import AsyncPlannerClient, PlannerError
from kvplan.client.prefix_cache import cached_tokens as client_cached_tokens
from kvplan.client.prefix_cache import summary
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import InvalidRequest
from kvplan.core.prefix_cache import cached_tokens, facts
from kvplan.core.prefix_warnings import WhatIf, what_if
from kvplan.prefix_facts import setup_from_plan
from kvplan.server.main import start_server
from kvplan.v1 import plan_pb2
from tests.server.conftest import TEST_SETTINGS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _request(name: str, engine_id: str, version: str) -> plan_pb2.PlanRequest:
    request = load_request(str(EXAMPLES / name))
    request.engine_id = engine_id
    request.options.engine_version = version
    return request


async def _scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())


async def test_prefix_cache_facts_what_if_and_metric_through_the_server() -> None:
    running = await start_server(TEST_SETTINGS)
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=30) as client:
            qwen = _request("qwen3-next-80b-a3b-mtp.yaml", "qwen-a", "vllm-0.32")
            qwen.shared_prefix_tokens = 4000
            response = (await client.plan(qwen)).response
            setup = setup_from_plan(request_from_proto(qwen), response)
            f = facts(setup)
            pc = response.diagnostics.prefix_cache
            assert pc.effectively_on and pc.hit_unit_tokens == f.unit == 528
            assert list(pc.group_hit_unit_tokens) == list(f.group_units)
            assert pc.min_shared_prefix_tokens == f.min_shared_prefix == 1056
            # No shorter prefix of a longer stored prompt hits: one unit and the drop.
            assert pc.min_any_hit_prefix_tokens == f.min_any_hit_prefix == 1056
            assert pc.min_any_hit_stored_tokens == f.min_any_hit_stored_tokens == 1056
            assert list(pc.drop_group_ids) == [g.group_id for g in response.groups if g.is_draft]
            assert pc.drop_tokens == 528 and pc.rule_exact and pc.boundary_only
            assert pc.boundary_block_tokens == 528 and list(pc.mamba_checkpoint_tokens) == [528]
            answer = what_if(setup, f, 4000)
            assert pc.what_if.shared_prefix_tokens == 4000
            assert pc.what_if.cached_tokens_prefix_stored == answer.prefix_stored == 3168
            assert pc.what_if.cached_tokens_prefix_diverges == answer.prefix_diverges == 0
            # The next request after that first one: 0.32's draft drop takes a block
            # off full attention's 3,696, so the first's junction (where it keeps its
            # Mamba state) and the next one's hit are 3,168.
            assert pc.what_if.cached_tokens_next_request == answer.next_request == 3168
            assert summary(pc).startswith(
                "prefix cache: hits in 528-token units; a prompt sent again hits only from "
                "1,056 tokens"
            )
            codes = {plan_pb2.WarningCode.Name(w.code) for w in response.diagnostics.warnings}
            assert {
                "WARNING_CODE_PREFIX_DRAFT_DROP",
                "WARNING_CODE_PREFIX_LARGE_HIT_UNIT",
                "WARNING_CODE_PREFIX_BOUNDARY_ONLY",
            } <= codes

            # A repeat is answered from the cache, another engine of equal content
            # reuses the body: both carry the same prediction.
            again = (await client.plan(qwen)).response
            qwen.engine_id = "qwen-b"
            reused = (await client.plan(qwen)).response
            assert again.diagnostics == response.diagnostics == reused.diagnostics
            assert reused.engine_id == "qwen-b"
            # Another question about the same engine: the model plan is kept (only
            # budgeted), the answer is the new one.
            qwen.engine_id, qwen.shared_prefix_tokens = "qwen-c", 2000
            other = (await client.plan(qwen)).response
            assert other.diagnostics.prefix_cache.what_if.cached_tokens_prefix_stored == (
                what_if(setup, f, 2000).prefix_stored
            )

            # A prefix longer than any request is the caller's mistake, named.
            qwen.shared_prefix_tokens = 262_145
            with pytest.raises(PlannerError) as refused:
                await client.plan(qwen)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in refused.value.violations] == ["shared_prefix_tokens"]
            assert "longer than the plan's max_model_len 262,144" in str(refused.value)

            # Without a drop the client's rule is the core's simulation.
            llama = (
                await client.plan(_request("llama-3.1-8b.yaml", "llama", "vllm-0.34"))
            ).response
            lpc = llama.diagnostics.prefix_cache
            assert lpc.rule_exact and not lpc.HasField("what_if")
            lsetup = setup_from_plan(
                request_from_proto(_request("llama-3.1-8b.yaml", "x", "vllm-0.34")), llama
            )
            for n in (0, 63, 64, 65, 1000, 4096):
                assert client_cached_tokens(lpc, n) == cached_tokens(lsetup, n, n, n + 64)
            # The stated rule with a drop beside Mamba groups: exact, as the what-if.
            assert client_cached_tokens(pc, 4000) == pc.what_if.cached_tokens_prefix_stored

        body = await _scrape(running.metrics_port)
        # Engines planned (computed or reused), not cache hits: qwen-a, -b and -c.
        for code in ("draft_drop", "large_hit_unit", "boundary_only"):
            assert f'kvplan_prefix_cache_warnings_total{{code="{code}"}} 3.0' in body, code
        # qwen-c and the refused what-if: the model plan is kept, only budgeted.
        assert "kvplan_model_plans_reused_total 2.0" in body
        assert 'code="cache_off"' not in body
    finally:
        await running.stop(0)


def test_the_client_rule_on_every_example_and_release() -> None:
    """In-process: the client's rule against the core's simulation on every example
    engine under every rule set, at N around each unit and the minimum."""
    from kvplan.convert import plan_from_proto

    exact = 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for version in ("", "vllm-0.32", "vllm-0.33", "vllm-0.34"):
            request = _request(path.name, "e", version)
            try:
                response = plan_from_proto(request)
            except InvalidRequest:  # an example using what this release lacks
                continue
            pc = response.diagnostics.prefix_cache
            setup = setup_from_plan(request_from_proto(request), response)
            if not pc.rule_exact or not pc.effectively_on:
                continue
            exact += 1
            unit, low = pc.hit_unit_tokens, pc.min_shared_prefix_tokens
            tail = unit + pc.hash_lookahead_tokens
            for n in {0, 1, low - 1, low, low + 1, 2 * low, 3 * unit - 1, 3 * unit, 7 * unit + 5}:
                if n >= 0:
                    expected = cached_tokens(setup, n, n, n + tail)
                    assert client_cached_tokens(pc, n) == expected, (path.name, version, n)
    assert exact >= 20


def test_prefix_caching_turned_off_on_purpose_draws_no_warning() -> None:
    from kvplan.convert import plan_from_proto

    request = _request("llama-3.1-8b.yaml", "e", "vllm-0.34")
    request.options.enable_prefix_caching = False
    response = plan_from_proto(request)
    pc = response.diagnostics.prefix_cache
    assert not pc.effectively_on and pc.off_reason == plan_pb2.PREFIX_CACHE_OFF_REASON_DISABLED
    assert pc.hit_unit_tokens == pc.min_shared_prefix_tokens == 0 and pc.off_detail
    names = [plan_pb2.WarningCode.Name(w.code) for w in response.diagnostics.warnings]
    assert not [name for name in names if name.startswith("WARNING_CODE_PREFIX_")], names
    assert summary(pc).startswith("prefix cache: no hit ever (prefix caching is disabled")


async def test_the_next_request_is_answered_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under 0.33 the first request sharing a 4,000-token system prompt with an
    earlier one gets nothing, the next one 3,696 tokens (7 units of 528) at the
    first's junction, as vLLM 0.33's manager does (tests/test_prefix_against_vllm.py);
    the simulation runs in a worker thread, not on the server's event loop."""
    from kvplan.convert import render

    threads: list[threading.Thread] = []

    def recorded(*args: Any) -> WhatIf:
        threads.append(threading.current_thread())
        return what_if(*args)

    monkeypatch.setattr(render, "what_if", recorded)
    running = await start_server(TEST_SETTINGS)
    try:
        async with AsyncPlannerClient(f"127.0.0.1:{running.port}", timeout_s=30) as client:
            qwen = _request("qwen3-next-80b-a3b-mtp.yaml", "qwen-33", "vllm-0.33")
            await client.plan(qwen)
            assert threads == []  # not asked, not simulated
            qwen.shared_prefix_tokens = 4000
            answer = (await client.plan(qwen)).response.diagnostics.prefix_cache.what_if
            assert (answer.cached_tokens_prefix_diverges, answer.cached_tokens_next_request) == (
                0,
                3696,
            )
            assert len(threads) == 1 and threads[0] is not threading.main_thread()
    finally:
        await running.stop(0)


def test_the_what_if_is_bounded_in_simulation_steps() -> None:
    from kvplan.convert import plan_from_proto

    request = _request("llama-3.1-8b.yaml", "e", "")  # 16-token units and steps
    request.options.max_model_len = request.options.derived_max_model_len = 1 << 20
    for worker in request.workers:
        worker.memory.kv_cache_memory_bytes = 1 << 40
    request.shared_prefix_tokens = 32_768 * 16
    assert plan_from_proto(request).diagnostics.prefix_cache.what_if.shared_prefix_tokens
    request.shared_prefix_tokens += 16
    with pytest.raises(InvalidRequest, match="at most 32,768") as refused:
        plan_from_proto(request)
    assert refused.value.field == "shared_prefix_tokens"
    # conformance's reference/r23b: a 1-token hidden-state cache beside 96-token
    # attention. Its hits are in 96-token units but the simulation walks 1-token
    # steps: bounded in units, 32,768 of them took 15.7 s; in steps, 32,768 tokens.
    layers = [full("f.0", 1), sw("s.0", 1024, 1), hidden("h.0", 1, 24576)]
    fine = generated_request(W(layers, 1 << 40), max_model_len=1 << 20)
    fine.shared_prefix_tokens = 32_768
    assert plan_from_proto(fine).diagnostics.prefix_cache.hit_unit_tokens == 96
    fine.shared_prefix_tokens = 32_769 + 95
    steps = "spans 32,864 of the prefix-cache simulation's 1-token steps"
    with pytest.raises(InvalidRequest, match=steps) as refused:
        plan_from_proto(fine)
    assert refused.value.field == "shared_prefix_tokens"


# Each family whose groups keep a stored prompt's state only near its end, its
# request file, its Hugging Face config (kvplan plan --model) and the knob named.
REPEATED_PROMPTS_ONLY_FAMILIES = [
    ("qwen3-next-80b-a3b-mtp.yaml", "qwen3-next-80b-a3b", "knob: none"),
    ("jamba-mini.yaml", "jamba-defaults", "knob: none"),
    ("gpt-oss-20b-eagle3.yaml", "gpt-oss-120b", "knob: --disable-hybrid-kv-cache-manager"),
]
RULE_SETS = ("", "vllm-0.32", "vllm-0.33", "vllm-0.34")


def _planned(name: str, version: str) -> tuple[plan_pb2.PlanRequest, plan_pb2.PlanResponse]:
    from kvplan.convert import plan_from_proto

    request = _request(name, "e", version)
    if version == "vllm-0.32":  # no is_draft in 0.32: the drafter comes unflagged
        for worker in request.workers:
            for layer in worker.layers:
                layer.ClearField("is_draft")
    return request, plan_from_proto(request)


def _boundary_warning(response: plan_pb2.PlanResponse) -> str:
    return "".join(
        w.message
        for w in response.diagnostics.warnings
        if w.code == plan_pb2.WARNING_CODE_PREFIX_BOUNDARY_ONLY
    )


@pytest.mark.parametrize("version", RULE_SETS)
@pytest.mark.parametrize(("example", "model", "knob"), REPEATED_PROMPTS_ONLY_FAMILIES)
def test_shorter_shared_prefixes_get_nothing_and_every_plan_says_so(
    example: str, model: str, knob: str, version: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvplan.cli import main
    from kvplan.core.prefix_warnings import REPEATED_PROMPTS_ONLY

    request, response = _planned(example, version)
    message = _boundary_warning(response)
    assert REPEATED_PROMPTS_ONLY in message and knob in message, message
    # What it says is what kvplan's model of the release's manager does: a stored
    # prompt of 6,000 tokens, requests sharing less of it get nothing, the same
    # prompt again (the next turn) hits.
    setup = setup_from_plan(request_from_proto(request), response)
    unit, stored = response.diagnostics.prefix_cache.hit_unit_tokens, 6_000
    for shared in (unit, 2 * unit, stored // 2, stored - 2 * unit - 1):
        assert cached_tokens(setup, shared, stored, shared + 500) == 0, shared
    assert cached_tokens(setup, stored, stored, stored + 500) > 0

    # The plan output, for the request file and for the model's HF config.
    path = EXAMPLES / example
    if version != "vllm-0.32":
        assert main(["plan", str(path), *(["--engine-version", version] if version else [])]) == 0
        assert f"warning: {REPEATED_PROMPTS_ONLY}" in capsys.readouterr().out
    args = ["plan", "--model", str(EXAMPLES / "models" / model), "--gpu", "H200", "-tp", "2"]
    assert main([*args, *(["--engine-version", version] if version else [])]) == 0
    out = capsys.readouterr().out
    assert f"warning: {REPEATED_PROMPTS_ONLY}" in out and knob in out, out


@pytest.mark.parametrize("version", RULE_SETS)
def test_whole_context_models_get_no_repeated_prompts_warning(version: str) -> None:
    # Full attention keeps every block of a stored prompt: shorter prefixes hit.
    for example in ("llama-3.1-8b.yaml", "deepseek-v3-mtp.yaml"):
        assert _boundary_warning(_planned(example, version)[1]) == ""
    # Gemma 3's 1,024-token window is shorter than most prompts: warned, with it.
    gemma = _boundary_warning(_planned("gemma-3-27b.yaml", version)[1])
    assert "1,024-token sliding window" in gemma, gemma
