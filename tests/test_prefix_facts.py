"""kvplan.prefix_facts: a plan's prefix-cache setup, the core prediction's input."""

from __future__ import annotations

import pytest

from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.prefix_cache import cached_tokens, facts
from kvplan.prefix_facts import setup_from_plan
from kvplan.v1 import plan_pb2, spec_pb2
from tests.test_fuzz_finds import find


def _plan(attention: str, attention_block: int) -> plan_pb2.PlanResponse:
    """A Mamba "align" group of 64 tokens over 16-token hash blocks, with one
    attention group of the given kind and block."""
    response = plan_pb2.PlanResponse()
    response.diagnostics.hash_block_size = 16
    response.diagnostics.scheduler_block_size = 64
    mamba = response.groups.add(block_size=64, prefix_cacheable=True)
    mamba.spec.mamba.states.add(shape=[4, 2048], dtype=spec_pb2.DTYPE_BFLOAT16)
    other = response.groups.add(block_size=attention_block, prefix_cacheable=True)
    if attention == "sliding_window":
        other.spec.sliding_window.attention.num_kv_heads = 8
        other.spec.sliding_window.attention.head_size = 128
        other.spec.sliding_window.sliding_window = 128
    else:
        other.spec.full_attention.attention.num_kv_heads = 8
        other.spec.full_attention.attention.head_size = 128
    return response


@pytest.mark.parametrize(
    ("attention", "block", "partial"),
    [
        ("full_attention", 32, True),  # full attention looks up hash blocks
        ("sliding_window", 16, True),  # its block is the hash block
        ("sliding_window", 32, False),  # needs whole blocks: vLLM turns partial hits off
    ],
)
def test_partial_hash_hits_need_every_other_group_to_look_up_hash_blocks(
    attention: str, block: int, partial: bool
) -> None:
    request = plan_pb2.PlanRequest(engine_id="prefix-facts")
    request.options.enable_prefix_caching = True
    request.options.max_model_len = 4096
    setup = setup_from_plan(request_from_proto(request), _plan(attention, block))
    assert setup.partial_hash_hits is partial


@pytest.mark.parametrize(
    ("engine_version", "flagged"),
    [
        ("vllm-0.32", False),  # the first worker holds no drafter layer: flag lost
        ("", True),  # kvplan's own rules: the flag survives an empty projection
    ],
)
def test_draft_flags_are_the_first_workers_the_scheduler_takes(
    engine_version: str, flagged: bool
) -> None:
    """conformance/finds/prefix-drafter-on-last-stage (fuzz seed 11, fuzzy/y0015): a
    Mamba drafter layer on the second of two pipeline stages. vLLM's scheduler takes
    the first worker's KV cache config, where under 0.32 the drafter's group has no
    layer and so no draft flag: no group is flagged, every group drops its last
    matched block, and vLLM 0.32's own manager hit 0 tokens of a 10,240-token shared
    prefix of a stored 13,313-token prompt (the prefix probe; kvplan said 10,240
    when it read the global flag)."""
    request = find("prefix-drafter-on-last-stage", engine_version)
    response = plan_from_proto(request)
    (mamba,) = [g for g in response.groups if g.spec.WhichOneof("kind") == "mamba"]
    assert mamba.is_draft  # the trailing-layer rule flags the global group
    setup = setup_from_plan(request_from_proto(request), response)
    flags = [g.is_draft for g in setup.groups]
    assert flags[mamba.group_id] is flagged
    assert sum(flags) == int(flagged)
    if engine_version == "vllm-0.32":
        assert facts(setup).drop_groups == tuple(range(len(setup.groups)))
        assert cached_tokens(setup, 10240, 13313, 10240 + 2049) == 0
