"""Runs inside a vLLM CPU venv (tests/models/test_non_torch_against_vllm.py): for each
(world size, every pair NVLink-connected, `vllm serve` flags) what vLLM decides about
custom all-reduce. The flags go through vLLM's own argparse and EngineArgs, then
set_custom_all_reduce as its GPU worker calls it: where that leaves custom all-reduce
disabled, the TP group's CudaCommunicator builds no CustomAllreduce ("off: flag").
Otherwise vLLM's own CustomAllreduce constructor runs, on stand-ins for the process
group, NVML's NVLink answer and the device, and says whether it turns custom
all-reduce off (on the "more than two PCIe-only GPUs" rule, an unsupported world
size, ...) or goes on to its P2P check (where, on a real node, it is enabled if P2P
works).

Stdin: [[world_size, fully_connected, [flag, ...]], ...]; stdout (last line): a JSON
list of "off: flag" / "off: not NVLink-connected" / "on to the P2P check" /
"off: <vLLM's warning>" per case."""

from __future__ import annotations

import json
import sys

import torch
import vllm.distributed.device_communicators.custom_all_reduce as car
import vllm.distributed.parallel_state as parallel_state
from vllm.platforms import current_platform

current_platform.device_type = "cpu"  # the CPU build names no device; argparse needs one
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

parser = FlexibleArgumentParser()
AsyncEngineArgs.add_cli_args(parser)


def enabled_by_flags(argv: list[str]) -> bool:
    """What the GPU worker hands set_custom_all_reduce for these flags, and what the
    TP group's CudaCommunicator then reads (_ENABLE_CUSTOM_ALL_REDUCE)."""
    engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))
    parallel_state.set_custom_all_reduce(not engine_args.disable_custom_all_reduce)
    return bool(parallel_state._ENABLE_CUSTOM_ALL_REDUCE)


class ReachedP2PCheck(Exception):
    pass


def decide(world_size: int, fully_connected: bool) -> str:
    platform = car.current_platform
    warnings: list[str] = []
    # A group of `world_size` ranks on one node, this process rank 0 (no real
    # communication happens before the decision).
    car.custom_ar = True  # the CPU wheel has no custom all-reduce kernels
    car.dist.get_backend = lambda group=None: "gloo"
    car.dist.get_rank = lambda group=None: 0
    car.dist.get_world_size = lambda group=None: world_size

    def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: object = None) -> None:
        for index, slot in enumerate(out):
            slot.copy_(torch.tensor([index], dtype=slot.dtype))

    car.dist.all_gather = all_gather
    car.in_the_same_node_as = lambda group, source_rank=0: [True] * world_size
    car._supports_mnnvl_multimem_reduce_scatter = lambda device, size: False
    platform.get_device_capability = lambda device_id=0: None
    platform.visible_device_id_to_physical_device_id = lambda index: index
    platform.is_cuda_alike = lambda: True
    platform.is_rocm = lambda: False
    # NVML's answer: NVLink P2P between every pair of the group's GPUs, or not.
    platform.is_fully_connected = lambda ids: fully_connected

    def p2p(rank: int, size: int) -> bool:
        raise ReachedP2PCheck

    car._can_p2p = p2p
    car.logger.warning = lambda message, *args, **kwargs: warnings.append(message)
    car.logger.warning_once = car.logger.warning
    try:
        communicator = car.CustomAllreduce(group=object(), device=torch.device("cuda:0"))
    except ReachedP2PCheck:
        return "on to the P2P check"
    assert communicator.disabled
    if any("more than two PCIe-only GPUs" in message for message in warnings):
        return "off: not NVLink-connected"
    return "off: " + "; ".join(warnings)


def decide_with_flags(world_size: int, fully_connected: bool, argv: list[str]) -> str:
    if not enabled_by_flags(argv):
        return "off: flag"
    return decide(world_size, fully_connected)


cases = json.loads(sys.stdin.read())
print(json.dumps([decide_with_flags(int(size), bool(nvlink), list(argv))
                  for size, nvlink, argv in cases]))  # fmt: skip
