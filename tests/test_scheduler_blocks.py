"""The scheduler's block sizes and what its KV cache manager refuses at start
(kvplan/core/scheduler_blocks.py), and the prefix-caching defaults that decide
them, through the wire conversion. Each expected figure is vLLM's rule worked by
hand; `make conformance` checks the same rules against vLLM 0.32-0.34 themselves."""

from __future__ import annotations

import random
from typing import Any

import pytest
from google.protobuf import json_format

from conformance.generate import MIB, W, _hisparse_engine, full, mla, rswa, sw, sw_mla
from conformance.generate import request as engine
from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import ErrorCode
from kvplan.v1 import plan_pb2
from tests.core.builders import planning_error

GIB = 1 << 30
MAMBA = {"mamba": {"states": [{"shape": [2, 512], "dtype": "DTYPE_FLOAT32"}]}}
CROSS = {"attention": {"num_kv_heads": 8, "head_size": 64}}


def attention(name: str) -> dict[str, Any]:
    return {"name": name, "full_attention": {"attention": {"num_kv_heads": 8, "head_size": 128}}}


def layer(name: str, body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, **body, **extra}


def request(layers: list[dict[str, Any]], **options: Any) -> plan_pb2.PlanRequest:
    message = {
        "engine_id": "e",
        "options": {"max_model_len": 4096, **options},
        "workers": [{"rank": 0, "layers": layers, "memory": {"kv_cache_memory_bytes": 4 * GIB}}],
    }
    return json_format.ParseDict(message, plan_pb2.PlanRequest())


def llama(count: int = 2, **extra: Any) -> list[dict[str, Any]]:
    return [{**attention(f"a.{i}"), **extra} for i in range(count)]


def sliding(name: str, block: int) -> dict[str, Any]:
    body = {"attention": {"num_kv_heads": 16, "head_size": 128}, "sliding_window": 512}
    return {"name": name, "block_size": block, "sliding_window": body}


def two_block_sizes(**options: Any) -> plan_pb2.PlanRequest:
    """Full attention in 32-token blocks and sliding windows in 16-token blocks:
    two groups whose pages match (8 x 128 x 2 x 2 x 32 = 16 x 128 x 2 x 2 x 16)."""
    full = [{**attention(f"f.{i}"), "block_size": 32} for i in range(2)]
    return request([*full, sliding("s.0", 16), sliding("s.1", 16)], **options)


def block_sizes(message: plan_pb2.PlanRequest) -> tuple[int, int]:
    diagnostics = plan_from_proto(message).diagnostics
    return diagnostics.scheduler_block_size, diagnostics.hash_block_size


def test_one_group_hashes_on_its_block_and_refuses_another_unit() -> None:
    assert block_sizes(request(llama())) == (16, 16)
    assert block_sizes(request(llama(), prefix_match_unit=16)) == (16, 16)
    error = planning_error(request(llama(), prefix_match_unit=8))
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "options.prefix_match_unit"
    assert "set it to 16" in error.message
    # Without prefix caching the unit is never read (vLLM accepts it then).
    assert block_sizes(request(llama(), prefix_match_unit=8, enable_prefix_caching=False)) == (
        16,
        16,
    )


def test_one_dcp_sharded_group_spans_the_dcp_ranks() -> None:
    parallel = {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}
    message = request(llama(), parallel=parallel)
    message.workers.add().CopyFrom(message.workers[0])
    message.workers[1].rank = 1
    assert block_sizes(message) == (32, 32)
    message.options.prefix_match_unit = 16
    assert planning_error(message).field == "options.prefix_match_unit"


def test_several_groups_hash_on_the_gcd_or_a_dividing_unit() -> None:
    assert block_sizes(two_block_sizes()) == (32, 16)
    assert block_sizes(two_block_sizes(prefix_match_unit=8)) == (32, 8)
    assert block_sizes(two_block_sizes(enable_prefix_caching=False)) == (32, 32)
    error = planning_error(two_block_sizes(prefix_match_unit=12))
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "options.prefix_match_unit"
    assert "[32, 16]" in error.message and "the largest is 16" in error.message


def test_a_zero_unit_is_out_of_range() -> None:
    error = planning_error(request(llama(), prefix_match_unit=0))
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "options.prefix_match_unit"


def test_hits_must_align_with_compressed_states() -> None:
    """An aligned Mamba group coarser than the hash block lets hits land on the hash
    block, which must then be a multiple of a compressed layer's tokens per state."""
    compressed = {
        "name": "c.0",
        "block_size": 64,
        "full_attention": {
            "attention": {"num_kv_heads": 2, "head_size": 256, "tokens_per_state": {"tokens": 4}}
        },
    }
    mambas = [layer(f"m.{i}", MAMBA) for i in range(3)]
    assert plan_from_proto(request([*mambas, compressed], prefix_match_unit=4))
    error = planning_error(request([*mambas, compressed], prefix_match_unit=2))
    assert error.field == "options.prefix_match_unit"
    assert "tokens per state ([4])" in error.message


def test_multi_module_mtp_needs_its_lookahead_in_the_scheduler_block() -> None:
    def mtp(block: int, **options: Any) -> plan_pb2.PlanRequest:
        message = request(
            [*llama(), {**attention("mtp.0"), "is_draft": True}], block_size=block, **options
        )
        message.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_MTP
        message.spec_decode.num_speculative_tokens = 32
        message.spec_decode.num_nextn_predict_layers = 32
        return message

    error = planning_error(mtp(16))
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "spec_decode.num_speculative_tokens"
    assert "(16 tokens)" in error.message and "(32)" in error.message
    assert plan_from_proto(mtp(32))
    assert plan_from_proto(mtp(16, enable_prefix_caching=False))


def test_prefix_caching_needs_a_group_it_can_cache() -> None:
    encoder_only = {"encoder_only_attention": {"attention": {"num_kv_heads": 8, "head_size": 64}}}
    layers = [layer(f"e.{i}", encoder_only) for i in range(2)]
    assert plan_from_proto(request(layers))  # vLLM's default for such a model: off
    error = planning_error(request(layers, enable_prefix_caching=True))
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "options.enable_prefix_caching"


@pytest.mark.parametrize(
    ("layers", "caching"),
    [
        (llama(), True),  # a decoder
        ([*llama(), layer("m.0", MAMBA)], True),  # hybrid
        ([layer("m.0", MAMBA)], False),  # attention-free
        (
            [
                *llama(),
                layer(
                    "x.0", {"cross_attention": {"attention": {"num_kv_heads": 8, "head_size": 64}}}
                ),
            ],
            False,
        ),  # encoder-decoder
    ],
)
def test_prefix_caching_defaults_by_model_kind(layers: list[dict[str, Any]], caching: bool) -> None:
    options = request_from_proto(request(layers)).options
    assert options.enable_prefix_caching is caching
    assert options.mamba_align_mode is caching


def test_mamba_mode_follows_prefix_caching_whatever_was_asked() -> None:
    """vLLM sets the mode from prefix caching (MambaModelConfig)."""
    hybrid = [*llama(), layer("m.0", MAMBA)]
    asked_align = request(hybrid, mamba_cache_mode="MAMBA_CACHE_MODE_ALIGN")
    asked_align.options.enable_prefix_caching = False
    assert not request_from_proto(asked_align).options.mamba_align_mode
    asked_none = request(hybrid, mamba_cache_mode="MAMBA_CACHE_MODE_NONE")
    assert request_from_proto(asked_none).options.mamba_align_mode
    # The mode decides the Mamba block: the model length without it, the block size with.
    none_plan = plan_from_proto(asked_align)
    align_plan = plan_from_proto(asked_none)
    assert none_plan.diagnostics.scheduler_block_size != align_plan.diagnostics.scheduler_block_size


def test_a_non_causal_layer_turns_prefix_caching_off() -> None:
    """The engine turns prefix caching off for a model with a non-causal layer
    before it plans: hashes stay on the scheduler block and the unit is not read."""
    message = two_block_sizes(prefix_match_unit=8)
    message.workers[0].layers[1].full_attention.non_causal = True
    assert block_sizes(message) == (32, 32)
    # The Mamba mode was set from the configured caching, before that.
    assert request_from_proto(message).options.mamba_align_mode


def test_bounded_replay_windows_must_agree() -> None:
    """vLLM's scheduler asserts one replay window, with prefix caching or without."""

    def replaying(*windows: int, caching: bool | None = None) -> plan_pb2.PlanRequest:
        layers = [mla("m.0", block=64)] + [
            sw_mla(f"s.{i}", window, block=64, bounded_replay=True)
            for i, window in enumerate(windows)
        ]
        return engine(W(layers, GIB), block_size=64, prefix_caching=caching)

    assert plan_from_proto(replaying(128, 128))
    for caching in (None, False):
        error = planning_error(replaying(128, 256, caching=caching))
        assert error.code is ErrorCode.FAILED_PRECONDITION
        assert "[128, 256]" in error.message


def test_rswa_models_never_cache_prefixes() -> None:
    """Unlimited-OCR (the only model with RSWA layers) turns prefix caching off."""
    message = engine(W([rswa(f"r.{i}") for i in range(2)], GIB), prefix_caching=True)
    message.options.prefix_match_unit = 32  # would be refused with caching on
    assert not request_from_proto(message).options.enable_prefix_caching
    assert block_sizes(message) == (16, 16)


def test_the_target_model_decides_the_default_not_its_drafter() -> None:
    drafter = {**attention("mtp.0"), "is_draft": True}
    # Mamba-only target with an attention drafter: attention-free, so off.
    assert not request_from_proto(request([layer("m.0", MAMBA), drafter])).options.mamba_align_mode
    # Hybrid with cross-attention: vLLM asks "hybrid" first, so on.
    hybrid_cross = [*llama(), layer("m.0", MAMBA), layer("x.0", {"cross_attention": CROSS})]
    assert request_from_proto(request(hybrid_cross)).options.enable_prefix_caching


def test_hisparse_hashes_through_its_connector_without_prefix_caching() -> None:
    """HiSparse always runs a KV connector, which consumes block hashes: the unit is
    used and checked even with prefix caching off."""

    def hisparse(unit: int) -> plan_pb2.PlanRequest:
        layers = _hisparse_engine(
            random.Random(0),
            sparse=2,
            indexers=1,
            leader_every=1,
            block=64,
            sparse_head=656,
            others=[],
            topk=2048,
        )
        message = engine(
            W(layers, kv_bytes=40 * GIB), layout="BLHNC", block_size=64, prefix_caching=False
        )
        message.options.hisparse.host_pool_gib = 4.0
        message.options.hisparse.index_topk = 2048
        message.options.prefix_match_unit = unit
        return message

    assert block_sizes(hisparse(16)) == (64, 16)
    error = planning_error(hisparse(48))
    assert error.field == "options.prefix_match_unit"


def sinks(sink_len: int) -> list[dict[str, Any]]:
    body = {"attention": {"num_kv_heads": 8, "head_size": 128}, "sink_len": sink_len}
    return [{"name": f"k.{i}", "sink_full_attention": body} for i in range(2)]


@pytest.mark.parametrize(
    ("sink_len", "block_size", "dcp", "starts"),
    [
        (16, 16, 1, True),
        (64, 32, 1, True),
        (16, 32, 1, False),  # the sink is not a whole number of blocks
        (48, 32, 1, False),
        (0, 16, 1, False),  # the manager needs a sink
        (32, 16, 2, True),  # a DCP-sharded block spans 16 x 2 tokens
        (16, 16, 2, False),
    ],
)
def test_the_sink_manager_needs_its_sink_in_whole_blocks(
    sink_len: int, block_size: int, dcp: int, starts: bool
) -> None:
    message = request(sinks(sink_len), block_size=block_size)
    if dcp > 1:
        message.options.parallel.tensor_parallel_size = dcp
        message.options.parallel.decode_context_parallel_size = dcp
    if starts:
        assert plan_from_proto(message).num_blocks > 0
        return
    error = planning_error(message)
    assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "options.block_size")
    assert f"sink of {sink_len} tokens" in error.message
    assert f"block ({block_size * dcp} tokens" in error.message


def test_a_worker_refuses_too_little_free_memory_before_planning() -> None:
    """vLLM's worker checks its device's free memory as it starts, before the model
    exists: that refusal comes before one of the model's (here: Mamba with the hybrid
    manager off), for a new model and for a known one alike."""
    message = request([layer("m.0", MAMBA), *llama(1)], disable_hybrid_kv_cache_manager=True)
    assert planning_error(message).code == ErrorCode.FAILED_PRECONDITION  # the model's fault
    worker = message.workers[0]
    worker.memory.gpu_memory_utilization = 0.9
    worker.device.total_memory_bytes = 80 * GIB
    worker.device.free_memory_bytes = 30 * GIB
    error = planning_error(message)
    assert (error.code, error.field) == (
        ErrorCode.RESOURCE_EXHAUSTED,
        "workers[0].memory.gpu_memory_utilization",
    )
    assert "free memory on the device" in error.message


@pytest.mark.parametrize(
    ("engine_version", "kv_bytes", "code"),
    [
        # 0.33+ places one block to size it, before the memory checks.
        ("vllm-0.33", 1 << 20, ErrorCode.FAILED_PRECONDITION),
        ("vllm-0.34", 1 << 20, ErrorCode.FAILED_PRECONDITION),
        # 0.32 checks the layout while building each worker's config, after them.
        ("vllm-0.32", 1 << 20, ErrorCode.RESOURCE_EXHAUSTED),
        ("vllm-0.32", 4 * GIB, ErrorCode.FAILED_PRECONDITION),
    ],
)
def test_a_layout_that_cannot_pad_pages_is_refused_where_vllm_places_a_block(
    engine_version: str, kv_bytes: int, code: ErrorCode
) -> None:
    padded = {
        "attention": {"num_kv_heads": 8, "head_size": 96, "page_size_padded_bytes": 65536},
        "sliding_window": 1024,
    }
    message = request(
        [*llama(1), layer("s.0", {"sliding_window": padded})],
        layout="KV_CACHE_LAYOUT_LHBNC",
        block_size=16,
        engine_version=engine_version,
    )
    message.workers[0].memory.kv_cache_memory_bytes = kv_bytes
    error = planning_error(message)
    assert error.code == code, error.message
    if code == ErrorCode.FAILED_PRECONDITION:
        assert "cannot pad pages" in error.message


# Sliding-window pages of two sizes that do not occur equally often: BLHNC's packed
# grouping leaves layer u.5 out of every group.
_UNEVEN_HEADS = (8, 8, 8, 8, 8, 8, 4, 8, 4, 4, 4, 8)
_UNEVEN = [
    full(f"u.{i}", heads, 96) if i % 4 == 3 else sw(f"u.{i}", 128, heads, 96)
    for i, heads in enumerate(_UNEVEN_HEADS)
]


@pytest.mark.parametrize(
    ("engine_version", "kv_bytes", "code"),
    [
        # 0.33+ find the layer left out while grouping, before the memory checks.
        ("vllm-0.33", 16 * MIB, ErrorCode.FAILED_PRECONDITION),
        ("vllm-0.34", 16 * MIB, ErrorCode.FAILED_PRECONDITION),
        ("", 16 * MIB, ErrorCode.FAILED_PRECONDITION),
        # 0.32 finds it as it builds each worker's configuration, after them.
        ("vllm-0.32", 16 * MIB, ErrorCode.RESOURCE_EXHAUSTED),
        ("vllm-0.32", 64 * GIB, ErrorCode.FAILED_PRECONDITION),
    ],
)
@pytest.mark.parametrize("stages", [1, 2])
def test_a_layer_no_group_holds_is_refused_where_the_release_finds_it(
    engine_version: str, kv_bytes: int, code: ErrorCode, stages: int
) -> None:
    workers = (
        W(_UNEVEN, kv_bytes)
        if stages == 1
        else [W(_UNEVEN[:4], kv_bytes), W(_UNEVEN[4:], kv_bytes)]
    )
    message = engine(workers, layout="BLHNC", block_size=32, max_model_len=131072, pp=stages)
    message.options.engine_version = engine_version
    error = planning_error(message)
    assert error.code == code, error.message
    if code == ErrorCode.FAILED_PRECONDITION:
        assert "no KV cache group holds layers ['u.5']" in error.message
        assert "LBNHC" in error.message
