"""The typed result both clients return."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplan.v1 import plan_pb2


@dataclass(frozen=True)
class WorkerView:
    """One worker's share of the plan."""

    rank: int
    num_blocks: int
    bytes_per_block: int
    kv_cache_size_tokens: int
    max_concurrency: float
    max_model_len: int
    tensors: tuple[plan_pb2.KVCacheTensor, ...]
    group_layers: dict[int, tuple[str, ...]]  # group id -> this worker's layers
    budget: plan_pb2.MemoryBudget  # the mode and every number of the KV budget
    lease: plan_pb2.Lease | None  # the device memory reserved for it, if it named a device


@dataclass(frozen=True)
class PlanResult:
    response: plan_pb2.PlanResponse
    _group_of_layer: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        mapping = {
            name: group.group_id for group in self.response.groups for name in group.layer_names
        }
        object.__setattr__(self, "_group_of_layer", mapping)

    @property
    def plan_id(self) -> str:
        return self.response.plan_id

    @property
    def num_blocks(self) -> int:
        return self.response.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.response.max_model_len

    @property
    def group_ids(self) -> tuple[int, ...]:
        return tuple(group.group_id for group in self.response.groups)

    @property
    def draft_group_ids(self) -> tuple[int, ...]:
        """Groups holding the drafter's layers (they take the EAGLE block drop)."""
        return tuple(group.group_id for group in self.response.groups if group.is_draft)

    def is_draft_group(self, group_id: int) -> bool:
        return group_id in self.draft_group_ids

    def group_of(self, layer_name: str) -> int:
        """The group id a layer belongs to (KeyError for an unknown layer)."""
        return self._group_of_layer[layer_name]

    @property
    def engine_id(self) -> str:
        return self.response.engine_id

    @property
    def leases(self) -> tuple[plan_pb2.Lease, ...]:
        """Device memory reserved for the workers that named a device; keep them
        alive with a LeaseKeeper (or RenewLeases) and release them at shutdown."""
        return tuple(self.response.leases)

    @property
    def lease_ttl_s(self) -> float:
        return min((lease.ttl_seconds for lease in self.response.leases), default=0.0)

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(warning.message for warning in self.response.diagnostics.warnings)

    def worker(self, rank: int) -> WorkerView:
        for worker in self.response.workers:
            if worker.rank == rank:
                return WorkerView(
                    rank=worker.rank,
                    num_blocks=worker.num_blocks,
                    bytes_per_block=worker.bytes_per_block,
                    kv_cache_size_tokens=worker.kv_cache_size_tokens,
                    max_concurrency=worker.max_concurrency,
                    max_model_len=worker.max_model_len,
                    tensors=tuple(worker.tensors),
                    group_layers={g.group_id: tuple(g.layer_names) for g in worker.groups},
                    budget=worker.budget,
                    lease=next(
                        (lease for lease in self.response.leases if lease.rank == rank), None
                    ),
                )
        raise KeyError(f"rank {rank} is not part of plan {self.plan_id}")
