"""The fleet's fingerprint and what its measurements say (kvplan.client.fleet)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplan.client.fleet import (
    config_key,
    fleet_figures,
    gpu_name,
    mm_limits_text,
    model_config_hash,
    runtime_matches,
)
from kvplan.gpus import lookup_gpu
from kvplan.v1 import service_pb2

GIB = 1 << 30
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0",
    "_name_or_path": "/models/llama",
}


def fingerprint(**fields: object) -> service_pb2.ConfigFingerprint:
    values: dict[str, object] = {
        "model_config_hash": model_config_hash(CONFIG),
        "engine_version": "vllm-0.33",
        "gpu_name": "H100-80GB",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "dtype": "bfloat16",
        "kv_cache_dtype": "auto",
    }
    values.update(fields)
    return service_pb2.ConfigFingerprint(**values)  # type: ignore[arg-type]


def test_the_config_hash_ignores_who_saved_it_and_key_order() -> None:
    resaved = dict(reversed(list(CONFIG.items())))
    resaved.update(transformers_version="4.57.1", _name_or_path="meta-llama/x", dtype="bf16")
    assert model_config_hash(resaved) == model_config_hash(CONFIG)
    assert model_config_hash({**CONFIG, "num_hidden_layers": 31}) != model_config_hash(CONFIG)


def test_gpu_names_as_cuda_and_people_spell_them() -> None:
    assert gpu_name("NVIDIA H100 80GB HBM3") == "H100-80GB"
    assert gpu_name("h100") == "H100-80GB"
    assert gpu_name("NVIDIA H200") == "H200-141GB"
    assert gpu_name("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert gpu_name("NVIDIA RTX 9999 Ultra") == "RTX-9999-ULTRA"  # not in the catalog


def test_the_key_is_the_configuration_not_the_runtime_nor_the_spelling() -> None:
    base = config_key(fingerprint())
    assert base.startswith("cfg-")
    same = fingerprint(
        gpu_name="NVIDIA H100 80GB HBM3",
        dtype="torch.bfloat16",
        engine_version="VLLM-0.33",
        kv_cache_dtype="",
        quantization="none",
        max_num_batched_tokens=8192,
        cuda_graphs="FULL_AND_PIECEWISE",
        model="meta-llama/Llama-3.1-8B",
    )
    assert config_key(same) == base
    for changed in (
        fingerprint(tensor_parallel_size=2),
        fingerprint(pipeline_parallel_size=2),
        fingerprint(engine_version="vllm-0.34"),
        fingerprint(gpu_name="H200"),
        fingerprint(kv_cache_dtype="fp8"),
        fingerprint(quantization="fp8"),
        fingerprint(dtype="float16"),
        fingerprint(model_config_hash=model_config_hash({**CONFIG, "hidden_size": 2048})),
    ):
        assert config_key(changed) != base, changed


@given(
    tokens=st.integers(min_value=0, max_value=1 << 20),
    graphs=st.text(max_size=20),
    model=st.text(max_size=20),
)
def test_runtime_fields_never_change_the_key(tokens: int, graphs: str, model: str) -> None:
    assert config_key(
        fingerprint(max_num_batched_tokens=tokens, cuda_graphs=graphs, model=model)
    ) == config_key(fingerprint())


def engine(
    kv: list[int], tokens: int = 8192, graphs: str = "FULL", weights: int | None = None
) -> service_pb2.EngineMeasurement:
    workers = []
    for rank, available in enumerate(kv):
        worker = service_pb2.WorkerMeasurement(
            rank=rank, available_kv_bytes=available, total_bytes=80 * GIB, requested_bytes=72 * GIB
        )
        if weights is not None:
            worker.weights_bytes = weights
        workers.append(worker)
    return service_pb2.EngineMeasurement(
        max_num_batched_tokens=tokens, cuda_graphs=graphs, workers=workers
    )


def test_runtime_matching_treats_unset_as_any() -> None:
    measured = engine([GIB], tokens=8192, graphs="FULL")
    assert runtime_matches(measured, 0, "")
    assert runtime_matches(measured, 8192, "FULL")
    assert not runtime_matches(measured, 4096, "")
    assert not runtime_matches(measured, 0, "PIECEWISE")


def test_figures_take_the_smallest_rank_of_any_engine() -> None:
    assert fleet_figures([]) is None
    figures = fleet_figures(
        [engine([60 * GIB, 59 * GIB], weights=15 * GIB), engine([61 * GIB, 62 * GIB], 4096)]
    )
    assert figures is not None
    assert (figures.engines, figures.ranks) == (2, 2)
    assert figures.min_available_kv_bytes == 59 * GIB
    assert figures.max_available_kv_bytes == 62 * GIB
    assert figures.weights_bytes == 15 * GIB
    assert figures.max_non_kv_bytes == 13 * GIB  # 72 GiB requested, 59 GiB left for KV
    assert figures.total_bytes == 80 * GIB
    assert figures.activation_peak_bytes is None  # no engine reported one
    text = figures.describe()
    assert text.startswith(
        "measured on 2 engines: available KV 59.00 GiB .. 62.00 GiB per worker, non-KV 13.00 GiB"
    )
    assert "weights 15.00 GiB" in text and "activation" not in text
    assert "max_num_batched_tokens 4096" in text and "max_num_batched_tokens 8192" in text


# The keys kvplan gave these two fingerprints before the start-up settings joined the
# key (commit 2c7e10d's client/fleet.py): records kept under them must still be found.
KEY_BEFORE_SETTINGS = {
    1: "cfg-cc9e196dfa17636a5696bfeafb4aad87",
    2: "cfg-0e73488e56599f98e8cd10779783803b",
}


def test_settings_left_at_their_defaults_keep_the_earlier_key() -> None:
    for tp, key in KEY_BEFORE_SETTINGS.items():
        assert config_key(fingerprint(tensor_parallel_size=tp)) == key
        defaults = fingerprint(
            tensor_parallel_size=tp,
            skip_mm_profiling=False,
            limit_mm_per_prompt='{"image": 999}',  # vLLM's default count, spelled out
            language_model_only=False,
        )
        assert config_key(defaults) == key
    # Custom all-reduce exists only in a TP group: the flag at TP 1 changes nothing.
    assert config_key(fingerprint(disable_custom_all_reduce=True)) == KEY_BEFORE_SETTINGS[1]


def test_each_start_up_setting_changes_the_key() -> None:
    base = config_key(fingerprint(tensor_parallel_size=2))
    keys = {
        config_key(fingerprint(tensor_parallel_size=2, **setting))
        for setting in (
            {"disable_custom_all_reduce": True},
            {"skip_mm_profiling": True},
            {"limit_mm_per_prompt": '{"image": 2}'},
            {"limit_mm_per_prompt": '{"image": 0, "video": 0}'},
            {"language_model_only": True},
        )
    }
    assert len(keys) == 5 and base not in keys


def test_limit_spellings_and_language_model_only() -> None:
    one = config_key(fingerprint(limit_mm_per_prompt='{"image": 2, "video": 999}'))
    assert one == config_key(fingerprint(limit_mm_per_prompt='{"image":{"count":2,"width":64}}'))
    assert mm_limits_text({"video": 0, "image": {"count": 2}}) == '{"image":2,"video":0}'
    # Without the tower nothing is profiled: the other flags no longer matter.
    text_only = config_key(fingerprint(language_model_only=True))
    every_flag = fingerprint(
        language_model_only=True, skip_mm_profiling=True, limit_mm_per_prompt='{"image": 3}'
    )
    assert text_only == config_key(every_flag)


def test_the_plugin_and_the_cli_key_a_configuration_alike() -> None:
    """What the plugin reports under (from vLLM's settled config objects) and what
    `plan --model` asks for (from the same flags) are one key, flags set or not."""
    from kvplan.client.vllm_plugin.fleet import fingerprint as reported
    from kvplan.models.config import load_config
    from kvplan.models.encoder import MultimodalOptions
    from kvplan.models.fleet import fingerprint as asked
    from kvplan.models.request import ModelPlanOptions

    gemma = load_config(str(Path(__file__).parents[1] / "examples" / "models" / "gemma-3-27b"))
    h100 = lookup_gpu("H100")

    def vllm_config(disable: bool, limits: dict[str, Any], skip: bool) -> Any:
        multimodal = SimpleNamespace(
            skip_mm_profiling=skip,
            # vLLM keeps each limit as an options object with its count
            limit_per_prompt={key: SimpleNamespace(count=n) for key, n in limits.items()},
            language_model_only=False,
        )
        return SimpleNamespace(
            model_config=SimpleNamespace(
                dtype="torch.bfloat16", quantization=None, model="g", multimodal_config=multimodal
            ),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=2, pipeline_parallel_size=1, disable_custom_all_reduce=disable
            ),
            cache_config=SimpleNamespace(cache_dtype="auto"),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
            compilation_config=None,
        )

    keys = set()
    for disable, limits, skip in ((False, {}, False), (True, {"image": 1}, True)):
        ours = ModelPlanOptions(
            tensor_parallel_size=2,
            disable_custom_all_reduce=disable,
            multimodal=MultimodalOptions(skip, limits),
        )
        theirs = reported(vllm_config(disable, limits, skip), gemma.data, "vllm-0.33", "H100")
        key = config_key(asked(gemma, ours, h100, "vllm-0.33"))
        assert key == config_key(theirs)
        keys.add(key)
    assert len(keys) == 2


VLLM_MULTIMODAL = """
import json, sys
sys.path.insert(0, sys.argv[1])  # the repository: the plugin's own code
from types import SimpleNamespace
from vllm.platforms import current_platform
current_platform.device_type = "cpu"  # the CPU build names no device; argparse needs one
from vllm.config.multimodal import MultiModalConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from kvplan.client.vllm_plugin.fleet import multimodal_settings
parser = FlexibleArgumentParser()
AsyncEngineArgs.add_cli_args(parser)
answers = []
for argv in json.load(sys.stdin):
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))
    config = MultiModalConfig(
        limit_per_prompt=args.limit_mm_per_prompt or {},
        skip_mm_profiling=bool(args.skip_mm_profiling),
        language_model_only=bool(args.language_model_only),
    )
    answers.append(multimodal_settings(SimpleNamespace(multimodal_config=config)))
print(json.dumps(answers))
"""
MULTIMODAL_FLAGS = [
    [],
    ["--skip-mm-profiling"],
    ["--limit-mm-per-prompt", '{"image": {"count": 2, "width": 64, "height": 64}, "video": 0}'],
    ["--limit-mm-per-prompt", '{"image": 999}'],
    ["--language-model-only"],
]


@pytest.mark.parametrize("release", ["0.32", "0.34"])
def test_the_plugin_reads_the_flags_from_vllms_own_config(release: str) -> None:
    """The flags through vLLM's argparse and MultiModalConfig, read by the plugin's own
    code in the release's venv, give the fingerprint fields `plan --model` sends for
    the same flags."""
    from kvplan.cli import build_parser
    from kvplan.models.cli import options_from_args
    from kvplan.models.config import load_config
    from kvplan.models.fleet import fingerprint as asked
    from tests.vllm_envs import run_in_vllm

    # The repository on sys.path from the script, as the other vLLM-side scripts put it
    # (a PYTHONPATH of its own would need a fork server of its own).
    repo = str(Path(__file__).parents[1])
    theirs = run_in_vllm(release, ["-c", VLLM_MULTIMODAL, repo], MULTIMODAL_FLAGS)
    model = Path(__file__).parents[1] / "examples" / "models" / "gemma-3-27b"
    gemma, h100 = load_config(str(model)), lookup_gpu("H100")
    parser = build_parser()
    for argv, settings in zip(MULTIMODAL_FLAGS, theirs, strict=True):
        options = options_from_args(parser.parse_args(["plan", "--model", str(model), *argv]))
        ours = asked(gemma, options, h100, "vllm-0.33")
        # a text-only engine (no multimodal config) sends none: Gemma 3 has one
        assert settings and {name: getattr(ours, name) for name in settings} == settings, argv
