"""Runs inside a vLLM CPU venv (tests/models/test_non_torch_against_vllm.py): vLLM's
own CustomAllreduce constructor, on stand-ins for the process group, NVML's NVLink
answer and the device, says for each (world size, every pair NVLink-connected) whether
it turns custom all-reduce off on the "more than two PCIe-only GPUs" rule or goes on
to its P2P check (where, on a real node, it is enabled if P2P works).

Stdin: [[world_size, fully_connected], ...]; stdout (last line): a JSON list of
"off: not NVLink-connected" / "on to the P2P check" / "off: <other>" per case."""

from __future__ import annotations

import json
import sys

import torch
import vllm.distributed.device_communicators.custom_all_reduce as car


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


cases = json.loads(sys.stdin.read())
print(json.dumps([decide(int(size), bool(nvlink)) for size, nvlink in cases]))
