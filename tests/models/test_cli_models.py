"""`kvplan plan --model` on every shipped config, and `kvplan capacity`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvplan.cli import main
from kvplan.gpus import CATALOG, lookup_gpu
from kvplan.models.cli import parse_fraction, parse_size, parse_tokens

MODELS = Path(__file__).parents[2] / "examples" / "models"
SHIPPED = sorted(path.name for path in MODELS.iterdir() if path.is_dir())


@pytest.mark.parametrize("model", SHIPPED)
def test_plan_every_shipped_config(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    length = 448 if model.startswith("whisper") else 4096  # Whisper's decoder: 448 positions
    args = ["plan", "--model", str(MODELS / model), "--gpu", "B200-180GB", "--tp", "2"]
    args += ["--max-model-len", str(length), "--gpu-memory-utilization", "90%"]
    args += ["--non-kv-bytes", "20GiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "capacity of" in out and "non-KV memory (given): 20.00 GiB" in out
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    budget = plan["workers"][0]["budget"]
    assert int(budget["non_kv_bytes"]) == 20 * 2**30
    assert int(budget["requested_bytes"]) == -(-lookup_gpu("B200").total_memory_bytes * 9 // 10)
    assert plan["capacity"]["max_model_len"] == length


def test_plan_llama_capacity_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    # H100 80GB: CUDA's 79.19 GiB; utilization 0.9; 20 GiB non-KV; 32 layers x 8 heads x 128 x
    # (K+V) x 2 B = 131,072 B per token = 2 MiB per 16-token block.
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100-80GB"]
    args += ["--max-model-len", "8K", "--gpu-memory-utilization", "0.9", "--non-kv-bytes", "20GiB"]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    available = -(-int(79.19 * 2**30) * 9 // 10) - 20 * 2**30
    blocks = available // (32 * 65_536)
    capacity = plan["capacity"]
    assert capacity["kv_bytes_per_token"] == 131_072
    assert capacity["num_blocks"] == blocks
    assert capacity["kv_cache_tokens"] == blocks * 16
    assert capacity["max_concurrency"] == pytest.approx(blocks / 512)


def test_estimated_non_kv_is_stated(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", str(MODELS / "deepseek-v3"), "--gpu", "H200", "--tp", "8"]
    assert main([*args, "--speculative", "mtp:1", "--max-model-len", "32K"]) == 0
    out = capsys.readouterr().out
    assert "weights:" in out and "fp8" in out and "activation_peak =" in out
    # 61 target MLA layers and the MTP layer share one (draft) group: 62 x 1,152 B
    assert "mla_attention (draft group: 1 drafter layer among them): 62 layers, " in out
    assert "62 layers, 71,424 B per token" in out


def test_a_point_that_does_not_fit_says_where_the_memory_went(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # DeepSeek V3 at TP 2 on H100s: ~313 GiB of fp8 weights per rank cannot fit.
    args = ["plan", "--model", str(MODELS / "deepseek-v3"), "--gpu", "H100", "--tp", "2"]
    assert main([*args, "--max-model-len", "4K"]) == 4
    err = capsys.readouterr().err
    assert "error: does not fit on H100-80GB at TP 2:" in err
    assert "weights 313." in err and "the non-KV memory alone exceeds it by" in err
    # Positive figures only, and only flags the command has.
    assert re.search(r"(^|[\s(])-\d", err) is None  # no negative byte count
    assert "kv_cache_memory_bytes" not in err and "gpu_memory_utilization" not in err
    # The smallest TP that fits, found by planning it (8 x H100 holds ~78 GiB per rank).
    assert "fits from --tensor-parallel-size 16 on this GPU" in err
    assert main([*args, "--tp", "16", "--max-model-len", "4K"]) == 0
    capsys.readouterr()
    sweep = ["capacity", "--model", str(MODELS / "deepseek-v3"), "--gpu", "H100"]
    assert main([*sweep, "--tp", "2", "--json", "--max-model-len", "4K"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["status"] == "does not fit" and row["non_kv_bytes_per_worker"] > 313 * 2**30
    assert row["fits_from_tp"] == 16 and row["max_model_len"] == 4096


def test_capacity_sweep_table_json_csv_chart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["capacity", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100-80GB,H200"]
    base += ["--tp", "1,2", "--max-model-len", "32K"]
    chart = tmp_path / "chart.svg"
    assert main([*base, "--chart", str(chart)]) == 0
    table = capsys.readouterr().out
    assert "H200-141GB" in table and "concurrency" in table
    assert "<svg" in chart.read_text() and "llama-3.1-8b" in chart.read_text()
    assert main([*base, "--chart", str(tmp_path / "chart.gif")]) == 2
    assert "name a .png, .svg, .pdf file" in capsys.readouterr().err
    assert main([*base, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["gpu"], row["tp"]) for row in rows] == [
        ("H100-80GB", 1), ("H100-80GB", 2), ("H200-141GB", 1), ("H200-141GB", 2)
    ]  # fmt: skip
    # more memory per worker, more tokens; TP 2 halves the weights and the per-token page
    assert rows[2]["kv_cache_tokens"] > rows[0]["kv_cache_tokens"]
    assert rows[1]["kv_bytes_per_token"] * 2 == rows[0]["kv_bytes_per_token"] == 131_072
    assert main([*base, "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpu,tp,") and len(lines) == 5


def test_capacity_accepts_sizes_for_unlisted_devices(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["capacity", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100,96GiB"]
    assert main([*args, "--tp", "1", "--max-model-len", "8K", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["gpu"] for row in rows] == ["H100-80GB", "96GiB"]
    assert rows[1]["kv_budget_bytes"] > rows[0]["kv_budget_bytes"]
    assert main([*args[:-1], "Z9", "--tp", "1"]) == 2
    assert "unknown GPU 'Z9'" in capsys.readouterr().err


def test_capacity_marks_rows_that_do_not_fit_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The sweep ran: rows that do not fit are marked, with what would fit; exit 0.
    args = ["capacity", "--model", str(MODELS / "qwen3-8b"), "--gpu", "L4,H100", "--tp", "1"]
    assert main([*args, "--max-model-len", "32K"]) == 0
    out = capsys.readouterr().out
    assert "L4-24GB tp=1: does not fit:" in out and "H100-80GB" in out
    # A config error is exit 2, as `plan` exits.
    assert main([*args, "--kv-cache-dtype", "int3"]) == 2


def test_bad_inputs_are_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", str(MODELS / "phi-4"), "--gpu", "H100", "--tp", "8"]) == 2
    assert "10 KV heads" in capsys.readouterr().err
    assert main(["plan", "--model", str(MODELS / "phi-4"), "--gpu", "X1"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


def test_max_model_len_beyond_the_model_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", str(MODELS / "phi-4"), "--gpu", "H100", "--max-model-len", "32K"]
    assert main(args) == 2
    assert "exceeds the model's maximum 16,384" in capsys.readouterr().err


def test_human_sizes() -> None:
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("81559MiB") == 81_559 * 2**20
    assert parse_size("24GB") == 24 * 10**9
    # vLLM's human_readable_int: lower case decimal, upper case binary
    assert parse_tokens("32K") == 32_768 and parse_tokens("auto") == -1
    assert parse_tokens("32k") == 32_000 and parse_tokens("25.6k") == 25_600
    assert parse_size("20G") == 20 * 2**30 and parse_size("20g") == 20 * 10**9
    assert parse_fraction("0.9") == parse_fraction("90%") == 0.9


def test_catalog_covers_the_data_centre_parts_with_sources() -> None:
    names = {gpu.name for gpu in CATALOG}
    for part in ("A100-80GB", "H100-80GB", "H100-NVL-94GB", "H200-141GB", "H20-96GB",
                 "GH200-96GB", "B200-180GB", "B300-288GB", "L40S-48GB", "L4-24GB",
                 "MI300X-192GB", "MI325X-256GB", "MI355X-288GB"):  # fmt: skip
        assert part in names
    assert all(gpu.source for gpu in CATALOG)
    # CUDA's total on an H200 (docs/gpu-check.md): nvidia-smi's 143,771 MiB less the
    # 644,939,776 B (615.06 MiB) the driver reserves.
    assert lookup_gpu("h200").total_memory_bytes == 143_771 * 2**20 - 644_939_776


def capacity_of(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["plan", "--model", *args, "--json"]) == 0
    capacity: dict[str, object] = json.loads(capsys.readouterr().out)["capacity"]
    return capacity


def test_docs_worked_examples(capsys: pytest.CaptureFixture[str]) -> None:
    # gpt-oss-120b TP 2: 18 sliding layers hold cdiv(128 - 1 + 8192, 16) + 1 = 521 blocks,
    # 18 full layers 2,048 blocks, each block 18 x 16,384 B.
    gpt = capacity_of(capsys, str(MODELS / "gpt-oss-120b"), "--gpu", "H200", "--tp", "2",
                      "--max-model-len", "32K")  # fmt: skip
    assert gpt["needed_per_request_bytes"] == (521 + 2048) * 18 * 16_384 == 757_628_928
    assert gpt["kv_bytes_per_token"] == 2 * 18 * 1_024
    # Qwen3-Next TP 4 mtp:1: 36 GDN layers x 278,528 B x (2 + 1) pages; 13 x 1,024 B/token
    qwen = capacity_of(capsys, str(MODELS / "qwen3-next-80b-a3b"), "--gpu", "H100", "--tp", "4",
                       "--max-model-len", "32K", "--speculative", "mtp:1")  # fmt: skip
    assert qwen["state_bytes_per_request"] == 36 * 278_528 * 3 == 30_081_024
    assert qwen["kv_bytes_per_token"] == 13 * 1_024
    # Jamba TP 2: 28 Mamba layers x 163,840 B (padded) x 2 pages; 4 x 2,048 B/token
    jamba = capacity_of(capsys, str(MODELS / "jamba-defaults"), "--gpu", "H100", "--tp", "2",
                        "--max-model-len", "32K")  # fmt: skip
    assert jamba["state_bytes_per_request"] == 28 * 163_840 * 2 == 9_175_040
    assert jamba["kv_bytes_per_token"] == 4 * 2_048
    # Nemotron 3 Nano TP 4: 23 Mamba-2 layers x 540,672 B (padded) x 2 pages; 6 attention
    # layers x 1 KV head (2 replicated over 4) x 128 x (K+V) x 2 B = 512 B/token each
    nano = capacity_of(capsys, str(MODELS / "nemotron-3-nano-30b-a3b"), "--gpu", "H100",
                       "--tp", "4", "--max-model-len", "32K")  # fmt: skip
    assert nano["state_bytes_per_request"] == 23 * 540_672 * 2 == 24_870_912
    assert nano["kv_bytes_per_token"] == 6 * 512
    # DeepSeek V3 TP 8 mtp:1: 62 MLA layers x 1,152 B per token
    deepseek = capacity_of(capsys, str(MODELS / "deepseek-v3"), "--gpu", "H200", "--tp", "8",
                           "--max-model-len", "32K", "--speculative", "mtp:1")  # fmt: skip
    assert deepseek["kv_bytes_per_token"] == 62 * 1_152 == 71_424
    assert deepseek["kv_cache_tokens"] == deepseek["num_blocks"] * 64  # type: ignore[operator]


def test_mamba_ssm_cache_dtype_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    # float32 recurrent state for Qwen3-Next TP 4: conv (3, 2,048) bf16 = 12,288 B +
    # (8, 128, 128) fp32 = 524,288 B = 536,576 B; 1,024 B/token attention:
    # block 16 x cdiv(536,576, 16,384) = 528, state page padded to 540,672 B.
    args = ["--model", str(MODELS / "qwen3-next-80b-a3b"), "--gpu", "H100", "--tp", "4"]
    capacity = capacity_of(capsys, *args[1:], "--mamba-ssm-cache-dtype", "float32")
    assert capacity["state_bytes_per_request"] == 36 * 540_672 * 2
    assert main(["capacity", *args[:4], "--tp", "4,8", "--progress"]) == 0
    err = capsys.readouterr().err
    assert "[1/2] H100-80GB tp=4" in err and "[2/2] H100-80GB tp=8" in err


def test_eagle3_drafter_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.models.test_importer import EAGLE3_TEST_DRAFTER

    drafter = tmp_path / "eagle3" / "config.json"
    drafter.parent.mkdir()
    drafter.write_text(json.dumps(EAGLE3_TEST_DRAFTER))
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100", "--max-model-len"]
    args += ["8K", "--speculative", "eagle3:3", "--draft-model", str(drafter.parent), "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["groups"][0]["is_draft"] is True  # the drafter's layer shares the group
    assert plan["capacity"]["kv_bytes_per_token"] == 33 * 8 * 128 * 2 * 2
    assert main(["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100",
                 "--draft-model", str(drafter.parent)]) == 2  # fmt: skip
    assert "--draft-model needs --speculative" in capsys.readouterr().err


def test_pipeline_parallel_plan(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100", "--tp", "2"]
    assert main([*args, "--pp", "2", "--max-model-len", "8K", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [int(worker.get("rank", 0)) for worker in plan["workers"]] == [0, 1, 2, 3]
    # TP innermost: ranks 0-1 hold layers 0-15, ranks 2-3 layers 16-31
    layer_names = [name for group in plan["workers"][2]["groups"] for name in group["layer_names"]]
    assert layer_names[0] == "model.layers.16.self_attn.attn" and len(layer_names) == 16


def test_whisper_cross_attention_sized_by_encoder_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # On an L4 vllm serve batches 2,048 tokens, so the encoder side of a 448-token request
    # holds cdiv(2048, 16) = 128 cross blocks next to 28 self-attention blocks; a block
    # costs the larger group: whisper-small's 12 layers x 49,152 B (12 heads x 64 x (K+V)
    # x 2 B x 16 tokens; its float32 checkpoint runs in bfloat16).
    capacity = capacity_of(capsys, str(MODELS / "whisper-small"), "--gpu", "L4")
    assert capacity["needed_per_request_bytes"] == (28 + 128) * 12 * 49_152
    capacity = capacity_of(
        capsys, str(MODELS / "whisper-small"), "--gpu", "L4",
        "--max-num-batched-tokens", "8K",
    )  # fmt: skip
    assert capacity["needed_per_request_bytes"] == (28 + 512) * 12 * 49_152


def test_serve_defaults_follow_the_device() -> None:
    from kvplan.models.request import serve_defaults

    def defaults(name: str) -> tuple[int, int]:
        gpu = lookup_gpu(name)
        return serve_defaults(gpu.total_memory_bytes, gpu.name)

    assert defaults("B200") == defaults("MI300X") == (16384, 1024)  # >= 160 GiB
    assert defaults("H100") == defaults("H200") == defaults("GH200") == (8192, 1024)
    assert defaults("A100-80GB") == defaults("L40S") == defaults("L4") == (2048, 256)


@pytest.mark.parametrize(
    ("engine_version", "block", "blocks"),
    [
        # H100 80GB = 85,029,615,042 B (79.19 GiB), 20 GiB non-KV, 131,072 B per token.
        # 0.32 / 0.33: 0.92 x total - 20 GiB over 2 MiB blocks (16 tokens);
        ("vllm-0.32", 16, (-(-85_029_615_042 * 92 // 100) - 20 * 2**30) // (16 * 131_072)),
        ("vllm-0.33", 16, (-(-85_029_615_042 * 92 // 100) - 20 * 2**30) // (16 * 131_072)),
        # 0.34: the extensible cache reserves at utilization 1.0, 64-token blocks of 8 MiB,
        # then keeps what is free after warm-up: the total less the given non-KV memory,
        # the 0.51 GiB taken before the worker starts and the 1 GiB margin floor, mapped
        # per layer in 2 MiB granules (8 blocks of 256 KiB per layer each).
        ("vllm-0.34", 64, (85_029_615_042 - round(0.51 * 2**30) - 21 * 2**30) // (64 << 20) * 8),
    ],
)
def test_model_plans_with_a_release(
    engine_version: str, block: int, blocks: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model with --engine-version: the release's layer registration (its default
    block) and its planning rules; the plan says which rule set made it."""
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100-80GB", "--json"]
    args += ["--max-model-len", "8K", "--non-kv-bytes", "20GiB", "--engine-version"]
    assert main([*args, engine_version]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rule_set"] == engine_version
    assert plan["groups"][0]["block_size"] == block
    assert int(plan["num_blocks"]) == blocks
    if engine_version == "vllm-0.34":  # the reservation before warm-up is the cap
        reserved = (85_029_615_042 - 20 * 2**30) // (64 * 131_072)
        assert int(plan["reserved_num_blocks"]) == reserved
        assert plan["plan_stage"] == "PLAN_STAGE_EXTENSIBLE_FINAL"
    capacity = ["capacity", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100", "--tp"]
    assert main([*capacity, "1", "--json", "--engine-version", engine_version]) == 0
    assert json.loads(capsys.readouterr().out)
    assert main([*args, "vllm-0.99"]) == 2
    assert "unknown engine_version 'vllm-0.99'" in capsys.readouterr().err


def test_plan_gpu_takes_a_size_like_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--max-model-len", "8K", "--json"]
    assert main([*args, "--gpu", "96GiB", "--non-kv-bytes", "16GiB"]) == 0
    sized = json.loads(capsys.readouterr().out)
    assert main([*args, "--gpu-memory", str(96 << 30), "--non-kv-bytes", "16GiB"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert sized["capacity"]["num_blocks"] == exact["capacity"]["num_blocks"] > 0
    assert main([*args, "--gpu", "H999"]) == 2
    assert "unknown GPU 'H999'" in capsys.readouterr().err


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """stderr of a command refused with exit 2 (argparse's or the command's own)."""
    try:
        code = main(list(args))
    except SystemExit as stop:  # argparse refuses a flag's value itself
        code = int(stop.code or 0)
    assert code == 2, args
    return capsys.readouterr().err


def test_block_size_is_one_vllm_runs(capsys: pytest.CaptureFixture[str]) -> None:
    llama = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--max-model-len", "8K"]
    err = _refused(capsys, *llama, "--gpu", "H100", "--block-size", "7")
    assert err.startswith("error: --block-size 7: no attention backend") and "on cuda" in err
    assert "FLASH_ATTN, TRITON_ATTN" in err and "multiple of 16 (16, 32, 48, 64, ...)" in err
    assert main([*llama, "--gpu", "H100", "--block-size", "48", "--json"]) == 0
    assert {group["block_size"] for group in json.loads(capsys.readouterr().out)["groups"]} == {48}
    # A hybrid's size is checked as given, before vLLM raises it to hold a Mamba page.
    hybrid = ["plan", "--model", str(MODELS / "qwen3-next-80b-a3b"), "--tp", "4", "--gpu", "H100"]
    assert "--block-size 8:" in _refused(capsys, *hybrid, "--block-size", "8")
    # MLA: multiples of 16 on CUDA; on ROCm AITER's MLA kernel takes any size.
    deepseek = ["capacity", "--model", str(MODELS / "deepseek-v3"), "--tp", "8"]
    deepseek += ["--max-model-len", "8K", "--block-size", "7", "--json"]
    err = _refused(capsys, *deepseek, "--gpu", "H200")
    assert "for an MLA model" in err and "FLASHMLA: 64" in err
    assert main([*deepseek, "--gpu", "MI300X"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["status"] == "ok"


def test_vllm_flags_refuse_what_vllm_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    plan = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100"]
    err = _refused(capsys, *plan, "--max-num-batched-tokens", "auto")
    assert "vLLM takes a token count here" in err
    err = _refused(capsys, *plan, "--mamba-ssm-cache-dtype", "fp8")
    assert "invalid choice: 'fp8'" in err
    # vLLM's SchedulerConfig: max_num_batched_tokens >= max_num_seqs, defaults included.
    err = _refused(capsys, *plan, "--max-num-seqs", "10000")
    assert "max_num_batched_tokens (8,192, vllm serve default for this GPU) must be >= " in err
    err = _refused(capsys, *plan, "--max-num-seqs", "512", "--max-num-batched-tokens", "256")
    assert "max_num_batched_tokens (256) must be >= max_num_seqs (512)" in err
    sweep = ["capacity", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100"]
    assert "--tensor-parallel-size '1,x': not an integer" in _refused(capsys, *sweep, "-tp", "1,x")
    assert "'0,2': must be >= 1: '0'" in _refused(capsys, *sweep, "-tp", "0,2")
    # Encoder-decoder: no chunked prefill in vLLM, so a whole request fits one step.
    whisper = ["plan", "--model", str(MODELS / "whisper-small"), "--gpu", "L4"]
    err = _refused(capsys, *whisper, "--max-num-batched-tokens", "256", "--max-num-seqs", "8")
    assert "max_num_batched_tokens (256) is smaller than max_model_len (448)" in err
    assert main([*whisper, "--max-num-batched-tokens", "448", "--max-num-seqs", "8"]) == 0


def test_a_fixed_kv_size_the_device_cannot_hold_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # vLLM plans --kv-cache-memory-bytes / --num-gpu-blocks-override whatever the device
    # holds, then fails allocating: the KV tensors plus the weights loaded before them
    # already exceed the H100's 79.19 GiB here.
    plan = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100"]
    plan += ["--max-model-len", "8K"]
    err = _refused(capsys, *plan, "--kv-cache-memory-bytes", "200GiB")
    assert err.startswith("error: --kv-cache-memory-bytes: a KV cache of 200.00 GiB per worker")
    assert "more than the device's 79.19 GiB: vLLM runs out of memory" in err
    # The room is the device less the weights the same message states (an estimate).
    weights = re.search(r"the weights \(estimated\), ([0-9.]+) GiB", err)
    assert weights is not None
    assert f"less than {79.19 - float(weights[1]):.2f} GiB fits beside the weights" in err
    err = _refused(capsys, *plan, "--num-gpu-blocks-override", "1000000")
    assert "(1,000,000 blocks of 2,097,152 B)" in err  # 32 layers x 2 x 8 x 128 x 2 B x 16
    given = ["--kv-cache-memory-bytes", "70GiB", "--non-kv-bytes", "20GiB"]
    assert "at most 59.19 GiB fits beside the given non-KV memory" in _refused(
        capsys, *plan, *given
    )
    assert main([*plan, "--kv-cache-memory-bytes", "60GiB"]) == 0
    capsys.readouterr()
    # In a sweep the GPU that cannot hold it is that row's error; the others plan.
    sweep = ["capacity", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "L4,H100", "--tp", "1"]
    assert (
        main([*sweep, "--max-model-len", "8K", "--kv-cache-memory-bytes", "30GiB", "--json"]) == 0
    )
    rows = {row["gpu"]: row for row in json.loads(capsys.readouterr().out)}
    assert (
        rows["L4-24GB"]["status"] == "error"
        and "vLLM runs out of memory" in rows["L4-24GB"]["error"]
    )
    assert rows["H100-80GB"]["status"] == "ok"


def test_a_logged_block_size_is_taken_as_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A block size an engine ran with (V0's 8, or ROCm's AITER MLA 1) is a fact of the
    # log `calibrate` reads, not refused as vLLM 0.32-0.34's CUDA backends refuse it.
    log = tmp_path / "engine.log"
    log.write_text(
        "INFO 04-22 15:56:27 [entrypoints/utils.py:233] non-default args: {'model': 'm', "
        "'max_model_len': 8192, 'block_size': 8}\n"
    )
    model = str(MODELS / "llama-3.1-8b")
    assert main(["calibrate", str(log), "--model", model, "--gpu", "H100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings_from_log"]["block_size"] == 8
    # The same size given for a deployment is checked.
    plan = ["plan", "--model", model, "--gpu", "H100", "--max-model-len", "8K"]
    assert "--block-size 8: no attention backend" in _refused(capsys, *plan, "--block-size", "8")


CHECKPOINTS = Path(__file__).parents[1] / "data" / "checkpoints"


@pytest.mark.parametrize(
    ("name", "length", "items", "tokens"),
    [("llava-v1.6-mistral-7b-hf", 32768, 2, 2928), ("llava-1.5-7b-hf", 4096, 14, 576)],
)
def test_clip_llava_checkpoints_plan_on_one_h100(
    name: str, length: int, items: int, tokens: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """llava-hf's CLIP LLaVA-Next and LLaVA 1.5 plan on one H100 at their own length with
    the estimated non-KV memory (weights, the decoder's and the encoder's profile): a
    7B model leaves most of the card to the KV cache, and the encoder is profiled with
    8,192 // tokens per image items at 8,192 batched tokens (the budgets of
    test_encoder_against_vllm.py check the count against vLLM's own functions)."""
    args = ["plan", "--model", str(CHECKPOINTS / name), "--gpu", "H100", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["capacity"]["max_model_len"] == length
    budget = plan["workers"][0]["budget"]
    assert 14 * 2**30 < int(budget["non_kv_bytes"]) < 20 * 2**30
    assert main(args[:-1]) == 0
    out = capsys.readouterr().out
    assert f"budget 8,192 tokens, {items} image item(s) of {tokens:,} tokens" in out
