"""Runs inside each vLLM worker (through `collective_rpc`): names the worker's GPU
as the worker itself sees it, and reports what vLLM measured there."""

from __future__ import annotations

from typing import Any

from kvplan.client.devices import cuda_device_name, cuda_device_uuid


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


def _device_index(worker: Any) -> int:
    index = getattr(getattr(worker, "device", None), "index", None)
    return int(getattr(worker, "local_rank", 0)) if index is None else int(index)


def _optional_bytes(value: Any) -> int | None:
    return None if value is None else max(0, int(value))


def report_measured(worker: Any) -> dict[str, int | str | None]:
    """What vLLM's worker measured in `determine_available_memory` (the same
    attributes in 0.32, 0.33 and 0.34), as plain values: None where the release or
    this start did not measure it (kv_cache_memory_bytes skips the profiling)."""
    snapshot = getattr(worker, "init_snapshot", None)
    runner = getattr(worker, "model_runner", None)
    return {
        "gpu_name": cuda_device_name(_device_index(worker)),
        "total_bytes": int(getattr(snapshot, "total_memory", 0) or 0),
        "requested_bytes": int(getattr(worker, "requested_memory", 0) or 0),
        "weights_bytes": _optional_bytes(getattr(runner, "model_memory_usage", None)),
        # vLLM's own figure: the profile run's transient peak plus, where the release
        # applies it, the CUDA-graph estimate.
        "activation_peak_bytes": _optional_bytes(getattr(worker, "peak_activation_memory", None)),
        "cuda_graph_bytes": _optional_bytes(getattr(worker, "cudagraph_memory_estimate", None)),
    }


def set_kv_cache_memory_bytes(worker: Any, value: int | None) -> None:
    """Hand the worker an explicit KV size (vLLM then skips its memory profiling), or
    take it back (None)."""
    worker.cache_config.kv_cache_memory_bytes = value
