"""The offline CLI on the shipped examples; expected figures from the formulas."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format

from kvplan.cli import main
from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.v1 import plan_pb2

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
GIB = 1 << 30
H100 = GPU_MEMORY_BYTES["H100-80GB"]  # the catalog's one figure for the name
H200 = GPU_MEMORY_BYTES["H200-141GB"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_json(name: str, capsys: pytest.CaptureFixture[str], *extra: str) -> plan_pb2.PlanResponse:
    assert main(["plan", str(EXAMPLES / name), "--json", *extra]) == 0
    return json_format.ParseDict(json.loads(capsys.readouterr().out), plan_pb2.PlanResponse())


def test_llama(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json("llama-3.1-8b.yaml", capsys)
    available = math.ceil(H100 * 0.9) - (16_060_522_496 + GIB + GIB // 2)
    blocks = available // (32 * 65_536)
    assert plan.num_blocks == blocks == 28_275
    worker = plan.workers[0]
    assert worker.budget.available_bytes == available
    assert worker.kv_cache_size_tokens == int(blocks / (32_768 // 16) * 32_768)
    assert len(plan.groups) == 1 and not plan.groups[0].is_draft


def test_gemma(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json("gemma-3-27b.yaml", capsys)
    assert [len(g.layer_names) for g in plan.groups] == [9, 9, 9, 9, 8, 8, 10]
    page = 16 * 16 * 256 * 2
    available = math.ceil(H100 * 0.9) - (54_800_000_000 + 2 * GIB + GIB // 2)
    assert plan.num_blocks == available // (10 * page)
    per_request = 6 * (cdiv(1023 + 8192, 16) + 1) + 131_072 // 16
    assert plan.workers[0].blocks_per_request == per_request
    assert plan.workers[0].max_concurrency == pytest.approx(plan.num_blocks / per_request)


def test_gpt_oss_eagle3_flags_the_draft_group(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json("gpt-oss-20b-eagle3.yaml", capsys)
    assert [len(g.layer_names) for g in plan.groups] == [12, 13]
    assert [g.is_draft for g in plan.groups] == [False, True]
    assert plan.groups[1].draft_rule == plan_pb2.DRAFT_RULE_IS_DRAFT
    assert plan.groups[0].padding_layers == 1
    available = math.ceil(H100 * 0.9) - (13_761_264_768 + 2 * GIB + GIB // 2)
    assert plan.num_blocks == available // (13 * 8 * 16 * 128 * 2)


def test_qwen3_next_mtp_group_found_by_trailing_rule(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json("qwen3-next-80b-a3b-mtp.yaml", capsys)
    assert [len(g.layer_names) for g in plan.groups] == [12, 12, 12, 13]
    assert [g.is_draft for g in plan.groups] == [False, False, False, True]
    assert plan.groups[3].draft_rule == plan_pb2.DRAFT_RULE_TRAILING_LAYER
    assert "mtp.layers.0.self_attn.attn" in plan.groups[3].layer_names
    page = 4 * 2048 * 2 + 8 * 128 * 128 * 4
    assert {g.page_size_bytes for g in plan.groups} == {page} == {528 * 1024}
    available = math.ceil(H100 * 0.9) - (40_000_000_000 + 2 * GIB + GIB)
    assert plan.num_blocks == available // (13 * page)
    # align mode, 1 speculative block: 3 pages per Mamba group + the attention table.
    assert plan.workers[0].blocks_per_request == 3 * 3 + cdiv(262_144, 528)
    assert len(plan.workers) == 4 and len({w.num_blocks for w in plan.workers}) == 1
    codes = [w.code for w in plan.diagnostics.warnings]
    assert plan_pb2.WARNING_CODE_NO_DRAFT_GROUP_MAMBA not in codes


def test_deepseek_v3_mtp(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json("deepseek-v3-mtp.yaml", capsys)
    (group,) = plan.groups
    assert len(group.layer_names) == 62 and group.page_size_bytes == 64 * 576 * 2
    assert group.is_draft and group.draft_rule == plan_pb2.DRAFT_RULE_IS_DRAFT
    available = math.ceil(H200 * 0.9) - (86_000_000_000 + 4 * GIB + GIB)
    assert plan.num_blocks == available // (62 * 73_728)
    assert all(w.kv_tp_replicas == 8 for w in plan.workers)


def test_jamba(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json("jamba-mini.yaml", capsys)
    assert [len(g.layer_names) for g in plan.groups] == [4] * 8
    assert {g.page_size_bytes for g in plan.groups} == {327_680}
    available = math.ceil(H200 * 0.95) - (103_200_000_000 + 4 * GIB + GIB)
    assert plan.num_blocks == available // (4 * 327_680)


def test_pipeline_two_stages(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json("pipeline-2-stage.yaml", capsys)
    assert plan.num_blocks == 30 * GIB // (16 * 65_536)
    assert [w.tensors[0].size_bytes for w in plan.workers] == [30 * GIB, 30 * GIB]
    assert plan.workers[0].max_concurrency == pytest.approx(30_720 / 8192)


def test_report_and_subprocess() -> None:
    binary = Path(sys.executable).parent / "kvplan"
    result = subprocess.run(
        [str(binary), "plan", str(EXAMPLES / "gemma-3-27b.yaml")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "grouping path: hybrid" in result.stdout
    assert "Add 8 padding layers" in result.stdout
    assert "max concurrency" in result.stdout


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`kvplan plan ... | head -1`: the pipe closes before the report is written
    (`true` reads nothing and is gone long before kvplan has planned)."""
    binary = Path(sys.executable).parent / "kvplan"
    result = subprocess.run(
        f"'{binary}' plan '{EXAMPLES / 'gemma-3-27b.yaml'}' | true",
        shell=True,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
    assert result.stderr == ""


def test_gpu_flag_sets_total_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = {
        "options": {"max_model_len": 8192},
        "workers": [
            {
                "rank": 0,
                "memory": {"gpu_memory_utilization": 0.5},
                "layers": [
                    {
                        "name": "l0",
                        "full_attention": {"attention": {"num_kv_heads": 8, "head_size": 128}},
                    }
                ],
            }
        ],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(request))
    assert main(["plan", str(path), "--json", "--gpu-memory", str(10 * GIB)]) == 0
    plan = json_format.ParseDict(json.loads(capsys.readouterr().out), plan_pb2.PlanResponse())
    assert plan.num_blocks == 5 * GIB // 65_536
    assert main(["plan", str(path), "--json", "--gpu", "A100-40GB"]) == 0
    plan = json_format.ParseDict(json.loads(capsys.readouterr().out), plan_pb2.PlanResponse())
    assert plan.num_blocks == math.ceil(GPU_MEMORY_BYTES["A100-40GB"] * 0.5) // 65_536


@pytest.mark.parametrize(
    ("content", "suffix", "code", "message"),
    [
        ("{not json", ".json", 2, "not valid JSON"),
        ("a: [1, 2", ".yaml", 2, "not valid YAML"),
        ('{"workers": [{"rank": "zero"}]}', ".json", 2, "rank"),
        ('{"bogus": 1}', ".json", 2, "bogus"),
        (
            '{"options": {"max_model_len": 8192}, "workers": [{"rank": 0, "memory":'
            ' {"kv_cache_memory_bytes": 1073741824}, "layers": [{"name": "x", "full_attention":'
            ' {"attention": {"num_kv_heads": 0, "head_size": 128}}}]}]}',
            ".json",
            2,
            "workers[0].layers[0].full_attention.attention.num_kv_heads",
        ),
        (
            '{"options": {"max_model_len": 8192}, "workers": [{"rank": 0, "memory":'
            ' {"kv_cache_memory_bytes": 1024}, "layers": [{"name": "x", "full_attention":'
            ' {"attention": {"num_kv_heads": 8, "head_size": 128}}}]}]}',
            ".json",
            4,
            "No available memory",
        ),
    ],
)
def test_bad_input(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    suffix: str,
    code: int,
    message: str,
) -> None:
    path = tmp_path / f"request{suffix}"
    path.write_text(content)
    assert main(["plan", str(path)]) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "/nonexistent/request.yaml"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_engine_version_flag_picks_the_release_rules(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM 0.32 flags the MTP group by its trailing layer; 0.33 flags only is_draft
    # layers (none here) and warns about the unflagged Mamba groups.
    plan_032 = plan_json("qwen3-next-80b-a3b-mtp.yaml", capsys, "--engine-version", "vllm-0.32")
    assert plan_032.rule_set == "vllm-0.32"
    assert [g.is_draft for g in plan_032.groups] == [False, False, False, True]
    plan_033 = plan_json("qwen3-next-80b-a3b-mtp.yaml", capsys, "--engine-version", "vllm-0.33")
    assert plan_033.rule_set == "vllm-0.33"
    assert not any(g.is_draft for g in plan_033.groups)
    codes = [w.code for w in plan_033.diagnostics.warnings]
    assert plan_pb2.WARNING_CODE_NO_DRAFT_GROUP_MAMBA in codes
    assert main(["plan", str(EXAMPLES / "llama-3.1-8b.yaml"), "--engine-version", "x"]) == 2
