"""The model runner: `use_v2_model_runner` unset is the release's default, and each
runner refuses what it lacks (vLLM 0.32 / 0.33's VllmConfig); parallel drafting
follows each release (issue 31, section 4). The differential check runs the same
engines through vLLM's own configuration (tests/conformance/build.py)."""

from __future__ import annotations

import pytest

from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import InvalidRequest
from kvplan.core.model_runner import RunnerInputs, choose_model_runner
from kvplan.core.rules import rule_set_for
from kvplan.v1 import plan_pb2, spec_pb2

GIB = 1 << 30
TWO_RUNNERS = ["", "vllm-0.32", "vllm-0.33"]  # kvplan's own rules follow 0.33


def _engine(
    engine_version: str,
    method: str = "none",
    *,
    tokens: int = 2,
    pp: int = 1,
    async_scheduling: bool = False,
    v2: bool | None = None,
    parallel_drafting: bool | None = None,
    batched: int = 0,
) -> plan_pb2.PlanRequest:
    request = plan_pb2.PlanRequest(engine_id="runner-test")
    options = request.options
    options.max_model_len = 8192
    options.engine_version = engine_version
    options.async_scheduling = async_scheduling
    options.parallel.pipeline_parallel_size = pp
    options.max_num_batched_tokens = batched
    if v2 is not None:
        options.use_v2_model_runner = v2
    for rank in range(pp):
        worker = request.workers.add(rank=rank)
        worker.memory.kv_cache_memory_bytes = GIB
        for index in range(2):
            layer = spec_pb2.LayerSpec(name=f"layers.{rank * 2 + index}.attn")
            layer.full_attention.attention.num_kv_heads = 8
            layer.full_attention.attention.head_size = 128
            worker.layers.append(layer)
    if method != "none":
        request.spec_decode.method = plan_pb2.SpecDecodeMethod.Value(
            f"SPEC_DECODE_METHOD_{method.upper()}"
        )
        request.spec_decode.num_speculative_tokens = tokens
    if parallel_drafting is not None:
        request.spec_decode.parallel_drafting = parallel_drafting
    return request


def _refusal(request: plan_pb2.PlanRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    return refused.value


def test_the_field_is_tri_state_on_the_wire() -> None:
    """Unset is told apart from false; a client of the earlier plain bool that sent
    true is read as asking for V2 (same field number and wire type)."""
    options = plan_pb2.EngineOptions()
    assert not options.HasField("use_v2_model_runner")
    options.use_v2_model_runner = False
    assert options.HasField("use_v2_model_runner")
    # Field 10, varint 1: what the plain bool wrote for true.
    decoded = plan_pb2.EngineOptions.FromString(bytes([10 << 3, 1]))
    assert decoded.HasField("use_v2_model_runner") and decoded.use_v2_model_runner


@pytest.mark.parametrize("engine_version", TWO_RUNNERS)
def test_v1_refuses_pipeline_parallelism_with_async_scheduling(engine_version: str) -> None:
    """vLLM 0.32 / 0.33: 'Model Runner V1 does not support: pipeline parallelism with
    async scheduling'. Unset, the runner is V2, which runs it."""
    refused = _refusal(_engine(engine_version, pp=2, async_scheduling=True, v2=False))
    assert refused.field == "options.use_v2_model_runner"
    assert "pipeline parallelism" in refused.message and "async" in refused.message
    plan_from_proto(_engine(engine_version, pp=2, async_scheduling=True))
    plan_from_proto(_engine(engine_version, pp=2, async_scheduling=False, v2=False))


def test_0_34_has_only_v2() -> None:
    """vLLM 0.34 has no V1 runner: the field changes nothing there."""
    plan_from_proto(_engine("vllm-0.34", "dspark", pp=2, async_scheduling=True, v2=False))
    plan_from_proto(_engine("vllm-0.34", "suffix", v2=True))


@pytest.mark.parametrize("engine_version", TWO_RUNNERS)
def test_v1_refuses_dspark(engine_version: str) -> None:
    refused = _refusal(_engine(engine_version, "dspark", v2=False))
    assert refused.field == "options.use_v2_model_runner" and "dspark" in refused.message
    plan_from_proto(_engine(engine_version, "dspark"))


@pytest.mark.parametrize("engine_version", TWO_RUNNERS)
def test_v2_refuses_suffix_and_unset_falls_back_to_v1(engine_version: str) -> None:
    refused = _refusal(_engine(engine_version, "suffix", v2=True))
    assert refused.field == "options.use_v2_model_runner" and "suffix" in refused.message
    plan_from_proto(_engine(engine_version, "suffix"))
    # Unset, suffix runs on V1, so V1's refusal of pp > 1 with async applies.
    refused = _refusal(_engine(engine_version, "suffix", pp=2, async_scheduling=True))
    assert refused.field == "options.async_scheduling"


def test_unset_runner_is_v2_in_flight_batches() -> None:
    """Unset means V2 (pp + 1 batches under async scheduling), not V1 as before."""
    engine = request_from_proto(_engine("vllm-0.33", pp=2, async_scheduling=True, batched=1000))
    assert engine.options.use_v2_model_runner
    assert engine.options.max_in_flight_tokens(engine.rules) == 3 * 1000
    explicit = request_from_proto(_engine("vllm-0.33", pp=2, batched=1000, v2=False))
    assert not explicit.options.use_v2_model_runner


@pytest.mark.parametrize("engine_version", TWO_RUNNERS)
def test_hisparse_refuses_v1_asked_for(engine_version: str) -> None:
    inputs = RunnerInputs(
        asked=False,
        hisparse=True,
        method="none",
        parallel_drafting=False,
        pipeline_parallel_size=1,
        async_scheduling=False,
    )
    with pytest.raises(InvalidRequest) as refused:
        choose_model_runner(rule_set_for(engine_version), inputs)
    assert refused.value.field == "options.use_v2_model_runner"


@pytest.mark.parametrize("engine_version", TWO_RUNNERS)
def test_parallel_drafting_runs_on_v1_in_0_32_and_0_33(engine_version: str) -> None:
    """0.32 / 0.33 take parallel drafting for any method, through the V1 runner:
    unset, the runner falls back to V1; V2 asked for refuses it."""
    plan_from_proto(_engine(engine_version, "eagle", tokens=3, parallel_drafting=True))
    refused = _refusal(_engine(engine_version, "eagle", tokens=3, parallel_drafting=True, v2=True))
    assert refused.field == "options.use_v2_model_runner"
    assert "parallel drafting" in refused.message
    plan_from_proto(_engine(engine_version, "dflash", tokens=3, parallel_drafting=True, v2=True))


def test_parallel_drafting_takes_slots_in_0_32() -> None:
    """0.32 counts a parallel EAGLE drafter's K - 1 slots (3 tokens: 2)."""
    request = _engine("vllm-0.32", "eagle", tokens=3, parallel_drafting=True, batched=2)
    assert _refusal(request).field == "options.max_num_batched_tokens"
    request.options.max_num_batched_tokens = 3
    plan_from_proto(request)
    plan_from_proto(_engine("vllm-0.32", "eagle", tokens=3, batched=2))


@pytest.mark.parametrize("method", ["eagle", "mtp", "ngram", "draft_model"])
def test_0_34_takes_parallel_drafting_for_dflash_and_dspark_only(method: str) -> None:
    refused = _refusal(_engine("vllm-0.34", method, tokens=3, parallel_drafting=True))
    assert refused.field == "spec_decode.parallel_drafting" and method in refused.message
    plan_from_proto(_engine("vllm-0.34", method, tokens=3, parallel_drafting=False))
    plan_from_proto(_engine("vllm-0.34", "dspark", tokens=3, parallel_drafting=True))
