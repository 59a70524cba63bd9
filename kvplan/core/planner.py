"""plan_engine: one engine request in, one plan for every worker out.

validate -> merge the workers' specs -> group -> annotate draft groups ->
budget every worker -> fit max_model_len -> size blocks and tensors ->
one block count for all ranks -> capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from functools import reduce
from typing import TypeVar

from kvplan.core.diagnostics import PaddingInfo, PlanWarning, WarningCode
from kvplan.core.draft import annotate_draft_groups
from kvplan.core.errors import InsufficientMemory, InvalidRequest, PlanningError, UnplannableSpecs
from kvplan.core.extensible import blocks_within, segment_strides
from kvplan.core.grouping import SpecDict, group_layers, raise_unassigned
from kvplan.core.groups import GroupingPath, KVCacheGroup
from kvplan.core.hisparse import (
    CONNECTOR_LAYOUT,
    HiSparseConfig,
    check_host_pool,
    is_hisparse_spec,
)
from kvplan.core.layout import (
    KVCacheLayout,
    TensorPlacement,
    bytes_per_block,
    check_mixed_page_sizes,
    check_page_padding,
    place_tensors,
    validate_layout,
)
from kvplan.core.layout_resolution import LayoutResolution, WorkerLayouts, resolve_layout
from kvplan.core.memory import (
    Budget,
    BudgetMode,
    check_one_request_fits,
    estimate_max_model_len,
    format_gib,
    needed_bytes,
    spec_blocks_per_request,
    worker_budget,
)
from kvplan.core.request import EngineOptions, EngineRequest, SpecDecode, WorkerInput
from kvplan.core.rules import RuleSet
from kvplan.core.scheduler_blocks import SchedulerStart, start_scheduler
from kvplan.core.specs import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    PlanningContext,
    SlidingWindowSpec,
    UniformTypeSpecs,
    cdiv,
    layer_specs_of,
)


class PlanStage(Enum):
    """Which plan this is (vLLM 0.34's extensible cache is planned twice)."""

    CLASSIC = "classic"  # an estimate-sized cache: the only plan
    EXTENSIBLE_RESERVATION = "extensible_reservation"  # before warm-up: upper bounds
    EXTENSIBLE_FINAL = "extensible_final"  # from the workers' measured KV bytes


@dataclass(frozen=True)
class ProjectedGroup:
    group_id: int
    layer_names: tuple[str, ...]
    is_draft: bool


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    device_uuid: str
    num_blocks: int  # the same on every rank; usable blocks = num_blocks - 1
    bytes_per_block: int
    tensors: tuple[TensorPlacement, ...]
    groups: tuple[ProjectedGroup, ...]
    budget: Budget
    check_bytes: int  # available bytes minus the null block
    needed_per_request_bytes: int
    encoder_only_layers: tuple[str, ...]
    kv_tp_replicas: int
    footprint_bytes: int  # what a lease reserves on the device: Budget.footprint_bytes
    needs_kv_cache_zeroing: bool = False  # zero new blocks (Mamba, mixed precision)


@dataclass(frozen=True)
class EnginePlan:
    engine_id: str
    path: GroupingPath
    groups: tuple[KVCacheGroup, ...]
    workers: tuple[WorkerPlan, ...]  # in rank order
    num_blocks: int
    max_model_len: int
    blocks_per_request: int  # scheduler view: one max_model_len request
    kv_cache_size_tokens: int
    max_concurrency: float
    warnings: tuple[PlanWarning, ...]
    padding: tuple[PaddingInfo, ...]
    group_size: int
    page_sizes_unified: bool
    local_attention_promoted: bool
    scheduler_block_size: int
    hash_block_size: int
    rule_set: str = "kvplan"  # RuleSet.name of the rules that made this plan
    stage: PlanStage = PlanStage.CLASSIC
    reserved_num_blocks: int = 0  # extensible final plans: the reservation (the cap)
    hisparse_host_num_blocks: int = 0  # HiSparse: blocks of the host pool
    layout: KVCacheLayout = KVCacheLayout.LBNHC  # the layout the plan uses
    layout_candidates: tuple[KVCacheLayout, ...] = ()  # what the resolution left


def _distinct_layers(worker: WorkerInput, seen: set[int]) -> bool:
    """Whether `worker.layers` is a layer tuple not in `seen` (ids), adding it.

    Tensor-parallel ranks share one tuple (the converter converts each distinct
    list once): per-layer work on a tuple already seen is skipped. For 8 workers
    x 65 layers this saved 0.08 ms of 1.13 ms per plan."""
    if id(worker.layers) in seen:
        return False
    seen.add(id(worker.layers))
    return True


def _validate(request: EngineRequest) -> list[WorkerInput]:
    if not request.workers:
        raise InvalidRequest("an engine needs at least one worker", field="workers")
    options = request.options
    if options.starting_max_model_len <= 0:
        field = "options.derived_max_model_len" if options.auto_fit else "options.max_model_len"
        raise InvalidRequest("max_model_len must be positive (or -1 to auto-fit)", field=field)
    ranks: dict[int, int] = {}
    checked: set[int] = set()  # ids of layer tuples checked (see `_distinct_layers`)
    for index, worker in enumerate(request.workers):
        if worker.rank in ranks:
            raise InvalidRequest(
                f"rank {worker.rank} appears twice (workers[{ranks[worker.rank]}] and "
                f"workers[{index}])",
                field=f"workers[{index}].rank",
            )
        ranks[worker.rank] = index
        if not _distinct_layers(worker, checked):
            continue
        names = [name for name, _ in worker.layers]
        if len(set(names)) == len(names):
            continue  # the usual case, in one pass; the loop below finds the repeat
        seen: set[str] = set()
        for layer_index, name in enumerate(names):
            if name in seen:
                raise InvalidRequest(
                    f"layer {name!r} appears twice on worker rank {worker.rank}",
                    field=f"workers[{index}].layers[{layer_index}].name",
                )
            seen.add(name)
    # Rank order, so the order workers arrive in never changes the plan.
    return sorted(request.workers, key=lambda worker: worker.rank)


def _merge_worker_specs(workers: list[WorkerInput], request: EngineRequest) -> SpecDict:
    """All workers' layers in registration order; one layer, one spec."""
    index_of = {worker.rank: index for index, worker in enumerate(request.workers)}
    merged: SpecDict = {}
    done: set[int] = set()
    for worker in workers:
        if not _distinct_layers(worker, done):
            continue  # every layer is in `merged` already, with this very spec
        if not merged:
            merged.update(worker.layers)  # its names are distinct (`_validate`)
            continue
        for layer_index, (name, spec) in enumerate(worker.layers):
            known = merged.setdefault(name, spec)
            if known is not spec and known != spec:
                owner = next(w.rank for w in workers if any(n == name for n, _ in w.layers))
                raise InvalidRequest(
                    f"layer {name!r} has different specs on worker ranks {owner} and "
                    f"{worker.rank}; ranks of one engine must agree on every shared layer",
                    field=f"workers[{index_of[worker.rank]}].layers[{layer_index}]",
                )
    return merged


def _resolve_layout(
    request: EngineRequest, workers: list[WorkerInput], specs: SpecDict
) -> LayoutResolution:
    """Resolved before grouping and memory, as the engine core does."""
    index_of = {worker.rank: index for index, worker in enumerate(request.workers)}
    options = request.options
    return resolve_layout(
        [WorkerLayouts(index_of[w.rank], w.rank, w.supported_layouts) for w in workers],
        specs.values(),
        options.layout,
        request.rules,
        # HiSparse is the one KV connector kvplan models.
        connector_layout=CONNECTOR_LAYOUT if options.hisparse is not None else None,
        connector_needs_block_compact=options.extensible_kv_cache and options.hisparse is not None,
    )


def _tag_retained_tokens(specs: SpecDict, request: EngineRequest) -> SpecDict:
    # Multi-module MTP re-prefills its last k-1 tokens: windows keep them.
    extra = max(0, request.spec_decode.prefill_lookahead_tokens - 1)
    # Layers share spec objects: rebuild each object once. Keyed by identity, as
    # equal specs may still differ in is_draft, which equality ignores.
    distinct = {id(spec): spec for spec in specs.values()}
    tagged = {
        key: replace(spec, extra_retained_tokens=extra)
        for key, spec in distinct.items()
        if isinstance(spec, SlidingWindowSpec) and spec.extra_retained_tokens != extra
    }
    if not tagged:
        return specs  # nothing to tag (the usual case): no pass over the layers
    return {name: tagged.get(id(spec), spec) for name, spec in specs.items()}


def _project_all(
    groups: list[KVCacheGroup], workers: list[WorkerInput], rules: RuleSet
) -> list[list[KVCacheGroup]]:
    """Every worker's view of the global groups, in time linear in the layers.

    A worker sees its own layers only, in group order. Where it holds none of a
    group's layers, the draft flag survives or not by the rule set (vLLM 0.33
    keeps it, 0.32 drops it). Each worker's layers are looked up in one index of
    the global groups (one pass over its own layers, not over every group's
    layers), and workers with the same layer list (tensor-parallel ranks) share
    one projection.
    """
    # A worker with as many layers as the groups hold holds every one of them (its
    # names are distinct and all grouped): it sees the groups unchanged, with no
    # pass over its layers (one worker, 64 layers: 15 -> 2 µs).
    grouped = sum(len(group.layer_names) for group in groups)
    if all(len(worker.layers) == grouped for worker in workers):
        return [groups] * len(workers)
    position = {
        name: (group_index, layer_index)
        for group_index, group in enumerate(groups)
        for layer_index, name in enumerate(group.layer_names)
    }
    # A projection depends on the layer names only. Keyed by names, not by the
    # (name, spec) pairs: hashing specs field by field cost 0.37 ms of 1.85 ms per
    # plan for 8 workers x 65 layers.
    by_names: dict[tuple[str, ...], list[KVCacheGroup]] = {}
    by_tuple: dict[int, list[KVCacheGroup]] = {}  # see `_distinct_layers`
    projected: list[list[KVCacheGroup]] = []
    for worker in workers:
        view = by_tuple.get(id(worker.layers))
        if view is None:
            names = tuple(name for name, _ in worker.layers)
            view = by_names.get(names)
            if view is None:
                view = by_names[names] = _project(groups, names, position, rules)
            by_tuple[id(worker.layers)] = view
        projected.append(view)
    return projected


def _project(
    groups: list[KVCacheGroup],
    layer_names: tuple[str, ...],
    position: dict[str, tuple[int, int]],
    rules: RuleSet,
) -> list[KVCacheGroup]:
    held: list[list[int]] = [[] for _ in groups]
    for name in layer_names:
        where = position.get(name)
        if where is not None:
            held[where[0]].append(where[1])
    projected: list[KVCacheGroup] = []
    for group, indices in zip(groups, held, strict=True):
        if len(indices) == len(group.layer_names):
            projected.append(group)
            continue
        names = tuple(group.layer_names[i] for i in sorted(indices))
        spec = group.spec
        if names and isinstance(spec, UniformTypeSpecs):
            members = spec.specs_by_layer
            spec = UniformTypeSpecs(
                block_size=spec.block_size,
                layer_specs=tuple((name, members[name]) for name in names),
            )
        is_draft = group.is_draft and (bool(names) or rules.flag_survives_empty_projection)
        # vLLM 0.32 rebuilds a group the worker does not hold whole without its
        # host_resident flag: the HiSparse source group becomes a device group.
        host_resident = group.host_resident and rules.hisparse_projection_keeps_host_source
        projected.append(
            replace(
                group, layer_names=names, spec=spec, is_draft=is_draft, host_resident=host_resident
            )
        )
    return projected


_T = TypeVar("_T")


def _per_projection(
    projected: list[list[KVCacheGroup]], compute: Callable[[list[KVCacheGroup]], _T]
) -> list[_T]:
    """`compute` of every worker's projection, run once per distinct projection:
    tensor-parallel ranks share one projection object (see `_project_all`)."""
    results: dict[int, _T] = {}
    out: list[_T] = []
    for view in projected:
        if id(view) not in results:
            results[id(view)] = compute(view)
        out.append(results[id(view)])
    return out


def _context(options: EngineOptions, in_flight_tokens: int, max_model_len: int) -> PlanningContext:
    return PlanningContext(
        max_model_len=max_model_len,
        max_in_flight_tokens=in_flight_tokens,
        dcp_size=options.decode_context_parallel_size,
        mamba_align_mode=options.mamba_align_mode,
        max_num_encoder_input_tokens=options.max_num_encoder_input_tokens,
    )


def _tp_replicas(groups: list[KVCacheGroup], options: EngineOptions) -> int:
    tp, dcp = options.tensor_parallel_size, options.decode_context_parallel_size

    def replicas(spec: object) -> int:
        if not isinstance(spec, AttentionSpec) or spec.max_tp_shards is None:
            return 1
        if spec.dcp_sharded and dcp > 1:
            return 1
        return max(1, tp // spec.max_tp_shards)

    specs = [spec for group in groups for spec in layer_specs_of(group.spec)]
    if not specs:
        return 1
    return reduce(math.gcd, (replicas(spec) for spec in specs), tp)


def _needs_kv_cache_zeroing(worker_groups: list[KVCacheGroup]) -> bool:
    """Mamba state is read before it is fully written; a block reused across
    groups of different precision would decode stale bytes."""
    specs = [spec for group in worker_groups for spec in layer_specs_of(group.spec)]
    if any(isinstance(spec, MambaSpec) for spec in specs):
        return True
    precisions = {
        (spec.dtype, spec.kv_quant_mode)
        for group in worker_groups
        if not group.host_resident
        for spec in layer_specs_of(group.spec)
        if isinstance(spec, AttentionSpec)
    }
    return len(precisions) > 1


def _source_group(worker_groups: list[KVCacheGroup]) -> KVCacheGroup:
    (source,) = [group for group in worker_groups if group.host_resident]
    return source


def _hisparse_host_blocks(
    config: HiSparseConfig, worker_groups: list[KVCacheGroup], max_model_len: int
) -> int:
    source = _source_group(worker_groups)
    return check_host_pool(
        config, source.spec.page_size_bytes, source.spec.block_size, max_model_len
    )


def _check_hisparse_layout(layout: KVCacheLayout, device_groups: list[KVCacheGroup]) -> None:
    if not layout.is_block_outermost and any(
        is_hisparse_spec(group.spec) for group in device_groups
    ):
        raise UnplannableSpecs(
            f"HiSparse needs a block-outermost KV cache layout (e.g. BLHNC), got {layout.name}"
        )


def _hisparse_config_builds(
    config: HiSparseConfig,
    worker_groups: list[KVCacheGroup],
    layout: KVCacheLayout,
    length: int,
    num_blocks: int,
) -> bool:
    """Whether the worker's HiSparse configuration can be built at `length` with
    `num_blocks` blocks. vLLM's length search (the memory check's estimate, auto-fit)
    builds it and takes a ValueError as "does not fit": the host pool's, mixed page
    sizes the layout cannot express, a HiSparse entry in a layout that is not
    block-outermost. Placing each device group's tensors, in group order, it asserts
    on a padded page the layout cannot express, which no search catches: that
    refusal is raised here, before any memory refusal (every release)."""
    try:
        _hisparse_host_blocks(config, worker_groups, length)
        device_groups = [g for g in worker_groups if not g.host_resident]
        check_mixed_page_sizes(layout, device_groups)
    except PlanningError:
        return False
    for group in device_groups:  # in placement order: the first failure decides
        for spec, _ in group.layer_runs:
            if not is_hisparse_spec(spec):
                check_page_padding(spec, layout, num_blocks=num_blocks)
            elif not layout.is_block_outermost:
                return False  # a ValueError to vLLM's search: "does not fit"
    return True


def _host_tensors(worker_groups: list[KVCacheGroup], host_blocks: int) -> list[TensorPlacement]:
    """The HiSparse host pool: the source group, layer-outer (LBNHC)."""
    host_groups = [group for group in worker_groups if group.host_resident]
    if not host_groups:
        return []
    host_layout = KVCacheLayout.LBNHC
    validate_layout(host_layout, host_groups)
    host_bpb = bytes_per_block(host_groups, host_layout)
    return [
        replace(tensor, host_resident=True)
        # vLLM's HiSparse placement keeps 0.33-style tensors in every release: a
        # stage without the source group's layers still gets its (empty) tensor.
        for tensor in place_tensors(
            host_groups, host_blocks, host_layout, host_bpb, own_layers_only=False
        )
    ]


@dataclass(frozen=True)
class ModelPlan:
    """What a plan takes from the model and the engine's settings alone: the resolved
    layout, the groups with their draft flags, and each worker's view of them.

    Nothing in it depends on a worker's memory or device, so engines that differ
    only there (replicas of one model whose workers measured different free memory)
    share one: `plan_model` once, then `plan_engine(request, model_plan)` per engine,
    which budgets each (in a warm loop, 64 layers: planning 150 -> 50 µs; 8 workers x
    65 layers: 200 -> 70 µs).
    """

    options: EngineOptions
    spec_decode: SpecDecode
    rules: RuleSet
    # The workers' model side, in rank order: what `plan_engine` checks a request
    # against (by identity first: a memo hands back the very tuples it kept).
    worker_models: tuple[
        tuple[int, tuple[tuple[str, KVCacheSpec], ...], tuple[KVCacheLayout, ...]], ...
    ]
    resolution: LayoutResolution
    path: GroupingPath
    groups: tuple[KVCacheGroup, ...]
    warnings: tuple[PlanWarning, ...]  # grouping's and the draft rule's
    padding: tuple[PaddingInfo, ...]
    group_size: int
    page_sizes_unified: bool
    local_attention_promoted: bool
    # Per worker, in rank order; workers with one projection share its objects.
    projected: tuple[list[KVCacheGroup], ...]
    device: tuple[list[KVCacheGroup], ...]  # the projection less host-resident groups
    projected_groups: tuple[tuple[ProjectedGroup, ...], ...]
    tp_replicas: tuple[int, ...]
    zeroing: tuple[bool, ...]
    scheduler: SchedulerStart  # its block sizes, and why it would not start
    # Layers no group holds, refused as each worker's configuration is built
    # (RuleSet.worker_config_checked_after_memory); elsewhere grouping refuses them.
    unassigned_layers: frozenset[str] = frozenset()

    def check_made_for(self, request: EngineRequest, workers: list[WorkerInput]) -> None:
        """Raise ValueError unless `request` (its `workers` in rank order) has this
        plan's model: a caller's memo handed over the wrong one, a bug."""
        same_settings = (
            (request.options is self.options or request.options == self.options)
            and (request.spec_decode is self.spec_decode or request.spec_decode == self.spec_decode)
            and request.rules is self.rules
        )
        if not same_settings or len(workers) != len(self.worker_models):
            raise ValueError("the model plan was made for another engine's settings or workers")
        for worker, (rank, layers, layouts) in zip(workers, self.worker_models, strict=True):
            if (
                worker.rank != rank
                or (worker.layers is not layers and worker.layers != layers)
                or worker.supported_layouts != layouts
            ):
                raise ValueError(f"the model plan was made for another model (worker rank {rank})")


def plan_model(request: EngineRequest) -> ModelPlan:
    """The memory-independent half of a plan: checks, layout, groups, draft flags and
    each worker's projection. Raises what `plan_engine` raises between the workers'
    budgets (`worker_budgets`) and its memory checks."""
    options = request.options
    rules = request.rules
    workers = _validate(request)
    merged = _merge_worker_specs(workers, request)
    resolution = _resolve_layout(request, workers, merged)
    specs = _tag_retained_tokens(merged, request)
    grouping = group_layers(
        specs,
        layout=resolution.layout,
        disable_hybrid=options.disable_hybrid_kv_cache_manager,
        rules=rules,
        hisparse=options.hisparse,
        max_decode_query_len=request.spec_decode.max_decode_query_len(rules),
    )
    groups, draft_warnings = annotate_draft_groups(grouping, request.spec_decode, rules)
    projected = _project_all(groups, workers, rules)
    # HiSparse source groups live in the host pool: the device pool, its checks
    # and its block size are the other groups'.
    # Work that depends on a worker's projection alone is done once per distinct
    # projection: for 8 TP ranks this saved 0.18 ms of 1.31 ms per plan.
    device = _per_projection(projected, lambda groups: [g for g in groups if not g.host_resident])
    zeroing = _per_projection(projected, _needs_kv_cache_zeroing)
    if rules.kv_zeroing_across_workers:
        zeroing = [any(zeroing)] * len(zeroing)
    # Workers with one projection share one tuple of groups, which lets the wire
    # conversion render each once.
    projected_groups = _per_projection(
        projected,
        lambda groups: tuple(ProjectedGroup(g.group_id, g.layer_names, g.is_draft) for g in groups),
    )
    return ModelPlan(
        options=options,
        spec_decode=request.spec_decode,
        rules=rules,
        worker_models=tuple((w.rank, w.layers, w.supported_layouts) for w in workers),
        resolution=resolution,
        path=grouping.path,
        groups=tuple(groups),
        warnings=(*grouping.warnings, *draft_warnings),
        padding=tuple(grouping.padding),
        group_size=grouping.group_size,
        page_sizes_unified=grouping.page_sizes_unified,
        local_attention_promoted=grouping.local_attention_promoted,
        projected=tuple(projected),
        device=tuple(device),
        projected_groups=tuple(projected_groups),
        tp_replicas=tuple(_per_projection(projected, lambda groups: _tp_replicas(groups, options))),
        zeroing=tuple(zeroing),
        scheduler=start_scheduler(
            projected[0] if projected else [], groups, options, request.spec_decode, rules
        ),
        unassigned_layers=grouping.unassigned,
    )


def worker_budgets(request: EngineRequest) -> list[Budget]:
    """Each worker's memory budget, in rank order: what it reads of its device as it
    starts. vLLM's workers check their device's free memory when they start, before
    the model exists, so these refusals come before any planning error: callers work
    them out before `plan_model`."""
    index_of = {worker.rank: index for index, worker in enumerate(request.workers)}
    extensible = request.options.extensible_kv_cache
    # A budget depends on the worker's memory and device settings alone (the rank and
    # index only name it in errors, raised at the first worker with those settings):
    # workers sharing settings objects (converted once per distinct setting) share
    # one budget (8 TP ranks: 16.7 -> 3.7 µs).
    budget_of: dict[tuple[int, int], Budget] = {}
    budgets: list[Budget] = []
    for worker in sorted(request.workers, key=lambda worker: worker.rank):
        key = (id(worker.memory), id(worker.device))
        if key not in budget_of:
            budget_of[key] = worker_budget(worker, index_of[worker.rank], extensible=extensible)
        budgets.append(budget_of[key])
    return budgets


def plan_engine(
    request: EngineRequest,
    model_plan: ModelPlan | None = None,
    budgets: list[Budget] | None = None,
) -> EnginePlan:
    """The plan of one engine. `model_plan`: `plan_model` of a request that differs
    from this one at most in its engine id and its workers' memory and device
    (checked: ValueError otherwise); without it, made here. `budgets`: the request's
    `worker_budgets`, when the caller has them."""
    if budgets is None:
        budgets = worker_budgets(request)
    model = plan_model(request) if model_plan is None else model_plan
    # plan_model checked the ranks (distinct): rank order, as there.
    workers = sorted(request.workers, key=lambda worker: worker.rank)
    model.check_made_for(request, workers)
    options = request.options
    rules = request.rules
    hisparse = options.hisparse
    warnings = list(model.warnings)
    layout = model.resolution.layout
    projected = list(model.projected)
    device = model.device
    # Under HiSparse the layout is checked only while building each worker's
    # configuration, after the memory checks (as in every release).
    layout_after_memory = rules.worker_config_checked_after_memory or hisparse is not None
    index_of = {worker.rank: index for index, worker in enumerate(request.workers)}
    available = [budget.available_bytes for budget in budgets]

    # Projections that lost the HiSparse source group to the device pool (vLLM 0.32,
    # see _project): their HiSparse configuration cannot be built.
    split_source = (
        {
            id(worker_groups)
            for worker_groups in projected
            if not any(group.host_resident for group in worker_groups)
        }
        if any(group.host_resident for group in model.groups)
        else set()
    )
    block_bytes: list[int] = []
    bytes_of_projection: dict[int, int] = {}
    for worker, worker_groups, device_groups in zip(workers, projected, device, strict=True):
        if not worker_groups:
            block_bytes.append(0)
            continue
        if id(worker_groups) not in bytes_of_projection:
            # Checked at the first worker (in rank order) with this projection.
            if not any(group.layer_names for group in worker_groups):
                raise InvalidRequest(
                    f"worker rank {worker.rank} holds no layers of this engine's KV cache "
                    "groups; every worker needs at least one layer",
                    field=f"workers[{index_of[worker.rank]}].layers",
                )
            if not layout_after_memory:
                validate_layout(layout, worker_groups)
            bytes_of_projection[id(worker_groups)] = bytes_per_block(
                device_groups, layout, hot_pages_align_pool=rules.hot_pages_align_pool
            )
        block_bytes.append(bytes_of_projection[id(worker_groups)])

    override = options.num_gpu_blocks_override
    if override is not None:
        budgets = [
            replace(budget, mode=BudgetMode.BLOCKS_OVERRIDE, available_bytes=override * bpb)
            if worker_groups
            else budget
            for budget, bpb, worker_groups in zip(budgets, block_bytes, projected, strict=True)
        ]
        available = [budget.available_bytes for budget in budgets]

    # The null block is never allocated: checks plan against usable blocks.
    check = [
        avail - bpb if worker_groups else avail
        for avail, bpb, worker_groups in zip(available, block_bytes, projected, strict=True)
    ]

    max_model_len = options.starting_max_model_len
    in_flight = options.max_in_flight_tokens(rules)  # what every length probe's context needs
    # A length search depends on the projection, the memory and the upper bound:
    # ranks with one projection and equal budgets search once (auto-fit, 8 workers x
    # 65 layers: planning 1.02 ms -> 0.59 ms).
    searched: dict[tuple[int, int, int], int] = {}

    def fits_for(worker_groups: list[KVCacheGroup], bpb: int, memory: int) -> int:
        key = (id(worker_groups), memory, max_model_len)
        if key not in searched:
            searched[key] = _search_length(worker_groups, bpb, memory)
        return searched[key]

    def _search_length(worker_groups: list[KVCacheGroup], bpb: int, memory: int) -> int:
        device_groups = [g for g in worker_groups if not g.host_resident]

        def fits(length: int) -> bool:
            if id(worker_groups) in split_source:
                return False  # its configuration cannot be built at any length
            if hisparse is not None and not _hisparse_config_builds(
                hisparse, worker_groups, layout, length, memory // bpb if bpb else 0
            ):
                return False
            return needed_bytes(device_groups, bpb, _context(options, in_flight, length)) <= memory

        return estimate_max_model_len(fits, max_model_len)

    def auto_fit(memory_per_worker: list[int], when: str) -> None:
        nonlocal max_model_len
        fitted, limiting_memory = max_model_len, memory_per_worker[0]
        for worker_groups, bpb, memory in zip(
            projected, block_bytes, memory_per_worker, strict=True
        ):
            if not worker_groups:
                continue
            worker_max = fits_for(worker_groups, bpb, memory)
            if worker_max < fitted:
                fitted, limiting_memory = worker_max, memory
        if fitted <= 0:
            raise InsufficientMemory(
                "Cannot auto-fit max_model_len: not enough GPU memory available to serve "
                f"even a single token{when}. Increase gpu_memory_utilization.",
                field="options.max_model_len",
                details={"available_bytes": min(memory_per_worker)},
            )
        if fitted < max_model_len:
            warnings.append(
                PlanWarning(
                    WarningCode.MAX_MODEL_LEN_AUTO_FIT,
                    f"Auto-fit max_model_len: reduced from {max_model_len} to {fitted} to fit "
                    f"in available KV cache memory ({format_gib(limiting_memory)} GiB){when}",
                )
            )
            max_model_len = fitted

    def one_request_fits(
        memory_per_worker: list[int], no_memory_advice: str | None = None
    ) -> list[int]:
        ctx = _context(options, in_flight, max_model_len)
        # What one request needs depends on the projection alone: ranks sharing one
        # compute it once (256 TP ranks x 64 layers: planning 2.7 -> 1.8 ms).
        needed_by_projection: dict[tuple[int, int], int] = {}

        def request_bytes(device_groups: list[KVCacheGroup], bpb: int) -> int:
            key = (id(device_groups), bpb)
            if key not in needed_by_projection:
                needed_by_projection[key] = needed_bytes(device_groups, bpb, ctx)
            return needed_by_projection[key]

        needed: list[int] = []
        for worker, worker_groups, device_groups, bpb, memory in zip(
            workers, projected, device, block_bytes, memory_per_worker, strict=True
        ):
            if not worker_groups:
                needed.append(0)
                continue
            need = check_one_request_fits(
                rank=worker.rank,
                check_bytes=memory,
                needed=lambda g=device_groups, b=bpb: request_bytes(g, b),  # type: ignore[misc]
                max_model_len=max_model_len,
                estimate=lambda memory, g=worker_groups, b=bpb: fits_for(g, b, memory),  # type: ignore[misc]
                blocks_override=override,
                no_memory_advice=no_memory_advice,
            )
            needed.append(need)
        return needed

    if options.auto_fit and any(projected):
        auto_fit(check, "")
    needed = one_request_fits(check)

    host_blocks_per_worker = [0] * len(workers)
    if layout_after_memory:
        # vLLM 0.32 (and HiSparse everywhere) checks each worker's configuration as
        # it builds it, in rank order: 0.32 first that its groups hold every layer of
        # the worker, then the layout; HiSparse sizes its host pool first.
        for index, (worker, worker_groups, device_groups) in enumerate(
            zip(workers, projected, device, strict=True)
        ):
            if model.unassigned_layers:
                dropped = [name for name, _ in worker.layers if name in model.unassigned_layers]
                if dropped:
                    raise_unassigned(dropped)
            if not worker_groups:
                continue
            if id(worker_groups) in split_source:
                raise UnplannableSpecs(
                    f"worker rank {worker.rank} does not hold every layer of the HiSparse "
                    f"host-resident group, which {rules.description} then makes a device "
                    "group (counted in its memory checks): its HiSparse configuration has no "
                    "source group. Run the engine without pipeline parallelism, or on vLLM "
                    "0.33+"
                )
            if hisparse is not None:
                host_blocks_per_worker[index] = _hisparse_host_blocks(
                    hisparse, worker_groups, max_model_len
                )
            validate_layout(layout, device_groups)
            if hisparse is not None:
                _check_hisparse_layout(layout, device_groups)
        host_pools = {
            blocks
            for blocks, worker_groups in zip(host_blocks_per_worker, projected, strict=True)
            if worker_groups
        }
        if len(host_pools) > 1:
            # Each worker sizes its host pool from its own source layers, and vLLM's
            # scheduler takes one count for every worker (it asserts they agree).
            raise UnplannableSpecs(
                f"the workers' HiSparse host pools would hold different block counts "
                f"{sorted(host_pools)}: the pipeline stages' sparse-MLA layers differ in "
                "number or page size; split the layers so that every stage holds the same"
            )

    per_worker_blocks = [
        (override if override is not None else avail // bpb) if worker_groups else 1
        for avail, bpb, worker_groups in zip(available, block_bytes, projected, strict=True)
    ]
    num_blocks = min(per_worker_blocks)

    # vLLM's HiSparse placement keeps every release's 0.33-style tensors.
    own_layers_only = rules.tensors_for_own_layers_only and hisparse is None
    # Block bytes and host blocks depend on the projection alone.
    host_blocks_of = {
        id(view): blocks for view, blocks in zip(projected, host_blocks_per_worker, strict=True)
    }
    bytes_of = {id(view): bpb for view, bpb in zip(projected, block_bytes, strict=True)}
    tensors_per_worker = _per_projection(
        projected,
        lambda worker_groups: (
            (
                *_host_tensors(worker_groups, host_blocks_of[id(worker_groups)]),
                *place_tensors(
                    [g for g in worker_groups if not g.host_resident],
                    num_blocks,
                    layout,
                    bytes_of[id(worker_groups)],
                    own_layers_only=own_layers_only,
                ),
            )
            if worker_groups
            else ()
        ),
    )

    stage = PlanStage.CLASSIC
    reserved_blocks = num_blocks
    if options.extensible_kv_cache:
        stage = PlanStage.EXTENSIBLE_RESERVATION
        measured = [worker.memory.measured_kv_cache_bytes for worker in workers]
        if measured and all(value is not None for value in measured):
            # vLLM 0.34 after warm-up: the most blocks each worker's measured bytes
            # map, the minimum over ranks, never above the reservation.
            stage = PlanStage.EXTENSIBLE_FINAL
            counts = [
                blocks_within(
                    segment_strides(
                        [t for t in tensors if not t.host_resident], layout, reserved_blocks
                    ),
                    worker.memory.measured_kv_cache_bytes or 0,
                    worker.memory.allocation_granule_bytes,
                    reserved_blocks,
                )
                for worker, tensors, worker_groups in zip(
                    workers, tensors_per_worker, projected, strict=True
                )
                if worker_groups
            ]
            num_blocks = min(counts, default=reserved_blocks)
            # The null block stays held back.
            check = [
                (num_blocks - 1) * bpb if worker_groups else 0
                for bpb, worker_groups in zip(block_bytes, projected, strict=True)
            ]
            if options.auto_fit and any(projected):
                auto_fit(check, " after warm-up")
            needed = one_request_fits(
                check,
                f"After warm-up the workers' measured KV cache bytes "
                f"(memory.measured_kv_cache_bytes, mapped in memory.allocation_granule_bytes "
                f"granules) hold {num_blocks} block(s) at the fewest, and the null block is one "
                "of them. Report the bytes the cache was measured to hold, or a finer "
                "allocation granule.",
            )
            # Strides and offsets keep describing the reservation; sizes shrink.
            tensors_per_worker = [
                tuple(
                    tensor
                    if tensor.host_resident
                    else replace(
                        tensor, size_bytes=num_blocks * tensor.size_bytes // reserved_blocks
                    )
                    for tensor in tensors
                )
                for tensors in tensors_per_worker
            ]
    # Last, as the engine does once its KV cache is sized: the scheduler starts.
    if (refusal := model.scheduler.refusal()) is not None:
        raise refusal
    ctx = _context(options, in_flight, max_model_len)

    # Workers with one projection share one tuple of tensors and of groups, which
    # lets the wire conversion render each once.
    projected_groups, tp_replicas, zeroing = (
        model.projected_groups,
        model.tp_replicas,
        model.zeroing,
    )
    worker_plans = []
    for index, worker in enumerate(workers):
        has_groups = bool(projected[index])
        bpb, budget = block_bytes[index], budgets[index]
        worker_plans.append(
            WorkerPlan(
                rank=worker.rank,
                device_uuid=worker.device.uuid,
                num_blocks=num_blocks,
                bytes_per_block=bpb,
                tensors=tensors_per_worker[index],
                groups=projected_groups[index],
                budget=budget,
                check_bytes=check[index],
                needed_per_request_bytes=needed[index],
                encoder_only_layers=worker.encoder_only_layers,
                kv_tp_replicas=tp_replicas[index],
                needs_kv_cache_zeroing=zeroing[index],
                footprint_bytes=(
                    # A final extensible cache holds what it committed, not its cap.
                    budget.non_kv_bytes + num_blocks * bpb
                    if stage is PlanStage.EXTENSIBLE_FINAL and has_groups
                    else budget.footprint_bytes(num_blocks * bpb if has_groups else 0)
                ),
            )
        )

    # Capacity as the scheduler sees it: the lowest rank's groups, with a
    # wrapper group standing for its first layer.
    blocks_per_request = host_blocks_per_request = 0
    if projected and projected[0]:
        blocks_of: dict[int, int] = {}  # hybrid groups repeat one spec object
        for group in projected[0]:
            spec = group.representative_spec
            blocks = blocks_of.get(id(spec))
            if blocks is None:
                blocks = blocks_of[id(spec)] = spec_blocks_per_request(spec, ctx)
            if group.host_resident:
                host_blocks_per_request += blocks
            else:
                blocks_per_request += blocks
    max_concurrency = num_blocks / blocks_per_request if blocks_per_request else 0.0
    if host_blocks_per_request:
        # The host pool bounds concurrency too (HiSparse).
        max_concurrency = min(max_concurrency, host_blocks_per_worker[0] / host_blocks_per_request)
    return EnginePlan(
        engine_id=request.engine_id,
        path=model.path,
        groups=model.groups,
        workers=tuple(worker_plans),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        blocks_per_request=blocks_per_request,
        kv_cache_size_tokens=int(max_concurrency * max_model_len),
        max_concurrency=max_concurrency,
        warnings=tuple(warnings),
        padding=model.padding,
        group_size=model.group_size,
        page_sizes_unified=model.page_sizes_unified,
        local_attention_promoted=model.local_attention_promoted,
        scheduler_block_size=model.scheduler.scheduler_block,
        hash_block_size=model.scheduler.hash_block,
        rule_set=rules.name,
        hisparse_host_num_blocks=host_blocks_per_worker[0] if hisparse is not None else 0,
        stage=stage,
        reserved_num_blocks=reserved_blocks if stage is PlanStage.EXTENSIBLE_FINAL else 0,
        layout=layout,
        layout_candidates=model.resolution.candidates,
    )


__all__ = [
    "EnginePlan",
    "ModelPlan",
    "ProjectedGroup",
    "WorkerPlan",
    "cdiv",
    "plan_engine",
    "plan_model",
    "worker_budgets",
]
