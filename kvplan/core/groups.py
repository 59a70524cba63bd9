"""KV cache groups: layers that share one block table."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvplan.core.cached import cached_value
from kvplan.core.specs import KVCacheSpec, UniformTypeSpecs


class DraftRule(Enum):
    """Which rule marked a group as holding the drafter's layers."""

    NONE = "none"
    IS_DRAFT = "is_draft"  # a layer of the group is marked is_draft
    SPEC_MARKER = "spec_marker"  # an MLA layer has non_causal_multi_token_decode
    TRAILING_LAYER = "trailing_layer"  # holds the last registered layer (MTP)


class GroupingPath(Enum):
    ATTENTION_FREE = "attention_free"
    UNIFORM_SPEC = "uniform_spec"
    UNIFORM_TYPE = "uniform_type"
    PACKED = "packed"
    HYBRID = "hybrid"
    FULL_ALLOCATION_FALLBACK = "full_allocation_fallback"
    HISPARSE = "hisparse"


@dataclass(frozen=True)
class KVCacheGroup:
    group_id: int
    layer_names: tuple[str, ...]
    spec: KVCacheSpec  # merged spec, or a UniformTypeSpecs wrapper
    is_draft: bool = False
    draft_rule: DraftRule = DraftRule.NONE
    padding_layers: int = 0  # hybrid path: nominal group size minus len(layer_names)
    host_resident: bool = False  # HiSparse source group: lives in the host pool

    def spec_of(self, layer_name: str) -> KVCacheSpec:
        if isinstance(self.spec, UniformTypeSpecs):
            return self.spec.specs_by_layer[layer_name]
        return self.spec

    @property
    def layer_runs(self) -> tuple[tuple[KVCacheSpec, tuple[str, ...]], ...]:
        """The group's layers as runs of one identical spec, in order of first use."""
        if not isinstance(self.spec, UniformTypeSpecs):
            # One run: cheaper built than cached.
            return ((self.spec, self.layer_names),) if self.layer_names else ()
        return self._uniform_layer_runs

    @cached_value
    def _uniform_layer_runs(self) -> tuple[tuple[KVCacheSpec, tuple[str, ...]], ...]:
        assert isinstance(self.spec, UniformTypeSpecs)
        members = self.spec.specs_by_layer
        runs: dict[KVCacheSpec, list[str]] = {}
        for name in self.layer_names:
            runs.setdefault(members[name], []).append(name)
        return tuple((spec, tuple(names)) for spec, names in runs.items())

    @cached_value
    def wrapper_layer_runs(self) -> tuple[tuple[KVCacheSpec, tuple[str, ...]], ...]:
        """Runs over every layer of a uniform-type wrapper, whatever `layer_names`
        holds (a group projected to a worker keeps the global wrapper)."""
        if not isinstance(self.spec, UniformTypeSpecs):
            return ()
        runs: dict[KVCacheSpec, list[str]] = {}
        for name, spec in self.spec.layer_specs:
            runs.setdefault(spec, []).append(name)
        return tuple((spec, tuple(names)) for spec, names in runs.items())

    @property
    def representative_spec(self) -> KVCacheSpec:
        """The spec a scheduler sees: a wrapper's first layer spec."""
        if isinstance(self.spec, UniformTypeSpecs):
            return self.spec.first_spec
        return self.spec
