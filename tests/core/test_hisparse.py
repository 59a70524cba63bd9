"""HiSparse requests: what the wire must say. Plans are checked figure by figure
by the `hisparse-*` conformance scenarios and against every vLLM release in
`make conformance` (generator section `hisparse`)."""

from __future__ import annotations

import json

from google.protobuf import json_format

from kvplan.convert import plan_from_proto
from kvplan.core.errors import ErrorCode
from kvplan.v1 import plan_pb2, spec_pb2
from tests.conformance import build
from tests.core.builders import planning_error


def _request(**options: object) -> plan_pb2.PlanRequest:
    data = json.loads(json.dumps(build.hisparse_request(4.0, **options)))
    return json_format.ParseDict(data, plan_pb2.PlanRequest())


def test_hot_and_resident_layers_need_hisparse_on() -> None:
    request = _request()
    request.options.ClearField("hisparse")
    error = planning_error(request)
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "workers[0].layers[6].hisparse_resident"


def test_the_host_pool_must_be_given() -> None:
    request = _request()
    request.options.hisparse.host_pool_gib = 0
    assert planning_error(request).field == "options.hisparse.host_pool_gib"


def test_hot_pages_need_a_block_outermost_layout() -> None:
    error = planning_error(_request(layout="KV_CACHE_LAYOUT_LBNHC"))
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert "LBNHC" in error.message


def test_the_device_buffer_covers_every_decode_query() -> None:
    request = _request()
    request.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_MTP
    request.spec_decode.num_speculative_tokens = 3
    request.options.hisparse.device_buffer_size = 4096  # < (1 + 3) x 2048
    error = planning_error(request)
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "options.hisparse.device_buffer_size"


def test_a_shared_host_pool_aligns_host_blocks_to_the_host_page() -> None:
    request = _request()
    private = plan_from_proto(request).hisparse_host_num_blocks
    request.options.hisparse.shared_host_pool = True
    request.options.hisparse.host_page_size_bytes = 1 << 20
    shared = plan_from_proto(request).hisparse_host_num_blocks
    assert private == 4 * 2**30 // (4 * 64 * 656)
    assert shared == 4 * 2**30 // (1 << 20)
    host_tensor = plan_from_proto(request).workers[0].tensors[0]
    assert host_tensor.host_resident


def test_rows_over_the_slot_limit_name_what_made_them() -> None:
    """A top-k or a speculative depth that no device buffer can hold is refused
    naming that field, not device_buffer_size, which was never set."""
    too_deep = _request()
    too_deep.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_MTP
    too_deep.spec_decode.num_speculative_tokens = 2**31
    # A step wide enough for the drafter's lookahead, which VllmConfig checks first.
    too_deep.options.max_num_batched_tokens = 2**32 - 1
    assert planning_error(too_deep).field == "spec_decode.num_speculative_tokens"
    too_wide = _request()
    too_wide.options.hisparse.index_topk = 2**31
    error = planning_error(too_wide)
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "options.hisparse.index_topk"


def _hot_blocks_per_request(plan: plan_pb2.PlanResponse) -> int:
    (hot,) = [g for g in plan.groups if g.spec.WhichOneof("kind") == "hisparse_hot"][:1]
    return hot.spec.hisparse_hot.blocks_per_request


def test_0_34_counts_the_draft_models_unsliced_token_as_a_decode_row() -> None:
    """vLLM 0.34's widest decode query adds the drafter's extra rows
    (max_num_new_slots_for_drafting: one for the autoregressive draft model), so
    HiSparse's default device buffer and its minimum grow by a top-k; 0.32 / 0.33
    count 1 + num_speculative_tokens for every method."""
    request = _request()
    request.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_DRAFT_MODEL
    request.spec_decode.num_speculative_tokens = 3
    for release, rows in (("vllm-0.32", 4), ("vllm-0.33", 4), ("", 4), ("vllm-0.34", 5)):
        request.options.engine_version = release
        # The default buffer: (max decode query + 1) x top-k rows, in 64-token blocks.
        assert _hot_blocks_per_request(plan_from_proto(request)) == (rows + 1) * 2048 // 64
    request.options.hisparse.device_buffer_size = 4 * 2048  # 0.34 needs 5 x 2048
    request.options.engine_version = "vllm-0.33"
    assert plan_from_proto(request).workers
    request.options.engine_version = "vllm-0.34"
    assert planning_error(request).field == "options.hisparse.device_buffer_size"
    request.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_MTP  # no extra row
    assert plan_from_proto(request).workers


def test_a_drafters_hot_or_resident_entry_flags_its_group() -> None:
    """vLLM flags every group holding a layer whose spec is the drafter's, the
    HiSparse entries included; kvplan read is_draft off every other kind only."""
    request = _request()
    request.spec_decode.method = plan_pb2.SPEC_DECODE_METHOD_EAGLE
    request.spec_decode.num_speculative_tokens = 1
    entry = request.workers[0].layers[6]
    assert entry.WhichOneof("kind") == "hisparse_resident"
    entry.is_draft = True
    for release in ("vllm-0.33", "vllm-0.34", ""):
        request.options.engine_version = release
        plan = plan_from_proto(request)
        (flagged,) = [list(g.layer_names) for g in plan.groups if g.is_draft]
        assert entry.name in flagged, release
        assert all(name.endswith(".hisparse_resident") for name in flagged), release
    request.options.engine_version = "vllm-0.32"  # no is_draft field in 0.32
    assert planning_error(request).field == "workers[0].layers[6].is_draft"


def test_a_page_the_layout_cannot_pad_stops_the_memory_checks_length_search() -> None:
    """Short of memory, vLLM estimates a length by building the HiSparse
    configuration; it takes a ValueError there as "does not fit", but placing a
    padded page the layout cannot express asserts, which no search catches: the
    layout's refusal, not the memory's, in every release."""
    request = _request(layout="KV_CACHE_LAYOUT_BLNHC")
    worker = request.workers[0]
    mixer = spec_pb2.LayerSpec(name="layers.4.mixer")
    state = mixer.mamba.states.add(shape=[2, 3072])
    state.dtype = spec_pb2.DTYPE_BFLOAT16
    mixer.mamba.page_size_padded_bytes = 65536  # BLNHC lays its 8 heads out as 96 KiB
    mixer.mamba.num_heads = 8
    worker.layers.insert(6, mixer)
    request.options.enable_prefix_caching = False
    for budget in (4 << 30, 1 << 20):  # enough, and short of one request
        worker.memory.kv_cache_memory_bytes = budget
        for release in ("vllm-0.32", "vllm-0.33", "vllm-0.34", ""):
            request.options.engine_version = release
            error = planning_error(request)
            assert error.code is ErrorCode.FAILED_PRECONDITION, (budget, release, error.message)
            assert "cannot pad" in error.message
