"""`plan --model` and `capacity` with the fleet's measurements: "measured on N engines"
where engines of the same configuration reported what vLLM measured at start
(kvplan.client.fleet, docs/capacity.md), "estimated" otherwise, always saying which.

A measured configuration is planned with the measured figures in place of the
estimate: the non-KV memory (the largest `requested - available` any rank of any
engine measured) and the device total CUDA reported. The KV arithmetic is kvplan's
either way, so the tokens are then what such a worker gets at this utilization.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvplan.client.errors import PlannerError
from kvplan.client.fleet import (
    FleetFigures,
    config_key,
    fleet_figures,
    mm_limits_text,
    model_config_hash,
)
from kvplan.gpus import GpuModel, UnknownGpu, lookup_gpu
from kvplan.models.config import HFConfig
from kvplan.models.request import ModelPlanOptions
from kvplan.v1 import service_pb2

# Asked newest first where the command names no release.
RELEASES = ("vllm-0.34", "vllm-0.33", "vllm-0.32")
Ask = Callable[[service_pb2.ConfigFingerprint], service_pb2.GetMeasurementsResponse]


@dataclass(frozen=True)
class MemorySource:
    """Where a plan's non-KV memory and device total came from."""

    figures: FleetFigures | None
    engine_version: str = ""
    config_key: str = ""
    reason: str = ""  # why estimated

    @property
    def measured(self) -> bool:
        return self.figures is not None

    def line(self) -> str:
        if self.figures is None:
            return f"memory per worker: estimated ({self.reason})"
        return (
            f"memory per worker: {self.figures.describe()} on {self.engine_version}, "
            f"configuration {self.config_key}; planned with the measured non-KV memory and "
            "device total"
        )

    def label(self) -> str:
        """The short form, for a table cell."""
        if self.figures is None:
            return "estimated"
        plural = "s" if self.figures.engines != 1 else ""
        return f"measured on {self.figures.engines} engine{plural}"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": "measured" if self.measured else "estimated"}
        if self.figures is None:
            out["reason"] = self.reason
            return out
        out.update(
            engines=self.figures.engines,
            engine_version=self.engine_version,
            config_key=self.config_key,
            non_kv_bytes=self.figures.max_non_kv_bytes,
            total_bytes=self.figures.total_bytes,
            min_available_kv_bytes=self.figures.min_available_kv_bytes,
        )
        return out


def _dtype(config: HFConfig, options: ModelPlanOptions) -> str:
    """The dtype vLLM settles for `--dtype`: auto is the config's, float32 served
    as bfloat16 (vLLM's choice on GPUs that have it)."""
    if options.dtype != "auto":
        return options.dtype
    text = config.data.get("torch_dtype") or config.data.get("dtype") or "bfloat16"
    return "bfloat16" if str(text) in ("float32", "float") else str(text)


def _quantization(config: HFConfig, options: ModelPlanOptions) -> str:
    if options.quantization:
        return options.quantization
    method = (config.data.get("quantization_config") or {}).get("quant_method", "")
    return str(method or "")


def fingerprint(
    config: HFConfig, options: ModelPlanOptions, gpu: GpuModel, engine_version: str
) -> service_pb2.ConfigFingerprint:
    """What engines of this configuration reported under (runtime fields: any, or
    --max-num-batched-tokens where given)."""
    return service_pb2.ConfigFingerprint(
        model_config_hash=model_config_hash(config.data),
        engine_version=engine_version,
        gpu_name=gpu.name,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        dtype=_dtype(config, options),
        kv_cache_dtype=options.kv_cache_dtype or "auto",
        quantization=_quantization(config, options),
        max_num_batched_tokens=options.max_num_batched_tokens or 0,
        disable_custom_all_reduce=options.disable_custom_all_reduce,
        **_multimodal_settings(config, options),
    )


def _multimodal_settings(config: HFConfig, options: ModelPlanOptions) -> dict[str, Any]:
    """The multimodal flags as the plugin reports them: only for a model with a vision
    tower (vLLM keeps no multimodal config for a text-only model, whose flags change
    nothing)."""
    if config.sub("vision_config") is None:
        return {}
    multimodal = options.multimodal
    return {
        "skip_mm_profiling": multimodal.skip_mm_profiling,
        "limit_mm_per_prompt": mm_limits_text(dict(multimodal.limit_mm_per_prompt)),
        "language_model_only": multimodal.language_model_only,
    }


def memory_source(
    config: HFConfig, options: ModelPlanOptions, gpu: GpuModel | None, ask: Ask | None
) -> MemorySource:
    """The fleet's answer for this configuration, or why the plan is estimated."""
    if options.non_kv_bytes is not None:
        return MemorySource(None, reason="--non-kv-bytes given")
    if options.kv_cache_memory_bytes is not None:
        return MemorySource(None, reason="--kv-cache-memory-bytes sets the KV size")
    if ask is None:
        return MemorySource(None, reason="no fleet asked: --target HOST:PORT asks a kvplan server")
    if gpu is None or not _catalog_gpu(gpu.name):
        return MemorySource(None, reason="the GPU is given as a size, not by a catalog name")
    releases = (options.engine_version,) if options.engine_version else RELEASES
    for release in releases:
        try:
            answer = ask(fingerprint(config, options, gpu, release))
        except PlannerError as error:  # e.g. a server without GetMeasurements
            return MemorySource(
                None, reason=f"the fleet could not be asked: {error.code_name}: {error.details}"
            )
        figures = fleet_figures(answer.engines)
        if figures is not None:
            return MemorySource(figures, release, answer.config_key)
    key = config_key(fingerprint(config, options, gpu, releases[0]))
    return MemorySource(
        None, reason=f"no engine of this configuration ({key}, {', '.join(releases)}) reported"
    )


def _catalog_gpu(name: str) -> bool:
    try:
        lookup_gpu(name)
    except UnknownGpu:
        return False
    return True


def measured_options(options: ModelPlanOptions, source: MemorySource) -> ModelPlanOptions:
    """`options` planned with the measured non-KV memory and device total."""
    if source.figures is None:
        return options
    return replace(
        options,
        non_kv_bytes=source.figures.max_non_kv_bytes,
        gpu_memory_bytes=source.figures.total_bytes,
    )


def remote_ask(target: str, environ: dict[str, str]) -> Ask:
    """GetMeasurements on a kvplan server (TLS and token from `environ`'s KVPLAN_*)."""
    from kvplan.client import ChannelSecurity, PlannerClient
    from kvplan.client.targets import with_default_port

    with_default_port(target)  # a target without a port: ValueError here, not per call
    security = ChannelSecurity.from_env(environ)

    def ask(print_: service_pb2.ConfigFingerprint) -> service_pb2.GetMeasurementsResponse:
        with PlannerClient(target, security=security) as client:
            return client.get_measurements(print_)

    return ask


def with_fleet(
    rows: list[dict[str, Any]],
    config: HFConfig,
    options: ModelPlanOptions,
    gpus: Sequence[GpuModel],
    replan: Callable[[ModelPlanOptions, GpuModel, int, int | None], dict[str, Any]],
    ask: Ask | None,
) -> list[dict[str, Any]]:
    """`capacity`'s rows, each saying where its memory came from ("memory"): a row of a
    configuration the fleet measured is planned again with the measured figures
    (`replan(options, gpu, tp, max_model_len)` gives the new row)."""
    by_name = {gpu.name: gpu for gpu in gpus}
    out = []
    sources: dict[tuple[str, int], MemorySource] = {}
    for row in rows:
        gpu = by_name[row["gpu"]]
        step = replace(options, tensor_parallel_size=row["tp"])
        where = (gpu.name, row["tp"])
        if where not in sources:
            sources[where] = memory_source(config, step, gpu, ask)
        source = sources[where]
        if source.figures is not None and row.get("status") != "error":
            measured_gpu = replace(gpu, total_memory_bytes=source.figures.total_bytes)
            length = row.get("requested_max_model_len", options.max_model_len)
            row = replan(measured_options(step, source), measured_gpu, row["tp"], length)
        out.append({**row, "memory": source.label()})
    return out
