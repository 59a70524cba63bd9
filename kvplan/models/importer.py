"""Hugging Face config -> the layer specs one worker registers, as the named vLLM release
(0.32, 0.33, 0.34; vLLM 0.33 when none is named) builds them.

Each supported architecture has a builder that lists its cache layers in registration
order (target model first, then the drafter's layers for MTP or EAGLE). What each builder encodes,
and where it comes from, is in docs/capacity.md. Rules shared by all:

* attention KV heads per tensor-parallel rank: `max(1, kv_heads // tp)`; when tp exceeds
  the KV heads they are replicated, which needs `tp % kv_heads == 0`, otherwise
  `kv_heads % tp == 0` (vLLM's QKV projection asserts the same);
* MLA layers cache one latent head (`kv_lora_rank + qk_rope_head_dim`) on every rank;
* Mamba-style states are split over tp by heads / channels (vLLM's state-shape rules);
* hybrid attention + Mamba models raise the attention block size until one attention
  page holds a Mamba page, then pad the Mamba page to the attention page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvplan.models.config import HFConfig, ModelConfigError
from kvplan.models.encoder import LLAVA_TOWERS, is_llava_tower
from kvplan.models.layers import Dtype, ImportedLayer, StateTensor, kv_storage_dtype
from kvplan.v1 import spec_pb2


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


# FlashMLA's fixed 64-token block for MLA models on Hopper (every release), and the
# kernel block vLLM's default CUDA attention backends align to (FlashAttention and
# Triton: multiples of 16). The default block of other models is the release's
# (`Registration.default_block_size`).
DEFAULT_MLA_BLOCK_SIZE = 64
KERNEL_BLOCK_ALIGNMENT = 16


@dataclass(frozen=True)
class Registration:
    """What differs between engine releases in how a model's layers are registered.

    * the default attention block: vLLM 0.32 / 0.33 16 tokens, 0.34 64
      (`CacheConfig.DEFAULT_BLOCK_SIZE`, which FlashAttention keeps as its preference);
    * whether a layer spec carries `is_draft` (vLLM 0.33 and later; 0.32 finds draft
      groups from the spec marker and the trailing layer instead);
    * whether the release has the extensible KV cache (vLLM 0.34, sized after warm-up).

    What does not differ for the imported families (read in each release's model code):
    KV-head sharding, state shapes, the Mamba dtype rules, the hybrid block alignment
    formula (0.34 applies it to its larger default block) and the MTP layer count
    (`num_nextn_predict_layers` in 0.32, 0.33 and 0.34 alike).
    """

    engine_version: str
    default_block_size: int
    marks_draft_layers: bool
    extensible_kv_cache: bool = False


# One entry per rule set of kvplan/core/rules.py (the client imports this module
# without the core; tests/models/test_importer.py checks the two tables agree).
REGISTRATIONS: dict[str, Registration] = {
    "": Registration("", default_block_size=16, marks_draft_layers=True),  # as vLLM 0.33
    "vllm-0.32": Registration("vllm-0.32", default_block_size=16, marks_draft_layers=False),
    "vllm-0.33": Registration("vllm-0.33", default_block_size=16, marks_draft_layers=True),
    "vllm-0.34": Registration(
        "vllm-0.34", default_block_size=64, marks_draft_layers=True, extensible_kv_cache=True
    ),
}


def registration_for(engine_version: str) -> Registration:
    """The registration rules of `engine_version` ("" = kvplan's own, i.e. vLLM 0.33)."""
    registration = REGISTRATIONS.get(engine_version)
    if registration is None:
        known = ", ".join(repr(key) for key in REGISTRATIONS)
        raise ModelConfigError(
            f"unknown engine_version {engine_version!r}; supported: {known} "
            "('' registers as vLLM 0.33 and plans with kvplan's own rules)"
        )
    return registration


# Cache dtypes whose page is (K + V) x 1 byte per element; backend-packed formats
# (nvfp4, per-token-head, turboquant, ...) need the backend's content size instead.
SUPPORTED_KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
)


class UnsupportedModel(ModelConfigError):
    """An architecture (or a feature of one) the importer does not know."""


@dataclass(frozen=True)
class Speculative:
    method: str  # "mtp" (the model's own MTP layers), "eagle" or "eagle3" (a drafter)
    num_speculative_tokens: int
    draft_config: HFConfig | None = field(default=None, compare=False)  # EAGLE drafter


@dataclass(frozen=True)
class Deployment:
    """The engine settings that change what a worker registers."""

    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # None: the architecture's default backend block
    enable_prefix_caching: bool = True
    speculative: Speculative | None = None
    mamba_ssm_cache_dtype: str = "auto"
    max_model_len: int | None = None  # Mamba block size when prefix caching is off
    engine_version: str = ""  # the release that registers the layers ("" = vLLM 0.33)
    dtype: str = "auto"  # vLLM's --dtype: auto (as served from the checkpoint) or a name


@dataclass(frozen=True)
class ModelLayers:
    """What one worker registers, plus the settings planning needs with it."""

    architecture: str
    model_type: str
    layers: tuple[ImportedLayer, ...]
    block_size: int
    model_dtype: Dtype
    mamba_cache_mode: str  # "none" | "align"
    derived_max_model_len: int
    num_hidden_layers: int = 0
    num_nextn_predict_layers: int = 0
    notes: tuple[str, ...] = ()
    encoder_decoder: bool = False  # no prefix caching; cross-attention sized by the encoder
    marks_draft_layers: bool = True  # the release's layer specs carry is_draft

    def layer_protos(
        self, layers: tuple[ImportedLayer, ...] | None = None
    ) -> list[spec_pb2.LayerSpec]:
        """The layers as the release's request carries them (no `is_draft` before 0.33)."""
        return [
            layer.to_proto(with_draft_flag=self.marks_draft_layers)
            for layer in (self.layers if layers is None else layers)
        ]

    @property
    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        return counts

    def stage_layers(
        self, pp_rank: int, pp_size: int, partition: tuple[int, ...] | None = None
    ) -> tuple[ImportedLayer, ...]:
        """The layers pipeline stage `pp_rank` of `pp_size` registers (`partition`:
        VLLM_PP_LAYER_PARTITION's layers per stage)."""
        if pp_size == 1:
            return self.layers
        if any(layer.is_draft for layer in self.layers):
            raise UnsupportedModel("pipeline parallelism with a drafter is not imported")
        start, end = pipeline_stage_bounds(self.num_hidden_layers, pp_rank, pp_size, partition)
        return tuple(layer for layer in self.layers if start <= layer.decoder_index < end)


def pipeline_stage_bounds(
    num_layers: int, pp_rank: int, pp_size: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """[start, end) decoder layers of a stage, as vLLM's get_pp_indices gives them: even
    shares, the remainder going to the stages before the last, from the second-to-last
    backwards; or `partition`, the layers per stage as VLLM_PP_LAYER_PARTITION lists
    them, which must name every stage and add up to the model's layers."""
    if partition is not None:
        shown = ",".join(str(count) for count in partition)
        if len(partition) != pp_size:
            raise ModelConfigError(
                f"VLLM_PP_LAYER_PARTITION {shown} lists {len(partition)} stages, but "
                f"pipeline_parallel_size is {pp_size}"
            )
        if sum(partition) != num_layers:
            raise ModelConfigError(
                f"VLLM_PP_LAYER_PARTITION {shown} adds up to {sum(partition)} layers; the "
                f"model has {num_layers}",
                "num_hidden_layers",
            )
        if any(count < 0 for count in partition):
            raise ModelConfigError(f"VLLM_PP_LAYER_PARTITION {shown}: a negative layer count")
        partitions = list(partition)
    else:
        if num_layers < pp_size:
            raise ModelConfigError(
                f"{num_layers} layers cannot fill {pp_size} pipeline stages", "num_hidden_layers"
            )
        partitions = [num_layers // pp_size] * pp_size
        for offset in range(2, num_layers % pp_size + 2):
            partitions[-offset] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


@dataclass
class _Builder:
    config: HFConfig  # the text config
    deployment: Deployment
    architecture: str
    model_dtype: Dtype = Dtype.BFLOAT16
    kv_dtype: Dtype = Dtype.BFLOAT16
    block_size: int = 16
    layers: list[ImportedLayer] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    num_nextn: int = 0

    @property
    def tp(self) -> int:
        return self.deployment.tensor_parallel_size

    @property
    def num_spec(self) -> int:
        spec = self.deployment.speculative
        return spec.num_speculative_tokens if spec is not None else 0

    # --- attention -------------------------------------------------------------------

    def kv_heads_per_rank(self, total: int, what: str = "num_key_value_heads") -> int:
        tp = self.tp
        if total >= tp:
            if total % tp:
                raise ModelConfigError(
                    f"{total} KV heads do not split evenly over tensor_parallel_size {tp}",
                    self.config._where(what),
                )
            return total // tp
        if tp % total:
            raise ModelConfigError(
                f"tensor_parallel_size {tp} is not a multiple of the {total} KV heads "
                "(replicated heads need tp % kv_heads == 0)",
                self.config._where(what),
            )
        return 1

    def head_dim(self) -> int:
        if self.config.has("head_dim"):
            return self.config.integer("head_dim")
        hidden = self.config.integer("hidden_size")
        heads = self.config.integer("num_attention_heads")
        if hidden % heads:
            raise ModelConfigError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                "and head_dim is not given",
                self.config._where("head_dim"),
            )
        return hidden // heads

    def attention(
        self,
        name: str,
        kind: str,
        *,
        is_draft: bool = False,
        kv_heads: tuple[int, str] | None = None,  # (total, config key) when not the usual
        head_size: int | None = None,
        **extra: int,
    ) -> None:
        total, key = kv_heads or (self._total_kv_heads(), "num_key_value_heads")
        self.layers.append(
            ImportedLayer(
                name=name,
                kind=kind,
                block_size=self.block_size,
                is_draft=is_draft,
                num_kv_heads=self.kv_heads_per_rank(total, key),
                head_size=head_size if head_size is not None else self.head_dim(),
                dtype=self.kv_dtype,
                **extra,  # type: ignore[arg-type]
            )
        )

    def _total_kv_heads(self) -> int:
        if self.config.has("num_key_value_heads"):
            return self.config.integer("num_key_value_heads")
        return self.config.integer("num_attention_heads")

    def full(self, name: str, *, is_draft: bool = False) -> None:
        self.attention(name, "full_attention", is_draft=is_draft)

    def sliding(self, name: str, window: int) -> None:
        self.attention(name, "sliding_window", sliding_window=window)

    def chunked(self, name: str, chunk: int) -> None:
        self.attention(name, "chunked_local_attention", attention_chunk_size=chunk)

    def sliding_window(self) -> int:
        window = self.config.integer("sliding_window")
        return window

    # --- state dtypes ----------------------------------------------------------------

    def ssm_dtype(self, default: str = "auto") -> Dtype:
        setting = self.deployment.mamba_ssm_cache_dtype
        if setting == "auto":
            setting = default
        if setting == "auto":
            return self.model_dtype
        table = {"float32": Dtype.FLOAT32, "bfloat16": Dtype.BFLOAT16, "float16": Dtype.FLOAT16}
        if setting not in table:
            raise ModelConfigError(
                f"unsupported mamba_ssm_cache_dtype {setting!r}; expected auto, float32, "
                "bfloat16 or float16"
            )
        return table[setting]

    def conv_dtype(self) -> Dtype:
        # vLLM's mamba_cache_dtype "auto" follows the KV cache dtype setting, which for
        # fp8 KV caches is a raw byte type: the importer supports "auto" only.
        return self.model_dtype


def _mamba(
    name: str, states: tuple[StateTensor, ...], mamba_type: str, num_spec: int, block_size: int
) -> ImportedLayer:
    return ImportedLayer(
        name=name,
        kind="mamba",
        block_size=block_size,
        states=states,
        mamba_type=mamba_type,
        num_speculative_blocks=num_spec,
    )


# --- families ----------------------------------------------------------------------


def _layer_types(b: _Builder, count: int) -> list[str] | None:
    types = b.config.items("layer_types")
    if types is None:
        return None
    if len(types) < count:
        raise ModelConfigError(
            f"lists {len(types)} layer types for {count} layers", b.config._where("layer_types")
        )
    return [str(t) for t in types[:count]]


def _dense_decoder(b: _Builder, prefix: str = "model.layers") -> None:
    """Llama / Mistral / Mixtral / Qwen2-3 (+MoE) / Phi-3 / Granite / Gemma: one attention layer
    per decoder layer; `layer_types` marks sliding layers, else a set `sliding_window`
    applies to every layer (Qwen only with `use_sliding_window`)."""
    count = b.config.integer("num_hidden_layers")
    types = _layer_types(b, count)
    window: int | None = None
    if types is None and b.config.has("sliding_window"):
        qwen = b.config.text("model_type", "").startswith("qwen")
        if qwen and b.config.flag("use_sliding_window", False):
            raise UnsupportedModel(
                "Qwen sliding-window layers (use_sliding_window with max_window_layers) are "
                "not supported by the importer",
                b.config._where("use_sliding_window"),
            )
        if not qwen:
            window = b.config.integer("sliding_window", minimum=0) or None
    for index in range(count):
        name = f"{prefix}.{index}.self_attn.attn"
        kind = types[index] if types is not None else "full_attention"
        if kind == "sliding_attention":
            b.sliding(name, b.sliding_window())
        elif kind == "full_attention":
            if window is not None:
                b.sliding(name, window)
            else:
                b.full(name)
        else:
            raise ModelConfigError(
                f"layer {index}: unknown layer type {kind!r} (expected full_attention or "
                "sliding_attention)",
                b.config._where("layer_types"),
            )


def _gpt_oss(b: _Builder) -> None:
    """gpt-oss: even layers slide over `sliding_window` tokens, odd layers attend
    globally (vLLM sets this by index; the configs' `layer_types` say the same)."""
    count = b.config.integer("num_hidden_layers")
    window = b.sliding_window()
    for index in range(count):
        name = f"model.layers.{index}.attn.attn"
        if index % 2 == 0:
            b.sliding(name, window)
        else:
            b.full(name)


def _gemma(b: _Builder, pattern_default: int, prefix: str) -> None:
    """Gemma 2 / 3: local sliding layers interleaved with global ones. `layer_types` if
    given, else every `sliding_window_pattern`-th layer (1-based) is global."""
    count = b.config.integer("num_hidden_layers")
    types = _layer_types(b, count)
    if types is None:
        pattern = b.config.integer("sliding_window_pattern", pattern_default)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(count)
        ]
    window = b.sliding_window()
    for index, kind in enumerate(types):
        name = f"{prefix}.{index}.self_attn.attn"
        if kind == "sliding_attention":
            b.sliding(name, window)
        elif kind == "full_attention":
            b.full(name)
        else:
            raise ModelConfigError(
                f"layer {index}: unknown layer type {kind!r}", b.config._where("layer_types")
            )


def _gemma2(b: _Builder) -> None:
    _gemma(b, 2, "model.layers")


def _gemma3(b: _Builder) -> None:
    prefix = "language_model.model.layers" if b.config.path else "model.layers"
    _gemma(b, 6, prefix)


def _qwen_vl(b: _Builder) -> None:
    """Qwen2.5-VL / Qwen3-VL: a Qwen2 / Qwen3 decoder (M-RoPE changes no KV shape)
    under vLLM's `language_model.`, beside the vision tower (no KV cache)."""
    _dense_decoder(b, "language_model.model.layers")


def _llama4(b: _Builder) -> None:
    """Llama 4: RoPE layers use chunked local attention (`attention_chunk_size`); the
    NoPE layers (`no_rope_layers[i] == 0`, by default every 4th) attend globally."""
    count = b.config.integer("num_hidden_layers")
    chunk = b.config.opt_integer("attention_chunk_size")
    flags = b.config.items("no_rope_layers")
    if not flags:
        interval = b.config.integer("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(count)]
    if len(flags) < count:
        raise ModelConfigError(
            f"lists {len(flags)} entries for {count} layers", b.config._where("no_rope_layers")
        )
    prefix = "language_model.model.layers" if b.config.path else "model.layers"
    for index in range(count):
        name = f"{prefix}.{index}.self_attn.attn"
        uses_rope = bool(flags[index])
        if uses_rope and chunk:
            b.chunked(name, chunk)
        else:
            b.full(name)


def _mla_layer(b: _Builder, name: str, *, is_draft: bool = False) -> ImportedLayer:
    latent = b.config.integer("kv_lora_rank") + b.config.integer("qk_rope_head_dim")
    return ImportedLayer(
        name=name,
        kind="mla_attention",
        block_size=b.block_size,
        is_draft=is_draft,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=latent,
        dtype=b.kv_dtype,
        cache_dtype=b.deployment.kv_cache_dtype,
    )


def _deepseek(b: _Builder) -> None:
    """DeepSeek V2 / V3 (MLA): one latent head per token on every rank; the MTP modules
    register after the target as `model.layers.{num_hidden_layers + j}`."""
    if b.config.has("index_topk"):
        raise UnsupportedModel(
            "DeepSeek V3.2 sparse attention (index_topk) is not supported by the importer",
            b.config._where("index_topk"),
        )
    count = b.config.integer("num_hidden_layers")
    for index in range(count):
        b.layers.append(_mla_layer(b, f"model.layers.{index}.self_attn.attn"))
    if _wants_mtp(b):
        b.num_nextn = b.config.integer("num_nextn_predict_layers")
        for offset in range(b.num_nextn):
            name = f"model.layers.{count + offset}.self_attn.attn"
            b.layers.append(_mla_layer(b, name, is_draft=True))


def _wants_mtp(b: _Builder) -> bool:
    spec = b.deployment.speculative
    if spec is None:
        return False
    if b.config.integer("num_nextn_predict_layers", 0, minimum=0) == 0:
        raise UnsupportedModel(
            "MTP speculative decoding needs the model's MTP layers, but the config has "
            "num_nextn_predict_layers 0 or unset",
            b.config._where("num_nextn_predict_layers"),
        )
    return True


def _gdn_states(b: _Builder) -> tuple[StateTensor, ...]:
    c = b.config
    k_heads = c.integer("linear_num_key_heads")
    v_heads = c.integer("linear_num_value_heads")
    k_dim = c.integer("linear_key_head_dim")
    v_dim = c.integer("linear_value_head_dim")
    kernel = c.integer("linear_conv_kernel_dim")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    _divisible(b, conv_dim, "linear_num_value_heads", "GDN conv channels")
    _divisible(b, v_heads, "linear_num_value_heads", "GDN value heads")
    conv = StateTensor((kernel - 1 + b.num_spec, conv_dim // b.tp), b.conv_dtype())
    # Qwen3.5 / 3.6: vLLM takes `mamba_ssm_dtype` from the config when the
    # mamba_ssm_cache_dtype setting is auto (its Qwen3_5 config hook; float32 in the
    # published configs).
    ssm_default = "auto"
    if b.architecture in _QWEN3_5 and c.has("mamba_ssm_dtype"):
        ssm_default = c.text("mamba_ssm_dtype")
    temporal = StateTensor((v_heads // b.tp, v_dim, k_dim), b.ssm_dtype(ssm_default))
    return (conv, temporal)


def _divisible(b: _Builder, value: int, key: str, what: str) -> None:
    if value % b.tp:
        raise ModelConfigError(
            f"{what} ({value}) do not split over tensor_parallel_size {b.tp}",
            b.config._where(key),
        )


def _qwen3_next(b: _Builder) -> None:
    """Qwen3-Next and Qwen3.5 / 3.6 (dense and MoE; vLLM builds the latter's decoder
    layers from Qwen3-Next's): Gated DeltaNet layers with a gated full-attention layer
    every `full_attention_interval` layers (or as `layer_types` lists them); the MTP
    layers are full attention (`mtp.layers.j`). Qwen3.5 / 3.6's multimodal wrappers
    register the same layers under `language_model.`."""
    count = b.config.integer("num_hidden_layers")
    types = _layer_types(b, count)
    if types is None:
        interval = b.config.integer("full_attention_interval")
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(count)
        ]
    states = _gdn_states(b)
    prefix = "language_model.model.layers" if b.config.path else "model.layers"
    for index, kind in enumerate(types):
        if kind == "full_attention":
            b.full(f"{prefix}.{index}.self_attn.attn")
        elif kind == "linear_attention":
            name = f"{prefix}.{index}.linear_attn"
            b.layers.append(_mamba(name, states, "GDN_ATTENTION", b.num_spec, b.block_size))
        else:
            raise ModelConfigError(
                f"layer {index}: unknown layer type {kind!r}", b.config._where("layer_types")
            )
    if b.deployment.speculative is not None:
        # vLLM reads the MTP layer count with a default of 1: Qwen3-Next's
        # num_nextn_predict_layers, Qwen3.5 / 3.6's mtp_num_hidden_layers.
        key = (
            "mtp_num_hidden_layers"
            if b.config.has("mtp_num_hidden_layers")
            else ("num_nextn_predict_layers")
        )
        b.num_nextn = b.config.integer(key, 1)
        for offset in range(b.num_nextn):
            b.full(f"mtp.layers.{offset}.self_attn.attn", is_draft=True)


def _jamba(b: _Builder) -> None:
    """Jamba: attention every `attn_layer_period` layers from `attn_layer_offset`, Mamba-1
    elsewhere (conv (d_conv-1, E*h/tp), ssm (E*h/tp, d_state))."""
    count = b.config.integer("num_hidden_layers")
    period = b.config.integer("attn_layer_period")
    offset = b.config.integer("attn_layer_offset", minimum=0)
    hidden = b.config.integer("hidden_size")
    inner = b.config.integer("mamba_expand") * hidden
    _divisible(b, inner, "mamba_expand", "Mamba inner channels")
    conv = StateTensor((b.config.integer("mamba_d_conv") - 1, inner // b.tp), b.conv_dtype())
    ssm = StateTensor((inner // b.tp, b.config.integer("mamba_d_state")), b.ssm_dtype())
    for index in range(count):
        if index % period == offset:
            b.full(f"model.layers.{index}.attn")
        else:
            name = f"model.layers.{index}.mixer"
            b.layers.append(_mamba(name, (conv, ssm), "MAMBA1", 0, b.block_size))


def _whisper(b: _Builder) -> None:
    """Whisper (encoder-decoder): each decoder layer caches its self-attention (full) and
    its cross-attention over the encoder's states; the encoder keeps no KV cache. KV heads
    are the decoder's attention heads (multi-head attention)."""
    heads = b.config.integer("decoder_attention_heads")
    model_dim = b.config.integer("d_model")
    if model_dim % heads:
        raise ModelConfigError(
            f"d_model {model_dim} is not a multiple of decoder_attention_heads {heads}",
            b.config._where("d_model"),
        )
    shape = {"kv_heads": (heads, "decoder_attention_heads"), "head_size": model_dim // heads}
    for index in range(b.config.integer("decoder_layers")):
        prefix = f"model.decoder.layers.{index}"
        b.attention(f"{prefix}.self_attn.attn", "full_attention", **shape)  # type: ignore[arg-type]
        b.attention(f"{prefix}.encoder_attn.attn", "cross_attention", **shape)  # type: ignore[arg-type]


_BLOCK_CHARS = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
    "moe": "E",
}


def _nemotron_pattern(b: _Builder) -> str:
    """`hybrid_override_pattern`, or the newer `layers_block_type` list spelled as one."""
    if b.config.has("hybrid_override_pattern"):
        return b.config.text("hybrid_override_pattern")
    blocks = b.config.items("layers_block_type")
    if blocks is None:
        raise ModelConfigError(
            "required field is missing (or layers_block_type)",
            b.config._where("hybrid_override_pattern"),
        )
    try:
        return "".join(_BLOCK_CHARS[str(block)] for block in blocks)
    except KeyError as error:
        raise ModelConfigError(
            f"unknown block type {error.args[0]!r}", b.config._where("layers_block_type")
        ) from None


def _nemotron_h(b: _Builder) -> None:
    """Nemotron-H: `hybrid_override_pattern` (M Mamba-2, * attention, - MLP, E MoE);
    Mamba-2 states keep fp32 SSM state by default (vLLM's NemotronH rule)."""
    count = b.config.integer("num_hidden_layers")
    pattern = _nemotron_pattern(b)
    if len(pattern) != count:
        raise ModelConfigError(
            f"has {len(pattern)} entries for {count} layers",
            b.config._where("hybrid_override_pattern"),
        )
    heads = b.config.integer("mamba_num_heads")
    head_dim = b.config.integer("mamba_head_dim")
    groups = b.config.integer("n_groups")
    state = b.config.integer("ssm_state_size")
    kernel = b.config.integer("conv_kernel")
    _divisible(b, heads, "mamba_num_heads", "Mamba-2 heads")
    if groups % b.tp:  # vLLM replicates groups so each rank holds whole ones
        groups += b.tp - groups
    inner = heads * head_dim
    conv = StateTensor(
        (kernel - 1 + b.num_spec, (inner + 2 * groups * state) // b.tp), b.conv_dtype()
    )
    ssm_default = b.config.text("mamba_ssm_cache_dtype", "float32")
    ssm = StateTensor((heads // b.tp, head_dim, state), b.ssm_dtype(ssm_default))
    for index, char in enumerate(pattern):
        if char == "M":
            name = f"model.layers.{index}.mixer"
            b.layers.append(_mamba(name, (conv, ssm), "MAMBA2", b.num_spec, b.block_size))
        elif char == "*":
            b.full(f"model.layers.{index}.mixer.attn")
        elif char not in "-E":
            raise ModelConfigError(
                f"layer {index}: unknown block {char!r} (expected M, *, - or E)",
                b.config._where("hybrid_override_pattern"),
            )


SPECULATIVE_METHODS = ("mtp", "eagle", "eagle3")
# EAGLE drafters vLLM runs as Llama/Qwen3-style decoder layers over the target's
# hidden states (its llama_eagle / llama_eagle3 / qwen3_eagle3 model code).
EAGLE_DRAFTERS = (
    "Eagle3LlamaForCausalLM",
    "Eagle3Qwen3ForCausalLM",
    "EagleLlamaForCausalLM",
    "LlamaForCausalLM",
    "LlamaForCausalLMEagle",
    "LlamaForCausalLMEagle3",
    "Qwen3ForCausalLM",
)


def _eagle_drafter(b: _Builder, draft: HFConfig) -> None:
    """An EAGLE drafter's layers, registered after the target's as
    `model.layers.{target_layers + i}` (vLLM numbers them from the target's count), with
    the drafter's own KV heads and head size, all full attention and all `is_draft`."""
    names = draft.items("architectures") or []
    arch = str(names[0]) if names else ""
    if arch not in EAGLE_DRAFTERS:
        raise UnsupportedModel(
            f"drafter architecture {arch!r} is not supported; supported: "
            + ", ".join(EAGLE_DRAFTERS),
            "architectures",
        )
    target_layers = b.config.integer("num_hidden_layers")
    drafter = _Builder(
        config=draft,
        deployment=b.deployment,
        architecture=arch,
        model_dtype=b.model_dtype,
        kv_dtype=b.kv_dtype,
        block_size=b.block_size,
    )
    for index in range(draft.integer("num_hidden_layers")):
        drafter.full(f"model.layers.{target_layers + index}.self_attn.attn", is_draft=True)
    b.layers.extend(drafter.layers)


# LLaVA / LLaVA-Next text models whose layers are Llama's (vLLM's wrappers build
# `text_config` with init_vllm_registered_model); other text models, and towers other
# than SigLIP and CLIP (encoder.LLAVA_TOWERS), are refused.
_LLAVA_TEXT = frozenset({"granite", "llama", "mistral"})
_LLAVA = frozenset({"LlavaNextForConditionalGeneration", "LlavaForConditionalGeneration"})


def _llava(b: _Builder) -> None:
    model_type = b.config.text("model_type", "llama")
    if model_type not in _LLAVA_TEXT:
        raise UnsupportedModel(
            f"LLaVA over a {model_type!r} text model is not supported; supported: "
            + ", ".join(sorted(_LLAVA_TEXT)),
            b.config._where("model_type"),
        )
    _dense_decoder(b)


# Architecture name (config "architectures"[0]) -> builder, and whether its text config
# is nested under "text_config".
ARCHITECTURES: dict[str, tuple[Callable[[_Builder], None], bool]] = {
    "LlamaForCausalLM": (_dense_decoder, False),
    "MistralForCausalLM": (_dense_decoder, False),
    "MixtralForCausalLM": (_dense_decoder, False),
    "Qwen2ForCausalLM": (_dense_decoder, False),
    "Qwen3ForCausalLM": (_dense_decoder, False),
    "Qwen3MoeForCausalLM": (_dense_decoder, False),
    # Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (QKV biases) over routed experts and one
    # gated shared expert (`shared_expert_intermediate_size`; vLLM's qwen2_moe.py).
    "Qwen2MoeForCausalLM": (_dense_decoder, False),
    "Phi3ForCausalLM": (_dense_decoder, False),
    # Phi-1 / 1.5 / 2: one full-attention layer per decoder layer (parallel attention and
    # MLP, LayerNorms, biases, a partial rotary embedding: no cache difference; vLLM's
    # phi.py); its two-matrix MLP is in weights.py's `_TWO_MATRIX_MLP`.
    "PhiForCausalLM": (_dense_decoder, False),
    # Granite 3.x: Llama's layers; its embedding, residual, attention and logit
    # multipliers scale activations, not memory (vLLM's granite.py).
    "GraniteForCausalLM": (_dense_decoder, False),
    "GptOssForCausalLM": (_gpt_oss, False),
    # Gemma (1): Llama's layer layout, every layer full attention (vLLM's gemma.py); its
    # 256-wide heads come from `head_dim`, its tied LM head from the family default.
    "GemmaForCausalLM": (_dense_decoder, False),
    "Gemma2ForCausalLM": (_gemma2, False),
    "Gemma3ForCausalLM": (_gemma3, False),
    "Gemma3ForConditionalGeneration": (_gemma3, True),
    "Llama4ForConditionalGeneration": (_llama4, True),
    "Llama4ForCausalLM": (_llama4, False),
    # LLaVA-Next (Granite Vision over SigLIP; llava-hf's v1.6 checkpoints over CLIP) and
    # LLaVA 1.5 (CLIP): a tower and projector before a Llama-layered text model, which
    # vLLM builds from `text_config`'s own architecture.
    "LlavaNextForConditionalGeneration": (_llava, True),
    "LlavaForConditionalGeneration": (_llava, True),
    "DeepseekV2ForCausalLM": (_deepseek, False),
    "DeepseekV3ForCausalLM": (_deepseek, False),
    # Kimi-VL: a MoonViT tower before a DeepSeek-V3-style MLA / MoE text model, which
    # vLLM builds from `text_config` as DeepseekV2ForCausalLM (kimi_vl.py).
    "KimiVLForConditionalGeneration": (_deepseek, True),
    "Qwen3NextForCausalLM": (_qwen3_next, False),
    "Qwen3_5ForCausalLM": (_qwen3_next, False),
    "Qwen3_5MoeForCausalLM": (_qwen3_next, False),
    "Qwen3_5ForConditionalGeneration": (_qwen3_next, True),
    "Qwen3_5MoeForConditionalGeneration": (_qwen3_next, True),
    # Qwen2.5-VL's published config keeps the text fields at the top level.
    "Qwen2_5_VLForConditionalGeneration": (_qwen_vl, False),
    "Qwen3VLForConditionalGeneration": (_qwen_vl, True),
    "JambaForCausalLM": (_jamba, False),
    "NemotronHForCausalLM": (_nemotron_h, False),
    "WhisperForConditionalGeneration": (_whisper, False),
}
ENCODER_DECODER = {"WhisperForConditionalGeneration"}
_MLA = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiVLForConditionalGeneration"}
# Families whose vLLM decoder layers read `is_causal` (false: bidirectional attention,
# vLLM's EncoderOnlyAttention, which registers no cache layer).
_READS_IS_CAUSAL = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
}
_QWEN3_5 = {
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
}
_MTP_CAPABLE = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Qwen3NextForCausalLM",
                *_QWEN3_5}  # fmt: skip


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_of(config: HFConfig) -> str:
    names = config.items("architectures")
    if not names:
        raise ModelConfigError(
            'required field is missing (e.g. ["LlamaForCausalLM"])', "architectures"
        )
    name = str(names[0])
    if name not in ARCHITECTURES:
        raise UnsupportedModel(
            f"architecture {name!r} is not supported; supported: "
            + ", ".join(supported_architectures()),
            "architectures",
        )
    return name


# Fields a published config may omit because its transformers config class fills them;
# the importer fills exactly these (and says so), never anything else.
_GEMMA3_TEXT_DEFAULTS: dict[str, object] = {
    # Gemma3TextConfig's defaults (transformers 4.5x), which Gemma 3 4B's file relies on
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 131072,
    "vocab_size": 262208,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}
FAMILY_DEFAULTS: dict[str, dict[str, object]] = {
    "Gemma3ForConditionalGeneration": _GEMMA3_TEXT_DEFAULTS,
    "Gemma3ForCausalLM": _GEMMA3_TEXT_DEFAULTS,
    "Gemma2ForCausalLM": {"tie_word_embeddings": True},
    "GemmaForCausalLM": {"tie_word_embeddings": True},  # GemmaConfig's default
}
# The LLaVA wrappers' text_config is built by the text model_type's config class
# (LlavaConfig / LlavaNextConfig: CONFIG_MAPPING[model_type], "llama" when unnamed), and
# llava-hf's files keep only what differs from it (llava-v1.6-mistral-7b-hf names no
# widths or depth). MistralConfig's and LlamaConfig's defaults (transformers 4.4x-5.x);
# Llama's num_key_value_heads defaults to the head count, as kvplan reads an absent one.
_LLAVA_TEXT_DEFAULTS: dict[str, dict[str, object]] = {
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
}


def text_config(config: HFConfig, architecture: str) -> HFConfig:
    """The language model's config (`text_config` for multimodal wrappers), with the
    family's documented defaults for fields the published file omits."""
    nested = ARCHITECTURES[architecture][1]
    text = config
    if nested:
        sub = config.sub("text_config")
        if sub is None:
            raise ModelConfigError("required for this architecture", "text_config")
        text = sub
    if architecture in _LLAVA:
        # only what the file leaves out: a null (Mistral's "sliding_window": null) stays
        defaults = _LLAVA_TEXT_DEFAULTS.get(text.text("model_type", "llama"), {})
        missing = {key: value for key, value in defaults.items() if key not in text.data}
    else:
        defaults = FAMILY_DEFAULTS.get(architecture, {})
        missing = {key: value for key, value in defaults.items() if not text.has(key)}
    if missing:
        text = HFConfig({**text.data, **missing}, text.path, text.source)
        text.defaulted = tuple(sorted(missing))
    return text


_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_target_positions",
    "model_max_length",
)
# Rope types whose max_position_embeddings is already the scaled length (vLLM 0.33).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def derived_max_model_len(config: HFConfig) -> int:
    """The model's own maximum length as vLLM 0.33 derives it: the smallest length key,
    times the RoPE scaling factor unless the rope type is pre-scaled (or Gemma 3)."""
    lengths = [config.integer(key) for key in _MAX_LEN_KEYS if config.has(key)]
    if not lengths:
        raise ModelConfigError(
            "none of " + ", ".join(_MAX_LEN_KEYS) + " is set",
            config._where("max_position_embeddings"),
        )
    length = min(lengths)
    scaling = config.sub("rope_scaling") or config.sub("rope_parameters")
    if scaling is not None and "gemma3" not in config.text("model_type", ""):
        kind = scaling.raw("rope_type", scaling.raw("type", "default"))
        factor = scaling.raw("factor", 1.0)
        if kind not in (*_PRESCALED_ROPE, "default"):
            if not isinstance(factor, int | float) or factor <= 0:
                raise ModelConfigError(
                    f"expected a positive number, got {factor!r}", scaling._where("factor")
                )
            length = int(length * factor)
    return length


def serving_dtype(checkpoint: Dtype) -> Dtype:
    """The dtype vLLM runs a checkpoint in with `--dtype auto` (its default): float32
    checkpoints (e.g. Whisper's) are downcast to the platform's preferred dtype, bfloat16
    on the Ampere-or-newer GPUs of the catalog; other dtypes run as stored."""
    return Dtype.BFLOAT16 if checkpoint is Dtype.FLOAT32 else checkpoint


def import_layers(config: HFConfig, deployment: Deployment = Deployment()) -> ModelLayers:
    """The cache layers one tensor-parallel worker registers for `config`."""
    if deployment.tensor_parallel_size < 1:
        raise ModelConfigError("tensor_parallel_size must be >= 1")
    if deployment.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise UnsupportedModel(
            f"kv_cache_dtype {deployment.kv_cache_dtype!r} is not supported by the importer "
            f"(its page size depends on the attention backend); supported: "
            + ", ".join(SUPPORTED_KV_CACHE_DTYPES)
        )
    architecture = architecture_of(config)
    text = text_config(config, architecture)
    if architecture in _READS_IS_CAUSAL and not text.flag("is_causal", True):
        raise UnsupportedModel(
            "false makes every attention layer bidirectional (encoder-only), and vLLM keeps "
            "no KV cache for encoder-only attention: there is no KV capacity to plan (the "
            "memory is weights and activations only)",
            text._where("is_causal"),
        )
    build, _ = ARCHITECTURES[architecture]
    speculative = deployment.speculative
    if speculative is not None:
        if speculative.method not in SPECULATIVE_METHODS:
            raise UnsupportedModel(
                f"speculative method {speculative.method!r} is not supported by the importer; "
                "supported: " + ", ".join(SPECULATIVE_METHODS)
            )
        if speculative.method != "mtp":
            if speculative.draft_config is None:
                raise ModelConfigError(
                    f"{speculative.method} needs the drafter's config (--draft-model PATH)"
                )
        elif speculative.draft_config is not None:
            raise ModelConfigError("mtp uses the model's own MTP layers: drop --draft-model")
        elif architecture not in _MTP_CAPABLE:
            raise UnsupportedModel(
                f"{architecture} has no MTP layers; MTP import is supported for "
                + ", ".join(sorted(_MTP_CAPABLE))
            )
    # vLLM reads the root config's dtype first, the text config's only where the root
    # names none (ModelArchConfigConvertorBase.get_torch_dtype, 0.32-0.34):
    # llava-v1.6-mistral-7b-hf runs in its root float16, not its text bfloat16.
    named = config.has("torch_dtype") or config.has("dtype")
    checkpoint_dtype = config.dtype() if named else text.dtype()
    model_dtype = serving_dtype(checkpoint_dtype)
    if deployment.dtype != "auto":
        model_dtype = HFConfig({"torch_dtype": deployment.dtype}, "--dtype").dtype()
    builder = _Builder(
        config=text,
        deployment=deployment,
        architecture=architecture,
        model_dtype=model_dtype,
        kv_dtype=kv_storage_dtype(deployment.kv_cache_dtype, model_dtype),
    )
    registration = registration_for(deployment.engine_version)
    default_block = (
        DEFAULT_MLA_BLOCK_SIZE if architecture in _MLA else registration.default_block_size
    )
    builder.block_size = deployment.block_size or default_block
    if model_dtype is not checkpoint_dtype:
        builder.notes.append(
            f"checkpoint dtype {checkpoint_dtype.value} runs as {model_dtype.value} "
            "(vLLM's dtype 'auto' on Ampere or newer GPUs)"
        )
    if text.defaulted:
        builder.notes.append(
            "omitted in the config, filled with the family's transformers defaults: "
            + ", ".join(f"{key}={text.data[key]}" for key in text.defaulted)
        )
    if architecture in _LLAVA and not is_llava_tower(config):
        raise UnsupportedModel(
            "LLaVA is supported with a SigLIP or CLIP tower ("
            + ", ".join(LLAVA_TOWERS)
            + "); the vision weights and encoder profile of "
            "another (Pixtral's) are not estimated",
            "vision_config.model_type",
        )
    build(builder)
    if speculative is not None and speculative.draft_config is not None:
        _eagle_drafter(builder, speculative.draft_config)
    has_mamba = any(layer.is_state for layer in builder.layers)
    mode = "none"
    if has_mamba:
        mode = "align" if deployment.enable_prefix_caching else "none"
        _align_hybrid(builder, mode, derived_max_model_len(text))
    return ModelLayers(
        architecture=architecture,
        model_type=text.text("model_type", config.text("model_type", "")),
        layers=tuple(builder.layers),
        block_size=builder.block_size,
        model_dtype=model_dtype,
        mamba_cache_mode=mode,
        derived_max_model_len=derived_max_model_len(text),
        num_hidden_layers=text.integer(
            "decoder_layers" if architecture in ENCODER_DECODER else "num_hidden_layers"
        ),
        encoder_decoder=architecture in ENCODER_DECODER,
        num_nextn_predict_layers=builder.num_nextn,
        notes=tuple(builder.notes),
        marks_draft_layers=registration.marks_draft_layers,
    )


def _align_hybrid(b: _Builder, mode: str, derived_len: int) -> None:
    """Hybrid block-size alignment (vLLM's platform step, before specs are built)."""
    attention = [layer for layer in b.layers if not layer.is_state]
    state_pages = {layer.real_page_bytes for layer in b.layers if layer.is_state}
    if len(state_pages) != 1:
        raise UnsupportedModel("Mamba layers with different state sizes are not supported")
    state_page = state_pages.pop()
    block = b.block_size
    padded = state_page
    if attention:
        per_token = attention[0].per_token_bytes
        alignment = max(KERNEL_BLOCK_ALIGNMENT, block)
        attn_block = alignment * cdiv(state_page, alignment * per_token)
        attn_block = KERNEL_BLOCK_ALIGNMENT * cdiv(attn_block, KERNEL_BLOCK_ALIGNMENT)
        block = max(block, attn_block)
        padded = block * per_token
        b.notes.append(
            f"hybrid alignment: attention block raised to {block} tokens so one attention page "
            f"({padded:,} B) holds a Mamba page ({state_page:,} B)"
        )
    state_block = block if mode == "align" else (b.deployment.max_model_len or derived_len)
    b.layers = [
        layer.aligned(state_block, padded if padded != state_page else None)
        if layer.is_state
        else layer.aligned(block)
        for layer in b.layers
    ]
    b.block_size = block
