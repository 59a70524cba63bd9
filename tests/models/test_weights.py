"""Weight estimates against published parameter counts and real per-rank figures, and
the one GPU table every path reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplan.cli import main
from kvplan.gpus import CATALOG, GPU_MEMORY_BYTES, lookup_gpu
from kvplan.models.config import HFConfig, ModelConfigError, load_config
from kvplan.models.importer import Deployment, ModelLayers, import_layers
from kvplan.models.weights import (
    _vision_params,
    allocator_rounding_bytes,
    count_params,
    estimate_weights,
    mxfp4_moe_backend,
    weight_rounding_bytes,
)
from server.devices import parse_inventory
from tests.vllm_envs import run_in_vllm

MODELS = Path(__file__).parents[2] / "examples" / "models"
GIB = 2**30
MIB = 2**20

# Total parameters as each Hugging Face model card (or its safetensors index) publishes
# them, for every shipped published config; the MTP / vision parts kvplan does not count
# are noted. jamba-defaults and llama-4-defaults are transformers' defaults, not a
# published checkpoint, so they have no published count.
PUBLISHED_PARAMS: dict[str, tuple[float, str]] = {
    "deepseek-v3": (671e9, "huggingface.co/deepseek-ai/DeepSeek-V3: 671B main model + 14B MTP"),
    "gemma-2-9b": (9.24e9, "huggingface.co/google/gemma-2-9b: 9.24B params (safetensors)"),
    "gemma-3-27b": (27.4e9, "huggingface.co/google/gemma-3-27b-it: 27B + 0.4B SigLIP vision"),
    "gemma-3-4b": (4.3e9, "huggingface.co/google/gemma-3-4b-it: 4.3B params (safetensors)"),
    "gpt-oss-120b": (116.8e9, "openai gpt-oss model card: 116.83B total parameters"),
    "gpt-oss-20b": (20.91e9, "openai gpt-oss model card: 20.91B total parameters"),
    "llama-3.1-8b": (8.03e9, "huggingface.co/meta-llama/Llama-3.1-8B-Instruct: 8.03B"),
    "mistral-7b-v0.3": (7.25e9, "huggingface.co/mistralai/Mistral-7B-Instruct-v0.3: 7.25B"),
    "mixtral-8x7b-instruct": (46.7e9, "huggingface.co/mistralai/Mixtral-8x7B-v0.1: 46.7B"),
    "nemotron-3-nano-30b-a3b": (
        31.6e9,
        "huggingface.co/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16: 31.6B total parameters",
    ),
    "phi-4": (14.7e9, "huggingface.co/microsoft/phi-4: 14.7B params (safetensors)"),
    "granite-3.3-8b-instruct": (
        8_170_864_640,
        "a public table of Granite sizes (code index id 68624493177): Granite 3 8B, "
        "'same arch as granite-3.3-8b', 8,170,864,640 parameters",
    ),
    "qwen2.5-7b-instruct": (
        7.61e9,
        "huggingface.co/Qwen/Qwen2.5-7B-Instruct: Number of Parameters 7.61B",
    ),
    "qwen2.5-72b-instruct": (
        72.7e9,
        "huggingface.co/Qwen/Qwen2.5-72B-Instruct: Number of Parameters 72.7B",
    ),
    "qwen3-30b-a3b-base": (30.5e9, "huggingface.co/Qwen/Qwen3-30B-A3B-Base: 30.5B in total"),
    "qwen3-8b": (8.2e9, "huggingface.co/Qwen/Qwen3-8B: 8.2B"),
    "qwen2.5-vl-7b-instruct": (
        8.29e9,
        "huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct: 8.29B params (safetensors), the ViT included",
    ),
    "qwen3-vl-8b-instruct": (
        8.77e9,
        "huggingface.co/Qwen/Qwen3-VL-8B-Instruct: 8.77B params (safetensors; LM Studio's card "
        "for qwen/qwen3-vl-8b: 8.77B), the ViT and its deepstack mergers included",
    ),
    "qwen3-next-80b-a3b": (80e9, "huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct: 80B total"),
    "whisper-small": (244e6, "huggingface.co/openai/whisper-small: 244M"),
}


def test_every_published_config_has_a_published_count() -> None:
    shipped = {path.name for path in MODELS.iterdir() if path.is_dir()}
    # Qwen3.5 / 3.6: counted against vLLM's own modules (test_against_vllm_model_code.py).
    # Qwen3.5-4B's published 4.66B counts its MTP layer, which vLLM builds only to draft
    # (examples/models/qwen3.5-4b/SOURCE.md: 4.54B without it).
    assert shipped - set(PUBLISHED_PARAMS) == {"jamba-defaults", "llama-4-defaults", "qwen3.6-27b",
                                               "qwen3.5-moe-35b-a3b-ornith",
                                               "qwen3.5-4b"}  # fmt: skip


@pytest.mark.parametrize("model", sorted(PUBLISHED_PARAMS))
def test_weight_total_matches_the_published_count(model: str) -> None:
    config = load_config(str(MODELS / model / "config.json"))
    published, _source = PUBLISHED_PARAMS[model]
    total = count_params(config, import_layers(config)).total
    assert abs(total - published) / published < 0.015, (model, total)


def test_llama_4_vision_tower_matches_the_published_module_table() -> None:
    """Llama 4 Scout's vision model and projector, counted from its vision_config,
    against the per-module parameter table printed from the checkpoint's model
    (tests/data/llama-4-scout-vision.json: layer 0's rows, 34 layers)."""
    data = json.loads(
        (Path(__file__).parents[1] / "data" / "llama-4-scout-vision.json").read_text()
    )
    rows = data["module_parameters"]
    layer = sum(v for k, v in rows.items() if ".layers.0." in k)
    rest = sum(v for k, v in rows.items() if ".layers.0." not in k)
    published = rest + data["vision_config"]["num_hidden_layers"] * layer
    config = HFConfig({"model_type": "llama4", "vision_config": data["vision_config"],
                       "text_config": {"hidden_size": data["text_hidden_size"]}})  # fmt: skip
    assert _vision_params(config, data["text_hidden_size"]) == published == 871_932_416


def test_llama_4_vision_stays_unquantized() -> None:
    # vLLM 0.32-0.34 build Llama4VisionModel and its projector with quant_config=None:
    # an fp8 checkpoint's tower stays in bf16, whatever its exclusion list says.
    raw = json.loads((MODELS / "llama-4-defaults" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "ignored_layers": ["lm_head"],
                                  "weight_block_size": [128, 128]}  # fmt: skip
    config = HFConfig(raw)
    layers = import_layers(config)
    params = count_params(config, layers)
    fp8 = estimate_weights(config, layers, 1)
    quantized = params.total - params.embedding - params.router - params.vision
    kept = (params.embedding + params.router + params.vision) * 2
    assert fp8.bytes_total == int(kept + quantized * (1 + 4 / (128 * 128)))


def test_nemotron_relu2_experts_have_two_matrices() -> None:
    # 23 MoE layers of 128 routed experts (up + down, relu^2) and one shared expert of
    # moe_shared_expert_intermediate_size 3712, plus the router.
    config = load_config(str(MODELS / "nemotron-3-nano-30b-a3b" / "config.json"))
    params = count_params(config, import_layers(config))
    assert params.mlp == 23 * (128 * 2 * 2688 * 1856 + 2 * 2688 * 3712)
    assert params.router == 23 * 128 * 2688


def test_nemotron_fits_one_h100(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", str(MODELS / "nemotron-3-nano-30b-a3b"), "--gpu", "H100"]
    assert main([*args, "--max-model-len", "32K"]) == 0
    assert "capacity of" in capsys.readouterr().out


def test_a_zero_shared_expert_size_means_none() -> None:
    # Qwen3-Coder-30B-A3B-Instruct publishes shared_expert_intermediate_size 0 on the
    # Qwen3-MoE shapes: no shared expert, not an error.
    raw = json.loads((MODELS / "qwen3-30b-a3b-base" / "config.json").read_text())
    base = count_params(HFConfig(raw), import_layers(HFConfig(raw)))
    raw["shared_expert_intermediate_size"] = 0
    coder = HFConfig(raw)
    assert count_params(coder, import_layers(coder)) == base
    raw["q_lora_rank"] = 0  # likewise for the other "none" sizes
    raw["num_experts"] = 0
    dense = HFConfig(raw)
    assert count_params(dense, import_layers(dense)).router == 0


def test_gpt_oss_120b_tp4_per_rank_as_vllm_loads_it() -> None:
    # The real A100 TP 4 log: "Model loading took 17.22 GiB" on each rank. Marlin (no FP4
    # compute on Ampere) pads each rank's 720 intermediate columns to 768 and the hidden
    # size 2880 to 3072; the router stays replicated. An even split would be 15.17 GiB.
    config = load_config(str(MODELS / "gpt-oss-120b" / "config.json"))
    layers = import_layers(config, Deployment(tensor_parallel_size=4))
    weights = estimate_weights(config, layers, 4, 1, lookup_gpu("A100-80GB").arch)
    assert abs(weights.bytes_per_worker / GIB - 17.22) < 0.01 * 17.22
    assert weights.bytes_per_worker > weights.bytes_total // 4


def test_gpt_oss_120b_on_one_hopper_gpu_as_vllm_loads_it() -> None:
    # H100, Triton MoE backend: "Model loading took 64.38 GiB" (vLLM 0.14.1,
    # github.com/vllm-project/vllm/issues/33155): the Hopper MX layout pads each
    # expert's packed bytes to 64 along K and its outputs to 256 (2,880 -> 3,072 for
    # the down projection, 5,760 -> 5,888 for gate_up); unpadded it would be 60.87
    # (the biases in float32 either way).
    # The Marlin fallback the same GPU took in vLLM 0.10.1 (hidden to 256, intermediate
    # to 128): "Model loading took 65.9651 GiB" (github.com/vllm-project/vllm/issues/23278).
    config = load_config(str(MODELS / "gpt-oss-120b" / "config.json"))
    layers = import_layers(config)
    triton = estimate_weights(config, layers, 1, 1, lookup_gpu("H100").arch)
    assert abs(triton.bytes_per_worker / GIB - 64.38) < 0.005 * 64.38
    marlin = estimate_weights(config, layers, 1, 1, "ampere")
    assert abs(marlin.bytes_per_worker / GIB - 65.9651) < 0.005 * 65.9651


# "Model loading took X GiB" in vLLM 0.19's H100 logs (llm-d-planner d3121e0,
# accuracy/results/v0.19.0/logs; printed to 0.01 GiB): per rank, unquantized bf16.
LOGGED_WEIGHTS: tuple[tuple[str, int, float], ...] = (
    ("qwen2.5-7b-instruct", 1, 14.25),  # qwen-qwen2-5-7b-instruct--h100-80gb--tp1pp1dp1--8192
    ("qwen2.5-7b-instruct", 2, 7.12),  # ...--tp2pp1dp1--8192
    ("qwen2.5-7b-instruct", 4, 3.55),  # ...--tp4pp1dp1--8192
    ("qwen2.5-72b-instruct", 2, 67.80),  # qwen-qwen2-5-72b-instruc--h100-80gb--tp2pp1dp1--8192
    ("phi-4", 1, 27.39),  # microsoft-phi-4--h100-80gb--tp1pp1dp1--8192
    ("llama-3.1-8b", 1, 14.99),  # meta-llama-llama-3-1-8b---h100-80gb--tp1pp1dp1--8192
    ("llama-3.1-8b", 2, 7.51),
    ("llama-3.1-8b", 4, 3.77),
    ("qwen3-8b", 1, 15.27),  # qwen-qwen3-8b--h100-80gb--tp1pp1dp1--8192
    ("gemma-2-9b", 1, 17.22),  # google-gemma-2-9b-it--h100-80gb--tp1pp1dp1--8192
    ("granite-3.3-8b-instruct", 1, 15.25),  # ibm-granite-granite-3-3---h100-80gb--tp1pp1dp1--8192
)


def test_the_caching_allocators_rounding_is_charged_as_vllm_reads_it() -> None:
    # A fresh tensor of 10 MiB or more is charged its 2 MiB-rounded segment where at
    # most 1 MiB would remain (PyTorch's should_split), else its own size.
    assert allocator_rounding_bytes(9 * MIB + 1) == 0  # a 20 MiB segment, split
    assert allocator_rounding_bytes(31 * MIB + MIB // 2) == MIB // 2  # Qwen2.5-7B's QKV
    assert allocator_rounding_bytes(24 * MIB + MIB // 2) == 0  # 1.5 MiB remains: split
    assert allocator_rounding_bytes(32 * MIB) == 0
    # Qwen2.5-7B's figure is parameters + RoPE cache + 57 / 21.5 / 0.2 MiB at TP 1 / 2 / 4
    # (its QKV, down projection and vocabulary tables sit just under 2 MiB multiples);
    # Llama, Qwen3 and Gemma 2's tensors are 2 MiB multiples.
    for model, tp, logged in LOGGED_WEIGHTS:
        config = load_config(str(MODELS / model / "config.json"))
        layers = import_layers(config, Deployment(tensor_parallel_size=tp))
        estimate = estimate_weights(config, layers, tp, 1, "hopper")
        assert abs(estimate.bytes_per_worker / GIB - logged) <= 0.005, (model, tp, estimate)
    qwen = load_config(str(MODELS / "qwen2.5-7b-instruct" / "config.json"))
    rounding = [weight_rounding_bytes(qwen, import_layers(qwen), tp, 0, 28, 1) for tp in (1, 2, 4)]
    assert rounding == [57 * MIB, 21 * MIB + MIB // 2, MIB // 4]


def test_one_figure_per_gpu_name_on_every_path() -> None:
    for gpu in CATALOG:
        for name in (gpu.name, *gpu.aliases):
            # request files / leases (DeviceRef.name), the static inventory, --model
            assert GPU_MEMORY_BYTES[name] == gpu.total_memory_bytes, name
            assert lookup_gpu(name) is gpu
            (listed,) = parse_inventory(f"1x{name}")
            assert listed.total_bytes == gpu.total_memory_bytes, name
    (device,) = parse_inventory("1xH200")
    assert device.total_bytes == lookup_gpu("H200-141GB").total_memory_bytes == 150_109_880_320
    (alias,) = parse_inventory("1xH100")
    assert alias.total_bytes == lookup_gpu("H100-80GB").total_memory_bytes


def test_the_short_names_people_type_resolve() -> None:
    for short, name in (("A10G", "A10G-24GB"), ("H100", "H100-80GB"), ("A100", "A100-80GB"),
                        ("L4", "L4-24GB"), ("L40S", "L40S-48GB"), ("B200", "B200-180GB"),
                        ("RTX-4090", "RTX-4090-24GB"), ("RTX-3090", "RTX-3090-24GB")):  # fmt: skip
        assert lookup_gpu(short).name == name
        assert lookup_gpu(short.lower()).name == name


def test_a100_totals_are_cuda_figures_not_nvidia_smi() -> None:
    # torch prints CUDA's total: "79.25 GiB" on A100 80GB, "39.50 GiB" on A100 40GB;
    # nvidia-smi's 81920 / 40960 MiB include the driver's reservation.
    assert round(lookup_gpu("A100-80GB").total_memory_bytes / GIB, 2) == 79.25
    assert round(lookup_gpu("A100-40GB").total_memory_bytes / GIB, 2) == 39.50


# nvidia-smi's memory.total (MiB) for the parts whose CUDA total the catalog holds; it
# includes what the driver reserves, so CUDA's own figure must be below it.
NVIDIA_SMI_MIB = {"A100-40GB": 40_960, "A100-80GB": 81_920, "H100-80GB": 81_559,
                  "H100-NVL-94GB": 95_830, "H200-141GB": 143_771, "B200-180GB": 183_359,
                  "L40S-48GB": 46_068, "L4-24GB": 23_034, "A10G-24GB": 23_028,
                  "RTX-4090-24GB": 24_564, "RTX-3090-24GB": 24_576}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NVIDIA_SMI_MIB))
def test_catalog_totals_are_cuda_figures_below_nvidia_smi(name: str) -> None:
    gpu = lookup_gpu(name)
    smi = NVIDIA_SMI_MIB[name] * 2**20
    assert gpu.measured and "cuda" in gpu.source.lower()
    # The reservation is 0.4-4% of the board (616 MiB on an H200, ~1 GiB on a 24 GB card).
    assert 0.95 * smi < gpu.total_memory_bytes < smi, name


_CHECKPOINTS = Path(__file__).parents[2] / "tests" / "data" / "checkpoints"
_CALIBRATION = Path(__file__).parents[2] / "tests" / "data" / "calibration"


def _qwen36_fp8() -> tuple[HFConfig, ModelLayers]:
    from kvplan.models.request import parse_speculative

    config = load_config(str(_CHECKPOINTS / "qwen3.6-27b-fp8"))
    deployment = Deployment(tensor_parallel_size=2, kv_cache_dtype="fp8",
                            speculative=parse_speculative("mtp:3"))  # fmt: skip
    return config, import_layers(config, deployment)


def test_the_qwen36_fp8_checkpoint_reconstruction_matches_its_file_sizes() -> None:
    # tests/data/checkpoints/qwen3.6-27b-fp8/SOURCE.md: the byte sizes of the
    # checkpoint's files in a public manifest. The vision tower is what its bf16 shard
    # holds besides the two vocabulary tables (the rest is the file's header); a Gated
    # DeltaNet layer's file has its in_proj_a / in_proj_b in bf16 and its other
    # projections and MLP in fp8 with bf16 128 x 128 block scales.
    config, layers = _qwen36_fp8()
    params = count_params(config, layers)
    c = config.sub("text_config")
    assert c is not None
    hidden, vocab = c.integer("hidden_size"), c.integer("vocab_size")
    outside = 6_007_102_112 - 2 * vocab * hidden * 2
    assert 0 <= outside - 2 * params.vision < 64 * 1024
    ab = 2 * hidden * c.integer("linear_num_value_heads")
    gdn = params.state_space // 48
    mlp = params.mlp // 64
    fp8 = gdn - ab + mlp
    blocks = 2 * (80 * 40 + 48 * 40 + 40 * 48 + 3 * 136 * 40)  # qkv, z, out, MLP
    conv_and_norms = 10240 * 4 * 2 + 2 * hidden * 2
    layer_file = fp8 + 2 * ab + blocks + conv_and_norms
    assert 0 <= 383_865_472 - layer_file < 8 * 1024  # the header and the small GDN tensors
    assert 383_865_472 - (layer_file - ab) > 400_000  # in_proj_a / b in fp8 would not fit


def test_qwen36_fp8_weights_against_the_logged_model_loading() -> None:
    # club-3090#751: "Model loading took 14.68 GiB" per worker, Qwen3.6-27B-FP8 at TP 2 on
    # two RTX 3090s (MTP loaded). What the checkpoint keeps in bf16 (the vision tower,
    # every GDN in_proj_a / b, mtp.fc: +0.25 GiB) and the Marlin group scales Ampere's
    # fp8 path holds (+0.18 GiB) take kvplan from 14.15 to 14.58 (-0.7%).
    from kvplan.models.calibrate import parse_log

    log = parse_log((_CALIBRATION / "qwen3.6-27b-fp8-rtx3090-tp2-club3090-751.log").read_text())
    logged = log.model_loading_gib[0]
    config, layers = _qwen36_fp8()
    ampere = estimate_weights(config, layers, 2, 1, lookup_gpu("RTX-3090").arch, "fp8")
    assert abs(ampere.bytes_per_worker / GIB - logged) < 0.01 * logged
    # Each of the two corrections moves it, in the direction of the log.
    hopper = estimate_weights(config, layers, 2, 1, lookup_gpu("H100").arch, "fp8")
    every_linear = estimate_weights(load_config(str(MODELS / "qwen3.6-27b")), layers, 2, 1,
                                    lookup_gpu("RTX-3090").arch, "fp8")  # fmt: skip
    assert every_linear.bytes_per_worker < hopper.bytes_per_worker < ampere.bytes_per_worker
    assert round(every_linear.bytes_per_worker / GIB, 2) == 14.15


def test_fp8_marlin_scales_on_ampere_only_for_block_checkpoints() -> None:
    # vLLM's Marlin fp8 path (below compute capability 8.9) turns 128 x 128 float32 block
    # scales into one bf16 scale per 128 input columns of every output row.
    config, layers = _qwen36_fp8()
    ampere = estimate_weights(config, layers, 1, 1, "ampere", "fp8")
    hopper = estimate_weights(config, layers, 1, 1, "hopper", "fp8")
    unknown = estimate_weights(config, layers, 1, 1, "", "fp8")
    assert unknown.bytes_per_worker == hopper.bytes_per_worker
    kept = _qwen36_bf16_bytes(config, layers)
    ratio = (ampere.bytes_total - kept) / (hopper.bytes_total - kept)
    assert abs(ratio - (1 + 2 / 128) / (1 + 4 / (128 * 128))) < 1e-6
    # An unquantized checkpoint quantized on load (--quantization fp8) has one scale per
    # tensor: no group scales on Ampere either.
    plain = load_config(str(MODELS / "qwen3.6-27b"))
    assert (estimate_weights(plain, layers, 1, 1, "ampere", "fp8").bytes_per_worker
            == estimate_weights(plain, layers, 1, 1, "hopper", "fp8").bytes_per_worker)  # fmt: skip


def _qwen36_bf16_bytes(config: HFConfig, layers: ModelLayers) -> int:
    """The bytes the Qwen3.6-27B-FP8 checkpoint keeps in bf16 (the whole model's)."""
    params = count_params(config, layers)
    c = config.sub("text_config")
    assert c is not None
    hidden = c.integer("hidden_size")
    ab = 48 * 2 * hidden * c.integer("linear_num_value_heads")
    return 2 * (params.embedding + params.vision + ab + 2 * hidden * hidden)


@pytest.mark.parametrize(
    ("ignored", "message"),
    [
        (["model.language_model.layers.0.linear_attn.in_proj_a"],
         "keeps part of the GDN in_proj_a / in_proj_b only"),
        (["lm_head", "model.layers.0.mlp.gate_proj"],
         "excludes part of the mlp weights only"),
    ],
)  # fmt: skip
def test_an_exclusion_list_that_splits_a_part_is_refused(ignored: list[str], message: str) -> None:
    # The estimate counts a part (every layer's MLP, every GDN layer's in_proj_a / b)
    # quantized or not as a whole; a list naming only some of it is refused with the
    # field, the reason and the way out, rather than counted wrong.
    raw = json.loads((MODELS / "qwen3.6-27b" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                  "ignored_layers": ignored}  # fmt: skip
    config = HFConfig(raw)
    with pytest.raises(ModelConfigError) as error:
        estimate_weights(config, import_layers(config), 1)
    assert message in str(error.value) and "pass --non-kv-bytes" in str(error.value)
    assert str(error.value).startswith("quantization_config: ")


def test_fp8_marlin_on_ada_from_0_32_for_dense_models() -> None:
    """Ada (8.9) has fp8 tensor cores. vLLM 0.17.0-0.19.0's
    kernels/linear/scaled_mm/marlin.py `MarlinFP8ScaledMMLinearKernel.is_supported`
    refuses capability 8.9 and above, so the block scales stay; 0.32-0.34's has no
    upper bound and every kernel ahead of it in kernels/linear/__init__.py
    `_POSSIBLE_FP8_BLOCK_KERNELS` needs capability 9.0, 10.x or 12.x, so Ada's linear
    layers hold Marlin's group scales, 1 + 2/128 B per weight in bf16 as on Ampere. An
    MoE model's experts keep the block layout there (fused_moe/oracle/fp8.py lists
    TRITON ahead of MARLIN, and TritonExperts takes block fp8 from 8.9)."""
    config, layers = _qwen36_fp8()
    ampere = estimate_weights(config, layers, 1, 1, "ampere", "fp8")
    hopper = estimate_weights(config, layers, 1, 1, "hopper", "fp8")
    for release in ("", "vllm-0.32", "0.33.0", "vllm-0.34"):
        ada = estimate_weights(config, layers, 1, 1, "ada", "fp8", release=release)
        assert ada.bytes_per_worker == ampere.bytes_per_worker, release
    for release in ("0.19.0", "0.17.0", "v0"):
        ada = estimate_weights(config, layers, 1, 1, "ada", "fp8", release=release)
        assert ada.bytes_per_worker == hopper.bytes_per_worker, release
    # DeepSeek V3 (block fp8 experts): Triton experts on Ada keep the block figure.
    deepseek = load_config(str(MODELS / "deepseek-v3"))
    moe_layers = import_layers(deepseek)
    ada_moe = estimate_weights(deepseek, moe_layers, 8, 1, "ada", release="vllm-0.34")
    hopper_moe = estimate_weights(deepseek, moe_layers, 8, 1, "hopper")
    assert ada_moe.bytes_per_worker == hopper_moe.bytes_per_worker


CHECKPOINTS = Path(__file__).parents[2] / "tests" / "data" / "checkpoints"


def test_mla_models_count_vllm_019s_flashinfer_workspace_and_their_rounding() -> None:
    # vLLM 0.12-0.24 import flashinfer_mla.py while the first MLA layer picks its
    # backend, and the module allocates 128 MiB on the device: on every rank, at any TP
    # size (read in the wheels; 0.11 picks without importing it, 0.25 on allocate lazily).
    deepseek = load_config(str(CHECKPOINTS / "deepseek-v2-lite-chat" / "config.json"))
    kimi = load_config(str(CHECKPOINTS / "kimi-vl-a3b-instruct" / "config.json"))
    llama = load_config(str(MODELS / "llama-3.1-8b" / "config.json"))

    def weights(config: HFConfig, tp: int, release: str, flashinfer: bool = True) -> int:
        layers = import_layers(config, Deployment(tensor_parallel_size=tp))
        return estimate_weights(config, layers, tp, 1, "hopper", release=release,
                                flashinfer=flashinfer).bytes_per_worker  # fmt: skip

    for config, tp in ((deepseek, 1), (kimi, 1), (kimi, 2)):
        with_it = weights(config, tp, "0.19.0")
        assert with_it - weights(config, tp, "0.19.0", flashinfer=False) == 128 * MIB
        assert with_it - weights(config, tp, "0.25.0") == 128 * MIB  # lazy from 0.25
        assert weights(config, tp, "0.12.0") == weights(config, tp, "0.24.0") == with_it
        assert weights(config, tp, "0.11.0") == weights(config, tp, "0.33.0")
    assert weights(llama, 1, "0.19.0") == weights(llama, 1, "0.19.0", flashinfer=False)
    # DeepSeek-V2-Lite's 11 MiB shared-expert down projection holds a 12 MiB block in
    # each of its 26 MoE layers (TP 2: the 11 MiB gate-up), its dense layer's 85.5 MiB
    # gate-up 86: vLLM 0.5.0 logged 29.3010 GiB for it (vllm#4650), parameters, norms
    # and the 20 MiB RoPE cache + 26.7 MiB.
    deepseek_layers = import_layers(deepseek)
    assert weight_rounding_bytes(deepseek, deepseek_layers, 1, 0, 27, 1) == 26 * MIB + MIB // 2
    kimi_layers = import_layers(kimi)
    assert weight_rounding_bytes(kimi, kimi_layers, 2, 0, 27, 1) == 26 * MIB
    # The 0.19 logs' "Model loading took" (29.43; 30.74 / 15.53 at TP 1 / 2): DeepSeek to
    # the printed 0.01 GiB; Kimi-VL 0.01-0.02 under (20 MiB segments not modelled).
    for config, tp, logged, slack in ((deepseek, 1, 29.43, 0.005), (kimi, 1, 30.74, 0.015),
                                      (kimi, 2, 15.53, 0.02)):  # fmt: skip
        estimate = weights(config, tp, "0.19.0") / GIB
        assert -slack <= estimate - logged <= 0.005, (tp, estimate)


# The MXFP4 backend by release (weights.mxfp4_moe_backend), read in the wheels: up to
# 0.11.2 `has_triton_kernels()` looks for an installed triton_kernels only (no release
# lists it in Requires-Dist), so Hopper gets Marlin; from 0.12.0 the wheel vendors
# vllm/third_party/triton_kernels and Hopper gets Triton. The releases of the two logs
# below, and the first and last each side of the change.
@pytest.mark.parametrize(
    ("release", "backend"),
    [("0.10.1", "marlin"), ("0.11.2", "marlin"), ("0.12.0", "triton"), ("0.14.1", "triton"),
     ("0.19.0", "triton"), ("vllm-0.34", "triton"), ("", "triton")],
)  # fmt: skip
def test_hoppers_mxfp4_backend_follows_the_release(release: str, backend: str) -> None:
    assert mxfp4_moe_backend("hopper", release) == backend
    # Below 9.0 Triton is refused in every release: Marlin.
    assert mxfp4_moe_backend("ampere", release) == mxfp4_moe_backend("ada", release) == "marlin"


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_the_releases_own_oracle_puts_triton_first_on_hopper(release: str, tmp_path: Path) -> None:
    # The release's MXFP4 oracle with a CUDA platform of each capability stood in
    # (vllm_mxfp4_backend_side.py): on 9.0 only FlashInfer's TRT-LLM (10.x) and AITER
    # (ROCm) backends come before TRITON, whose device gate admits 9.0 and whose
    # triton_kernels the wheel vendors; 8.0 and 8.9 are outside that gate.
    side = str(Path(__file__).with_name("vllm_mxfp4_backend_side.py"))
    capabilities = [[8, 0], [8, 9], [9, 0]]
    answer = run_in_vllm(release, [side], {"capabilities": capabilities}, cache_root=tmp_path)
    assert answer["vendored_triton_kernels"] and answer["has_triton_kernels"], answer
    hopper = answer["by_capability"]["9.0"]
    ahead = hopper["priority"][: hopper["priority"].index("TRITON")]
    assert ahead and all(name.startswith(("FLASHINFER_TRTLLM_", "AITER_")) for name in ahead)
    assert hopper["priority"].index("TRITON") < hopper["priority"].index("MARLIN")
    assert hopper["triton_device"] is True
    assert mxfp4_moe_backend("hopper", f"vllm-{release}") == "triton"
    for older in ("8.0", "8.9"):
        assert answer["by_capability"][older]["triton_device"] is False
    assert mxfp4_moe_backend("ampere", f"vllm-{release}") == "marlin"


def test_gpt_oss_120b_on_one_h100_by_release() -> None:
    # The two H100 logs of gpt-oss-120b at TP 1 with their releases' default backends:
    # vLLM 0.10.1, Marlin, "Model loading took 65.9651 GiB" (vllm#23278); 0.14.1,
    # Triton, "Model loading took 64.38 GiB" (vllm#33155). kvplan: 65.93 and 64.28.
    config = load_config(str(MODELS / "gpt-oss-120b" / "config.json"))
    layers = import_layers(config)
    for release, logged in (("0.10.1", 65.9651), ("0.14.1", 64.38)):
        weights = estimate_weights(config, layers, 1, 1, "hopper", release=release)
        assert abs(weights.bytes_per_worker / GIB - logged) < 0.005 * logged, release
    # A log naming Triton on 0.10.2-0.11.0 (an installed triton_kernels under their
    # pinned torch 2.8.0): vLLM keeps the experts unswizzled, 60.87 GiB.
    strided = estimate_weights(config, layers, 1, 1, "hopper", release="0.11.0",
                               mxfp4_backend="triton")  # fmt: skip
    unpadded = estimate_weights(config, layers, 1, 1, "", release="0.11.0")
    assert strided.bytes_per_worker == unpadded.bytes_per_worker
    assert strided.bytes_per_worker < weights.bytes_per_worker
