"""Draft-group annotation: which groups hold the drafter's (EAGLE/MTP) layers.

Rules in precedence order; the first that identifies any group decides:
1. explicit `is_draft` markers (vLLM 0.33), on every grouping path;
2. the spec marker `non_causal_multi_token_decode` of MLA layers;
3. the trailing-layer rule for MTP (and DeepSeek-V4 targets): the group that
   holds the last registered layer, only when the groups partition the layers
   exactly.
Rules 2 and 3 run on the packed and hybrid paths only, as in the seed patch;
a single-group plan needs no flag (consumers flag the only group anyway).
"""

from __future__ import annotations

from dataclasses import replace

from kvplan.core.diagnostics import PlanWarning, WarningCode
from kvplan.core.grouping import GroupingResult
from kvplan.core.groups import DraftRule, KVCacheGroup
from kvplan.core.request import SpecDecode
from kvplan.core.specs import MambaSpec, MLAAttentionSpec, layer_specs_of


def _groups_partition_exactly(groups: list[KVCacheGroup], names: list[str]) -> bool:
    grouped = [name for group in groups for name in group.layer_names]
    return len(grouped) == len(names) and set(grouped) == set(names)


def _find_draft_groups(
    result: GroupingResult, spec_decode: SpecDecode
) -> tuple[set[int], DraftRule]:
    groups = result.groups
    draft_layers = {name for name, spec in result.specs.items() if spec.is_draft}
    if draft_layers:
        flagged = {g.group_id for g in groups if draft_layers.intersection(g.layer_names)}
        if flagged:
            return flagged, DraftRule.IS_DRAFT
    if not result.positional_rules_apply:
        return set(), DraftRule.NONE

    candidates = groups[: result.annotated_group_count]
    marked = {
        group.group_id
        for group in candidates
        if any(
            isinstance(spec, MLAAttentionSpec) and spec.non_causal_multi_token_decode
            for spec in layer_specs_of(group.spec)
        )
    }
    if marked:
        return marked, DraftRule.SPEC_MARKER

    names = list(result.annotation_specs)
    # The exact-partition guard: dropped, duplicated or foreign layers make
    # "the last registered layer" meaningless.
    if (
        spec_decode.uses_trailing_draft_layers
        and names
        and _groups_partition_exactly(candidates, names)
    ):
        last_layer = names[-1]
        for group in candidates:
            if last_layer in group.layer_names:
                return {group.group_id}, DraftRule.TRAILING_LAYER
    return set(), DraftRule.NONE


def annotate_draft_groups(
    result: GroupingResult, spec_decode: SpecDecode
) -> tuple[list[KVCacheGroup], list[PlanWarning]]:
    """Flag the drafter's groups; warn when spec decode is on and none is found."""
    if not spec_decode.block_drop_enabled:
        return result.groups, []
    flagged, rule = _find_draft_groups(result, spec_decode)
    groups = [
        replace(group, is_draft=True, draft_rule=rule) if group.group_id in flagged else group
        for group in result.groups
    ]
    if flagged:
        return groups, []
    method = spec_decode.method
    mamba_groups = [
        group.group_id
        for group in groups
        if any(isinstance(spec, MambaSpec) for spec in layer_specs_of(group.spec))
    ]
    if mamba_groups:
        return groups, [
            PlanWarning(
                WarningCode.NO_DRAFT_GROUP_MAMBA,
                f"Speculative decoding (method={method}) is enabled but no KV cache group "
                "could be identified as the draft model's. Consumers will then treat every "
                f"group, Mamba groups {mamba_groups} included, as a draft group, which "
                "disables cross-request prefix reuse; mark the drafter's layers is_draft.",
            )
        ]
    if len(groups) > 1:
        return groups, [
            PlanWarning(
                WarningCode.NO_DRAFT_GROUP,
                f"Speculative decoding (method={method}) is enabled but no KV cache group "
                "could be identified as the draft model's; every group will take the EAGLE "
                "last-block drop. Mark the drafter's layers is_draft.",
            )
        ]
    return groups, []
