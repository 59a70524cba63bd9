"""Model plans kept across requests: engines of one model share their grouping.

A fleet's engines of one model differ in their workers' memory (each process
measures what it has free) far more often than in their layers. The memory-
independent half of a plan (`kvplan.core.model_plan.plan_model`: layer conversion,
layout, groups, draft flags, projections) is then the same for all of them, and
`ModelCache` keeps it, keyed by `PlanKeys.model`, for the next engine of that model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

from kvplan.core.layout import KVCacheLayout
from kvplan.core.model_plan import ModelPlan
from kvplan.core.request import EngineOptions, EngineRequest, SpecDecode
from kvplan.core.rules import RuleSet
from kvplan.core.specs import KVCacheSpec

WorkerLayers = tuple[tuple[str, KVCacheSpec], ...]

# What a kept model holds per layer besides its name, measured with tracemalloc
# (tests/test_model_cache.py): 240 B for 64 Gemma-style layers, 250 B for 8 TP ranks
# x 65 layers, 490 B for 32 pipeline stages x 8 layers, 1.2 KB with every layer a
# spec of its own. Rounded up, so that the bound holds for all of them.
BYTES_PER_LAYER = 1536


@dataclass(frozen=True)
class WorkerModel:
    """One worker's model side, as converted: what `plan_model` read of it."""

    layers: WorkerLayers
    encoder_only_layers: tuple[str, ...]
    supported_layouts: tuple[KVCacheLayout, ...]


@dataclass(frozen=True)
class KnownModel:
    """A request's converted model side and its model plan: all a later request with
    the same model key needs besides its own memory and device settings."""

    options: EngineOptions
    spec_decode: SpecDecode
    rules: RuleSet
    workers: dict[int, WorkerModel]  # by rank (distinct: plan_model checked them)
    plan: ModelPlan
    # The plan's groups as a reply carries them (kvplan.convert.render.render_groups): every
    # engine of the model gets the same, so it is rendered once.
    rendered_groups: bytes
    # Bytes it holds, over-estimated: each distinct layer list once (tensor-parallel
    # ranks share one) at BYTES_PER_LAYER plus its names' characters, and the groups'
    # wire bytes.
    weight: int
    # The plan's prefix-cache diagnostics and warnings as Diagnostics bytes
    # (kvplan.convert.render.prefix_cache_diagnostics): the same for every engine of
    # the model; b"" until its first engine rendered them.
    prefix_diagnostics: bytes = b""

    @classmethod
    def of(cls, request: EngineRequest, plan: ModelPlan, rendered_groups: bytes) -> KnownModel:
        distinct = {id(worker.layers): worker.layers for worker in request.workers}
        return cls(
            options=request.options,
            spec_decode=request.spec_decode,
            rules=request.rules,
            workers={
                w.rank: WorkerModel(w.layers, w.encoder_only_layers, w.supported_layouts)
                for w in request.workers
            },
            plan=plan,
            rendered_groups=rendered_groups,
            weight=len(rendered_groups)
            + max(
                BYTES_PER_LAYER,
                sum(
                    BYTES_PER_LAYER + len(name)
                    for layers in distinct.values()
                    for name, _ in layers
                ),
            ),
        )

    def with_prefix_diagnostics(self, rendered: bytes) -> KnownModel:
        return replace(self, prefix_diagnostics=rendered, weight=self.weight + len(rendered))

    def worker(self, rank: int) -> WorkerModel:
        """The model side of the worker of this rank (a request with this model's key
        has the same ranks)."""
        return self.workers[rank]


class ModelCache:
    """The most recently used model plans, least recently used dropped first.

    Bounded by count and by bytes (`KnownModel.weight`, an over-estimate): a caller
    cannot make it hold more than `max_bytes`. Planning threads and the event loop
    share it: a lock guards every call.
    """

    def __init__(
        self,
        capacity: int = 256,
        max_bytes: int = 32 * 1024 * 1024,
        on_reuse: Callable[[], object] | None = None,
    ) -> None:
        """`on_reuse`: called on every hit (a metric's counter)."""
        if capacity < 0 or max_bytes < 0:
            raise ValueError("a model cache's bounds are not negative")
        self._on_reuse = on_reuse
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._models: OrderedDict[Hashable, KnownModel] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._models)

    @property
    def size_bytes(self) -> int:
        """What the kept models hold, as the bound counts it (`KnownModel.weight`)."""
        return self._bytes

    def get(self, key: Hashable) -> KnownModel | None:
        with self._lock:
            known = self._models.get(key)
            if known is not None:
                self._models.move_to_end(key)
        if known is not None and self._on_reuse is not None:
            self._on_reuse()
        return known

    def put(self, key: Hashable, known: KnownModel) -> None:
        """Keep `known` (a model over the byte bound is not kept at all)."""
        weight = known.weight
        with self._lock:
            replaced = self._models.pop(key, None)
            if replaced is not None:
                self._bytes -= replaced.weight
            if self._capacity == 0 or weight > self._max_bytes:
                return
            self._models[key] = known
            self._bytes += weight
            while len(self._models) > self._capacity or self._bytes > self._max_bytes:
                _, dropped = self._models.popitem(last=False)
                self._bytes -= dropped.weight


__all__ = ["BYTES_PER_LAYER", "KnownModel", "ModelCache", "WorkerModel"]
