"""The vision encoder's part of the profile run end to end: vLLM's multimodal flags
(`--skip-mm-profiling`, `--limit-mm-per-prompt`, `--language-model-only`) through the
CLI, the calibrate log reader and the request builder. The per-patch peaks and the item
counts themselves are checked against vLLM's code in test_encoder_against_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplan.cli import main
from kvplan.models import load_config
from kvplan.models.calibrate import parse_log, settings_from_log
from kvplan.models.config import ModelConfigError
from kvplan.models.encoder import (
    MultimodalOptions,
    encoder_profile,
    parse_limit_mm_per_prompt,
    qwen2_vl_video_temporal_patches,
    tower_built,
)
from kvplan.models.profiling import CUBLAS_WORKSPACE_HOPPER
from kvplan.models.request import ModelPlanOptions, build_plan_request

MODELS = Path(__file__).parents[2] / "examples" / "models"
EXAMPLES = Path(__file__).parents[2] / "examples"
GEMMA = ["plan", "--model", str(MODELS / "gemma-3-27b"), "--gpu", "H100", "--max-model-len", "8K"]


def _non_kv(capsys: pytest.CaptureFixture[str], *extra: str) -> int:
    assert main([*GEMMA, *extra, "--json"]) == 0
    return int(json.loads(capsys.readouterr().out)["workers"][0]["budget"]["non_kv_bytes"])


def test_flags_change_the_estimate_as_vllm_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(GEMMA) == 0
    out = capsys.readouterr().out
    # H100 defaults: 8,192 batched tokens, 1,024 sequences; 256 tokens per image
    assert "vision encoder profile: budget 8,192 tokens, 32 image item(s) of 256 tokens" in out
    default = _non_kv(capsys)
    skipped = _non_kv(capsys, "--skip-mm-profiling")
    # Gemma 3 27B at 1,024 sequences: the sampler phase is the larger, so the encoder adds
    # what it leaves held through it: 32 bf16 images of 3 x 896 x 896 and 32 x 256 x 5,376
    # embeddings.
    assert default - skipped == 32 * 3 * 896 * 896 * 2 + 32 * 256 * 5376 * 2
    assert main([*GEMMA, "--skip-mm-profiling"]) == 0
    assert "vision encoder profile" not in capsys.readouterr().out
    # One image per prompt and one sequence: one image profiled.
    one = ["--limit-mm-per-prompt", '{"image": 1}', "--max-num-seqs", "1"]
    assert main([*GEMMA, *one]) == 0
    assert "1 image item(s) of 256 tokens" in capsys.readouterr().out
    # No image at all: no encoder run, and the tower is not loaded either.
    text_only = _non_kv(capsys, "--language-model-only")
    assert text_only == _non_kv(capsys, "--limit-mm-per-prompt", '{"image": 0}')
    assert text_only == _non_kv(capsys, "--limit-mm-per-prompt", '{"image": {"count": 0}}')
    assert text_only < skipped


def test_language_model_only_drops_the_tower_weights() -> None:
    config = load_config(str(MODELS / "qwen3.6-27b"))
    _, full_inputs = build_plan_request(config, ModelPlanOptions(gpu="H100", max_model_len=8192))
    text = ModelPlanOptions(
        gpu="H100", max_model_len=8192, multimodal=MultimodalOptions(language_model_only=True)
    )
    _, text_inputs = build_plan_request(config, text)
    assert full_inputs.weights is not None and text_inputs.weights is not None
    vision = full_inputs.weights.params.vision
    assert vision > 0 and text_inputs.weights.params.vision == 0
    assert full_inputs.weights.bytes_per_worker - text_inputs.weights.bytes_per_worker == vision * 2
    assert full_inputs.overhead is not None and full_inputs.overhead.encoder is not None
    assert text_inputs.overhead is not None and text_inputs.overhead.encoder is None
    assert not tower_built(config, MultimodalOptions(limit_mm_per_prompt={"image": 0, "video": 0}))
    assert tower_built(config, MultimodalOptions(limit_mm_per_prompt={"image": 0}))


def test_qwen_profiles_one_largest_image_where_the_encoder_is_the_larger_phase() -> None:
    config = load_config(str(MODELS / "qwen3.6-27b"))
    profile = encoder_profile(config, 2, 2, 262144, 8192, 2, MultimodalOptions())
    assert profile is not None
    # 4,096 x 4,096 pixels: 256 x 256 patches of 16, 16,384 tokens after the 2 x 2 merge
    assert (profile.encoder_budget, profile.items, profile.tokens_per_item) == (16384, 1, 16384)
    assert profile.input_bytes == 65536 * 3 * 2 * 16 * 16 * 2
    _, inputs = build_plan_request(
        config,
        ModelPlanOptions(gpu_memory_bytes=24 << 30, tensor_parallel_size=2, max_model_len=262144,
                         max_num_batched_tokens=8192, max_num_seqs=2),
    )  # fmt: skip
    assert inputs.overhead is not None
    # The encoder phase is the peak; cuBLAS's workspace comes on top (32 MiB on a part
    # kvplan does not know, as on Hopper).
    assert inputs.overhead.activation_peak_bytes == (
        profile.encoder_phase_bytes + CUBLAS_WORKSPACE_HOPPER)  # fmt: skip
    with pytest.raises(ModelConfigError, match="profiles the encoder with a video"):
        encoder_profile(
            config, 1, 2, 8192, 8192, 2, MultimodalOptions(limit_mm_per_prompt={"image": 0})
        )


def test_qwen2_5_vl_profiles_a_video_of_the_largest_frames() -> None:
    """vLLM picks the modality with the most tokens per item, a tie to "video"
    (get_modality_with_max_tokens), and Qwen2-VL's processing info makes the dummy video
    as many frames of the largest image as max_model_len holds, at most 14, two frames a
    temporal patch (qwen2_vl.py, 0.32): the 0.23.0 A100 log of Qwen2.5-VL-7B prints "a
    budget of 114688 tokens, and profiled with 1 video items" at max_model_len 128,000."""
    config = load_config(str(MODELS / "qwen2.5-vl-7b-instruct"))
    image = 16384  # 256 x 256 patches of 14 (max_pixels 12,845,056), merged 2 x 2
    # (max_model_len, temporal patches): 1 frame at least, padded to 2; 14 frames at most
    for length, temporal in ((4096, 1), (16384, 1), (32767, 1), (32768, 2), (114688, 7),
                             (128000, 7), (1 << 20, 7)):  # fmt: skip
        assert qwen2_vl_video_temporal_patches(image, 2, length) == temporal, length
    profile = encoder_profile(config, 1, 2, 128000, 2048, 256, MultimodalOptions())
    assert profile is not None
    assert (profile.modality, profile.encoder_budget, profile.items) == ("video", 114688, 1)
    patches = 7 * 256 * 256
    assert profile.input_bytes == patches * 3 * 2 * 14 * 14 * 2
    # At the down projection: 5 x 1,280 + 3 x 3,420, the cos/sin of the batch and of the
    # grid's cache (80 each), the window order and its inverse (4 B a patch)
    assert profile.forward_peak_bytes == patches * ((5 * 1280 + 3 * 3420 + 2 * 80) * 2 + 4)
    assert profile.output_bytes == 114688 * 3584 * 2
    # The image alone where video is off; a video of one temporal patch ties the image
    images = MultimodalOptions(limit_mm_per_prompt={"video": 0})
    only_image = encoder_profile(config, 1, 2, 128000, 2048, 256, images)
    assert only_image is not None and only_image.modality == "image"
    assert only_image.tokens_per_item == image
    short = encoder_profile(config, 1, 2, 8192, 2048, 256, MultimodalOptions())
    assert short is not None and (short.modality, short.tokens_per_item) == ("video", image)
    videos = MultimodalOptions(limit_mm_per_prompt={"image": 0})
    assert encoder_profile(config, 1, 2, 128000, 2048, 256, videos) == profile


def test_calibrate_compares_the_parts_of_an_engine_with_no_room_for_the_cache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    record = Path(__file__).parents[1] / "data" / "calibration"
    log = str(record / "qwen2.5-vl-7b-instruct-a100-v0.23.log")
    model = str(MODELS / "qwen2.5-vl-7b-instruct")
    assert parse_log(Path(log).read_text(encoding="utf-8")).available_kv_gib == [-14.28]
    assert main(["calibrate", log, "--model", model, "--gpu", "A100-80GB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["no_room_for_the_cache"] is True
    rows = {row["figure"]: row for row in result["rows"]}
    available = rows["available KV cache memory per worker"]
    assert available["measured"] == -14.28 and available["predicted"] < 0
    assert rows["encoder items profiled"]["predicted"] == 1


def test_bad_limits_are_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for text, message in (
        ("image=2", "not JSON"),
        ("[2]", "a JSON object"),
        ('{"image": -1}', "'image' must be a count >= 0"),
        ('{"image": true}', "'image' must be a count >= 0"),
    ):
        with pytest.raises(ModelConfigError, match=message):
            parse_limit_mm_per_prompt(text)
        assert main([*GEMMA, "--limit-mm-per-prompt", text]) == 2
        assert message in capsys.readouterr().err


def test_the_flags_beside_a_request_file_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    request = str(EXAMPLES / "gemma-3-27b.yaml")
    for flags in (["--skip-mm-profiling"], ["--language-model-only"],
                  ["--limit-mm-per-prompt", '{"image": 1}']):  # fmt: skip
        assert main(["plan", request, *flags]) == 2
        assert f"{flags[0]} applies to --model only" in capsys.readouterr().err


def test_calibrate_reads_the_flags_from_the_log() -> None:
    line = (
        "(APIServer pid=1) INFO 04-22 16:06:59 [entrypoints/utils.py:233] non-default args: "
        "{'model': 'google/gemma-3-4b-it', 'skip_mm_profiling': True, "
        "'limit_mm_per_prompt': {'image': 2}, 'language_model_only': False}"
    )
    settings = settings_from_log(parse_log(line))
    assert settings["skip_mm_profiling"] is True
    assert "language_model_only" not in settings
    assert json.loads(settings["limit_mm_per_prompt"]) == {"image": 2}


@pytest.mark.parametrize("model", ["gemma-3-4b", "gemma-3-27b"])
def test_the_gemma_3_records_log_what_kvplan_profiles(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM 0.19 on an H100 (llm-d-planner's sweep): "Encoder cache will be initialized
    # with a budget of 8192 tokens, and profiled with 32 image items".
    record = Path(__file__).parents[1] / "data" / "calibration" / f"{model}-h100-llmd-v0.19.log"
    args = ["calibrate", str(record), "--model", str(MODELS / model), "--gpu", "H100"]
    assert main([*args, "--json"]) == 0
    rows = {row["figure"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    budget = rows["encoder budget of the profile run (tokens)"]
    items = rows["encoder items profiled"]
    assert (budget["measured"], budget["predicted"]) == (8192, 8192)
    assert (items["measured"], items["predicted"]) == (32, 32)


def test_what_is_not_modelled_is_said(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # A vision tower of a kind kvplan has no model of (a Gemma 3 wrapper around a CLIP
    # tower): said, not counted as nothing silently.
    raw = json.loads((MODELS / "gemma-3-4b" / "config.json").read_text())
    raw["vision_config"] = {**raw["vision_config"], "model_type": "clip_vision_model"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    other = ["plan", "--model", str(tmp_path), "--gpu", "H100", "--max-model-len", "8K"]
    assert main(other) == 0
    assert "vision tower, which kvplan does not estimate for this family" in (
        capsys.readouterr().out
    )
    # Llama 4's tower is modelled: the profile is printed, no such note.
    llama4 = ["plan", "--model", str(MODELS / "llama-4-defaults"), "--gpu", "H200", "-tp", "8"]
    assert main([*llama4, "--max-model-len", "8K"]) == 0
    out = capsys.readouterr().out
    assert "vision encoder profile: budget 8,192 tokens, 1 image item(s) of 4,352 tokens" in out
    assert "does not estimate for this family" not in out
    text = ["plan", "--model", str(MODELS / "llama-3.1-8b"), "--gpu", "H100"]
    assert main([*text, "--max-model-len", "8K", "--skip-mm-profiling"]) == 0
    assert "the model has no vision tower" in capsys.readouterr().out
    assert main([*GEMMA]) == 0
    assert "note: the model has no vision tower" not in capsys.readouterr().out
