"""Runs inside each vLLM worker (through `collective_rpc`): names the worker's GPU
as the worker itself sees it, and reports what vLLM measured there."""

from __future__ import annotations

from typing import Any

from kvplan.client.devices import cuda_device_uuid


def report_device(worker: Any) -> dict[str, int | str]:
    """The worker's device UUID (CUDA driver, after CUDA_VISIBLE_DEVICES), its total
    memory and vLLM's memory request, as plain values (they cross processes)."""
    device = getattr(worker, "device", None)
    index = getattr(device, "index", None)
    if index is None:
        index = int(getattr(worker, "local_rank", 0))
    snapshot = getattr(worker, "init_snapshot", None)
    runner = getattr(worker, "model_runner", None)
    return {
        "uuid": cuda_device_uuid(int(index)),
        "total_memory_bytes": int(getattr(snapshot, "total_memory", 0) or 0),
        "requested_memory_bytes": int(getattr(worker, "requested_memory", 0) or 0),
        "weights_bytes": int(getattr(runner, "model_memory_usage", 0) or 0),
    }
