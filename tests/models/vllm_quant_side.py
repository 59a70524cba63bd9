"""Runs in a vLLM CPU venv: which modules vLLM leaves unquantized for a ModelOpt NVFP4
quantization_config on Qwen3.5 / 3.6 (ModelOptNvFp4Config with the wrapper's weight
mapper applied to its exclusion list, as vLLM's loader does), by vLLM module prefix.

stdin: {"cases": [{"quantization_config": {...}, "prefixes": {part: [prefix, ...]}}]}
stdout (last line): {"excluded": [{part: [bool, ...]} per case]}
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration


def main() -> None:
    answers = []
    for case in json.load(sys.stdin)["cases"]:
        config = ModelOptNvFp4Config.from_config(case["quantization_config"])
        config.apply_vllm_mapper(Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper)
        answers.append(
            {
                part: [bool(config.is_layer_excluded(prefix)) for prefix in prefixes]
                for part, prefixes in case["prefixes"].items()
            }
        )
    print(json.dumps({"excluded": answers}))


if __name__ == "__main__":
    main()
