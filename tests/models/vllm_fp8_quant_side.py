"""Runs in a vLLM CPU venv: which linear modules vLLM leaves unquantized for an fp8
quantization_config on Qwen3.5 / 3.6, by vLLM module prefix. The target model's and the
MTP drafter's Fp8Config each get their class's rename mapper (where it has one) and
packed-modules mapping
(what vLLM's configure_quant_config does when the model is built), then the decision
Fp8Config.get_quant_method takes for a linear layer (is_layer_skipped).

stdin: {"quantization_config": {...}, "target": [prefix, ...], "draft": [prefix, ...]}
stdout (last line): {"target": [bool, ...], "draft": [bool, ...]}
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration
from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP


def skipped(model_class: Any, quant: dict[str, Any], prefixes: list[str]) -> list[bool]:
    config = Fp8Config.from_config(quant)
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)  # the MTP class has none
    if mapper is not None:
        config.apply_vllm_mapper(mapper.get_rename_mapper())
    config.packed_modules_mapping = model_class.packed_modules_mapping
    return [
        bool(
            is_layer_skipped(
                prefix,
                config.ignored_layers or [],
                fused_mapping=config.packed_modules_mapping,
                match_mode=config.ignored_layers_match_mode,
            )
        )
        for prefix in prefixes
    ]


def main() -> None:
    case = json.load(sys.stdin)
    quant = case["quantization_config"]
    print(json.dumps({
        "target": skipped(Qwen3_5ForConditionalGeneration, quant, case["target"]),
        "draft": skipped(Qwen3_5MTP, quant, case["draft"]),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
