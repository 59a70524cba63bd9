"""kvplan.prefix_facts: a plan's prefix-cache setup, the core prediction's input."""

from __future__ import annotations

import pytest

from kvplan.convert.request import request_from_proto
from kvplan.prefix_facts import setup_from_plan
from kvplan.v1 import plan_pb2, spec_pb2


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
