"""`kvplan calibrate LOG` on the public calibration set (tests/data/calibration: each
record's lines copied verbatim from its source, named in the record's .json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplan.cli import main
from kvplan.models import import_layers, load_config
from kvplan.models.calibrate import (
    CONCURRENCY_FORMULA,
    PER_GROUP_FORMULA,
    engine_budget_gib,
    hybrid_prefix_caching_default,
    parse_log,
    printed_stage,
    printed_token_formula,
    printed_token_releases,
    settings_from_log,
)
from kvplan.models.weights import estimate_overhead, estimate_weights

ROOT = Path(__file__).parents[2]
GIB = 1 << 30
MIB = 1 << 20
DATA = ROOT / "tests" / "data" / "calibration"
RECORDS = sorted(path.stem for path in DATA.glob("*.json"))


def record(name: str) -> dict[str, object]:
    result: dict[str, object] = json.loads((DATA / f"{name}.json").read_text())
    return result


def test_every_record_names_its_source_and_has_its_lines() -> None:
    assert len(RECORDS) >= 3
    for name in RECORDS:
        # A GitHub URL, or a public file the code index found without naming its
        # repository (its index id; the record says so).
        assert str(record(name)["source"]).startswith(("https://github.com/", "code-index:"))
        assert (DATA / f"{name}.log").read_text().strip()


def test_a_v1_log_is_read_line_by_line() -> None:
    log = parse_log((DATA / "qwen3.6-35b-a3b-nvfp4-rtx5090-club3090-612.log").read_text())
    assert log.available_kv_gib == [5.98]
    assert log.kv_cache_tokens == 567_978
    assert (log.concurrency_len, log.max_concurrency) == (131_072, 4.33)
    settings = settings_from_log(log)
    assert settings["max_model_len"] == 131_072 and settings["kv_cache_dtype"] == "fp8"
    assert settings["max_num_seqs"] == 1 and settings["max_num_batched_tokens"] == 8192


def test_the_engine_config_line_and_the_one_line_capacity_format() -> None:
    # vLLM 0.32-0.34 print size and concurrency on one line; the config line's fields.
    text = (
        "INFO [core.py:154] Initializing a V1 LLM engine (v0.34.0) with config: "
        "model='m', dtype=torch.bfloat16, max_seq_len=32768, tensor_parallel_size=4, "
        "pipeline_parallel_size=1, kv_cache_dtype=auto\n"
        "INFO [kv_cache_utils.py:1169] GPU KV cache size: 1,234,567 tokens, "
        "Maximum concurrency for 32,768 tokens per request: 37.68x\n"
        "INFO [model_runner.py:1217] Graph capturing finished in 12 secs, took 0.52 GiB\n"
    )
    log = parse_log(text)
    assert log.release == "0.34.0" and log.cuda_graph_gib == 0.52
    assert log.kv_cache_tokens == 1_234_567 and log.max_concurrency == 37.68
    assert settings_from_log(log) == {
        "tp": 4, "pp": 1, "max_model_len": 32_768, "dtype": "bfloat16"}  # fmt: skip


def test_the_settings_the_engine_states_in_its_own_lines() -> None:
    # The L40S record (vLLM 0.19.0): the utilization from the advice line (0.9 was the
    # default, so the non-default args do not name it), max_num_batched_tokens from the
    # compile range, max_num_seqs from FULL graphs stopping at 256 under PIECEWISE's 512,
    # prefix caching from the engine's config line, custom all-reduce off from vLLM's
    # WARNING (more than two PCIe-only GPUs).
    log = parse_log((DATA / "qwen2.5-72b-l40s-tp4-v0.19.log").read_text())
    assert log.cudagraph_subtracted_fraction is None  # 0.19.0 logs it, does not subtract
    assert settings_from_log(log) == {
        "tp": 4, "pp": 1, "max_model_len": 8192, "max_num_batched_tokens": 2048,
        "max_num_seqs": 256, "gpu_memory_utilization": 0.9, "dtype": "bfloat16",
        "enable_prefix_caching": True, "disable_custom_all_reduce": True,
    }  # fmt: skip
    # Equal largest sizes say nothing of max_num_seqs (the llm-d H100 records: 1,024).
    h100 = parse_log((DATA / "llama-3.1-8b-h100-tp1-llmd-v0.19.log").read_text())
    assert h100.max_num_seqs_from_graphs is None
    # A speculative config widens FULL decode graphs: no max_num_seqs from them.
    drafts = parse_log(
        "INFO [core.py:105] Initializing a V1 LLM engine (v0.24.0) with config: model='m', "
        "speculative_config=SpeculativeConfig(method='mtp', num_spec_tokens=3), "
        "max_seq_len=4096\n"
        "INFO [gpu_model_runner.py:5876] Profiling CUDA graph memory: PIECEWISE=5 "
        "(largest=16), FULL=2 (largest=8)\n"
    )
    assert "max_num_seqs" not in settings_from_log(drafts)


def test_quantization_is_read_from_the_command_not_the_engine_line() -> None:
    # `--quantization fp8` on an unquantized Llama-3.1-8B: the non-default args name it.
    qfp8 = parse_log((DATA / "llama-3.1-8b-h100-qfp8-llmd-v0.19.log").read_text())
    assert settings_from_log(qfp8)["quantization"] == "fp8"
    # A GPTQ checkpoint: the engine line says quantization=gptq_marlin (the kernel's
    # method, not a --quantization the checkpoint would accept), the command nothing.
    gptq = parse_log((DATA / "llama-3.1-8b-w4a16-h100-fp16-llmd-v0.19.log").read_text())
    assert gptq.engine_config.get("quantization") == "gptq_marlin"
    assert "quantization" not in settings_from_log(gptq)


def test_the_scheduler_line_and_a_split_compile_state_the_batched_tokens() -> None:
    # Qwen2.5-7B at TP 4 (vLLM 0.19.0): the all-reduce fusion ends at 292 tokens, so the
    # profile run compiles (1, 292) and (293, 8192) after the scheduler's 8,192. The
    # first range is not max_num_batched_tokens (calibrate once refused the settings:
    # 292 < max_num_seqs 1,024).
    tp4 = parse_log((DATA / "qwen2.5-7b-instruct-h100-tp4-llmd-v0.19.log").read_text())
    assert tp4.max_num_batched_tokens == 8192
    split = "INFO [backends.py:372] Cache the graph of compile range ({}, {}) for later use\n"
    # Without the scheduler's line, a split compile ends at its last range's end.
    ranges = parse_log(split.format(1, 292) + split.format(293, 4096))
    assert ranges.max_num_batched_tokens == 4096
    assert parse_log(split.format(1, 2048)).max_num_batched_tokens == 2048


def test_the_api_servers_length_line_states_max_model_len() -> None:
    # The self-llm tutorial's lines (vLLM 0.23.0): no engine-config line, but the API
    # server's "Using max model len 4096" (the command's --max-model-len).
    log = parse_log((DATA / "qwen3.5-4b-rtx4090d-selfllm-v0.23.log").read_text())
    assert log.max_model_len == 4096 and settings_from_log(log)["max_model_len"] == 4096
    # The engine-config line, where there is one, and the non-default args come first.
    line = "INFO [model.py:1745] Using max model len 8192\n"
    config = "INFO [core.py:113] Initializing a V1 LLM engine (v0.23.0) with config: "
    config += "max_seq_len=4096\n"
    assert settings_from_log(parse_log(line + config))["max_model_len"] == 4096


def test_a_hybrid_models_prefix_caching_default_follows_the_release(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # vLLM 0.19.0-0.25.1 turn prefix caching off for a hybrid model unless told (the
    # wheels' is_prefix_caching_supported), 0.26+ on.
    assert [hybrid_prefix_caching_default(r) for r in ("0.19.1", "0.23.0", "0.25.1")] == [
        False, False, False]  # fmt: skip
    assert [hybrid_prefix_caching_default(r) for r in ("0.26.0", "0.30.0", "0.34.0")] == [
        True,
        True,
        True,
    ]
    assert hybrid_prefix_caching_default("0.10.2") is None
    # Off, a request of 4,096 tokens holds 8 attention blocks of 528 tokens and one state
    # block in each of the 3 GDN groups: the logged 10.21 GiB (633 blocks) gives the
    # printed 235,706 = int(633 / 11 x 4,096) tokens; with prefix caching ('align': two
    # state blocks a group, 14 a request) 185,197.
    name = "qwen3.5-4b-rtx4090d-selfllm-v0.23"
    data = record(name)
    flags = data["flags"]
    assert isinstance(flags, list) and "--enable-prefix-caching" not in flags
    args = ["calibrate", str(DATA / f"{name}.log"), "--model", str(ROOT / str(data["model"]))]
    args += ["--gpu", str(data["gpu"]), *flags, "--json"]
    figure = "KV cache tokens from the logged budget, int(concurrency x max_model_len)"
    for extra, tokens in (([], 235_706), (["--enable-prefix-caching"], 185_197)):
        assert main([*args, *extra]) == 0
        rows = {row["figure"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
        assert rows[figure]["measured"] == 235_706 and rows[figure]["predicted"] == tokens


def test_a_029_hybrid_log_prints_the_concurrency_formula_with_prefix_caching(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Qwen/Qwen3.5-4B on one L4, `vllm/vllm-openai:v0.29.0-cu129`, 32,768 tokens: a lab's
    # findings (a public file the code index found, id 69494016274) quote vLLM's account
    # with its line wrapped, and the concurrency; they state 267,842 tokens measured.
    # 0.29 prints int(max_concurrency x max_model_len) and turns prefix caching on for a
    # hybrid model: two state blocks per GDN group ('align'), 267,842 from the logged
    # 9.1 GiB to the token; without prefix caching it would be 280,017.
    log = tmp_path / "l4.log"
    log.write_text(
        "Free memory on device (21.84/22.03 GiB) on startup.\n"
        "Desired GPU memory utilization is (0.92, 20.27 GiB).\n"
        "Actual usage is 9.01 GiB for consumed memory (weights + non-torch),\n"
        "2.17 GiB for peak activation, and 0.24 GiB for CUDAGraph memory.\n"
        "Available KV cache memory: 9.1 GiB\n"
        "Maximum concurrency for 32,768 tokens per request: 8.17x\n"
    )
    args = ["calibrate", str(log), "--model", str(ROOT / "examples/models/qwen3.5-4b")]
    args += ["--gpu", "L4", "--release", "0.29.0", "--max-model-len", "32768", "--json"]
    figure = "KV cache tokens from the logged budget, int(concurrency x max_model_len)"
    for extra, tokens in (([], 267_842), (["--no-enable-prefix-caching"], 280_017)):
        assert main([*args, *extra]) == 0
        rows = {row["figure"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
        assert rows[figure]["predicted"] == tokens
        assert rows["maximum concurrency at 32,768 tokens"]["measured"] == 8.17


def test_the_model_dtype_the_engine_ran_with() -> None:
    # `--dtype float32` (the llm-d float32 record): the non-default args and the engine's
    # config line both say it, and the weights are twice the checkpoint's bfloat16.
    log = parse_log((DATA / "llama-3.1-8b-h100-float32-llmd-v0.19.log").read_text())
    assert settings_from_log(log)["dtype"] == "float32" and log.model_loading_gib == [29.98]
    half = parse_log(
        "INFO [core.py:105] Initializing a V1 LLM engine (v0.19.0) with config: model='m', "
        "dtype=torch.float16, max_seq_len=4096\n"
    )
    assert settings_from_log(half)["dtype"] == "float16"
    assert "dtype" not in settings_from_log(parse_log("Model loading took 1.00 GiB memory\n"))


def account_line() -> str:
    """The 0.27+ post-capture account as club-3090#1087 quotes it (RTX 5090s)."""
    return (
        "(Worker_TP0 pid=223) INFO 08-22 04:42:13 [gpu_worker.py:789] Free memory on device "
        "(30.27/31.4 GiB) on startup. Desired GPU memory utilization is (0.92, 28.88 GiB). "
        "Actual usage is 15.03 GiB for consumed memory (weights + non-torch), 1.59 GiB for "
        "peak activation, and 0.09 GiB for CUDAGraph memory.\n"
    )


def test_the_newer_profiling_summary_and_post_capture_account() -> None:
    # vLLM 0.32-0.34's summary (MemoryProfilingResult's format in their CPU venvs): the
    # transient peak is the non-KV total less the consumed memory; non-torch is at most
    # the consumed memory less the weights.
    log = parse_log(
        "DEBUG [gpu_worker.py:758] Memory profiling takes 2.50 seconds. Total non KV cache "
        "memory: 17.50GiB; torch peak memory increase: 1.20GiB; total consumed (from "
        "mem_get_info): 16.00GiB; weights memory: 15.30GiB.\n"
    )
    assert (log.peak_torch_increase_gib, log.non_torch_gib) == (1.5, 0.7)
    # The later post-capture account, weights and non-torch as one figure (its line as
    # club-3090#1087 quotes it; the loading line is made up for the subtraction).
    account = parse_log(
        "INFO [gpu_model_runner.py:5405] Model loading took 14.28 GiB memory and 6.3 seconds\n"
        + account_line()
    )
    assert (account.total_gpu_gib, account.graph_line_utilization) == (31.4, 0.92)
    # That form's "peak activation" is the transient peak plus the graph estimate vLLM
    # subtracted (0.27.0-0.34 gpu_worker `peak_activation_memory`): not the activation
    # peak itself until the log states the estimate (the pool line, printed before).
    assert account.non_torch_gib == 0.75 and account.peak_torch_increase_gib is None
    assert account.account_peak_with_graph_estimate_gib == 1.59
    assert account.cuda_graph_gib == 0.09
    pool = "CUDA graph pool memory: 0.09 GiB (actual), 0.13 GiB (estimated), difference\n"
    split = parse_log(pool + "INFO Model loading took 14.28 GiB memory\n" + account_line())
    assert split.peak_torch_increase_gib == 1.46 and split.cuda_graph_estimate_gib == 0.13


@pytest.mark.parametrize("name", [n for n in RECORDS if record(n)["config_known"]])
def test_calibrate_prints_prediction_and_error_for_each_record(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = record(name)
    args = ["calibrate", str(DATA / f"{name}.log"), "--model", str(ROOT / str(data["model"]))]
    flags = data["flags"]
    assert isinstance(flags, list)
    assert main([*args, "--gpu", str(data["gpu"]), *flags, "--json"]) == 0
    rows = {row["figure"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    available = rows["available KV cache memory per worker"]
    assert available["measured"] is not None and available["predicted"] is not None
    assert available["error"] == pytest.approx(
        (available["predicted"] - available["measured"]) / available["measured"]
    )


def test_the_logged_budget_reproduces_the_logged_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    # Given the log's own KV budget (3.81 GiB, printed to 0.01 GiB), the KV arithmetic
    # is exact up to that rounding: 1,950 blocks of 2 MiB against 1,952 logged.
    name = "llama-3.1-8b-rtx3090-vllm10517"
    data = record(name)
    flags = data["flags"]
    assert isinstance(flags, list)
    args = ["calibrate", str(DATA / f"{name}.log"), "--model", str(ROOT / str(data["model"]))]
    assert main([*args, "--gpu", str(data["gpu"]), *flags, "--json"]) == 0
    rows = {row["figure"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    exact = rows["GPU blocks from the logged budget (the exact part)"]
    assert abs(exact["error"]) < 0.005 / 3.81  # the budget's print rounding
    # Parameters and the RoPE cache (131,072 positions x 128 x 2 B) against 14.9888 GiB.
    assert abs(rows["model loading (weights) per worker"]["error"]) < 0.0005


def test_the_flashinfer_fallback_line_or_flag_plans_the_sort(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The Qwen3-Next 0.10.2 record without its sampler WARNING plans FlashInfer's path
    # (16 B per logit) and misses the logged activation peak by half; --no-flashinfer
    # says what the line said, and plans what the whole log plans.
    name = "qwen3-next-80b-a3b-h200-tp2-v0.10.2"
    text = (DATA / f"{name}.log").read_text()
    stripped = tmp_path / "without-warning.log"
    stripped.write_text("".join(line for line in text.splitlines(True) if "FlashInfer" not in line))
    model = ["--model", str(ROOT / str(record(name)["model"])), "--gpu", "H200", "--json"]

    def activation(log: Path, *flags: str) -> dict[str, float]:
        assert main(["calibrate", str(log), *model, *flags]) == 0
        rows = {row["figure"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
        row: dict[str, float] = rows["activation peak of the profile run"]
        return row

    whole = activation(DATA / f"{name}.log")
    assert abs(whole["error"]) <= 0.03
    without = activation(stripped)
    assert without["error"] < -0.4
    assert activation(stripped, "--no-flashinfer") == whole


def test_custom_all_reduce_off_is_read_from_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM's own WARNING (the L40S TP 4 record: more than two PCIe-only GPUs).
    l40s = parse_log((DATA / "qwen2.5-72b-l40s-tp4-v0.19.log").read_text())
    assert l40s.custom_all_reduce_off == "it's not supported on more than two PCIe-only GPUs"
    assert settings_from_log(l40s)["disable_custom_all_reduce"] is True
    # The engine's config line: False on the H100 TP 2 record, and its non-torch row
    # is then the TP figure the log shows (2.07 GiB); the same log with the flag set in
    # its config line, or in its non-default args, plans the TP 1 figure.
    name = "llama-3.1-8b-h100-tp2-llmd-v0.19"
    text = (DATA / f"{name}.log").read_text()
    assert "disable_custom_all_reduce" not in settings_from_log(parse_log(text))
    flagged = tmp_path / "config-line.log"
    flagged.write_text(
        text.replace("disable_custom_all_reduce=False", "disable_custom_all_reduce=True")
    )
    args_line = tmp_path / "non-default.log"
    args_line.write_text(  # the flag as vllm serve lists it among its non-default args
        text.replace("'tensor_parallel_size': 2,", "'tensor_parallel_size': 2, "
                     "'disable_custom_all_reduce': True,", 1)
    )  # fmt: skip
    model = ["--model", str(ROOT / str(record(name)["model"])), "--gpu", "H100", "--json"]
    model += [str(flag) for flag in record(name).get("flags", [])]  # type: ignore[attr-defined]

    def non_torch(log: Path) -> float:
        assert main(["calibrate", str(log), *model]) == 0
        rows = {row["figure"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
        return float(rows["non-torch memory"]["predicted"])

    assert round(non_torch(DATA / f"{name}.log"), 2) == 2.07
    assert settings_from_log(parse_log(flagged.read_text()))["disable_custom_all_reduce"]
    assert round(non_torch(flagged), 2) == 0.25
    assert round(non_torch(args_line), 2) == 0.25


def test_a_pipeline_log_is_compared_stage_by_stage(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3.1-8B at PP 2 (vLLM 0.19, H100): only the first stage prints its budget;
    # both stages log their non-KV total, and the engine sizes the cache from the
    # smaller budget, the last stage's (0.95 x 79.19 - 9.6 = 65.63 GiB: 1,075,312 tokens).
    name = "llama-3.1-8b-h100-pp2-llmd-v0.19"
    log = parse_log((DATA / f"{name}.log").read_text())
    assert (log.available_kv_gib, log.available_kv_stage) == ([66.54], [0])
    assert log.stage_non_kv_gib == {0: 8.69, 1: 9.6}
    assert log.stage_activation_gib == {0: 1.1, 1: 2.01}
    assert log.stage_non_torch_gib == {0: 0.07, 1: 0.07}
    assert printed_stage(log) == 0
    assert engine_budget_gib(log, 0.95) == pytest.approx(0.95 * 79.19 - 9.6)
    # kvplan plans each stage's own profile: the first runs no sampler, the last keeps
    # the hidden states and residual it receives (2 x 8,192 x 4,096 x 2 B).
    config = load_config(str(ROOT / "examples/models/llama-3.1-8b/config.json"))
    layers = import_layers(config)
    first, last = (
        estimate_overhead(config, layers, 1, 8192, 1024, "0.19.0", gpu_arch="hopper",
                          pipeline_stage=stage, pipeline_parallel_size=2)
        for stage in (0, 1)
    )  # fmt: skip
    alone = estimate_overhead(config, layers, 1, 8192, 1024, "0.19.0", gpu_arch="hopper")
    assert first.activation_peak_bytes == 8192 * (3 * 4096 + 3 * 14_336) * 2 + 32 * MIB
    assert last.activation_peak_bytes == alone.activation_peak_bytes + 2 * 8192 * 4096 * 2
    assert abs(last.activation_peak_bytes / GIB - log.stage_activation_gib[1]) <= 0.005
    # calibrate compares the printed stage with kvplan's budget for that stage, and
    # reproduces the tokens from the smaller budget.
    meta = json.loads((DATA / f"{name}.json").read_text())
    args = ["calibrate", str(DATA / f"{name}.log"), "--model", str(ROOT / meta["model"])]
    assert main([*args, "--gpu", "H100", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["pipeline_stage"] == 0
    rows = {row["figure"]: row for row in printed["rows"]}
    available = rows["available KV cache memory per worker"]
    assert available["measured"] == 66.54 and abs(available["error"]) <= 0.01
    reproduced = rows["KV cache tokens from the logged budget, num_blocks // groups x block"]
    assert abs(reproduced["error"]) <= 0.0001
    assert rows["activation peak of the profile run"]["measured"] == 1.1


# Every V1 release on PyPI from 0.8.0 to 0.34.0 and the "GPU KV cache size" formula its
# wheel's vllm/v1/core/kv_cache_utils.py computes (read per wheel; docs/capacity.md names
# the function per range). Written out here, not derived from PRINTED_TOKEN_FORMULA, so
# a wrong key there fails.
PER_GROUP_RELEASES = [
    "0.8.0", "0.8.1", "0.8.2", "0.8.3", "0.8.4", "0.8.5", "0.8.5.post1", "0.9.0", "0.9.0.1",
    "0.9.1", "0.9.2", "0.10.0", "0.10.1", "0.10.1.1", "0.10.2", "0.11.0", "0.11.1",
    "0.11.2", "0.12.0", "0.13.0", "0.14.0", "0.14.1", "0.15.0", "0.15.1", "0.16.0",
    "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0",
]  # fmt: skip
CONCURRENCY_RELEASES = [
    "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0",
    "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
    "0.32.0", "0.33.0", "0.34.0",
]  # fmt: skip


@pytest.mark.parametrize(
    ("release", "formula"),
    [(release, PER_GROUP_FORMULA) for release in PER_GROUP_RELEASES]
    + [(release, CONCURRENCY_FORMULA) for release in CONCURRENCY_RELEASES],
)
def test_each_release_prints_the_formula_its_source_computes(release: str, formula: str) -> None:
    assert printed_token_formula(release) == formula


def test_releases_outside_the_checked_ones_have_no_formula() -> None:
    # V0 (0.7 and before), a 0.20 log without its patch release (0.20.0 and 0.20.1 differ)
    # and releases after 0.34: not read, so calibrate holds a record to both.
    for release in ("0.7.3", "0.20", "0.35.0", "V0 engine", ""):
        assert printed_token_formula(release) is None, release
    # A release candidate or dev build counts as its release.
    assert printed_token_formula("0.23.1rc1") == CONCURRENCY_FORMULA
    assert printed_token_formula("0.20.0rc2") == PER_GROUP_FORMULA
    # The bounds plan --model names.
    assert printed_token_releases(PER_GROUP_FORMULA) == ("0.8", "0.20.0")
    assert printed_token_releases(CONCURRENCY_FORMULA) == ("0.20.1", "0.34")


# Lines copied verbatim from two public H100 logs of gpt-oss-120b at TP 1.
VLLM_23278 = (  # https://github.com/vllm-project/vllm/issues/23278 (vLLM 0.10.1)
    "(APIServer pid=5710) INFO 08-20 18:03:40 [api_server.py:1805] vLLM API server version 0.10.1\n"
    "(EngineCore_0 pid=5839) WARNING 08-20 18:04:08 [marlin_utils_fp4.py:196] Your GPU does "
    "not have native support for FP4 computation but FP4 quantization is being used. "
    "Weight-only FP4 compression will be used leveraging the Marlin kernel. This may degrade "
    "performance for compute-heavy workloads.\n"
    "(EngineCore_0 pid=5839) INFO 08-20 18:04:10 [gpu_model_runner.py:2007] Model loading "
    "took 65.9651 GiB and 12.799889 seconds\n"
)
VLLM_33155 = (  # https://github.com/vllm-project/vllm/issues/33155 (vLLM 0.14.1)
    "^[[0;36m(EngineCore_DP0 pid=70073)^[[0;0m INFO 01-27 00:31:44 [mxfp4.py:165] Using "
    "Triton backend\n"
    "^[[0;36m(EngineCore_DP0 pid=70073)^[[0;0m INFO 01-27 00:31:59 [gpu_model_runner.py:3905] "
    "Model loading took 64.38 GiB memory and 14.380607 seconds\n"
)


@pytest.mark.parametrize(
    ("text", "release", "backend", "other"),
    [(VLLM_23278, "0.10.1", "marlin", "0.14.1"), (VLLM_33155, "0.14.1", "triton", "0.11.2")],
)
def test_the_mxfp4_backend_a_log_names_sets_the_experts_layout(
    text: str, release: str, backend: str, other: str
) -> None:
    # Each log's backend line is read, and it wins over the release's default: planned
    # as the other release (whose default is the other backend), the weights still
    # follow the line, within 0.5% of what the log loaded.
    log = parse_log(text)
    assert log.mxfp4_backend == backend
    assert settings_from_log(log)["mxfp4_backend"] == backend
    config = load_config(str(ROOT / "examples/models/gpt-oss-120b/config.json"))
    layers = import_layers(config)
    for planned_release in (release, other):
        weights = estimate_weights(config, layers, 1, 1, "hopper", release=planned_release,
                                   mxfp4_backend=log.mxfp4_backend)  # fmt: skip
        logged = log.model_loading_gib[0]
        assert abs(weights.bytes_per_worker / GIB - logged) < 0.005 * logged, planned_release


def test_only_the_mxfp4_records_name_an_mxfp4_backend() -> None:
    # Every record's log: the gpt-oss-20b one names its backend (0.19's oracle line,
    # "Using 'TRITON' Mxfp4 MoE backend."); no other line of any record is taken for one.
    named = {name: parse_log((DATA / f"{name}.log").read_text()).mxfp4_backend for name in RECORDS}
    assert named.pop("gpt-oss-20b-h100-tp2-llmd-v0.19") == "triton"
    assert set(named.values()) == {None}


def test_calibrate_plans_the_backend_the_log_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vllm#23278's lines without its version line: kvplan would plan the newest
    # release's Hopper default (Triton, 64.28 GiB); the Marlin WARNING makes it Marlin's
    # layout, what the log loaded.
    log = tmp_path / "vllm-23278.log"
    log.write_text("".join(VLLM_23278.splitlines(True)[1:]))
    model = str(ROOT / "examples/models/gpt-oss-120b")
    assert main(["calibrate", str(log), "--model", model, "--gpu", "H100", "--json"]) == 0
    rows = {row["figure"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    weights = rows["model loading (weights) per worker"]
    assert weights["measured"] == 65.9651
    assert abs(weights["error"]) < 0.005
