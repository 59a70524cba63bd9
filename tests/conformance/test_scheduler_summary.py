"""The scheduler probe's known open classes, its exit status and its part of
conformance/report.md (conformance/scheduler_known.py, conformance/summary.py):
pure Python on made-up reports, no vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conformance import scheduler_known, summary
from conformance.scheduler_known import (
    FIRST,
    KNOWN_OPEN,
    LATER,
    KnownOpen,
    chunk_figures,
    classify,
    known_by_engine,
    known_class,
    unexpected_disagreements,
)

REPO = Path(__file__).resolve().parents[2]
HYBRID = "fuzz_finds/prefix-mtp-reprefilled-tail-hybrid"
MAMBA = "mamba_junction/qwen35-b64-h16-mtp-off"
# A made-up open class: none is open now, and the machinery must still work when one is.
OPEN = "fuzz/f100"
SAMPLE_CLASS = KnownOpen(
    name="sample-open-class",
    reason="a made-up class for these tests",
    engines=(OPEN,),
    requests=frozenset({FIRST, LATER}),
)
Json = dict[str, Any]


@pytest.fixture
def sample_class(monkeypatch: pytest.MonkeyPatch) -> KnownOpen:
    """KNOWN_OPEN holding SAMPLE_CLASS alone, for the probe's classification and
    the summary."""
    monkeypatch.setattr(scheduler_known, "KNOWN_OPEN", (SAMPLE_CLASS,))
    return SAMPLE_CLASS


def _record(case_id: str, chunk: str, later: bool, scheduler: int = 128, kvplan: int = 0) -> Json:
    record: Json = {
        "id": case_id,
        "chunk": 87,
        "chunk_spec": chunk,
        "shared": 191,
        "stored": 417,
        "scheduler": scheduler,
        "kvplan": kvplan,
    }
    if later:
        record["later"] = True
    return record


@pytest.mark.parametrize(
    ("case_id", "chunk", "later", "expected"),
    [
        # The MTP hybrid's re-keyed partial tail is modelled: no longer known.
        (HYBRID, "x1.37", False, None),
        (HYBRID, "8192", True, None),
        # Mamba hybrids' kept blocks a chunk ended inside are modelled (99b9670):
        # none of their probes is known any more, first or later, at any chunk.
        (MAMBA, "x1.37", True, None),
        ("fuzzj/j0012", "x1.37", True, None),
        ("fuzz_finds/prefix-drafter-on-last-stage", "x1.37", True, None),
        (MAMBA, "x1.37", False, None),
        ("fuzz_finds/prefix-drafter-on-last-stage", "x1.37", False, None),
        ("fuzz_finds/prefix-drafter-on-last-stage", "8192", False, None),
        ("fuzzj/j0006", "x1.37", False, None),
        (MAMBA, "8192", True, None),  # nor another chunk
        (MAMBA, "x1.3", True, None),
        # Exact ids: the hybrid's sibling find, or a longer id, is not covered.
        ("fuzz_finds/prefix-mtp-reprefilled-tail", "8192", False, None),
        (HYBRID + "-2", "8192", False, None),
        ("scenarios/mamba_junction/x", "x1.37", True, None),
        ("fuzz/f230", "x1.37", True, None),
    ],
)
def test_a_disagreement_is_known_only_as_its_class_names_it(
    case_id: str, chunk: str, later: bool, expected: str | None
) -> None:
    assert known_class(_record(case_id, chunk, later)) == expected


def test_none_is_open_now() -> None:
    assert KNOWN_OPEN == ()


@pytest.mark.parametrize(
    ("case_id", "chunk", "later", "expected"),
    [
        (OPEN, "x1.37", False, "sample-open-class"),
        (OPEN, "8192", True, "sample-open-class"),
        (OPEN + "-2", "8192", False, None),  # exact ids
        (HYBRID, "8192", False, None),
    ],
)
def test_an_open_class_covers_its_engines_alone(
    sample_class: KnownOpen, case_id: str, chunk: str, later: bool, expected: str | None
) -> None:
    assert known_class(_record(case_id, chunk, later)) == expected
    assert known_class(_record(case_id, chunk, later), known=()) is None


def _counts(**given: int) -> Json:
    counts = {
        "engines": 10,
        "probes": 100,
        "agree": 100,
        "later_probes": 50,
        "later_agree": 50,
        "stalled": 0,
        "crashed": 0,
    }
    counts.update(given)
    return counts


def _report(records: list[Json], chunks: tuple[str, ...] = ("x1.37", "8192"), **meta: Any) -> Json:
    """A report as the probe writes it: each record classified and counted."""
    counts = {chunk: _counts(known_first=0, known_later=0) for chunk in chunks}
    for record in records:
        c = counts[record["chunk_spec"]]
        c["later_agree" if record.get("later") else "agree"] -= 1
        classify(record, c)
    return {
        "counts": counts,
        "disagreements": records,
        "failure_classes": {},
        "meta": {"vllm": "0.34.0", "seconds": 12.5, "stride": 1, "offset": 0, **meta},
    }


def test_known_disagreements_do_not_fail_the_run_others_do(sample_class: KnownOpen) -> None:
    known = [
        _record(OPEN, "x1.37", False, 1728, 1870),
        _record(OPEN, "8192", True, 1728, 1870),
        _record(OPEN, "x1.37", True, 1728, 1870),
        _record(OPEN, "x1.37", True, 1728, 1870),
    ]
    report = _report(known)
    assert [f.known_first + f.known_later for f in chunk_figures(report)] == [3, 1]
    assert [(f.disagree_first, f.disagree_later) for f in chunk_figures(report)] == [
        (1, 2),
        (0, 1),
    ]
    assert unexpected_disagreements(report) == 0
    # A Mamba engine's disagreement is of no known class (modelled): it fails.
    report = _report([*known, _record(MAMBA, "x1.37", True)])
    assert unexpected_disagreements(report) == 1
    assert [f.unexpected for f in chunk_figures(report)] == [1, 0]


def test_vllms_own_failures_and_stalls_do_not_fail_the_run() -> None:
    report = _report([])
    report["counts"]["8192"].update(stalled=9, crashed=2)
    assert unexpected_disagreements(report) == 0
    assert [(f.stalls, f.vllm_failures) for f in chunk_figures(report)] == [(0, 0), (9, 2)]


def test_every_counted_disagreement_fails_when_not_classified_known() -> None:
    """The exit status rests on the counts, not on the kept records (the probe keeps
    at most 2,000): a disagreement counted but not recorded still fails, and a
    report without the known counts (an older probe) counts none as known."""
    report = _report([])
    report["counts"]["x1.37"]["agree"] -= 3
    assert unexpected_disagreements(report) == 3
    del report["counts"]["x1.37"]["known_first"]
    assert unexpected_disagreements(report) == 3


def test_the_known_classes_are_documented_and_name_real_finds() -> None:
    docs = (REPO / "docs/prefix-caching.md").read_text()
    finds = {f"fuzz_finds/{p.stem}" for p in (REPO / "conformance/finds").glob("*.json")}
    assert len({k.name for k in KNOWN_OPEN}) == len(KNOWN_OPEN)
    for entry in KNOWN_OPEN:
        assert entry.reason and entry.requests and entry.engines
        assert f"`{entry.name}`" in docs, entry.name
        for pattern in entry.engines:
            if pattern.startswith("fuzz_finds/"):
                assert pattern in finds, pattern


def _write(tmp_path: Path, release: str, report: Json) -> None:
    (tmp_path / f"scheduler-vllm-{release}.json").write_text(json.dumps(report))


def test_the_summary_shows_figures_per_release_and_chunk(
    tmp_path: Path, sample_class: KnownOpen
) -> None:
    _write(
        tmp_path,
        "0.34",
        _report(
            [_record(OPEN, "x1.37", False, 1728, 1870), _record(OPEN, "x1.37", True)],
            stride=8,
        ),
    )
    clean = _report([], chunks=("8192",))
    clean["meta"]["vllm"] = "0.33.0"
    clean["counts"]["8192"]["stalled"] = 4
    clean["failure_classes"] = {"SchedulerStalled: nothing scheduled": 4}
    _write(tmp_path, "0.33", clean)
    out = tmp_path / "summary.md"
    assert summary.main(["--reports", str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Prefix caching against vLLM's scheduler (chunked prefill)" in text
    rows = [line for line in text.splitlines() if line.startswith("| 0.3")]
    # vLLM, chunk, engines, probes, disagree, later probes, disagree later, known
    # open, unexpected, stalls, vLLM failures, wall s (on a release's first row).
    assert rows == [
        "| 0.33.0 | 8192 | 10 | 100 | 0 | 50 | 0 | 0 | 0 | 4 | 0 | 12.5 "
        "| [scheduler-vllm-0.33.json](scheduler-vllm-0.33.json) |",
        "| 0.34.0 | x1.37 | 10 | 100 | 1 | 50 | 1 | 2 | 0 | 0 | 0 | 12.5 "
        "| [scheduler-vllm-0.34.json](scheduler-vllm-0.34.json) |",
        "| 0.34.0 | 8192 | 10 | 100 | 0 | 50 | 0 | 0 | 0 | 0 | 0 |  "
        "| [scheduler-vllm-0.34.json](scheduler-vllm-0.34.json) |",
    ]
    assert "Engines: every 8-th engine from offset 0" in text
    # The known classes, by engine, under their reasons.
    assert f"  - vLLM 0.34, `{OPEN}`: x1.37 first 1, x1.37 later 1" in text
    assert "### Unexpected disagreements (failing `make conformance`)\n\nnone" in text
    assert "- vLLM 0.33: 4x SchedulerStalled: nothing scheduled" in text


def test_the_summary_lists_unexpected_disagreements_and_fixed_classes(
    tmp_path: Path, sample_class: KnownOpen
) -> None:
    _write(tmp_path, "0.34", _report([_record("fuzz/f230", "8192", True, 64, 96)]))
    out = tmp_path / "summary.md"
    summary.main(["--reports", str(tmp_path), "--out", str(out)])
    text = out.read_text()
    assert "- vLLM 0.34: 1 probes" in text
    assert (
        "  - `fuzz/f230` chunk 8192 (87 tokens), later request, 191 of 417 shared: "
        "the scheduler serves 64, kvplan says 96"
    ) in text
    # A listed class no run disagrees in any more is pointed out (fixed?).
    assert text.count("no longer disagrees in these reports") == 1


def test_the_summary_says_when_no_class_is_open(tmp_path: Path) -> None:
    _write(tmp_path, "0.34", _report([_record(HYBRID, "8192", False, 1728, 1870)]))
    out = tmp_path / "summary.md"
    summary.main(["--reports", str(tmp_path), "--out", str(out)])
    text = out.read_text()
    assert "### Known open classes (not failing `make conformance`)\n\nnone" in text
    # The modelled hybrid's disagreement, were there one, would fail the run.
    assert "- vLLM 0.34: 1 probes" in text


def test_known_by_engine_counts_per_chunk_and_request(sample_class: KnownOpen) -> None:
    report = _report(
        [
            _record(OPEN, "x1.37", True),
            _record(OPEN, "x1.37", True),
            _record(OPEN, "8192", False),
            _record(OPEN, "8192", True),
            _record(HYBRID, "8192", True),  # of no class: not listed
        ]
    )
    assert known_by_engine(report) == {
        "sample-open-class": {OPEN: {"x1.37 later": 2, "8192 first": 1, "8192 later": 1}},
    }


def test_no_scheduler_reports_no_section(tmp_path: Path) -> None:
    out = tmp_path / "summary.md"
    summary.main(["--reports", str(tmp_path), "--out", str(out)])
    assert "against vLLM's scheduler" not in out.read_text()
