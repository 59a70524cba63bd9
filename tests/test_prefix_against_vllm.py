"""kvplan's prefix-cache answers against each release's own KV cache manager, in
that release's CPU venv (conformance/prefix_probe.py's harness): engines a claim or
a doc names, where `make conformance` and the fuzz campaigns check every generated
one. A missing venv fails the test with how to build it."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.generate import GIB, SMALL_STATES, W, full, mamba
from conformance.generate import request as generated_request
from conformance.prefix_lengths import block_by_block
from kvplan.cli import load_request
from kvplan.convert import plan_from_proto
from kvplan.convert.request import request_from_proto
from kvplan.core.prefix_cache import cached_tokens, cached_tokens_after_junction, facts
from kvplan.core.prefix_warnings import DIVERGING_TAIL_UNITS, what_if
from kvplan.prefix_facts import setup_from_plan
from kvplan.v1 import plan_pb2
from tests.test_fuzz_finds import find
from tests.vllm_envs import run_in_vllm

REPO = Path(__file__).resolve().parents[1]

# Runs in the release's venv with the repository on sys.path: plans the request
# with the release (which leaves its KV cache manager's arguments behind), then
# asks that manager for hits: ["first", stored, n, tail] is the first request
# sharing n tokens after a stored prompt, ["later", ...] the one after that,
# ["min", stored, n, 1] one sharing n tokens and going on one, on a new manager.
VLLM_SIDE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from conformance import prefix_probe, vllm_driver
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.v1 import plan_pb2
payload = json.load(sys.stdin)
request = plan_pb2.PlanRequest.FromString(bytes.fromhex(payload["request"]))
assert vllm_driver.plan_with_vllm(request, GPU_MEMORY_BYTES)["ok"]
out = []
for which, stored, n, tail in payload["probes"]:
    if which == "first":
        out.append(prefix_probe.vllm_hits(stored, [n], tail)[0])
    elif which == "min":
        out.append(prefix_probe.vllm_min_hits([(stored, n)])[0])
    else:
        out.append(prefix_probe.vllm_later_hit(stored, n, tail))
print(json.dumps(out))
"""


def vllm_hits(
    release: str, request: plan_pb2.PlanRequest, probes: list[tuple[str, int, int, int]]
) -> list[int]:
    hits: list[int] = run_in_vllm(
        release,
        ["-c", VLLM_SIDE, str(REPO)],
        {"request": request.SerializeToString().hex(), "probes": probes},
    )
    return hits


def qwen3_next(method: int, engine_version: str) -> plan_pb2.PlanRequest:
    """examples/qwen3-next-80b-a3b-mtp.yaml (528-token units) with `method`, its
    drafter layer unmarked, as `make conformance` sends it to a release."""
    request = load_request(str(REPO / "examples" / "qwen3-next-80b-a3b-mtp.yaml"))
    request.spec_decode.method = method  # type: ignore[assignment]
    request.options.max_model_len = 16384  # room for the probes, a smaller pool
    request.options.engine_version = engine_version
    return request


def test_qwen3_next_with_an_unmarked_eagle_drafter_under_0_32_keeps_part_of_a_prefix() -> None:
    """No group is flagged (0.32 flags a trailing MTP layer only), so every group
    drops its last matched block: a 4,000-token prompt repeated and continued keeps
    3,168 tokens (6 units of 528, one dropped), not 0, which is why the plugin says
    FEWER HITS rather than ZERO HITS; a prefix of a longer prompt gets nothing
    (the Mamba groups hold its state only at its end), and the request after that one
    3,168 again. vLLM 0.32's manager agrees."""
    request = qwen3_next(plan_pb2.SPEC_DECODE_METHOD_EAGLE, "vllm-0.32")
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    f = facts(setup)
    assert f.drop_groups == tuple(range(len(setup.groups)))  # every group drops
    answer = what_if(setup, f, 4000)
    unit = f.unit
    diverging = 4000 + DIVERGING_TAIL_UNITS * unit + 1
    probes = [("first", 4000, 4000, unit), ("first", diverging, 4000, unit)]
    vllm = vllm_hits("0.32", request, [*probes, ("later", diverging, 4000, unit)])
    assert vllm == [answer.prefix_stored, answer.prefix_diverges, answer.next_request]
    assert answer.prefix_stored == 3168 and answer.prefix_diverges == 0
    # The next request hits where the first kept its Mamba state: the junction,
    # full attention's hit less the dropped block.
    assert answer.next_request == 3168


def test_later_requests_hit_at_the_shared_prefix_junction() -> None:
    """Requests that share a 4,000-token system prompt and go on differently: the
    first after the stored one hits nothing (the Mamba state is kept at the stored
    prompt's end only), but vLLM records where its groups' hits parted, keeps that
    request's Mamba state there, and the next one hits 3,696 tokens (7 units of
    528). vLLM 0.33's manager agrees with cached_tokens_after_junction and the
    what-if's next request (PrefixCacheWhatIf.cached_tokens_next_request)."""
    request = qwen3_next(plan_pb2.SPEC_DECODE_METHOD_MTP, "vllm-0.33")
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    unit = facts(setup).unit
    diverging = 4000 + DIVERGING_TAIL_UNITS * unit + 1
    tail = unit + setup.hash_lookahead
    vllm = vllm_hits(
        "0.33", request, [("first", diverging, 4000, tail), ("later", diverging, 4000, tail)]
    )
    answer = what_if(setup, facts(setup), 4000)
    later = cached_tokens_after_junction(setup, 4000, diverging, 4000 + tail)
    assert vllm == [answer.prefix_diverges, later] == [answer.prefix_diverges, answer.next_request]
    assert answer.prefix_diverges == 0 and answer.next_request == 3696


def test_the_minimum_prefix_is_the_first_prompt_that_hits_when_repeated() -> None:
    """conformance/finds/prefix-mtp-reprefilled-tail-hybrid (fuzz seed 13, fuzzx/x0788,
    vLLM 0.32): 1-token hit units beside a 288-token Mamba block, the draft drop and
    a 2-token reprefilled tail. The old minimum (unit + drop + tail) said 4; a prompt
    stored and repeated with one more token first hits at 578 (288 tokens), and
    vLLM 0.32's own manager misses at 4 and at every length from 572 to 577."""
    request = find("prefix-mtp-reprefilled-tail-hybrid", "vllm-0.32")
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    f = facts(setup)
    assert f.min_shared_prefix == 578 and f.min_shared_prefix_exact
    lengths = [4, *range(572, 579)]
    vllm = vllm_hits("0.32", request, [("min", n, n, 1) for n in lengths])
    assert vllm == [cached_tokens(setup, n, n, n + 1) for n in lengths]
    assert vllm == [0] * 7 + [288]


def test_a_shared_prefix_of_a_longer_stored_prompt_hits_below_the_sent_again_minimum() -> None:
    """The same engine (x0788, vLLM 0.32): 576 tokens shared with a stored prompt of
    578 hit 288, where a prompt sent again first hits at 578; 575 shared tokens hit
    nothing, whatever the stored length around it (facts' min_any_hit_prefix and
    min_any_hit_stored_tokens). vLLM 0.32's own manager agrees."""
    request = find("prefix-mtp-reprefilled-tail-hybrid", "vllm-0.32")
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    f = facts(setup)
    assert (f.min_any_hit_prefix, f.min_any_hit_stored_tokens) == (576, 578)
    assert f.min_any_hit_prefix_exact
    pairs = [(stored, 576) for stored in range(576, 582)]
    pairs += [(stored, 575) for stored in (575, 576, 577, 578, 579, 580, 863, 864, 866)]
    vllm = vllm_hits("0.32", request, [("min", stored, n, 1) for stored, n in pairs])
    assert vllm == [cached_tokens(setup, n, stored, n + 1) for stored, n in pairs]
    assert vllm[:6] == [0, 0, 288, 288, 288, 288] and not any(vllm[6:])


def junction_engine() -> plan_pb2.PlanRequest:
    """conformance's mamba_junction engines: 64-token Mamba blocks beside 16-token
    attention with an MTP drafter marked is_draft, 16-token hashes, under 0.33,
    the junction checkpoint asked for, the what-if for a 100-token shared prefix."""
    layers = [
        *[mamba(f"m.{i}", SMALL_STATES, block=64) for i in range(2)],
        full("f.0", 2, 256, block=16),
        full("mtp.layers.0.attn", 2, 256, block=16, draft=True),
    ]
    request = generated_request(W(layers, 4 * GIB), mamba_align=True, method="mtp")
    request.options.engine_version = "vllm-0.33"
    request.options.enable_mamba_shared_prefix_checkpoint = True
    request.shared_prefix_tokens = 100
    return request


def test_the_junction_checkpoint_lets_the_next_request_hit_inside_a_mamba_block() -> None:
    """vLLM's opt-in enable_mamba_shared_prefix_checkpoint (junction_engine). The
    first request sharing 100 tokens of a longer stored prompt hits nothing; the
    next one hits the Mamba state the first kept at its junction (96, full
    attention's match). vLLM 0.33's manager, its prompts prefilled one scheduler
    block a step, agrees with kvplan's prediction for that prefill. Without the
    option the junction's chunk is floored to the 16-token cache block (96 too):
    the state at 64 exists only where a chunk ends there, which the engine's
    default 8,192-token chunks never do, so the what-if's next request hits 0
    (tests/test_scheduler_probe.py measures both on the release's scheduler)."""
    request = junction_engine()
    answer = plan_from_proto(request).diagnostics.prefix_cache.what_if
    request.options.enable_mamba_shared_prefix_checkpoint = False
    without = plan_from_proto(request).diagnostics.prefix_cache.what_if
    request.options.enable_mamba_shared_prefix_checkpoint = True
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    unit, tail = facts(setup).unit, facts(setup).unit + setup.hash_lookahead
    diverging = 100 + DIVERGING_TAIL_UNITS * unit + setup.hash_lookahead + 1
    vllm = vllm_hits(
        "0.33", request, [("first", diverging, 100, tail), ("later", diverging, 100, tail)]
    )
    stepped = block_by_block(setup)
    assert vllm == [
        cached_tokens(stepped, 100, diverging, 100 + tail),
        cached_tokens_after_junction(stepped, 100, diverging, 100 + tail),
    ]
    assert vllm == [answer.cached_tokens_prefix_diverges, answer.cached_tokens_next_request]
    assert answer.cached_tokens_prefix_diverges == 0
    assert (answer.cached_tokens_next_request, without.cached_tokens_next_request) == (96, 0)


# The vLLM plugin's engine options, read from each release's own CacheConfig with
# the junction checkpoint asked for (on) and left at its default (off).
PLUGIN_SIDE = """
import json, sys
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
from vllm.config import CacheConfig, ParallelConfig
from kvplan.client.vllm_plugin.engine import engine_options
out = []
for asked in ({"enable_mamba_shared_prefix_checkpoint": True}, {}):
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=4096),
        cache_config=CacheConfig(**asked),
        scheduler_config=SimpleNamespace(),
        parallel_config=ParallelConfig(),
    )
    options = engine_options(config, "")
    out.append(options.HasField("enable_mamba_shared_prefix_checkpoint")
               and options.enable_mamba_shared_prefix_checkpoint)
print(json.dumps(out))
"""


def test_the_plugin_reads_the_junction_checkpoint_from_every_release() -> None:
    for release in ("0.32", "0.33", "0.34"):
        assert run_in_vllm(release, ["-c", PLUGIN_SIDE, str(REPO)]) == [True, False], release


# Runs in the release's venv: the later-request probe of one engine on a pool of
# exactly the stored request's blocks (and the null block), on a pool of 2 blocks,
# and on the pool the probe sizes.
POOL_SIDE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from conformance import prefix_probe, vllm_driver
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.v1 import plan_pb2
payload = json.load(sys.stdin)
request = plan_pb2.PlanRequest.FromString(bytes.fromhex(payload["request"]))
assert vllm_driver.plan_with_vllm(request, GPU_MEMORY_BYTES)["ok"]
stored, n, tail = payload["stored"], payload["shared"], payload["tail"]
sized = prefix_probe._pool_blocks
pools = {
    "stored_only": lambda config, requests, watermark: 1 + sum(
        -(-requests[0] // group.kv_cache_spec.block_size) for group in config.kv_cache_groups
    ),
    "two_blocks": lambda config, requests, watermark: 2,
}
out = {}
for name, pool in pools.items():
    prefix_probe._pool_blocks = pool
    try:
        out[name] = prefix_probe.vllm_later_hit(stored, n, tail)
    except prefix_probe.PoolTooSmall as exc:
        out[name] = "PoolTooSmall: " + str(exc)
prefix_probe._pool_blocks = sized
out["sized"] = prefix_probe.vllm_later_hit(stored, n, tail)
print(json.dumps(out))
"""


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_the_probes_pool_refuses_to_evict_what_it_measures(release: str) -> None:
    """The probe sizes its pool to the requests it holds (a larger one only costs
    time). Where a pool cannot hold them, the release's manager would evict the
    stored prompt's cached blocks to run the next request, or fail to allocate, and
    the probe would read a smaller pool's hit: it stops with PoolTooSmall instead,
    never counted as vLLM's failure (the eviction check hooks the release's block
    pool, hence every release). On the pool it sizes, the hit is kvplan's."""
    request = load_request(str(REPO / "examples" / "gemma-3-27b.yaml"))
    request.options.max_model_len = 4096
    request.options.engine_version = f"vllm-{release}"
    setup = setup_from_plan(request_from_proto(request), plan_from_proto(request))
    unit = max(setup.scheduler_block, *(g.block_tokens for g in setup.groups))
    stored, shared, tail = 6 * unit + unit // 2 + 1, 3 * unit, unit + 1
    payload = {
        "request": request.SerializeToString().hex(),
        "stored": stored,
        "shared": shared,
        "tail": tail,
    }
    out = run_in_vllm(release, ["-c", POOL_SIDE, str(REPO)], payload)
    assert out["stored_only"].startswith("PoolTooSmall: ")
    assert "evicted a cached block" in out["stored_only"]
    assert out["two_blocks"].startswith("PoolTooSmall: ")
    assert "cannot take" in out["two_blocks"]
    assert out["sized"] == cached_tokens_after_junction(setup, shared, stored, shared + tail)
    assert out["sized"] > 0
