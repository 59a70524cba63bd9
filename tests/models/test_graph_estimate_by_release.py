"""Which CUDA graphs each vLLM release counts in the estimate it subtracts before sizing
the KV cache, and on which model runner (docs/capacity.md, "The CUDA-graph estimate").

Read in the 0.20.0-0.31.0 wheels (vllm/config/vllm.py `_set_cudagraph_sizes` and
`use_v2_model_runner`, vllm/v1/worker/gpu_model_runner.py and gpu/model_runner.py
`profile_cudagraph_memory`, gpu/cudagraph_utils.py) and the 0.32-0.34 CPU venvs; the
venv checks below run 0.32-0.34's own code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplan.models.calibrate import parse_log
from kvplan.models.config import HFConfig, load_config
from kvplan.models.importer import Deployment, ModelLayers, import_layers
from kvplan.models.profiling import (
    PROFILES,
    RunnerModel,
    cudagraph_capture_sizes,
    cudagraph_estimate,
    default_runner_is_v2,
    gdn_graph_transient,
    graph_estimate_runs,
)
from kvplan.models.weights import estimate_overhead, runner_model
from tests.vllm_envs import run_in_vllm

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "tests" / "data" / "calibration"


def _model(architecture: str, *, moe: bool = False, quantized: bool = False,
           state: bool = False, attention: bool = True) -> RunnerModel:  # fmt: skip
    return RunnerModel(architecture, moe, quantized, state, attention)


LLAMA = _model("LlamaForCausalLM")
QWEN3 = _model("Qwen3ForCausalLM")
QWEN2 = _model("Qwen2ForCausalLM")
MIXTRAL = _model("MixtralForCausalLM", moe=True)
QWEN2_MOE = _model("Qwen2MoeForCausalLM", moe=True)
QWEN3_5 = _model("Qwen3_5ForConditionalGeneration", state=True)  # GDN + gated attention
MAMBA = _model("MambaForCausalLM", state=True, attention=False)
QWEN2_5_VL = _model("Qwen2_5_VLForConditionalGeneration")


def test_the_grid_gains_max_num_batched_tokens_from_0_20_1() -> None:
    # 0.20.0's `_set_cudagraph_sizes` builds the 1, 2, 4, 8k, 16k grid only; 0.20.1
    # appends max_num_batched_tokens where it is within the cap (as 0.17-0.19 did not).
    assert cudagraph_capture_sizes(256, 300, "0.20.0")[-1] == 288
    assert cudagraph_capture_sizes(256, 300, "0.20.1")[-1] == 300
    assert cudagraph_capture_sizes(256, 300, "0.19.0") == cudagraph_capture_sizes(
        256, 300, "0.20.0"
    )


def test_the_grid_gains_max_num_seqs_from_0_31() -> None:
    # 0.31.0 adds `uniform_decode_sizes = [max_num_seqs]` (where it is within the cap),
    # so an off-grid max_num_seqs gets its own PIECEWISE and FULL graph; 0.30 does not.
    old, new = (
        cudagraph_capture_sizes(100, 8192, "0.30.0"),
        cudagraph_capture_sizes(100, 8192, "0.31.0"),
    )
    assert 100 not in old and 100 in new
    assert len(new) == len(old) + 1
    assert [s for s in old if s <= 100][-1] == 96  # the largest FULL graph before 0.31
    assert cudagraph_capture_sizes(100, 8192) == new  # kvplan's newest (0.32-0.34)


def test_data_centre_blackwell_captures_to_1024_from_0_28() -> None:
    # 0.28.0: `default_max_graph_size = 1024 if is_device_capability_family(100) else
    # 512` (SM 10.x: the catalog's "blackwell" parts, B200 / B300); before, 512 everywhere.
    assert cudagraph_capture_sizes(1024, 8192, "0.27.1", "blackwell")[-1] == 512
    assert cudagraph_capture_sizes(1024, 8192, "0.28.0", "blackwell")[-1] == 1024
    assert cudagraph_capture_sizes(1024, 8192, "vllm-0.34", "hopper")[-1] == 512
    # 1, 2, 4, 31 multiples of 8, then 256..1024 by 16: 83 PIECEWISE graphs, not 51.
    assert len(cudagraph_capture_sizes(1024, 8192, "vllm-0.33", "blackwell")) == 83
    assert len(cudagraph_capture_sizes(1024, 8192, "vllm-0.33")) == 51


@pytest.mark.parametrize(
    ("model", "v2_from"),
    [
        (QWEN3, "0.22.0"),  # 0.22's list is Qwen3ForCausalLM alone
        (LLAMA, "0.23.0"),  # 0.23 adds Llama and Mistral
        (QWEN2_MOE, "0.24.0"),  # 0.24 adds DeepseekV2, Qwen2Moe, GraniteMoe (MoE allowed)
        (QWEN2, "0.25.0"),  # 0.25: any dense, non-hybrid model
        (QWEN2_5_VL, "0.25.0"),
        (MIXTRAL, "0.29.0"),  # an unlisted MoE: V1 until 0.29 makes V2 the default for all
        (QWEN3_5, "0.29.0"),  # hybrids: refused 0.25-0.26, unlisted ones 0.27-0.28
        (MAMBA, "0.29.0"),  # attention-free: refused 0.25-0.28
    ],
)
def test_model_runner_v2_becomes_the_default(model: RunnerModel, v2_from: str) -> None:
    # VllmConfig.use_v2_model_runner with VLLM_USE_V2_MODEL_RUNNER unset, per release.
    releases = ["0.20.0", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.25.0", "0.26.0",
                "0.27.0", "0.28.0", "0.29.0", "0.31.0", "vllm-0.33"]  # fmt: skip
    first = releases.index(v2_from)
    assert [default_runner_is_v2(r, model) for r in releases] == [i >= first for i in range(12)]


def test_0_22_and_0_23_keep_quantized_and_moe_models_on_v1() -> None:
    # `_is_default_v2_model_runner_model` in 0.22 / 0.23 ends with `not is_moe and not
    # is_quantized`; 0.24 drops that clause (its list has MoE models).
    fp8_llama = _model("LlamaForCausalLM", quantized=True)
    assert not default_runner_is_v2("0.23.0", fp8_llama)
    assert default_runner_is_v2("0.24.0", fp8_llama)
    assert not default_runner_is_v2("0.23.0", _model("Qwen3ForCausalLM", moe=True))


def test_which_runner_measures_a_graph_estimate() -> None:
    # V1's profile_cudagraph_memory captures the two largest sizes of each mode in
    # every release that has it; Model Runner V2's returns 0 in 0.20-0.28 ("TBD
    # whether we keep this API") and captures one throwaway pass from 0.29; 0.34
    # returns 0 under the extensible KV cache, on unless a block override or
    # kv_cache_memory_bytes turns it off.
    # 0.18.0 first ships the V1 function (0.17.0 has none, nor has the V0 engine).
    assert not graph_estimate_runs("0.17.0", use_v2_model_runner=False)
    assert not graph_estimate_runs("v0", use_v2_model_runner=False)
    assert graph_estimate_runs("0.18.0", use_v2_model_runner=False)
    assert graph_estimate_runs("0.25.0", use_v2_model_runner=False)
    assert graph_estimate_runs("vllm-0.33", use_v2_model_runner=False)
    for release in ("0.20.0", "0.22.0", "0.25.1", "0.28.0"):
        assert not graph_estimate_runs(release, use_v2_model_runner=True), release
    for release in ("0.29.0", "0.31.0", "vllm-0.32", "vllm-0.33", ""):
        assert graph_estimate_runs(release, use_v2_model_runner=True), release
    assert not graph_estimate_runs("vllm-0.34", use_v2_model_runner=True)
    assert not graph_estimate_runs("vllm-0.34", True, extensible_kv_cache=True)
    assert graph_estimate_runs("vllm-0.34", True, extensible_kv_cache=False)


def _llama() -> tuple[HFConfig, ModelLayers]:
    config = load_config(str(ROOT / "examples/models/llama-3.1-8b"))
    return config, import_layers(config, Deployment())


@pytest.mark.parametrize(
    ("release", "runner", "extensible", "subtracts"),
    [
        ("0.21.0", None, None, True),  # V1 by default
        ("0.22.0", None, None, True),  # Llama is not on 0.22's list: V1
        ("0.23.0", None, None, False),  # Llama on V2 by default: nothing measured
        ("0.23.0", False, None, True),  # VLLM_USE_V2_MODEL_RUNNER=0
        ("0.28.0", None, None, False),
        ("0.29.0", None, None, True),  # V2 measures from 0.29
        ("0.31.0", None, None, True),
        ("vllm-0.33", None, None, True),
        ("vllm-0.34", None, None, False),  # the extensible cache measures after capture
        ("vllm-0.34", None, False, True),
    ],
)
def test_llama_3_1_8b_graph_memory_by_release_and_runner(
    release: str, runner: bool | None, extensible: bool | None, subtracts: bool
) -> None:
    config, layers = _llama()
    overhead = estimate_overhead(
        config, layers, 1, 8192, 1024, release,
        use_v2_model_runner=runner, extensible_kv_cache=extensible,
    )  # fmt: skip
    # Where it runs, the same count structure on both runners: every PIECEWISE size
    # and every FULL size up to max_num_seqs (51 + 51 here): 0.84 GiB.
    expected = cudagraph_estimate(PROFILES["v1"], 1024, 8192, 0, release) if subtracts else 0
    assert overhead.cudagraph_bytes == expected
    assert overhead.cudagraph_logged_bytes == expected
    if subtracts:
        assert round(expected / (1 << 30), 2) == 0.84


def test_every_0_2x_record_ran_on_kvplans_default_runner() -> None:
    # The runner a log's lines name (V1's gpu_model_runner.py, V2's model_runner.py)
    # against kvplan's default for the record's model and release: the records whose
    # logged estimate kvplan's graph terms are checked on ran the runner kvplan
    # assumes (0.21-0.24 records on V1, the 0.31 record on V2).
    checked = 0
    for meta_path in sorted(CALIBRATION.glob("*.json")):
        meta = json.loads(meta_path.read_text())
        log = parse_log(meta_path.with_suffix(".log").read_text())
        flags = meta.get("flags") or []
        release = flags[flags.index("--release") + 1] if "--release" in flags else log.release
        if log.model_runner_v2 is None or not meta.get("model") or not release:
            continue
        if not release.startswith(("0.2", "0.3")):
            continue
        config = load_config(ROOT / meta["model"])
        quantization = (
            flags[flags.index("--quantization") + 1] if "--quantization" in flags else None
        )
        model = runner_model(config, import_layers(config, Deployment()), quantization)
        assert default_runner_is_v2(release, model) is log.model_runner_v2, meta_path.name
        checked += 1
    assert checked >= 4


def test_the_logs_name_their_runner() -> None:
    v2 = parse_log((CALIBRATION / "llama-3.1-8b-a100-v0.31.log").read_text())
    v1 = parse_log((CALIBRATION / "qwen3-8b-rtxa5000-lmcache3430-v0.21.log").read_text())
    v0 = parse_log((CALIBRATION / "llama-3.1-8b-rtx3090-vllm10517.log").read_text())
    assert (v2.model_runner_v2, v1.model_runner_v2, v0.model_runner_v2) == (True, False, None)


VLLM_0_34_SIDE = """
import json, types
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
runner = types.SimpleNamespace(
    cache_config=types.SimpleNamespace(enable_extensible_kv_cache=True))
answer = {"extensible": GPUModelRunner.profile_cudagraph_memory(runner)}
runner.cache_config.enable_extensible_kv_cache = False
try:
    answer["classic"] = GPUModelRunner.profile_cudagraph_memory(runner)
except AttributeError as error:  # it went on to measure (the stand-in has no eplb)
    answer["classic"] = "measures: " + str(error)
print(json.dumps(answer))
"""


def test_0_34_measures_nothing_before_sizing_an_extensible_cache(tmp_path: Path) -> None:
    # vLLM 0.34's own Model Runner V2: profile_cudagraph_memory returns 0 under the
    # extensible KV cache, and goes on to capture without it.
    answer = run_in_vllm("0.34", ["-c", VLLM_0_34_SIDE], {}, cache_root=tmp_path)
    assert answer["extensible"] == 0
    assert str(answer["classic"]).startswith("measures: ") and "eplb" in answer["classic"]


@pytest.mark.parametrize("release", ["0.32", "0.33"])
@pytest.mark.parametrize("model", ["llama-3.1-8b", "mixtral-8x7b-instruct", "qwen3.6-27b"])
def test_0_32_and_0_33_pick_v2_as_kvplan_does(release: str, model: str, tmp_path: Path) -> None:
    # The releases' own VllmConfig.use_v2_model_runner (Triton taken as present, as on
    # CUDA) for a dense, an MoE and a hybrid GDN model: V2, as default_runner_is_v2 says.
    side = str(Path(__file__).with_name("vllm_runner_choice_side.py"))
    path = ROOT / "examples/models" / model
    answer = run_in_vllm(release, [side], {"path": str(path)}, cache_root=tmp_path)
    config = load_config(str(path))
    ours = default_runner_is_v2(
        f"vllm-{release}", runner_model(config, import_layers(config, Deployment()))
    )
    assert answer["v2_by_default"] is ours is True, answer


def test_the_gdn_long_sample_takes_the_releases_largest_full_size() -> None:
    # 0.26-0.28's V1 profiler runs its long sample at the largest FULL capture size;
    # those releases add no off-grid max_num_seqs (0.31 does), so with 100 sequences
    # that size is the grid's 96: 96 requests x (32,768 // 96 = 341) context tokens.
    config = load_config(str(ROOT / "examples/models/qwen3.6-27b"))
    layers = import_layers(config, Deployment())
    rules = PROFILES["v1-0.26"]
    per_token = rules.gdn_graph_transient_per_context_token
    assert gdn_graph_transient(rules, layers, 100, 32_768, 262_144, "0.27.0") == (
        96 * (32_768 // 96) * per_token
    )
    assert gdn_graph_transient(rules, layers, 100, 32_768, 262_144) == 100 * 327 * per_token
    # On B200 / B300 0.28 captures to 1,024 (512 elsewhere): with 1,024 sequences the
    # long sample runs 1,024 requests, each at min(40, 32,768 // 1,024) context tokens,
    # the capture list the graph estimate itself uses on that part.
    on_blackwell = gdn_graph_transient(rules, layers, 1024, 32_768, 40, "0.28.0", "blackwell")
    assert on_blackwell == 1024 * 32 * per_token
    assert gdn_graph_transient(rules, layers, 1024, 32_768, 40, "0.28.0") == 512 * 40 * per_token
