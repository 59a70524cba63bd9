"""Memory outside the KV cache, estimated from the config (stated as estimates).

Weights: a parameter count by architecture (embeddings, attention / MLA / Mamba / GDN
projections, dense or MoE MLPs, MTP modules) times bytes per parameter for the
checkpoint's quantization, divided over tensor-parallel ranks (vocab-parallel embeddings
and sharded projections); MoE routers are replicated on every rank, MXFP4 experts padded
per rank as vLLM's MoE kernel needs; norms are negligible and left out.

Runtime overhead: the profiling run's activation peak plus non-torch memory, with the
formula in `OVERHEAD_FORMULA`; what each release counts there (the sampler phase,
non-torch memory, the CUDA-graph estimate) is in profiling.py. Pass `--non-kv-bytes`
for a measured figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

from kvplan.gpus import MIB
from kvplan.models.config import HFConfig, ModelConfigError
from kvplan.models.encoder import (
    EncoderProfile,
    MultimodalOptions,
    deepstack_buffer_bytes,
    encoder_profile,
    is_llava_tower,
    llava_feature_layers,
    llava_tower_family,
    llava_vision_layers,
    moonvit_merge_kernel,
)
from kvplan.models.importer import ARCHITECTURES, ModelLayers, pipeline_stage_bounds, text_config
from kvplan.models.profiling import (
    PROFILES,
    RunnerModel,
    cublas_workspace_bytes,
    cudagraph_estimate,
    custom_all_reduce_on,
    default_runner_is_v2,
    float32_logits_saving,
    gdn_graph_transient,
    graph_estimate_runs,
    mrv2_sampler_bytes,
    nccl_all_reduces_per_graph,
    non_torch_bytes,
    profile_rules,
    release_version,
    sampler_bytes_per_logit,
    triton_row_buffer_bytes,
)

# A pipeline stage's profile run (vLLM 0.19's gpu_model_runner.profile_run and
# _dummy_run): only the last stage runs the dummy sampler (`is_last_rank`), and every
# stage but the first keeps the tensors it receives, `make_empty_intermediate_tensors`
# of max_num_batched_tokens rows: hidden states and residual (the Llama-style
# families), zeros in the model dtype, held for the process. Llama-3.1-8B at PP 2
# (0.19, H100): the last stage logs 2.01 GiB, 1.89 (its TP 1 figure) + 2 x 8,192 x
# 4,096 x 2 B (0.125 GiB).
_PP_RECEIVED_TENSORS = 2


def moe_workspace_per_token(c: HFConfig, tensor_parallel_size: int) -> int:
    """Elements per batched token of the fused-MoE scratch vLLM's workspace manager
    keeps (0.19's modular TritonExperts, `workspace_shapes` and
    `_allocate_buffers`): workspace13, top_k x max(activation output, hidden), which
    the output (hidden) shares, and workspace2, top_k x max(gate-up output, hidden).
    The gate-up output is 2 x the expert size per rank for a gated activation, 1 x for
    relu^2; the activation's output 1 x. Checked on 0.19's H100 logs: Mixtral-8x7B at
    TP 2 672 MiB and Qwen3-30B-A3B 512 MiB above the dense terms, against 673 and 519."""
    hidden = c.integer("hidden_size")
    expert = c.integer("moe_intermediate_size") if c.has("moe_intermediate_size") else 0
    expert = (expert or c.integer("intermediate_size")) // tensor_parallel_size
    top_k = c.opt_integer("num_experts_per_tok") or c.opt_integer("moe_topk") or 1
    gate_up = (_matrices(c) - 1) * expert
    return top_k * (max(expert, hidden) + max(gate_up, hidden))


OVERHEAD_FORMULA = (
    "activation_peak = cuBLAS workspace (32 MiB; 8 MiB before Hopper) + max(tokens x"
    " (3 x hidden + max(attention_per_rank, mlp_per_rank)) x act_bytes, (tokens + 2 x"
    " max_num_seqs) x hidden x act_bytes [+ the fused-MoE workspace, tokens x top_k x"
    " (max(expert/tp, hidden) + max(gate_up/tp, hidden)) x act_bytes, from 0.13, not with"
    " MXFP4's monolithic kernels] + max_num_seqs x vocab x B, the V1 runner's B: 14 from"
    " vLLM 0.17 (its Triton kernel, + min(next_pow2(min(SMs, max_num_seqs)), SMs) x vocab"
    " x 4 B of row buffer, SMs the GPU's, 132 when not known), 38 on PyTorch's sort"
    " (0.11.1-0.16, and <= 0.11.0 without FlashInfer), 16 on FlashInfer's (<= 0.11.0),"
    " - 2 with float32 logits, which are the sampler's float32 copy; on Model Runner V2"
    " (its default models from 0.22, every model from 0.29) the requests' hidden states"
    " once (tokens + max_num_seqs), B 6 (0.22-0.25) / 2 (0.26-0.32) + 12 B per"
    " 1,024-logit block, 14 (from 0.33), + 2 with float32 logits, no row buffer);"
    " mlp_per_rank = matrices x ffn / tp, or top_k x (matrices x expert_ffn / tp + hidden)"
    " for MoE;  non_torch = 2.07 GiB where vLLM runs custom all-reduce (TP 2, 4, 6, 8, 16;"
    " not --disable-custom-all-reduce; not TP > 2 on GPUs without NVLink), else 0.25 GiB;"
    " CUDA graphs (from vLLM 0.20; 0 on Model Runner V2 before 0.29 and under 0.34's"
    " extensible cache) = n_piecewise x 7.1 MiB + n_full x largest_full x 19.6 KiB"
    " (+ (n_piecewise + n_full) x (2 x layers + 1) x 167 KiB where TP > 1 runs without"
    " custom all-reduce: NCCL's captured all-reduces)"
    " (0.26-0.28 with GDN layers: at least the first FULL sample's context x 128 KiB);"
    " a vision model: max(encoder inputs + encoder forward, inputs + embeddings + the above)"
    " (Qwen3-VL's deepstack levels x max_num_batched_tokens x text hidden x act_bytes are"
    " built with the model: in the weights)"
)


@dataclass(frozen=True)
class ParamCount:
    embedding: int  # embeddings + lm head
    attention: int
    mlp: int  # dense MLPs and routed / shared experts
    state_space: int  # Mamba / GDN mixers
    draft: int  # MTP modules
    router: int = 0  # MoE routers: replicated on every rank
    vision: int = 0  # a multimodal wrapper's vision tower and projector

    @property
    def total(self) -> int:
        return (
            self.embedding + self.attention + self.mlp + self.state_space + self.draft
            + self.router + self.vision
        )  # fmt: skip


@dataclass(frozen=True)
class WeightEstimate:
    params: ParamCount
    quantization: str  # "none", "fp8", "awq-int4", "gptq-int4", "mxfp4"
    bytes_total: int
    bytes_per_worker: int  # the largest stage's rank: what limits the KV cache
    # One rank of each pipeline stage, first to last (one entry without PP).
    bytes_per_stage: tuple[int, ...] = ()
    rope_cache_bytes: int = 0  # in every rank's figure (RoPE cos/sin caches)
    # Buffers the model allocates when it is built, so "Model loading took" counts them
    # (in every rank's figure): Qwen3-VL's deepstack input buffers, vLLM 0.19's FlashInfer
    # MLA workspace.
    model_buffer_bytes: int = 0

    def stage_bytes(self, stage: int) -> int:
        return self.bytes_per_stage[stage] if self.bytes_per_stage else self.bytes_per_worker


@dataclass(frozen=True)
class OverheadEstimate:
    activation_peak_bytes: int
    non_torch_bytes: int
    cudagraph_bytes: int = 0  # what the release subtracts for CUDA graphs
    # The estimate vLLM logs ("Estimated CUDA graph memory"), subtracted or not.
    cudagraph_logged_bytes: int = 0
    formula: str = OVERHEAD_FORMULA
    release: str = "vLLM >= 0.20"
    # A multimodal model's encoder run (in the activation peak), None where none runs.
    encoder: EncoderProfile | None = None
    # The part of `cudagraph_bytes` for NCCL all-reduces captured in the graphs (a TP
    # group without custom all-reduce; `nccl_all_reduces_per_graph`).
    cudagraph_nccl_bytes: int = 0
    # The graphs the engine goes on to capture, by the same per-graph costs, whether or
    # not the release subtracts an estimate first: what vLLM 0.34's extensible cache
    # finds used after capture (kvplan/models/extensible.py).
    cudagraph_captured_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.activation_peak_bytes + self.non_torch_bytes + self.cudagraph_bytes


def _attention_params(c: HFConfig) -> int:
    hidden = c.integer("hidden_size")
    heads = c.integer("num_attention_heads")
    if c.has("kv_lora_rank"):  # MLA
        nope = c.integer("qk_nope_head_dim")
        rope = c.integer("qk_rope_head_dim")
        v_dim = c.integer("v_head_dim")
        latent = c.integer("kv_lora_rank")
        q_rank = c.size_or_none("q_lora_rank")
        q = (
            hidden * heads * (nope + rope)
            if q_rank is None
            else hidden * q_rank + q_rank * heads * (nope + rope)
        )
        return (
            q + hidden * (latent + rope) + latent * heads * (nope + v_dim) + heads * v_dim * hidden
        )
    head_dim = c.integer("head_dim") if c.has("head_dim") else hidden // heads
    kv_heads = c.integer("num_key_value_heads") if c.has("num_key_value_heads") else heads
    # Qwen3-Next / Qwen3.5 gate the attention output: the query projection also emits a
    # gate per head (vLLM's Qwen3NextAttention, `attn_output_gate`, default true).
    gate = (
        heads
        if _GATED_ATTENTION.get(c.text("model_type", ""), False)
        and c.flag("attn_output_gate", True)
        else 0
    )
    return hidden * head_dim * (2 * heads + 2 * kv_heads + gate)


_GATED_ATTENTION = {"qwen3_next": True, "qwen3_5_text": True, "qwen3_5_moe_text": True}


def _expert_count(c: HFConfig) -> int:
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        size = c.size_or_none(key)  # 0 / null: a dense model
        if size:
            return size
    return 0


# Families (model_type) whose MLP is one up and one down projection, no gate: Phi-1 /
# 1.5 / 2's fc1 and fc2 (vLLM's PhiMLP, `n_inner` wide, else 4 x hidden: the published
# Phi configs' `intermediate_size`).
_TWO_MATRIX_MLP = frozenset({"phi"})


def _matrices(c: HFConfig) -> int:
    """Gated MLPs (SiLU/GELU) hold gate, up and down; Nemotron-H's relu^2 MLPs and
    experts and the `_TWO_MATRIX_MLP` families only up and down (vLLM's NemotronHMLP /
    its experts, PhiMLP)."""
    relu2 = c.has("mlp_hidden_act") and c.text("mlp_hidden_act") == "relu2"
    return 2 if relu2 or c.text("model_type", "") in _TWO_MATRIX_MLP else 3


def _mlp_params(c: HFConfig, layer: int) -> tuple[int, int]:
    """(MLP / expert parameters, router parameters) of one decoder layer."""
    hidden = c.integer("hidden_size")
    experts = _expert_count(c)
    matrices = _matrices(c)
    if c.has("interleave_moe_layer_step"):  # Llama 4: MoE layers + a shared expert
        step = c.integer("interleave_moe_layer_step", minimum=0)
        if step == 0 or (layer + 1) % step:
            return 3 * hidden * c.integer("intermediate_size_mlp"), 0
        expert_size = c.integer("intermediate_size")
        return (experts + 1) * 3 * hidden * expert_size, hidden * experts
    dense_first = c.integer("first_k_dense_replace", 0, minimum=0)
    if c.has("expert_layer_period"):  # Jamba: experts every period-th layer from offset
        period = c.integer("expert_layer_period")
        if layer % period != c.integer("expert_layer_offset", 0, minimum=0):
            experts = 0
    if experts and layer >= dense_first:
        expert_size = (
            c.integer("moe_intermediate_size")
            if c.has("moe_intermediate_size")
            else c.integer("intermediate_size")
        )
        shared_count = c.integer("n_shared_experts", 0, minimum=0)
        # The shared expert's own size field where the config has one (Nemotron-H:
        # moe_shared_expert_intermediate_size; Qwen2/3-MoE: shared_expert_intermediate_size,
        # 0 = none); DeepSeek's n_shared_experts are routed-expert sized.
        shared_size = c.size_or_none("moe_shared_expert_intermediate_size")
        if shared_size is not None:
            shared = max(shared_count, 1) * matrices * hidden * shared_size
        elif shared_count:
            shared = shared_count * matrices * hidden * expert_size
        else:
            single = c.size_or_none("shared_expert_intermediate_size")
            shared = matrices * hidden * single if single else 0
        return experts * matrices * hidden * expert_size + shared, hidden * experts
    return matrices * hidden * c.integer("intermediate_size"), 0


def _state_params(c: HFConfig, kind: str) -> int:
    hidden = c.integer("hidden_size")
    if kind == "GDN_ATTENTION":
        k = c.integer("linear_num_key_heads") * c.integer("linear_key_head_dim")
        v = c.integer("linear_num_value_heads") * c.integer("linear_value_head_dim")
        return (
            hidden * (2 * k + 2 * v) + hidden * 2 * c.integer("linear_num_value_heads") + v * hidden
        )
    if kind == "MAMBA1":
        inner = c.integer("mamba_expand") * hidden
        rank = c.integer("mamba_dt_rank") if c.has("mamba_dt_rank") else -(-hidden // 16)
        state = c.integer("mamba_d_state")
        return (
            hidden * 2 * inner
            + inner * (rank + 2 * state)
            + rank * inner
            + inner * state
            + inner * hidden
        )
    inner = c.integer("mamba_num_heads") * c.integer("mamba_head_dim")
    groups = c.integer("n_groups")
    state = c.integer("ssm_state_size")
    in_proj = hidden * (2 * inner + 2 * groups * state + c.integer("mamba_num_heads"))
    return in_proj + inner * hidden


def _whisper_params(c: HFConfig) -> ParamCount:
    d = c.integer("d_model")
    encoder = c.integer("encoder_layers") * (4 * d * d + 2 * d * c.integer("encoder_ffn_dim"))
    encoder += 3 * d * (c.integer("num_mel_bins") + d)  # the two conv stem layers
    decoder = c.integer("decoder_layers") * (8 * d * d + 2 * d * c.integer("decoder_ffn_dim"))
    positions = (c.integer("max_source_positions") + c.integer("max_target_positions")) * d
    embedding = c.integer("vocab_size") * d + positions  # the output projection is tied
    # Encoder and decoder blocks (attention and MLP together) are counted as attention.
    return ParamCount(embedding, encoder + decoder, mlp=0, state_space=0, draft=0)


_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)


def padded_vocab(vocab: int) -> int:
    """The rows vLLM builds for a vocab-parallel embedding or LM head: the vocabulary
    rounded up to `_VOCAB_PADDING` (`pad_vocab_size` in vLLM's
    vocab_parallel_embedding.py), then split over the TP ranks. Granite 3.3's 49,159
    tokens become 49,216 rows; the other shipped decoder-only vocabularies are
    multiples of 64 (Whisper's token table is a plain `nn.Embedding`: not padded)."""
    return -(-vocab // _VOCAB_PADDING) * _VOCAB_PADDING


def count_params(config: HFConfig, layers: ModelLayers) -> ParamCount:
    c = text_config(config, layers.architecture)
    if layers.encoder_decoder:
        return _whisper_params(c)
    hidden = c.integer("hidden_size")
    vocab = padded_vocab(c.integer("vocab_size"))
    tied = c.flag("tie_word_embeddings", False)
    embedding = vocab * hidden * (1 if tied else 2)
    attention = mlp = state = draft = 0
    count = c.integer("num_hidden_layers")
    mamba_kinds = [layer.mamba_type for layer in layers.layers if layer.is_state]
    mamba_kind = mamba_kinds[0] if mamba_kinds else ""
    router = 0
    attention_layers = sum(
        1 for layer in layers.layers if not layer.is_draft and not layer.is_state
    )
    attention = attention_layers * _attention_params(c)
    state = len(mamba_kinds) * _state_params(c, mamba_kind) if mamba_kinds else 0
    pattern = c.text("hybrid_override_pattern", "") if c.has("hybrid_override_pattern") else ""
    for index in range(count):
        if pattern:
            if pattern[index] == "E":
                layer_mlp, layer_router = _mlp_params(c, index)
                mlp, router = mlp + layer_mlp, router + layer_router
            elif pattern[index] == "-":
                mlp += _matrices(c) * hidden * c.integer("intermediate_size")
            continue
        layer_mlp, layer_router = _mlp_params(c, index)
        mlp, router = mlp + layer_mlp, router + layer_router
    nextn = layers.num_nextn_predict_layers
    if nextn:
        draft = nextn * (_attention_params(c) + sum(_mlp_params(c, count)) + 2 * hidden * hidden)
    # A multimodal checkpoint's vision tower is loaded too (vLLM builds the whole
    # *ForConditionalGeneration model).
    return ParamCount(
        embedding, attention, mlp, state, draft, router, _vision_params(config, hidden)
    )


# Families whose vLLM model builds the embeddings only on the first pipeline stage and
# the LM head only on the last (LlamaModel, Qwen2Model, GraniteModel and DeepSeek-V2's
# `is_first_rank` / `is_last_rank` checks, and the models built on them); with tied embeddings the
# last stage builds its own copy for the head. Every other family builds both on every
# stage (vLLM 0.32-0.34: Mixtral, Qwen3-MoE, Gemma 2 / 3, gpt-oss, Qwen3-Next,
# Nemotron-H, Jamba). tests/models/test_against_vllm_pp.py counts vLLM's own modules.
_PP_EMBEDDINGS_AT_THE_ENDS = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "GraniteForCausalLM", "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "LlavaNextForConditionalGeneration", "LlavaForConditionalGeneration",
    "KimiVLForConditionalGeneration",
})  # fmt: skip
# Qwen3.5 / 3.6 build the embedding on every stage and the LM head on the last only
# (a tied head shares the last stage's embedding).
_PP_HEAD_ON_THE_LAST = frozenset({
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
})  # fmt: skip


def _decoder_layer_params(c: HFConfig, layers: ModelLayers) -> list[ParamCount]:
    """Each decoder layer's attention / mixer, MLP and router parameters, as
    `count_params` counts them (their sum is its attention + state + MLP + router)."""
    hidden = c.integer("hidden_size")
    count = c.integer("num_hidden_layers")
    attention_at = {layer.decoder_index for layer in layers.layers
                    if not layer.is_draft and not layer.is_state}  # fmt: skip
    state_kinds = {layer.decoder_index: layer.mamba_type for layer in layers.layers
                   if layer.is_state and not layer.is_draft}  # fmt: skip
    attention = _attention_params(c)
    pattern = c.text("hybrid_override_pattern", "") if c.has("hybrid_override_pattern") else ""
    result = []
    for index in range(count):
        mlp = router = 0
        if not pattern or pattern[index] == "E":
            mlp, router = _mlp_params(c, index)
        elif pattern[index] == "-":
            mlp = _matrices(c) * hidden * c.integer("intermediate_size")
        state = _state_params(c, state_kinds[index]) if index in state_kinds else 0
        result.append(ParamCount(0, attention if index in attention_at else 0, mlp, state, 0,
                                 router))  # fmt: skip
    return result


def stage_params(
    config: HFConfig, layers: ModelLayers, bounds: list[tuple[int, int]]
) -> list[ParamCount]:
    """The parameters each pipeline stage builds, for stages holding decoder layers
    [start, end): its layers, the embeddings where the family's vLLM model builds them
    (`_PP_EMBEDDINGS_AT_THE_ENDS`), MTP modules on the last stage and the vision tower
    on every stage (vLLM builds it without a stage check). One stage: `count_params`."""
    if len(bounds) == 1:
        return [count_params(config, layers)]
    c = text_config(config, layers.architecture)
    total = count_params(config, layers)
    table = padded_vocab(c.integer("vocab_size")) * c.integer("hidden_size")
    per_layer = _decoder_layer_params(c, layers)
    vision = _vision_params(config, c.integer("hidden_size"))
    stages = []
    for stage, (start, end) in enumerate(bounds):
        first, last = stage == 0, stage == len(bounds) - 1
        if layers.architecture in _PP_EMBEDDINGS_AT_THE_ENDS:
            embedding = table * (first + last)
        elif layers.architecture in _PP_HEAD_ON_THE_LAST:
            embedding = table * (1 + (last and not c.flag("tie_word_embeddings", False)))
        else:  # both tables (one if tied) on every stage
            embedding = total.embedding
        mine = per_layer[start:end]
        stages.append(ParamCount(
            embedding,
            sum(p.attention for p in mine),
            sum(p.mlp for p in mine),
            sum(p.state_space for p in mine),
            total.draft if last else 0,
            sum(p.router for p in mine),
            vision,
        ))  # fmt: skip
    return stages


def _qwen3_vision_params(vision: HFConfig) -> int:
    """Qwen3-VL's vision transformer, which Qwen3.5 / 3.6 load (vLLM's
    Qwen3_VisionTransformer): a Conv3d patch embedding, a learned position table, per
    block two LayerNorms, a fused QKV and an output projection and a two-matrix MLP
    (all with biases), then the patch merger (a LayerNorm and two linears over
    `spatial_merge_size`^2 patches into the text width) and one more merger per
    deepstack level."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    stem = vision.integer("in_channels", 3) * vision.integer("temporal_patch_size", 2)
    stem = stem * patch * patch * width + width
    positions = vision.integer("num_position_embeddings") * width
    block = 4 * width + 4 * width * width + 4 * width + 2 * width * inter + inter + width
    merged = width * vision.integer("spatial_merge_size", 2) ** 2
    out = vision.integer("out_hidden_size")
    merger = merged * merged + merged + merged * out + out
    deepstack = len(vision.items("deepstack_visual_indexes") or [])
    return (
        stem + positions + vision.integer("depth") * block
        + (merger + 2 * width) + deepstack * (merger + 2 * merged)
    )  # fmt: skip


def _qwen2_5_vision_params(vision: HFConfig) -> int:
    """Qwen2.5-VL's windowed vision transformer (vLLM's Qwen2_5_VisionTransformer): a
    Conv3d patch embedding without bias, per block two RMSNorms, a fused QKV and an
    output projection and a gated MLP (all with biases), then the patch merger (an
    RMSNorm and two linears over `spatial_merge_size`^2 patches into the text width)."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    stem = vision.integer("in_channels", 3) * vision.integer("temporal_patch_size", 2)
    stem = stem * patch * patch * width
    block = 2 * width + 4 * width * width + 4 * width + 3 * width * inter + 2 * inter + width
    merged = width * vision.integer("spatial_merge_size", 2) ** 2
    out = vision.integer("out_hidden_size")
    merger = width + merged * merged + merged + merged * out + out
    return stem + vision.integer("depth") * block + merger


def _llama4_vision_params(vision: HFConfig, text_hidden: int) -> int:
    """Llama 4's vision model (vLLM's Llama4VisionModel: an unfold patch embedding
    without bias, a class embedding and a position embedding per patch and CLS, pre and
    post LayerNorms, per layer Q/K/V/O and a two-matrix MLP with biases and two
    LayerNorms, the pixel-shuffle adapter's two bias-free linears) and the projector
    into the text width (Llama4MultiModalProjector, no bias)."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    patches = (vision.integer("image_size") // patch) ** 2 + 1
    stem = vision.integer("num_channels", 3) * patch * patch * width + width + patches * width
    layer = 4 * width * width + 4 * width + 2 * width * inter + inter + width + 4 * width
    projector_in = vision.integer("projector_input_dim")
    adapter = inter * projector_in + projector_in * vision.integer("projector_output_dim")
    projector = vision.integer("vision_output_dim") * text_hidden
    return stem + 4 * width + vision.integer("num_hidden_layers") * layer + adapter + projector


def _llava_tower_stem_params(vision: HFConfig) -> int:
    """The tower's parameters outside its encoder layers (vLLM's siglip.py / clip.py
    embeddings), by family (encoder.LLAVA_TOWERS): the patch convolution (SigLIP's with
    a bias), a position embedding per patch and for CLIP's class token, CLIP's class
    embedding and its pre-layernorm (`pre_layrnorm`)."""
    family = llava_tower_family(vision)
    width = vision.integer("hidden_size")
    patch = vision.integer("patch_size")
    positions = (vision.integer("image_size") // patch) ** 2 + family.class_token
    conv = vision.integer("num_channels", 3) * patch * patch * width + family.conv_bias * width
    return conv + positions * width + family.class_token * width + family.pre_norm * 2 * width


def _llava_vision_params(config: HFConfig, vision: HFConfig, text_hidden: int) -> int:
    """A LLaVA wrapper's tower and projector as vLLM builds them (llava.py
    `init_vision_tower_for_llava`, llava_next.py): the encoder layers up to the deepest
    feature layer only, per layer Q/K/V/O and fc1 / fc2 with biases and two LayerNorms
    (SigLIP and CLIP alike); the stem (`_llava_tower_stem_params`); the two-layer
    projector from the concatenated feature layers (LLaVA-Next with a list; one layer's
    width otherwise), with biases unless `multimodal_projector_bias` is false; and
    LLaVA-Next's image-newline vector."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    layer = 4 * width * width + 2 * width * inter + 9 * width + inter
    features = llava_feature_layers(config)
    bias = 2 * text_hidden if config.flag("multimodal_projector_bias", True) else 0
    projector = features * width * text_hidden + text_hidden * text_hidden + bias
    newline = text_hidden if config.text("model_type", "") == "llava_next" else 0
    return (
        llava_vision_layers(config, vision) * layer + _llava_tower_stem_params(vision)
        + projector + newline
    )  # fmt: skip


def replicated_params(config: HFConfig, layers: ModelLayers, stage_layers: int) -> int:
    """Parameters vLLM builds whole on every tensor-parallel rank, besides the MoE
    routers: MLA's down projections (deepseek_v2.py: `kv_a_proj_with_mqa` and, with a
    `q_lora_rank`, `q_a_proj`, fused as DeepSeekV2FusedQkvAProjLinear with
    `disable_tp=True`; ReplicatedLinear otherwise), per MLA layer of the stage; and
    Kimi-VL's MoonViT parts outside its parallel linears' sharded weights (moonvit.py,
    kimi_vl.py: the patch convolution, the position grid, the LayerNorms, the biases of
    the row-parallel `wo` and `fc1`, and the projector's ReplicatedLinear layers); and a
    LLaVA tower's (`_llava_whole_params`). Counted for unquantized checkpoints."""
    c = text_config(config, layers.architecture)
    whole = 0
    if c.has("kv_lora_rank"):
        hidden = c.integer("hidden_size")
        latent = c.integer("kv_lora_rank") + c.integer("qk_rope_head_dim")
        q_rank = c.size_or_none("q_lora_rank")
        whole += stage_layers * hidden * (latent + (q_rank or 0))
    vision = config.sub("vision_config")
    if vision is not None and config.text("model_type", "") == "kimi_vl":
        width = vision.integer("hidden_size")
        inter = vision.integer("intermediate_size")
        # sharded: the QKV, output and MLP matrices and the column-parallel biases (QKV,
        # fc0); the row-parallel ones' biases (wo, fc1) and the LayerNorms stay whole
        layer = 4 * width * width + 2 * width * inter + 3 * width + inter
        parallel = vision.integer("num_hidden_layers") * layer
        whole += _moonvit_params(vision, c.integer("hidden_size")) - parallel
    if vision is not None and is_llava_tower(config):
        whole += _llava_whole_params(config, vision, c.integer("hidden_size"))
    return whole


def _llava_whole_params(config: HFConfig, vision: HFConfig, text_hidden: int) -> int:
    """A LLaVA tower's parameters vLLM keeps whole on every tensor-parallel rank (its
    tower shards across the TP group unless `mm_encoder_tp_mode` is "data", which kvplan
    does not read): the stem (the patch convolution, position and class embeddings and
    CLIP's pre-layernorm are plain modules), per built layer the two LayerNorms and the
    row-parallel biases (out_proj, fc2), the projector's row-parallel linear_2 bias and
    LLaVA-Next's newline vector. 1,345,536 parameters for llava-v1.6-mistral-7b-hf."""
    width = vision.integer("hidden_size")
    layers = llava_vision_layers(config, vision) * 6 * width
    bias = text_hidden if config.flag("multimodal_projector_bias", True) else 0
    newline = text_hidden if config.text("model_type", "") == "llava_next" else 0
    return _llava_tower_stem_params(vision) + layers + bias + newline


def _moonvit_params(vision: HFConfig, text_hidden: int) -> int:
    """Kimi-VL's MoonViT and projector as vLLM builds them (moonvit.py, kimi_vl.py): the
    patch convolution with its bias and a learnable init_pos_emb_height x width position
    grid; per layer two LayerNorms, the fused QKV and the output projection with biases
    and the two-matrix MLP with biases; the final LayerNorm; the projector's LayerNorm
    and its two linears from the merged patches (hidden x the merge kernel's area)."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    layer = 4 * width * width + 2 * width * inter + 9 * width + inter
    positions = vision.integer("init_pos_emb_height") * vision.integer("init_pos_emb_width")
    stem = 3 * patch * patch * width + width + positions * width
    kernel = moonvit_merge_kernel(vision)
    merged = width * kernel[0] * kernel[1]
    projector = 2 * width + merged * merged + merged + merged * text_hidden + text_hidden
    return vision.integer("num_hidden_layers") * layer + stem + 2 * width + projector


def _vision_params(config: HFConfig, text_hidden: int) -> int:
    """A SigLIP vision tower (Gemma 3's `vision_config`) and its projection into the
    text model: per encoder layer Q/K/V/O and a two-matrix MLP (with biases), the
    patch embedding and a position embedding per patch; or Qwen3-VL's, which Qwen3.5 /
    3.6 load too (`_qwen3_vision_params`); Qwen2.5-VL's (`_qwen2_5_vision_params`);
    Llama 4's (`_llama4_vision_params`); a LLaVA wrapper's SigLIP or CLIP tower
    (`_llava_vision_params`); Kimi-VL's MoonViT (`_moonvit_params`). Other vision towers
    are not counted (none of the supported families has one)."""
    vision = config.sub("vision_config")
    model_type = config.text("model_type", "")
    if vision is not None and model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_vl"):
        return _qwen3_vision_params(vision)
    if vision is not None and model_type == "qwen2_5_vl":
        return _qwen2_5_vision_params(vision)
    if vision is not None and model_type == "llama4":
        return _llama4_vision_params(vision, text_hidden)
    if vision is not None and is_llava_tower(config):
        return _llava_vision_params(config, vision, text_hidden)
    if vision is not None and model_type == "kimi_vl":
        return _moonvit_params(vision, text_hidden)
    if vision is None or vision.text("model_type", "") != "siglip_vision_model":
        return 0
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    layer = 4 * width * width + 2 * width * inter + 6 * width + inter
    patch = vision.integer("patch_size")
    patches = (vision.integer("image_size") // patch) ** 2
    stem = 3 * patch * patch * width + width + patches * width
    return vision.integer("num_hidden_layers") * layer + stem + width * text_hidden


# Families whose vLLM attention has no rotary embedding (Mamba layers carry position).
_NO_ROPE = frozenset({"JambaForCausalLM", "NemotronHForCausalLM",
                      "WhisperForConditionalGeneration"})  # fmt: skip


def _positive_number(c: HFConfig, key: str, default: float) -> float:
    value = c.raw(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ModelConfigError(f"expected a positive number, got {value!r}", c._where(key))
    return float(value)


def rope_cache_bytes(config: HFConfig, layers: ModelLayers) -> int:
    """The RoPE cos/sin caches vLLM builds with the model, on every rank: not
    parameters, but loaded with them ("Model loading took" counts them: Llama 3.1 8B's
    14.99 GiB against 14.96 of parameters). One cache per distinct rotary embedding
    (get_rope shares it between layers): positions x rotary dims in the model dtype
    (gpt-oss's in float32). Positions: max_position_embeddings, times the factor for
    linear / dynamic scaling, original_max_position_embeddings times the factor for
    YaRN. Gemma 3 holds a second, unscaled cache for its local layers. Checked against
    vLLM 0.34's model classes (tests/models/test_against_vllm_pp.py)."""
    if layers.architecture in _NO_ROPE:
        return 0
    c = text_config(config, layers.architecture)
    positions = c.opt_integer("max_position_embeddings") or layers.derived_max_model_len
    hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
    if c.has("kv_lora_rank"):  # MLA: only the rope part of each head rotates
        dims = c.integer("qk_rope_head_dim")
    else:
        head_dim = c.integer("head_dim") if c.has("head_dim") else hidden // heads
        dims = int(head_dim * _positive_number(c, "partial_rotary_factor", 1.0))
    scaling = c.sub("rope_scaling") or c.sub("rope_parameters")
    scaled = positions
    if scaling is not None:
        kind = scaling.text("rope_type", "") or scaling.text("type", "")
        if kind in ("linear", "dynamic"):
            scaled = int(positions * _positive_number(scaling, "factor", 1.0))
        elif kind in ("yarn", "deepseek_yarn"):
            original = scaling.integer("original_max_position_embeddings")
            scaled = int(original * _positive_number(scaling, "factor", 1.0))
    entries = scaled + (positions if layers.architecture.startswith("Gemma3") else 0)
    dtype_bytes = 4 if layers.architecture == "GptOssForCausalLM" else layers.model_dtype.size_bytes
    return entries * dims * dtype_bytes


# 4-bit weights + per 128-group an fp16 scale and a 4-bit zero point, packed eight to an
# int32 (vLLM 0.19's gptq_marlin / awq_marlin `create_weights`: `qzeros` is int32 of
# output / 8 per group, and a symmetric GPTQ checkpoint builds it too; the Machete and
# Marlin repacks keep both sizes). RedHatAI's GPTQ Llama 3.1 8B logs 5.38 GiB on 0.19.
_INT4_BYTES = 0.5 + 2.5 / 128


def _quantization(config: HFConfig, requested: str | None = None) -> tuple[str, float, bool]:
    """(name, bytes per quantized parameter, experts only). `requested` is vLLM's
    --quantization: it must name the checkpoint's method, or on an unquantized
    checkpoint `fp8` (quantized when loaded, one scale per tensor)."""
    quant = config.sub("quantization_config")
    if quant is None:
        if requested in (None, "none"):
            return ("none", 0.0, False)
        if requested == "fp8":
            return ("fp8", 1.0, False)
        if requested.startswith("modelopt"):
            raise ModelConfigError(
                f"--quantization {requested}: config.json has no quantization_config; vLLM then "
                "reads ModelOpt's settings from hf_quant_config.json, which kvplan does not: "
                "copy its 'quantization' section into config.json as quantization_config with "
                '"quant_method": "modelopt" (quant_algo, group_size, exclude_modules)'
            )
        raise ModelConfigError(
            f"--quantization {requested}: an unquantized checkpoint can be quantized on load "
            "only with fp8 in the weight estimate; pass --non-kv-bytes"
        )
    method = quant.text("quant_method")
    if requested == "modelopt" and method.startswith("modelopt"):
        requested = method  # vLLM's --quantization modelopt picks the checkpoint's algorithm
    if requested is not None and requested != method:
        raise ModelConfigError(
            f"--quantization {requested} does not match the checkpoint's {method!r} "
            "(vLLM refuses it too)",
            quant._where("quant_method"),
        )
    if method == "fp8":
        block = _fp8_block(quant)
        return ("fp8", 1 + (4 / (block[0] * block[1]) if block else 0.0), False)
    if method in ("awq", "gptq"):
        bits = quant.integer("bits", 4)
        if bits != 4:
            raise ModelConfigError(
                f"only 4-bit {method} is supported, got {bits}", quant._where("bits")
            )
        return (f"{method}-int4", _INT4_BYTES, False)
    if method == "mxfp4":
        return ("mxfp4", 0.5 + 1 / 32, True)  # e2m1 pairs + one e8m0 scale per 32
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "modelopt":
        return _modelopt(quant)
    raise ModelConfigError(
        f"quantization {method!r} is not supported by the weight estimate (fp8, awq, gptq, "
        "mxfp4, compressed-tensors, modelopt); pass --non-kv-bytes",
        quant._where("quant_method"),
    )


def _fp8_block(quant: HFConfig) -> tuple[int, int] | None:
    """An fp8 checkpoint's `weight_block_size` (output rows, input columns per scale);
    None: one scale per tensor."""
    block = quant.items("weight_block_size")
    if not block:
        return None
    if len(block) != 2 or not all(isinstance(side, int) and side > 0 for side in block):
        raise ModelConfigError(f"expected two positive sizes, got {block!r}",
                               quant._where("weight_block_size"))  # fmt: skip
    return int(block[0]), int(block[1])


# GPUs without fp8 tensor cores (compute capability below 8.9): vLLM serves fp8 weights
# there through its Marlin weight-only kernel (0.32-0.34 fp8.py picks
# MarlinFP8ScaledMMLinearKernel below 8.9).
_FP8_MARLIN_ARCHS = frozenset({"ampere"})
# Ada (8.9) has fp8 tensor cores, and its block-fp8 linear kernel depends on the
# release. 0.17.0-0.18.0 (fp8.py Fp8LinearMethod.__init__: `use_marlin` only below
# 8.9) and 0.19.0 (kernels/linear/scaled_mm/marlin.py
# MarlinFP8ScaledMMLinearKernel.is_supported refuses 8.9 and above) keep the block
# scales unless VLLM_TEST_FORCE_FP8_MARLIN is set (W8A8BlockFp8LinearOp).
# 0.32-0.34: Marlin's is_supported has no upper bound, and in
# kernels/linear/__init__.py `_POSSIBLE_FP8_BLOCK_KERNELS` every CUDA kernel ahead of
# it needs Hopper, Blackwell or 12.x (FlashInfer's and DeepGEMM's block GEMMs,
# CUTLASS's block kernel, B12x), so Ada's linear layers run Marlin. Their fp8 MoE
# oracle (fused_moe/oracle/fp8.py `_get_priority_backends`) lists TRITON before MARLIN
# and TritonExperts takes block fp8 from 8.9, so experts keep the block layout. Not
# read: 0.20-0.31 (planned with the block figure, as 0.19).
_FP8_MARLIN_ON_ADA_FROM = (0, 32, 0)


def _fp8_runs_marlin(c: HFConfig, gpu_arch: str, release: str) -> bool:
    """Whether vLLM `release` serves a block-fp8 checkpoint's weights through Marlin on
    a GPU of `gpu_arch`: always below capability 8.9; on Ada from 0.32 ("" or an
    unparseable release: the newest), for a model without experts (an MoE model's
    experts keep the block layout there, and its linear layers' Marlin scales are not
    counted apart)."""
    if gpu_arch in _FP8_MARLIN_ARCHS:
        return True
    if gpu_arch != "ada" or release == "v0" or _expert_count(c):
        return False
    version = release_version(release)
    return version is None or version >= _FP8_MARLIN_ON_ADA_FROM


def _fp8_marlin_bytes(
    config: HFConfig, text: HFConfig, gpu_arch: str, model_dtype_bytes: int, release: str = ""
) -> float | None:
    """Bytes per fp8 weight as a block-quantized fp8 checkpoint is held on a GPU that
    runs it through Marlin (`_fp8_runs_marlin`, on its text config `text`), None
    elsewhere. vLLM's
    prepare_fp8_layer_for_marlin
    (marlin_utils_fp8.py, 0.32-0.34) turns the block scales into group scales Marlin
    reads: one per `block_k` input columns for every output row, in the model dtype,
    replacing the float32 block scales after loading (so "Model loading took" counts
    them): 1 + 2 / 128 bytes per weight for 128 x 128 blocks in bf16. A per-tensor
    checkpoint gets one scale per output row (negligible)."""
    quant = config.sub("quantization_config")
    if quant is None or not _fp8_runs_marlin(text, gpu_arch, release):
        return None
    block = _fp8_block(quant)
    return None if block is None else 1 + model_dtype_bytes / block[1]


def _modelopt(quant: HFConfig) -> tuple[str, float, bool]:
    """NVIDIA ModelOpt as config.json's quantization_config states it (vLLM's
    ModelOptQuantConfigBase.from_config): NVFP4 (and W4A16_NVFP4) store e2m1 pairs
    with one fp8 scale per `group_size` (16) weights; FP8 one byte per weight with a
    per-tensor scale. Mixed precision is per layer and not estimated."""
    algo = quant.text("quant_algo").upper()
    if algo in ("NVFP4", "W4A16_NVFP4"):
        group = quant.integer("group_size", 16)
        return ("modelopt-nvfp4", 0.5 + 1 / group, False)
    if algo == "FP8":
        return ("modelopt-fp8", 1.0, False)
    raise ModelConfigError(
        f"ModelOpt quant_algo {algo!r} is not estimated (NVFP4, W4A16_NVFP4, FP8); pass "
        "--non-kv-bytes",
        quant._where("quant_algo"),
    )


def _all_excluded(names: list[str], patterns: list[str], mixed: str) -> bool:
    """Whether the exclusion `patterns` name every one of `names` (the representatives
    of a part the estimate counts whole); `mixed` says what a split would mean."""
    hits = {any(_matches(name, pattern) for pattern in patterns) for name in names}
    if len(hits) > 1:
        raise ModelConfigError(f"{mixed}: pass --non-kv-bytes", "quantization_config")
    return hits == {True}


def _excluded_patterns(config: HFConfig) -> list[str]:
    """The modules a checkpoint leaves unquantized: fp8's `ignored_layers` (else
    `modules_to_not_convert`), ModelOpt's `ignore` (else `exclude_modules`)."""
    quant = config.sub("quantization_config")
    if quant is None:
        return []
    keys = ("ignore", "exclude_modules", "ignored_layers", "modules_to_not_convert")
    for key in keys:
        patterns = quant.items(key)
        if patterns:
            return [str(pattern) for pattern in patterns]
    return []


def _matches(name: str, pattern: str) -> bool:
    # vLLM's rules together: an exact or substring match of the module name
    # (is_layer_skipped, ModelOpt's legacy substring rule) or a wildcard (fnmatch).
    return pattern in name or fnmatch(name, pattern)


def _unquantized_parts(config: HFConfig, layers: ModelLayers) -> frozenset[str]:
    """The ParamCount parts a quantized checkpoint keeps in the model dtype: the
    embeddings and LM head and the MoE routers always, and Llama 4's vision model and
    projector (vLLM builds them with no quantization config); the vision tower, MTP modules,
    attention, GDN / Mamba mixers or MLPs when the exclusion list names them. A part
    is matched through the checkpoint names of its first and last layer; a list that
    excludes one of them only (part of a group) cannot be estimated per part."""
    patterns = _excluded_patterns(config)
    kept = {"embedding", "router"}
    if config.text("model_type", "") == "llama4":
        kept.add("vision")  # vLLM builds Llama 4's vision model and projector unquantized
    if not patterns:
        return frozenset(kept)
    nested = ARCHITECTURES[layers.architecture][1]
    root = "model.language_model.layers" if nested else "model.layers"
    c = text_config(config, layers.architecture)
    mlp = "mlp.experts.0.gate_proj" if _expert_count(c) else "mlp.gate_proj"
    target = [layer for layer in layers.layers if not layer.is_draft]
    attention = [layer.decoder_index for layer in target if not layer.is_state]
    state = [layer.decoder_index for layer in target if layer.is_state]
    count = c.integer("num_hidden_layers")
    representatives: dict[str, list[str]] = {
        "attention": [f"{root}.{i}.self_attn.q_proj" for i in (attention[:1] + attention[-1:])],
        "state_space": [f"{root}.{i}.linear_attn.in_proj_qkv" for i in (state[:1] + state[-1:])],
        "mlp": [f"{root}.0.{mlp}", f"{root}.{count - 1}.{mlp}"],
    }
    if _vision_params(config, c.integer("hidden_size")) and "vision" not in kept:
        representatives["vision"] = [
            "model.visual.blocks.0.attn.qkv",
            "model.visual.merger.linear_fc2",
        ]
    if layers.num_nextn_predict_layers:  # MTP modules are loaded
        representatives["draft"] = ["mtp.layers.0.self_attn.q_proj", f"mtp.layers.0.{mlp}"]
    for part, names in representatives.items():
        if not names:
            continue
        mixed = (f"excludes part of the {part} weights only ({names[0]} and {names[-1]} "
                 "differ); the estimate counts whole parts")  # fmt: skip
        if _all_excluded(names, patterns, mixed):
            kept.add(part)
    return frozenset(kept)


def _kept_modules_within(
    config: HFConfig, layers: ModelLayers, kept: frozenset[str]
) -> tuple[int, int]:
    """Parameters the exclusion list keeps in the model dtype inside parts that are
    otherwise quantized, as (per GDN layer, in the MTP modules): the GDN mixers'
    `in_proj_a` / `in_proj_b` (hidden x value heads each; vLLM fuses them into
    `in_proj_ba`, whose shards must agree) and the MTP `fc` (2 x hidden -> hidden).
    Qwen's own fp8 checkpoints of Qwen3-Next and Qwen3.5 / 3.6 keep both in bf16 and
    quantize the rest of the mixer and of the MTP layer."""
    patterns = _excluded_patterns(config)
    if not patterns:
        return 0, 0
    c = text_config(config, layers.architecture)
    hidden = c.integer("hidden_size")
    nested = ARCHITECTURES[layers.architecture][1]
    root = "model.language_model.layers" if nested else "model.layers"
    gdn = [layer.decoder_index for layer in layers.layers
           if layer.mamba_type == "GDN_ATTENTION" and not layer.is_draft]  # fmt: skip
    per_gdn_layer = 0
    if gdn and "state_space" not in kept:
        names = [f"{root}.{i}.linear_attn.in_proj_{side}" for i in (gdn[0], gdn[-1])
                 for side in "ab"]  # fmt: skip
        mixed = (f"keeps part of the GDN in_proj_a / in_proj_b only ({', '.join(names)}); "
                 "the estimate counts them for every layer")  # fmt: skip
        if _all_excluded(names, patterns, mixed):
            per_gdn_layer = 2 * hidden * c.integer("linear_num_value_heads")
    fc = 0
    mtp = layers.num_nextn_predict_layers
    if mtp and "draft" not in kept and any(_matches("mtp.fc", pattern) for pattern in patterns):
        fc = mtp * 2 * hidden * hidden
    return per_gdn_layer, fc


def _compressed_tensors(quant: HFConfig) -> tuple[str, float, bool]:
    """compressed-tensors: every config group's weights must share one bit width; a
    grouped scheme adds a 2-byte scale per `group_size` weights."""
    groups = quant.sub("config_groups")
    if groups is None or not groups.data:
        raise ModelConfigError("required for compressed-tensors", quant._where("config_groups"))
    schemes: set[tuple[int, int | None]] = set()
    for name in groups.data:
        group = groups.sub(name)
        weights = group.sub("weights") if group is not None else None
        if weights is None:
            raise ModelConfigError("required field is missing", groups._where(f"{name}.weights"))
        bits = weights.integer("num_bits")
        if bits not in (4, 8):
            raise ModelConfigError(f"only 4- and 8-bit weights are estimated, got {bits}",
                                   weights._where("num_bits"))  # fmt: skip
        schemes.add((bits, weights.opt_integer("group_size")))
    if len(schemes) != 1:
        raise ModelConfigError(
            f"groups quantize weights differently ({sorted(schemes, key=str)}); pass "
            "--non-kv-bytes",
            quant._where("config_groups"),
        )
    bits, group_size = schemes.pop()
    scale = 2 / group_size if group_size else 0.0
    return (f"compressed-tensors-w{bits}", bits / 8 + scale, False)


# The MoE kernel vLLM runs MXFP4 experts with by default, by GPU and release (read in
# the wheels' quantization/mxfp4.py `get_mxfp4_backend`, 0.10.2-0.18.0, and
# fused_moe/oracle/mxfp4.py's backend priority, 0.19.0-0.34). Triton needs
# `triton_kernels`, which no release lists in its Requires-Dist: up to 0.11.2
# `has_triton_kernels()` finds only an installed copy, so Hopper falls back to Marlin
# (vllm#23278, 0.10.1 on an H100: Marlin's WARNING); from 0.12.0 the wheel vendors one
# (vllm/third_party/triton_kernels, the fallback `has_triton_kernels()` also accepts),
# and Triton, ahead of Marlin from 9.0, is Hopper's (vllm#33155, 0.14.1: "Using Triton
# backend"; the 0.19 record: "Using 'TRITON' Mxfp4 MoE backend"). Below 9.0 Triton is
# refused (Marlin); on Blackwell (10.x) FlashInfer's TRT-LLM kernel comes first where
# FlashInfer is installed (kvplan's default; a pinned dependency from 0.11.1).
MXFP4_TRITON_ON_HOPPER_FROM = (0, 12, 0)
# vLLM's _swizzle_mxfp4 keeps Triton's experts unswizzled (strided, no layout padding)
# on Hopper under torch < 2.8.1: 0.10.2 and 0.11.0 pin torch 2.8.0, 0.11.1 pins 2.9.0.
# Only a log that says Triton (an installed triton_kernels) reaches this.
MXFP4_SWIZZLED_ON_HOPPER_FROM = (0, 11, 1)
_MXFP4_ARCH_BACKEND: dict[str, str] = {
    "ampere": "marlin",  # no FP4 compute: Marlin weight-only
    "ada": "marlin",
    "blackwell": "flashinfer-trtllm",
    "cdna": "rocm",
}
# vLLM pads each rank's MXFP4 expert shapes to its MoE kernel's tile (vLLM 0.34
# fused_moe/oracle/mxfp4.py, mxfp4_round_up_hidden_size_and_intermediate_size; Marlin's
# the same in 0.10.2's create_weights): (hidden alignment, per-rank intermediate
# alignment) by backend. "triton" then takes triton_kernels' Hopper layout below.
_MXFP4_ALIGNMENT: dict[str, tuple[int, int]] = {
    "triton": (1, 64),  # Triton (matmul_ogs): intermediate to 64
    "triton-strided": (1, 64),  # the same, unswizzled (also a GPU kvplan does not know)
    "marlin": (256, 128),  # Marlin weight-only: hidden to 256
    "flashinfer-trtllm": (256, 128),
    "flashinfer-cutlass": (128, 128),
    "rocm": (256, 256),  # ROCm: both to 256
}


def mxfp4_moe_backend(gpu_arch: str, release: str, logged: str | None = None) -> str:
    """The MoE backend vLLM `release` runs MXFP4 experts with on a GPU of `gpu_arch`:
    the one its log named (`logged`, read by `calibrate`), else the release's default
    (`MXFP4_TRITON_ON_HOPPER_FROM`; "" or an unparseable release is the newest)."""
    version = release_version(release)
    if gpu_arch != "hopper":
        if logged == "triton":
            # ROCm's padding applies to its Triton kernel too; elsewhere kvplan models
            # triton_kernels' swizzled layout on Hopper only.
            return "rocm" if gpu_arch == "cdna" else "triton-strided"
        return logged or _MXFP4_ARCH_BACKEND.get(gpu_arch, "triton-strided")
    if logged is None:
        vendored = version is None or version >= MXFP4_TRITON_ON_HOPPER_FROM
        return "triton" if vendored else "marlin"
    if logged == "triton" and version is not None and version < MXFP4_SWIZZLED_ON_HOPPER_FROM:
        return "triton-strided"
    return logged


def _round_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _hopper_mx_layout_bytes(k: int, n: int) -> int:
    """One expert matrix (reduction size k, output size n) as the Triton MoE kernel
    stores it on Hopper after vLLM swizzles it (_swizzle_mxfp4): triton_kernels'
    Hopper MX value layout pads the packed e2m1 bytes along k to 64 and n to 256
    (aligning each 4-packed row to a 64-byte load); the e8m0 scales (one per 32 along
    k, padded by vLLM to a multiple of 4 groups) take the Hopper scale layout, n
    padded to 256 (2 x 8 warps x 2 x 8). The copy of triton_kernels vLLM 0.34 vendors
    as a fallback pads less (to 16 / 32 only); an installed triton_kernels wins, and
    the padded figure is what a real H100 load logged (test_weights.py), so kvplan
    plans with it."""
    values = _round_up(k // 2, 64) * _round_up(n, 256)
    scales = _round_up(n, 256) * _round_up(_round_up(-(-k // 32), 4), 2)
    return values + scales


def _mxfp4_experts_per_rank(c: HFConfig, tp: int, backend: str) -> int:
    """Bytes of one rank's MXFP4 experts, all layers: fused gate_up + down in e2m1 with
    an e8m0 scale per 32, padded as the `backend`'s kernel wants (`mxfp4_moe_backend`),
    plus the biases (gpt-oss; float32 under Triton, else bf16)."""
    hidden_align, inter_align = _MXFP4_ALIGNMENT[backend]
    hidden = _round_up(c.integer("hidden_size"), hidden_align)
    inter = _round_up(-(-c.integer("intermediate_size") // tp), inter_align)
    experts = _expert_count(c)
    # The Triton path converts the biases to float32 for triton_kernels (the bf16
    # parameters replaced: 0.12-0.34's mxfp4 process_weights_after_loading); the
    # other kernels keep them in bf16.
    bias_bytes = 4 if backend in ("triton", "triton-strided") else 2
    biases = experts * (2 * inter + hidden) * bias_bytes
    weights: float = experts * 3 * inter * hidden * (0.5 + 1 / 32)
    if backend == "triton":  # gate_up (k = hidden, n = 2 x inter) and down (k = inter)
        gate_up = _hopper_mx_layout_bytes(hidden, 2 * inter)
        weights = experts * (gate_up + _hopper_mx_layout_bytes(inter, hidden))
    return int((weights + biases) * c.integer("num_hidden_layers"))


# PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, the same in the
# releases vLLM 0.19-0.34 ship; vLLM leaves expandable segments off): a request of
# 10 MiB (kMinLargeAlloc) or more gets a new segment rounded up to 2 MiB (kRoundLarge),
# and a block is split only where more than 1 MiB (kSmallSize) would remain
# (`should_split`). A tensor within 1 MiB under a 2 MiB multiple so holds the whole
# block, which torch counts as allocated and vLLM's "Model loading took" reads
# (torch.cuda.max_memory_allocated right after a peak reset).
_ALLOC_MIN_LARGE = 10 * MIB
_ALLOC_ROUND_LARGE = 2 * MIB
_ALLOC_SPLIT_REMAINDER = 1 * MIB


def allocator_rounding_bytes(nbytes: int) -> int:
    """What the caching allocator charges a fresh tensor of `nbytes` beyond its size."""
    if nbytes < _ALLOC_MIN_LARGE:
        return 0  # carved out of a 20 MiB segment and split: not modelled (small)
    remainder = -nbytes % _ALLOC_ROUND_LARGE
    return remainder if remainder <= _ALLOC_SPLIT_REMAINDER else 0


# vLLM's v1/attention/backends/mla/flashinfer_mla.py allocates a 128 MiB FlashInfer
# workspace (`g_fi_workspace`, torch.zeros on "cuda") when the module is imported, and
# the CUDA platform imports it while the first MLA layer picks its backend
# (platforms/cuda.py `get_valid_backends` loads every candidate class; FLASHINFER_MLA
# is one on every CUDA GPU, only then refused below compute capability 10): inside
# load_model, on every rank, whatever the TP size, and kept. Without FlashInfer the
# import fails before it. Read in the wheels: get_valid_backends from 0.12.0 (0.10.2
# and 0.11.0 import only the backend they pick, FlashInfer MLA on Hopper never), the
# import-time buffer up to 0.24.0, allocated lazily from 0.25.0 (`_fi_workspace`, at
# the first FlashInfer MLA decode, as in 0.32-0.34's venvs).
FLASHINFER_MLA_IMPORT_WORKSPACE = 128 * MIB
_FLASHINFER_MLA_IMPORTED_FROM = (0, 12, 0)
_FLASHINFER_MLA_LAZY_FROM = (0, 25, 0)


def mla_import_workspace_bytes(
    config: HFConfig, layers: ModelLayers, gpu_arch: str, release: str, flashinfer: bool = True
) -> int:
    """The FlashInfer MLA workspace vLLM 0.12-0.24 allocate on importing the backend,
    on CUDA GPUs with FlashInfer installed, for a model with MLA layers."""
    c = text_config(config, layers.architecture)
    version = release_version(release)
    if not flashinfer or not c.has("kv_lora_rank") or gpu_arch == "cdna":
        return 0
    if version is None:
        return 0
    if _FLASHINFER_MLA_IMPORTED_FROM <= version < _FLASHINFER_MLA_LAZY_FROM:
        return FLASHINFER_MLA_IMPORT_WORKSPACE
    return 0


def _mla_rounding_bytes(c: HFConfig, tp: int, dtype: int) -> int:
    """The allocator's rounding over one rank's MLA projections (DeepseekV2MLAAttention
    in vLLM 0.19.0 / 0.32): q_proj or the fused q_a / kv_a projection with q_b_proj,
    kv_a_proj_with_mqa (replicated), kv_b_proj and o_proj."""
    hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads") // tp
    kv_lora, rope = c.integer("kv_lora_rank"), c.integer("qk_rope_head_dim")
    nope, v_dim = c.integer("qk_nope_head_dim"), c.integer("v_head_dim")
    q_lora = c.size_or_none("q_lora_rank")
    sizes = [heads * (nope + v_dim) * kv_lora, hidden * heads * v_dim]
    if q_lora:
        sizes += [(q_lora + kv_lora + rope) * hidden, heads * (nope + rope) * q_lora]
    else:
        sizes += [heads * (nope + rope) * hidden, (kv_lora + rope) * hidden]
    return sum(allocator_rounding_bytes(size * dtype) for size in sizes)


def weight_rounding_bytes(
    config: HFConfig, layers: ModelLayers, tp: int, start: int, end: int, stages: int
) -> int:
    """The caching allocator's rounding (`allocator_rounding_bytes`) over one rank's
    weight tensors of decoder layers [start, end) of a `stages`-stage pipeline, as vLLM
    builds them unquantized: the fused QKV and output projections, the fused gate-up
    and down projections (per layer, or per MoE layer the experts' w13 and w2 stacks),
    the vocab-parallel embedding on the first stage and the LM head on the last
    (vocabulary padded to 64). Checked on vLLM 0.19's logs: Qwen2.5-7B 57 / 21.5 / 0.2
    MiB at TP 1 / 2 / 4 against 54-64 / 15-25 / -9-1 MiB over the parameters, Phi-4
    80 (77-87), Qwen2.5-72B 80 at TP 2 and 120 at TP 4 (78-88, 118-128), Llama-3.1-8B,
    Qwen3-8B and Gemma 2 0-2 (within the logs' 0.01 GiB). 0 where the layout is not
    this one (state-space layers, shared experts beside GQA, interleaved or periodic MoE
    layers, gated attention): not modelled there. DeepSeek's MLA layers with their
    `n_shared_experts` are (`_mla_rounding_bytes`, the shared experts as one MLP of
    `n_shared_experts x moe_intermediate_size`): DeepSeek-V2-Lite's 11 MiB shared-expert
    down projection holds 12 MiB in each of its 26 MoE layers, which vLLM 0.5.0's
    "Loading model weights took 29.3010 GB" (vllm#4650) shows beside the parameters,
    norms and RoPE cache, to 0.05 MiB."""
    c = text_config(config, layers.architecture)
    if layers.encoder_decoder or any(layer.is_state for layer in layers.layers):
        return 0
    mla = c.has("kv_lora_rank")
    special = ("interleave_moe_layer_step", "expert_layer_period",
               "moe_shared_expert_intermediate_size")  # fmt: skip
    if any(c.has(key) for key in special) or c.size_or_none("shared_expert_intermediate_size"):
        return 0
    if c.has("n_shared_experts") and not mla:
        return 0
    if _GATED_ATTENTION.get(c.text("model_type", ""), False):
        return 0
    dtype = layers.model_dtype.size_bytes
    hidden = c.integer("hidden_size")
    heads = c.integer("num_attention_heads")
    head_dim = c.integer("head_dim") if c.has("head_dim") else hidden // heads
    kv_heads = c.integer("num_key_value_heads") if c.has("num_key_value_heads") else heads
    q, kv = heads // tp * head_dim, max(1, kv_heads // tp) * head_dim
    if mla:
        attention = _mla_rounding_bytes(c, tp, dtype)
    else:
        attention = allocator_rounding_bytes((q + 2 * kv) * hidden * dtype)
        attention += allocator_rounding_bytes(q * hidden * dtype)
    gate_up_matrices = _matrices(c) - 1

    def mlp(size: int, count: int) -> int:
        gate_up = count * gate_up_matrices * (size // tp) * hidden * dtype
        down = count * hidden * (size // tp) * dtype
        return allocator_rounding_bytes(gate_up) + allocator_rounding_bytes(down)

    experts = _expert_count(c)
    dense_first = c.integer("first_k_dense_replace", 0, minimum=0)
    expert_size = c.size_or_none("moe_intermediate_size") or c.integer("intermediate_size")
    dense_mlp = mlp(c.integer("intermediate_size"), 1)
    # Non-MLA layouts with shared experts returned above.
    shared_mlp = mlp(c.integer("n_shared_experts", 0, minimum=0) * expert_size, 1)
    total = 0
    for layer in range(start, end):
        moe = experts and layer >= dense_first
        total += attention + (mlp(expert_size, experts) + shared_mlp if moe else dense_mlp)
    rows = padded_vocab(c.integer("vocab_size")) // tp
    table = allocator_rounding_bytes(rows * hidden * dtype)
    tied = c.flag("tie_word_embeddings", False)
    first, last = start == 0, end == c.integer("num_hidden_layers")
    total += table * first + table * (last and (not tied or stages > 1))
    return total


def estimate_weights(
    config: HFConfig,
    layers: ModelLayers,
    tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
    gpu_arch: str = "",
    quantization: str | None = None,
    pp_layer_partition: tuple[int, ...] | None = None,
    release: str = "",
    max_num_batched_tokens: int = 0,
    flashinfer: bool = True,
    mxfp4_backend: str | None = None,
) -> WeightEstimate:
    """Bytes per worker: embeddings, LM head, attention, MLP and mixers shard over TP
    (vocab-parallel embeddings, column/row-parallel projections), routers are
    replicated on every rank. Each pipeline stage holds its decoder layers (vLLM's
    partition, or `pp_layer_partition` as VLLM_PP_LAYER_PARTITION gives it) and the
    embeddings where the family builds them (`stage_params`). MXFP4 experts are
    padded per rank for the MoE kernel `release` runs on the GPU (`gpu_arch`), or the
    `mxfp4_backend` a log named (`mxfp4_moe_backend`); block-fp8 weights take
    Marlin's layout where `release` runs them through it (`_fp8_runs_marlin`). With
    `max_num_batched_tokens`, the buffers the model allocates when it is built, which
    vLLM's "Model loading took" counts: Qwen3-VL's deepstack input buffers
    (`deepstack_buffer_bytes`; `config` as loaded, without a tower vLLM skips), and
    on an MLA model the FlashInfer workspace vLLM 0.19 allocates on importing its MLA
    backend (`mla_import_workspace_bytes`; `flashinfer`: whether it is installed)."""
    params = count_params(config, layers)
    dtype_bytes = layers.model_dtype.size_bytes
    name, quant_bytes, experts_only = _quantization(config, quantization)
    if name == "fp8":
        text = text_config(config, layers.architecture)
        marlin = _fp8_marlin_bytes(config, text, gpu_arch, dtype_bytes, release)
        quant_bytes = marlin or quant_bytes
    tp = tensor_parallel_size
    router_bytes = params.router * dtype_bytes
    kept = (
        _unquantized_parts(config, layers) if name != "none" and not experts_only else frozenset()
    )
    c = text_config(config, layers.architecture)
    gdn_kept, fc_kept = _kept_modules_within(config, layers, kept) if kept else (0, 0)
    gdn_params = _state_params(c, "GDN_ATTENTION") if gdn_kept else 0

    def kept_within(part: ParamCount) -> int:
        # The GDN layers a part holds, from its mixer parameters, and the MTP `fc` with
        # the MTP modules.
        layers_held = part.state_space // gdn_params if gdn_params else 0
        return layers_held * gdn_kept + (fc_kept if part.draft else 0)

    if name == "none":
        total = params.total * dtype_bytes
    elif experts_only:
        dense = (params.total - params.mlp - params.router) * dtype_bytes
        total = int(dense + params.mlp * quant_bytes) + router_bytes
    else:
        # Embeddings, the lm head and the routers stay in the model dtype, and what the
        # checkpoint's exclusion list names.
        unquantized = sum(getattr(params, part) for part in kept) - params.router
        unquantized += kept_within(params)
        quantized = params.total - unquantized - params.router
        total = int(unquantized * dtype_bytes + quantized * quant_bytes) + router_bytes
    num_layers = c.integer("num_hidden_layers") if not layers.encoder_decoder else 1
    if layers.encoder_decoder and pipeline_parallel_size > 1:
        raise ModelConfigError("pipeline parallelism is not estimated for encoder-decoder models")
    bounds = [
        pipeline_stage_bounds(num_layers, stage, pipeline_parallel_size, pp_layer_partition)
        for stage in range(pipeline_parallel_size)
    ]
    backend = mxfp4_moe_backend(gpu_arch, release, mxfp4_backend)
    experts_all_layers = _mxfp4_experts_per_rank(c, tp, backend) if experts_only else 0
    rope = rope_cache_bytes(config, layers)
    # Built in Qwen3VLForConditionalGeneration.__init__ (0.19.0 and 0.32-0.34), inside
    # the runner's load_model: in the weights figure, and in the profile's baseline,
    # not its peak. Every stage builds the wrapper.
    buffers = deepstack_buffer_bytes(config, max_num_batched_tokens, dtype_bytes,
                                     MultimodalOptions())  # fmt: skip
    buffers += mla_import_workspace_bytes(config, layers, gpu_arch, release, flashinfer)
    per_stage = []
    for (start, end), stage in zip(bounds, stage_params(config, layers, bounds), strict=True):
        stage_router = stage.router * dtype_bytes
        if name == "none":
            # What vLLM builds unsharded besides the routers (`replicated_params`).
            kept_whole = replicated_params(config, layers, end - start) if tp > 1 else 0
            sharded = (stage.total - stage.router - kept_whole) * dtype_bytes
            rank = -(-sharded // tp) + stage_router + kept_whole * dtype_bytes
        elif experts_only:
            dense = (stage.total - stage.mlp - stage.router) * dtype_bytes
            experts = experts_all_layers * (end - start) // num_layers
            rank = -(-dense // tp) + experts + stage_router
        else:
            unquantized = sum(getattr(stage, part) for part in kept) - stage.router
            unquantized += kept_within(stage)
            quantized = stage.total - unquantized - stage.router
            sharded = int(unquantized * dtype_bytes + quantized * quant_bytes)
            rank = -(-sharded // tp) + stage_router
        if name == "none":
            rank += weight_rounding_bytes(config, layers, tp, start, end, len(bounds))
        per_stage.append(rank + rope + buffers)
    return WeightEstimate(params, name, total, max(per_stage), tuple(per_stage), rope, buffers)


def _per_token_activation(c: HFConfig, tp: int) -> int:
    """Elements one token holds at the peak of a decoder layer's forward, per rank.

    Three hidden-size streams stay live through a layer (its input / residual, the
    normed input, the output being built); beside them the attention phase holds the
    QKV projection and the attention output, the MLP phase the up (and gate)
    projection and the activation's output, or for fused MoE the top-k copies of
    those and of the expert outputs (vLLM's fused_moe intermediate caches). The
    peak is the larger phase."""
    hidden = c.integer("hidden_size") if c.has("hidden_size") else c.integer("d_model")
    heads = c.opt_integer("num_attention_heads") or c.opt_integer("decoder_attention_heads") or 1
    head_dim = c.integer("head_dim") if c.has("head_dim") else hidden // heads
    kv_heads = c.opt_integer("num_key_value_heads") or heads
    attention = ((heads + 2 * kv_heads) * head_dim + heads * head_dim) // tp
    matrices = _matrices(c)
    ffn_keys = ("intermediate_size", "decoder_ffn_dim")
    ffn = next((c.integer(key) for key in ffn_keys if c.has(key)), 4 * hidden)
    if c.has("intermediate_size_mlp"):  # Llama 4: the dense layers' size
        ffn = max(ffn, c.integer("intermediate_size_mlp"))
    mlp = matrices * ffn // tp
    if _expert_count(c):
        expert = c.integer("moe_intermediate_size") if c.has("moe_intermediate_size") else ffn
        top_k = c.opt_integer("num_experts_per_tok") or c.opt_integer("moe_topk") or 1
        mlp = max(mlp, top_k * (matrices * expert // tp + hidden))
    return 3 * hidden + max(attention, mlp)


def runner_model(
    config: HFConfig, layers: ModelLayers, quantization: str | None = None
) -> RunnerModel:
    c = text_config(config, layers.architecture)
    state = any(layer.is_state for layer in layers.layers)
    return RunnerModel(
        layers.architecture,
        bool(_expert_count(c)),
        _quantization(config, quantization)[0] != "none",
        state,
        any(not layer.is_state for layer in layers.layers),
    )


def estimate_overhead(
    config: HFConfig,
    layers: ModelLayers,
    tensor_parallel_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int = 256,
    release: str = "",
    flashinfer: bool = True,
    max_model_len: int | None = None,
    pcie_only_gpu: bool = False,
    multimodal: MultimodalOptions | None = None,
    disable_custom_all_reduce: bool = False,
    gpu_arch: str = "",
    pipeline_stage: int = 0,
    pipeline_parallel_size: int = 1,
    gpu_sms: int = 0,
    use_v2_model_runner: bool | None = None,
    extensible_kv_cache: bool | None = None,
    quantization: str | None = None,
) -> OverheadEstimate:
    """The profile run's peak over the weights: a forward pass of
    `max_num_batched_tokens` tokens (what the engine profiles; the V0 engine without
    chunked prefill profiled `max_model_len`), then the sampler's float32 logits for
    `max_num_seqs` requests while the forward's last hidden states are still held.
    The two do not overlap, so the peak is the larger. `release` picks the runtime
    allowances (`PROFILES`); `flashinfer` whether FlashInfer is installed (the
    sampler's path). `max_model_len` (default: the model's) bounds the context of the
    graph estimate's long sample where a release has one (`gdn_graph_transient`);
    `pcie_only_gpu` whether the GPU has no NVLink and `disable_custom_all_reduce`
    vLLM's flag (`custom_all_reduce_on`, `non_torch_bytes`); `gpu_arch` the catalog's
    architecture ("": not known), which sizes cuBLAS's workspace, and `gpu_sms` its
    streaming multiprocessors (0: not known), which size 0.17-0.19's sampler row
    buffer (`triton_row_buffer_bytes`); `use_v2_model_runner` the runner (None: the
    release's default for the model, `default_runner_is_v2`, which reads vLLM's
    --quantization, `quantization`) and `extensible_kv_cache` vLLM 0.34's cache (None:
    on), which decide whether a graph estimate runs at all (`graph_estimate_runs`);
    `pipeline_stage` of
    `pipeline_parallel_size` the stage whose worker this is (`stage_activation_terms`);
    `multimodal`,
    vLLM's flags, sets a multimodal model's encoder item count (kvplan.models.encoder):
    its encoder runs first, so the peak is then the larger of its inputs plus its
    forward, and its inputs and embeddings plus the decoder's phases, which run while
    the encoder cache holds them."""
    c = text_config(config, layers.architecture)
    hidden = c.integer("hidden_size") if c.has("hidden_size") else c.integer("d_model")
    act_bytes = layers.model_dtype.size_bytes
    forward = max_num_batched_tokens * _per_token_activation(c, tensor_parallel_size) * act_bytes
    rules = profile_rules(release)
    if use_v2_model_runner is None:
        use_v2_model_runner = default_runner_is_v2(release, runner_model(config, layers,
                                                                         quantization))  # fmt: skip
    # Model Runner V2's sampler where the release has a figure for it (0.22 on; an engine
    # forced onto V2 before that is planned with the V1 runner's).
    mrv2 = bool(rules.mrv2_sampler_bytes_per_logit) and use_v2_model_runner
    # The sampler phase holds the forward's hidden states, the requests' last hidden
    # states (`_dummy_run` returns them indexed out) and, on the V1 runner, the random
    # stand-in `_dummy_sampler_run` computes the logits from (Model Runner V2 computes
    # them from the requests' own).
    sampler = (max_num_batched_tokens + (1 if mrv2 else 2) * max_num_seqs) * hidden * act_bytes
    # MXFP4 experts run a monolithic kernel on Hopper and Blackwell (0.19's
    # oracle/mxfp4.py prefers OAITritonMxfp4ExpertsMonolithic, and FlashInfer's
    # TRT-LLM one), which takes no workspace from the manager.
    monolithic_moe = _quantization(config)[0] == "mxfp4"
    if _expert_count(c) and rules.moe_workspace_held and not monolithic_moe:
        # The fused-MoE kernels' scratch lives in vLLM's workspace manager, which keeps
        # it after the forward pass: it is still held while the sampler runs (where the
        # release has one: `moe_workspace_held`).
        per_token = moe_workspace_per_token(c, tensor_parallel_size)
        sampler += max_num_batched_tokens * per_token * act_bytes
    vocab = c.integer("vocab_size")
    logits = max_num_seqs * vocab
    if mrv2:
        sampler += mrv2_sampler_bytes(rules, max_num_seqs, vocab, act_bytes)
    else:
        # The rules count 16-bit model logits beside their float32 copy; float32 logits
        # are that copy.
        per_logit = sampler_bytes_per_logit(rules, flashinfer) - float32_logits_saving(act_bytes)
        sampler += logits * per_logit
        sampler += triton_row_buffer_bytes(rules, max_num_seqs, vocab, gpu_sms)
    custom_all_reduce = custom_all_reduce_on(
        tensor_parallel_size, pcie_only_gpu, disable_custom_all_reduce
    )
    non_torch = non_torch_bytes(rules, custom_all_reduce)
    decoder_layers = layers.num_hidden_layers or c.integer("num_hidden_layers")
    nccl = nccl_all_reduces_per_graph(decoder_layers, tensor_parallel_size, custom_all_reduce)
    sizes = (release, gpu_arch)  # the release's capture list on this part
    graphs = cudagraph_estimate(rules, max_num_seqs, max_num_batched_tokens, nccl, *sizes)
    logged = cudagraph_estimate(PROFILES["v1"], max_num_seqs, max_num_batched_tokens, nccl,
                                *sizes)  # fmt: skip
    # The PIECEWISE samples run first and their warmups leave activations cached in
    # torch's allocator; the FULL sample's transient reuses those before it draws new
    # memory, so it shows in the estimate only past the graphs' own figure: the larger
    # of the two (vllm#52872's 0.52 / 0.52 / 0.89 GiB at 2,048 / 4,096 / 8,192 batched
    # tokens has that shape).
    transient = gdn_graph_transient(
        rules, layers, max_num_seqs, max_num_batched_tokens,
        max_model_len if max_model_len and max_model_len > 0 else layers.derived_max_model_len,
        *sizes,
    )  # fmt: skip
    nccl_bytes = graphs - cudagraph_estimate(rules, max_num_seqs, max_num_batched_tokens, 0,
                                             *sizes)  # fmt: skip
    graphs, logged = max(graphs, transient), max(logged, transient)
    captured = graphs
    if not graph_estimate_runs(release, use_v2_model_runner, extensible_kv_cache):
        # Model Runner V2 before 0.29, and 0.34's extensible cache: nothing is measured
        # before the cache is sized, so nothing is subtracted or logged.
        graphs = logged = nccl_bytes = 0
    encoder = encoder_profile(
        config,
        tensor_parallel_size,
        act_bytes,
        max_model_len if max_model_len and max_model_len > 0 else layers.derived_max_model_len,
        max_num_batched_tokens,
        max_num_seqs,
        multimodal or MultimodalOptions(),
    )
    last_stage = pipeline_stage == pipeline_parallel_size - 1
    peak = max(forward, sampler) if last_stage else forward
    if encoder is not None:  # every stage profiles the encoder (no stage check)
        peak = max(encoder.encoder_phase_bytes, encoder.held_bytes + peak)
    if pipeline_stage > 0:
        peak += _PP_RECEIVED_TENSORS * max_num_batched_tokens * hidden * act_bytes
    peak += cublas_workspace_bytes(gpu_arch)
    # Qwen3-VL's deepstack buffers are built with the model: in the weights figure
    # (`estimate_weights`), not the profile's peak.
    return OverheadEstimate(peak, non_torch, graphs, logged, release=rules.name, encoder=encoder,
                            cudagraph_nccl_bytes=nccl_bytes,
                            cudagraph_captured_bytes=captured)  # fmt: skip
