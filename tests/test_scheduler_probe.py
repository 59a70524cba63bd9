"""kvplan's prefix-cache prediction against each release's own v1 scheduler with
chunked prefill, in that release's CPU venv (conformance/scheduler_probe.py's
harness): a few engines and chunk sizes per release, where `make conformance`'s
scheduler probe checks every generated one. A missing venv fails the test."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conformance.generate import GIB, SMALL_STATES, W, full, mamba
from conformance.generate import request as generated_request
from conformance.prefix_lengths import parse_chunk, stored_and_tail
from kvplan.cli import load_request
from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.prefix_cache import (
    PrefillChunks,
    PrefixCacheSetup,
    cached_tokens,
    cached_tokens_after_junction,
    facts,
    manager_view,
)
from kvplan.core.prefix_warnings import DIVERGING_TAIL_UNITS
from kvplan.prefix_facts import setup_from_plan
from kvplan.v1 import plan_pb2
from tests.test_fuzz_finds import find
from tests.test_prefix_against_vllm import junction_engine
from tests.test_prefix_facts import bounded_replay_engine
from tests.vllm_envs import run_in_vllm

REPO = Path(__file__).resolve().parents[1]

# Runs in the release's venv: plans each request with the release (the driver keeps
# its scheduler's configuration), then runs the release's Scheduler for each probe
# (stored, shared, tail, later) on a new scheduler, the stored request generating
# the engine's "max_tokens" (2 if absent); the hit (with `later`, the first
# request's and the next one's), or vLLM's failure as text.
VLLM_SIDE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from conformance import scheduler_probe, vllm_driver
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.v1 import plan_pb2
out = []
for engine in json.load(sys.stdin):
    request = plan_pb2.PlanRequest.FromString(bytes.fromhex(engine["request"]))
    assert vllm_driver.plan_with_vllm(request, GPU_MEMORY_BYTES)["ok"]
    hits = []
    for stored, shared, tail, later in engine["probes"]:
        try:
            got = scheduler_probe.scheduler_hit(
                stored, shared, tail, engine.get("max_tokens", 2), later
            )
        except scheduler_probe.SchedulerStalled as exc:
            hits.append(str(exc))
            continue
        hits.append([got["hit"], got["later_hit"]] if later else got["hit"])
    out.append(hits)
print(json.dumps(out))
"""

CHUNK_FIND = "prefix-mamba-state-at-chunk-ends"
# Engines and chunk sizes (max_num_batched_tokens) per release: the chunk find at
# the default batch, a chunk not a multiple of the cache block and one of three
# blocks; a Qwen3-Next-like hybrid (528-token blocks, MTP), Gemma 3's sliding
# windows and gpt-oss with EAGLE3 (the draft drop under 0.32), each at two chunks.
ENGINES = [
    (f"find:{CHUNK_FIND}", ["8192", "87", "x3"]),
    ("examples/qwen3-next-80b-a3b-mtp.yaml", ["x1.37", "8192"]),
    ("examples/gemma-3-27b.yaml", ["x0.5", "x1.37"]),
    ("examples/gpt-oss-20b-eagle3.yaml", ["x0.5", "x3"]),
]


def _request(source: str, engine_version: str) -> plan_pb2.PlanRequest:
    if source.startswith("find:"):
        return find(source.removeprefix("find:"), engine_version)
    request = load_request(str(REPO / source))
    request.options.engine_version = engine_version
    if engine_version == "vllm-0.32":  # no is_draft there, as `make conformance` sends it
        for worker in request.workers:
            for layer in worker.layers:
                layer.is_draft = False
    return request


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_the_scheduler_serves_what_kvplan_predicts(release: str) -> None:
    engines, predicted = [], []
    for source, chunks in ENGINES:
        base = _request(source, f"vllm-{release}")
        for text in chunks:
            request = plan_pb2.PlanRequest()
            request.CopyFrom(base)
            setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
            unit = max(setup.scheduler_block, *(g.block_tokens for g in setup.groups))
            request.options.max_num_batched_tokens = parse_chunk(text).for_unit(unit)
            setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
            stored, tail = stored_and_tail(setup)
            # Just under the prompt (the replay boundary), the prompt again, a unit
            # below, and a token under that.
            shared = list(dict.fromkeys([stored - 1, stored, stored - unit, stored - unit - 1]))
            probes = [(stored, n, tail, False) for n in shared]
            engines.append({"request": request.SerializeToString().hex(), "probes": probes})
            predicted.append([cached_tokens(setup, n, stored, n + tail) for n in shared])
    measured = run_in_vllm(release, ["-c", VLLM_SIDE, str(REPO)], engines)
    assert measured == predicted
    # The chunk find: at the default batch the replay boundary's state is never
    # written (one chunk to 416), at 3 blocks a chunk it is (192, 384, 416).
    find_default, _, find_three_blocks = measured[:3]
    if release != "0.32":  # 0.32 has no is_draft: its drop makes a different engine
        assert find_default[0] == 0  # shares 416 of 417
        assert find_three_blocks[0] == 384


# (junction checkpoint asked for, max_num_batched_tokens) -> the first request's
# hit and the next one's.
JUNCTION_HITS = {
    (True, 8192): [0, 96],  # one chunk to the junction (96): its state is kept
    (False, 8192): [0, 0],  # the junction floored to the cache block (96): no 64
    (False, 40): [0, 64],  # 32-token chunks end at 64 on the way
}


def test_the_next_request_hits_where_the_first_ones_chunks_ended() -> None:
    """tests/test_prefix_against_vllm.py's junction_engine (vLLM 0.33): a request
    sharing 100 tokens of a longer stored prompt, then the next one, on the
    release's own scheduler; kvplan's what-if says the same."""
    engines, answers = [], []
    for checkpoint, batched in JUNCTION_HITS:
        request = junction_engine()
        request.options.enable_mamba_shared_prefix_checkpoint = checkpoint
        request.options.max_num_batched_tokens = batched
        setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
        unit, tail = facts(setup).unit, facts(setup).unit + setup.hash_lookahead
        diverging = 100 + DIVERGING_TAIL_UNITS * unit + setup.hash_lookahead + 1
        probes = [(diverging, 100, tail, True)]
        engines.append({"request": request.SerializeToString().hex(), "probes": probes})
        answer = plan_from_proto(request).diagnostics.prefix_cache.what_if
        answers.append([[answer.cached_tokens_prefix_diverges, answer.cached_tokens_next_request]])
    measured = run_in_vllm("0.33", ["-c", VLLM_SIDE, str(REPO)], engines)
    assert measured == answers
    assert measured == [[hits] for hits in JUNCTION_HITS.values()]


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_the_scheduler_replays_a_bounded_window_off_the_managers_hit(release: str) -> None:
    """tests/test_prefix_facts.py's bounded_replay_engine (a 128-token window, 64-token
    blocks) on the release's own scheduler: after the KV cache manager's hit the
    scheduler recomputes the window (Scheduler._mark_prefix_replay), so a hit of
    the window or less is served as 0 and a longer one less the window, as
    kvplan's cached_tokens says; the manager's own hit (manager_view, what the
    block-by-block probe sees) is the window longer."""
    request = bounded_replay_engine(f"vllm-{release}")
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    stored, tail = stored_and_tail(setup)
    # One block, the window, a block past it, and the stored prompt less one.
    shared = [64, 128, 192, stored - 1]
    probes = [(stored, n, tail, False) for n in shared]
    engines = [{"request": request.SerializeToString().hex(), "probes": probes}]
    (measured,) = run_in_vllm(release, ["-c", VLLM_SIDE, str(REPO)], engines)
    assert measured == [cached_tokens(setup, n, stored, n + tail) for n in shared]
    manager = [cached_tokens(manager_view(setup), n, stored, n + tail) for n in shared]
    assert measured == [max(0, hit - setup.replay_window) for hit in manager]
    assert setup.replay_window == 128 and 0 in measured and max(measured) > 0


def unmarked_junction_engine(engine_version: str, batched: int) -> plan_pb2.PlanRequest:
    """conformance's mamba_junction/mamba64-full16-unitNone-none engine: two 64-token
    Mamba blocks beside 16-token full attention, no drafter (so no junction
    checkpoint: the junction's chunk is floored to the 16-token cache block),
    under `engine_version` at `batched` tokens a step."""
    layers = [
        *[mamba(f"m.{i}", SMALL_STATES, block=64) for i in range(2)],
        full("f.0", 2, 256, block=16),
    ]
    request = generated_request(W(layers, 4 * GIB), mamba_align=True, batched=batched)
    request.options.engine_version = engine_version
    request.options.enable_mamba_shared_prefix_checkpoint = True
    return request


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_a_mamba_block_a_chunk_ended_inside_is_kept_at_its_end(release: str) -> None:
    """The next request after one that started from no Mamba hit (seed 13's
    fuzzj/j0023 and mamba_junction engines at x1.37 chunks): 87-token steps end
    the first request's chunks on the 16-token cache block (80, 160, the junction
    176, 240), never on the 64-token Mamba block. vLLM keeps the block holding
    the junction's floor (176 floored to the 64-token Mamba block: the block over
    64..128) and keys it at its end as soon as a chunk passes it, and that block
    is a real one because a chunk (80) ended inside it (MambaManager.cache_blocks
    over reachable_block_mask): the next request hits 128 at 191 shared tokens
    and 256 at 319 (junctions 176, 304); at 192 and 320 a chunk ends at the
    junction itself. kvplan said 0 at 191 and 319 when it asked for a chunk
    ending exactly at the block's end."""
    request = unmarked_junction_engine(f"vllm-{release}", 87)
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    stored, tail = stored_and_tail(setup)
    shared = [191, 192, 319, 320]
    probes = [(stored, n, tail, True) for n in shared]
    engines = [{"request": request.SerializeToString().hex(), "probes": probes}]
    (measured,) = run_in_vllm(release, ["-c", VLLM_SIDE, str(REPO)], engines)
    assert measured == [
        [
            cached_tokens(setup, n, stored, n + tail),
            cached_tokens_after_junction(setup, n, stored, n + tail),
        ]
        for n in shared
    ]
    assert measured == [[0, 128], [0, 192], [0, 256], [0, 320]]
    # 191 shared: full attention matches 176 (the junction), Mamba nothing; the
    # first request's chunks end at 80, 160, 176 and 240, none at 128.
    first = PrefillChunks(setup, 191 + tail, 0, 176)
    assert [p for p in range(1, 191 + tail) if first.is_end(p)] == [80, 160, 176, 240]


def checkpoint_hybrid_engine(engine_version: str, batched: int) -> plan_pb2.PlanRequest:
    """conformance's mamba/checkpoint-alignment-hybrid-64-16-unitNone: two 64-token
    Mamba layers with a prefill checkpoint block (alignment 16) beside 16-token full
    attention, under `engine_version` at `batched` tokens a step."""
    layers = [
        *[
            mamba(f"m.{i}", SMALL_STATES, block=64, checkpoint_alignment=16, checkpoint_blocks=1)
            for i in range(2)
        ],
        full("f.0", 2, 256, block=16),
    ]
    request = generated_request(W(layers, 4 * GIB), mamba_align=True, batched=batched)
    request.options.engine_version = engine_version
    return request


# max_num_batched_tokens -> the hits of a request sharing 416 tokens of the stored
# 417-token prompt, then of the next one.
CHECKPOINT_HITS = {
    8192: [416, 416],  # one chunk from 0: both tests pass, the state at 416 is written
    87: [0, 0],  # the last chunk 400 -> 417 runs past 416, the manager writes nothing
    192: [384, 384],  # 384 -> 417 likewise; the chunk ending at 384 left its state
}


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_a_last_chunk_that_can_export_the_checkpoint_is_not_stopped_there(release: str) -> None:
    """Mamba layers with prefill checkpoint blocks: the scheduler lets a prompt's
    last chunk run past the checkpoint (416 of 417 tokens) where it judges the
    backend can export the state inside it (Scheduler._mamba_block_aligned_split,
    is_mamba_prefill_checkpoint_valid against the 16-token cache block); the Mamba
    manager has it written only where the same test passes against the 64-token
    Mamba block (MambaManager._needs_internal_checkpoint): from 0, not from 400 or
    384 (the checkpoint's column, 5, is not past the chunk's initial one, 6 or 5).
    kvplan said 416 at every chunk size, as if the chunk stopped at 416."""
    engines, predicted = [], []
    for batched in CHECKPOINT_HITS:
        request = checkpoint_hybrid_engine(f"vllm-{release}", batched)
        setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
        assert setup.mamba_checkpoint_alignment == 16
        stored, tail = stored_and_tail(setup)
        assert stored == 417
        probes = [(stored, 416, tail, True)]
        engines.append({"request": request.SerializeToString().hex(), "probes": probes})
        predicted.append(
            [
                [
                    cached_tokens(setup, 416, stored, 416 + tail),
                    cached_tokens_after_junction(setup, 416, stored, 416 + tail),
                ]
            ]
        )
    measured = run_in_vllm(release, ["-c", VLLM_SIDE, str(REPO)], engines)
    assert measured == predicted
    assert measured == [[hits] for hits in CHECKPOINT_HITS.values()]


REPREFILLED_TAIL_HYBRID = "prefix-mtp-reprefilled-tail-hybrid"
OUTPUTS = [1, 16, 300]  # under, past and far past the hash lookahead (3 tokens from 0.33)


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_a_stored_requests_output_moves_full_attentions_partial_tail(release: str) -> None:
    """conformance/finds/prefix-mtp-reprefilled-tail-hybrid (three MTP modules,
    1-token hash blocks, 3 hash lookahead tokens, 288-token Mamba and attention
    blocks, a 1,873-token prompt) on the release's own scheduler, the stored
    request generating 1, 16 or 300 tokens (300 fill the attention block the prompt
    ends in and the next). Each sampled token extends the request's hashes and the
    scheduler's next cache_blocks keys full attention's partial tail block at the
    new boundary (FullAttentionManager._cache_partial_tail_block), dropping the key
    at 1,870 a resent prompt would reach: it gets the whole blocks, 1,728, at every
    output length, as kvplan's cached_tokens says for the stored output; the bare
    manager, which stores without sampling (manager_view), keeps 1,870. 0.32 hashes
    without lookahead, so no output moves a key (and its scheduler stalls on that
    find): the chunk find there, whose figures no output changes."""
    if release == "0.32":
        request = find(CHUNK_FIND, "vllm-0.32")
    else:
        request = find(REPREFILLED_TAIL_HYBRID, f"vllm-{release}")
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    stored, tail = stored_and_tail(setup)
    unit = max(setup.scheduler_block, *(g.block_tokens for g in setup.groups))
    shared = [stored, stored - 1, stored - unit]
    probes = [(stored, n, tail, True) for n in shared]
    hex_request = request.SerializeToString().hex()
    engines = [{"request": hex_request, "max_tokens": m, "probes": probes} for m in OUTPUTS]

    def figures(output: PrefixCacheSetup) -> list[list[int]]:
        return [
            [
                cached_tokens(output, n, stored, n + tail),
                cached_tokens_after_junction(output, n, stored, n + tail),
            ]
            for n in shared
        ]

    predicted = [figures(replace(setup, stored_output_tokens=m)) for m in OUTPUTS]
    measured = run_in_vllm(release, ["-c", VLLM_SIDE, str(REPO)], engines)
    assert measured == predicted
    # The plan's figure is the one for every output of at least the hash lookahead.
    assert setup.stored_output_tokens == setup.hash_lookahead
    long_enough = [m >= setup.hash_lookahead for m in OUTPUTS]
    assert [hits for hits, ok in zip(measured, long_enough, strict=True) if ok] == [
        figures(setup)
    ] * sum(long_enough)
    resent = [hits[0] for hits in measured]
    manager = cached_tokens(manager_view(setup), stored, stored, stored + tail)
    if release == "0.32":
        assert setup.hash_lookahead == 0 and resent == [[manager, manager]] * len(OUTPUTS)
    else:
        assert stored == 1_873 and setup.hash_lookahead == 3 and manager == 1_870
        assert resent == [[1_728, 1_728]] * len(OUTPUTS)
