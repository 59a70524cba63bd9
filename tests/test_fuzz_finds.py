"""The engines fuzz campaigns found kvplan and a vLLM release disagreeing on
(conformance/finds/), under each rule set: what each release does with them, read off
vLLM 0.32 / 0.33 / 0.34 themselves (`make conformance` plans them with vLLM too)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
from google.protobuf import json_format

from conformance.generate import FINDS_DIR
from kvplan.convert import plan_from_proto
from kvplan.core.errors import ErrorCode
from kvplan.core.rules import (
    FIELD_EXTENSIBLE_KV_CACHE,
    FIELD_IS_DRAFT,
    FIELD_STATE_ALIGNMENT,
    FIELD_TOPK_BUFFER_WIDTH,
    rule_set_for,
)
from kvplan.v1 import plan_pb2
from tests.core.builders import planning_error

PLANS = "plans"
RELEASES = ("vllm-0.32", "vllm-0.33", "vllm-0.34", "")
REFUSED_BY_LAYOUT = {release: ErrorCode.FAILED_PRECONDITION for release in RELEASES}
HISPARSE_STAGES_REFUSED = {
    release: (ErrorCode.INVALID_ARGUMENT, "options.parallel.pipeline_parallel_size")
    for release in RELEASES
}
# find -> rule set -> PLANS or the refusal's code (and, for INVALID_ARGUMENT, field).
EXPECTED: dict[str, Mapping[str, object]] = {
    # 0.33's and 0.34's SpeculativeConfig have no Medusa.
    "medusa": {
        **{release: (ErrorCode.INVALID_ARGUMENT, "spec_decode.method") for release in RELEASES},
        "vllm-0.32": PLANS,
    },
    # vLLM divides by the kernel block's page (0 bytes): a refusal, never a crash.
    "kernel-block-holds-no-state": REFUSED_BY_LAYOUT,
    # Placing one block asserts, in every release before the memory checks.
    "mamba-head-slots-padded-tail": REFUSED_BY_LAYOUT,
    # 0.32 places blocks only after the memory checks, which this engine fails.
    "stride-alignment-not-block-compact": {
        **REFUSED_BY_LAYOUT,
        "vllm-0.32": ErrorCode.RESOURCE_EXHAUSTED,
    },
    # VllmConfig refuses HiSparse with pipeline stages before any worker starts.
    "hisparse-host-pools-differ": HISPARSE_STAGES_REFUSED,
    # Engine arguments are checked before any worker starts: 0.33 and 0.34 refuse
    # Medusa first; 0.32's workers then refuse the device's free memory.
    "medusa-short-of-free-memory": {
        **{release: (ErrorCode.INVALID_ARGUMENT, "spec_decode.method") for release in RELEASES},
        "vllm-0.32": ErrorCode.RESOURCE_EXHAUSTED,
    },
    # vLLM takes an override of 0 as a pool of no blocks, which its memory check refuses.
    "blocks-override-zero": {release: ErrorCode.RESOURCE_EXHAUSTED for release in RELEASES},
    # Every release's CacheConfig refuses a prefix_match_unit of 0 (it must be positive).
    "prefix-match-unit-zero": {
        release: (ErrorCode.INVALID_ARGUMENT, "options.prefix_match_unit") for release in RELEASES
    },
    # A worker checks its device's free memory as it starts, whatever the model:
    # also one whose layers need no KV cache.
    "encoder-only-short-of-free-memory": {
        release: (ErrorCode.RESOURCE_EXHAUSTED, "workers[0].memory.gpu_memory_utilization")
        for release in RELEASES
    },
    # Hidden-state caches of two specs and no other layer: every release's grouping
    # fails (it sizes groups by the other layers' buckets, of which there are none).
    "hidden-state-caches-alone": {release: ErrorCode.FAILED_PRECONDITION for release in RELEASES},
    # 0.34's widest decode query counts the draft model's unsliced token: a buffer of
    # 4 x top-k rows is short for 3 draft tokens there.
    "hisparse-draft-model-decode-row": {
        **{release: PLANS for release in RELEASES},
        "vllm-0.34": (ErrorCode.INVALID_ARGUMENT, "options.hisparse.device_buffer_size"),
    },
    # A drafter's HiSparse entry flags its group (0.32 has no is_draft: cleared).
    "hisparse-drafter-resident-entry": {release: PLANS for release in RELEASES},
    # Short of memory, the length search builds the HiSparse configuration and
    # asserts placing a padded page the layout cannot express (no search catches it).
    "hisparse-unpaddable-page-short-of-memory": {
        release: ErrorCode.FAILED_PRECONDITION for release in RELEASES
    },
    "hisparse-stage-without-hot-layers": HISPARSE_STAGES_REFUSED,
    "hisparse-dcp": {
        release: (ErrorCode.INVALID_ARGUMENT, "options.parallel.decode_context_parallel_size")
        for release in RELEASES
    },
    # ParallelConfig wants DCP to divide TP, in every release.
    "dcp-does-not-divide-tp": {
        release: (ErrorCode.INVALID_ARGUMENT, "options.parallel.decode_context_parallel_size")
        for release in RELEASES
    },
    # VllmConfig turns the hybrid manager off for chunked local attention with an
    # EAGLE-family drafter, and refuses an engine asking for it on.
    "chunked-local-eagle-hybrid-manager-on": {
        release: (ErrorCode.INVALID_ARGUMENT, "options.disable_hybrid_kv_cache_manager")
        for release in RELEASES
    },
    # A drafter on the last pipeline stage plans everywhere; its prefix-cache
    # prediction is pinned in tests/test_prefix_facts.py.
    "prefix-drafter-on-last-stage": {release: PLANS for release in RELEASES},
    # Prefix-cache finds (their predictions are pinned in tests/test_prefix_facts.py):
    # every release plans them.
    "prefix-first-layer-cacheable": {release: PLANS for release in RELEASES},
    "prefix-mtp-reprefilled-tail": {release: PLANS for release in RELEASES},
    "prefix-mtp-reprefilled-tail-hybrid": {release: PLANS for release in RELEASES},
    # Found by the scheduler probe (chunked prefill); pinned in tests/test_prefix_facts.py
    # and against each release's scheduler in tests/test_scheduler_probe.py.
    "prefix-mamba-state-at-chunk-ends": {release: PLANS for release in RELEASES},
    # With the hybrid manager disabled vLLM 0.34 allocates bounded-replay sliding-window
    # MLA layers as MLA, dropping the replay bound; 0.32 / 0.33 cannot (their MLA spec
    # has no such field: a TypeError while grouping). Its prediction: test_prefix_facts.
    "prefix-promoted-first-layer": {
        **{release: ErrorCode.FAILED_PRECONDITION for release in RELEASES},
        "vllm-0.34": PLANS,
    },
    "nvfp4-ds-mla-under-dcp": {
        **{release: PLANS for release in RELEASES},
        "vllm-0.34": (ErrorCode.INVALID_ARGUMENT, "options.cache_dtype"),
    },
}


def find(name: str, engine_version: str) -> plan_pb2.PlanRequest:
    data = json.loads((FINDS_DIR / f"{name}.json").read_text())
    request = json_format.ParseDict(data["request"], plan_pb2.PlanRequest())
    request.options.engine_version = engine_version
    if not rule_set_for(engine_version).has_field(FIELD_IS_DRAFT):
        for worker in request.workers:  # as `make conformance` sends it
            for layer in worker.layers:
                layer.is_draft = False
    if not rule_set_for(engine_version).has_field(FIELD_EXTENSIBLE_KV_CACHE):
        request.options.ClearField("extensible_kv_cache")  # as `make conformance` sends it
    if not rule_set_for(engine_version).has_field(FIELD_TOPK_BUFFER_WIDTH):
        # As `make conformance` sends it to a release without the field.
        for worker in request.workers:
            for layer in worker.layers:
                if layer.HasField("mla_attention"):
                    layer.mla_attention.mla.ClearField("topk_buffer_width")
    if not rule_set_for(engine_version).has_field(FIELD_STATE_ALIGNMENT):
        for worker in request.workers:  # as `make conformance` sends it
            for layer in worker.layers:
                if layer.HasField("mamba"):
                    layer.mamba.ClearField("state_alignment_bytes")
    return request


def test_every_find_has_its_expectations() -> None:
    assert sorted(path.stem for path in FINDS_DIR.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("engine_version", RELEASES)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_release_answers_a_find_as_vllm_does(name: str, engine_version: str) -> None:
    expected = EXPECTED[name][engine_version]
    request = find(name, engine_version)
    if expected == PLANS:
        assert plan_from_proto(request).workers
        return
    code, field = expected if isinstance(expected, tuple) else (expected, None)
    error = planning_error(request)
    assert error.code == code, error.message
    if field is not None:
        assert error.field == field


def test_a_stage_without_hot_layers_aligns_its_block_to_the_hot_page_before_0_34() -> None:
    """Stage 1 holds no HiSparse hot layer: 0.32 / 0.33 align its block to the hot
    group's page all the same (20,992 B), 0.34 only to its own layers' (its 16 KiB
    Mamba page); every release gives it the host source tensor, empty. The planner's
    rule, reached by workers holding different layers: the engine refuses HiSparse
    with pipeline_parallel_size > 1 up front, so the find is planned without it."""
    for engine_version, stage_block in (("vllm-0.33", 20992), ("vllm-0.34", 16384)):
        request = find("hisparse-stage-without-hot-layers", engine_version)
        request.options.parallel.ClearField("pipeline_parallel_size")
        plan = plan_from_proto(request)
        stage0, stage1 = plan.workers
        assert stage1.bytes_per_block == stage_block
        assert stage0.bytes_per_block == 20992
        (host_tensor,) = [t for t in stage1.tensors if t.host_resident]
        assert host_tensor.size_bytes == 0
