"""Conformance scenarios: wire-format requests through the converter and the
planner, checked against the figures the reference predicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from kvplan.convert import plan_from_proto
from kvplan.core.errors import PlanningError
from kvplan.v1 import plan_pb2
from tests.conformance import build

# By number: past 99 scenarios the names no longer sort as text does.
SCENARIOS = sorted(build.SCENARIO_DIR.glob("*.json"), key=lambda p: int(p.stem.split("-")[0]))
Json = dict[str, Any]


def test_scenario_files_are_current() -> None:
    """The committed files are exactly what build.py writes."""
    assert len(SCENARIOS) == len(build.SCENARIOS) >= 40
    for path, item in zip(SCENARIOS, build.SCENARIOS, strict=True):
        assert json.loads(path.read_text()) == json.loads(json.dumps(item)), path.name


def _enum_name(message: Any, field: str) -> str:
    descriptor = message.DESCRIPTOR.fields_by_name[field].enum_type
    return str(descriptor.values_by_number[getattr(message, field)].name)


def _check_group(group: plan_pb2.KVCacheGroup, expect: Json) -> None:
    spec_kind = group.spec.WhichOneof("kind")
    spec = getattr(group.spec, spec_kind) if spec_kind else None
    for key, value in expect.items():
        if key == "layers":
            assert len(group.layer_names) == value
        elif key == "draft_rule":
            assert _enum_name(group, "draft_rule") == value
        elif key == "spec_padded_bytes":
            assert spec is not None and spec.attention.page_size_padded_bytes == value
        elif key == "spec_sliding_window":
            assert spec is not None and spec.sliding_window == value
        else:
            assert getattr(group, key) == value, key


def _check_worker(worker: plan_pb2.WorkerPlan, expect: Json) -> None:
    for key, value in expect.items():
        if key == "tensors":
            assert len(worker.tensors) == len(value)
            for tensor, tensor_expect in zip(worker.tensors, value, strict=True):
                for tensor_key, tensor_value in tensor_expect.items():
                    if tensor_key == "layers":
                        assert len(tensor.layer_names) == tensor_value
                    else:
                        assert getattr(tensor, tensor_key) == tensor_value, tensor_key
        elif key == "budget":
            for budget_key, budget_value in value.items():
                if budget_key == "mode":
                    assert _enum_name(worker.budget, "mode") == budget_value
                else:
                    assert getattr(worker.budget, budget_key) == budget_value, budget_key
        elif key == "encoder_only_layers":
            assert list(worker.encoder_only_layers) == value
        else:
            assert getattr(worker, key) == value, key


def _check_plan(response: plan_pb2.PlanResponse, expect: Json) -> None:
    diagnostics = response.diagnostics
    warnings = [(_enum_name(w, "code"), w.message) for w in diagnostics.warnings]
    flagged = [group for group in response.groups if group.is_draft]
    first_worker = response.workers[0]
    for key, value in expect.items():
        if key == "rule_set":
            assert response.rule_set == value
        elif key == "grouping_path":
            assert _enum_name(diagnostics, "grouping_path") == value
        elif key == "layout":
            assert _enum_name(diagnostics, "kv_cache_layout") == f"KV_CACHE_LAYOUT_{value}"
        elif key == "layout_candidates":
            names = [plan_pb2.KVCacheLayout.Name(x) for x in diagnostics.layout_candidates]
            assert names == [f"KV_CACHE_LAYOUT_{name}" for name in value]
        elif key in ("page_sizes_unified", "local_attention_promoted"):
            assert getattr(diagnostics, key) == value
        elif key in ("num_blocks", "max_model_len", "hisparse_host_num_blocks"):
            assert getattr(response, key) == value, key
        elif key in ("kv_cache_size_tokens", "blocks_per_request"):
            assert getattr(first_worker, key) == value, key
        elif key == "max_concurrency":
            assert first_worker.max_concurrency == pytest.approx(value, rel=1e-12)
        elif key == "groups":
            assert len(response.groups) == len(value)
            for group, group_expect in zip(response.groups, value, strict=True):
                _check_group(group, group_expect)
        elif key == "group_layer_names":
            for index, names in value.items():
                assert list(response.groups[int(index)].layer_names) == names
        elif key == "group_block_sizes":
            for index, block_size in value.items():
                assert response.groups[int(index)].block_size == block_size
        elif key == "workers":
            for worker, worker_expect in zip(response.workers, value, strict=False):
                _check_worker(worker, worker_expect)
        elif key == "warnings":
            codes = {code for code, _ in warnings}
            assert set(value) <= codes, (value, warnings)
        elif key == "warnings_absent":
            codes = {code for code, _ in warnings}
            assert not set(value) & codes, (value, warnings)
        elif key == "warning_text":
            for text in value:
                assert any(text in message for _, message in warnings), (text, warnings)
        elif key == "flagged_groups":
            assert len(flagged) == value
        elif key == "flagged_contains":
            assert any(value in group.layer_names for group in flagged)
        elif key == "draft_rule":
            assert flagged and all(_enum_name(g, "draft_rule") == value for g in flagged)
        elif key == "projected":
            for index, groups in value.items():
                seen = [list(g.layer_names) for g in response.workers[int(index)].groups]
                assert seen == groups
        elif key == "projected_draft":
            for index, flags in value.items():
                assert [g.is_draft for g in response.workers[int(index)].groups] == flags
        else:
            raise AssertionError(f"unknown expectation {key!r}")


@pytest.mark.parametrize("path", SCENARIOS, ids=[path.stem for path in SCENARIOS])
def test_scenario(path: Path) -> None:
    item = json.loads(path.read_text())
    request = json_format.ParseDict(item["request"], plan_pb2.PlanRequest())
    expect = item["expect"]
    if "error" in expect:
        with pytest.raises(PlanningError) as caught:
            plan_from_proto(request)
        error = expect["error"]
        assert caught.value.code == error["code"], caught.value.message
        for text in error.get("contains", []):
            assert text in caught.value.message, (text, caught.value.message)
        if "field" in error:
            assert caught.value.field == error["field"]
        return
    _check_plan(plan_from_proto(request), expect)
