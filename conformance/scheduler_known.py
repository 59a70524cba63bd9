"""The scheduler probe's known open disagreements, and what fails `make conformance`.

conformance/scheduler_probe.py compares kvplan's predicted prefix-cache hit with what
each release's real v1 Scheduler serves under chunked prefill. A disagreement in one
of the classes below is known, documented (docs/prefix-caching.md, "Against vLLM's
scheduler: chunked prefill", the **Open** paragraphs) and being worked on: the probe
counts and reports it, and `make conformance` does not fail on it. Any other
disagreement fails the probe, and so `make conformance`. vLLM's own failures (an
engine its scheduler raises on, a probe it stalls in: SchedulerStalled) are reported,
never failures of kvplan, as in conformance/prefix_probe.py.

Keep this list short and exact: an entry names the engines (case ids, fnmatch
patterns), the requests (the first one sharing the prefix, the later one after its
junction is recorded) and the chunk specs it covers, with the reason. When a class is
fixed, delete its entry; conformance/report.md says when a listed class no longer
disagrees anywhere. Standard library only: conformance/summary.py runs outside the
vLLM environments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

Json = dict[str, Any]

FIRST, LATER = "first", "later"


@dataclass(frozen=True)
class KnownOpen:
    """A class of scheduler-probe disagreements that is known and not yet modelled."""

    name: str
    reason: str
    engines: tuple[str, ...]  # fnmatch patterns on the case id
    requests: frozenset[str]  # FIRST, LATER
    chunks: tuple[str, ...] | None = None  # chunk specs as given (--chunk); None: all

    def covers(self, record: Mapping[str, Any]) -> bool:
        """Whether a disagreement record of the probe (its `id`, `chunk_spec` and
        `later`) is of this class."""
        request = LATER if record.get("later") else FIRST
        return (
            request in self.requests
            and (self.chunks is None or record.get("chunk_spec") in self.chunks)
            and any(fnmatchcase(str(record.get("id", "")), p) for p in self.engines)
        )


# None open. The last, `prefix-mtp-reprefilled-tail-hybrid` (full attention's partial
# tail re-keyed as the stored request's sampled tokens extend its hashes), is modelled
# (kvplan.core.prefix_cache: PrefixCacheSetup.stored_output_tokens).
KNOWN_OPEN: tuple[KnownOpen, ...] = ()


def known_class(record: Mapping[str, Any], known: Iterable[KnownOpen] | None = None) -> str | None:
    """The name of the known open class a disagreement record is of (of `known`;
    None: KNOWN_OPEN as it is now), else None."""
    for entry in KNOWN_OPEN if known is None else known:
        if entry.covers(record):
            return entry.name
    return None


def classify(record: Json, counts: Json) -> None:
    """Mark a disagreement record of the probe with its known open class (`known`:
    the name, or None) and count it in its chunk's `counts` (`known_first` or
    `known_later`) when it is of one."""
    record["known"] = known_class(record)
    if record["known"] is not None:
        key = "known_later" if record.get("later") else "known_first"
        counts[key] = counts.get(key, 0) + 1


@dataclass(frozen=True)
class ChunkFigures:
    """One chunk spec's figures of a scheduler-probe report."""

    chunk: str
    engines: int
    probes: int
    disagree_first: int
    later_probes: int
    disagree_later: int
    known_first: int
    known_later: int
    stalls: int
    vllm_failures: int  # engines vLLM's scheduler raised on

    @property
    def unexpected(self) -> int:
        """Disagreements outside the known open classes: each fails the run."""
        return self.disagree_first + self.disagree_later - self.known_first - self.known_later


def chunk_figures(report: Mapping[str, Any]) -> list[ChunkFigures]:
    """Per chunk spec, in the report's order."""
    figures = []
    for chunk, c in report["counts"].items():
        figures.append(
            ChunkFigures(
                chunk=chunk,
                engines=c["engines"],
                probes=c["probes"],
                disagree_first=c["probes"] - c["agree"],
                later_probes=c["later_probes"],
                disagree_later=c["later_probes"] - c["later_agree"],
                known_first=c.get("known_first", 0),
                known_later=c.get("known_later", 0),
                stalls=c["stalled"],
                vllm_failures=c["crashed"],
            )
        )
    return figures


def unexpected_disagreements(report: Mapping[str, Any]) -> int:
    """Disagreements of a scheduler-probe report outside KNOWN_OPEN (as the probe
    classified them): the run fails when this is not 0."""
    return sum(f.unexpected for f in chunk_figures(report))


def known_by_engine(report: Mapping[str, Any]) -> dict[str, dict[str, dict[str, int]]]:
    """The report's recorded known disagreements: class -> engine id -> "chunk
    first|later" -> probes."""
    by_class: dict[str, dict[str, dict[str, int]]] = {}
    for record in report.get("disagreements", []):
        name = record.get("known")
        if not name:
            continue
        key = f"{record['chunk_spec']} {LATER if record.get('later') else FIRST}"
        engine = by_class.setdefault(name, {}).setdefault(record["id"], {})
        engine[key] = engine.get(key, 0) + 1
    return by_class
