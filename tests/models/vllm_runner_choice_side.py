"""Run in a vLLM CPU venv: which model runner the release picks for a config directory
(stdin: {"path": DIR}). The V1 runner's CUDA-graph profiler is the one with the long
FULL sample (vllm#50780); stdout (last line): {"v1_runner_shipped": bool,
"v2_by_default": bool or null (null: the release has no choice to make),
"unsupported": [features that would send it to V1]}.

The CPU venvs lack Triton, which Model Runner V2 requires and vLLM's CUDA wheels ship,
so the check is made as on CUDA: with Triton taken as present."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import vllm.config.vllm as vllm_config_module
from vllm_model_side import cpu_vllm_config  # type: ignore[import-not-found]

request = json.loads(sys.stdin.read())
v1_shipped = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
answer: dict[str, object] = {"v1_runner_shipped": v1_shipped, "v2_by_default": None}
config = cpu_vllm_config(request["path"], 4096)
if hasattr(type(config), "use_v2_model_runner"):
    vllm_config_module.HAS_TRITON = True
    answer["v2_by_default"] = bool(config.use_v2_model_runner)
    answer["unsupported"] = config._get_v2_model_runner_unsupported_features()
print(json.dumps(answer))
