"""Pipeline stages against vLLM itself: the decoder layers of each stage (vLLM's
`get_pp_indices`, with and without VLLM_PP_LAYER_PARTITION, in all three CPU venvs) and
which stages hold the embedding and LM-head tables (vLLM 0.34's model classes built per
stage on the meta device, tests/models/vllm_pp_side.py), beside kvplan's
`pipeline_stage_bounds` and `stage_params`."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvplan.gpus import lookup_gpu
from kvplan.models import Deployment, import_layers, load_config
from kvplan.models.config import HFConfig, ModelConfigError
from kvplan.models.importer import pipeline_stage_bounds, text_config
from kvplan.models.weights import (
    _vision_params,
    count_params,
    estimate_overhead,
    estimate_weights,
    rope_cache_bytes,
    stage_params,
)
from tests.models.test_against_vllm_model_code import vllm_input
from tests.vllm_envs import run_in_vllm

MODELS = Path(__file__).parents[2] / "examples" / "models"
SIDE = Path(__file__).with_name("vllm_pp_side.py")

# (decoder layers, stages, VLLM_PP_LAYER_PARTITION or None)
PARTITIONS: list[tuple[int, int, str | None]] = [
    (layers, pp, None)
    for layers in (7, 26, 30, 32, 36, 40, 46, 48, 61, 94)
    for pp in (2, 3, 4, 5, 8)
    if layers >= pp
] + [
    (32, 2, "20,12"),
    (32, 3, "0,16,16"),  # a stage may hold no decoder layer
    (61, 4, "16,15,15,15"),
    (32, 2, "20,11"),  # the counts must add up to the model's layers
    (32, 2, "32"),  # and name every stage
]
# vLLM 0.34 also refuses a negative count (0.32 and 0.33 do not check it).
NEGATIVE = (32, 2, "40,-8")

# (shipped config, stages): families that build their tables only at the ends (Llama,
# Qwen3, Phi-3, DeepSeek) and on every stage (Mixtral, Qwen3-MoE, Gemma 2 / 3, gpt-oss,
# Jamba, Nemotron-H).
STAGE_MODELS: tuple[tuple[str, int], ...] = (
    ("llama-3.1-8b", 3),
    ("llama-3.1-8b-tied", 2),  # a tied head: the last stage builds its own table
    ("mistral-7b-v0.3", 2),
    ("llama-4-defaults", 2),
    ("qwen3-8b", 2),
    ("phi-4", 2),
    ("granite-3.3-8b-instruct", 2),  # tied: the last stage builds its own table
    ("deepseek-v3", 2),
    ("mixtral-8x7b-instruct", 2),
    ("qwen3-30b-a3b-base", 3),
    ("gemma-2-9b", 2),
    ("gemma-3-27b", 2),
    ("gpt-oss-120b", 2),
    ("jamba-defaults", 2),
    ("nemotron-3-nano-30b-a3b", 2),
    ("qwen3.6-27b", 3),  # the embedding on every stage, the LM head on the last
    ("qwen3.5-moe-35b-a3b-ornith", 2),
    ("qwen3-next-80b-a3b", 2),
)


def _config_dir(model: str, root: Path) -> Path:
    if model == "llama-3.1-8b-tied":
        raw = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
        raw["tie_word_embeddings"] = True
        (root / model).mkdir(parents=True)
        (root / model / "config.json").write_text(json.dumps(raw))
        return root / model
    directory, _ = vllm_input(model, root / model)
    return directory


def _kvplan_config(model: str, root: Path) -> HFConfig:
    if model == "llama-3.1-8b-tied":
        return load_config(str(root / model / "config.json"))
    return load_config(str(MODELS / model / "config.json"))


def _run(release: str, payload: Mapping[str, object], root: Path) -> dict[str, list[object]]:
    with socket.socket() as probe:  # a free loopback port for the one-rank gloo group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    answer: dict[str, list[object]] = run_in_vllm(
        release, [str(SIDE)], {"port": port, **payload}, cache_root=root
    )
    return answer


def _kvplan_partition(layers: int, pp: int, env: str | None) -> object:
    partition = None if env is None else tuple(int(part) for part in env.split(","))
    try:
        return [list(pipeline_stage_bounds(layers, rank, pp, partition)) for rank in range(pp)]
    except ModelConfigError as error:
        return f"error: {error}"


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_stage_layers_match_vllm_get_pp_indices(release: str, tmp_path: Path) -> None:
    cases = PARTITIONS + ([NEGATIVE] if release == "0.34" else [])
    payload = {
        "partitions": [{"layers": n, "pp": pp, "env": env} for n, pp, env in cases],
        "stages": [],
    }
    answers = _run(release, payload, tmp_path)["partitions"]
    assert len(answers) == len(cases)
    for (layers, pp, env), theirs in zip(cases, answers, strict=True):
        ours = _kvplan_partition(layers, pp, env)
        if isinstance(theirs, str):  # vLLM refuses it: so does kvplan
            assert isinstance(ours, str) and "VLLM_PP_LAYER_PARTITION" in ours, (env, ours)
        else:
            assert ours == theirs, (layers, pp, env)


def test_stage_tables_and_layers_match_vllm_model_code(tmp_path: Path) -> None:
    stages = []
    for model, pp in STAGE_MODELS:
        directory = _config_dir(model, tmp_path)
        stages += [{"path": str(directory), "pp": pp, "rank": rank} for rank in range(pp)]
    answers = iter(_run("0.34", {"partitions": [], "stages": stages}, tmp_path)["stages"])
    for model, pp in STAGE_MODELS:
        config = _kvplan_config(model, tmp_path)
        layers = import_layers(config)
        count = layers.num_hidden_layers
        bounds = [pipeline_stage_bounds(count, rank, pp) for rank in range(pp)]
        ours = stage_params(config, layers, bounds)
        for rank in range(pp):
            theirs = next(answers)
            assert isinstance(theirs, dict)
            assert theirs["layers"] == list(bounds[rank]), (model, rank)
            assert ours[rank].embedding == theirs["embedding_params"], (model, rank)
            # The RoPE caches every stage builds with its layers, in bytes.
            assert rope_cache_bytes(config, layers) == theirs["rope_cache_bytes"], model


def test_stage_weights_add_up_to_the_model() -> None:
    # Every stage's rank at TP 1, summed: the whole model, plus one table per extra
    # stage for families that build them everywhere (two untied, one tied), plus the
    # tied head's own copy on the last stage for the others.
    for model, extra_tables in (("llama-3.1-8b", 0), ("mixtral-8x7b-instruct", 2 * 2),
                                ("gemma-2-9b", 1 * 2)):  # fmt: skip
        config = load_config(str(MODELS / model / "config.json"))
        layers = import_layers(config, Deployment())
        whole = estimate_weights(config, layers, 1, 1)
        split = estimate_weights(config, layers, 1, 3)
        table = config.integer("vocab_size") * config.integer("hidden_size") * 2  # bf16
        rope = split.rope_cache_bytes  # built on every stage
        assert sum(split.bytes_per_stage) == whole.bytes_total + extra_tables * table + 3 * rope
        assert split.bytes_per_worker == max(split.bytes_per_stage)


def test_cli_plans_each_stage_with_its_own_weights(capsys: pytest.CaptureFixture[str]) -> None:
    from kvplan.cli import main

    model = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100", "-pp", "2"]
    assert main([*model, "--pp-layer-partition", "20,12", "--max-model-len", "8K", "--json"]) == 0
    workers = json.loads(capsys.readouterr().out)["workers"]
    non_kv = [int(worker["budget"]["non_kv_bytes"]) for worker in workers]
    config = load_config(str(MODELS / "llama-3.1-8b" / "config.json"))
    layers = import_layers(config)
    split = estimate_weights(config, layers, 1, 2, pp_layer_partition=(20, 12))
    # Each stage's worker carries its own weights and its own runtime part: only the
    # last stage samples, and it holds the hidden states it receives (vllm serve's
    # H100 defaults: 8,192 batched tokens, 1,024 sequences).
    h100 = lookup_gpu("H100")
    runtime = [
        estimate_overhead(
            config,
            layers,
            1,
            8192,
            1024,
            "",
            max_model_len=8192,
            gpu_arch=h100.arch,
            pipeline_stage=stage,
            pipeline_parallel_size=2,
        ).total_bytes
        for stage in range(2)
    ]
    assert non_kv == [split.bytes_per_stage[stage] + runtime[stage] for stage in range(2)]
    assert split.bytes_per_stage[0] > split.bytes_per_stage[1] and runtime[1] > runtime[0]
    assert main([*model, "--pp-layer-partition", "20,11"]) == 2
    assert "VLLM_PP_LAYER_PARTITION 20,11 adds up to 31 layers" in capsys.readouterr().err
    request = str(Path(__file__).parents[2] / "examples" / "llama-3.1-8b.yaml")
    assert main(["plan", request, "--pp-layer-partition", "16,16"]) == 2
    assert "--pp-layer-partition applies to --model only" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model", sorted(p.name for p in MODELS.iterdir() if p.is_dir() and "whisper" not in p.name)
)
def test_stages_share_out_every_decoder_layer(model: str) -> None:
    config = load_config(str(MODELS / model / "config.json"))
    layers = import_layers(config)
    whole = count_params(config, layers)
    bounds = [pipeline_stage_bounds(layers.num_hidden_layers, rank, 3) for rank in range(3)]
    stages = stage_params(config, layers, bounds)
    # The vision tower (Gemma 3's, Qwen3.5's) is on every stage, counted once in the whole.
    vision = _vision_params(config, text_config(config, layers.architecture).integer("hidden_size"))
    assert whole.vision == vision and all(stage.vision == vision for stage in stages)
    for part in ("attention", "mlp", "state_space", "router"):
        assert sum(getattr(stage, part) for stage in stages) == getattr(whole, part), part
