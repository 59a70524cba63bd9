"""Warnings and padding figures a plan reports beside its groups."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class WarningCode(Enum):
    PADDING_LAYERS = "padding_layers"
    FULL_ALLOCATION_FALLBACK = "full_allocation_fallback"
    HYBRID_MANAGER_DISABLED = "hybrid_manager_disabled"
    # Spec decode on, no draft group identified, a Mamba group exists: consumers
    # flag every group and hybrid prefix-cache hits collapse to zero.
    NO_DRAFT_GROUP_MAMBA = "no_draft_group_mamba"
    # Spec decode on, no draft group identified: every group takes the drop.
    NO_DRAFT_GROUP = "no_draft_group"
    MAX_MODEL_LEN_AUTO_FIT = "max_model_len_auto_fit"
    HIDDEN_STATE_PADDING = "hidden_state_padding"
    # Prefix-cache setups that lose hits (kvplan/core/prefix_warnings.py).
    PREFIX_CACHE_OFF = "prefix_cache_off"
    PREFIX_UNIDENTIFIED_DRAFTER = "prefix_unidentified_drafter"
    PREFIX_LARGE_HIT_UNIT = "prefix_large_hit_unit"
    PREFIX_BOUNDARY_ONLY = "prefix_boundary_only"
    PREFIX_DRAFT_DROP = "prefix_draft_drop"
    PREFIX_BOUNDED_REPLAY = "prefix_bounded_replay"


@dataclass(frozen=True)
class PlanWarning:
    code: WarningCode
    message: str


@dataclass(frozen=True)
class PaddingInfo:
    bucket_index: int
    padding_layers: int
    waste_percent: float  # worst case, of the bucket's memory
    wasted_bytes_per_block: int
