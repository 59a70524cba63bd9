"""The offline CLI on the shipped examples; expected figures from the formulas."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    assert plan.num_blocks == blocks == 28_064
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


# --- vLLM's flag names (kvplan plan --model / capacity) -------------------------------

MODELS = EXAMPLES / "models"


def model_plan(
    capsys: pytest.CaptureFixture[str], model: str, *flags: str, gpu: str = "H100"
) -> dict[str, Any]:
    args = ["plan", "--model", str(MODELS / model), "--gpu", gpu, "--json", *flags]
    assert main(args) == 0, capsys.readouterr().err
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_vllm_flag_names_and_the_short_forms_plan_alike(
    capsys: pytest.CaptureFixture[str],
) -> None:
    length = ["--max-model-len", "8K"]
    plans = [
        model_plan(capsys, "llama-3.1-8b", *length, *flags)
        for flags in (["--tensor-parallel-size", "2"], ["-tp", "2"], ["--tp", "2"])
    ]
    assert len({json.dumps(plan["capacity"], sort_keys=True) for plan in plans}) == 1
    assert len(plans[0]["workers"]) == 2
    staged = model_plan(capsys, "llama-3.1-8b", *length, "--pipeline-parallel-size", "2")
    assert staged == model_plan(capsys, "llama-3.1-8b", *length, "-pp", "2")
    assert len(staged["workers"]) == 2
    mtp = ["--max-model-len", "8K", "-tp", "8"]
    config = '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'
    by_json = model_plan(capsys, "deepseek-v3", *mtp, "--speculative-config", config, gpu="H200")
    short = model_plan(capsys, "deepseek-v3", *mtp, "--speculative", "mtp:1", gpu="H200")
    assert by_json["capacity"] == short["capacity"]
    assert any(group.get("is_draft") for group in by_json["groups"])


def test_vllm_memory_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--max-model-len", "8K"]
    fixed = model_plan(capsys, "llama-3.1-8b", *base, "--kv-cache-memory-bytes", "10GiB")
    assert int(fixed["workers"][0]["budget"]["available_bytes"]) == 10 * GIB
    blocks = model_plan(capsys, "llama-3.1-8b", *base, "--num-gpu-blocks-override", "1000")
    assert int(blocks["num_blocks"]) == 1000
    half = model_plan(capsys, "llama-3.1-8b", *base, "--gpu-memory-utilization", "0.5")
    assert int(half["workers"][0]["budget"]["requested_bytes"]) == math.ceil(H100 * 0.5)
    fp8 = model_plan(capsys, "llama-3.1-8b", *base, "--kv-cache-dtype", "fp8")
    plain = model_plan(capsys, "llama-3.1-8b", *base)
    assert fp8["capacity"]["kv_bytes_per_token"] * 2 == plain["capacity"]["kv_bytes_per_token"]
    # --max-num-seqs sizes the sampler's logits, the peak once the forward pass is
    # short (256 tokens: 27 MiB of forward against 256 x 128,256 x 4 B of logits; vLLM
    # wants max_num_batched_tokens >= max_num_seqs).
    short = ["--max-num-batched-tokens", "256"]
    few = model_plan(capsys, "llama-3.1-8b", *base, *short, "--max-num-seqs", "8")
    many = model_plan(capsys, "llama-3.1-8b", *base, *short, "--max-num-seqs", "256")
    assert int(few["workers"][0]["budget"]["non_kv_bytes"]) < int(
        many["workers"][0]["budget"]["non_kv_bytes"]
    )
    tokens = model_plan(capsys, "llama-3.1-8b", *base, "--max-num-batched-tokens", "2K")
    assert int(tokens["workers"][0]["budget"]["non_kv_bytes"]) < int(
        plain["workers"][0]["budget"]["non_kv_bytes"]
    )
    block = model_plan(capsys, "llama-3.1-8b", *base, "--block-size", "32")
    assert block["groups"][0]["block_size"] == 32


def test_vllm_dtype_quantization_and_prefix_caching_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--max-model-len", "8K"]
    plain = model_plan(capsys, "llama-3.1-8b", *base)
    weights = int(plain["workers"][0]["budget"]["non_kv_bytes"])
    online = model_plan(capsys, "llama-3.1-8b", *base, "--quantization", "fp8")
    # fp8 on load: the 7.0B non-embedding parameters drop from 2 bytes to 1.
    saved = weights - int(online["workers"][0]["budget"]["non_kv_bytes"])
    assert abs(saved - (8_029_995_008 - 2 * 128_256 * 4096)) < 2**20
    assert (
        model_plan(capsys, "llama-3.1-8b", *base, "--dtype", "float16")["capacity"]
        == (plain["capacity"])
    )  # bf16 and fp16 are the same size
    wide = model_plan(capsys, "llama-3.1-8b", *base, "--dtype", "float32")
    assert wide["capacity"]["kv_bytes_per_token"] == 2 * plain["capacity"]["kv_bytes_per_token"]
    args = ["plan", "--model", str(MODELS / "deepseek-v3"), "--gpu", "H200", "-tp", "8"]
    assert main([*args, "--quantization", "awq"]) == 2
    assert "does not match the checkpoint's 'fp8'" in capsys.readouterr().err
    hybrid = ["--max-model-len", "8K"]
    on = model_plan(capsys, "nemotron-3-nano-30b-a3b", *hybrid, "--enable-prefix-caching")
    off = model_plan(capsys, "nemotron-3-nano-30b-a3b", *hybrid, "--no-enable-prefix-caching")
    short = model_plan(capsys, "nemotron-3-nano-30b-a3b", *hybrid, "--no-prefix-caching")
    shown = model_plan(capsys, "nemotron-3-nano-30b-a3b", *hybrid, "--disable-prefix-caching")
    assert off == short == shown and off["capacity"] != on["capacity"]
    # vLLM's own short forms: -q (quantization), -sc (speculative config)
    assert model_plan(capsys, "llama-3.1-8b", *base, "-q", "fp8") == online
    mtp = ["--max-model-len", "8K", "-tp", "8", "--speculative-config"]
    config = '{"method": "mtp", "num_speculative_tokens": 1}'
    by_short = model_plan(capsys, "deepseek-v3", *mtp[:-1], "-sc", config, gpu="H200")
    assert by_short == model_plan(capsys, "deepseek-v3", *mtp, config, gpu="H200")


def test_nothing_beside_a_request_file_is_silently_ignored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    request = str(EXAMPLES / "llama-3.1-8b.yaml")
    assert main(["plan", request, "--tp", "2", "--max-model-len", "8K"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size, --max-model-len apply to --model only" in err
    assert main(["plan", request, "--model", str(MODELS / "llama-3.1-8b")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["plan", request, "--no-enable-prefix-caching"]) == 2
    assert "--enable-prefix-caching" in capsys.readouterr().err
    assert main(["plan", request, "--gpu", "H200", "--json"]) == 0  # these do apply
    capsys.readouterr()
    both = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H200"]
    assert main([*both, "--gpu-memory", "80GiB"]) == 2  # --gpu would be dropped
    assert "not both" in capsys.readouterr().err


def test_capacity_sweeps_max_model_len(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["capacity", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100", "--tp", "1,2"]
    assert main([*args, "--max-model-len", "8K,32K,auto", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["tp"], row["requested_max_model_len"]) for row in rows] == [
        (tp, length) for tp in (1, 2) for length in (8192, 32768, -1)
    ]
    assert [row["max_model_len"] for row in rows[:2]] == [8192, 32768]
    # auto: the length it chose, the longest the budget holds (the 8k row's auto-fit)
    assert rows[2]["max_model_len"] == rows[0]["auto_fit_max_model_len"]


def test_auto_shows_the_length_it_chose(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--max-model-len", "auto"]
    assert main(args) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"max_model_len auto: chose ([0-9,]+) tokens", out)
    assert chosen is not None
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert int(chosen.group(1).replace(",", "")) == int(plan["max_model_len"]) < 40_960


def test_commands_that_talk_to_a_server_list_tls_and_token_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("plan", "health"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        for flag in ("--tls", "--tls-ca", "--client-cert", "--client-key", "--token-file"):
            assert flag in out, (command, flag)
    request = str(EXAMPLES / "llama-3.1-8b.yaml")
    assert main(["plan", request, "--target", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "no kvplan server answered at 127.0.0.1:1 " in err
    missing = ["--tls-ca", "/nonexistent/ca.pem"]
    assert main(["plan", request, "--target", "127.0.0.1:1", *missing]) == 2
    assert "KVPLAN_TLS_CA=/nonexistent/ca.pem" in capsys.readouterr().err


def test_plan_prints_the_prefix_cache_line_and_answers_a_shared_prefix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", str(EXAMPLES / "qwen3-next-80b-a3b-mtp.yaml"), "--engine-version"]
    assert main([*argv, "vllm-0.32", "--shared-prefix", "4,000"]) == 0
    out = capsys.readouterr().out
    assert (
        "prefix cache: hits in 528-token units; a prompt sent again hits only from 1,056 tokens; "
        "the drafter's groups drop the last matched block (528 tokens)"
    ) in out
    assert "shared prefix of 4,000 tokens: 3,168 served from cache" in out
    # 0.33: nothing for the first request after a longer stored one, 3,696 (the
    # first's junction) for the next one.
    assert main([*argv, "vllm-0.33", "--shared-prefix", "4000"]) == 0
    assert (
        "after one that went on with other text, first request: 0 of 4,000 tokens from "
        "cache; the next one: 3,696"
    ) in capsys.readouterr().out
    plan = plan_json("qwen3-next-80b-a3b-mtp.yaml", capsys, "--shared-prefix", "1000")
    assert plan.diagnostics.prefix_cache.what_if.shared_prefix_tokens == 1000


def test_plan_says_where_a_shared_prefix_of_a_longer_stored_prompt_hits_lower(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Jamba: an 80-token prompt sent again keeps its Mamba state at 0 and misses;
    80 shared tokens of an 81-token prompt hit 80 (PrefixCacheDiagnostics
    .min_any_hit_prefix_tokens)."""
    assert main(["plan", str(EXAMPLES / "jamba-mini.yaml")]) == 0
    assert (
        "prefix cache: hits in 80-token units; a prompt sent again hits only from 81 tokens; "
        "a shared prefix of a longer stored prompt from 80"
    ) in capsys.readouterr().out
    pc = plan_json("jamba-mini.yaml", capsys).diagnostics.prefix_cache
    assert (pc.min_shared_prefix_tokens, pc.min_any_hit_prefix_tokens) == (81, 80)
    assert pc.min_any_hit_stored_tokens == 81


def test_a_budget_below_the_non_kv_memory_is_said_in_positive_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 90% of 80 GiB = 72 GiB usable, 100 GiB of weights: 28 GiB plus the null block short.
    request = {
        "options": {"max_model_len": 8192},
        "workers": [
            {
                "rank": 0,
                "device": {"total_memory_bytes": 80 * 2**30},
                "memory": {"gpu_memory_utilization": 0.9, "non_kv": {"weights_bytes": 100 * 2**30}},
                "layers": [
                    {
                        "name": "x",
                        "full_attention": {"attention": {"num_kv_heads": 8, "head_size": 128}},
                    }
                ],
            }
        ],
    }
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request))
    assert main(["plan", str(path)]) == 4
    err = capsys.readouterr().err
    assert "No available memory for the cache blocks on worker rank 0" in err
    assert re.search(r"(^|[\s(])-\d", err) is None  # no negative byte count
    # 28 GiB short, plus one 16-token block of 8 heads x 128 x 2 (K, V) x 2 B = 64 KiB
    assert f"falls {28 * 2**30 + 65_536:,} bytes (28.0 GiB) short of one block" in err


def _flags_of(parser_args: list[str]) -> set[str]:
    """Every option string of the kvplan subcommand `parser_args[0]`."""
    from kvplan.cli import build_parser

    subparsers: Any = build_parser()._subparsers
    command = subparsers._group_actions[0].choices[parser_args[0]]
    return {flag for action in command._actions for flag in action.option_strings}


def test_does_not_fit_says_where_memory_went_and_advice_works_as_typed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Qwen3-8B at 32k on one L4: the non-KV estimate leaves less than one 32k request's
    # 4.50 GiB (36 layers x 8 KV heads x 128 x 2 x 2 B x 32,768 tokens).
    args = ["plan", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--max-model-len", "32K"]
    assert main(args) == 4
    err = capsys.readouterr().err
    assert re.search(r"(^|[\s(])-\d", err) is None  # no negative byte count
    went = re.search(
        r"= ([\d.]+) GiB usable\n  weights ([\d.]+) GiB \+ activation peak ([\d.]+) GiB"
        r" \+ CUDA graphs ([\d.]+) GiB \+ runtime ([\d.]+) GiB \(estimated\) = ([\d.]+) GiB"
        r" non-KV\n"
        r"  ([\d.]+) GiB left for the KV cache, less than the 4\.50 GiB one request",
        err,
    )
    assert went is not None, err
    usable, weights, activation, graphs, runtime, non_kv, left = map(float, went.groups())
    # 8.19B bf16 parameters, checked against the published count, and the RoPE cache
    assert weights == 15.27
    # The parts add up (each printed to 0.01 GiB) and the shortfall is real.
    assert abs(weights + activation + graphs + runtime - non_kv) <= 0.02
    assert abs(usable - non_kv - left) <= 0.015 and 0 < left < 4.5
    # The smallest catalog GPUs first, the rest counted.
    assert "fits at this TP on: RTX-4090-24GB, RTX-3090-24GB, A100-40GB, L40S-48GB and " in err
    # Every flag the answer names is one of this command's, and each advice runs as typed.
    named = set(re.findall(r"--[a-z][a-z-]+", err))
    assert named == {"--max-model-len", "--tensor-parallel-size"} <= _flags_of(["plan"])
    shorter = re.search(r"fits here with (--max-model-len \d+) or shorter", err)
    wider = re.search(r"fits from (--tensor-parallel-size \d+) on this GPU", err)
    assert shorter is not None and wider is not None
    assert main([*args[:-2], *shorter.group(1).split(), "--json"]) == 0
    assert main([*args, *wider.group(1).split(), "--json"]) == 0
    capsys.readouterr()


def test_capacity_length_sweep_names_each_point_and_the_auto_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["capacity", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4", "--tp", "1"]
    assert main([*args, "--max-model-len", "8K,32K,auto", "--price", "L4=0.8"]) == 0
    out = capsys.readouterr().out
    assert "L4-24GB tp=1 max_model_len 32,768: does not fit:" in out
    rows = {line.split()[2]: line for line in out.splitlines()[1:4]}
    assert set(rows) == {"8,192", "32,768", "auto:"}
    # auto shows the length it chose: the longest one request the budget holds.
    auto = re.search(r"auto: ([\d,]+) .* 1\.00x", rows["auto:"])
    assert auto is not None and 8_192 < int(auto.group(1).replace(",", "")) < 32_768
    assert "tokens per USD/h" in out.splitlines()[0] and "0.80" in rows["8,192"]
    named = set(re.findall(r"--[a-z][a-z-]+", out))
    assert named and named <= _flags_of(["capacity"])


def test_gpu_beside_a_request_file_that_sizes_every_device_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = {
        "options": {"max_model_len": 8192},
        "workers": [
            {
                "rank": 0,
                "device": {"total_memory_bytes": 80 * 2**30},
                "memory": {"gpu_memory_utilization": 0.9},
                "layers": [
                    {
                        "name": "x",
                        "full_attention": {"attention": {"num_kv_heads": 8, "head_size": 128}},
                    }
                ],
            }
        ],
    }
    path = tmp_path / "sized.json"
    path.write_text(json.dumps(request))
    for flags in (["--gpu", "H200"], ["--gpu-memory", "141GiB"]):
        assert main(["plan", str(path), *flags]) == 2
        err = capsys.readouterr().err
        assert f"{flags[0]} applies to workers without a device size" in err
    assert main(["plan", str(path), "--json"]) == 0
    capsys.readouterr()


def test_any_command_with_target_has_every_security_option() -> None:
    # Found by --target, not listed: a command that gains --target later is held too.
    from kvplan.cli import build_parser

    security = {"--tls", "--tls-ca", "--client-cert", "--client-key", "--tls-server-name"}
    security.add("--token-file")
    subparsers: Any = build_parser()._subparsers
    with_target = {
        name: {flag for action in command._actions for flag in action.option_strings}
        for name, command in subparsers._group_actions[0].choices.items()
        if any("--target" in action.option_strings for action in command._actions)
    }
    assert {"plan", "health"} <= set(with_target)
    for name, flags in with_target.items():
        assert security <= flags, f"kvplan {name} lacks {sorted(security - flags)}"


def test_does_not_fit_under_a_fixed_kv_budget_names_the_flag_that_set_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The device's share is not the budget here: the answer names what is, not the
    # 56 GiB an H100 would leave.
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100"]
    args += ["--max-model-len", "128K"]
    # 1 GiB at 131,072 B per token: 8,192 tokens less the null block's 16
    assert main([*args, "--kv-cache-memory-bytes", "1GiB"]) == 4
    err = capsys.readouterr().err
    assert "--kv-cache-memory-bytes sets the KV cache: 1.00 GiB per worker" in err
    assert "less than the 16.00 GiB one request" in err and "left for the KV cache" not in err
    assert "fits here with --max-model-len 8176 or shorter" in err
    assert main([*args[:-1], "8176", "--kv-cache-memory-bytes", "1GiB", "--json"]) == 0
    capsys.readouterr()
    assert main([*args, "--num-gpu-blocks-override", "100"]) == 4
    err = capsys.readouterr().err
    assert "--num-gpu-blocks-override 100 sets the pool: 99 usable blocks" in err
    assert "fits here with --max-model-len 1584 or shorter" in err  # 99 x 16 tokens
    assert main([*args, "--num-gpu-blocks-override", "1"]) == 4
    assert "0 usable blocks (one is the null block)" in capsys.readouterr().err


def test_plan_takes_the_mamba_junction_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--mamba-shared-prefix-checkpoint (vLLM's opt-in): the next request after the
    first one sharing 100 tokens hits the Mamba state kept at the junction (96).
    Without it the first request's chunk stops at the junction floored to the
    16-token cache block (96 too), so no state is written at the Mamba block's 64 in
    the default 8,192-token chunks, and the next one hits 0 (64 in 40-token chunks,
    which end at 64; vLLM 0.33's scheduler agrees: tests/test_scheduler_probe.py).
    64-token Mamba blocks, 16-token attention and hashes."""
    from conformance.generate import GIB, SMALL_STATES, W, full, mamba
    from conformance.generate import request as generated_request

    layers = [
        *[mamba(f"m.{i}", SMALL_STATES, block=64) for i in range(2)],
        full("f.0", 2, 256, block=16),
        full("mtp.layers.0.attn", 2, 256, block=16, draft=True),
    ]
    request = generated_request(W(layers, 4 * GIB), mamba_align=True, method="mtp")
    path = tmp_path / "mamba.json"
    path.write_text(json_format.MessageToJson(request))
    argv = ["plan", str(path), "--engine-version", "vllm-0.33", "--shared-prefix", "100"]
    assert main(argv) == 0
    assert "first request: 0 of 100 tokens from cache; the next one: 0" in capsys.readouterr().out
    request.options.max_num_batched_tokens = 40
    path.write_text(json_format.MessageToJson(request))
    assert main(argv) == 0
    assert "first request: 0 of 100 tokens from cache; the next one: 64" in capsys.readouterr().out
    assert main([*argv, "--mamba-shared-prefix-checkpoint"]) == 0
    assert "first request: 0 of 100 tokens from cache; the next one: 96" in capsys.readouterr().out
