"""Learning from the fleet: the fingerprint of an engine's configuration, and what
the measurements engines reported for it say.

Used by the vLLM plugin (which reports and reuses), the server (which keys and
keeps) and the CLI (which answers "measured on N engines"), so it imports only the
standard library, protobuf's stubs and kvplan.gpus (standard library too).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplan.v1 import service_pb2

# config.json keys that differ between copies of one model without changing its
# memory: who saved it, with which transformers, and the dtype (a field of its own).
VOLATILE_CONFIG_KEYS = frozenset(
    {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"}
)
# The configuration part of a fingerprint: these fields make the record's key.
KEY_FIELDS = (
    "model_config_hash",
    "engine_version",
    "gpu_name",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
    "kv_cache_dtype",
    "quantization",
)
# Start-up settings that change what vLLM measures, added to the key after the fields
# above existed: each joins the key's text only where it is set (not its default), so
# a fingerprint without them -- every record reported before, and every engine on
# vLLM's defaults -- keeps the key it had. A record reported before by an engine that
# did set one is therefore under the defaults' key (docs/capacity.md, "Learn from the
# fleet").
SETTING_FIELDS = (
    "disable_custom_all_reduce",
    "skip_mm_profiling",
    "limit_mm_per_prompt",
    "language_model_only",
)
# vLLM's item count for a modality --limit-mm-per-prompt does not name (0.32-0.34)
DEFAULT_MM_LIMIT = 999


def model_config_hash(config: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a model's config.json as read from the file, its volatile keys
    left out, keys sorted: equal for every copy of one model, whoever loads it."""
    kept = {key: value for key, value in config.items() if key not in VOLATILE_CONFIG_KEYS}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def gpu_name(name: str) -> str:
    """kvplan's catalog name for a GPU as CUDA or a person names it ("NVIDIA H100 80GB
    HBM3" and "H100" are both "H100-80GB"); a GPU the catalog lacks keeps its name,
    upper-cased with dashes ("NVIDIA L40S" -> "L40S")."""
    from kvplan.gpus import UnknownGpu, lookup_gpu

    words = name.replace("NVIDIA", " ").replace("nvidia", " ").split()
    # Longest first: "H100 80GB HBM3" -> "H100-80GB-HBM3", "H100-80GB", "H100".
    for count in range(len(words), 0, -1):
        try:
            return lookup_gpu("-".join(words[:count])).name
        except UnknownGpu:
            continue
    return "-".join(word.upper() for word in words)


def normalized(fingerprint: service_pb2.ConfigFingerprint) -> service_pb2.ConfigFingerprint:
    """The fingerprint with its names in one spelling (case, GPU aliases, dtype aliases)."""
    out = service_pb2.ConfigFingerprint()
    out.CopyFrom(fingerprint)
    out.engine_version = fingerprint.engine_version.strip().lower()
    out.gpu_name = gpu_name(fingerprint.gpu_name) if fingerprint.gpu_name.strip() else ""
    out.dtype = _DTYPE_ALIASES.get(fingerprint.dtype.strip().lower(), fingerprint.dtype.lower())
    out.kv_cache_dtype = fingerprint.kv_cache_dtype.strip().lower() or "auto"
    quantization = fingerprint.quantization.strip().lower()
    out.quantization = "" if quantization in ("none", "auto") else quantization
    out.model_config_hash = fingerprint.model_config_hash.strip().lower()
    # Custom all-reduce exists only in a TP group.
    out.disable_custom_all_reduce = fingerprint.disable_custom_all_reduce and (
        fingerprint.tensor_parallel_size > 1
    )
    if fingerprint.language_model_only:  # no tower: nothing left to profile or limit
        out.skip_mm_profiling, out.limit_mm_per_prompt = False, ""
    else:
        out.limit_mm_per_prompt = mm_limits_text(fingerprint.limit_mm_per_prompt)
    return out


def mm_limits_text(limits: str | Mapping[str, Any]) -> str:
    """--limit-mm-per-prompt in one spelling: item counts by modality (a value may be
    vLLM's {"count": N, ...} object; its size options are not kept), sorted, the default
    count left out; "" where nothing differs from vLLM's default."""
    parsed: Any = limits
    if isinstance(limits, str):
        if not limits.strip():
            return ""
        try:
            parsed = json.loads(limits)
        except json.JSONDecodeError:
            return limits.strip()  # kept as given: still a distinct key
    if not isinstance(parsed, Mapping):
        return json.dumps(parsed, sort_keys=True)
    counts: dict[str, int] = {}
    for modality, value in parsed.items():
        if isinstance(value, Mapping):
            count: Any = value.get("count", DEFAULT_MM_LIMIT)
        else:  # a count, or vLLM's own options object (its `count`)
            count = getattr(value, "count", value)
        if int(count) != DEFAULT_MM_LIMIT:
            counts[str(modality)] = int(count)
    return json.dumps(counts, sort_keys=True, separators=(",", ":")) if counts else ""


_DTYPE_ALIASES = {
    "torch.bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "torch.float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "torch.float32": "float32",
    "float": "float32",
}


def config_key(fingerprint: service_pb2.ConfigFingerprint) -> str:
    """The record's key: a digest of the configuration fields (KEY_FIELDS) of the
    normalized fingerprint, and the start-up settings (SETTING_FIELDS) that are set.
    The runtime fields are kept with each engine instead."""
    fields = normalized(fingerprint)
    text = "\n".join(f"{name}={getattr(fields, name)}" for name in KEY_FIELDS)
    for name in SETTING_FIELDS:
        if getattr(fields, name):
            text += f"\n{name}={getattr(fields, name)}"
    return "cfg-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def runtime_matches(
    engine: service_pb2.EngineMeasurement, max_num_batched_tokens: int, cuda_graphs: str
) -> bool:
    """Whether an engine ran with the asked runtime settings (0 / "": any)."""
    if max_num_batched_tokens and engine.max_num_batched_tokens != max_num_batched_tokens:
        return False
    return not cuda_graphs or engine.cuda_graphs == cuda_graphs


@dataclass(frozen=True)
class FleetFigures:
    """What the kept measurements of one configuration say, per worker."""

    engines: int
    ranks: int
    min_available_kv_bytes: int  # the smallest any rank of any engine measured
    max_available_kv_bytes: int
    max_non_kv_bytes: int  # the largest requested - available of any rank: non-KV memory
    total_bytes: int  # the device's total as CUDA reported it (the largest reported)
    runtimes: tuple[tuple[int, str], ...]  # (max_num_batched_tokens, cuda_graphs) seen
    weights_bytes: int | None  # the largest any rank reported, where reported
    activation_peak_bytes: int | None
    cuda_graph_bytes: int | None

    def describe(self) -> str:
        """One line for people: "measured on N engines: ..."."""
        spread = (
            _gib(self.min_available_kv_bytes)
            if self.min_available_kv_bytes == self.max_available_kv_bytes
            else f"{_gib(self.min_available_kv_bytes)} .. {_gib(self.max_available_kv_bytes)}"
        )
        parts = [f"available KV {spread} per worker", f"non-KV {_gib(self.max_non_kv_bytes)}"]
        for name, value in (
            ("weights", self.weights_bytes),
            ("activation peak", self.activation_peak_bytes),
            ("CUDA graphs", self.cuda_graph_bytes),
        ):
            if value is not None:
                parts.append(f"{name} {_gib(value)}")
        runs = "; ".join(
            f"max_num_batched_tokens {tokens or '?'}, cuda graphs {graphs or '?'}"
            for tokens, graphs in self.runtimes
        )
        plural = "s" if self.engines != 1 else ""
        return f"measured on {self.engines} engine{plural}: {', '.join(parts)} ({runs})"


def _gib(value: int) -> str:
    return f"{value / (1 << 30):,.2f} GiB"


def _largest(values: Sequence[int | None]) -> int | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None


def fleet_figures(engines: Sequence[service_pb2.EngineMeasurement]) -> FleetFigures | None:
    """The figures of `engines` (one configuration's), None when there are none."""
    workers = [worker for engine in engines for worker in engine.workers]
    if not workers:
        return None
    available = [worker.available_kv_bytes for worker in workers]

    def optional(name: str) -> int | None:
        return _largest([getattr(w, name) if w.HasField(name) else None for w in workers])  # type: ignore[arg-type]

    runtimes = sorted({(e.max_num_batched_tokens, e.cuda_graphs) for e in engines})
    return FleetFigures(
        engines=len(engines),
        ranks=max(len(engine.workers) for engine in engines),
        min_available_kv_bytes=min(available),
        max_available_kv_bytes=max(available),
        max_non_kv_bytes=max(w.requested_bytes - w.available_kv_bytes for w in workers),
        total_bytes=max(worker.total_bytes for worker in workers),
        runtimes=tuple(runtimes),
        weights_bytes=optional("weights_bytes"),
        activation_peak_bytes=optional("activation_peak_bytes"),
        cuda_graph_bytes=optional("cuda_graph_bytes"),
    )


__all__ = [
    "KEY_FIELDS",
    "FleetFigures",
    "config_key",
    "fleet_figures",
    "gpu_name",
    "model_config_hash",
    "normalized",
    "runtime_matches",
]
