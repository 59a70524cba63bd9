"""The vision encoder's part of the profile run (kvplan.models.encoder) against vLLM's
own code in the 0.32 CPU venv (tests/models/vllm_encoder_side.py):

* the forward peak of vLLM's towers (Gemma 3's SiglipVisionModel with
  Gemma3MultiModalProjector, Qwen3.5 / 3.6's Qwen3_VisionTransformer), built with the
  shipped configs' widths and run on dummy pixels, every storage their ops create
  counted while it lives, against kvplan's per-patch count, at two depths and two batch
  sizes (the peak does not grow with the depth, and grows linearly with the patches);
* the embeddings they return (what the encoder cache holds through the decoder run);
* the encoder budget and the number of items profiled (vLLM's
  compute_mm_encoder_budget and MultiModalBudget._get_max_items) for 42 settings.
"""

from __future__ import annotations

import itertools
import json
import socket
from pathlib import Path

from kvplan.models.config import HFConfig
from kvplan.models.encoder import encoder_items, forward_peak_bytes, vision_tower
from tests.vllm_envs import run_in_vllm

MODELS = Path(__file__).parents[2] / "examples" / "models"
SIDE = Path(__file__).with_name("vllm_encoder_side.py")
BF16 = 2


def _config(name: str) -> HFConfig:
    return HFConfig(json.loads((MODELS / name / "config.json").read_text()))


def _port() -> int:
    with socket.socket() as probe:  # a free loopback port for the one-rank gloo group
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# (tokens per item, max_num_batched_tokens, max_num_seqs, max_model_len, limit)
BUDGETS = [
    *itertools.product((256,), (2048, 8192, 16384), (1, 4, 256), (4096, 262144), (1, 999)),
    (16384, 8192, 2, 262144, 999),  # Qwen3.5 / 3.6 at 8,192 batched tokens: one image
    (16384, 32768, 2, 262144, 999),
    (16384, 32768, 1, 8192, 999),  # shorter than one image: still one per prompt
    (16384, 65536, 1, 262144, 2),
    (1200, 8192, 1024, 32768, 3),
    (1200, 2048, 1, 1024, 999),
]


def test_encoder_peak_outputs_and_budget_against_vllm(tmp_path: Path) -> None:
    gemma, qwen = _config("gemma-3-27b"), _config("qwen3.6-27b")
    siglip = {
        "kind": "siglip",
        "vision": gemma.data["vision_config"],
        "text_hidden": gemma.data["text_config"]["hidden_size"],
        "mm_tokens_per_image": gemma.data["mm_tokens_per_image"],
    }
    vit = {"kind": "qwen3_vit", "vision": qwen.data["vision_config"]}
    # The second SigLIP case halves the image (448 pixels, 32 x 32 patches pooled to
    # 8 x 8 = 64 tokens, the same 4 x 4 pooling) to keep the CPU run short.
    small = {**gemma.data, "mm_tokens_per_image": 64,
             "vision_config": {**gemma.data["vision_config"], "image_size": 448}}  # fmt: skip
    towers = [
        {**siglip, "depth": 2, "items": 1},
        {**siglip, "vision": small["vision_config"], "mm_tokens_per_image": 64, "depth": 3,
         "items": 2},
        {**vit, "depth": 2, "items": 1, "grid": [1, 32, 32]},
        {**vit, "depth": 3, "items": 2, "grid": [1, 16, 32]},
    ]  # fmt: skip
    budgets = [
        dict(zip(("max_tokens_per_item", "max_num_batched_tokens", "max_num_seqs",
                  "max_model_len", "limit"), case, strict=True))
        for case in BUDGETS
    ]  # fmt: skip
    assert len(budgets) == 42
    answer = run_in_vllm(
        "0.32", [str(SIDE)], {"port": _port(), "towers": towers, "budgets": budgets},
        cache_root=tmp_path, timeout=280,
    )  # fmt: skip

    gemma_tower, qwen_tower = vision_tower(gemma, 1), vision_tower(qwen, 1)
    small_tower = vision_tower(HFConfig(small), 1)
    assert gemma_tower is not None and qwen_tower is not None and small_tower is not None
    patches = [1 * 64 * 64, 2 * 32 * 32, 1 * 32 * 32, 2 * 16 * 32]

    # On the CPU the host-side buffers count too, which on a GPU are not device memory:
    # the Qwen ViT keeps one item's int64 position ids (2 per patch) in a host cache
    # (`_rot_pos_ids_cache`), and its int32 cu_seqlens (items + 1) and max_seqlen.
    def host_side(items: int, patches_per_item: int) -> int:
        return 2 * 8 * patches_per_item + 4 * (items + 1) + 4

    expected_peaks = [
        forward_peak_bytes(gemma_tower, patches[0], BF16),
        forward_peak_bytes(small_tower, patches[1], BF16),
        forward_peak_bytes(qwen_tower, patches[2], BF16) + host_side(1, 32 * 32),
        forward_peak_bytes(qwen_tower, patches[3], BF16) + host_side(2, 16 * 32),
    ]
    assert answer["peaks"] == expected_peaks
    text_hidden = gemma.data["text_config"]["hidden_size"]
    out_hidden = qwen.data["vision_config"]["out_hidden_size"]
    assert answer["outputs"] == [
        1 * 256 * text_hidden * BF16,
        2 * 64 * text_hidden * BF16,
        patches[2] // 4 * out_hidden * BF16,
        patches[3] // 4 * out_hidden * BF16,
    ]
    ours = [list(encoder_items(tokens, limit, length, batched, seqs))
            for tokens, batched, seqs, length, limit in BUDGETS]  # fmt: skip
    assert answer["budgets"] == ours
