"""Which KV cache layout an engine runs with: resolved once for all workers from
each worker's list of supported layouts, as the engine core of each release does.

Every worker reports the layouts all its attention backends support, most
preferred first. The lists combine by the rule set's `LayoutMerge`, then the
engine's specs narrow the candidates (facts read off vLLM 0.32 / 0.33 / 0.34,
identical in the three releases unless said):

* layers whose (heads, states per block, page bytes) differ can only alias one
  page in a block-compact layout (L and B the two outer axes);
* DCP-sharded and replicated attention layers with mixed page sizes need
  independent groups, which only a block-outermost layout packs;
* vLLM 0.34: an extensible KV cache behind a KV connector (HiSparse here) needs a
  block-compact layout, the connector registers one run per layer.

The layout asked for (`options.layout`, vLLM's `VLLM_KV_CACHE_LAYOUT`) must be a
candidate; without one a KV connector's layout wins when it is a candidate (HiSparse's
asks for BLHNC), else the first candidate. Without any list the layout is
taken as given (LBNHC when unset), which is what a layout already resolved by the
engine does in every release.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvplan.core.errors import FieldViolation, InvalidRequest, UnplannableSpecs
from kvplan.core.layout import KVCacheLayout
from kvplan.core.rules import LayoutMerge, RuleSet
from kvplan.core.specs import AttentionSpec, CircularBufferSpec, KVCacheSpec

# vLLM's declaration order of its KVCacheLayout members: how it breaks ties.
TIE_BREAK_ORDER = (
    KVCacheLayout.LBHNC,
    KVCacheLayout.LBNHC,
    KVCacheLayout.LHBNC,
    KVCacheLayout.BLHNC,
    KVCacheLayout.BLNHC,
    KVCacheLayout.BHLNC,
)
# What a worker reports when none of its backends declares a list (any layout works).
NO_PREFERENCE = (
    KVCacheLayout.LBNHC,
    KVCacheLayout.LBHNC,
    KVCacheLayout.BLNHC,
    KVCacheLayout.BLHNC,
    KVCacheLayout.BHLNC,
    KVCacheLayout.LHBNC,
)
DEFAULT_LAYOUT = KVCacheLayout.LBNHC


@dataclass(frozen=True)
class WorkerLayouts:
    """One worker's supported layouts; `index` is its position in the request."""

    index: int
    rank: int
    layouts: tuple[KVCacheLayout, ...]

    @property
    def field(self) -> str:
        return f"workers[{self.index}].supported_layouts"

    def describe(self) -> str:
        return f"rank {self.rank} [{', '.join(layout.name for layout in self.layouts)}]"


@dataclass(frozen=True)
class LayoutResolution:
    layout: KVCacheLayout
    # The layouts the resolution left, best first; empty without worker lists.
    candidates: tuple[KVCacheLayout, ...] = ()


def validate_worker_layouts(workers: Sequence[WorkerLayouts]) -> None:
    """Every worker lists its layouts or none does; no layout twice in a list."""
    given = [worker for worker in workers if worker.layouts]
    if given and len(given) != len(workers):
        missing = next(worker for worker in workers if not worker.layouts)
        raise InvalidRequest(
            f"worker rank {missing.rank} gives no supported_layouts while rank "
            f"{given[0].rank} does; give every worker's list or none",
            field=missing.field,
        )
    for worker in given:
        seen: set[KVCacheLayout] = set()
        for position, layout in enumerate(worker.layouts):
            if layout in seen:
                raise InvalidRequest(
                    f"worker rank {worker.rank} lists {layout.name} twice in supported_layouts",
                    field=f"{worker.field}[{position}]",
                )
            seen.add(layout)


def merge_by_first_choice(
    lists: Sequence[tuple[KVCacheLayout, ...]],
) -> list[KVCacheLayout]:
    """vLLM 0.34's merge: identical lists keep their order; otherwise the layouts
    in every list, most first choices first, ties in vLLM's enum order. Empty
    when no layout is in every list."""
    first = lists[0]
    if all(layouts == first for layouts in lists[1:]):
        return list(first)
    votes = Counter(layouts[0] for layouts in lists)
    common = set(first).intersection(*lists[1:])
    in_enum_order = [layout for layout in TIE_BREAK_ORDER if layout in common]
    return sorted(in_enum_order, key=lambda layout: -votes[layout])  # stable


def _merged(workers: Sequence[WorkerLayouts], rules: RuleSet) -> list[KVCacheLayout]:
    if rules.layout_merge is LayoutMerge.REQUIRE_EQUAL:
        first = workers[0]
        for worker in workers[1:]:
            if worker.layouts != first.layouts:
                raise UnplannableSpecs(
                    f"the workers support different KV cache layouts ({first.describe()}; "
                    f"{worker.describe()}); {rules.description} needs every worker to "
                    "report the same list (vLLM 0.34 plans with the layouts they share)",
                    violations=[FieldViolation(w.field, w.describe()) for w in (first, worker)],
                )
        return list(first.layouts)
    # Workers whose backends declare nothing report the default order: no vote.
    voting = [w for w in workers if w.layouts != NO_PREFERENCE] or list(workers)
    candidates = merge_by_first_choice([w.layouts for w in voting])
    if not candidates:
        raise UnplannableSpecs(
            "no KV cache layout is supported by every worker: "
            + "; ".join(w.describe() for w in voting),
            violations=[FieldViolation(w.field, w.describe()) for w in voting],
        )
    return candidates


def _narrow(
    candidates: list[KVCacheLayout], keep: str, why: str, workers: Sequence[WorkerLayouts]
) -> list[KVCacheLayout]:
    kept = [layout for layout in candidates if getattr(layout, keep)]
    if not kept:
        raise UnplannableSpecs(
            f"{why}, but no such layout is supported by every worker: "
            + "; ".join(w.describe() for w in workers)
        )
    return kept


def resolve_layout(
    workers: Sequence[WorkerLayouts],
    specs: Iterable[KVCacheSpec],
    requested: KVCacheLayout | None,
    rules: RuleSet,
    *,
    connector_layout: KVCacheLayout | None = None,
    connector_needs_block_compact: bool = False,
) -> LayoutResolution:
    """The engine's layout. `specs` are every worker's own layer specs;
    `connector_layout`: the layout a KV connector asks for (dropped, as vLLM does
    with a warning, when it is no candidate); `connector_needs_block_compact`: an
    extensible cache behind a KV connector."""
    validate_worker_layouts(workers)
    if not workers or not workers[0].layouts:
        return LayoutResolution(requested if requested is not None else DEFAULT_LAYOUT)
    candidates = _merged(workers, rules)

    # Specs without per-layer views (HiSparse hot / resident) lay out their own pages.
    viewed = [spec for spec in specs if spec.has_layer_views]
    if len({(s.num_heads, s.states_per_block, s.page_size_bytes) for s in viewed}) > 1:
        candidates = _narrow(
            candidates,
            "is_block_compact",
            "layers of different (heads, states, page bytes) need a block-compact layout",
            workers,
        )
    sharding = {
        spec.dcp_sharded
        for spec in viewed
        # Ring buffers address their pages themselves (no slot mapping).
        if isinstance(spec, AttentionSpec) and not isinstance(spec, CircularBufferSpec)
    }
    if len(sharding) > 1 and len({spec.page_size_bytes for spec in viewed}) > 1:
        candidates = _narrow(
            candidates,
            "is_block_outermost",
            "DCP-sharded and replicated layers with mixed page sizes need a block-outermost layout",
            workers,
        )
    if connector_needs_block_compact:
        candidates = _narrow(
            candidates,
            "is_block_compact",
            "an extensible KV cache behind a KV connector needs a block-compact layout",
            workers,
        )

    if requested is not None and requested not in candidates:
        raise InvalidRequest(
            f"options.layout {requested.name} is not one the workers can all use here; "
            f"valid: {', '.join(layout.name for layout in candidates)} (or leave it unset)",
            field="options.layout",
        )
    if requested is not None:
        layout = requested
    elif connector_layout in candidates:
        layout = connector_layout
    else:
        layout = candidates[0]
    return LayoutResolution(layout, tuple(candidates))


__all__ = [
    "DEFAULT_LAYOUT",
    "NO_PREFERENCE",
    "TIE_BREAK_ORDER",
    "LayoutResolution",
    "WorkerLayouts",
    "merge_by_first_choice",
    "resolve_layout",
    "validate_worker_layouts",
]
