"""The wire converter: proto <-> domain, defaults, validation, content addressing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from google.protobuf import json_format

from kvplan.convert import plan_from_proto
from kvplan.convert.keys import plan_id_for, plan_keys
from kvplan.convert.render import spec_to_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import InsufficientMemory, InvalidRequest, UnplannableSpecs
from kvplan.core.rules import rule_set_for
from kvplan.core.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvplan.gpus import CATALOG
from kvplan.v1 import plan_pb2, spec_pb2

GIB = 1 << 30
SCENARIOS = Path(__file__).parent / "conformance" / "scenarios"


def full_layer(name: str, heads: int = 8, head: int = 128) -> spec_pb2.LayerSpec:
    layer = spec_pb2.LayerSpec(name=name)
    layer.full_attention.attention.num_kv_heads = heads
    layer.full_attention.attention.head_size = head
    return layer


def sliding_layer(name: str, window: int = 1024) -> spec_pb2.LayerSpec:
    layer = spec_pb2.LayerSpec(name=name)
    layer.sliding_window.attention.num_kv_heads = 8
    layer.sliding_window.attention.head_size = 128
    layer.sliding_window.sliding_window = window
    return layer


def engine(*stages: list[spec_pb2.LayerSpec], kv_bytes: int = 4 * GIB) -> plan_pb2.PlanRequest:
    request = plan_pb2.PlanRequest(engine_id="convert-test")
    request.options.max_model_len = 8192
    for rank, layers in enumerate(stages):
        worker = request.workers.add(rank=rank)
        worker.device.uuid = f"GPU-{rank}"
        worker.memory.kv_cache_memory_bytes = kv_bytes
        worker.layers.extend(layers)
    return request


def test_defaults_block_size_dtype_and_utilization() -> None:
    request = engine([full_layer("l0")])
    domain = request_from_proto(request)
    spec = domain.workers[0].layers[0][1]
    assert isinstance(spec, FullAttentionSpec)
    assert spec.block_size == 16  # vLLM's default block size
    assert spec.dtype.size_bytes == 2  # auto cache dtype on a bf16 model
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2


def test_domain_spec_round_trips_through_the_wire() -> None:
    request = engine([full_layer("f"), sliding_layer("s", 4096)])
    ctx_specs = [spec for _, spec in request_from_proto(request).workers[0].layers]
    for spec in ctx_specs:
        again = engine([spec_to_proto(spec, "x")])
        (back,) = [s for _, s in request_from_proto(again).workers[0].layers]
        assert back == spec
        assert back.page_size_bytes == spec.page_size_bytes
    assert isinstance(ctx_specs[1], SlidingWindowSpec)
    assert ctx_specs[1].sliding_window == 4096


def test_mamba_state_round_trip() -> None:
    layer = spec_pb2.LayerSpec(name="m")
    layer.mamba.states.add(shape=[3, 2048], dtype=spec_pb2.DTYPE_BFLOAT16)
    layer.mamba.states.add(shape=[8, 128, 128], dtype=spec_pb2.DTYPE_FLOAT32)
    (spec,) = [s for _, s in request_from_proto(engine([layer])).workers[0].layers]
    assert isinstance(spec, MambaSpec)
    assert spec.page_size_bytes == 3 * 2048 * 2 + 8 * 128 * 128 * 4
    (back,) = [
        s for _, s in request_from_proto(engine([spec_to_proto(spec, "m")])).workers[0].layers
    ]
    assert back == spec


def test_plan_id_ignores_worker_order_but_not_content() -> None:
    forward = engine([full_layer("a")], [full_layer("b")])
    backward = plan_pb2.PlanRequest()
    backward.CopyFrom(forward)
    del backward.workers[:]
    backward.workers.extend(reversed(forward.workers))
    assert plan_id_for(forward) == plan_id_for(backward)
    changed = plan_pb2.PlanRequest()
    changed.CopyFrom(forward)
    changed.workers[1].memory.kv_cache_memory_bytes += 1
    assert plan_id_for(changed) != plan_id_for(forward)
    assert plan_from_proto(forward).SerializeToString(deterministic=True) == plan_from_proto(
        backward
    ).SerializeToString(deterministic=True)


def test_plan_id_is_stable_across_releases() -> None:
    """Plan ids are stored addresses (GetPlan, replicas of several releases on one
    store): the same request must keep its id. The content key leaves out the engine id."""
    request = engine([full_layer("a")], [full_layer("b")])
    request.engine_id = "engine-a"
    keys = plan_keys(request)
    assert keys.plan_id == plan_id_for(request) == "plan-4735b76cb10d856a9d851c2aee255f33"
    renamed = plan_pb2.PlanRequest()
    renamed.CopyFrom(request)
    renamed.engine_id = "engine-b"
    assert plan_keys(renamed).content == keys.content
    assert plan_keys(renamed).plan_id != keys.plan_id


def test_device_name_resolves_total_memory() -> None:
    # Every catalog name and alias, in any case, means its one catalog figure.
    for gpu in CATALOG:
        for name in (gpu.name, *gpu.aliases, gpu.name.lower()):
            request = engine([full_layer("l0")])
            worker = request.workers[0]
            worker.memory.gpu_memory_utilization = 0.9
            worker.device.name = name
            domain = request_from_proto(request)
            assert domain.workers[0].device.total_memory_bytes == gpu.total_memory_bytes, name


def test_duplicate_rank_names_the_field() -> None:
    request = engine([full_layer("a")], [full_layer("b")])
    request.workers[1].rank = 0
    with pytest.raises(InvalidRequest) as caught:
        plan_from_proto(request)
    assert caught.value.field == "workers[1].rank"


def test_tokens_per_state_above_block_size_is_invalid() -> None:
    layer = spec_pb2.LayerSpec(name="mla", block_size=16)
    layer.mla_attention.attention.num_kv_heads = 1
    layer.mla_attention.attention.head_size = 576
    layer.mla_attention.attention.tokens_per_state.tokens = 128
    with pytest.raises(InvalidRequest) as caught:
        plan_from_proto(engine([layer]))
    assert (
        caught.value.field == "workers[0].layers[0].mla_attention.attention.tokens_per_state.tokens"
    )
    assert "block_size" in str(caught.value)


def test_empty_budget_is_reported_before_a_spec_limit() -> None:
    # vLLM checks for an empty budget before asking any spec for its memory bound,
    # so a DCP + sliding-window engine with no memory is a memory error.
    request = engine([sliding_layer("s")], kv_bytes=0)
    request.options.parallel.tensor_parallel_size = 2
    request.options.parallel.decode_context_parallel_size = 2
    with pytest.raises(InsufficientMemory, match="No available memory"):
        plan_from_proto(request)


@pytest.mark.parametrize("pool_gib", [math.inf, 1e300, float(1 << 21), math.nan, 0.0])
def test_a_hisparse_host_pool_beyond_any_machine_is_refused_by_name(pool_gib: float) -> None:
    """The pool's bytes must fit the plan: infinity once reached the planner as an
    OverflowError (an INTERNAL answer)."""
    scenario = json.loads(
        (SCENARIOS / "94-hisparse-groups-and-host-pool.json").read_text(encoding="utf-8")
    )
    request = json_format.ParseDict(scenario["request"], plan_pb2.PlanRequest())
    plan_from_proto(request)  # as given, it plans
    request.options.hisparse.host_pool_gib = pool_gib
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    assert refused.value.field == "options.hisparse.host_pool_gib"


def test_a_scheduler_block_past_32_bits_names_what_made_it() -> None:
    """Block sizes times decode context parallelism, or block sizes with little in
    common, can make a scheduler block the reply cannot carry: the refusal names the
    setting (it was a 64-bit overflow blamed on `workers`)."""
    request = engine([full_layer(f"layers.{index}") for index in range(4)])
    request.options.parallel.decode_context_parallel_size = 2**32 - 1
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    assert refused.value.field == "options.parallel.decode_context_parallel_size"
    coprime = engine([full_layer("a"), sliding_layer("b")])
    coprime.workers[0].layers[0].block_size = 65537
    coprime.workers[0].layers[1].block_size = 65539
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(coprime)
    assert refused.value.field == "workers"
    assert "least common multiple" in str(refused.value)


def test_an_override_that_leaves_no_block_says_so() -> None:
    """num_gpu_blocks_override 1 is all null block: the advice is about the override,
    not gpu_memory_utilization, which then sizes nothing."""
    request = engine([full_layer(f"layers.{index}") for index in range(4)])
    request.options.num_gpu_blocks_override = 1
    with pytest.raises(InsufficientMemory) as refused:
        plan_from_proto(request)
    assert "No available memory" in str(refused.value)
    assert "num_gpu_blocks_override 1 leaves no block" in str(refused.value)
    assert "gpu_memory_utilization" not in str(refused.value)


def test_an_override_of_zero_blocks_is_one_vllm_takes() -> None:
    """num_gpu_blocks_override 0 is an override, as in vLLM: a pool of no blocks, which
    the memory check refuses (not a field kvplan refuses up front); a model whose
    layers need no KV cache plans with it, as there."""
    request = engine([full_layer(f"layers.{index}") for index in range(4)])
    request.options.num_gpu_blocks_override = 0
    with pytest.raises(InsufficientMemory) as refused:
        plan_from_proto(request)
    assert "num_gpu_blocks_override 0 leaves no block" in str(refused.value)
    encoder = engine([])
    encoder.workers[0].layers.add(name="encoder.0").encoder_only_attention.attention.CopyFrom(
        full_layer("x").full_attention.attention
    )
    encoder.options.num_gpu_blocks_override = 0
    assert plan_from_proto(encoder).workers[0].encoder_only_layers == ["encoder.0"]


@pytest.mark.parametrize("engine_version", ["", "vllm-0.32", "vllm-0.33", "vllm-0.34"])
def test_a_top_k_buffer_on_a_sliding_window_mla_layer_is_refused_by_name(
    engine_version: str,
) -> None:
    """Only (sparse) MLA layers have a top-k index buffer: on a sliding-window MLA
    layer the field is INVALID_ARGUMENT naming it, not a crash building the spec."""
    layer = spec_pb2.LayerSpec(name="layers.0.swa")
    layer.sliding_window_mla.attention.num_kv_heads = 1
    layer.sliding_window_mla.attention.head_size = 576
    layer.sliding_window_mla.sliding_window = 128
    layer.sliding_window_mla.mla.topk_buffer_width = 0
    request = engine([layer])
    request.options.engine_version = engine_version
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    assert refused.value.field == "workers[0].layers[0].sliding_window_mla.mla.topk_buffer_width"


@pytest.mark.parametrize("engine_version", ["", "vllm-0.32", "vllm-0.33", "vllm-0.34"])
def test_hidden_state_caches_of_different_specs_alone_are_unplannable(
    engine_version: str,
) -> None:
    """Hidden-state caches of differing specs are grouped only beside other layers,
    whose common page they are aligned to. With no other layer every release's
    grouping has nothing to size its groups by and fails; kvplan refuses the engine
    (FAILED_PRECONDITION), where it crashed with a ValueError. One spec alone plans."""
    layers = []
    for index, block in enumerate((None, 32)):
        layer = spec_pb2.LayerSpec(name=f"layers.{index}.hidden")
        layer.hidden_state_cache.attention.num_kv_heads = 1
        layer.hidden_state_cache.attention.head_size = 4096
        layer.hidden_state_cache.attention.dtype = spec_pb2.DTYPE_BFLOAT16
        if block is not None:
            layer.block_size = block
        layers.append(layer)
    request = engine(layers)
    request.options.engine_version = engine_version
    with pytest.raises(UnplannableSpecs, match="hidden-state cache"):
        plan_from_proto(request)
    request.workers[0].layers[1].ClearField("block_size")
    assert plan_from_proto(request).workers[0].num_blocks > 1


def _set(request: plan_pb2.PlanRequest, path: str, value: int) -> None:
    """Set a field of the request's first layer (`layer.` paths) or of its options."""
    owner, _, name = path.rpartition(".")
    target: object = request
    for part in owner.split("."):
        target = request.workers[0].layers[0] if part == "layer" else getattr(target, part)
    setattr(target, name, value)


@pytest.mark.parametrize("engine_version", ["", "vllm-0.32", "vllm-0.33", "vllm-0.34"])
@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("options.derived_max_model_len", "options.derived_max_model_len"),
        ("layer.block_size", "workers[0].layers[0].block_size"),
        (
            "layer.full_attention.sliding_window",
            "workers[0].layers[0].full_attention.sliding_window",
        ),
        (
            "layer.full_attention.attention_chunk_size",
            "workers[0].layers[0].full_attention.attention_chunk_size",
        ),
        *(
            (
                f"layer.full_attention.attention.{name}",
                f"workers[0].layers[0].full_attention.attention.{name}",
            )
            for name in (
                "max_tp_shards",
                "num_head_slots",
                "state_content_bytes",
                "page_size_padded_bytes",
            )
        ),
    ],
)
def test_a_zero_no_backend_publishes_is_refused_by_name(
    engine_version: str, path: str, field: str
) -> None:
    """D11: a count or size that must be at least 1, set to 0, is INVALID_ARGUMENT on
    its field in every rule set (vLLM's planner takes it as given)."""
    request = engine([full_layer("layers.0")])
    request.options.engine_version = engine_version
    _set(request, path, 0)
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    assert refused.value.field == field
    assert "must be >= 1" in str(refused.value)


def test_a_v_head_size_on_an_mla_layer_is_refused_by_name() -> None:
    """D11: MLA keeps one latent vector per token; a V head size is a mistake."""
    layer = spec_pb2.LayerSpec(name="layers.0.mla")
    layer.mla_attention.attention.num_kv_heads = 1
    layer.mla_attention.attention.head_size = 576
    layer.mla_attention.attention.head_size_v = 1
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(engine([layer]))
    assert refused.value.field == "workers[0].layers[0].mla_attention.attention.head_size_v"


RELEASE_RULE_SETS = ["vllm-0.32", "vllm-0.33", "vllm-0.34"]


def _hisparse_engine() -> plan_pb2.PlanRequest:
    scenario = json.loads(
        (SCENARIOS / "94-hisparse-groups-and-host-pool.json").read_text(encoding="utf-8")
    )
    return json_format.ParseDict(scenario["request"], plan_pb2.PlanRequest())


@pytest.mark.parametrize("engine_version", ["", *RELEASE_RULE_SETS])
@pytest.mark.parametrize(
    ("option", "field"),
    [
        ("pipeline", "options.parallel.pipeline_parallel_size"),
        ("dcp", "options.parallel.decode_context_parallel_size"),
        ("no_hybrid_manager", "options.disable_hybrid_kv_cache_manager"),
    ],
)
def test_hisparse_refuses_what_vllm_s_engine_configuration_refuses(
    engine_version: str, option: str, field: str
) -> None:
    """VllmConfig refuses HiSparse with pipeline stages, with DCP, or without the
    hybrid KV cache manager before any worker starts (vLLM 0.32-0.34 alike)."""
    request = _hisparse_engine()
    request.options.engine_version = engine_version
    plan_from_proto(request)  # as given, it plans
    if option == "pipeline":
        request.options.parallel.pipeline_parallel_size = 2
    elif option == "dcp":
        request.options.parallel.tensor_parallel_size = 2
        request.options.parallel.decode_context_parallel_size = 2
    else:
        request.options.disable_hybrid_kv_cache_manager = True
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    assert refused.value.field == field


@pytest.mark.parametrize("engine_version", ["", *RELEASE_RULE_SETS])
@pytest.mark.parametrize(("tp", "dcp"), [(1, 4), (2, 4), (6, 4)])
def test_a_dcp_size_that_does_not_divide_tp_is_refused(
    engine_version: str, tp: int, dcp: int
) -> None:
    """vLLM's ParallelConfig wants DCP to divide TP (it shards over the TP ranks):
    no engine runs such a configuration, under any rule set."""
    request = engine([full_layer("layers.0")])
    request.options.engine_version = engine_version
    request.options.parallel.tensor_parallel_size = tp
    request.options.parallel.decode_context_parallel_size = dcp
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    assert refused.value.field == "options.parallel.decode_context_parallel_size"
    assert f"{dcp} does not divide tensor_parallel_size {tp}" in str(refused.value)
    request.options.parallel.tensor_parallel_size = dcp * 2
    plan_from_proto(request)


@pytest.mark.parametrize("engine_version", ["", *RELEASE_RULE_SETS])
def test_cross_attention_is_sized_by_the_engines_encoder_budget(engine_version: str) -> None:
    """vLLM derives max_num_encoder_input_tokens from max_num_batched_tokens, but the
    engine's value can differ from the batch it reports (the CPU platform raises the
    batch of MLA models afterwards): the request's value sizes cross-attention."""
    cross = spec_pb2.LayerSpec(name="layers.0.encoder_attn")
    cross.cross_attention.attention.num_kv_heads = 8
    cross.cross_attention.attention.head_size = 64
    request = engine([cross])
    request.options.engine_version = engine_version
    request.options.block_size = 16
    request.options.max_num_batched_tokens = 2048
    request.options.max_num_encoder_input_tokens = 1500
    assert plan_from_proto(request).workers[0].blocks_per_request == 94  # 1500 / 16
    request.options.ClearField("max_num_encoder_input_tokens")  # derived: the batch
    assert plan_from_proto(request).workers[0].blocks_per_request == 128


@pytest.mark.parametrize("engine_version", ["", *RELEASE_RULE_SETS])
def test_nvfp4_ds_mla_under_dcp_is_refused_by_0_34_only(engine_version: str) -> None:
    """0.34's VllmConfig refuses the nvfp4_ds_mla cache with DCP > 1."""
    layer = spec_pb2.LayerSpec(name="layers.0.mla")
    layer.mla_attention.attention.num_kv_heads = 1
    layer.mla_attention.attention.head_size = 576
    request = engine([layer], [layer])
    request.options.engine_version = engine_version
    request.options.cache_dtype = spec_pb2.KV_CACHE_DTYPE_NVFP4_DS_MLA
    request.options.parallel.tensor_parallel_size = 2
    request.options.parallel.decode_context_parallel_size = 2
    if engine_version != "vllm-0.34":
        plan_from_proto(request)
        return
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    assert refused.value.field == "options.cache_dtype"


@pytest.mark.parametrize("engine_version", ["", *RELEASE_RULE_SETS])
@pytest.mark.parametrize("method", ["eagle", "mtp", "dflash", "ngram"])
def test_chunked_local_attention_with_a_hidden_state_drafter_needs_the_manager_off(
    engine_version: str, method: str
) -> None:
    """vLLM turns the hybrid manager off for chunked local attention with an EAGLE-
    family drafter, refusing an engine that asks for it on; other drafters, and an
    engine with the manager off, plan."""
    chunked = spec_pb2.LayerSpec(name="layers.0.attn")
    chunked.chunked_local_attention.attention.num_kv_heads = 8
    chunked.chunked_local_attention.attention.head_size = 128
    chunked.chunked_local_attention.attention_chunk_size = 8192
    request = engine([chunked, full_layer("layers.1.attn")])
    request.options.engine_version = engine_version
    request.spec_decode.method = plan_pb2.SpecDecodeMethod.Value(
        f"SPEC_DECODE_METHOD_{method.upper()}"
    )
    request.spec_decode.num_speculative_tokens = 1
    if method == "ngram":
        plan_from_proto(request)
        return
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    assert refused.value.field == "options.disable_hybrid_kv_cache_manager"
    request.options.disable_hybrid_kv_cache_manager = True
    plan_from_proto(request)


ALL_RULE_SETS = ["", *RELEASE_RULE_SETS]


def _drafted(
    method: str, tokens: int, engine_version: str = "", **options: int | bool
) -> plan_pb2.PlanRequest:
    request = engine([full_layer("layers.0.attn"), full_layer("layers.1.attn")])
    request.options.engine_version = engine_version
    for name, value in options.items():
        setattr(request.options, name, value)
    request.spec_decode.method = plan_pb2.SpecDecodeMethod.Value(
        f"SPEC_DECODE_METHOD_{method.upper()}"
    )
    request.spec_decode.num_speculative_tokens = tokens
    return request


def _refused_field(request: plan_pb2.PlanRequest) -> str | None:
    with pytest.raises(InvalidRequest) as refused:
        plan_from_proto(request)
    return refused.value.field


@pytest.mark.parametrize("engine_version", ALL_RULE_SETS)
@pytest.mark.parametrize("method", ["eagle", "mtp", "ngram", "draft_model"])
def test_a_drafter_without_draft_tokens_is_refused(engine_version: str, method: str) -> None:
    """SpeculativeConfig wants num_speculative_tokens > 0 in every release."""
    request = _drafted(method, 0, engine_version)
    assert _refused_field(request) == "spec_decode.num_speculative_tokens"
    request.spec_decode.num_speculative_tokens = 1
    plan_from_proto(request)


@pytest.mark.parametrize("engine_version", ALL_RULE_SETS)
def test_mtp_draft_tokens_beyond_the_modules_come_in_whole_rounds(engine_version: str) -> None:
    """SpeculativeConfig refuses more MTP draft tokens than modules unless they are
    a multiple of the module count, and a drafter of no module at all; unset, the
    module count is not checked."""
    request = _drafted("mtp", 3, engine_version)
    plan_from_proto(request)  # num_nextn_predict_layers unset
    for modules, tokens, plans in ((2, 3, False), (2, 4, True), (3, 1, True), (3, 2, True)):
        request = _drafted("mtp", tokens, engine_version)
        request.spec_decode.num_nextn_predict_layers = modules
        if plans:
            plan_from_proto(request)
        else:
            assert _refused_field(request) == "spec_decode.num_speculative_tokens"
    request = _drafted("mtp", 1, engine_version)
    request.spec_decode.num_nextn_predict_layers = 0
    assert _refused_field(request) == "spec_decode.num_nextn_predict_layers"


@pytest.mark.parametrize("engine_version", ALL_RULE_SETS)
def test_mtp_on_a_deepseek_v41_target_is_refused(engine_version: str) -> None:
    """DeepSeek-V4.1 checkpoints carry DSpark stages, no MTP modules: every release
    refuses the MTP method for it and takes DSpark."""
    request = _drafted("mtp", 1, engine_version)
    request.spec_decode.target_model_type = "deepseek_v41"
    assert _refused_field(request) == "spec_decode.method"
    request.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_DSPARK
    plan_from_proto(request)


@pytest.mark.parametrize("engine_version", ALL_RULE_SETS)
def test_medusa_exists_in_0_32_only(engine_version: str) -> None:
    """0.33's SpeculativeConfig method field has no Medusa (0.34's validator neither);
    kvplan's own rules follow 0.33."""
    request = _drafted("medusa", 2, engine_version)
    if engine_version == "vllm-0.32":
        plan_from_proto(request)
    else:
        assert _refused_field(request) == "spec_decode.method"


# (method, num_speculative_tokens 3) -> the largest max_num_batched_tokens refused:
# 0.32 counts the slots drafting adds to a request's batch, 0.33+ the lookahead.
_LARGEST_REFUSED_BATCH = {
    "vllm-0.32": {"eagle": 0, "mtp": 0, "dflash": 3, "dspark": 2, "draft_model": 1, "ngram": 0},
    "vllm-0.33": {"eagle": 3, "mtp": 3, "dflash": 4, "dspark": 3, "draft_model": 3, "ngram": 0},
}


@pytest.mark.parametrize("engine_version", ALL_RULE_SETS)
@pytest.mark.parametrize("method", ["eagle", "mtp", "dflash", "dspark", "draft_model", "ngram"])
def test_a_step_must_hold_a_token_beside_the_drafters_slots(
    engine_version: str, method: str
) -> None:
    """VllmConfig refuses max_num_batched_tokens not above the drafter's slots."""
    largest = _LARGEST_REFUSED_BATCH.get(engine_version, _LARGEST_REFUSED_BATCH["vllm-0.33"])[
        method
    ]
    if largest:
        request = _drafted(method, 3, engine_version, max_num_batched_tokens=largest)
        assert _refused_field(request) == "options.max_num_batched_tokens"
    plan_from_proto(_drafted(method, 3, engine_version, max_num_batched_tokens=largest + 1))


@pytest.mark.parametrize("engine_version", ALL_RULE_SETS)
@pytest.mark.parametrize("method", ["suffix", "medusa", "ngram", "eagle", "draft_model"])
@pytest.mark.parametrize("v2_runner", [False, True])
def test_async_scheduling_refuses_drafters_it_cannot_overlap(
    engine_version: str, method: str, v2_runner: bool
) -> None:
    """With async scheduling on, 0.32 refuses the suffix (and Medusa) drafters on any
    model runner, 0.33 (and kvplan's own rules) on the V1 runner only, 0.34 never;
    EAGLE-family, draft-model and n-gram drafters (vLLM's GPU n-gram, which the
    plugin sends as ngram, is overlapped) run everywhere."""
    if method == "medusa" and engine_version != "vllm-0.32":
        return  # no Medusa there at all
    request = _drafted(
        method, 2, engine_version, async_scheduling=True, use_v2_model_runner=v2_runner
    )
    refused = method in ("suffix", "medusa") and (
        engine_version == "vllm-0.32" or (engine_version != "vllm-0.34" and not v2_runner)
    )
    # Asked for, model runner V2 refuses the drafters it does not run (checked after
    # the async scheduling check, as VllmConfig does).
    v2_lacks = (
        v2_runner
        and engine_version != "vllm-0.34"
        and method in rule_set_for(engine_version).v2_runner_unsupported_methods
    )
    if refused:
        assert _refused_field(request) == "options.async_scheduling"
    elif v2_lacks:
        assert _refused_field(request) == "options.use_v2_model_runner"
    else:
        plan_from_proto(request)
    request.options.async_scheduling = False
    if v2_lacks:
        assert _refused_field(request) == "options.use_v2_model_runner"
    else:
        plan_from_proto(request)
