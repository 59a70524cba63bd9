"""The config importer against figures derived by hand from each architecture's
published definition (head counts, head sizes, state shapes), not from the importer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplan.convert.request import request_from_proto
from kvplan.core.dtypes import StorageDtype
from kvplan.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvplan.models import (
    Deployment,
    HFConfig,
    ModelConfigError,
    Speculative,
    UnsupportedModel,
    import_layers,
    load_config,
)
from kvplan.models.encoder import vision_tower
from kvplan.models.importer import ModelLayers
from kvplan.models.weights import (
    count_params,
    estimate_weights,
    replicated_params,
    weight_rounding_bytes,
)
from kvplan.v1 import plan_pb2

MODELS = Path(__file__).parents[2] / "examples" / "models"


def domain(layers: ModelLayers) -> list[tuple[str, KVCacheSpec]]:
    """The imported layers as the planner sees them (through the proto converter)."""
    request = plan_pb2.PlanRequest(engine_id="import-test")
    request.options.max_model_len = 4096
    request.options.block_size = layers.block_size
    if layers.mamba_cache_mode == "align":
        request.options.mamba_cache_mode = plan_pb2.MAMBA_CACHE_MODE_ALIGN
    worker = request.workers.add(rank=0)
    worker.memory.kv_cache_memory_bytes = 1 << 30
    worker.layers.extend(layer.to_proto() for layer in layers.layers)
    return list(request_from_proto(request).workers[0].layers)


def layers_of(name: str, **deployment: object) -> list[tuple[str, KVCacheSpec]]:
    config = load_config(str(MODELS / name / "config.json"))
    return domain(import_layers(config, Deployment(**deployment)))  # type: ignore[arg-type]


def only(specs: list[tuple[str, KVCacheSpec]], kind: type) -> list[KVCacheSpec]:
    return [spec for _, spec in specs if type(spec) is kind]


def attention_page(heads: int, head: int, dtype_bytes: int, block: int = 16) -> int:
    return heads * block * (head + head) * dtype_bytes  # K and V


def test_every_shipped_config_has_a_source_note() -> None:
    for directory in MODELS.iterdir():
        if directory.is_dir():
            assert (directory / "config.json").is_file()
            assert (directory / "SOURCE.md").read_text().strip()


# --- dense families ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "layers", "kv_heads", "head"),
    [
        ("llama-3.1-8b", 32, 8, 4096 // 32),
        ("qwen3-8b", 36, 8, 4096 // 32),
        ("mistral-7b-v0.3", 32, 8, 4096 // 32),
        ("mixtral-8x7b-instruct", 32, 8, 4096 // 32),
        ("qwen3-30b-a3b-base", 48, 4, 128),
        ("phi-4", 40, 10, 5120 // 40),
        ("granite-3.3-8b-instruct", 40, 8, 4096 // 32),
    ],
)
def test_dense_models_register_one_full_attention_layer_per_decoder_layer(
    model: str, layers: int, kv_heads: int, head: int
) -> None:
    specs = layers_of(model)
    assert len(specs) == len(only(specs, FullAttentionSpec)) == layers
    spec = specs[0][1]
    assert isinstance(spec, FullAttentionSpec)
    assert (spec.num_kv_heads, spec.head_size, spec.block_size) == (kv_heads, head, 16)
    assert spec.page_size_bytes == attention_page(kv_heads, head, 2)
    assert specs[0][0] == "model.layers.0.self_attn.attn"


def test_llama_tp_shards_then_replicates_kv_heads() -> None:
    # 8 KV heads: TP 2 -> 4 per rank, TP 8 -> 1, TP 16 -> 1 (each head on 2 ranks).
    for tp, heads in ((2, 4), (8, 1), (16, 1)):
        spec = layers_of("llama-3.1-8b", tensor_parallel_size=tp)[0][1]
        assert isinstance(spec, FullAttentionSpec)
        assert spec.num_kv_heads == heads
        assert spec.page_size_bytes == attention_page(heads, 128, 2)
    with pytest.raises(ModelConfigError, match=r"num_key_value_heads.*tensor_parallel_size 3"):
        layers_of("llama-3.1-8b", tensor_parallel_size=3)


def test_phi4_ten_kv_heads_do_not_split_over_eight_ranks() -> None:
    assert layers_of("phi-4", tensor_parallel_size=2)[0][1].num_kv_heads == 5  # type: ignore[attr-defined]
    assert layers_of("phi-4", tensor_parallel_size=20)[0][1].num_kv_heads == 1  # type: ignore[attr-defined]
    with pytest.raises(ModelConfigError, match="10 KV heads"):
        layers_of("phi-4", tensor_parallel_size=8)


def test_fp8_kv_cache_halves_the_page() -> None:
    spec = layers_of("llama-3.1-8b", kv_cache_dtype="fp8")[0][1]
    assert isinstance(spec, FullAttentionSpec)
    assert spec.dtype is StorageDtype.UINT8
    assert spec.page_size_bytes == attention_page(8, 128, 1) == 32_768


def test_backend_packed_kv_dtypes_are_refused() -> None:
    with pytest.raises(UnsupportedModel, match="nvfp4"):
        layers_of("llama-3.1-8b", kv_cache_dtype="nvfp4")


# --- local attention -----------------------------------------------------------------


def test_gpt_oss_alternates_sliding_and_full() -> None:
    specs = layers_of("gpt-oss-120b")
    sliding = only(specs, SlidingWindowSpec)
    full = only(specs, FullAttentionSpec)
    assert (len(sliding), len(full)) == (18, 18)  # 36 layers, even ones sliding
    assert isinstance(specs[0][1], SlidingWindowSpec)
    assert specs[0][1].sliding_window == 128
    assert isinstance(specs[1][1], FullAttentionSpec)
    assert specs[1][1].page_size_bytes == attention_page(8, 64, 2) == 32_768
    assert [name for name, _ in specs[:2]] == [
        "model.layers.0.attn.attn",
        "model.layers.1.attn.attn",
    ]


def test_gemma3_every_sixth_layer_is_global() -> None:
    # gemma-3-27b-it: 62 layers, 16 KV heads x 128, window 1024; the published
    # text_config omits the pattern (Gemma3TextConfig's default: every 6th global).
    specs = layers_of("gemma-3-27b")
    full_at = [i for i, (_, spec) in enumerate(specs) if type(spec) is FullAttentionSpec]
    assert full_at == list(range(5, 62, 6))
    assert len(only(specs, SlidingWindowSpec)) == 62 - 10
    assert specs[0][0] == "language_model.model.layers.0.self_attn.attn"
    sliding = specs[0][1]
    assert isinstance(sliding, SlidingWindowSpec)
    assert sliding.sliding_window == 1024
    assert sliding.page_size_bytes == attention_page(16, 128, 2) == 131_072
    layers = import_layers(load_config(str(MODELS / "gemma-3-27b")))
    assert any("sliding_window_pattern=6" in note for note in layers.notes)
    # Gemma 3's length is already scaled: its linear rope factor 8 is not applied again
    assert layers.derived_max_model_len == 131_072


def test_derived_max_model_len_follows_the_rope_type() -> None:
    raw = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    assert import_layers(HFConfig(raw)).derived_max_model_len == 131_072  # llama3: prescaled
    raw["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    assert import_layers(HFConfig(raw)).derived_max_model_len == 262_144
    deepseek = import_layers(load_config(str(MODELS / "deepseek-v3")))
    assert deepseek.derived_max_model_len == 163_840  # yarn: max_position_embeddings as is


def test_gemma2_alternates() -> None:
    # gemma-2-9b: 42 layers, even ones local (window 4096), 8 KV heads x 256
    specs = layers_of("gemma-2-9b")
    assert [type(spec) for _, spec in specs[:2]] == [SlidingWindowSpec, FullAttentionSpec]
    assert len(only(specs, SlidingWindowSpec)) == len(only(specs, FullAttentionSpec)) == 21
    assert specs[0][1].page_size_bytes == attention_page(8, 256, 2) == 131_072


def test_llama4_rope_layers_are_chunked_nope_layers_global() -> None:
    specs = layers_of("llama-4-defaults", tensor_parallel_size=8)
    chunked = only(specs, ChunkedLocalAttentionSpec)
    full_at = [i for i, (_, spec) in enumerate(specs) if type(spec) is FullAttentionSpec]
    assert full_at == list(range(3, 48, 4))
    assert len(chunked) == 36
    assert chunked[0].attention_chunk_size == 8192  # type: ignore[attr-defined]
    assert chunked[0].page_size_bytes == attention_page(1, 128, 2)


# --- MLA + MTP ----------------------------------------------------------------------


def test_deepseek_v3_mla_latent_replicated_on_every_rank() -> None:
    for tp in (1, 8, 16):
        specs = layers_of("deepseek-v3", tensor_parallel_size=tp)
        assert len(specs) == len(only(specs, MLAAttentionSpec)) == 61
        spec = specs[0][1]
        assert isinstance(spec, MLAAttentionSpec)
        # one latent head: kv_lora_rank 512 + qk_rope_head_dim 64, block 64, bf16
        assert (spec.num_kv_heads, spec.head_size, spec.max_tp_shards) == (1, 576, 1)
        assert spec.page_size_bytes == 64 * 576 * 2 == 73_728


def test_deepseek_v3_mtp_adds_its_drafter_layer() -> None:
    specs = layers_of("deepseek-v3", speculative=Speculative("mtp", 1), kv_cache_dtype="fp8")
    assert len(specs) == 62
    name, spec = specs[-1]
    assert name == "model.layers.61.self_attn.attn"
    assert spec.is_draft and not any(s.is_draft for _, s in specs[:-1])
    assert spec.page_size_bytes == 64 * 576 == 36_864


def test_mtp_on_a_model_without_mtp_layers_is_an_error() -> None:
    with pytest.raises(UnsupportedModel, match="no MTP layers"):
        layers_of("llama-3.1-8b", speculative=Speculative("mtp", 1))


# --- hybrids -------------------------------------------------------------------------


def test_qwen3_next_gdn_states_and_hybrid_block_tp4_mtp() -> None:
    specs = layers_of(
        "qwen3-next-80b-a3b", tensor_parallel_size=4, speculative=Speculative("mtp", 1)
    )
    gdn = only(specs, MambaSpec)
    full = only(specs, FullAttentionSpec)
    assert (len(gdn), len(full)) == (36, 13)  # 3:1 interleave of 48 layers, + 1 MTP layer
    state = gdn[0]
    assert isinstance(state, MambaSpec)
    # conv: kernel 4 - 1 + 1 speculative token, (2*16*128 + 32*128) / 4 channels, bf16
    assert [s.shape for s in state.states] == [(4, 2048), (8, 128, 128)]
    assert state.states[0].size_bytes == 16_384 and state.states[1].size_bytes == 262_144
    assert state.num_speculative_blocks == 1 and state.mamba_type == "GDN_ATTENTION"
    # attention: max(1, 2 // 4) = 1 head x 256 x (K+V) x 2 B = 1,024 B/token;
    # block = 16 * cdiv(278,528, 16 * 1,024) = 272; page 272 * 1,024 = the state page.
    attention = full[0]
    assert isinstance(attention, FullAttentionSpec)
    assert attention.block_size == state.block_size == 272
    assert attention.page_size_bytes == state.page_size_bytes == 278_528
    assert state.page_size_padded is None
    assert specs[-1][0] == "mtp.layers.0.self_attn.attn" and specs[-1][1].is_draft


def test_qwen3_next_tp1_pads_the_state_page() -> None:
    specs = layers_of("qwen3-next-80b-a3b")
    state = only(specs, MambaSpec)[0]
    assert isinstance(state, MambaSpec)
    # conv (3, 2*16*128 + 32*128 = 8192) bf16 = 49,152; temporal (32,128,128) bf16 = 1,048,576
    assert sum(s.size_bytes for s in state.states) == 1_097_728
    # 2 heads x 256 x 2 x 2 B = 2,048 B/token; block 16 * cdiv(1,097,728, 32,768) = 544
    assert state.block_size == 544
    assert state.page_size_padded == 544 * 2_048 == 1_114_112


def test_qwen3_6_27b_layers_under_its_wrapper_with_fp32_ssm_state_and_mtp() -> None:
    mtp = Speculative("mtp", 3)
    specs = layers_of("qwen3.6-27b", tensor_parallel_size=2, kv_cache_dtype="fp8", speculative=mtp)
    gdn = only(specs, MambaSpec)
    full = only(specs, FullAttentionSpec)
    assert (len(gdn), len(full)) == (48, 17)  # 3:1 of 64 layers, + mtp_num_hidden_layers 1
    assert specs[0][0] == "language_model.model.layers.0.linear_attn"
    assert specs[3][0] == "language_model.model.layers.3.self_attn.attn"
    assert specs[-1][0] == "mtp.layers.0.self_attn.attn" and specs[-1][1].is_draft
    state = gdn[0]
    assert isinstance(state, MambaSpec)
    # conv (4 - 1 + 3 speculative tokens, (2*16*128 + 48*128) / 2) bf16; the temporal
    # state in the config's mamba_ssm_dtype, float32 (vLLM's Qwen3.5 config hook)
    assert [s.shape for s in state.states] == [(6, 5120), (24, 128, 128)]
    assert [s.dtype.value for s in state.states] == ["bfloat16", "float32"]
    # fp8 KV: 2 heads x 256 x 2 x 1 B = 1,024 B/token; the state page 1,634,304 B gives
    # 16 * cdiv(1,634,304, 16,384) = 1,600 tokens, padded by 0.25%: what club-3090#751's
    # TP-2 log printed for a Qwen3.6-27B ("Setting attention block size to 1600 tokens",
    # "Padding mamba page size by 0.25%").
    assert state.block_size == 1600 and state.page_size_padded == 1600 * 1024
    assert round(100 * (1600 * 1024 / 1_634_304 - 1), 2) == 0.25


def test_prefix_caching_off_gives_mamba_max_len_blocks() -> None:
    specs = layers_of("qwen3-next-80b-a3b", enable_prefix_caching=False, max_model_len=32768)
    assert only(specs, MambaSpec)[0].block_size == 32768


def test_jamba_mamba1_states_and_attention_every_eighth_layer() -> None:
    specs = layers_of("jamba-defaults", tensor_parallel_size=2)
    attention_at = [i for i, (_, spec) in enumerate(specs) if isinstance(spec, FullAttentionSpec)]
    assert attention_at == [4, 12, 20, 28]
    assert (specs[3][0], specs[4][0]) == ("model.layers.3.mixer", "model.layers.4.attn")
    state = only(specs, MambaSpec)[0]
    assert isinstance(state, MambaSpec)
    inner = 2 * 4096 // 2  # mamba_expand x hidden / tp
    assert [s.shape for s in state.states] == [(3, inner), (inner, 16)]
    real = (3 * inner + inner * 16) * 2  # 155,648
    per_token = attention_page(4, 128, 2, block=1)  # 4 heads per rank: 2,048 B
    block = 16 * -(-real // (16 * per_token))
    assert state.block_size == block == 80
    assert state.page_size_padded == block * per_token == 163_840


NEMOTRON_H_TEST_CONFIG = {  # a test input (Nemotron-H-style shapes), not a shipped model
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "num_hidden_layers": 8,
    "hybrid_override_pattern": "M-M-M*-M",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "intermediate_size": 21504,
    "vocab_size": 131072,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("tp", "conv", "ssm"),
    [
        (1, (3, 8192 + 2 * 8 * 128), (128, 64, 128)),
        (4, (3, (8192 + 2 * 8 * 128) // 4), (32, 64, 128)),
        # 8 groups over 16 ranks: groups grow to 16 so each rank holds a whole one
        (16, (3, (8192 + 2 * 16 * 128) // 16), (8, 64, 128)),
    ],
)
def test_nemotron_h_mamba2_states(tp: int, conv: tuple[int, ...], ssm: tuple[int, ...]) -> None:
    layers = domain(
        import_layers(HFConfig(NEMOTRON_H_TEST_CONFIG), Deployment(tensor_parallel_size=tp))
    )
    kinds = [type(spec).__name__ for _, spec in layers]
    assert [name for name, _ in layers][2:4] == [
        "model.layers.4.mixer",
        "model.layers.5.mixer.attn",
    ]
    assert kinds == ["MambaSpec"] * 3 + ["FullAttentionSpec", "MambaSpec"]  # - is an MLP
    state = layers[0][1]
    assert isinstance(state, MambaSpec)
    assert [s.shape for s in state.states] == [conv, ssm]
    # NemotronH keeps the SSM state in float32 unless the config says otherwise
    assert [s.dtype for s in state.states] == [StorageDtype.BFLOAT16, StorageDtype.FLOAT32]


NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


@pytest.mark.parametrize(
    ("tp", "kv_heads", "conv", "ssm", "block"),
    [
        # conv dim = 64 heads x 64 + 2 x 8 groups x 128 = 6,144 channels over tp;
        # 2 KV heads: 2, 1, then replicated (1 per rank) at tp 4 and 8
        (1, 2, (3, 6144), (64, 64, 128), 2096),
        (2, 1, (3, 3072), (32, 64, 128), 2096),
        (4, 1, (3, 1536), (16, 64, 128), 1056),
        (8, 1, (3, 768), (8, 64, 128), 528),
    ],
)
def test_nemotron_3_nano_published_config(
    tp: int, kv_heads: int, conv: tuple[int, ...], ssm: tuple[int, ...], block: int
) -> None:
    """nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: 23 Mamba-2 (M), 23 MoE (E, no cache) and
    6 attention (*) layers; its config asks for a float32 SSM state."""
    specs = layers_of("nemotron-3-nano-30b-a3b", tensor_parallel_size=tp)
    mamba_at = [i for i, c in enumerate(NEMOTRON_3_NANO_PATTERN) if c == "M"]
    attention_at = [i for i, c in enumerate(NEMOTRON_3_NANO_PATTERN) if c == "*"]
    assert (len(mamba_at), len(attention_at)) == (23, 6)
    assert [name for name, _ in specs] == sorted(
        [f"model.layers.{i}.mixer" for i in mamba_at]
        + [f"model.layers.{i}.mixer.attn" for i in attention_at],
        key=lambda name: int(name.split(".")[2]),
    )
    state = only(specs, MambaSpec)[0]
    assert isinstance(state, MambaSpec)
    assert [s.shape for s in state.states] == [conv, ssm]
    assert [s.dtype for s in state.states] == [StorageDtype.BFLOAT16, StorageDtype.FLOAT32]
    real = conv[0] * conv[1] * 2 + ssm[0] * ssm[1] * ssm[2] * 4
    per_token = attention_page(kv_heads, 128, 2, block=1)  # head_dim 128, bf16
    assert block == 16 * -(-real // (16 * per_token))
    attention = only(specs, FullAttentionSpec)[0]
    assert isinstance(attention, FullAttentionSpec)
    assert (attention.num_kv_heads, attention.head_size) == (kv_heads, 128)
    assert attention.block_size == state.block_size == block
    assert attention.page_size_bytes == state.page_size_padded == block * per_token


# --- errors --------------------------------------------------------------------------


def test_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(
        UnsupportedModel, match=r"'FooForCausalLM' is not supported; supported: .*LlamaForCausalLM"
    ):
        import_layers(HFConfig({"architectures": ["FooForCausalLM"]}))


def test_uninterpretable_field_is_an_error_with_its_path(tmp_path: Path) -> None:
    config = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    config["num_key_value_heads"] = "eight"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="num_key_value_heads: expected an integer"):
        import_layers(load_config(str(tmp_path)))
    gemma = json.loads((MODELS / "gemma-3-27b" / "config.json").read_text())
    gemma["text_config"]["layer_types"] = ["weird_attention"] * 62
    with pytest.raises(ModelConfigError, match=r"text_config\.layer_types"):
        import_layers(HFConfig(gemma))


def test_bidirectional_is_causal_false_keeps_no_kv_cache() -> None:
    """vLLM's Llama / Qwen2 / Qwen3 / Gemma 3 / DeepSeek layers turn `is_causal: false`
    into encoder-only attention, which registers no cache layer (checked against vLLM's
    model code in test_against_vllm_model_code.py); Qwen3-MoE's ignore the field."""
    raw = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    raw["is_causal"] = False
    with pytest.raises(UnsupportedModel, match=r"is_causal: false .* no KV cache"):
        import_layers(HFConfig(raw))
    raw["is_causal"] = "no"
    with pytest.raises(ModelConfigError, match="is_causal: expected true or false"):
        import_layers(HFConfig(raw))
    moe = json.loads((MODELS / "qwen3-30b-a3b-base" / "config.json").read_text())
    moe["is_causal"] = False
    assert len(import_layers(HFConfig(moe)).layers) == 48


def test_model_id_from_the_local_hf_cache(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((MODELS / "llama-3.1-8b" / "config.json").read_text())
    (tmp_path / "models--meta-llama--Llama-3.1-8B-Instruct" / "refs").mkdir()
    (tmp_path / "models--meta-llama--Llama-3.1-8B-Instruct" / "refs" / "main").write_text("abc")
    config = load_config("meta-llama/Llama-3.1-8B-Instruct", {"HF_HUB_CACHE": str(tmp_path)})
    assert config.integer("num_hidden_layers") == 32
    with pytest.raises(ModelConfigError, match="never downloads"):
        load_config("meta-llama/Other", {"HF_HUB_CACHE": str(tmp_path)})


# --- weights -------------------------------------------------------------------------


def test_llama_parameter_count_by_hand() -> None:
    config = load_config(str(MODELS / "llama-3.1-8b" / "config.json"))
    layers = import_layers(config)
    embed = 128_256 * 4096 * 2  # untied embeddings + lm head
    attention = 4096 * 128 * (2 * 32 + 2 * 8)
    mlp = 3 * 4096 * 14_336
    assert count_params(config, layers).total == embed + 32 * (attention + mlp) == 8_029_995_008
    weights = estimate_weights(config, layers, tensor_parallel_size=2)
    assert weights.quantization == "none"
    # Each rank also builds the RoPE cache: 131,072 positions x 128 dims x 2 B. Its
    # embedding and LM head shards are 64,128 x 4,096 x 2 B = 250.5 blocks of 2 MiB each,
    # and the caching allocator charges each the whole 251st (1 MiB over).
    rounding = 2 * (1 << 20)
    assert weights.bytes_per_worker == 8_029_995_008 * 2 // 2 + 131_072 * 128 * 2 + rounding


def test_deepseek_fp8_and_awq_int4_weights(tmp_path: Path) -> None:
    config = load_config(str(MODELS / "deepseek-v3" / "config.json"))
    layers = import_layers(config, Deployment(speculative=Speculative("mtp", 1)))
    params = count_params(config, layers)
    assert 670e9 < params.total - params.draft < 673e9  # published: 671B + 11.5B MTP
    fp8 = estimate_weights(config, layers, 8)
    assert fp8.quantization == "fp8"
    # Embeddings, LM head and routers stay bf16 (the checkpoint's gates are bf16).
    unquantized = params.embedding + params.router
    expected = unquantized * 2 + (params.total - unquantized) * (1 + 4 / 128**2)
    assert fp8.bytes_total == int(expected)
    raw = json.loads((MODELS / "deepseek-v3" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    awq = estimate_weights(HFConfig(raw), layers, 8)
    assert awq.quantization == "awq-int4"
    # 4-bit weights, an fp16 scale and a 4-bit zero point per 128-group
    int4 = 0.5 + 2.5 / 128
    assert awq.bytes_total == int(unquantized * 2 + (params.total - unquantized) * int4)
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    gptq = estimate_weights(HFConfig(raw), layers, 8)
    assert (gptq.quantization, gptq.bytes_total) == ("gptq-int4", awq.bytes_total)
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 8}
    with pytest.raises(ModelConfigError, match="only 4-bit gptq"):
        estimate_weights(HFConfig(raw), layers, 8)
    raw["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 128}}},
    }
    w4 = estimate_weights(HFConfig(raw), layers, 8)
    assert w4.quantization == "compressed-tensors-w4"
    assert w4.bytes_total == int(unquantized * 2 + (params.total - unquantized) * (0.5 + 2 / 128))
    raw["quantization_config"] = {"quant_method": "bitsandbytes"}
    with pytest.raises(ModelConfigError, match="quant_method"):
        estimate_weights(HFConfig(raw), layers, 8)


def test_mxfp4_quantizes_only_the_experts() -> None:
    raw = json.loads((MODELS / "gpt-oss-120b" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    config = HFConfig(raw)
    layers = import_layers(config)
    params = count_params(config, layers)
    weights = estimate_weights(config, layers, 1)
    assert weights.bytes_total == int((params.total - params.mlp) * 2 + params.mlp * (0.5 + 1 / 32))


EAGLE3_TEST_DRAFTER = {  # a test input shaped like a one-layer Llama 3.1 8B EAGLE3 head
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 1,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "torch_dtype": "float16",
}


def test_eagle3_drafter_layers_follow_the_targets() -> None:
    config = load_config(str(MODELS / "llama-3.1-8b"))
    drafter = HFConfig(EAGLE3_TEST_DRAFTER)
    for tp, heads in ((1, 8), (2, 4), (16, 1)):
        specs = domain(
            import_layers(
                config,
                Deployment(tensor_parallel_size=tp, speculative=Speculative("eagle3", 3, drafter)),
            )
        )
        assert len(specs) == 33
        name, spec = specs[-1]
        assert name == "model.layers.32.self_attn.attn" and spec.is_draft
        assert isinstance(spec, FullAttentionSpec) and spec.num_kv_heads == heads
        assert not any(s.is_draft for _, s in specs[:-1])


def test_eagle_on_a_hybrid_adds_speculative_state() -> None:
    config = load_config(str(MODELS / "qwen3-next-80b-a3b"))
    layers = import_layers(
        config,
        Deployment(
            tensor_parallel_size=4,
            speculative=Speculative("eagle3", 2, HFConfig(EAGLE3_TEST_DRAFTER)),
        ),
    )
    state = next(spec for _, spec in domain(layers) if isinstance(spec, MambaSpec))
    assert state.states[0].shape == (4 - 1 + 2, 2048) and state.num_speculative_blocks == 2
    assert layers.layers[-1].name == "model.layers.48.self_attn.attn" and layers.layers[-1].is_draft


def test_speculative_errors() -> None:
    config = load_config(str(MODELS / "llama-3.1-8b"))
    with pytest.raises(ModelConfigError, match="needs the drafter's config"):
        import_layers(config, Deployment(speculative=Speculative("eagle3", 3)))
    odd = HFConfig({**EAGLE3_TEST_DRAFTER, "architectures": ["MedusaModel"]})
    with pytest.raises(UnsupportedModel, match="drafter architecture 'MedusaModel'"):
        import_layers(config, Deployment(speculative=Speculative("eagle3", 3, odd)))
    with pytest.raises(UnsupportedModel, match="'ngram' is not supported"):
        import_layers(config, Deployment(speculative=Speculative("ngram", 3)))


def test_pipeline_stages_split_layers_like_vllm() -> None:
    from kvplan.models.importer import pipeline_stage_bounds

    # 32 over 2: 16 + 16; 30 over 4: 7 each, the 2 left over go to stages 2 and 1;
    # 40 over 3: 13 each, 1 left over to the second-to-last stage.
    assert [pipeline_stage_bounds(32, r, 2) for r in range(2)] == [(0, 16), (16, 32)]
    assert [pipeline_stage_bounds(30, r, 4) for r in range(4)] == [
        (0, 7), (7, 15), (15, 23), (23, 30)
    ]  # fmt: skip
    assert [pipeline_stage_bounds(40, r, 3) for r in range(3)] == [(0, 13), (13, 27), (27, 40)]
    layers = import_layers(load_config(str(MODELS / "jamba-defaults")))
    stage = layers.stage_layers(1, 2)
    assert [layer.name for layer in stage][:1] == ["model.layers.16.mixer"]
    assert sum(not layer.is_state for layer in stage) == 2  # attention at 20 and 28
    mtp = import_layers(
        load_config(str(MODELS / "deepseek-v3")), Deployment(speculative=Speculative("mtp", 1))
    )
    with pytest.raises(UnsupportedModel, match="pipeline parallelism with a drafter"):
        mtp.stage_layers(0, 2)


def test_whisper_decoder_self_and_cross_attention() -> None:
    # whisper-small (published config): 12 decoder layers, 12 heads of 768 / 12 = 64,
    # no KV-head grouping; its float32 checkpoint runs (and caches) in bfloat16.
    from kvplan.core.specs import CrossAttentionSpec

    specs = layers_of("whisper-small", tensor_parallel_size=2)
    assert [name for name, _ in specs[:2]] == [
        "model.decoder.layers.0.self_attn.attn",
        "model.decoder.layers.0.encoder_attn.attn",
    ]
    cross = only(specs, CrossAttentionSpec)
    assert len(cross) == len(only(specs, FullAttentionSpec)) == 12
    assert cross[0].page_size_bytes == attention_page(6, 64, 2) == 24_576
    assert isinstance(cross[0], CrossAttentionSpec) and cross[0].dtype is StorageDtype.BFLOAT16
    with pytest.raises(ModelConfigError, match="decoder_attention_heads"):
        layers_of("whisper-small", tensor_parallel_size=8)
    config = load_config(str(MODELS / "whisper-small"))
    assert config.dtype().value == "float32"
    layers = import_layers(config)
    assert layers.encoder_decoder and layers.derived_max_model_len == 448
    assert layers.model_dtype.value == "bfloat16"
    assert any("float32 runs as bfloat16" in note for note in layers.notes)
    d, ffn = 768, 3072
    encoder = 12 * (4 * d * d + 2 * d * ffn) + 3 * d * (80 + d)
    decoder = 12 * (8 * d * d + 2 * d * ffn)
    embedding = 51_865 * d + (1500 + 448) * d
    assert count_params(config, layers).total == encoder + decoder + embedding == 241_463_040


# --- engine releases ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine_version", "block", "is_draft"),
    [("", 16, True), ("vllm-0.32", 16, False), ("vllm-0.33", 16, True), ("vllm-0.34", 64, True)],
)
def test_registration_follows_the_release(engine_version: str, block: int, is_draft: bool) -> None:
    """vLLM 0.34's CacheConfig.DEFAULT_BLOCK_SIZE is 64 (0.32 / 0.33: 16), which
    FlashAttention keeps as its preferred block; FlashMLA stays at 64 in every release.
    Layer specs carry is_draft from 0.33 on; 0.32 finds draft groups by position."""
    from kvplan.models.request import ModelPlanOptions, build_plan_request

    llama = load_config(str(MODELS / "llama-3.1-8b"))
    layers = import_layers(llama, Deployment(engine_version=engine_version))
    assert layers.block_size == block
    assert {layer.block_size for layer in layers.layers} == {block}
    deepseek = load_config(str(MODELS / "deepseek-v3"))
    assert import_layers(deepseek, Deployment(engine_version=engine_version)).block_size == 64
    eagle = Speculative("eagle3", 3, HFConfig(EAGLE3_TEST_DRAFTER))
    options = ModelPlanOptions(
        gpu="H100-80GB", max_model_len=8192, speculative=eagle, engine_version=engine_version
    )
    request, _ = build_plan_request(llama, options)
    assert request.options.engine_version == engine_version
    assert request.options.block_size == block
    flags = [layer.is_draft for layer in request.workers[0].layers]
    assert flags == [False] * 32 + [is_draft]  # the drafter's layer, registered last
    # No utilization given: the release's default applies (0.34 reserves at 1.0).
    assert not request.workers[0].memory.HasField("gpu_memory_utilization")


def test_hybrid_block_aligns_to_the_releases_default_block() -> None:
    # Qwen3-Next TP 4: one attention token = 1 KV head (2 replicated over 4) x 256 x
    # (K+V) x 2 B = 1,024 B; GDN state: conv (3, 2,048) + (8, 128, 128), bf16 = 274,432 B.
    # 0.33 aligns to 16-token blocks: 16 x cdiv(274,432, 16 x 1,024) = 272, the state
    # page padded to 278,528 B; 0.34 to its 64-token default block:
    # 64 x cdiv(274,432, 64 x 1,024) = 320, padded to 327,680 B.
    config = load_config(str(MODELS / "qwen3-next-80b-a3b"))
    for engine_version, block, page in (("vllm-0.33", 272, 278_528), ("vllm-0.34", 320, 327_680)):
        layers = import_layers(
            config, Deployment(tensor_parallel_size=4, engine_version=engine_version)
        )
        assert layers.block_size == block
        state = next(layer for layer in layers.layers if layer.is_state)
        assert state.real_page_bytes == (3 * 2_048 + 8 * 128 * 128) * 2 == 274_432
        assert state.page_size_bytes == page == block * 1_024


def test_unknown_engine_version_names_the_supported_ones() -> None:
    with pytest.raises(ModelConfigError, match=r"vllm-0\.32.*vllm-0\.33.*vllm-0\.34"):
        import_layers(load_config(str(MODELS / "llama-3.1-8b")), Deployment(engine_version="x"))


def test_registration_table_matches_the_core_rule_sets() -> None:
    from kvplan.core.rules import FIELD_IS_DRAFT, RULE_SETS
    from kvplan.models.importer import REGISTRATIONS

    assert set(REGISTRATIONS) == set(RULE_SETS)
    for version, rules in RULE_SETS.items():
        registration = REGISTRATIONS[version]
        assert registration.default_block_size == rules.default_block_size, version
        assert registration.marks_draft_layers == rules.has_field(FIELD_IS_DRAFT), version
        assert registration.extensible_kv_cache == rules.extensible_kv_cache, version


GRANITE_VISION = Path(__file__).parents[1] / "data" / "checkpoints" / "granite-vision-3.3-2b"


def test_llava_next_granite_vision_by_hand() -> None:
    """Granite Vision 3.3 2B: the Granite text model's 40 layers of 8 KV heads x 64 (2,048 /
    32), and the SigLIP tower of 27 layers (1,152 wide, MLP 4,304, 27 x 27 patches of 14
    pixels) with its projector from four concatenated feature layers, counted by hand."""
    config = load_config(str(GRANITE_VISION))
    layers = import_layers(config)
    assert layers.architecture == "LlavaNextForConditionalGeneration"
    assert layers.model_type == "granite"
    assert [(x.num_kv_heads, x.head_size, x.kind) for x in layers.layers] == [
        (8, 64, "full_attention")
    ] * 40
    w, inter, text = 1152, 4304, 2048
    layer = 4 * w * w + 4 * w + 2 * 2 * w + w * inter + inter + inter * w + w
    stem = 3 * 14 * 14 * w + w + 27 * 27 * w
    projector = 4 * w * text + text + text * text + text
    assert count_params(config, layers).vision == 27 * layer + stem + projector + text


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"vision_config": {"model_type": "pixtral"}}, "SigLIP or CLIP tower"),
        ({"text_config": {"model_type": "qwen2"}}, "'qwen2' text model is not supported"),
    ],
)
def test_llava_next_other_towers_and_text_models_are_refused(
    change: dict[str, dict[str, object]], match: str
) -> None:
    raw = json.loads((GRANITE_VISION / "config.json").read_text())
    for key, fields in change.items():
        raw[key] = {**raw[key], **fields}
    with pytest.raises(UnsupportedModel, match=match):
        import_layers(HFConfig(raw))


CHECKPOINTS = Path(__file__).parents[1] / "data" / "checkpoints"


@pytest.mark.parametrize(
    ("name", "architecture", "text_ffn", "kv_heads", "tokens", "tiles"),
    [
        # 672 x 672: the base tile and 2 x 2, 576 + 48 x 48 + 48 newlines
        ("llava-v1.6-mistral-7b-hf", "LlavaNextForConditionalGeneration", 14336, 8, 2928, 5),
        ("llava-1.5-7b-hf", "LlavaForConditionalGeneration", 11008, 32, 576, 1),
    ],
)
def test_clip_llava_checkpoints_by_hand(
    name: str, architecture: str, text_ffn: int, kv_heads: int, tokens: int, tiles: int
) -> None:
    """llava-hf's LLaVA-Next (Mistral 7B) and LLaVA 1.5 (Vicuna 7B) over CLIP ViT-L/14-336:
    32 full-attention layers of 128-wide heads from the text model's defaults (the files
    name no widths; Mistral's "sliding_window": null stays null), served in the root
    config's float16 as vLLM does; the CLIP tower to layer 23 of 24 (-2) counted by hand:
    per layer Q/K/V/O and fc1 / fc2 with biases and two LayerNorms, the bias-free patch
    convolution, the class embedding, 577 position embeddings, the pre-layernorm; the
    projector 1,024 -> 4,096 -> 4,096 with biases, and LLaVA-Next's newline vector."""
    config = load_config(str(CHECKPOINTS / name))
    layers = import_layers(config)
    assert layers.architecture == architecture
    assert layers.model_dtype.value == "float16"
    assert [(x.num_kv_heads, x.head_size, x.kind, x.sliding_window) for x in layers.layers] == [
        (kv_heads, 128, "full_attention", None)
    ] * 32
    assert any("hidden_size=4096" in note and "num_hidden_layers=32" in note
               for note in layers.notes)  # fmt: skip
    w, inter, text, vocab = 1024, 4096, 4096, 32064
    layer = 4 * w * w + 3 * w + w + 2 * 2 * w + w * inter + inter + inter * w + w
    stem = 3 * 14 * 14 * w + w + 577 * w + 2 * w
    projector = w * text + text + text * text + text
    newline = text if architecture.startswith("LlavaNext") else 0
    params = count_params(config, layers)
    assert params.vision == 23 * layer + stem + projector + newline
    attention = 32 * (text * 128 * (32 + 2 * kv_heads) + 32 * 128 * text)
    assert params.total == params.vision + 2 * vocab * text + attention + 32 * 3 * text * text_ffn
    tower = vision_tower(config, 1)
    assert tower is not None
    assert (tower.tokens_per_item, tower.patches_per_item) == (tokens, tiles * 577)
    # a layer's QuickGELU in its PyTorch form: four 1,024-wide streams, three 4,096-wide
    assert tower.peak_elements_per_patch == 4 * w + 3 * inter


def test_a_llava_vision_config_without_a_model_type_is_clip() -> None:
    """LlavaNextConfig builds a CLIPVisionConfig from a vision_config that names no
    model_type, and so does kvplan: the same tower, weights and profile."""
    raw = json.loads((CHECKPOINTS / "llava-v1.6-mistral-7b-hf" / "config.json").read_text())
    unnamed = {**raw, "vision_config": {key: value for key, value in raw["vision_config"].items()
                                        if key != "model_type"}}  # fmt: skip
    named, bare = HFConfig(raw), HFConfig(unnamed)
    assert count_params(bare, import_layers(bare)) == count_params(named, import_layers(named))
    assert vision_tower(bare, 1) == vision_tower(named, 1)


KIMI_VL = Path(__file__).parents[1] / "data" / "checkpoints" / "kimi-vl-a3b-instruct"


def test_kimi_vl_mla_layers_moonvit_and_what_stays_whole() -> None:
    """Kimi-VL-A3B: DeepSeek's MLA layers (one 512 + 64 latent head, block 64) from
    `text_config`; MoonViT and its projector counted from the shapes vLLM 0.19's log
    prints as it loads them; at TP 2 the MLA down projections and MoonViT's parts
    outside its parallel linears stay whole on each rank."""
    config = load_config(str(KIMI_VL))
    layers = import_layers(config)
    assert layers.architecture == "KimiVLForConditionalGeneration"
    assert layers.block_size == 64
    assert [(x.kind, x.num_kv_heads, x.head_size) for x in layers.layers] == [
        ("mla_attention", 1, 576)
    ] * 27
    w, inter, text = 1152, 4304, 2048
    block = (3 * w * w + 3 * w) + (w * w + w) + (inter * w + inter) + (w * inter + w) + 4 * w
    tower = 27 * block + 2 * w + 64 * 64 * w + w * 3 * 14 * 14 + w
    projector = 2 * w + 4608 * 4608 + 4608 + text * 4608 + text
    assert count_params(config, layers).vision == tower + projector
    whole = replicated_params(config, layers, 27)
    # the stem, the final LayerNorm, the projector; per block two LayerNorms and the
    # row-parallel wo's and fc1's biases
    outside = 2 * w + 64 * 64 * w + w * 3 * 14 * 14 + w + projector + 27 * 6 * w
    assert whole == 27 * text * (512 + 64) + outside
    one, two = estimate_weights(config, layers, 1), estimate_weights(config, layers, 2)
    params = count_params(config, layers)
    sharded = (params.total - params.router - whole) * 2
    # and what the caching allocator rounds up: the shared experts' 11 MiB gate-up
    # projections hold 12 MiB blocks at TP 2 (26 MiB over 26 MoE layers)
    rounding = weight_rounding_bytes(config, layers, 2, 0, 27, 1)
    assert rounding == 26 * 2**20
    assert (
        two.bytes_per_worker
        == -(-sharded // 2) + (params.router + whole) * 2 + two.rope_cache_bytes + rounding
    )
    rounding_tp1 = weight_rounding_bytes(config, layers, 1, 0, 27, 1)
    assert rounding_tp1 == 26 * 2**20  # the 11 MiB down projections at TP 1
    assert one.bytes_per_worker == params.total * 2 + one.rope_cache_bytes + rounding_tp1
