"""The importer against vLLM's own model code: each shipped config is built by vLLM
0.33's and 0.34's model classes on the meta device (tests/models/vllm_model_side.py, in
the release's CPU venv) and every cache layer's `get_kv_cache_spec` is compared with the
importer's layer for the same tensor-parallel size and KV cache dtype: kind, KV heads
per rank, head size, dtype, window / chunk, Mamba state shapes and dtypes, in order.

Qwen3-Next's and Qwen3.5 / 3.6's module chain imports `compressed_tensors` and
`torchvision`, which the CPU venvs do not install and the meta build does not use: the
side process runs with the import stand-ins of tests/models/vllm_stubs on its path. For
these GDN families, and for Qwen2.5-VL and Qwen3-VL, the parameter count is compared
too: the text model as vLLM builds it, plus a wrapper's vision tower built from
`vision_config`, against `count_params` (which leaves out norms, convolution kernels,
the GDN decay vectors and the text model's biases: under 0.025%).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest

from kvplan.models import Deployment, import_layers, load_config
from kvplan.models.config import HFConfig, ModelConfigError
from kvplan.models.importer import Speculative, text_config
from kvplan.models.layers import ImportedLayer
from kvplan.models.weights import count_params, replicated_params
from tests.vllm_envs import run_in_vllm

MODELS = Path(__file__).parents[2] / "examples" / "models"
SIDE = Path(__file__).with_name("vllm_model_side.py")
RELEASES = ("vllm-0.33", "vllm-0.34")

# (shipped config, tensor-parallel size, KV cache dtype): every config vLLM's model code
# builds on the CPU, at a TP that shards its KV heads, and where it is interesting at one
# that replicates them (more ranks than KV heads).
CASES: tuple[tuple[str, int, str], ...] = (
    ("llama-3.1-8b", 1, "auto"),
    ("llama-3.1-8b", 2, "fp8"),
    ("llama-3.1-8b", 16, "auto"),  # 8 KV heads over 16 ranks: 1 each, replicated
    ("qwen3-8b", 2, "auto"),
    ("qwen2.5-7b-instruct", 2, "auto"),  # 4 KV heads: 2 per rank
    ("qwen2.5-72b-instruct", 4, "auto"),
    ("qwen3-30b-a3b-base", 8, "auto"),  # 4 KV heads over 8 ranks
    ("mistral-7b-v0.3", 2, "auto"),
    ("mixtral-8x7b-instruct", 4, "auto"),
    ("phi-4", 2, "auto"),  # 10 KV heads: 5 per rank
    ("granite-3.3-8b-instruct", 2, "auto"),  # Granite 3.x: Llama's layers, 4 KV heads a rank
    ("gemma-2-9b", 2, "auto"),
    ("gemma-3-27b", 2, "auto"),
    ("gemma-3-4b", 1, "auto"),  # 4 KV heads x 256, heads and head size from the defaults
    ("gpt-oss-120b", 1, "auto"),
    ("gpt-oss-120b", 8, "fp8"),
    ("gpt-oss-20b", 2, "auto"),  # the llm-d calibration record's setting
    ("llama-4-defaults", 8, "auto"),
    ("deepseek-v3", 8, "auto"),  # MLA: one latent head on every rank
    ("deepseek-v3", 2, "fp8"),
    ("jamba-defaults", 2, "auto"),
    ("nemotron-3-nano-30b-a3b", 4, "auto"),  # 2 KV heads replicated over 4 ranks
    ("whisper-small", 2, "auto"),
    ("qwen3.6-27b", 1, "auto"),  # GDN + gated attention, fp32 SSM state from its config
    ("qwen3.6-27b", 2, "fp8"),
    ("qwen3.5-4b", 1, "auto"),  # the dense 4B: tied embeddings, 24-block vision tower
    ("qwen3.5-4b", 4, "fp8"),  # 4 KV heads, 32 GDN value heads over 4 ranks
    ("qwen3.5-moe-35b-a3b-ornith", 1, "auto"),  # Qwen3.5 / 3.6 MoE: 2 KV heads
    ("qwen3.5-moe-35b-a3b-ornith", 4, "fp8"),  # replicated over 4 ranks
    ("qwen3-next-80b-a3b", 1, "auto"),
    ("qwen3-next-80b-a3b", 4, "fp8"),
    ("qwen2.5-vl-7b-instruct", 1, "auto"),  # Qwen2.5-VL: a Qwen2 decoder + windowed ViT
    ("qwen3-vl-8b-instruct", 1, "auto"),  # Qwen3-VL: a Qwen3 decoder + deepstack ViT
)

# Multimodal wrappers whose vLLM class needs processors the CPU venv cannot inspect: the
# language model is built from `text_config` as the family's text-only class, the same
# decoder layers vLLM's wrapper registers under `language_model.`.
TEXT_ONLY = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
}
# The text model's own model_type where the wrapper's would make transformers build
# the multimodal config (Qwen2.5-VL keeps its text fields at the top level).
TEXT_MODEL_TYPE = {
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    "Qwen3VLForConditionalGeneration": "qwen3",
}
# Wrappers whose vision tower is built beside the text model and counted.
QWEN_VISION = ("Qwen3_5", "Qwen2_5_VL", "Qwen3VL")

_KINDS = {
    "full_attention": "FullAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "chunked_local_attention": "ChunkedLocalAttentionSpec",
    "cross_attention": "CrossAttentionSpec",
    "mla_attention": "MLAAttentionSpec",
    "mamba": "MambaSpec",
}


def vllm_input(model: str, directory: Path) -> tuple[Path, bool]:
    """The config directory vLLM builds (a text-only rewrite for multimodal wrappers,
    without `quantization_config`, which changes weights but no cache layer), and
    whether vLLM names the layers as the importer does."""
    raw = json.loads((MODELS / model / "config.json").read_text())
    raw.pop("quantization_config", None)
    architecture = raw["architectures"][0]
    renamed = architecture in TEXT_ONLY or architecture.startswith("Whisper")
    if architecture in TEXT_ONLY:
        text = dict(raw.get("text_config", raw))
        text.pop("vision_config", None)
        text["architectures"] = [TEXT_ONLY[architecture]]
        if architecture in TEXT_MODEL_TYPE:
            text["model_type"] = TEXT_MODEL_TYPE[architecture]
        raw = text
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory, not renamed


def row(layer: ImportedLayer) -> list[object]:
    kind = _KINDS[layer.kind]
    if layer.is_state:
        return [
            kind,
            [list(state.shape) for state in layer.states],
            [state.dtype.value for state in layer.states],
        ]
    return [
        kind,
        layer.num_kv_heads,
        layer.head_size,
        layer.dtype.value,
        layer.sliding_window,
        layer.attention_chunk_size,
    ]


def decoder_index(name: str) -> int:
    match = re.search(r"layers\.(\d+)", name)
    assert match is not None, name
    return int(match.group(1))


@pytest.fixture(scope="module", params=RELEASES)
def vllm_specs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[list[list[object]]], list[int]]:
    engine_version: str = request.param
    release = engine_version.removeprefix("vllm-")
    root = tmp_path_factory.mktemp(engine_version)
    cases = []
    for model, tp, kv_dtype in CASES:
        directory, _ = vllm_input(model, root / model)
        length = 448 if model.startswith("whisper") else 4096
        case = {"path": str(directory), "tp": tp, "max_model_len": length,
                "kv_cache_dtype": kv_dtype}  # fmt: skip
        raw = json.loads((MODELS / model / "config.json").read_text())
        if raw["architectures"][0].startswith(QWEN_VISION):
            case["vision"] = raw["vision_config"]
            case["vision_kind"] = raw["model_type"]
        cases.append(case)
    # vLLM's Llama layers with `is_causal: false` (encoder-only attention): no spec at all
    bidirectional = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    bidirectional["is_causal"] = False
    (root / "bidirectional").mkdir()
    (root / "bidirectional" / "config.json").write_text(json.dumps(bidirectional))
    cases.append(
        {
            "path": str(root / "bidirectional"),
            "tp": 1,
            "max_model_len": 4096,
            "kv_cache_dtype": "auto",
        }
    )
    with socket.socket() as probe:  # a free loopback port for the one-rank gloo group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    answer = run_in_vllm(release, [str(SIDE)], {"port": port, "cases": cases}, cache_root=root)
    return engine_version, answer["specs"], answer["parameters"]


def test_importer_layers_match_vllm_model_code(
    vllm_specs: tuple[str, list[list[list[object]]], list[int]], tmp_path: Path
) -> None:
    engine_version, specs, _ = vllm_specs
    assert len(specs) == len(CASES) + 1
    assert specs[-1] == [], "is_causal false: vLLM registers no cache layer"
    for (model, tp, kv_dtype), theirs in zip(CASES, specs[:-1], strict=True):
        layers = import_layers(
            load_config(str(MODELS / model)),
            Deployment(tensor_parallel_size=tp, kv_cache_dtype=kv_dtype),
        ).layers
        where = (engine_version, model, tp, kv_dtype)
        assert len(layers) == len(theirs), where
        assert [row(layer) for layer in layers] == [spec[1:] for spec in theirs], where
        assert [decoder_index(layer.name) for layer in layers] == [
            decoder_index(str(spec[0])) for spec in theirs
        ], where
        _, same_names = vllm_input(model, tmp_path / model)
        if same_names:
            assert [layer.name for layer in layers] == [spec[0] for spec in theirs], where


def test_gdn_family_parameters_match_vllm_model_code(
    vllm_specs: tuple[str, list[list[list[object]]], list[int]],
) -> None:
    """Gated attention (the query projection's per-head gate), GDN mixers, the MLP or
    shared expert and router, and the vision tower: kvplan's count against the modules
    vLLM builds, at TP 1. The routed experts are stood in (no kernel oracle on the CPU):
    their weights, `num_experts` x 3 x hidden x `moe_intermediate_size` per layer, are
    added back to vLLM's count."""
    engine_version, _, parameters = vllm_specs
    compared = 0
    for (model, tp, _), theirs in zip(CASES, parameters, strict=False):
        config = load_config(str(MODELS / model))
        family = ("qwen3_5", "qwen3_next", "qwen2_5_vl", "qwen3_vl")
        if tp != 1 or not config.text("model_type").startswith(family):
            continue
        text = config.sub("text_config") or config
        if text.has("num_experts"):
            theirs += text.integer("num_hidden_layers") * (
                text.integer("num_experts") * 3 * text.integer("hidden_size")
                * text.integer("moe_intermediate_size")
            )  # fmt: skip
        ours = count_params(config, import_layers(config)).total
        # What count_params leaves out is at most 0.025%: Qwen3.5-4B's norms (173,568),
        # GDN convolution kernels (786,432) and decay vectors (1,536), 0.021%, the most.
        assert 0 <= theirs - ours < 2.5e-4 * theirs, (engine_version, model, ours, theirs)
        compared += 1
    assert compared == 6


def test_every_shipped_config_is_compared_somewhere() -> None:
    """Every shipped config is built by vLLM's model code here."""
    built = {model for model, _, _ in CASES}
    shipped = {path.name for path in MODELS.iterdir() if path.is_dir()}
    assert shipped == built


# ModelOpt exclusion lists as NVIDIA's and the community's NVFP4 exports write them.
EXCLUSIONS: tuple[list[str], ...] = (
    ["lm_head", "model.visual*", "mtp*", "*linear_attn*", "*mlp.gate", "*shared_expert_gate"],
    ["lm_head", "*self_attn*", "model.visual*"],
    ["lm_head"],
)


def test_modelopt_exclusions_leave_unquantized_what_vllm_does(tmp_path: Path) -> None:
    """kvplan's unquantized parts of a Qwen3.5 / 3.6 MoE NVFP4 checkpoint against
    vLLM 0.34's ModelOptNvFp4Config.is_layer_excluded on the modules vLLM builds (first
    and last layer of each part)."""
    from kvplan.models.weights import _unquantized_parts

    raw = json.loads((MODELS / "qwen3.5-moe-35b-a3b-ornith" / "config.json").read_text())
    root = "language_model.model.layers"
    prefixes = {
        "attention": [f"{root}.3.self_attn.qkv_proj", f"{root}.39.self_attn.qkv_proj"],
        "state_space": [
            f"{root}.0.linear_attn.in_proj_qkvz",
            f"{root}.38.linear_attn.in_proj_qkvz",
        ],
        "mlp": [f"{root}.0.mlp.experts", f"{root}.39.mlp.experts"],
        "vision": ["visual.blocks.0.attn.qkv", "visual.merger.linear_fc2"],
        "draft": ["mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.mlp.experts"],
    }
    mtp = Deployment(speculative=Speculative("mtp", 1))
    cases: list[dict[str, Any]] = []
    for patterns in EXCLUSIONS:
        quant: dict[str, object] = {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": patterns
        }  # fmt: skip
        cases.append({"quantization_config": quant, "prefixes": prefixes})
    side = str(Path(__file__).with_name("vllm_quant_side.py"))
    answers = run_in_vllm("0.34", [side], {"cases": cases}, cache_root=tmp_path)["excluded"]
    for case, theirs in zip(cases, answers, strict=True):
        quant = case["quantization_config"]
        config = HFConfig({**raw, "quantization_config": quant})
        ignore = quant["ignore"]
        if len(set(theirs["draft"])) > 1:  # vLLM quantizes only part of the MTP layer
            with pytest.raises(ModelConfigError, match="part of the draft weights"):
                _unquantized_parts(config, import_layers(config, mtp))
        else:
            kept = _unquantized_parts(config, import_layers(config, mtp))
            assert ("draft" in kept) == theirs["draft"][0], ignore
        kept = _unquantized_parts(config, import_layers(config))  # no MTP layer loaded
        for part in ("attention", "state_space", "mlp", "vision"):
            assert len(set(theirs[part])) == 1, (ignore, part, theirs[part])  # whole parts
            assert (part in kept) == theirs[part][0], (ignore, part)


def test_fp8_exclusions_leave_unquantized_what_vllm_does(tmp_path: Path) -> None:
    """kvplan's bf16 modules of Qwen3.6-27B-FP8 (tests/data/checkpoints, its
    quantization_config reconstructed from the checkpoint's file sizes) against vLLM
    0.32's Fp8Config decision on the modules vLLM builds, target and MTP drafter: the
    vision tower, every fused in_proj_ba and mtp.fc stay bf16; the fused in_proj_qkvz,
    attention, MLP and the MTP layer are fp8."""
    from kvplan.models.weights import _kept_modules_within, _unquantized_parts

    checkpoint = Path(__file__).parents[2] / "tests" / "data" / "checkpoints" / "qwen3.6-27b-fp8"
    config = load_config(str(checkpoint))
    root = "language_model.model.layers"
    target = {
        "in_proj_ba": [f"{root}.0.linear_attn.in_proj_ba", f"{root}.62.linear_attn.in_proj_ba"],
        "state_space": [f"{root}.0.linear_attn.in_proj_qkvz",
                        f"{root}.62.linear_attn.in_proj_qkvz"],
        "attention": [f"{root}.3.self_attn.qkv_proj", f"{root}.63.self_attn.o_proj"],
        "mlp": [f"{root}.0.mlp.gate_up_proj", f"{root}.63.mlp.down_proj"],
        "vision": ["visual.blocks.0.attn.qkv", "visual.blocks.26.mlp.linear_fc2",
                   "visual.merger.linear_fc1"],
    }  # fmt: skip
    draft = {"fc": ["mtp.fc"], "draft": ["mtp.layers.0.self_attn.qkv_proj",
                                         "mtp.layers.0.mlp.gate_up_proj"]}  # fmt: skip
    payload = {
        "quantization_config": config.raw("quantization_config", {}),
        "target": [prefix for prefixes in target.values() for prefix in prefixes],
        "draft": [prefix for prefixes in draft.values() for prefix in prefixes],
    }
    side = str(Path(__file__).with_name("vllm_fp8_quant_side.py"))
    answers = run_in_vllm("0.32", [side], payload, cache_root=tmp_path)
    theirs: dict[str, set[bool]] = {}
    for parts, answer in ((target, answers["target"]), (draft, answers["draft"])):
        flat = iter(answer)
        for part, prefixes in parts.items():
            theirs[part] = {next(flat) for _ in prefixes}
    assert all(len(decisions) == 1 for decisions in theirs.values()), theirs  # whole parts
    layers = import_layers(config, Deployment(speculative=Speculative("mtp", 1)))
    kept = _unquantized_parts(config, layers)
    per_gdn_layer, fc = _kept_modules_within(config, layers, kept)
    ours = {part: part in kept for part in ("state_space", "attention", "mlp", "vision", "draft")}
    ours |= {"in_proj_ba": per_gdn_layer > 0, "fc": fc > 0}
    assert ours == {part: decisions.pop() for part, decisions in theirs.items()}
    assert ours == {"in_proj_ba": True, "state_space": False, "attention": False, "mlp": False,
                    "vision": True, "fc": True, "draft": False}  # fmt: skip


# Checkpoint configs (tests/data/checkpoints) whose whole vLLM wrapper builds on the CPU:
# LLaVA-Next needs no processor to build, so its tower, projector and language model
# are vLLM's own (llava.py imports pixtral.py, whose `mistral_common` import gets the
# stand-ins of tests/models/vllm_stubs; the SigLIP path uses none of it).
CHECKPOINTS = Path(__file__).parents[1] / "data" / "checkpoints"
WHOLE_WRAPPER = """
import runpy, sys
sys.path.insert(0, {models!r})
import vllm_encoder_side
vllm_encoder_side._stand_in_mistral_common()
runpy.run_path({side!r}, run_name="__main__")
"""


def _whole_wrapper_parameters(release: str, directory: Path, tmp_path: Path,
                              max_model_len: int = 8192, tp: int = 1) -> list[int]:  # fmt: skip
    """Build the checkpoint's whole wrapper with vLLM's model code on the meta device
    (TP 1 unless given: one rank's modules; 8,192 tokens unless the model is shorter),
    check every cache layer's spec and name against kvplan's import, and return vLLM's
    parameter count."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = WHOLE_WRAPPER.format(models=str(SIDE.parent), side=str(SIDE))
    case = {"path": str(directory), "tp": tp, "max_model_len": max_model_len,
            "kv_cache_dtype": "auto"}  # fmt: skip
    answer = run_in_vllm(release, ["-c", code], {"port": port, "cases": [case]},
                         cache_root=tmp_path)  # fmt: skip
    deployment = Deployment(tensor_parallel_size=tp)
    layers = import_layers(load_config(str(directory)), deployment).layers
    theirs = answer["specs"][0]
    assert [row(layer) for layer in layers] == [spec[1:] for spec in theirs]
    assert [layer.name for layer in layers] == [
        spec[0].removeprefix("language_model.") for spec in theirs
    ]
    parameters: list[int] = answer["parameters"]
    return parameters


@pytest.mark.parametrize("release", [r.removeprefix("vllm-") for r in RELEASES])
def test_llava_next_wrapper_matches_vllm_model_code(release: str, tmp_path: Path) -> None:
    """Granite Vision 3.3 2B as vLLM builds LlavaNextForConditionalGeneration on the
    meta device: every cache layer's spec, and the parameters, which are kvplan's
    count plus the text model's RMSNorm weights count_params leaves out (2 per layer
    and the final one, 2,048 each)."""
    directory = CHECKPOINTS / "granite-vision-3.3-2b"
    parameters = _whole_wrapper_parameters(release, directory, tmp_path)
    config = load_config(str(directory))
    text = config.sub("text_config")
    assert text is not None
    norms = (2 * text.integer("num_hidden_layers") + 1) * text.integer("hidden_size")
    assert parameters == [count_params(config, import_layers(config)).total + norms]


@pytest.mark.parametrize("release", [r.removeprefix("vllm-") for r in RELEASES])
@pytest.mark.parametrize("name", ["llava-v1.6-mistral-7b-hf", "llava-1.5-7b-hf", "vicuna-next"])
def test_clip_llava_wrappers_match_vllm_model_code(name: str, release: str,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """LLaVA-Next over CLIP and Mistral 7B (llava-v1.6-mistral-7b-hf) and LLaVA 1.5 over
    CLIP and Vicuna 7B (llava-1.5-7b-hf, LlavaForConditionalGeneration) as vLLM builds
    them on the meta device from the published files, whose text_config names no widths
    (transformers' MistralConfig / LlamaConfig fill them, as kvplan's defaults do); and
    LLaVA-Next over CLIP and a Llama-class text model ("vicuna-next": the first file
    with the second's Vicuna text_config, as llava-v1.6-vicuna-7b-hf pairs them; no
    stored corpus holds that file). Every cache layer's spec (Mistral's
    "sliding_window": null: full attention), and the parameters, which are kvplan's
    count plus the text model's RMSNorm weights (two a layer and the final one, 4,096
    each); the CLIP tower's 23 of 24 layers, its class and position embeddings and
    pre-layernorm are in kvplan's count."""
    directory = CHECKPOINTS / name
    if name == "vicuna-next":
        wrapper = json.loads((CHECKPOINTS / "llava-v1.6-mistral-7b-hf" / "config.json").read_text())
        vicuna = json.loads((CHECKPOINTS / "llava-1.5-7b-hf" / "config.json").read_text())
        directory = tmp_path / name
        directory.mkdir()
        raw = {**wrapper, "text_config": vicuna["text_config"]}
        (directory / "config.json").write_text(json.dumps(raw))
    config = load_config(str(directory))
    layers = import_layers(config)
    length = min(8192, layers.derived_max_model_len)  # LLaVA 1.5's Vicuna: 4,096
    parameters = _whole_wrapper_parameters(release, directory, tmp_path, length)
    text = text_config(config, layers.architecture)
    norms = (2 * text.integer("num_hidden_layers") + 1) * text.integer("hidden_size")
    assert parameters == [count_params(config, layers).total + norms]
    assert {layer.kind for layer in layers.layers} == {"full_attention"}


@pytest.mark.parametrize("release", [r.removeprefix("vllm-") for r in RELEASES])
@pytest.mark.parametrize(
    ("name", "whole"),
    [("llava-v1.6-mistral-7b-hf", 1_345_536), ("llava-1.5-7b-hf", 1_341_440),
     ("granite-vision-3.3-2b", 1_709_056)],
)  # fmt: skip
def test_llava_wrappers_at_tp_2_match_vllm_model_code(name: str, whole: int, release: str,
                                                      tmp_path: Path) -> None:  # fmt: skip
    """One rank of the LLaVA wrappers at TP 2 as vLLM builds it on the meta device: the
    text model, the tower and the projector shard, and what stays whole on each rank
    (`replicated_params`: the tower's stem, its LayerNorms and row-parallel biases, the
    projector's linear_2 bias, LLaVA-Next's newline; CLIP's 1,196,032-parameter stem is
    most of it) is counted once, beside the text model's RMSNorms, which kvplan leaves
    out and vLLM keeps whole too."""
    directory = CHECKPOINTS / name
    config = load_config(str(directory))
    layers = import_layers(config, Deployment(tensor_parallel_size=2))
    length = min(8192, layers.derived_max_model_len)
    parameters = _whole_wrapper_parameters(release, directory, tmp_path, length, tp=2)
    text = text_config(config, layers.architecture)
    norms = (2 * text.integer("num_hidden_layers") + 1) * text.integer("hidden_size")
    kept = replicated_params(config, layers, text.integer("num_hidden_layers"))
    assert kept == whole
    total = count_params(config, layers).total
    assert (total - kept) % 2 == 0
    assert parameters == [(total - kept) // 2 + kept + norms]


@pytest.mark.parametrize("release", [r.removeprefix("vllm-") for r in RELEASES])
def test_kimi_vl_wrapper_matches_vllm_model_code(release: str, tmp_path: Path) -> None:
    """Kimi-VL-A3B as vLLM builds KimiVLForConditionalGeneration on the meta device
    (MoonViT, the projector and DeepseekV2ForCausalLM from `text_config`): every cache
    layer's spec (MLA: one 576-wide latent head), and the parameters: the routed
    experts are stood in (added back: 26 MoE layers x 64 x 3 x 2,048 x 1,408), and what
    count_params leaves out is the text model's RMSNorms (two a layer, MLA's
    `kv_a_layernorm` and the final one) and the routers' `e_score_correction_bias`."""
    directory = CHECKPOINTS / "kimi-vl-a3b-instruct"
    parameters = _whole_wrapper_parameters(release, directory, tmp_path)
    config = load_config(str(directory))
    text = config.sub("text_config")
    assert text is not None
    count, hidden = text.integer("num_hidden_layers"), text.integer("hidden_size")
    moe_layers = count - text.integer("first_k_dense_replace")
    experts = text.integer("n_routed_experts")
    routed = moe_layers * experts * 3 * hidden * text.integer("moe_intermediate_size")
    norms = count * (2 * hidden + text.integer("kv_lora_rank")) + hidden
    ours = count_params(config, import_layers(config)).total
    assert parameters == [ours - routed + norms + moe_layers * experts]
