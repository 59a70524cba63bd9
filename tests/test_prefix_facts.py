"""kvplan.prefix_facts: a plan's prefix-cache setup, the core prediction's input."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conformance.generate import GIB, W, generate_cases, mla, sw_mla
from conformance.generate import request as engine
from kvplan.client.prefix_cache import cached_tokens as client_cached_tokens
from kvplan.client.prefix_cache import reported_cached_tokens, what_if_line
from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.errors import PlanningError
from kvplan.core.prefix_cache import (
    PrefillChunks,
    cached_tokens,
    facts,
    manager_view,
    reported_after_replay,
)
from kvplan.core.prefix_warnings import rule_is_exact, what_if
from kvplan.prefix_facts import setup_from_plan
from kvplan.v1 import plan_pb2, spec_pb2
from tests.core.test_prefix_warnings import rule_check_lengths
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


def test_a_groups_cacheability_is_its_first_layers_on_the_first_worker() -> None:
    """conformance/finds/prefix-first-layer-cacheable (fuzz seed 13, fuzzc/c0490,
    vLLM 0.34): group 0 holds sliding-window layers and bounded-replay
    sliding-window MLA layers (which opt out of prefix caching). vLLM's scheduler
    takes the first worker's config and, for such a group, its first layer's spec
    there: a sliding window of 32 tokens, cacheable. Its 32-token window then keeps
    a stored prompt's blocks only near its end, and vLLM 0.34's manager hit 0 for
    every shared prefix shorter than the stored 105 tokens (kvplan, leaving the
    group out, said 16 for 16 tokens)."""
    request = find("prefix-first-layer-cacheable", "vllm-0.34")
    response = plan_from_proto(request)
    assert not response.groups[0].prefix_cacheable  # kvplan's own view of the group
    setup = setup_from_plan(request_from_proto(request), response)
    assert setup.groups[0].prefix_cacheable and setup.groups[0].window == 32
    assert cached_tokens(setup, 16, 105, 16 + 17) == 0


def test_a_promoted_first_layer_takes_part_as_allocated() -> None:
    """conformance/finds/prefix-promoted-first-layer (fuzz seed 13, fuzzx/x0807,
    vLLM 0.34): bounded-replay sliding-window MLA layers (which opt out of prefix
    caching) beside MLA layers, the hybrid manager disabled. 0.34 allocates the
    windows as MLA and drops the replay bound, so the one group's first layer on the
    first worker, `model.layers.0.swa`, is an MLA layer there and cacheable. vLLM
    0.34's manager hit 256, 1,024 and 1,536 tokens of shared prefixes of 256, 1,279
    and 1,665 tokens of a stored 1,665-token prompt; kvplan, reading the layer as
    declared, said 0 (39 of the 45 probes of x0282, x0391 and x0807 disagreed)."""
    request = find("prefix-promoted-first-layer", "vllm-0.34")
    response = plan_from_proto(request)
    core = request_from_proto(request)
    (group,) = response.groups
    first = group.layer_names[0]
    assert first == "model.layers.0.swa"
    (declared,) = {spec for worker in core.workers for name, spec in worker.layers if name == first}
    assert declared.kind == "sliding_window_mla" and not declared.prefix_cacheable
    assert group.layer_specs[0].WhichOneof("kind") == "mla_attention"  # promoted
    setup = setup_from_plan(core, response)
    assert setup.groups[0].prefix_cacheable
    assert setup.replay_window == 0  # the promotion dropped the bound: nothing replays
    for shared, vllm in ((256, 256), (1279, 1024), (1665, 1536)):
        assert cached_tokens(setup, shared, 1665, shared + 257) == vllm


def bounded_replay_engine(engine_version: str, window: int = 128) -> plan_pb2.PlanRequest:
    """DeepSeek-V4.1-like: MLA layers beside bounded-replay sliding-window MLA
    layers of a `window`-token window, 64-token blocks, the hybrid manager on (two
    groups; the windows' opts out of prefix caching), prefix caching on."""
    layers = [mla(f"m.{i}", block=64) for i in range(2)]
    layers += [sw_mla(f"s.{i}", window, block=64, bounded_replay=True) for i in range(2)]
    request = engine(W(layers, GIB), block_size=64, prefix_caching=True)
    request.options.engine_version = engine_version
    return request


@pytest.mark.parametrize("engine_version", ["", "vllm-0.32", "vllm-0.33", "vllm-0.34"])
def test_a_bounded_replay_window_is_taken_off_what_the_scheduler_serves(
    engine_version: str,
) -> None:
    """The window of the groups whose spec the scheduler reads as bounded-replay
    sliding-window MLA (KVCacheSpec.prefix_replay_tokens, in tokens) is the
    setup's replay window; the manager's hit (manager_view) keeps it. Every
    release replays alike (Scheduler._mark_prefix_replay in 0.32, 0.33, 0.34)."""
    request = bounded_replay_engine(engine_version)
    response = plan_from_proto(request)
    setup = setup_from_plan(request_from_proto(request), response)
    assert setup.replay_window == 128
    assert [g.prefix_cacheable for g in setup.groups] == [True, False]
    manager = manager_view(setup)
    for shared in (64, 128, 192, 416):
        hit = cached_tokens(manager, shared, 417, shared + 65)
        assert hit == shared // 64 * 64
        assert cached_tokens(setup, shared, 417, shared + 65) == max(0, hit - 128)
    stated = response.diagnostics.prefix_cache
    assert (stated.replay_tokens, stated.min_shared_prefix_tokens) == (128, 192)
    assert facts(manager).min_shared_prefix == 64


@pytest.mark.parametrize("shared", [128, 192, 416])
def test_the_what_if_says_what_vllms_hit_metric_counts_under_bounded_replay(
    shared: int,
) -> None:
    """vLLM's usage cached_tokens and prefix-cache hit metric take the KV cache
    manager's hit, before the scheduler's replay (reported_after_replay): the
    what-if line says what they will count beside what is served, each the
    manager's hit of the same request (0 where the scheduler drops it: 128)."""
    request = bounded_replay_engine("vllm-0.34")
    request.shared_prefix_tokens = shared
    response = plan_from_proto(request)
    setup = setup_from_plan(request_from_proto(request), response)
    stated = response.diagnostics.prefix_cache
    answer = stated.what_if
    served = [
        answer.cached_tokens_prefix_stored,
        answer.cached_tokens_prefix_diverges,
        answer.cached_tokens_next_request,
    ]
    manager = what_if(manager_view(setup), facts(manager_view(setup)), shared)
    counted = [
        reported_after_replay(setup, hit)
        for hit in (manager.prefix_stored, manager.prefix_diverges, manager.next_request)
    ]
    assert [reported_cached_tokens(stated, n) for n in served] == counted
    assert counted[0] == (shared // 64 * 64 if shared > 128 else 0)
    listed = " / ".join(f"{c:,}" for c in counted)
    said = f"count {listed}: the 128 tokens the scheduler recomputes" in what_if_line(stated)
    assert said == (shared > 128)  # where nothing is served both figures are 0
    # Without bounded replay the line says nothing of it (it would be the same).
    request = bounded_replay_engine("vllm-0.34")
    del request.workers[0].layers[2:]
    request.shared_prefix_tokens = shared
    plain = plan_from_proto(request).diagnostics.prefix_cache
    assert plain.replay_tokens == 0 and "recomputes" not in what_if_line(plain)


@pytest.mark.parametrize(
    ("name", "shared", "stored", "vllm"),
    [
        # One MLA group of 64-token blocks, 64 MTP modules: 63 tokens not cached.
        ("prefix-mtp-reprefilled-tail", 416, 417, 256),
        # Mamba beside full attention of 288-token blocks, hash blocks of 1 token.
        ("prefix-mtp-reprefilled-tail-hybrid", 1873, 1873, 1440),
    ],
)
def test_a_multi_module_mtp_drafters_reprefilled_tail_is_not_cached(
    name: str, shared: int, stored: int, vllm: int
) -> None:
    """Fuzz seed 13 on vLLM 0.32 (fuzzz/z1890, fuzzx/x0788): with several MTP
    modules the drafter may prefill a prompt's last lookahead-less-one tokens
    again, so vLLM caches a single group, and a dropping group beside others, only
    up to there; the hits are vLLM 0.32's own manager's (kvplan said 320 and 1,872
    when it cached the whole prompt)."""
    request = find(name, "vllm-0.32")
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    assert (
        setup.reprefill_tokens == request_from_proto(request).spec_decode.num_speculative_tokens - 1
    )
    unit = max(setup.scheduler_block, *(g.block_tokens for g in setup.groups))
    assert cached_tokens(setup, shared, stored, shared + unit + 1) == vllm
    # The closed-form rule counts the single group's hit from N less the tail
    # (reprefill_tokens) and is exact; beside Mamba, under partial hash hits, the
    # dropping 288-token group also loses the block holding the prompt's last
    # hash boundary, and lands on whole blocks only: not the rule's. The minimum
    # prefix is the first prompt that hits when sent again (vLLM 0.32 agrees for
    # the hybrid: tests/test_prefix_against_vllm.py).
    f = facts(setup)
    prefix_cache = plan_from_proto(request).diagnostics.prefix_cache
    assert prefix_cache.reprefill_tokens == setup.reprefill_tokens
    assert (
        rule_is_exact(setup, f)
        == prefix_cache.rule_exact
        == (name == "prefix-mtp-reprefilled-tail")
    )
    if prefix_cache.rule_exact:
        assert client_cached_tokens(prefix_cache, stored) == cached_tokens(
            setup, stored, stored, stored + 1
        )
        assert all(
            client_cached_tokens(prefix_cache, n) == cached_tokens(setup, n, n, n + 1)
            for n in range(4 * f.unit)
        )
    minimum = f.min_shared_prefix
    assert f.min_shared_prefix_exact
    assert (
        minimum
        == {"prefix-mtp-reprefilled-tail": 191, "prefix-mtp-reprefilled-tail-hybrid": 578}[name]
    )
    assert all(cached_tokens(setup, n, n, n + 1) == 0 for n in range(1, minimum))
    assert what_if(setup, f, minimum - 1).prefix_stored == 0
    assert what_if(setup, f, minimum).prefix_stored > 0


def test_a_uniform_group_of_circular_buffers_stays_out_of_prefix_caching() -> None:
    """The group's first layer decides (the scheduler's view), by its kind's own
    rule: circular-buffer layers never take part (block_sizes/default-circular-only-
    caching* in make conformance: vLLM hits 0; kvplan said 16 for 16 tokens when it
    read only sliding-window MLA's opt-out)."""
    response = plan_pb2.PlanResponse()
    response.diagnostics.hash_block_size = 16
    response.diagnostics.scheduler_block_size = 16
    group = response.groups.add(block_size=16, prefix_cacheable=False, uniform_type=True)
    group.layer_names.extend(["model.layers.0.attn", "model.layers.1.attn"])
    for _ in range(2):
        layer = group.layer_specs.add()
        layer.circular_buffer.attention.num_kv_heads = 8
        layer.circular_buffer.attention.head_size = 128
    group.spec.CopyFrom(group.layer_specs[0])
    request = plan_pb2.PlanRequest(engine_id="prefix-facts")
    request.options.enable_prefix_caching = True
    request.options.max_model_len = 4096
    setup = setup_from_plan(request_from_proto(request), response)
    assert not setup.groups[0].prefix_cacheable
    assert cached_tokens(setup, 16, 105, 16 + 17) == 0


@pytest.mark.parametrize("engine_version", ["vllm-0.33", "vllm-0.34"])
@pytest.mark.parametrize(
    ("batched", "chunk_ends", "hit"),
    [
        # One chunk to the last 16-token position (416): no state at 384.
        (8192, [416], 0),
        # 87 tokens, cut to 80: 80, 160, ..., 400, then 416. 384 is skipped.
        (87, [80, 160, 240, 320, 400, 416], 0),
        # 192 tokens a chunk: 192, 384, then 416.
        (192, [192, 384, 416], 384),
        # 32 tokens a chunk: every 16-token boundary's multiple of 32, and 416.
        (32, list(range(32, 417, 32)), 384),
    ],
)
def test_a_mamba_state_exists_only_where_a_prefill_chunk_ends(
    engine_version: str, batched: int, chunk_ends: list[int], hit: int
) -> None:
    """conformance/finds/prefix-mamba-state-at-chunk-ends (the scheduler probe, vLLM
    0.33 and 0.34): 64-token Mamba blocks beside 16-token full attention and a
    marked MTP drafter. vLLM's scheduler ends prefill chunks on the engine's cache
    block (16, the smallest cacheable group block) and at the prompt's last
    cacheable position, so the Mamba state at a stored 417-token prompt's replay
    boundary (384) exists only where a chunk ends there: the release's own
    scheduler gives a request sharing 416 tokens these hits
    (tests/test_scheduler_probe.py); prefilled block by block, 384."""
    request = find("prefix-mamba-state-at-chunk-ends", engine_version)
    request.options.max_num_batched_tokens = batched
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    assert (setup.prefill_chunk_tokens, setup.split_block) == (batched, 16)
    chunks = PrefillChunks(setup, 417)
    assert [p for p in range(1, 417) if chunks.is_end(p)] == chunk_ends
    assert cached_tokens(setup, 416, 417, 416 + 65) == hit
    assert cached_tokens(replace(setup, prefill_chunk_tokens=0), 416, 417, 416 + 65) == 384


def test_the_client_rule_is_not_claimed_exact_where_chunk_ends_decide() -> None:
    """The closed-form rule a client evaluates has no chunk ends: for the chunk find
    (Mamba blocks coarser than the cache block) it is not claimed exact, as it is
    when the prompt is prefilled block by block."""
    request = find("prefix-mamba-state-at-chunk-ends", "vllm-0.34")
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    assert not rule_is_exact(setup, facts(setup))
    stepped = replace(setup, prefill_chunk_tokens=0)
    assert rule_is_exact(stepped, facts(stepped))
    assert not plan_from_proto(request).diagnostics.prefix_cache.rule_exact


def test_the_client_rule_is_the_simulation_on_every_conformance_engine_it_says_exact() -> None:
    """Every engine `make conformance` plans (generated cases, scenario files,
    fuzz finds), under its own rule set: where the plan says rule_exact, the
    client's rule on the rendered diagnostics is the core's simulation for every
    N below 600 and around each unit, the minimum, the drop and the replay window
    up to 12 units."""
    exact = estimates = 0
    for case in generate_cases():
        try:
            response = plan_from_proto(case.request)
        except PlanningError:
            continue
        prefix_cache = response.diagnostics.prefix_cache
        if not prefix_cache.effectively_on:
            continue
        if not prefix_cache.rule_exact:
            estimates += 1
            continue
        exact += 1
        setup = setup_from_plan(request_from_proto(case.request), response)
        for n in rule_check_lengths(prefix_cache, 600):
            expected = cached_tokens(setup, n, n, n + 1)
            assert client_cached_tokens(prefix_cache, n) == expected, (case.id, n)
    # 909 exact and 82 estimates when written.
    assert exact >= 900 and estimates <= 90, (exact, estimates)
