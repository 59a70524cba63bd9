"""Engine-release rule sets: every planning rule that differs between the vLLM
releases kvplan plans for, in one place.

A request names its rule set (`EngineOptions.engine_version`); the planning
steps read the fields of the `RuleSet` value and never test a version string.
Adding a release is adding one entry to `RULE_SETS` (and, for a rule no field
covers yet, one field here and the step that reads it).

The values were read off each release's own planner (vLLM 0.32.0, 0.33.0 and
0.34.0 on the CPU; see conformance/) and are checked against it by
`make conformance`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from kvplan.core.errors import InvalidRequest


class DraftFlagRule(Enum):
    """How draft groups (the EAGLE last-block drop) are found."""

    # vLLM 0.33 / 0.34: exactly the groups holding an `is_draft` layer, on every path.
    IS_DRAFT_ONLY = "is_draft_only"
    # vLLM 0.31 / 0.32 (PR #55390 as shipped), packed and hybrid paths only: the
    # spec marker flags its groups, and for MTP (or a DeepSeek-V4 target) the
    # group holding the last registered layer is flagged too, both rules at once.
    SPEC_MARKER_AND_TRAILING = "spec_marker_and_trailing"
    # kvplan's own: `is_draft` on every path; when no layer is marked, the spec
    # marker, else the trailing layer (packed and hybrid paths; first match decides).
    IS_DRAFT_THEN_POSITIONAL = "is_draft_then_positional"


class InFlightBatches(Enum):
    """How many batches may be in flight (sliding-window / chunked reserves)."""

    # Model runner V2: pp + 1 under async scheduling. V1: pp, or 2 when pp == 1.
    BY_MODEL_RUNNER = "by_model_runner"
    # Only model runner V2 exists (vLLM 0.34): pp + 1 under async scheduling.
    V2_ONLY = "v2_only"


class DraftSlotCheck(Enum):
    """What VllmConfig requires of max_num_batched_tokens with a drafter: more tokens
    than the slots the drafter takes per request (else it refuses the engine)."""

    # vLLM 0.32: the drafting slots a request adds to the batch (dflash K, dspark
    # K - 1 as it drafts in parallel, a draft model 1, the others none).
    NEW_SLOTS_FOR_DRAFTING = "new_slots_for_drafting"
    # vLLM 0.33 / 0.34: the lookahead KV slots (dflash K + 1; eagle, eagle3, mtp,
    # dspark and a draft model K; ngram, suffix and Medusa none).
    LOOKAHEAD_TOKENS = "lookahead_tokens"


class AsyncDraftCheck(Enum):
    """Where async scheduling refuses a drafter outside the EAGLE family, the draft
    model and the GPU n-gram: suffix, and Medusa (0.32). kvplan's ngram also stands
    for the GPU n-gram (the vLLM plugin sends it so), so it is not refused."""

    ANY_RUNNER = "any_runner"  # vLLM 0.32
    V1_RUNNER = "v1_runner"  # vLLM 0.33: the V2 model runner takes them
    NEVER = "never"  # vLLM 0.34


class LayoutMerge(Enum):
    """How the workers' supported-layout lists (most preferred first) combine
    into the engine's candidates, before the spec-driven narrowing."""

    # vLLM 0.32 / 0.33: every worker must report the same list (they assert it).
    REQUIRE_EQUAL = "require_equal"
    # vLLM 0.34: identical lists keep their order; otherwise the layouts in every
    # list, the one the most workers put first winning (ties in vLLM's enum
    # order). A worker reporting exactly the no-preference default does not vote.
    FIRST_CHOICE_VOTE = "first_choice_vote"


# Optional request fields that only some releases have (their proto field paths,
# relative to a layer's spec body or to the request, as `unsupported_field` reports).
FIELD_IS_DRAFT = "is_draft"
FIELD_TOPK_BUFFER_WIDTH = "mla.topk_buffer_width"
FIELD_KV_HEAD_MAJOR_SLOTS = "attention.kv_head_major_slots"
FIELD_STATE_ALIGNMENT = "state_alignment_bytes"
FIELD_SW_MLA_SPEC_MARKER = "non_causal_multi_token_decode"
FIELD_MEASURED_KV_BYTES = "memory.measured_kv_cache_bytes"
FIELD_EXTENSIBLE_KV_CACHE = "options.extensible_kv_cache"

_ALL_FIELDS = frozenset(
    {
        FIELD_IS_DRAFT,
        FIELD_TOPK_BUFFER_WIDTH,
        FIELD_KV_HEAD_MAJOR_SLOTS,
        FIELD_STATE_ALIGNMENT,
        FIELD_SW_MLA_SPEC_MARKER,
        FIELD_MEASURED_KV_BYTES,
        FIELD_EXTENSIBLE_KV_CACHE,
    }
)


@dataclass(frozen=True)
class RuleSet:
    """The planning rules of one engine release."""

    name: str  # what PlanResponse.rule_set reports
    description: str
    default_block_size: int  # tokens, when options.block_size is unset

    # Draft groups.
    draft_rule: DraftFlagRule
    # Methods whose drafter takes the last-block drop (the annotation gate).
    block_drop_methods: frozenset[str]
    # Methods for which an unflagged Mamba group draws the warning (0.32 warns
    # even when the drop is disabled; 0.33 only when it applies).
    warning_methods: frozenset[str]
    warning_needs_block_drop: bool
    # kvplan's own extra warning: spec decode on, no group flagged, no Mamba group.
    warns_unflagged_without_mamba: bool
    # A projected group keeps its flag on a worker that holds none of its layers.
    flag_survives_empty_projection: bool

    # Order of checks.
    # 0.32 checks each worker's configuration as it builds it, after the memory
    # checks: that the groups hold every layer of the worker (its packed grouping
    # can drop some), then the layout. Later releases check both before.
    worker_config_checked_after_memory: bool

    # Grouping.
    fallback_admits_sliding_window_mla: bool  # MLA + SW-MLA full-allocation fallback
    promotion_drops_bounded_replay: bool  # SW-MLA promoted to MLA under disable_hybrid
    sw_mla_merge_keeps_quant_and_alignment: bool
    # Uniform-type groups a worker holds only some layers of place tensors for
    # the worker's own layers (0.34) or for every layer of the group (0.32/0.33).
    tensors_for_own_layers_only: bool

    in_flight_batches: InFlightBatches

    # 0.34's extensible KV cache: the planner only reserves; a worker's measured
    # KV bytes decide the final block count.
    extensible_kv_cache: bool

    # Optional request fields this release has (see FIELD_*).
    fields: frozenset[str]
    # The highest KVQuantMode value the release knows (0.32 has no Octave modes).
    max_kv_quant_mode: int = 14
    # Whether KV-cache zeroing is decided once for all workers (OR) or per worker.
    kv_zeroing_across_workers: bool = False
    # How the workers' supported_layouts combine (kvplan/core/layout_resolution.py).
    layout_merge: LayoutMerge = LayoutMerge.REQUIRE_EQUAL
    # 0.33+: with prefix caching, block hashes cover the drafter's lookahead, so no
    # group takes the EAGLE last-block drop unless flagged (0.32 drops from every
    # group when none is flagged). Read when the scheduler starts.
    lookahead_block_hashes: bool = True
    # Speculative methods the release no longer accepts: its SpeculativeConfig
    # refuses the method (0.33's method field has no Medusa; 0.34's validator
    # neither).
    unsupported_spec_methods: frozenset[str] = frozenset({"medusa"})
    # HiSparse: every hot group's page aligns a worker's block, also on a stage
    # holding none of its layers (0.32 / 0.33; 0.34 aligns to own layers only).
    hot_pages_align_pool: bool = True
    # HiSparse: a worker holding only some layers of the host-resident source group
    # keeps it host-resident (0.33+). 0.32's projection drops the flag, so that
    # worker's HiSparse configuration has no source group and cannot be built.
    hisparse_projection_keeps_host_source: bool = True
    # 0.34's VllmConfig refuses the nvfp4_ds_mla cache dtype under DCP > 1
    # (validate_nvfp4_kv_cache_with_mla); 0.32 / 0.33 take it.
    nvfp4_ds_mla_refuses_dcp: bool = False
    # The widest decode query counts one more row for the draft_model method (0.34:
    # SpeculativeConfig.max_num_new_slots_for_drafting, the standalone draft model's
    # unsliced token; 0.32 / 0.33: 1 + num_speculative_tokens for every method under
    # model runner V2). HiSparse's default device buffer and its minimum read it.
    draft_model_extra_query_slot: bool = False
    # The batch a drafter needs (VllmConfig._set_max_num_scheduled_tokens).
    draft_slot_check: DraftSlotCheck = DraftSlotCheck.LOOKAHEAD_TOKENS
    # Async scheduling with a drafter it cannot overlap (VllmConfig.__post_init__).
    async_draft_check: AsyncDraftCheck = AsyncDraftCheck.V1_RUNNER
    # The model runner (VllmConfig.use_v2_model_runner, 0.32 / 0.33; 0.34 has only V2,
    # in_flight_batches V2_ONLY, and reads none of these). Unset, V2 is chosen unless
    # the engine uses something V2 lacks (then V1); asked for, a runner that lacks a
    # feature refuses the engine (kvplan/core/model_runner.py).
    # Speculative methods V2 does not run.
    v2_runner_unsupported_methods: frozenset[str] = frozenset({"suffix"})
    # The methods V2 runs with parallel drafting (others only on V1).
    v2_runner_parallel_drafting_methods: frozenset[str] = frozenset({"dflash", "dspark"})
    # Speculative methods V1 does not run (DSpark is V2's only).
    v1_runner_unsupported_methods: frozenset[str] = frozenset({"dspark"})
    # V1 refuses pipeline parallelism (pp > 1) with async scheduling.
    v1_runner_refuses_pp_async: bool = True
    # The methods speculative_config.parallel_drafting may be set for (0.34: DFlash and
    # DSpark; the field is deprecated there). None: any method (0.32 / 0.33).
    parallel_drafting_methods: frozenset[str] | None = None

    @property
    def has_v1_runner(self) -> bool:
        return self.in_flight_batches is not InFlightBatches.V2_ONLY

    def max_concurrent_batches(
        self, *, pipeline_parallel_size: int, async_scheduling: bool, use_v2_model_runner: bool
    ) -> int:
        """Batches in flight at once: pp fills the pipeline; async scheduling
        overlaps one more (V2), or runs 2 when pp == 1 (V1)."""
        pp = pipeline_parallel_size
        if not async_scheduling:
            return pp
        if use_v2_model_runner or self.in_flight_batches is InFlightBatches.V2_ONLY:
            return pp + 1
        return 2 if pp <= 1 else pp

    def has_field(self, name: str) -> bool:
        return name in self.fields

    def unsupported_field(self, name: str, path: str) -> InvalidRequest:
        return InvalidRequest(
            f"{path} does not exist in {self.description}; leave it unset or choose an "
            f"engine_version that has it ({', '.join(versions_with_field(name)) or 'none'})",
            field=path,
        )


_EAGLE_FAMILY = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
_BLOCK_DROP_033 = frozenset({"eagle", "eagle3", "mtp"})  # DFlash / DSpark need no drop

# vLLM 0.33.0 in full; every other rule set is written as its differences from it,
# so what a release changes stands in one place (adding 0.35 is one more `replace`).
VLLM_0_33 = RuleSet(
    name="vllm-0.33",
    description="vLLM 0.33.0",
    default_block_size=16,
    draft_rule=DraftFlagRule.IS_DRAFT_ONLY,
    block_drop_methods=_BLOCK_DROP_033,
    warning_methods=_BLOCK_DROP_033,
    warning_needs_block_drop=True,
    warns_unflagged_without_mamba=False,
    flag_survives_empty_projection=True,
    worker_config_checked_after_memory=False,
    fallback_admits_sliding_window_mla=False,
    promotion_drops_bounded_replay=False,
    sw_mla_merge_keeps_quant_and_alignment=False,
    tensors_for_own_layers_only=False,
    in_flight_batches=InFlightBatches.BY_MODEL_RUNNER,
    extensible_kv_cache=False,
    fields=frozenset({FIELD_IS_DRAFT, FIELD_TOPK_BUFFER_WIDTH}),
)

KVPLAN = replace(
    VLLM_0_33,
    name="kvplan",
    description="kvplan's own rules (vLLM 0.33 plus the draft rules of PR #55390)",
    draft_rule=DraftFlagRule.IS_DRAFT_THEN_POSITIONAL,
    block_drop_methods=_EAGLE_FAMILY,
    warning_methods=_EAGLE_FAMILY,
    warns_unflagged_without_mamba=True,
    tensors_for_own_layers_only=True,
    # Pipeline stages may run different backends (docs/semantics.md, D9).
    layout_merge=LayoutMerge.FIRST_CHOICE_VOTE,
)

VLLM_0_32 = replace(
    VLLM_0_33,
    name="vllm-0.32",
    description="vLLM 0.32.0",
    draft_rule=DraftFlagRule.SPEC_MARKER_AND_TRAILING,
    block_drop_methods=_EAGLE_FAMILY,
    warning_methods=_EAGLE_FAMILY,
    warning_needs_block_drop=False,
    flag_survives_empty_projection=False,
    worker_config_checked_after_memory=True,
    fields=frozenset(),
    max_kv_quant_mode=11,
    lookahead_block_hashes=False,
    hisparse_projection_keeps_host_source=False,
    unsupported_spec_methods=frozenset(),
    draft_slot_check=DraftSlotCheck.NEW_SLOTS_FOR_DRAFTING,
    async_draft_check=AsyncDraftCheck.ANY_RUNNER,
    v2_runner_unsupported_methods=frozenset({"suffix", "medusa"}),
)

VLLM_0_34 = replace(
    VLLM_0_33,
    name="vllm-0.34",
    description="vLLM 0.34.0",
    default_block_size=64,
    fallback_admits_sliding_window_mla=True,
    promotion_drops_bounded_replay=True,
    sw_mla_merge_keeps_quant_and_alignment=True,
    tensors_for_own_layers_only=True,
    in_flight_batches=InFlightBatches.V2_ONLY,
    extensible_kv_cache=True,
    kv_zeroing_across_workers=True,
    layout_merge=LayoutMerge.FIRST_CHOICE_VOTE,
    fields=_ALL_FIELDS,
    hot_pages_align_pool=False,
    nvfp4_ds_mla_refuses_dcp=True,
    draft_model_extra_query_slot=True,
    async_draft_check=AsyncDraftCheck.NEVER,
    parallel_drafting_methods=frozenset({"dflash", "dspark"}),
)

RULE_SETS: dict[str, RuleSet] = {
    "": KVPLAN,
    VLLM_0_32.name: VLLM_0_32,
    VLLM_0_33.name: VLLM_0_33,
    VLLM_0_34.name: VLLM_0_34,
}


def versions_with_field(name: str) -> list[str]:
    return [key for key, rules in RULE_SETS.items() if key and rules.has_field(name)]


def versions_with_spec_method(method: str) -> list[str]:
    return [key for key, rules in RULE_SETS.items() if method not in rules.unsupported_spec_methods]


def rule_set_for(engine_version: str) -> RuleSet:
    """The rule set a request names; INVALID_ARGUMENT listing the known ones."""
    rules = RULE_SETS.get(engine_version)
    if rules is None:
        known = ", ".join(repr(key) for key in RULE_SETS)
        raise InvalidRequest(
            f"unknown engine_version {engine_version!r}; supported: {known} "
            "('' plans with kvplan's own rules)",
            field="options.engine_version",
        )
    return rules


assert all(rules.fields <= _ALL_FIELDS for rules in RULE_SETS.values())

__all__ = [
    "KVPLAN",
    "RULE_SETS",
    "VLLM_0_32",
    "VLLM_0_33",
    "VLLM_0_34",
    "AsyncDraftCheck",
    "DraftFlagRule",
    "DraftSlotCheck",
    "InFlightBatches",
    "LayoutMerge",
    "RuleSet",
    "rule_set_for",
]
