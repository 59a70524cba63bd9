"""The scheduler's bounded replay (kvplan.core.prefix_cache, `replay_window`):
after vLLM's KV cache manager finds a hit, the scheduler recomputes its last
window for DeepSeek-V4.1's bounded-replay sliding-window MLA layers. What it
serves is the manager's hit less that window, 0 where the hit is no longer; the
manager's own hit is `manager_view`'s. The facts, the stated rule and the
what-if are the served figure (tests/test_scheduler_probe.py measures it on each
release's scheduler)."""

from __future__ import annotations

from kvplan.client.prefix_cache import cached_tokens as client_cached_tokens
from kvplan.client.prefix_cache import summary
from kvplan.convert.render import prefix_rule_to_proto
from kvplan.core.diagnostics import WarningCode
from kvplan.core.prefix_cache import (
    CacheGroup,
    GroupKind,
    PrefixCacheSetup,
    cached_tokens,
    cached_tokens_after_junction,
    facts,
    manager_view,
    reported_after_replay,
    served_after_replay,
)
from kvplan.core.prefix_warnings import (
    HYBRID_MANAGER_SWITCH,
    PrefixContext,
    prefix_warnings,
    rule_cached_tokens,
    rule_is_exact,
    what_if,
)
from kvplan.v1 import plan_pb2

# Full attention in 16-token blocks beside a bounded-replay window of 100 tokens
# (not a multiple of the block: the cut is in tokens) that takes no part in
# prefix caching.
WINDOW = 100
REPLAYING = PrefixCacheSetup(
    enabled=True,
    groups=(
        CacheGroup(GroupKind.FULL, 16, False),
        CacheGroup(GroupKind.SLIDING_WINDOW, 16, False, prefix_cacheable=False, window=WINDOW),
    ),
    scheduler_block=16,
    hash_block=16,
    partial_hash_hits=False,
    block_drop=False,
    replay_window=WINDOW,
)


def test_the_scheduler_serves_the_managers_hit_less_the_window() -> None:
    manager = manager_view(REPLAYING)
    for n in range(1, 400):
        hit = cached_tokens(manager, n, n, n + 16)
        assert hit == n // 16 * 16  # the manager: whole blocks of the prefix
        served = cached_tokens(REPLAYING, n, n, n + 16)
        assert served == served_after_replay(REPLAYING, hit) == max(0, hit - WINDOW)
        # vLLM reports the hit, window included, once it is longer than the window.
        assert reported_after_replay(REPLAYING, hit) == (hit if hit > WINDOW else 0)
    # A hit of the window or less is dropped; past it, served to the token.
    assert [cached_tokens(REPLAYING, n, n, n + 16) for n in (96, 112, 8192)] == [0, 12, 8092]


def test_the_minimums_are_those_of_a_served_hit() -> None:
    """The manager first hits at one block; the scheduler serves from the first
    block boundary past the window (112 - 100 = 12 tokens), sent again or as a
    prefix of a longer stored prompt."""
    assert (facts(manager_view(REPLAYING)).min_shared_prefix, facts(REPLAYING).replay_tokens) == (
        16,
        WINDOW,
    )
    f = facts(REPLAYING)
    assert (f.min_shared_prefix, f.min_any_hit_prefix) == (112, 112)
    assert f.min_shared_prefix_exact and f.min_any_hit_prefix_exact
    assert cached_tokens(REPLAYING, 111, 111, 112) == 0 < cached_tokens(REPLAYING, 112, 112, 113)
    # The unit stays the manager's: every manager hit is a multiple of it.
    assert f.unit == 16 and facts(manager_view(REPLAYING)).replay_tokens == 0


def test_the_stated_rule_and_the_what_if_take_the_window_off() -> None:
    f = facts(REPLAYING)
    assert rule_is_exact(REPLAYING, f)
    stated = plan_pb2.PrefixCacheDiagnostics()
    prefix_rule_to_proto(REPLAYING, f, [0, 1], stated)
    assert stated.replay_tokens == WINDOW and stated.min_shared_prefix_tokens == 112
    for n in range(600):
        served = cached_tokens(REPLAYING, n, n, n + 16)
        assert rule_cached_tokens(REPLAYING, f, n) == served, n
        assert client_cached_tokens(stated, n) == served, n
    answer = what_if(REPLAYING, f, 1000)
    manager = what_if(manager_view(REPLAYING), facts(manager_view(REPLAYING)), 1000)
    assert answer.prefix_stored == manager.prefix_stored - WINDOW
    assert answer.prefix_diverges == manager.prefix_diverges - WINDOW
    assert answer.next_request == manager.next_request - WINDOW


def test_the_next_request_is_served_after_the_replay_too() -> None:
    for n in (50, 128, 300):
        manager = cached_tokens_after_junction(manager_view(REPLAYING), n, n + 70, n + 17)
        served = cached_tokens_after_junction(REPLAYING, n, n + 70, n + 17)
        assert served == max(0, manager - WINDOW)


def test_the_replay_is_named_with_the_releases_knob() -> None:
    f = facts(REPLAYING)
    for promotes in (False, True):
        context = PrefixContext(
            spec_decode=False, drafter_flagged=False, promotion_drops_bounded_replay=promotes
        )
        codes = {w.code: w.message for w in prefix_warnings(REPLAYING, f, context)}
        message = codes[WarningCode.PREFIX_BOUNDED_REPLAY]
        assert "last 100 tokens" in message and "from 112 tokens" in message
        assert (HYBRID_MANAGER_SWITCH in message) is promotes
    plain = manager_view(REPLAYING)
    context = PrefixContext(spec_decode=False, drafter_flagged=False)
    assert not prefix_warnings(plain, facts(plain), context)
    stated = plan_pb2.PrefixCacheDiagnostics()
    prefix_rule_to_proto(REPLAYING, f, [0, 1], stated)
    assert "the scheduler recomputes the last 100 tokens of every hit" in summary(stated)
