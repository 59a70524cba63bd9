"""Reusing a plan for another engine of one model (PlanCache.known_plan) gives what
planning that engine gives, byte for byte: over every engine the conformance
generator builds, under each rule set."""

from __future__ import annotations

import pytest

from conformance.generate import generate_cases
from kvplan.convert import plan_from_proto
from kvplan.convert.keys import plan_keys
from kvplan.core.errors import PlanningError
from kvplan.core.rules import RULE_SETS
from kvplan.server.plan_cache import PlanCache, PlanSummary
from kvplan.server.store.bodies import PlanParts
from kvplan.v1 import plan_pb2


def _renamed(request: plan_pb2.PlanRequest, engine_id: str) -> plan_pb2.PlanRequest:
    renamed = plan_pb2.PlanRequest()
    renamed.CopyFrom(request)
    renamed.engine_id = engine_id
    return renamed


@pytest.mark.parametrize("rule_set", sorted(RULE_SETS), ids=lambda name: name or "kvplan")
def test_a_reused_plan_is_the_plan_of_the_new_engine(rule_set: str) -> None:
    cache = PlanCache(capacity=4)
    reused = refused = 0
    for case in generate_cases():
        first = _renamed(case.request, "first-engine")
        first.options.engine_version = rule_set
        keys = plan_keys(first)
        try:
            planned = plan_from_proto(first, plan_id=keys.plan_id)
        except PlanningError:
            refused += 1  # nothing is remembered of a refused request
            assert cache.known_plan(keys, first.engine_id, "team") is None
            continue
        parts = PlanParts.of(keys.plan_id, first.engine_id, planned.SerializeToString())
        cache.keep(keys.plan_id, first.engine_id, parts)
        cache.remember_content(keys.content, parts, PlanSummary.of(first, planned), "team")

        second = _renamed(first, f"{case.id}/another engine")
        second_keys = plan_keys(second)
        known = cache.known_plan(second_keys, second.engine_id, "team")
        assert known is not None, case.id
        fresh = plan_from_proto(second, plan_id=second_keys.plan_id)
        assert known[0].plan == fresh.SerializeToString(), case.id
        assert known[1] == PlanSummary.of(second, fresh), case.id
        reused += 1
    assert reused > 500 and refused < reused, (reused, refused)
