"""The vision encoder's part of vLLM's profile run (multimodal models).

Before it sizes the KV cache, vLLM's GPU model runner (`profile_run`, 0.19-0.34) runs
a multimodal model's encoder on a dummy batch of the modality with the most tokens per
item, each item of the largest size, and keeps the embeddings in the encoder cache
while the decoder's dummy forward and the sampler run; the dummy inputs stay on the
device until the run ends. So the run's torch peak is the larger of

* the dummy inputs plus the encoder forward's own peak, and
* the dummy inputs plus the embeddings plus the decoder forward's or sampler's peak.

The number of items is vLLM's `MultiModalBudget`: the encoder budget is
`max(max_num_batched_tokens, tokens per item)` (the compute budget and the cache size
start at `max_num_batched_tokens`, `compute_mm_encoder_budget`), and the profile runs
`max(1, min(budget // tokens per item, max_num_seqs x items per prompt))` items, with
items per prompt `max(1, min(limit, max_model_len // tokens per item))`; the limit is
`--limit-mm-per-prompt`'s (999 when not given). `--skip-mm-profiling` skips this part;
a limit of 0 for every modality of the tower (`--language-model-only` sets them all)
skips it and leaves the tower unbuilt (`_mark_tower_model`), so its weights are not
loaded either.

The encoder peaks are per patch, counted the way vLLM's own towers allocate on a
forward (tests/models/test_encoder_against_vllm.py runs them on the CPU):

* Gemma 3 (SigLIP + Gemma3MultiModalProjector): the peak is in an encoder layer's MLP:
  four hidden-size streams (the embeddings the encoder keeps, the layer's input, the
  post-attention residual, the normed copy) and fc1's output and its GELU
  (intermediate / TP each).
* Qwen3.5 / 3.6 (Qwen3_VisionTransformer): the peak is at the attention's output
  projection: the position embeddings, the layer's input, its normed copy and the
  projection's output (hidden each), beside QKV (3 x hidden / TP), the contiguous Q/K
  (2 / TP), the rotated Q/K (2 / TP) and the attention output (1 / TP); plus the rotary
  cos/sin per patch (head_dim). The position ids are built on the host (vLLM keeps one
  item's in a host-side cache) and their device copy is freed before the layers run.
* Qwen3-VL (the same Qwen3_VisionTransformer, with deepstack mergers): as Qwen3.5, plus
  the deepstack features already taken (`out_hidden_size` per merged token each), which
  the tower keeps until it concatenates them with the merger's output; the last block
  runs with all of them held. Its embeddings are (1 + levels) x `out_hidden_size` wide.
* Qwen2.5-VL (Qwen2_5_VisionTransformer, windowed attention): the peak is in a block's
  gated MLP, at its down projection: four hidden-size streams (the layer's input, the
  attention output, the post-attention residual, its normed copy) beside gate_up
  (2 x intermediate / TP), SiluAndMul's output (intermediate / TP) and the projection's
  output (hidden). On a CUDA engine SiluAndMul is one kernel with one output: with
  vLLM's custom ops off (its default under torch.compile) the op's native forward is
  itself compiled (`CustomOp.maybe_compile`, `SiluAndMul(compile_native=True)`,
  vllm#32806, 0.32-0.34's activation.py), and with them on it is the CUDA kernel; the
  eager PyTorch form, silu(gate) and the product alive together, is the CPU's. Plus the
  rotary cos/sin, which the tower keeps per grid in a cache (one item's, head_dim per
  patch) and concatenates per batch (head_dim per patch), and the window order and its
  inverse on the device (two int64 per merged token).
  Its profiled item is a video, not an image, whenever video is allowed: vLLM picks the
  modality with the most tokens per item, ties to the later name
  (`MultiModalBudget.get_modality_with_max_tokens`), and Qwen2-VL's processing info
  sizes the dummy video as frames of the largest image, as many as max_model_len holds,
  at most 14 (`get_num_frames_with_most_features`, `_MAX_FRAMES_PER_VIDEO`), two frames
  a temporal patch: 7 x 16,384 = 114,688 tokens from a 114,688-token max_model_len on,
  never fewer than the image's 16,384.
* Llama 4 (Llama4VisionModel + Llama4MultiModalProjector): per tile of image_size
  pixels, (image_size / patch)^2 patches and a CLS token; the peak is at the attention's
  rotary, which vLLM runs in PyTorch on every platform (complex64): the tower's
  pre-norm output (held by the tower until its encoder returns), the layer's input and
  its normed copy (hidden each), beside QKV (3 / TP), the float32 copies of Q and K
  (2 x 2 / TP), their rotated complex products (2 x 2 / TP) and the bf16 results
  (2 / TP): 3 x hidden + 13 x hidden / TP per token. The largest image is a 16:1 strip of
  `LLAMA4_MAX_TILES` tiles plus the global tile; each tile gives (image_size / patch)^2
  x pixel_shuffle_ratio^2 embeddings.
* LLaVA-Next over SigLIP (Granite Vision) or CLIP (llava-hf's v1.6 checkpoints), and
  LLaVA 1.5 over CLIP: the profiled image is the grid pinpoint with the most embeddings
  (the base tile's, the unpadded grid's and a newline per row; LLaVA 1.5: one tile); the
  tower runs on its base tile and every grid tile, a CLIP tile a class token longer than
  its patches. With one feature layer the peak is at a layer's MLP as Gemma 3's: four
  streams beside fc1's output and its activation's (CLIP's QuickGELU in its PyTorch
  form: three MLP-wide tensors). With a list of feature layers the encoder keeps every
  layer's output, so at the last built layer's MLP it holds those (built in all, the
  last the layer's input), the post-attention residual and its normed copy beside the
  MLP's; after the last layer the pool and the selected layers' concatenation (the
  larger moment is taken).
* Kimi-VL (MoonViT + KimiVLMultiModalProjector): vLLM's 1,024-pixel dummy image scaled
  to the processor's patch limit and padded to the merge kernel; every image's patches
  in one packed sequence. The peak is at a block's 2D rotary, run in PyTorch: the patch
  embeddings, the block's input and its normed copy beside QKV, Q's and K's float32
  copies, their complex64 products and the results (3 x hidden + 13 x hidden / TP), plus
  the batch's complex64 rotary factors; the 512 x 512 rotary table the first forward
  builds is kept through the rest of the run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvplan.models.config import HFConfig, ModelConfigError

# vLLM's limit per prompt for a modality --limit-mm-per-prompt does not name
# (MultiModalConfig.get_limit_per_prompt, 0.32-0.34).
DEFAULT_LIMIT_PER_PROMPT = 999

# Qwen3.5 / 3.6's image processor (Qwen2VLImageProcessorFast, the checkpoints'
# preprocessor_config.json: size.longest_edge 16,777,216 pixels, which config.json does
# not carry): the largest image is 4,096 x 4,096 pixels, 256 x 256 patches of 16, 16,384
# tokens after the 2 x 2 merge. Public startup logs of Qwen3.5 checkpoints print "Encoder
# cache will be initialized with a budget of 16384 tokens, and profiled with 1 image
# items" at 8,192 batched tokens: the image, not the video, is the profiled modality.
QWEN3_VL_MAX_IMAGE_PIXELS = 16_777_216
# Qwen2.5-VL's image processor (Qwen2VLImageProcessor, the checkpoints'
# preprocessor_config.json: max_pixels 12,845,056 with 14-pixel patches): 16,384 merged
# tokens, a 3,584 x 3,584 image of 256 x 256 patches.
QWEN2_5_VL_MAX_IMAGE_PIXELS = 12_845_056
# The most frames of the dummy video vLLM's Qwen2-VL / Qwen2.5-VL processing info profiles
# (qwen2_vl.py `_MAX_FRAMES_PER_VIDEO`, 0.32-0.34; the 0.23.0 log of Qwen2.5-VL-7B prints
# its 7 x 16,384 = 114,688 tokens).
QWEN2_VL_MAX_FRAMES_PER_VIDEO = 14
# Llama 4's image processor (Llama4ImageProcessorFast, the checkpoints'
# preprocessor_config.json: max_patches 16, which config.json does not carry): vLLM's
# dummy image is 16 tiles high and one wide, which the processor splits into 16 tiles
# and a global one (Mllama4ProcessingInfo.get_image_size_with_most_features).
LLAMA4_MAX_TILES = 16
# Kimi-VL: vLLM's dummy image is 1,024 x 1,024 pixels (kimi_vl.py `MaxImageTokenMeta`),
# which the image processor scales down to at most `in_token_limit` 14-pixel patches
# (KimiVLImageProcessor, the checkpoint's preprocessor_config.json: 4,096; config.json
# does not carry it) before padding to the 2 x 2 merge: 66 x 66 patches, 1,089 tokens.
# The 0.19 log's "budget of 8192 tokens, and profiled with 7 image items" pins the
# limit to 4,081-4,606 (1,025-1,170 tokens an image).
KIMI_VL_DUMMY_IMAGE = 1024
KIMI_VL_IN_TOKEN_LIMIT = 4096
# MoonViT's 2D rotary table (moonvit.py Rope2DPosEmb(head_dim, 512, 512)): complex64,
# head_dim / 2 per position of a 512 x 512 grid, built on the device by the first
# encoder forward (a cached property) and kept.
MOONVIT_ROPE_GRID = 512


@dataclass(frozen=True)
class MultimodalOptions:
    """vLLM's multimodal flags that change the start-up profile."""

    skip_mm_profiling: bool = False  # --skip-mm-profiling
    # --limit-mm-per-prompt as vLLM takes it ({"image": 2, "video": 0}); absent: 999
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=dict)
    language_model_only: bool = False  # --language-model-only: every limit 0

    def limit(self, modality: str) -> int:
        if self.language_model_only:
            return 0
        return self.limit_mm_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT)


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt '{"image": 2, "video": 0}'` (vLLM's JSON form; a value
    may also be an object with a `count`, as vLLM 0.32-0.34 accept)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ModelConfigError(
            f"--limit-mm-per-prompt {text!r}: not JSON ({error.msg}); give e.g. "
            '\'{"image": 2, "video": 0}\''
        ) from None
    if not isinstance(data, dict):
        raise ModelConfigError(
            f"--limit-mm-per-prompt {text!r}: expected a JSON object of modality: count"
        )
    limits = {}
    for modality, value in data.items():
        count = value.get("count") if isinstance(value, dict) else value
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ModelConfigError(
                f"--limit-mm-per-prompt: {modality!r} must be a count >= 0, got {value!r}"
            )
        limits[str(modality)] = count
    return limits


@dataclass(frozen=True)
class Tower:
    """One vision tower as the profile run sees it: per item, per patch, per rank."""

    modalities: tuple[str, ...]  # the limits that decide whether it is built
    tokens_per_item: int  # embeddings per item of the largest size
    patches_per_item: int
    # the dummy pixels on the device, in the model dtype (vLLM's processor casts them)
    input_elements_per_item: int
    peak_elements_per_patch: int  # at the forward's peak, in the model dtype
    output_hidden: int  # width of the embeddings handed to the decoder
    # Besides, at the peak, bytes outside the model dtype: int64 index tensors
    # (Qwen2.5-VL's window order), complex64 rotary factors (MoonViT's)
    peak_index_bytes_per_patch: float = 0.0
    # Held once per distinct grid, in the model dtype (Qwen2.5-VL's cos/sin cache); the
    # profile's items are all of one size, so once per item's patches.
    cached_elements_per_patch: int = 0
    # Allocated by the first encoder forward and kept (MoonViT's rotary table), bytes
    persistent_bytes: int = 0
    # Frames per temporal patch where vLLM profiles a video of the largest image's frames
    # (Qwen2.5-VL: 2); 0 where the image is the profiled item whatever the limits.
    video_temporal_patch: int = 0
    # Moments after the tower that may hold more than its own peak, in the model dtype:
    # (elements per item, elements once) each (LLaVA's projector and LLaVA-Next's anyres
    # merge, `_llava_after_tower`). The forward's peak is the largest moment.
    after_tower: tuple[tuple[int, int], ...] = ()


def _text_hidden(config: HFConfig, fallback: int) -> int:
    """The text model's hidden size the projector maps into (`fallback` without a
    `text_config`)."""
    text = config.sub("text_config")
    return text.integer("hidden_size") if text is not None else fallback


def moonvit_merge_kernel(vision: HFConfig) -> tuple[int, int]:
    """MoonViT's patch merge kernel (rows, columns); 2 x 2 by default."""
    rows, cols = (int(k) for k in vision.items("merge_kernel_size") or [2, 2])
    return rows, cols


def _siglip_tower(config: HFConfig, vision: HFConfig, tp: int) -> Tower:
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    size = vision.integer("image_size")
    channels = vision.integer("num_channels", 3)
    text_hidden = _text_hidden(config, width)
    return Tower(
        modalities=("image",),
        # Pan-and-scan is off by default: one crop, mm_tokens_per_image embeddings.
        tokens_per_item=config.integer("mm_tokens_per_image", 256),
        patches_per_item=(size // patch) ** 2,
        input_elements_per_item=channels * size * size,
        peak_elements_per_patch=4 * width + 2 * -(-inter // tp),
        output_hidden=text_hidden,
    )


def qwen_vl_image_patches(max_pixels: int, patch: int, merge: int) -> int:
    """Patches of the largest image vLLM's Qwen2-VL processing info profiles
    (get_image_size_with_most_features): max_pixels // (patch x merge)^2 merged tokens,
    factored into the closest height x width pair with an aspect ratio <= 200 (fewer
    tokens where no such pair exists)."""
    unit_tokens = max_pixels // (patch * merge) ** 2
    for tokens in range(unit_tokens, 0, -1):
        height = next(d for d in range(math.isqrt(tokens), 0, -1) if tokens % d == 0)
        if tokens // height / height <= 200:
            return tokens * merge * merge
    return merge * merge


def _deepstack_held(vision: HFConfig) -> int:
    """Deepstack features held while the last block runs: those of earlier blocks."""
    depth = vision.integer("depth")
    levels = [int(index) for index in vision.items("deepstack_visual_indexes") or []]
    return sum(1 for index in levels if index < depth - 1)


def _qwen3_vit_tower(vision: HFConfig, tp: int) -> Tower:
    width = vision.integer("hidden_size")
    heads = vision.integer("num_heads")
    patch = vision.integer("patch_size")
    merge = vision.integer("spatial_merge_size")
    temporal = vision.integer("temporal_patch_size")
    channels = vision.integer("in_channels", 3)
    out = vision.integer("out_hidden_size")
    levels = len(vision.items("deepstack_visual_indexes") or [])
    patches = qwen_vl_image_patches(QWEN3_VL_MAX_IMAGE_PIXELS, patch, merge)
    per_rank = -(-width // tp)
    # The held deepstack features are per merged token: out / merge^2 per patch.
    held = _deepstack_held(vision) * out
    return Tower(
        modalities=("image", "video"),
        tokens_per_item=patches // (merge * merge),
        patches_per_item=patches,
        input_elements_per_item=patches * channels * temporal * patch * patch,
        peak_elements_per_patch=4 * width + 8 * per_rank + width // heads + held // (merge * merge),
        output_hidden=(1 + levels) * out,
    )


def _qwen2_5_vit_tower(vision: HFConfig, tp: int) -> Tower:
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    heads = vision.integer("num_heads")
    patch = vision.integer("patch_size")
    merge = vision.integer("spatial_merge_size")
    temporal = vision.integer("temporal_patch_size")
    channels = vision.integer("in_channels", 3)
    patches = qwen_vl_image_patches(QWEN2_5_VL_MAX_IMAGE_PIXELS, patch, merge)
    head_dim = width // heads
    # The attention phase (the layer's input and the projection's output, beside QKV,
    # the contiguous and the rotated Q/K and the attention output per rank) holds less
    # than the MLP at every TP for the published widths; the larger is taken. The MLP's
    # peak is at the down projection on a CUDA engine (SiluAndMul one output, above):
    # the four streams and the projection's output beside gate_up and the activation.
    per_rank_inter = -(-inter // tp)
    mlp = 5 * width + 3 * per_rank_inter
    attention = 2 * width + 8 * -(-width // tp)
    return Tower(
        modalities=("image", "video"),
        tokens_per_item=patches // (merge * merge),
        patches_per_item=patches,
        input_elements_per_item=patches * channels * temporal * patch * patch,
        # cos and sin (head_dim / 2 each per patch: half the head rotates, two axes)
        # in the batch's concatenation, and one item's in the per-grid cache
        peak_elements_per_patch=max(mlp, attention) + head_dim,
        output_hidden=vision.integer("out_hidden_size"),
        peak_index_bytes_per_patch=2 * 8 / (merge * merge),
        cached_elements_per_patch=head_dim,
        video_temporal_patch=temporal,
    )


def _llama4_tower(config: HFConfig, vision: HFConfig, tp: int) -> Tower:
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    size = vision.integer("image_size")
    channels = vision.integer("num_channels", 3)
    ratio = vision.raw("pixel_shuffle_ratio", 0.5)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ModelConfigError(
            f"expected a ratio in (0, 1], got {ratio!r}", vision._where("pixel_shuffle_ratio")
        )
    text_hidden = _text_hidden(config, width)
    tiles = LLAMA4_MAX_TILES + 1  # the global tile
    per_tile = (size // patch) ** 2
    per_rank = -(-width // tp)
    attention = 3 * width + 13 * per_rank
    mlp = 3 * width + 2 * -(-inter // tp)  # fc1's output and its GELU
    return Tower(
        modalities=("image",),
        tokens_per_item=tiles * (per_tile // round(1 / (ratio * ratio))),
        patches_per_item=tiles * (per_tile + 1),  # + each tile's CLS token
        input_elements_per_item=tiles * channels * size * size,
        peak_elements_per_patch=max(attention, mlp),
        output_hidden=text_hidden,
    )


def best_grid_resolution(
    height: int, width: int, pinpoints: list[tuple[int, int]]
) -> tuple[int, int]:
    """The (height, width) pinpoint an image of height x width is resized to: the most
    of the image kept at the pinpoint's scale, then the least padding (transformers'
    `select_best_resolution`, which vLLM's LLaVA-Next processing info calls)."""
    best, kept_best, wasted_best = pinpoints[0], -1, math.inf
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - kept
        if kept > kept_best or (kept == kept_best and wasted < wasted_best):
            best, kept_best, wasted_best = (pin_height, pin_width), kept, wasted
    return best


def llava_next_image_tokens(height: int, width: int, pinpoints: list[tuple[int, int]],
                            tile: int, grid: int, base_tokens: int) -> int:  # fmt: skip
    """Embeddings of one image under LLaVA-Next's anyres layout (vLLM's
    LlavaNextProcessingInfo.get_num_image_tokens): the base tile's, then the grid's
    patches with the padding rows or columns removed, plus one newline per row."""
    pin_height, pin_width = best_grid_resolution(height, width, pinpoints)
    rows, cols = grid * (pin_height // tile), grid * (pin_width // tile)
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        rows -= 2 * ((rows - kept) // 2)
    else:
        kept = int(round(width * (rows / height), 7))
        cols -= 2 * ((cols - kept) // 2)
    return rows * cols + rows + base_tokens


@dataclass(frozen=True)
class LlavaTowerFamily:
    """What differs between the towers vLLM's `init_vision_tower_for_llava` builds
    (siglip.py, clip.py); the encoder layers are alike (Q/K/V/O and fc1 / fc2 with
    biases, two LayerNorms), and neither builds a post-layernorm
    (`require_post_norm=False`) or SigLIP's pooling head."""

    class_token: bool  # CLIPVisionEmbeddings prepends one to every tile's patches
    conv_bias: bool  # the patch convolution's bias (SigLIP's; CLIP's has none)
    pre_norm: bool  # CLIP's `pre_layrnorm` over the embeddings
    default_act: str  # the vision config class's hidden_act


# By vision_config model_type; Pixtral towers are not modelled.
LLAVA_TOWERS: dict[str, LlavaTowerFamily] = {
    "siglip_vision_model": LlavaTowerFamily(False, True, False, "gelu_pytorch_tanh"),
    "clip_vision_model": LlavaTowerFamily(True, False, True, "quick_gelu"),
}
# The wrappers (config model_type): LLaVA-Next tiles an image (anyres) and adds a newline
# vector; LLaVA 1.5 encodes one image_size tile and concatenates no feature layers.
LLAVA_WRAPPERS = ("llava_next", "llava")


def llava_tower_kind(vision: HFConfig) -> str:
    """The tower's model_type; LlavaConfig / LlavaNextConfig build a CLIP tower from a
    vision_config that names none."""
    return vision.text("model_type", "clip_vision_model")


def is_llava_tower(config: HFConfig) -> bool:
    """A LLaVA / LLaVA-Next wrapper over a tower kvplan models (SigLIP or CLIP)."""
    vision = config.sub("vision_config")
    return (
        config.text("model_type", "") in LLAVA_WRAPPERS
        and vision is not None
        and llava_tower_kind(vision) in LLAVA_TOWERS
    )


def _selects_layers(config: HFConfig) -> bool:
    """Whether the wrapper runs its tower with `select_layers`: LLaVA-Next with a list of
    feature layers (Granite Vision). LLaVA 1.5 never passes it, so its tower returns the
    deepest built layer whatever the config lists."""
    raw = config.raw("vision_feature_layer", -2)
    return config.text("model_type", "") == "llava_next" and isinstance(raw, list)


def llava_feature_layers(config: HFConfig) -> int:
    """How many encoder layers' outputs the projector takes, concatenated."""
    return len(config.items("vision_feature_layer") or []) if _selects_layers(config) else 1


def activation_streams(vision: HFConfig) -> int:
    """Intermediate-width tensors alive at the tower MLP's activation. CLIP's
    `quick_gelu` (vLLM's QuickGELU, CLIPVisionConfig's default) runs its PyTorch form
    with vLLM's custom ops off (the default under torch.compile; the tower itself is
    not compiled): x * sigmoid(1.702 * x) holds fc1's output x, then the sigmoid and the
    product (or the scaled copy) beside it. A GELU (`gelu`, `gelu_pytorch_tanh`,
    SigLIP's default) is one op: fc1's output and its own."""
    default = llava_tower_family(vision).default_act
    return 3 if vision.text("hidden_act", default) == "quick_gelu" else 2


def llava_tower_family(vision: HFConfig) -> LlavaTowerFamily:
    return LLAVA_TOWERS[llava_tower_kind(vision)]


def _llava_tower(config: HFConfig, vision: HFConfig, tp: int) -> Tower:
    """LLaVA-Next (Granite Vision over SigLIP; the llava-hf v1.6 checkpoints over CLIP)
    and LLaVA 1.5 (CLIP). LLaVA-Next's profile item is the image of the pinpoint with
    the most embeddings (`get_image_size_with_most_features`); the processor cuts it
    into one base tile plus the pinpoint's grid of image_size tiles, and the tower
    encodes every tile. LLaVA 1.5's is one image_size tile. CLIP's tiles are a class
    token longer than their patches."""
    width = vision.integer("hidden_size")
    inter = vision.integer("intermediate_size")
    patch = vision.integer("patch_size")
    size = vision.integer("image_size")
    channels = vision.integer("num_channels", 3)
    # The text width with the text model_type's defaults (llava-hf's files omit it);
    # imported here, as the importer imports this module.
    from kvplan.models.importer import architecture_of, text_config

    text_hidden = text_config(config, architecture_of(config)).integer("hidden_size")
    grid = size // patch
    sequence = grid * grid + llava_tower_family(vision).class_token  # per tile
    # 'default' drops the first embedding (CLIP's class token; vLLM's
    # get_num_selected_vision_tokens drops one of SigLIP's patches too), 'full' none
    strategy = config.text("vision_feature_select_strategy", "default")
    base = sequence - (1 if strategy == "default" else 0)
    tokens, tiles = base, 1
    if config.text("model_type", "") == "llava_next":
        pinpoints = [_pinpoint(config, item) for item in config.items("image_grid_pinpoints") or []]
        if not pinpoints:
            raise ModelConfigError(
                "required for LLaVA-Next's anyres layout", "image_grid_pinpoints"
            )
        tokens = 0
        for pin_height, pin_width in pinpoints:
            count = llava_next_image_tokens(pin_height, pin_width, pinpoints, size, grid, base)
            if count > tokens:
                best = best_grid_resolution(pin_height, pin_width, pinpoints)
                tokens, tiles = count, 1 + (best[0] // size) * (best[1] // size)
    built = llava_vision_layers(config, vision)
    mlp = activation_streams(vision) * -(-inter // tp)  # fc1's output and the activation's
    # With one feature layer, four streams at a layer's MLP (Gemma 3's count): the
    # embeddings the encoder's pool keeps, the layer's input, the post-attention residual
    # and its normed copy. With a list vLLM's encoder keeps every layer's output
    # (`return_all_hidden_states`): at the last layer's MLP the embeddings and the
    # earlier outputs (`built` in all, the last the layer's input), the post-attention
    # residual and its normed copy; after the last layer the whole pool (built + 1)
    # beside the selected layers' concatenation. The larger moment is the peak. The
    # projector's and LLaVA-Next's merge's moments follow the tower (`after_tower`).
    peak = 4 * width + mlp
    if _selects_layers(config):
        features = llava_feature_layers(config)
        peak = max((built + 2) * width + mlp, (built + 1 + features) * width)
    return Tower(
        modalities=("image",),
        tokens_per_item=tokens,
        patches_per_item=tiles * sequence,
        input_elements_per_item=tiles * channels * size * size,
        peak_elements_per_patch=peak,
        output_hidden=text_hidden,
        after_tower=_llava_after_tower(
            config, width, text_hidden, tp, (tiles, sequence, base), tokens
        ),
    )


def _llava_after_tower(
    config: HFConfig, width: int, text_hidden: int, tp: int, tiles: tuple[int, int, int],
    tokens: int,
) -> tuple[tuple[int, int], ...]:  # fmt: skip
    """The wrappers' moments after the tower (`tiles`: tiles per item, positions and
    selected embeddings per tile), per item and once:

    * the projector, over every item's tiles at once: the features it reads (the last
      layer's output, of which the strategy's selection is a view; with a list, the
      selected layers' concatenation), linear_1's output and its GELU, or at linear_2
      the GELU and the output (column- then row-parallel: linear_1's output is the
      rank's share; the all-reduce's copy is not counted, as in the towers);
    * LLaVA-Next's merge (`_merge_image_patch_embeddings`, one item after another): every
      item's projected tiles (held until the last is merged), the merged items so far,
      and for the item being merged its unpadded grid with a newline per row beside the
      base tile's and the grid's concatenation (the finished item): at the last item,
      items x (projected + merged) + the grid with its newlines.

    With the published widths the tower's peak is the larger for llava-v1.6-mistral /
    vicuna (text width 4 to 5 x the tower's) and LLaVA 1.5 at TP 1; the merge is the
    larger for a 7,168-wide text model over CLIP (llava-v1.6-34b's Yi)."""
    count, sequence, selected = tiles
    features = sequence * width
    if _selects_layers(config):
        features = selected * width * llava_feature_layers(config)
    shard = -(-text_hidden // tp)
    projector = count * (features + selected * max(2 * shard, shard + text_hidden))
    if config.text("model_type", "") != "llava_next":
        return ((projector, 0),)
    merge = (count * selected + tokens) * text_hidden
    return ((projector, 0), (merge, (tokens - selected) * text_hidden))


def _pinpoint(config: HFConfig, item: object) -> tuple[int, int]:
    if (
        not isinstance(item, list) or len(item) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in item)
    ):  # fmt: skip
        raise ModelConfigError(
            f"expected [height, width] pairs, got {item!r}", config._where("image_grid_pinpoints")
        )
    return item[0], item[1]


def llava_vision_layers(config: HFConfig, vision: HFConfig) -> int:
    """The SigLIP / CLIP layers vLLM builds for a LLaVA model: up to the deepest feature layer
    (`_get_num_hidden_layers`: a negative index counts from the end, -1 the last)."""
    count = vision.integer("num_hidden_layers")
    raw = config.raw("vision_feature_layer", -2)
    indexes = raw if isinstance(raw, list) else [raw]
    if not indexes or not all(isinstance(i, int) and not isinstance(i, bool) for i in indexes):
        raise ModelConfigError(
            f"expected a layer index or a list of them, got {raw!r}",
            config._where("vision_feature_layer"),
        )
    layers = [int(index) for index in indexes]
    return max(index + count + 1 if index < 0 else index for index in layers)


def _kimi_vl_image_patches(patch: int, kernel: tuple[int, int]) -> tuple[int, int]:
    """(patch rows, patch columns) of vLLM's dummy Kimi-VL image after the processor's
    scaling to KIMI_VL_IN_TOKEN_LIMIT patches and padding to the merge kernel
    (KimiVLProcessingInfo.get_num_image_tokens)."""
    height = width = KIMI_VL_DUMMY_IMAGE
    patches = (width // patch) * (height // patch)
    if patches > KIMI_VL_IN_TOKEN_LIMIT:
        scale = math.sqrt(KIMI_VL_IN_TOKEN_LIMIT / patches)
        width, height = int(width * scale), int(height * scale)
    # Padded up to whole merge kernels.
    rows = -(-height // (kernel[0] * patch)) * kernel[0]
    cols = -(-width // (kernel[1] * patch)) * kernel[1]
    return rows, cols


def _moonvit_tower(config: HFConfig, vision: HFConfig, tp: int) -> Tower:
    """Kimi-VL's MoonViT: every image's patches packed into one sequence. The peak is at
    a block's 2D rotary, which vLLM runs in PyTorch (moonvit.py `apply_rope`): the
    patch embeddings (held by the tower's forward while its encoder runs), the block's
    input and its normed copy (hidden each), beside the fused QKV (3 / TP), Q's and K's
    float32 copies (2 x 2 / TP), their complex64 products (2 x 2 / TP) and the results
    in the model dtype (2 / TP); plus the batch's rotary factors (head_dim / 2 complex64
    per patch) and the 512 x 512 rotary table the first forward builds and keeps."""
    width = vision.integer("hidden_size")
    heads = vision.integer("num_attention_heads")
    patch = vision.integer("patch_size")
    kernel = moonvit_merge_kernel(vision)
    text_hidden = _text_hidden(config, width)
    rows, cols = _kimi_vl_image_patches(patch, kernel)
    head_dim = width // heads
    return Tower(
        modalities=("image",),
        tokens_per_item=rows * cols // (kernel[0] * kernel[1]),
        patches_per_item=rows * cols,
        input_elements_per_item=rows * cols * 3 * patch * patch,
        peak_elements_per_patch=3 * width + 13 * -(-width // tp),
        output_hidden=text_hidden,
        peak_index_bytes_per_patch=head_dim // 2 * 8,
        persistent_bytes=MOONVIT_ROPE_GRID * MOONVIT_ROPE_GRID * head_dim // 2 * 8,
    )


def forward_peak_bytes(tower: Tower, items: int, patches_per_item: int, dtype_bytes: int) -> int:
    """The encoder forward's peak over its inputs and weights, for `items` items of
    `patches_per_item` patches each."""
    patches = items * patches_per_item
    elements = patches * tower.peak_elements_per_patch
    elements += patches_per_item * tower.cached_elements_per_patch
    in_tower = elements * dtype_bytes + int(patches * tower.peak_index_bytes_per_patch)
    after = max((items * per_item + once for per_item, once in tower.after_tower), default=0)
    return max(in_tower, after * dtype_bytes)


def vision_tower(config: HFConfig, tp: int) -> Tower | None:
    """The tower of a multimodal checkpoint kvplan models, else None (text-only
    models; a vision_config of another kind is an error, not a silent zero)."""
    vision = config.sub("vision_config")
    if vision is None:
        return None
    model_type = config.text("model_type", "")
    if model_type == "gemma3" and vision.text("model_type", "") == "siglip_vision_model":
        return _siglip_tower(config, vision, tp)
    if model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_vl"):
        return _qwen3_vit_tower(vision, tp)
    if model_type == "qwen2_5_vl":
        return _qwen2_5_vit_tower(vision, tp)
    if model_type == "llama4":
        return _llama4_tower(config, vision, tp)
    if is_llava_tower(config):
        return _llava_tower(config, vision, tp)
    if model_type == "kimi_vl":
        return _moonvit_tower(config, vision, tp)
    return None


def deepstack_buffer_bytes(config: HFConfig, max_num_batched_tokens: int, dtype_bytes: int,
                           options: MultimodalOptions) -> int:  # fmt: skip
    """Qwen3-VL's deepstack input buffers: one of max_num_batched_tokens x the text
    width per level, allocated with the model where the tower is built
    (Qwen3VLForConditionalGeneration.__init__), so held through the whole profile run
    whether or not the encoder is profiled."""
    vision = config.sub("vision_config")
    text = config.sub("text_config")
    if vision is None or text is None or config.text("model_type", "") != "qwen3_vl":
        return 0
    if not tower_built(config, options):
        return 0
    levels = len(vision.items("deepstack_visual_indexes") or [])
    return levels * max_num_batched_tokens * text.integer("hidden_size") * dtype_bytes


def tower_built(config: HFConfig, options: MultimodalOptions) -> bool:
    """Whether vLLM builds (and loads) the tower: not when every modality it serves
    has a limit of 0 (`--language-model-only`, `--limit-mm-per-prompt`)."""
    tower = vision_tower(config, 1)
    return tower is not None and any(options.limit(m) > 0 for m in tower.modalities)


@dataclass(frozen=True)
class EncoderProfile:
    """What vLLM's profile run does with the encoder, per rank."""

    modality: str
    tokens_per_item: int
    encoder_budget: int  # tokens: "Encoder cache will be initialized with a budget of"
    items: int  # "... and profiled with N image items of the maximum feature size"
    input_bytes: int  # the dummy batch on the device, held through the whole run
    forward_peak_bytes: int  # the encoder forward's peak over its inputs
    output_bytes: int  # embeddings kept in the encoder cache through the decoder run
    # what the first encoder forward allocates and keeps (MoonViT's rotary table)
    persistent_bytes: int = 0

    @property
    def encoder_phase_bytes(self) -> int:
        return self.input_bytes + self.forward_peak_bytes + self.persistent_bytes

    @property
    def held_bytes(self) -> int:
        """Held while the decoder's forward and the sampler run."""
        return self.input_bytes + self.output_bytes + self.persistent_bytes


def encoder_items(
    tokens_per_item: int, limit: int, max_model_len: int, max_num_batched_tokens: int,
    max_num_seqs: int,
) -> tuple[int, int]:  # fmt: skip
    """(encoder budget in tokens, items the profile run encodes), as vLLM's
    compute_mm_encoder_budget and MultiModalBudget._get_max_items (chunked prefill on,
    as in V1)."""
    budget = max(max_num_batched_tokens, tokens_per_item)
    per_prompt = max(1, min(limit, max_model_len // tokens_per_item))
    items = max(1, min(budget // tokens_per_item, max_num_seqs * per_prompt))
    return budget, items


def encoder_profile(
    config: HFConfig,
    tp: int,
    dtype_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    options: MultimodalOptions,
) -> EncoderProfile | None:
    """The encoder part of the profile run, or None where vLLM runs none (a text
    model, `--skip-mm-profiling`, every limit of the tower 0)."""
    tower = vision_tower(config, tp)
    if tower is None or options.skip_mm_profiling or not tower_built(config, options):
        return None
    # The profiled modality is the one with the most tokens per item, a tie to the later
    # name (vLLM's get_modality_with_max_tokens): Qwen2.5-VL's video whenever video is
    # allowed; the image for the other towers (Qwen3-VL's video processor sizes its
    # dummy video below the image, and Qwen3.5 logs print "1 image items"). With images
    # off and video on, those towers profile a video, which is not modelled.
    modality, tokens, patches = tower.modalities[0], tower.tokens_per_item, tower.patches_per_item
    input_elements = tower.input_elements_per_item
    if tower.video_temporal_patch and options.limit("video") > 0:
        temporal_patches = qwen2_vl_video_temporal_patches(
            tower.tokens_per_item, tower.video_temporal_patch, max_model_len
        )
        modality, tokens = "video", temporal_patches * tower.tokens_per_item
        patches = temporal_patches * tower.patches_per_item
        input_elements = temporal_patches * tower.input_elements_per_item
    elif options.limit(modality) == 0:
        raise ModelConfigError(
            "--limit-mm-per-prompt: with images off, vLLM profiles the encoder with a video, "
            "which kvplan does not estimate; pass --skip-mm-profiling or --non-kv-bytes"
        )
    budget, items = encoder_items(
        tokens, options.limit(modality), max_model_len, max_num_batched_tokens, max_num_seqs
    )
    forward = forward_peak_bytes(tower, items, patches, dtype_bytes)
    outputs = items * tokens * tower.output_hidden * dtype_bytes
    return EncoderProfile(
        modality,
        tokens,
        budget,
        items,
        items * input_elements * dtype_bytes,
        forward,
        outputs,
        tower.persistent_bytes,
    )


def qwen2_vl_video_temporal_patches(image_tokens: int, temporal: int, max_model_len: int) -> int:
    """Temporal patches of the dummy video vLLM's Qwen2-VL processing info profiles
    (one video: get_num_frames_with_most_features): the most frames of the largest image
    whose tokens (frames padded to `temporal`, each temporal patch an image's tokens)
    fit max_model_len, at least 1 and at most QWEN2_VL_MAX_FRAMES_PER_VIDEO."""
    frames = 1
    while frames < QWEN2_VL_MAX_FRAMES_PER_VIDEO:
        if -(-(frames + 1) // temporal) * image_tokens > max_model_len:
            break
        frames += 1
    return -(-frames // temporal)
