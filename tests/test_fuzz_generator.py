"""A sample of every section of conformance/fuzz.py (the fuzz campaigns' wide random
engines) under every rule set: kvplan answers each with a plan or with a refusal a
caller can act on (a PlanningError: its gRPC code, a message, and for
INVALID_ARGUMENT the field path), never with a crash. What vLLM answers is the
campaign's to check (`make fuzz`); this keeps the generator working and kvplan total
over its space in `make test`."""

from __future__ import annotations

from collections import Counter

import pytest

from conformance.fuzz import SECTIONS, parse_fuzz_sections
from conformance.generate import Case, check_split, generate_cases, split_cases
from kvplan.convert import plan_from_proto
from kvplan.core.errors import ErrorCode, PlanningError
from kvplan.v1 import plan_pb2

RELEASES = ("vllm-0.32", "vllm-0.33", "vllm-0.34", "")
SEED = 20261205
SAMPLE = {
    "fuzz_wide": 80,
    "fuzz_x": 80,
    "fuzz_y": 200,
    "fuzz_h": 60,
    "fuzz_l": 60,
    "fuzz_z": 20,
    "fuzz_c": 100,
    "fuzz_v": 60,
    "fuzz_j": 40,
}
FUZZ_CATEGORIES = {
    "fuzzw",
    "fuzzx",
    "fuzzy",
    "fuzzh",
    "fuzzl",
    "fuzzz",
    "fuzzc",
    "fuzzv",
    "fuzzj",
}


@pytest.fixture(scope="module")
def fuzz_cases() -> list[Case]:
    cases = generate_cases(SEED, scenarios=False, fuzz=SAMPLE)
    return [case for case in cases if case.category in FUZZ_CATEGORIES]


def test_the_sample_draws_every_section(fuzz_cases: list[Case]) -> None:
    assert set(SAMPLE) == set(SECTIONS)
    drawn = Counter(case.category for case in fuzz_cases)
    assert drawn == {
        "fuzzw": 80,
        "fuzzx": 80,
        "fuzzy": 200,
        "fuzzh": 60,
        "fuzzl": 60,
        "fuzzz": 20,
        "fuzzc": 100,
        "fuzzv": 60,
        "fuzzj": 40,
    }


def test_a_seed_and_its_counts_give_the_same_engines() -> None:
    """What makes a campaign's find reproducible from its seed."""
    counts = {"fuzz_wide": 5, "fuzz_y": 5}
    first = generate_cases(7, scenarios=False, fuzz=counts)
    again = generate_cases(7, scenarios=False, fuzz=counts)
    assert [(case.id, case.request) for case in first] == [
        (case.id, case.request) for case in again
    ]


def test_fuzz_c_leaves_every_other_section_as_it_was() -> None:
    """fuzz_c draws from a generator of its own: a seed's other engines (the other
    fuzz sections and the fixed sections drawn after them) are the ones it gave
    before fuzz_c existed, with or without it."""
    counts = {"fuzz_wide": 3, "fuzz_y": 3, "fuzz_l": 2}
    without = generate_cases(11, scenarios=False, fuzz=counts)
    with_c = generate_cases(11, scenarios=False, fuzz={**counts, "fuzz_c": 5})
    assert [(case.id, case.request) for case in without] == [
        (case.id, case.request) for case in with_c if case.category != "fuzzc"
    ]
    assert sum(case.category == "fuzzc" for case in with_c) == 5


def test_fuzz_v_leaves_every_other_section_as_it_was() -> None:
    """fuzz_v, like fuzz_c, draws from a generator of its own."""
    counts = {"fuzz_wide": 3, "fuzz_y": 3, "fuzz_l": 2, "fuzz_c": 3}
    without = generate_cases(11, scenarios=False, fuzz=counts)
    with_v = generate_cases(11, scenarios=False, fuzz={**counts, "fuzz_v": 5})
    assert [(case.id, case.request) for case in without] == [
        (case.id, case.request) for case in with_v if case.category != "fuzzv"
    ]
    assert sum(case.category == "fuzzv" for case in with_v) == 5


def test_fuzz_j_leaves_every_other_section_as_it_was() -> None:
    """fuzz_j, like fuzz_c, draws from a generator of its own."""
    counts = {"fuzz_wide": 3, "fuzz_y": 3, "fuzz_c": 3, "fuzz_v": 3}
    without = generate_cases(11, scenarios=False, fuzz=counts)
    with_j = generate_cases(11, scenarios=False, fuzz={**counts, "fuzz_j": 5})
    assert [(case.id, case.request) for case in without] == [
        (case.id, case.request) for case in with_j if case.category != "fuzzj"
    ]
    assert sum(case.category == "fuzzj" for case in with_j) == 5


def test_most_fuzz_v_engines_plan_under_0_34() -> None:
    """fuzz_v exists to reach 0.34's planning rules: its budgets are sized so that
    most engines plan (fuzz_c's mostly draw refusals)."""
    cases = [
        case
        for case in generate_cases(SEED, scenarios=False, fuzz={"fuzz_v": 100})
        if case.category == "fuzzv"
    ]
    planned = 0
    for case in cases:
        request = plan_pb2.PlanRequest()
        request.CopyFrom(case.request)
        request.options.engine_version = "vllm-0.34"
        try:
            plan_from_proto(request)
        except PlanningError:
            continue
        planned += 1
    assert planned >= 60, planned


@pytest.mark.parametrize("release", RELEASES)
def test_every_engine_gets_a_plan_or_a_precise_refusal(
    fuzz_cases: list[Case], release: str
) -> None:
    outcomes: Counter[str] = Counter()
    for case in fuzz_cases:
        request = plan_pb2.PlanRequest()
        request.CopyFrom(case.request)
        request.options.engine_version = release
        try:
            response = plan_from_proto(request)
        except PlanningError as refusal:
            assert refusal.code in set(ErrorCode), case.id
            assert str(refusal).strip(), case.id
            if refusal.code is ErrorCode.INVALID_ARGUMENT:
                assert refusal.field, f"{case.id}: {refusal}"
            outcomes[refusal.code.value] += 1
            continue
        assert response.num_blocks >= 1, case.id
        assert len(response.workers) == len(request.workers), case.id
        outcomes["plan"] += 1
    # The sample reaches plans and refusals alike (fewer plans under 0.32, which
    # refuses the fields it lacks), or it would not test much.
    assert outcomes["plan"] >= len(fuzz_cases) // 10, outcomes
    assert sum(outcomes.values()) - outcomes["plan"] >= len(fuzz_cases) // 10, outcomes


def test_fuzz_arguments_name_sections_and_counts() -> None:
    assert parse_fuzz_sections(["fuzz_y=12", "fuzz_h"]) == {"fuzz_y": 12, "fuzz_h": 600}
    assert parse_fuzz_sections(["all"]) == {name: count for name, (_, count) in SECTIONS.items()}
    with pytest.raises(ValueError, match="no fuzz section 'fuzz_q'"):
        parse_fuzz_sections(["fuzz_q"])
    with pytest.raises(ValueError, match="0 or more"):
        parse_fuzz_sections(["fuzz_y=-1"])


@pytest.mark.parametrize("stride", [1, 2, 3, 7])
def test_stride_and_offset_split_a_campaign_into_disjoint_parts(
    fuzz_cases: list[Case], stride: int
) -> None:
    """`--stride K --offset I` (compare.py, prefix_probe.py): K processes with offsets
    0..K-1 together take every engine of the campaign exactly once, in order."""
    parts = [split_cases(fuzz_cases, stride, offset) for offset in range(stride)]
    ids = [case.id for part in parts for case in part]
    assert sorted(ids) == sorted(case.id for case in fuzz_cases)
    assert len(set(ids)) == len(ids)
    assert all(
        len(part) in (len(fuzz_cases) // stride, -(-len(fuzz_cases) // stride)) for part in parts
    )
    assert parts[0][1:2] == fuzz_cases[stride : stride + 1]


@pytest.mark.parametrize(
    ("stride", "offset", "message"),
    [(0, 0, "a stride is 1 or more"), (2, 2, "offset is 0 to stride - 1"), (2, -1, "offset")],
)
def test_a_split_that_drops_or_repeats_engines_is_refused(
    stride: int, offset: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_split(stride, offset)
