"""The plugin's part in learning from the fleet (docs/vllm.md, "Measurements").

- Every mode: after an engine start that profiled its memory, report what each
  worker measured (ReportMeasurements) under the configuration's fingerprint.
- draft-flags and lease modes, with KVPLAN_REUSE_MEASUREMENTS=1: before the
  workers profile, ask for the configuration's measurements (GetMeasurements);
  where there are some, hand each worker kv_cache_memory_bytes = what it requests
  less the largest non-KV memory any measured rank needed, so vLLM skips its
  memory profiling. The setting is taken back once vLLM measured.

Nothing here may stop an engine: a failure is one log line and vLLM goes on.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvplan.client.fleet import config_key, fleet_figures, mm_limits_text, model_config_hash
from kvplan.client.planner import PlannerClient
from kvplan.client.vllm_plugin.logs import log
from kvplan.client.vllm_plugin.worker import report_measured, set_kv_cache_memory_bytes
from kvplan.v1 import service_pb2


def _config_json(model_config: Any) -> tuple[dict[str, Any] | None, str]:
    """The model's config.json as the file holds it (what `kvplan plan --model`
    hashes too), and where it came from; None where it cannot be read."""
    where = str(getattr(model_config, "hf_config_path", None) or getattr(model_config, "model", ""))
    if not where:
        return None, "no model path"
    local = os.path.join(where, "config.json")
    try:
        if os.path.isfile(local):
            with open(local) as file:
                return json.load(file), local
        # A hub id: the copy vLLM loaded, from the local cache only (never the network:
        # this runs while the engine starts).
        from vllm.transformers_utils.repo_utils import try_get_local_file

        path = try_get_local_file(where, "config.json", getattr(model_config, "revision", None))
        if not (isinstance(path, os.PathLike) and os.path.isfile(path)):
            return None, f"{where}: config.json not in the local Hugging Face cache"
        with open(path) as file:
            return json.load(file), str(path)
    except Exception as error:  # the fingerprint is then unknown, not wrong
        return None, f"{where}: {error}"


def cuda_graphs(vllm_config: Any) -> str:
    """The CUDA-graph settings that change the memory vLLM measures."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return "eager"
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    name = getattr(mode, "name", None) or (str(mode) if mode is not None else "")
    size = getattr(compilation, "max_cudagraph_capture_size", None)
    return f"{name}:{size}" if name and size else name


def multimodal_settings(model_config: Any) -> dict[str, Any]:
    """A multimodal model's profiling flags as vLLM settled them (its MultiModalConfig,
    0.32-0.34); none for a text-only model, which has no such config."""
    multimodal = getattr(model_config, "multimodal_config", None)
    if multimodal is None:
        return {}
    limits = getattr(multimodal, "limit_per_prompt", None) or {}
    return {
        "skip_mm_profiling": bool(getattr(multimodal, "skip_mm_profiling", False)),
        "limit_mm_per_prompt": mm_limits_text(dict(limits)),
        "language_model_only": bool(getattr(multimodal, "language_model_only", False)),
    }


def fingerprint(
    vllm_config: Any, config: dict[str, Any], engine_version: str, gpu_name: str
) -> service_pb2.ConfigFingerprint:
    """The configuration's fingerprint; `config`: the model's config.json."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    return service_pb2.ConfigFingerprint(
        model_config_hash=model_config_hash(config),
        engine_version=engine_version,
        gpu_name=gpu_name,
        tensor_parallel_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        pipeline_parallel_size=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
        dtype=str(model.dtype).removeprefix("torch."),
        kv_cache_dtype=str(getattr(cache, "cache_dtype", "auto") or "auto"),
        quantization=str(getattr(model, "quantization", None) or ""),
        max_num_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens or 0),
        cuda_graphs=cuda_graphs(vllm_config),
        model=str(getattr(model, "model", ""))[:256],
        disable_custom_all_reduce=bool(getattr(parallel, "disable_custom_all_reduce", False)),
        **multimodal_settings(model),
    )


def _worker(rank: int, available: int, report: dict[str, Any]) -> service_pb2.WorkerMeasurement:
    worker = service_pb2.WorkerMeasurement(
        rank=rank,
        available_kv_bytes=int(available),
        total_bytes=int(report["total_bytes"]),
        requested_bytes=int(report["requested_bytes"]),
    )
    for name in ("weights_bytes", "activation_peak_bytes", "cuda_graph_bytes"):
        if report.get(name) is not None:
            setattr(worker, name, int(report[name]))
    return worker


@dataclass
class FleetStart:
    """One engine start's measurements: reused before the profiling, reported after."""

    core: Any
    client: Callable[[], PlannerClient]
    engine_id: str
    engine_version: str
    release: str  # vLLM's version
    reused_bytes: int | None = None  # kv_cache_memory_bytes handed to the workers

    def _measured(
        self, vllm_config: Any
    ) -> tuple[service_pb2.ConfigFingerprint, list[dict[str, Any]]] | None:
        """The fingerprint and each worker's figures; None (one debug line) where the
        model's config.json cannot be read: the fingerprint would not be comparable."""
        config, where = _config_json(vllm_config.model_config)
        if config is None:
            log.debug("kvplan fleet: the model's config.json is unreadable (%s)", where)
            return None
        reports = list(self.core.model_executor.collective_rpc(report_measured))
        gpu = str(reports[0]["gpu_name"]) if reports else ""
        return fingerprint(vllm_config, config, self.engine_version, gpu), reports

    def report(self, vllm_config: Any, measured: Sequence[int] | None) -> None:
        """Every mode, after the KV cache exists: what the workers measured. Nothing is
        reported for a start that did not profile (kv_cache_memory_bytes, reused or
        given), or whose measurement never reached the planner."""
        if measured is None or self.reused_bytes is not None:
            return
        if getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None):
            return
        try:
            found = self._measured(vllm_config)
            if found is None:
                return
            print_, reports = found
            request = service_pb2.ReportMeasurementsRequest(
                engine_id=self.engine_id,
                fingerprint=print_,
                release=self.release,
                workers=[
                    _worker(rank, available, report)
                    for rank, (available, report) in enumerate(zip(measured, reports, strict=True))
                ],
            )
            with self.client() as client:
                answer = client.report_measurements(request)
            log.info(
                "kvplan fleet: reported the measurements of engine %s (configuration %s, "
                "%d engine(s) kept)",
                self.engine_id,
                answer.config_key,
                answer.engines,
            )
        except Exception as error:  # never the engine's problem
            log.warning("kvplan fleet: reporting the measurements failed (%s)", error)

    def reusable_bytes(self, vllm_config: Any) -> tuple[int, str] | None:
        """kv_cache_memory_bytes for this engine from the fleet's measurements of its
        exact configuration (runtime included), with the log's reason; None: profile."""
        found = self._measured(vllm_config)
        if found is None:
            return None
        print_, reports = found
        with self.client() as client:
            answer = client.get_measurements(print_)
        figures = fleet_figures(answer.engines)
        if figures is None:
            log.info(
                "kvplan fleet: configuration %s was not measured before: vLLM profiles",
                config_key(print_),
            )
            return None
        requested = min(int(report["requested_bytes"]) for report in reports)
        value = requested - figures.max_non_kv_bytes
        if value <= 0:
            return None
        return value, f"configuration {answer.config_key} {figures.describe()}"

    @contextmanager
    def reusing(self, vllm_config: Any) -> Iterator[None]:
        """While the engine start runs: the workers' determine_available_memory sees
        kv_cache_memory_bytes where the fleet measured this configuration."""
        executor = self.core.model_executor
        started = time.monotonic()
        try:
            found = self.reusable_bytes(vllm_config)
        except Exception as error:
            log.warning("kvplan fleet: asking for measurements failed (%s); vLLM profiles", error)
            found = None
        if found is None:
            yield
            return
        value, why = found
        asked_s = time.monotonic() - started
        determine = executor.determine_available_memory

        def determine_available_memory() -> list[int]:
            executor.collective_rpc(set_kv_cache_memory_bytes, args=(value,))
            try:
                return list(determine())
            finally:  # taken back: later readers (a lease's request) see the user's setting
                executor.collective_rpc(set_kv_cache_memory_bytes, args=(None,))

        own = vars(executor).get("determine_available_memory")  # usually the class's
        executor.determine_available_memory = determine_available_memory
        self.reused_bytes = value
        log.info(
            "kvplan fleet: %s; vLLM gets kv_cache_memory_bytes=%d and skips its memory "
            "profiling (its compile profile run still runs); asked in %.0f ms",
            why,
            value,
            asked_s * 1000,
        )
        try:
            yield
        finally:
            if own is None:
                del executor.determine_available_memory
            else:
                executor.determine_available_memory = own
