"""plan_engine: one engine request in, one plan for every worker out.

validate -> merge the workers' specs -> group -> annotate draft groups ->
budget every worker -> fit max_model_len -> size blocks and tensors ->
one block count for all ranks -> capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import reduce

from kvplan.core.diagnostics import PaddingInfo, PlanWarning, WarningCode
from kvplan.core.draft import annotate_draft_groups
from kvplan.core.errors import InsufficientMemory, InvalidRequest
from kvplan.core.grouping import SpecDict, group_layers
from kvplan.core.groups import GroupingPath, KVCacheGroup
from kvplan.core.layout import TensorPlacement, bytes_per_block, place_tensors, validate_layout
from kvplan.core.memory import (
    Budget,
    BudgetMode,
    check_one_request_fits,
    estimate_max_model_len,
    format_gib,
    group_blocks_per_request,
    needed_bytes,
    worker_budget,
)
from kvplan.core.request import EngineOptions, EngineRequest, WorkerInput
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


def _validate(request: EngineRequest) -> list[WorkerInput]:
    if not request.workers:
        raise InvalidRequest("an engine needs at least one worker", field="workers")
    options = request.options
    if options.starting_max_model_len <= 0:
        field = "options.derived_max_model_len" if options.auto_fit else "options.max_model_len"
        raise InvalidRequest("max_model_len must be positive (or -1 to auto-fit)", field=field)
    ranks: dict[int, int] = {}
    for index, worker in enumerate(request.workers):
        if worker.rank in ranks:
            raise InvalidRequest(
                f"rank {worker.rank} appears twice (workers[{ranks[worker.rank]}] and "
                f"workers[{index}])",
                field=f"workers[{index}].rank",
            )
        ranks[worker.rank] = index
        seen: set[str] = set()
        for layer_index, (name, _) in enumerate(worker.layers):
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
    owner: dict[str, int] = {}
    for worker in workers:
        for layer_index, (name, spec) in enumerate(worker.layers):
            if name not in merged:
                merged[name] = spec
                owner[name] = worker.rank
            elif merged[name] is not spec and merged[name] != spec:
                raise InvalidRequest(
                    f"layer {name!r} has different specs on worker ranks {owner[name]} and "
                    f"{worker.rank}; ranks of one engine must agree on every shared layer",
                    field=f"workers[{index_of[worker.rank]}].layers[{layer_index}]",
                )
    return merged


def _tag_retained_tokens(specs: SpecDict, request: EngineRequest) -> SpecDict:
    # Multi-module MTP re-prefills its last k-1 tokens: windows keep them.
    extra = max(0, request.spec_decode.prefill_lookahead_tokens - 1)
    # Layers share spec objects: rebuild each object once. Keyed by identity, as
    # equal specs may still differ in is_draft, which equality ignores.
    tagged: dict[int, KVCacheSpec] = {}

    def tag(spec: KVCacheSpec) -> KVCacheSpec:
        if not isinstance(spec, SlidingWindowSpec) or spec.extra_retained_tokens == extra:
            return spec
        result = tagged.get(id(spec))
        if result is None:
            result = tagged[id(spec)] = replace(spec, extra_retained_tokens=extra)
        return result

    return {name: tag(spec) for name, spec in specs.items()}


def _project_all(
    groups: list[KVCacheGroup], workers: list[WorkerInput]
) -> list[list[KVCacheGroup]]:
    """Every worker's view of the global groups, in time linear in the layers.

    A worker sees its own layers only, in group order. Draft flags survive even
    where the worker holds none of the group's layers (vLLM 0.33). Each worker's
    layers are looked up in one index of the global groups (one pass per worker
    over its own layers, not over every group's layers), and workers with the
    same layer list (tensor-parallel ranks) share one projection.
    """
    position = {
        name: (group_index, layer_index)
        for group_index, group in enumerate(groups)
        for layer_index, name in enumerate(group.layer_names)
    }
    by_layers: dict[tuple[tuple[str, KVCacheSpec], ...], list[KVCacheGroup]] = {}
    projected: list[list[KVCacheGroup]] = []
    for worker in workers:
        view = by_layers.get(worker.layers)
        if view is None:
            view = by_layers[worker.layers] = _project(groups, worker, position)
        projected.append(view)
    return projected


def _project(
    groups: list[KVCacheGroup],
    worker: WorkerInput,
    position: dict[str, tuple[int, int]],
) -> list[KVCacheGroup]:
    held: list[list[int]] = [[] for _ in groups]
    for name, _ in worker.layers:
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
        projected.append(replace(group, layer_names=names, spec=spec))
    return projected


def _context(options: EngineOptions, max_model_len: int) -> PlanningContext:
    return PlanningContext(
        max_model_len=max_model_len,
        max_in_flight_tokens=options.max_in_flight_tokens,
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


def _block_sizes(groups: list[KVCacheGroup], options: EngineOptions) -> tuple[int, int]:
    """(scheduler block size, prefix-cache hash block size) in tokens."""
    if not groups:
        return options.block_size, options.block_size
    dcp = options.decode_context_parallel_size

    def tokens(group: KVCacheGroup) -> int:
        spec = group.representative_spec
        return spec.block_size * (dcp if spec.dcp_sharded else 1)

    if len(groups) == 1:
        size = tokens(groups[0])
        return size, size
    scheduler = math.lcm(*(tokens(group) for group in groups))
    has_mamba_none = (
        any(isinstance(group.representative_spec, MambaSpec) for group in groups)
        and not options.mamba_align_mode
    )
    if not options.enable_prefix_caching or has_mamba_none:
        return scheduler, scheduler
    if options.prefix_match_unit:
        return scheduler, options.prefix_match_unit
    cacheable = [g.representative_spec.block_size for g in groups if g.spec.prefix_cacheable]
    return scheduler, math.gcd(*cacheable) if cacheable else scheduler


def plan_engine(request: EngineRequest) -> EnginePlan:
    options = request.options
    workers = _validate(request)
    specs = _tag_retained_tokens(_merge_worker_specs(workers, request), request)

    grouping = group_layers(
        specs,
        layout=options.layout,
        disable_hybrid=options.disable_hybrid_kv_cache_manager,
    )
    groups, draft_warnings = annotate_draft_groups(grouping, request.spec_decode)
    warnings = [*grouping.warnings, *draft_warnings]

    projected = _project_all(groups, workers)
    index_of = {worker.rank: index for index, worker in enumerate(request.workers)}
    budgets = [worker_budget(worker, index_of[worker.rank]) for worker in workers]
    available = [budget.available_bytes for budget in budgets]

    block_bytes: list[int] = []
    for worker, worker_groups in zip(workers, projected, strict=True):
        if not worker_groups:
            block_bytes.append(0)
            continue
        if not any(group.layer_names for group in worker_groups):
            raise InvalidRequest(
                f"worker rank {worker.rank} holds no layers of this engine's KV cache groups; "
                "every worker needs at least one layer",
                field=f"workers[{index_of[worker.rank]}].layers",
            )
        validate_layout(options.layout, worker_groups)
        block_bytes.append(bytes_per_block(worker_groups, options.layout))

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

    def fits_for(worker_groups: list[KVCacheGroup], bpb: int, memory: int) -> int:
        return estimate_max_model_len(
            lambda length: needed_bytes(worker_groups, bpb, _context(options, length)) <= memory,
            max_model_len,
        )

    if options.auto_fit and any(projected):
        fitted, limiting_memory = max_model_len, check[0]
        for worker_groups, bpb, memory in zip(projected, block_bytes, check, strict=True):
            if not worker_groups:
                continue
            worker_max = fits_for(worker_groups, bpb, memory)
            if worker_max < fitted:
                fitted, limiting_memory = worker_max, memory
        if fitted <= 0:
            raise InsufficientMemory(
                "Cannot auto-fit max_model_len: not enough GPU memory available to serve "
                "even a single token. Increase gpu_memory_utilization.",
                field="options.max_model_len",
                details={"available_bytes": min(check)},
            )
        if fitted < max_model_len:
            warnings.append(
                PlanWarning(
                    WarningCode.MAX_MODEL_LEN_AUTO_FIT,
                    f"Auto-fit max_model_len: reduced from {max_model_len} to {fitted} to fit "
                    f"in available KV cache memory ({format_gib(limiting_memory)} GiB)",
                )
            )
            max_model_len = fitted

    ctx = _context(options, max_model_len)
    needed: list[int] = []
    for worker, worker_groups, bpb, memory in zip(
        workers, projected, block_bytes, check, strict=True
    ):
        if not worker_groups:
            needed.append(0)
            continue
        need = check_one_request_fits(
            rank=worker.rank,
            check_bytes=memory,
            needed=lambda g=worker_groups, b=bpb: needed_bytes(g, b, ctx),  # type: ignore[misc]
            max_model_len=max_model_len,
            estimate=lambda memory, g=worker_groups, b=bpb: fits_for(g, b, memory),  # type: ignore[misc]
        )
        needed.append(need)

    per_worker_blocks = [
        (override if override is not None else avail // bpb) if worker_groups else 1
        for avail, bpb, worker_groups in zip(available, block_bytes, projected, strict=True)
    ]
    num_blocks = min(per_worker_blocks)

    worker_plans = []
    for worker, worker_groups, bpb, budget, memory, need in zip(
        workers, projected, block_bytes, budgets, check, needed, strict=True
    ):
        tensors = (
            place_tensors(worker_groups, num_blocks, options.layout, bpb) if worker_groups else []
        )
        worker_plans.append(
            WorkerPlan(
                rank=worker.rank,
                device_uuid=worker.device.uuid,
                num_blocks=num_blocks,
                bytes_per_block=bpb,
                tensors=tuple(tensors),
                groups=tuple(
                    ProjectedGroup(g.group_id, g.layer_names, g.is_draft) for g in worker_groups
                ),
                budget=budget,
                check_bytes=memory,
                needed_per_request_bytes=need,
                encoder_only_layers=worker.encoder_only_layers,
                kv_tp_replicas=_tp_replicas(worker_groups, options),
                footprint_bytes=budget.footprint_bytes(num_blocks * bpb if worker_groups else 0),
            )
        )

    # Capacity as the scheduler sees it: the lowest rank's groups, with a
    # wrapper group standing for its first layer.
    blocks_per_request = 0
    if projected and projected[0]:
        blocks_per_request = sum(
            group_blocks_per_request(replace(group, spec=group.representative_spec), ctx)
            for group in projected[0]
        )
    max_concurrency = num_blocks / blocks_per_request if blocks_per_request else 0.0
    scheduler_block, hash_block = _block_sizes(projected[0] if projected else [], options)

    return EnginePlan(
        engine_id=request.engine_id,
        path=grouping.path,
        groups=tuple(groups),
        workers=tuple(worker_plans),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        blocks_per_request=blocks_per_request,
        kv_cache_size_tokens=int(max_concurrency * max_model_len),
        max_concurrency=max_concurrency,
        warnings=tuple(warnings),
        padding=tuple(grouping.padding),
        group_size=grouping.group_size,
        page_sizes_unified=grouping.page_sizes_unified,
        local_attention_promoted=grouping.local_attention_promoted,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
    )


__all__ = ["EnginePlan", "ProjectedGroup", "WorkerPlan", "cdiv", "plan_engine"]
