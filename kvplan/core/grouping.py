"""Grouping: which layers share a block table, in vLLM 0.33's decision order.

1. hybrid manager disabled -> promote local attention to full allocation
2. no specs -> attention-free (no groups)
3. every spec merges into one -> one group
4. one layer type (pages may differ) -> one wrapper group
5. block-outermost layout with mixed pages -> packed groups
6. unify page sizes (or fall back to full allocation for MLA + sliding window)
7. equal-size hybrid groups over one page size
8. hidden-state layers appended with pages aligned to the common page
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NoReturn

from kvplan.core.diagnostics import PaddingInfo, PlanWarning, WarningCode
from kvplan.core.errors import InvalidRequest, UnplannableSpecs
from kvplan.core.groups import GroupingPath, KVCacheGroup
from kvplan.core.hisparse import HiSparseConfig, hisparse_groups
from kvplan.core.layout import KVCacheLayout
from kvplan.core.rules import FIELD_TOPK_BUFFER_WIDTH, KVPLAN, RuleSet
from kvplan.core.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    ConflictingWindows,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    IncompatibleSpecs,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SpecInvariantError,
    UniformTypeSpecs,
    cdiv,
    init_field_names,
)

SpecDict = dict[str, KVCacheSpec]


class PageSizesNotUnifiable(UnplannableSpecs):
    """A smaller page neither divides the largest page nor may be padded."""


@dataclass(frozen=True)
class Grouping:
    """Layer names per group with their group spec, before ids and draft flags."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    padding_layers: int = 0


@dataclass
class GroupingResult:
    path: GroupingPath
    groups: list[KVCacheGroup]
    specs: SpecDict  # the specs grouping worked on (after promotion)
    # The spec dict the positional draft rule reads (the packed path leaves
    # hidden-state layers out of it).
    annotation_specs: SpecDict
    # The positional rules see only `annotated_groups` (packed path: not the
    # hidden-state groups appended after it; HiSparse: only the regular groups).
    annotated_group_count: int
    # Whether the seed's positional / spec-marker draft rules run on this path.
    positional_rules_apply: bool
    warnings: list[PlanWarning] = field(default_factory=list)
    padding: list[PaddingInfo] = field(default_factory=list)
    group_size: int = 0
    page_sizes_unified: bool = False
    local_attention_promoted: bool = False
    annotated_group_start: int = 0
    # Layers no group holds, where the release finds them only as it builds each
    # worker's configuration (RuleSet.worker_config_checked_after_memory).
    unassigned: frozenset[str] = frozenset()

    @property
    def annotated_groups(self) -> list[KVCacheGroup]:
        start = self.annotated_group_start
        return self.groups[start : start + self.annotated_group_count]


def _distinct(specs: Iterable[KVCacheSpec]) -> list[KVCacheSpec]:
    """Each spec object once, in first-seen order. Layers share spec objects, and a
    merge depends only on the set of specs and on the first (Qwen3-Next-like, 65
    layers: grouping 113 -> 102 µs)."""
    return list({id(spec): spec for spec in specs}.values())


def _merged(values: list[KVCacheSpec], rules: RuleSet) -> KVCacheSpec | None:
    """The one spec distinct `values` merge into, or None. Conflicting windows
    propagate as an error."""
    try:
        return type(values[0]).merge(values, rules)
    except IncompatibleSpecs:
        return None


def is_uniform_spec(specs: Mapping[str, KVCacheSpec], rules: RuleSet = KVPLAN) -> bool:
    """All specs merge into one. Conflicting windows propagate as an error."""
    values = _distinct(specs.values())
    return not values or _merged(values, rules) is not None


def is_uniform_type(specs: Mapping[str, KVCacheSpec]) -> bool:
    return UniformTypeSpecs.is_uniform_type(specs)


def _merge_group(specs: SpecDict, names: Sequence[str], rules: RuleSet) -> KVCacheSpec:
    layer_specs = _distinct(specs[name] for name in names)
    return type(layer_specs[0]).merge(layer_specs, rules)


def _replace_as(
    spec: AttentionSpec, target: type[AttentionSpec], drop: tuple[str, ...], **changes: Any
) -> AttentionSpec:
    """Rebuild `spec` as `target`; every field must exist there unless dropped."""
    target_fields = {f.name for f in fields(target) if f.init}
    kwargs = {name: getattr(spec, name) for name in init_field_names(spec) if name not in drop}
    missing = sorted(set(kwargs) - target_fields)
    if missing:
        raise UnplannableSpecs(
            f"{spec.kind} layers cannot be allocated as {target.kind}: "
            f"{', '.join(missing)} has no counterpart there"
        )
    kwargs.update(changes)
    return target(**kwargs)


# Local-attention kinds and the full-allocation kind each is promoted to.
_PROMOTIONS: dict[type[KVCacheSpec], type[AttentionSpec]] = {
    SlidingWindowMLASpec: MLAAttentionSpec,
    SlidingWindowSpec: FullAttentionSpec,
    ChunkedLocalAttentionSpec: FullAttentionSpec,
}


def _promotion_target(spec: KVCacheSpec) -> type[AttentionSpec] | None:
    return next((_PROMOTIONS[cls] for cls in type(spec).__mro__ if cls in _PROMOTIONS), None)


def promoted_spec(spec: AttentionSpec, rules: RuleSet, **changes: Any) -> AttentionSpec:
    """A local-attention layer allocated as full attention: its kind's promotion
    target, without the window's trailing extension and, where the release drops
    it, the replay bound (both mean nothing once every token keeps its block).
    UnplannableSpecs where a field has no counterpart there."""
    target = _promotion_target(spec)
    if target is None:
        raise UnplannableSpecs(f"{spec.kind} layers are not promoted to full allocation")
    drop: tuple[str, ...] = ("extra_retained_tokens",)
    if rules.promotion_drops_bounded_replay:
        drop = (*drop, "bounded_replay")
    return _replace_as(spec, target, drop=drop, **changes)


def allocated_layer_spec(declared: KVCacheSpec, allocated_kind: str, rules: RuleSet) -> KVCacheSpec:
    """A layer's `declared` spec as its plan allocated it, given the kind of the
    spec it was allocated as (a planned group's per-layer spec): promoted
    (promoted_spec) where that kind is its promotion target's, else as declared.
    What such a layer does beyond its kind (opting out of prefix caching: a
    bounded-replay window that vLLM 0.34 promotes to MLA does not) is the
    promoted spec's."""
    target = _promotion_target(declared)
    if target is None or declared.kind == allocated_kind or target.kind != allocated_kind:
        return declared
    assert isinstance(declared, AttentionSpec)  # every promoted kind is attention
    return promoted_spec(declared, rules)


def promote_local_attention(specs: SpecDict, rules: RuleSet = KVPLAN) -> SpecDict:
    """Allocate sliding-window / chunked layers as full attention (compute is
    unchanged). Raises UnplannableSpecs if the result is still not one type."""
    promoted = dict(specs)
    if is_uniform_spec(promoted, rules) or is_uniform_type(promoted):
        return promoted
    values = list(promoted.values())
    has_full = any(isinstance(spec, FullAttentionSpec) for spec in values)
    has_local = any(
        isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec) for spec in values
    )
    full_block_sizes = {spec.block_size for spec in values if isinstance(spec, FullAttentionSpec)}
    full_block_size = next(iter(full_block_sizes)) if len(full_block_sizes) == 1 else None
    if has_full and has_local:
        for name, spec in specs.items():
            target = _promotion_target(spec)
            if target is None:
                continue
            assert isinstance(spec, AttentionSpec)
            block_size = full_block_size or spec.block_size
            padded = spec.page_size_padded
            if padded is not None:
                rescaled = spec.unpadded_page_size_bytes * block_size // spec.block_size
                padded = max(padded, rescaled)
            promoted[name] = promoted_spec(
                spec, rules, block_size=block_size, page_size_padded=padded
            )
    try:
        unified = is_uniform_spec(promoted, rules) or is_uniform_type(promoted)
    except ConflictingWindows as error:
        raise UnplannableSpecs(
            f"Failed to promote local KV cache specs to one unified type: {error}"
        ) from error
    if not unified:
        kinds = sorted({spec.kind for spec in promoted.values()})
        raise UnplannableSpecs(
            "Failed to promote local KV cache specs to one unified type "
            f"(kinds left: {', '.join(kinds)}); the hybrid KV cache manager is needed "
            "for this model (disable_hybrid_kv_cache_manager=false)"
        )
    return promoted


def _disable_hybrid(
    specs: SpecDict, warnings: list[PlanWarning], rules: RuleSet
) -> tuple[SpecDict, bool]:
    """Promote replicated (DCP-unsharded attention) and other layers separately."""
    partitions: dict[bool, SpecDict] = {}
    for name, spec in specs.items():
        replicated = isinstance(spec, AttentionSpec) and not spec.dcp_sharded
        partitions.setdefault(replicated, {})[name] = spec
    result = dict(specs)
    changed = False
    for partition in partitions.values():
        promoted = promote_local_attention(partition, rules)
        if promoted == partition:
            continue
        changed = True
        result.update(promoted)
    if changed:
        warnings.append(
            PlanWarning(
                WarningCode.HYBRID_MANAGER_DISABLED,
                "hybrid KV cache manager is disabled: sliding-window / chunked layers are "
                "allocated as full attention (no memory saved outside their windows)",
            )
        )
    return result, changed


def approximate_gcd(values: Sequence[int], lower_bound: int | None = None) -> int:
    """The divisor in [lower_bound, max(values)] that minimises total round-up
    padding of `values`; ties go to the larger divisor."""
    if not values:
        raise InvalidRequest("approximate_gcd needs a non-empty list of values")
    if any(value <= 0 for value in values):
        raise InvalidRequest(f"approximate_gcd needs positive values, got {list(values)}")
    low = max(1, lower_bound if lower_bound is not None else 1)
    high = max(values)
    if low > high:
        return low
    best, best_pad = low, -1
    for divisor in range(low, high + 1):
        pad = sum((divisor - value % divisor) % divisor for value in values)
        if best_pad < 0 or pad < best_pad or (pad == best_pad and divisor > best):
            best, best_pad = divisor, pad
    return best


_Bucket = tuple[UniformTypeSpecs, dict[int, list[str]], bool]


def _packed_buckets(specs: SpecDict) -> list[_Bucket]:
    """The layers in buckets of one layer type (first fit, in order), each with its
    layers by page size and whether every page size has as many layers."""
    buckets: list[SpecDict] = []
    for name, spec in specs.items():
        for bucket in buckets:
            if is_uniform_type({**bucket, name: spec}):
                bucket[name] = spec
                break
        else:
            buckets.append({name: spec})

    bucketed: list[_Bucket] = []
    for bucket in buckets:
        wrapper = UniformTypeSpecs.from_specs(bucket)
        if wrapper is None:
            raise SpecInvariantError("a packed bucket is not of one layer type")
        by_page: dict[int, list[str]] = {}
        for name, spec in bucket.items():
            by_page.setdefault(spec.page_size_bytes, []).append(name)
        balanced = len({len(names) for names in by_page.values()}) == 1
        bucketed.append((wrapper, by_page, balanced))
    return bucketed


def packed_groups(specs: SpecDict, layout: KVCacheLayout) -> list[Grouping] | None:
    """Groups for block-outermost layouts with mixed page sizes: layers packed
    side by side inside each block."""
    if not layout.is_block_outermost or len({s.page_size_bytes for s in specs.values()}) <= 1:
        return None
    bucketed = _packed_buckets(specs)

    min_repeats = max(
        (
            wrapper.max_layers_per_page_size()
            for wrapper, by_page, balanced in bucketed
            if balanced and len(by_page) > 1
        ),
        default=0,
    )
    repeats = (
        approximate_gcd(
            [wrapper.max_layers_per_page_size() for wrapper, _, balanced in bucketed if balanced],
            lower_bound=min_repeats,
        )
        if min_repeats
        else None
    )

    def group_count(wrapper: UniformTypeSpecs, balanced: bool) -> int:
        if balanced and repeats is not None:
            return cdiv(wrapper.max_layers_per_page_size(), repeats)
        return 1

    def widest_group_bytes(by_page: dict[int, list[str]], count: int) -> int:
        return sum(cdiv(len(names), count) * page for page, names in by_page.items())

    def is_state_bucket(wrapper: UniformTypeSpecs) -> bool:
        # State-like buckets can shrink down to one layer per group.
        if isinstance(wrapper.first_spec, MambaSpec | CircularBufferSpec):
            return True
        return repeats is None and isinstance(wrapper.first_spec, SlidingWindowSpec)

    anchor = max(
        (
            widest_group_bytes(
                by_page,
                len(wrapper.layer_specs)
                if is_state_bucket(wrapper)
                else group_count(wrapper, balanced),
            )
            for wrapper, by_page, balanced in bucketed
        ),
        default=0,
    )

    result: list[Grouping] = []
    for wrapper, by_page, balanced in bucketed:
        count = group_count(wrapper, balanced)
        if anchor and is_state_bucket(wrapper):
            states_per_block = max(anchor // wrapper.first_spec.page_size_bytes, 1)
            count = max(count, cdiv(len(wrapper.layer_specs), states_per_block))
        if count == 1:
            result.append(Grouping(tuple(name for name, _ in wrapper.layer_specs), wrapper))
            continue
        pattern_repeats = list(zip(*by_page.values(), strict=False))
        members = wrapper.specs_by_layer
        for index in range(count):
            names = tuple(name for repeat in pattern_repeats[index::count] for name in repeat)
            if not names:
                # vLLM 0.33 fails here too (an empty packed group).
                raise SpecInvariantError(
                    f"the packed layout cannot split {len(wrapper.layer_specs)} "
                    f"{wrapper.first_spec.kind} layers of mixed page sizes into {count} groups; "
                    "use a layer-outer layout such as LBNHC"
                )
            group_spec = UniformTypeSpecs.from_specs({name: members[name] for name in names})
            if group_spec is None:
                raise SpecInvariantError("a packed group is not of one layer type")
            result.append(Grouping(names, group_spec))
    return result


def unify_page_sizes(specs: SpecDict) -> tuple[SpecDict, bool]:
    """Give every layer the largest page: Mamba and non-MLA attention pages are
    padded, other pages grow with their block size when they divide it."""
    pages = {spec.page_size_bytes for spec in specs.values()}
    if len(pages) <= 1:
        return specs, False
    largest = max(pages)
    unified: SpecDict = {}
    done: dict[int, KVCacheSpec] = {}  # layers share spec objects: convert each once
    for name, spec in specs.items():
        converted = done.get(id(spec))
        if converted is not None:
            unified[name] = converted
            continue
        page = spec.page_size_bytes
        new_spec: KVCacheSpec
        if page == largest:
            new_spec = spec
        elif isinstance(spec, MambaSpec):
            new_spec = replace(spec, page_size_padded=largest)
        elif largest % page == 0:
            new_spec = spec.with_block_size(spec.block_size * (largest // page))
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            new_spec = replace(spec, page_size_padded=largest)
        else:
            raise PageSizesNotUnifiable(
                f"layer {name!r}: its page ({page} bytes) does not divide the largest page "
                f"({largest} bytes) and cannot be padded (only non-MLA attention and Mamba "
                "pages can); use a block-outermost layout (BLHNC) or align the page sizes"
            )
        if new_spec.page_size_bytes != largest:
            raise SpecInvariantError(
                f"layer {name!r}: its page cannot be brought to {largest} bytes "
                f"(got {new_spec.page_size_bytes})"
            )
        unified[name] = done[id(spec)] = new_spec
    return unified, True


def _full_allocation_fallback(specs: SpecDict, rules: RuleSet) -> Grouping | None:
    """MLA next to an unpaddable sliding-window page: allocate the window as full."""
    values = list(specs.values())
    if any(isinstance(spec, HiddenStateCacheSpec) for spec in values):
        return None
    excluded: tuple[type[KVCacheSpec], ...] = (ChunkedLocalAttentionSpec,)
    if not rules.fallback_admits_sliding_window_mla:
        excluded = (*excluded, SlidingWindowMLASpec)
    if any(isinstance(spec, excluded) for spec in values):
        return None
    has_mla = any(isinstance(spec, MLAAttentionSpec) for spec in values)
    has_window = any(isinstance(spec, SlidingWindowSpec) for spec in values)
    if not (has_mla and has_window):
        return None
    try:
        promoted = promote_local_attention(specs, rules)
    except UnplannableSpecs:
        return None
    wrapper = UniformTypeSpecs.from_specs(promoted)
    if wrapper is None:
        return None
    return Grouping(tuple(promoted), wrapper)


def _layers_by_equal_spec(specs: SpecDict) -> list[tuple[list[KVCacheSpec], list[str]]]:
    """(distinct spec objects, layer names) per class of equal specs, in registration
    order. Layers usually share spec objects, so group by identity first and hash
    each object once."""
    by_object: dict[int, tuple[KVCacheSpec, list[int]]] = {}
    names = list(specs)
    for index, spec in enumerate(specs.values()):
        entry = by_object.get(id(spec))
        if entry is None:
            entry = by_object[id(spec)] = (spec, [])
        entry[1].append(index)
    by_spec: dict[KVCacheSpec, tuple[list[KVCacheSpec], list[int]]] = {}
    for spec, indices in by_object.values():
        objects, merged = by_spec.setdefault(spec, ([], []))
        objects.append(spec)
        merged.extend(indices)
    return [
        # One object's indices are in order already; equal objects' are interleaved.
        (objects, [names[i] for i in (indices if len(objects) == 1 else sorted(indices))])
        for objects, indices in by_spec.values()
    ]


def hybrid_groups(
    specs: SpecDict, rules: RuleSet = KVPLAN
) -> tuple[list[Grouping], int, list[PaddingInfo], list[PlanWarning]]:
    """Equal-size groups over specs that share one page size. Layer i of a type
    goes to group i mod n, so pipeline stages get balanced groups."""
    # Coalesce specs that merge (e.g. full layers differing only in window metadata).
    # A bucket: (layer names, one spec per class of equal specs, every spec object).
    buckets: list[tuple[list[str], list[KVCacheSpec], list[KVCacheSpec]]] = []
    for objects, names in _layers_by_equal_spec(specs):
        spec = objects[0]
        for bucket_names, bucket_specs, bucket_objects in buckets:
            try:
                type(bucket_specs[0]).merge([*bucket_specs, spec], rules)
            except (IncompatibleSpecs, ConflictingWindows):
                continue
            bucket_names.extend(names)
            bucket_specs.append(spec)
            bucket_objects.extend(objects)
            break
        else:
            buckets.append((list(names), [spec], list(objects)))

    sizes = [len(names) for names, _, _ in buckets]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        # Close counts (e.g. 12 SW + 13 full with an EAGLE layer): pad the smaller.
        group_size = max(sizes)

    page = next(iter(specs.values())).page_size_bytes
    groupings: list[Grouping] = []
    padding: list[PaddingInfo] = []
    warnings: list[PlanWarning] = []
    for index, (names, _, objects) in enumerate(buckets):
        # The groups of a bucket whose layers share one spec object all merge that
        # object alone: merged once (Gemma-3-style, 64 layers, with the one-pass
        # partition check: group_layers 99 -> 80 µs).
        shared = _merge_group(specs, names[:1], rules) if len(objects) == 1 else None
        remainder = len(names) % group_size
        num_groups = cdiv(len(names), group_size)
        padding_layers = group_size - remainder if remainder else 0
        if padding_layers:
            waste = padding_layers / len(names) * 100
            padding.append(PaddingInfo(index, padding_layers, waste, padding_layers * page))
            warnings.append(
                PlanWarning(
                    WarningCode.PADDING_LAYERS,
                    f"Add {padding_layers} padding layers, may waste at most {waste:.2f}% "
                    "KV cache memory",
                )
            )
        for group_index in range(num_groups):
            members = tuple(names[group_index::num_groups])
            merged = shared if shared is not None else _merge_group(specs, members, rules)
            groupings.append(Grouping(members, merged, group_size - len(members)))
    return groupings, group_size, padding, warnings


def _largest_divisor_at_most(value: int, limit: int) -> int:
    for candidate in range(min(value, limit), 0, -1):
        if value % candidate == 0:
            return candidate
    return 1


def _append_hidden_state_groups(
    groupings: list[Grouping], hidden: dict[str, HiddenStateCacheSpec], warnings: list[PlanWarning]
) -> list[Grouping]:
    pages = {grouping.spec.page_size_bytes for grouping in groupings}
    if len(pages) != 1:
        raise SpecInvariantError(f"groups must share one page size, got {sorted(pages)}")
    common_page = pages.pop()
    per_token_max = max(
        spec.num_kv_heads * spec.head_size * spec.dtype.size_bytes for spec in hidden.values()
    )
    if per_token_max > common_page:
        # Scale every group so one hidden-state token fits a page.
        scale = cdiv(per_token_max, common_page)
        common_page *= scale
        scaled: list[Grouping] = []
        for grouping in groupings:
            spec = grouping.spec
            changes: dict[str, Any] = {"block_size": spec.block_size * scale}
            padded = getattr(spec, "page_size_padded", None)
            if isinstance(spec, AttentionSpec | MambaSpec) and padded is not None:
                changes["page_size_padded"] = padded * scale
            scaled.append(replace(grouping, spec=replace(spec, **changes)))
        groupings = scaled
    block_gcd = math.gcd(*(grouping.spec.block_size for grouping in groupings))
    result = list(groupings)
    for name, spec in hidden.items():
        per_token = spec.num_kv_heads * spec.head_size * spec.dtype.size_bytes
        block_size = _largest_divisor_at_most(block_gcd, max(common_page // per_token, 1))
        wasted = common_page - block_size * per_token
        if wasted:
            warnings.append(
                PlanWarning(
                    WarningCode.HIDDEN_STATE_PADDING,
                    f"hidden-state layer {name!r} uses block size {block_size}; page alignment "
                    f"wastes {wasted} bytes ({wasted / common_page * 100:.2f}%) per block",
                )
            )
        aligned = replace(spec, block_size=block_size, page_size_padded=common_page)
        result.append(Grouping((name,), aligned))
    return result


def _numbered(groupings: list[Grouping], host_resident: int = 0) -> list[KVCacheGroup]:
    """Groups with ids; the first `host_resident` live in the HiSparse host pool."""
    return [
        KVCacheGroup(
            group_id=index,
            layer_names=grouping.layer_names,
            spec=grouping.spec,
            padding_layers=grouping.padding_layers,
            host_resident=index < host_resident,
        )
        for index, grouping in enumerate(groupings)
    ]


def _grouping_result(
    path: GroupingPath,
    groupings: list[Grouping],
    specs: SpecDict,
    rules: RuleSet,
    warnings: list[PlanWarning],
    promoted: bool,
    *,
    annotation_specs: SpecDict | None = None,
    annotated_group_count: int | None = None,
    positional: bool = False,
    padding: list[PaddingInfo] | None = None,
    group_size: int = 0,
    page_sizes_unified: bool = False,
) -> GroupingResult:
    """The result of a grouping path, its groups numbered and checked to hold every
    layer exactly once."""
    groups = _numbered(groupings)
    unassigned = _check_exact_partition(
        groups, specs, missing_allowed=rules.worker_config_checked_after_memory
    )
    return GroupingResult(
        path=path,
        groups=groups,
        specs=specs,
        unassigned=unassigned,
        annotation_specs=specs if annotation_specs is None else annotation_specs,
        annotated_group_count=(
            len(groups) if annotated_group_count is None else annotated_group_count
        ),
        positional_rules_apply=positional,
        warnings=warnings,
        padding=padding or [],
        group_size=group_size,
        page_sizes_unified=page_sizes_unified,
        local_attention_promoted=promoted,
    )


def _split_hidden_state(
    specs: SpecDict, distinct: Sequence[KVCacheSpec]
) -> tuple[dict[str, HiddenStateCacheSpec], SpecDict]:
    """(the hidden-state cache layers, the other layers)."""
    if not any(isinstance(spec, HiddenStateCacheSpec) for spec in distinct):
        return {}, specs
    hidden = {n: s for n, s in specs.items() if isinstance(s, HiddenStateCacheSpec)}
    filtered = {n: s for n, s in specs.items() if n not in hidden}
    if not filtered:
        # Every release groups hidden-state caches of differing specs only
        # beside other layers, whose common page they are aligned to; with
        # none, its grouping has no bucket to size groups by (min() of none).
        raise UnplannableSpecs(
            "every layer with a KV cache is a hidden-state cache and their specs "
            f"differ ({len(hidden)} layers): hidden-state caches of different specs "
            "are grouped only beside attention or Mamba layers, whose common page "
            "they are aligned to; give them one spec, or plan them with such layers"
        )
    return hidden, filtered


def group_layers(
    specs: SpecDict,
    *,
    layout: KVCacheLayout,
    disable_hybrid: bool,
    rules: RuleSet = KVPLAN,
    hisparse: HiSparseConfig | None = None,
    max_decode_query_len: int = 1,
) -> GroupingResult:
    """Split the engine's layers (registration order) into KV cache groups."""
    warnings: list[PlanWarning] = []
    promoted = False
    if disable_hybrid:
        specs, promoted = _disable_hybrid(specs, warnings, rules)

    def done(path: GroupingPath, groupings: list[Grouping], **found: Any) -> GroupingResult:
        return _grouping_result(path, groupings, specs, rules, warnings, promoted, **found)

    if not specs:
        return done(GroupingPath.ATTENTION_FREE, [])
    if hisparse is not None:
        result = _hisparse_path(
            specs, warnings, layout, disable_hybrid, rules, hisparse, max_decode_query_len
        )
        if result is not None:
            result.local_attention_promoted = promoted
            return result
    # The distinct spec objects, found once for the checks below (a uniform engine's
    # specs used to be merged twice: Llama-like 64 layers, group_layers 27 -> 15 µs).
    distinct = _distinct(specs.values())
    merged = _merged(distinct, rules)
    if merged is not None:
        return done(GroupingPath.UNIFORM_SPEC, [Grouping(tuple(specs), merged)])
    wrapper = UniformTypeSpecs.from_specs(specs, distinct)
    if wrapper is not None:
        return done(GroupingPath.UNIFORM_TYPE, [Grouping(tuple(specs), wrapper)])

    hidden, filtered = _split_hidden_state(specs, distinct)
    packed = packed_groups(filtered, layout)
    if packed is not None:
        # Blocks are strided by the widest group, so hidden-state pages need no alignment.
        hidden_groupings = [Grouping((name,), spec) for name, spec in hidden.items()]
        return done(
            GroupingPath.PACKED,
            packed + hidden_groupings,
            annotation_specs=filtered,
            positional=True,
            annotated_group_count=len(packed),
        )

    try:
        unified, page_sizes_unified = unify_page_sizes(filtered)
    except PageSizesNotUnifiable:
        fallback = _full_allocation_fallback(specs, rules)
        if fallback is None:
            raise
        warnings.append(
            PlanWarning(
                WarningCode.FULL_ALLOCATION_FALLBACK,
                "KV cache page sizes cannot be unified; sliding-window layers are allocated "
                "as full attention (their attention compute is unchanged)",
            )
        )
        return done(GroupingPath.FULL_ALLOCATION_FALLBACK, [fallback])

    groupings, group_size, padding, hybrid_warnings = hybrid_groups(unified, rules)
    warnings.extend(hybrid_warnings)
    if hidden:
        groupings = _append_hidden_state_groups(groupings, hidden, warnings)
    return done(
        GroupingPath.HYBRID,
        groupings,
        positional=True,
        padding=padding,
        group_size=group_size,
        page_sizes_unified=page_sizes_unified,
    )


def _hisparse_path(
    specs: SpecDict,
    warnings: list[PlanWarning],
    layout: KVCacheLayout,
    disable_hybrid: bool,
    rules: RuleSet,
    config: HiSparseConfig,
    max_decode_query_len: int,
) -> GroupingResult | None:
    """HiSparse groups; the engine's other layers are grouped by the usual paths
    (a nested grouping, whose draft rules and warnings apply to its groups only)."""
    nested: list[GroupingResult] = []

    def regular(others: SpecDict) -> list[tuple[tuple[str, ...], KVCacheSpec]]:
        result = group_layers(
            others,
            layout=layout,
            disable_hybrid=disable_hybrid,
            rules=rules,
            hisparse=config,
            max_decode_query_len=max_decode_query_len,
        )
        nested.append(result)
        return [(group.layer_names, group.spec) for group in result.groups]

    laid_out = hisparse_groups(
        specs,
        config,
        max_decode_query_len=max_decode_query_len,
        use_topk_buffer_width=rules.has_field(FIELD_TOPK_BUFFER_WIDTH),
        regular=regular,
    )
    if laid_out is None:
        return None
    sub = nested[0] if nested else None
    own = len(laid_out.groups) - laid_out.regular_count
    groupings = [Grouping(names, spec) for names, spec, _ in laid_out.groups[:own]]
    if sub is not None:
        groupings += [
            Grouping(group.layer_names, group.spec, group.padding_layers) for group in sub.groups
        ]
    groups = _numbered(groupings, host_resident=1)
    _check_exact_partition(groups, specs)
    return GroupingResult(
        path=GroupingPath.HISPARSE,
        groups=groups,
        specs=specs,
        annotation_specs=sub.annotation_specs if sub is not None else {},
        annotated_group_count=sub.annotated_group_count if sub is not None else 0,
        annotated_group_start=own,
        positional_rules_apply=sub.positional_rules_apply if sub is not None else False,
        warnings=[*warnings, *(sub.warnings if sub is not None else [])],
        padding=sub.padding if sub is not None else [],
        group_size=sub.group_size if sub is not None else 0,
        page_sizes_unified=sub.page_sizes_unified if sub is not None else False,
    )


def _check_exact_partition(
    groups: Sequence[KVCacheGroup], specs: Mapping[str, object], *, missing_allowed: bool = False
) -> frozenset[str]:
    """Raise unless every layer is in exactly one group. `missing_allowed`: layers
    no group holds are returned instead, for the release that finds them later."""
    grouped = [name for group in groups for name in group.layer_names]
    distinct = set(grouped)
    if len(distinct) == len(grouped) and distinct.issuperset(specs):
        return frozenset()  # one pass for the usual case; the loop below names what is wrong
    seen: set[str] = set()
    for group in groups:
        overlap = seen & set(group.layer_names)
        if overlap:
            raise SpecInvariantError(f"KV cache groups overlap: {sorted(overlap)}")
        seen |= set(group.layer_names)
    missing = frozenset(specs) - seen
    if missing and not missing_allowed:
        raise_unassigned(missing)
    return missing


def raise_unassigned(layers: Iterable[str]) -> NoReturn:
    raise SpecInvariantError(
        f"no KV cache group holds layers {sorted(layers)}: a packed layout leaves out the "
        "layers of one kind whose page sizes do not occur equally often; a layer-outer "
        "layout such as LBNHC groups them"
    )
