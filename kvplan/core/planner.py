"""plan_engine: one engine request in, one plan for every worker out.

`plan_model` (kvplan/core/model_plan.py) first: validate -> merge the workers' specs ->
resolve the layout -> group -> annotate draft groups -> project onto each worker. Then
`plan_engine`'s steps, each a function below it: bytes per block -> the blocks
override -> usable bytes -> max_model_len (auto-fit, one request fits) -> each worker's
configuration (vLLM 0.32, HiSparse) -> one block count for all ranks -> tensors ->
the extensible cache's final size -> the scheduler's start -> capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from kvplan.core.diagnostics import PaddingInfo, PlanWarning, WarningCode
from kvplan.core.errors import InsufficientMemory, InvalidRequest, PlanningError, UnplannableSpecs
from kvplan.core.extensible import blocks_within, segment_strides
from kvplan.core.grouping import raise_unassigned
from kvplan.core.groups import GroupingPath, KVCacheGroup
from kvplan.core.hisparse import HiSparseConfig, check_host_pool, is_hisparse_spec
from kvplan.core.layout import (
    KVCacheLayout,
    TensorPlacement,
    bytes_per_block,
    check_mixed_page_sizes,
    check_page_padding,
    place_tensors,
    validate_layout,
)
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
from kvplan.core.model_plan import ModelPlan, ProjectedGroup, _per_projection, plan_model
from kvplan.core.request import EngineOptions, EngineRequest, WorkerInput
from kvplan.core.specs import PlanningContext, cdiv


class PlanStage(Enum):
    """Which plan this is (vLLM 0.34's extensible cache is planned twice)."""

    CLASSIC = "classic"  # an estimate-sized cache: the only plan
    EXTENSIBLE_RESERVATION = "extensible_reservation"  # before warm-up: upper bounds
    EXTENSIBLE_FINAL = "extensible_final"  # from the workers' measured KV bytes


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


def _context(options: EngineOptions, in_flight_tokens: int, max_model_len: int) -> PlanningContext:
    return PlanningContext(
        max_model_len=max_model_len,
        max_in_flight_tokens=in_flight_tokens,
        dcp_size=options.decode_context_parallel_size,
        mamba_align_mode=options.mamba_align_mode,
        max_num_encoder_input_tokens=options.max_num_encoder_input_tokens,
    )


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
    # Under HiSparse the layout is checked only while building each worker's
    # configuration, after the memory checks (as in every release).
    config_after_memory = (
        request.rules.worker_config_checked_after_memory or options.hisparse is not None
    )
    block_bytes = _block_bytes(request, model, workers, config_after_memory)
    budgets = _override_budgets(options.num_gpu_blocks_override, budgets, block_bytes, model)
    available = [budget.available_bytes for budget in budgets]
    check = _usable_bytes(available, block_bytes, model)
    split_source = _split_source(model)
    lengths = _LengthFit(request, model, workers, block_bytes, split_source)
    needed = lengths.fit(check)
    host_blocks = (
        _build_worker_configs(request, model, workers, lengths.max_model_len, split_source)
        if config_after_memory
        else [0] * len(workers)
    )
    num_blocks = _block_count(options.num_gpu_blocks_override, available, block_bytes, model)
    tensors = _tensors(request, model, num_blocks, block_bytes, host_blocks)
    sized = _Sized(PlanStage.CLASSIC, num_blocks, num_blocks, check, needed, tensors)
    if options.extensible_kv_cache:
        sized = _size_extensible(sized, workers, model, block_bytes, lengths)
    # Last, as the engine does once its KV cache is sized: the scheduler starts.
    if (refusal := model.scheduler.refusal()) is not None:
        raise refusal
    blocks_per_request, max_concurrency = _capacity(
        model, sized.num_blocks, host_blocks[0], lengths.context()
    )
    return EnginePlan(
        engine_id=request.engine_id,
        path=model.path,
        groups=model.groups,
        workers=_worker_plans(workers, model, sized, block_bytes, budgets),
        num_blocks=sized.num_blocks,
        max_model_len=lengths.max_model_len,
        blocks_per_request=blocks_per_request,
        kv_cache_size_tokens=int(max_concurrency * lengths.max_model_len),
        max_concurrency=max_concurrency,
        warnings=tuple(lengths.warnings),
        padding=model.padding,
        group_size=model.group_size,
        page_sizes_unified=model.page_sizes_unified,
        local_attention_promoted=model.local_attention_promoted,
        scheduler_block_size=model.scheduler.scheduler_block,
        hash_block_size=model.scheduler.hash_block,
        rule_set=request.rules.name,
        hisparse_host_num_blocks=host_blocks[0] if options.hisparse is not None else 0,
        stage=sized.stage,
        reserved_num_blocks=sized.reserved_blocks
        if sized.stage is PlanStage.EXTENSIBLE_FINAL
        else 0,
        layout=model.resolution.layout,
        layout_candidates=model.resolution.candidates,
    )


def _split_source(model: ModelPlan) -> set[int]:
    """Projections (ids) that lost the HiSparse source group to the device pool (vLLM
    0.32, see `_project`): their HiSparse configuration cannot be built."""
    if not any(group.host_resident for group in model.groups):
        return set()
    return {
        id(worker_groups)
        for worker_groups in model.projected
        if not any(group.host_resident for group in worker_groups)
    }


def _block_bytes(
    request: EngineRequest,
    model: ModelPlan,
    workers: list[WorkerInput],
    config_after_memory: bool,
) -> list[int]:
    """Each worker's bytes per block (0 for a worker with no groups), once per
    projection; checked at the first worker (in rank order) with that projection."""
    index_of = {worker.rank: index for index, worker in enumerate(request.workers)}
    layout = model.resolution.layout
    block_bytes: list[int] = []
    bytes_of_projection: dict[int, int] = {}
    for worker, worker_groups, device_groups in zip(
        workers, model.projected, model.device, strict=True
    ):
        if not worker_groups:
            block_bytes.append(0)
            continue
        if id(worker_groups) not in bytes_of_projection:
            if not any(group.layer_names for group in worker_groups):
                raise InvalidRequest(
                    f"worker rank {worker.rank} holds no layers of this engine's KV cache "
                    "groups; every worker needs at least one layer",
                    field=f"workers[{index_of[worker.rank]}].layers",
                )
            if not config_after_memory:
                validate_layout(layout, worker_groups)
            bytes_of_projection[id(worker_groups)] = bytes_per_block(
                device_groups, layout, hot_pages_align_pool=request.rules.hot_pages_align_pool
            )
        block_bytes.append(bytes_of_projection[id(worker_groups)])
    return block_bytes


def _override_budgets(
    override: int | None, budgets: list[Budget], block_bytes: list[int], model: ModelPlan
) -> list[Budget]:
    """num_gpu_blocks_override: every worker with groups budgets that many blocks."""
    if override is None:
        return budgets
    return [
        replace(budget, mode=BudgetMode.BLOCKS_OVERRIDE, available_bytes=override * bpb)
        if worker_groups
        else budget
        for budget, bpb, worker_groups in zip(budgets, block_bytes, model.projected, strict=True)
    ]


def _usable_bytes(available: list[int], block_bytes: list[int], model: ModelPlan) -> list[int]:
    """The null block is never allocated: checks plan against usable blocks."""
    return [
        avail - bpb if worker_groups else avail
        for avail, bpb, worker_groups in zip(available, block_bytes, model.projected, strict=True)
    ]


class _LengthFit:
    """The engine's max_model_len as the memory checks settle it: auto-fit, then the
    check that one request of that length fits every worker (run again after an
    extensible cache's warm-up). Holds the length, its warnings and the searches."""

    def __init__(
        self,
        request: EngineRequest,
        model: ModelPlan,
        workers: list[WorkerInput],
        block_bytes: list[int],
        split_source: set[int],
    ) -> None:
        self.options = options = request.options
        self.model, self.workers, self.block_bytes = model, workers, block_bytes
        self.max_model_len = options.starting_max_model_len
        self.warnings = list(model.warnings)
        # What every length probe's context needs.
        self.in_flight = options.max_in_flight_tokens(request.rules)
        self.split_source = split_source
        # A length search depends on the projection, the memory and the upper bound:
        # ranks with one projection and equal budgets search once (auto-fit, 8 workers
        # x 65 layers: planning 1.02 ms -> 0.59 ms).
        self.searched: dict[tuple[int, int, int], int] = {}

    def context(self, length: int | None = None) -> PlanningContext:
        return _context(
            self.options, self.in_flight, self.max_model_len if length is None else length
        )

    def fit(
        self, memory_per_worker: list[int], when: str = "", no_memory_advice: str | None = None
    ) -> list[int]:
        """Auto-fit (where asked) to `memory_per_worker`, then each worker's bytes for
        one request of the length, refused where one does not fit."""
        if self.options.auto_fit and any(self.model.projected):
            self._auto_fit(memory_per_worker, when)
        return self._one_request_fits(memory_per_worker, no_memory_advice)

    def _fits_for(self, worker_groups: list[KVCacheGroup], bpb: int, memory: int) -> int:
        key = (id(worker_groups), memory, self.max_model_len)
        if key not in self.searched:
            self.searched[key] = self._search_length(worker_groups, bpb, memory)
        return self.searched[key]

    def _search_length(self, worker_groups: list[KVCacheGroup], bpb: int, memory: int) -> int:
        device_groups = [g for g in worker_groups if not g.host_resident]
        hisparse, layout = self.options.hisparse, self.model.resolution.layout

        def fits(length: int) -> bool:
            if id(worker_groups) in self.split_source:
                return False  # its configuration cannot be built at any length
            if hisparse is not None and not _hisparse_config_builds(
                hisparse, worker_groups, layout, length, memory // bpb if bpb else 0
            ):
                return False
            return needed_bytes(device_groups, bpb, self.context(length)) <= memory

        return estimate_max_model_len(fits, self.max_model_len)

    def _auto_fit(self, memory_per_worker: list[int], when: str) -> None:
        fitted, limiting_memory = self.max_model_len, memory_per_worker[0]
        for worker_groups, bpb, memory in zip(
            self.model.projected, self.block_bytes, memory_per_worker, strict=True
        ):
            if not worker_groups:
                continue
            worker_max = self._fits_for(worker_groups, bpb, memory)
            if worker_max < fitted:
                fitted, limiting_memory = worker_max, memory
        if fitted <= 0:
            raise InsufficientMemory(
                "Cannot auto-fit max_model_len: not enough GPU memory available to serve "
                f"even a single token{when}. Increase gpu_memory_utilization.",
                field="options.max_model_len",
                details={"available_bytes": min(memory_per_worker)},
            )
        if fitted < self.max_model_len:
            self.warnings.append(
                PlanWarning(
                    WarningCode.MAX_MODEL_LEN_AUTO_FIT,
                    f"Auto-fit max_model_len: reduced from {self.max_model_len} to {fitted} to "
                    f"fit in available KV cache memory ({format_gib(limiting_memory)} GiB){when}",
                )
            )
            self.max_model_len = fitted

    def _one_request_fits(
        self, memory_per_worker: list[int], no_memory_advice: str | None
    ) -> list[int]:
        ctx = self.context()
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
            self.workers,
            self.model.projected,
            self.model.device,
            self.block_bytes,
            memory_per_worker,
            strict=True,
        ):
            if not worker_groups:
                needed.append(0)
                continue
            need = check_one_request_fits(
                rank=worker.rank,
                check_bytes=memory,
                needed=lambda g=device_groups, b=bpb: request_bytes(g, b),  # type: ignore[misc]
                max_model_len=self.max_model_len,
                estimate=lambda memory, g=worker_groups, b=bpb: self._fits_for(g, b, memory),  # type: ignore[misc]
                blocks_override=self.options.num_gpu_blocks_override,
                no_memory_advice=no_memory_advice,
            )
            needed.append(need)
        return needed


def _build_worker_configs(
    request: EngineRequest,
    model: ModelPlan,
    workers: list[WorkerInput],
    max_model_len: int,
    split_source: set[int],
) -> list[int]:
    """vLLM 0.32 (and HiSparse everywhere) checks each worker's configuration as it
    builds it, after the memory checks, in rank order: 0.32 first that its groups hold
    every layer of the worker, then the layout; HiSparse sizes its host pool first.
    Returns each worker's host pool blocks (0 without HiSparse)."""
    hisparse, layout = request.options.hisparse, model.resolution.layout
    host_blocks = [0] * len(workers)
    for index, (worker, worker_groups, device_groups) in enumerate(
        zip(workers, model.projected, model.device, strict=True)
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
                f"host-resident group, which {request.rules.description} then makes a device "
                "group (counted in its memory checks): its HiSparse configuration has no "
                "source group. Run the engine without pipeline parallelism, or on vLLM "
                "0.33+"
            )
        if hisparse is not None:
            host_blocks[index] = _hisparse_host_blocks(hisparse, worker_groups, max_model_len)
        validate_layout(layout, device_groups)
        if hisparse is not None:
            _check_hisparse_layout(layout, device_groups)
    host_pools = {
        blocks
        for blocks, worker_groups in zip(host_blocks, model.projected, strict=True)
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
    return host_blocks


def _block_count(
    override: int | None, available: list[int], block_bytes: list[int], model: ModelPlan
) -> int:
    """One block count for every rank: the fewest any worker holds."""
    return min(
        (override if override is not None else avail // bpb) if worker_groups else 1
        for avail, bpb, worker_groups in zip(available, block_bytes, model.projected, strict=True)
    )


def _tensors(
    request: EngineRequest,
    model: ModelPlan,
    num_blocks: int,
    block_bytes: list[int],
    host_blocks: list[int],
) -> list[tuple[TensorPlacement, ...]]:
    """Each worker's tensors: its host pool's (HiSparse), then its device groups'.
    Workers with one projection share one tuple, which lets the wire conversion render
    each once."""
    hisparse = request.options.hisparse
    layout = model.resolution.layout
    # vLLM's HiSparse placement keeps every release's 0.33-style tensors.
    own_layers_only = request.rules.tensors_for_own_layers_only and hisparse is None
    # Block bytes and host blocks depend on the projection alone.
    host_blocks_of = {
        id(view): blocks for view, blocks in zip(model.projected, host_blocks, strict=True)
    }
    bytes_of = {id(view): bpb for view, bpb in zip(model.projected, block_bytes, strict=True)}
    return _per_projection(
        list(model.projected),
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


@dataclass(frozen=True)
class _Sized:
    """What sizing the cache settled: the stage, the block count and the reservation
    (equal but for a final extensible plan), and per worker its usable bytes, its
    bytes for one request and its tensors."""

    stage: PlanStage
    num_blocks: int
    reserved_blocks: int
    check: list[int]
    needed: list[int]
    tensors: list[tuple[TensorPlacement, ...]]


def _size_extensible(
    sized: _Sized,
    workers: list[WorkerInput],
    model: ModelPlan,
    block_bytes: list[int],
    lengths: _LengthFit,
) -> _Sized:
    """vLLM 0.34's extensible cache: before warm-up the plan is the reservation; after
    it (every worker's measured KV bytes known), the most blocks each worker's measured
    bytes map, the minimum over ranks, never above the reservation."""
    measured = [worker.memory.measured_kv_cache_bytes for worker in workers]
    if not measured or not all(value is not None for value in measured):
        return replace(sized, stage=PlanStage.EXTENSIBLE_RESERVATION)
    reserved_blocks, layout = sized.reserved_blocks, model.resolution.layout
    num_blocks = min(
        (
            blocks_within(
                segment_strides(
                    [t for t in tensors if not t.host_resident], layout, reserved_blocks
                ),
                worker.memory.measured_kv_cache_bytes or 0,
                worker.memory.allocation_granule_bytes,
                reserved_blocks,
            )
            for worker, tensors, worker_groups in zip(
                workers, sized.tensors, model.projected, strict=True
            )
            if worker_groups
        ),
        default=reserved_blocks,
    )
    # The null block stays held back.
    check = [
        (num_blocks - 1) * bpb if worker_groups else 0
        for bpb, worker_groups in zip(block_bytes, model.projected, strict=True)
    ]
    needed = lengths.fit(
        check,
        " after warm-up",
        f"After warm-up the workers' measured KV cache bytes "
        f"(memory.measured_kv_cache_bytes, mapped in memory.allocation_granule_bytes "
        f"granules) hold {num_blocks} block(s) at the fewest, and the null block is one "
        "of them. Report the bytes the cache was measured to hold, or a finer "
        "allocation granule.",
    )
    # Strides and offsets keep describing the reservation; sizes shrink.
    tensors = [
        tuple(
            tensor
            if tensor.host_resident
            else replace(tensor, size_bytes=num_blocks * tensor.size_bytes // reserved_blocks)
            for tensor in worker_tensors
        )
        for worker_tensors in sized.tensors
    ]
    return _Sized(PlanStage.EXTENSIBLE_FINAL, num_blocks, reserved_blocks, check, needed, tensors)


def _worker_plans(
    workers: list[WorkerInput],
    model: ModelPlan,
    sized: _Sized,
    block_bytes: list[int],
    budgets: list[Budget],
) -> tuple[WorkerPlan, ...]:
    num_blocks = sized.num_blocks
    final = sized.stage is PlanStage.EXTENSIBLE_FINAL
    worker_plans = []
    for index, worker in enumerate(workers):
        has_groups = bool(model.projected[index])
        bpb, budget = block_bytes[index], budgets[index]
        worker_plans.append(
            WorkerPlan(
                rank=worker.rank,
                device_uuid=worker.device.uuid,
                num_blocks=num_blocks,
                bytes_per_block=bpb,
                tensors=sized.tensors[index],
                # Workers with one projection share one tuple of groups.
                groups=model.projected_groups[index],
                budget=budget,
                check_bytes=sized.check[index],
                needed_per_request_bytes=sized.needed[index],
                encoder_only_layers=worker.encoder_only_layers,
                kv_tp_replicas=model.tp_replicas[index],
                needs_kv_cache_zeroing=model.zeroing[index],
                footprint_bytes=(
                    # A final extensible cache holds what it committed, not its cap.
                    budget.non_kv_bytes + num_blocks * bpb
                    if final and has_groups
                    else budget.footprint_bytes(num_blocks * bpb if has_groups else 0)
                ),
            )
        )
    return tuple(worker_plans)


def _capacity(
    model: ModelPlan, num_blocks: int, host_blocks: int, ctx: PlanningContext
) -> tuple[int, float]:
    """Blocks per request and max concurrency as the scheduler sees them: the lowest
    rank's groups, with a wrapper group standing for its first layer."""
    blocks_per_request = host_blocks_per_request = 0
    if model.projected and model.projected[0]:
        blocks_of: dict[int, int] = {}  # hybrid groups repeat one spec object
        for group in model.projected[0]:
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
        max_concurrency = min(max_concurrency, host_blocks / host_blocks_per_request)
    return blocks_per_request, max_concurrency


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
