"""Draft-group annotation: which groups hold the drafter's (EAGLE/MTP) layers.

The rule comes from the request's rule set (`kvplan.core.rules.DraftFlagRule`):

* IS_DRAFT_ONLY (vLLM 0.33 / 0.34): the groups holding a layer marked
  `is_draft`, on every grouping path.
* SPEC_MARKER_AND_TRAILING (vLLM 0.32, PR #55390 as shipped), packed and hybrid
  paths only: groups with a layer carrying the spec marker
  `non_causal_multi_token_decode`, and also, for MTP (or a DeepSeek-V4 / V4.1
  target with any EAGLE-family method), the group holding the last registered
  layer when the groups partition the layers exactly.
* IS_DRAFT_THEN_POSITIONAL (kvplan's own): `is_draft` first, on every path;
  when no layer is marked, the spec marker, else the trailing layer (packed and
  hybrid paths; the first rule that finds a group decides).

The gate (which methods take the last-block drop) and the warning for an
unflagged Mamba group also come from the rule set.
"""

from __future__ import annotations

from dataclasses import replace

from kvplan.core.diagnostics import PlanWarning, WarningCode
from kvplan.core.grouping import GroupingResult
from kvplan.core.groups import DraftRule, KVCacheGroup
from kvplan.core.request import SpecDecode
from kvplan.core.rules import KVPLAN, DraftFlagRule, RuleSet
from kvplan.core.specs import MambaSpec, layer_specs_of


def _groups_partition_exactly(groups: list[KVCacheGroup], names: list[str]) -> bool:
    grouped = [name for group in groups for name in group.layer_names]
    return len(grouped) == len(names) and set(grouped) == set(names)


def _is_draft_groups(result: GroupingResult) -> set[int]:
    draft_layers = {name for name, spec in result.specs.items() if spec.is_draft}
    if not draft_layers:
        return set()
    return {g.group_id for g in result.groups if draft_layers.intersection(g.layer_names)}


def _spec_marker_groups(result: GroupingResult) -> set[int]:
    return {
        group.group_id
        for group in result.annotated_groups
        if any(
            getattr(spec, "non_causal_multi_token_decode", False)
            for spec in layer_specs_of(group.spec)
        )
    }


def _trailing_layer_groups(result: GroupingResult, spec_decode: SpecDecode) -> set[int]:
    candidates = result.annotated_groups
    names = list(result.annotation_specs)
    # The exact-partition guard: dropped, duplicated or foreign layers make
    # "the last registered layer" meaningless.
    if not (
        spec_decode.uses_trailing_draft_layers
        and names
        and _groups_partition_exactly(candidates, names)
    ):
        return set()
    last_layer = names[-1]
    return {next(g.group_id for g in candidates if last_layer in g.layer_names)}


def _find_draft_groups(
    result: GroupingResult, spec_decode: SpecDecode, rule: DraftFlagRule
) -> dict[int, DraftRule]:
    """Flagged group ids and the rule that flagged each."""
    if rule is not DraftFlagRule.SPEC_MARKER_AND_TRAILING:
        flagged = _is_draft_groups(result)
        if flagged or rule is DraftFlagRule.IS_DRAFT_ONLY:
            return dict.fromkeys(flagged, DraftRule.IS_DRAFT)
    if not result.positional_rules_apply:
        return {}
    marked = dict.fromkeys(_spec_marker_groups(result), DraftRule.SPEC_MARKER)
    if marked and rule is DraftFlagRule.IS_DRAFT_THEN_POSITIONAL:
        return marked
    trailing = dict.fromkeys(_trailing_layer_groups(result, spec_decode), DraftRule.TRAILING_LAYER)
    return {**trailing, **marked}


def annotate_draft_groups(
    result: GroupingResult, spec_decode: SpecDecode, rules: RuleSet = KVPLAN
) -> tuple[list[KVCacheGroup], list[PlanWarning]]:
    """Flag the drafter's groups; warn when spec decode is on and none is found."""
    flagged: dict[int, DraftRule] = {}
    if spec_decode.block_drop_enabled(rules):
        flagged = _find_draft_groups(result, spec_decode, rules.draft_rule)
    groups = [
        replace(group, is_draft=True, draft_rule=flagged[group.group_id])
        if group.group_id in flagged
        else group
        for group in result.groups
    ]
    if flagged or not spec_decode.warns_unflagged(rules):
        return groups, []
    if rules.draft_rule is DraftFlagRule.SPEC_MARKER_AND_TRAILING and not (
        result.positional_rules_apply
    ):
        return groups, []  # the annotator (and its warning) runs on packed / hybrid only
    method = spec_decode.method
    # The packed path warns over its packed groups only (not the hidden-state ones).
    start = result.annotated_group_start
    warned_over = groups[start : start + result.annotated_group_count]
    mamba_groups = [
        group.group_id
        for group in warned_over
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
    if len(groups) > 1 and rules.warns_unflagged_without_mamba:
        return groups, [
            PlanWarning(
                WarningCode.NO_DRAFT_GROUP,
                f"Speculative decoding (method={method}) is enabled but no KV cache group "
                "could be identified as the draft model's; every group will take the EAGLE "
                "last-block drop. Mark the drafter's layers is_draft.",
            )
        ]
    return groups, []
