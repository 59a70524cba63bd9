"""Run in a vLLM CPU venv: what the release's MXFP4 MoE oracle (fused_moe/oracle/mxfp4.py)
would weigh for gpt-oss on a CUDA GPU of each compute capability (stdin: {"capabilities":
[[major, minor], ...]}). The platform is stood in at the hardware boundary only (a CUDA
platform reporting that capability); everything else is the release's own code. stdout
(last line): {"vendored_triton_kernels": bool, "has_triton_kernels": bool, "by_capability":
{"9.0": {"priority": [backend names, first preferred], "triton_device": bool}}}."""

from __future__ import annotations

import importlib.util
import json
import sys

import vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe as triton_moe
import vllm.model_executor.layers.fused_moe.oracle.mxfp4 as oracle
import vllm.platforms as platforms
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum
from vllm.utils.import_utils import has_triton_kernels

request = json.loads(sys.stdin.read())


def cuda_platform(major: int, minor: int) -> Platform:
    class StandIn(Platform):  # type: ignore[misc]
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major, minor)

    return StandIn()


answer: dict[str, object] = {
    "vendored_triton_kernels": importlib.util.find_spec("vllm.third_party.triton_kernels")
    is not None,
    "has_triton_kernels": bool(has_triton_kernels()),
}
by_capability: dict[str, object] = {}
for major, minor in request["capabilities"]:
    stand_in = cuda_platform(major, minor)
    # Every module that reads the platform in the selection: the oracle, the Triton
    # experts' device gate, and the late `from vllm.platforms import current_platform`
    # of the Humming priority helper.
    oracle.current_platform = stand_in
    triton_moe.current_platform = stand_in
    platforms._current_platform = stand_in
    by_capability[f"{major}.{minor}"] = {
        "priority": [backend.name for backend in oracle._get_priority_backends_for_gpt_oss()],
        "triton_device": bool(triton_moe._triton_kernel_moe_supports_current_device()),
    }
answer["by_capability"] = by_capability
print(json.dumps(answer))
