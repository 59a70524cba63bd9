"""What the plugin sends kvplan for a vLLM engine, and how it compares the answers.

Pure functions over vLLM's objects (read by attribute, never imported) and
kvplan's messages: `plan_request` builds the PlanRequest, `compare` sets vLLM's
groups, draft flags and block count beside kvplan's, `draft_flag_fix` decides
what draft-flags mode changes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplan.client.vllm_plugin.specs import STORAGE_DTYPES, cache_dtype, dtype_name, to_layer_spec
from kvplan.client.vllm_plugin.specs import UnsupportedSpec as UnsupportedSpec
from kvplan.v1 import plan_pb2

GIB = 1 << 30

# vLLM's speculative method names are the enum's value names, lower-cased.
SPEC_METHODS: dict[str, int] = {
    name.removeprefix("SPEC_DECODE_METHOD_").lower(): number
    for name, number in plan_pb2.SpecDecodeMethod.items()
    if number != plan_pb2.SPEC_DECODE_METHOD_NONE
}
FLAG_ALL_WARNINGS = (
    plan_pb2.WARNING_CODE_NO_DRAFT_GROUP_MAMBA,
    plan_pb2.WARNING_CODE_NO_DRAFT_GROUP,
)


@dataclass(frozen=True)
class WorkerDevice:
    """What a worker reports about its device (lease mode)."""

    uuid: str
    total_memory_bytes: int = 0
    requested_memory_bytes: int = 0  # vLLM's request: ceil(total × utilization)
    weights_bytes: int = 0


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def engine_options(vllm_config: Any, engine_version: str) -> plan_pb2.EngineOptions:
    """The engine-wide options kvplan plans with, read from vLLM's config as it
    stands when planning starts (before auto-fit changes max_model_len)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    options = plan_pb2.EngineOptions(engine_version=engine_version)
    if getattr(model, "original_max_model_len", None) == -1:
        options.max_model_len = -1
        options.derived_max_model_len = int(model.max_model_len)
    else:
        options.max_model_len = int(model.max_model_len)
    if isinstance(getattr(cache, "block_size", None), int):
        options.block_size = cache.block_size
    # Every layer carries its own storage dtype; the engine's only fills gaps.
    with contextlib.suppress(UnsupportedSpec):
        options.cache_dtype = cache_dtype(getattr(cache, "cache_dtype", "auto"))  # type: ignore[assignment]
    model_dtype = STORAGE_DTYPES.get(dtype_name(getattr(model, "dtype", "")))
    if model_dtype is not None:
        options.model_dtype = model_dtype  # type: ignore[assignment]
    options.disable_hybrid_kv_cache_manager = bool(
        getattr(scheduler, "disable_hybrid_kv_cache_manager", False)
    )
    override = _int(getattr(cache, "num_gpu_blocks_override", None))
    if override is not None:
        options.num_gpu_blocks_override = override
    # 0.34 settles its extensible KV cache before planning: off with KV cache bytes
    # or a block override given, off CUDA, behind some KV connectors. The release's
    # default would be wrong for those engines; older releases have no such field,
    # nor has kvplan's own rule set (draft-flags mode, which reads only the flags).
    extensible = getattr(cache, "enable_extensible_kv_cache", None)
    if isinstance(extensible, bool) and engine_version:
        options.extensible_kv_cache = extensible
    options.max_num_batched_tokens = int(getattr(scheduler, "max_num_batched_tokens", 0) or 0)
    options.async_scheduling = bool(getattr(scheduler, "async_scheduling", False))
    # The engine's settled runner (0.32 / 0.33; it saw Triton and the environment).
    # 0.34 has only V2 and no such attribute: left unset.
    runner = getattr(vllm_config, "use_v2_model_runner", None)
    if isinstance(runner, bool):
        options.use_v2_model_runner = runner
    options.parallel.tensor_parallel_size = int(parallel.tensor_parallel_size)
    options.parallel.pipeline_parallel_size = int(parallel.pipeline_parallel_size)
    options.parallel.decode_context_parallel_size = int(
        getattr(parallel, "decode_context_parallel_size", 1) or 1
    )
    layout = getattr(cache, "kv_cache_layout", None)
    if layout is not None:  # resolved by the engine core before planning
        options.layout = layout_value(str(getattr(layout, "name", layout)).rsplit(".", 1)[-1])
    if getattr(cache, "mamba_cache_mode", "none") == "align":
        options.mamba_cache_mode = plan_pb2.MAMBA_CACHE_MODE_ALIGN
    elif getattr(cache, "mamba_cache_mode", "none") not in ("none", None):
        raise UnsupportedSpec(f"mamba_cache_mode {cache.mamba_cache_mode!r}")
    encoder_tokens = getattr(scheduler, "max_num_encoder_input_tokens", None)
    if encoder_tokens:
        options.max_num_encoder_input_tokens = int(encoder_tokens)
    options.enable_prefix_caching = bool(getattr(cache, "enable_prefix_caching", True))
    unit = _int(getattr(cache, "prefix_match_unit", None))
    if unit is not None:
        options.prefix_match_unit = unit
    if getattr(cache, "enable_mamba_shared_prefix_checkpoint", False):
        options.enable_mamba_shared_prefix_checkpoint = True
    return options


def layout_value(name: str) -> plan_pb2.KVCacheLayout.ValueType:
    """A vLLM layout name (or its legacy alias) as kvplan's enum value."""
    name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(name, name)
    try:
        return plan_pb2.KVCacheLayout.Value(f"KV_CACHE_LAYOUT_{name}")
    except ValueError as error:
        raise UnsupportedSpec(f"KV cache layout {name!r} has no kvplan KVCacheLayout") from error


def spec_decode(vllm_config: Any) -> plan_pb2.SpecDecodeConfig:
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return plan_pb2.SpecDecodeConfig()
    method = str(spec.method)
    # vLLM's ngram proposer on the GPU: no drafter layers, no KV cache of its own.
    method = {"ngram_gpu": "ngram"}.get(method, method)
    if method not in SPEC_METHODS:
        raise UnsupportedSpec(f"speculative method {method!r} has no kvplan SpecDecodeMethod")
    out = plan_pb2.SpecDecodeConfig(
        method=SPEC_METHODS[method],  # type: ignore[arg-type]
        num_speculative_tokens=int(spec.num_speculative_tokens or 0),
        disable_eagle_block_drop=bool(getattr(spec, "disable_eagle_block_drop", False)),
    )
    target = getattr(spec, "target_model_config", None)
    target_type = getattr(getattr(target, "hf_config", None), "model_type", None)
    if target_type:
        out.target_model_type = str(target_type)
    draft = getattr(spec, "draft_model_config", None)
    n_predict = getattr(getattr(draft, "hf_config", None), "num_nextn_predict_layers", None)
    if isinstance(n_predict, int):
        out.num_nextn_predict_layers = n_predict
    # 0.34 deprecated the field (None unless given); 0.32 / 0.33 settle it.
    parallel_drafting = getattr(spec, "parallel_drafting", None)
    if isinstance(parallel_drafting, bool):
        out.parallel_drafting = parallel_drafting
    return out


def engine_utilization(cache_config: Any) -> float:
    """The utilization vLLM applies: 0.34 leaves `gpu_memory_utilization` unset and
    resolves it by sizing mode (1.0 with the extensible KV cache)."""
    resolved = getattr(cache_config, "resolved_gpu_memory_utilization", None)
    value = resolved if resolved is not None else cache_config.gpu_memory_utilization
    if value is None:
        raise UnsupportedSpec("gpu_memory_utilization is unset and vLLM resolves none")
    return float(value)


def plan_request(
    vllm_config: Any,
    kv_cache_specs: Sequence[dict[str, Any]],
    available_memory: Sequence[int],
    *,
    engine_version: str,
    engine_id: str = "",
    devices: Sequence[WorkerDevice] | None = None,
    supported_layouts: Sequence[Sequence[str]] | None = None,
) -> plan_pb2.PlanRequest:
    """The whole engine (every worker, layers in registration order) as kvplan reads it.

    Without `devices` each worker's KV budget is what vLLM measured (explicit
    bytes): kvplan plans the same memory, and agreement is the expected answer.
    With `devices` each worker names its GPU, asks for vLLM's utilization (or
    its explicit bytes) and reports its non-KV memory, so kvplan grants a lease
    for the worker's whole footprint. `supported_layouts`: each worker's list
    (`get_supported_kv_cache_layouts`), which the engine core resolved the layout
    from; kvplan then checks the resolved layout against them.
    """
    request = plan_pb2.PlanRequest(
        engine_id=engine_id,
        options=engine_options(vllm_config, engine_version),
        spec_decode=spec_decode(vllm_config),
    )  # engine mode: every worker in one request (world_size stays 0)
    cache = vllm_config.cache_config
    for rank, (specs, available) in enumerate(zip(kv_cache_specs, available_memory, strict=True)):
        worker = request.workers.add(rank=rank)
        worker.layers.extend(to_layer_spec(name, spec) for name, spec in specs.items())
        if supported_layouts is not None:
            worker.supported_layouts.extend(layout_value(n) for n in supported_layouts[rank])
        if devices is None:
            worker.memory.kv_cache_memory_bytes = int(available)
            continue
        device = devices[rank]
        worker.device.uuid = device.uuid
        explicit = getattr(cache, "kv_cache_memory_bytes", None)
        if explicit:
            worker.memory.kv_cache_memory_bytes = int(explicit)
            worker.memory.non_kv.weights_bytes = device.weights_bytes
        else:
            worker.memory.gpu_memory_utilization = engine_utilization(cache)
            # vLLM measured available = requested - non-KV; kvplan recomputes
            # requested from the device's total, so hand it the non-KV part.
            non_kv = max(0, device.requested_memory_bytes - int(available))
            weights = min(device.weights_bytes, non_kv)
            worker.memory.non_kv.weights_bytes = weights
            worker.memory.non_kv.activation_peak_bytes = non_kv - weights
    return request


# --- comparison ------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupView:
    layers: tuple[str, ...]
    is_draft: bool
    rule: str = ""  # kvplan's DraftRule for a flagged group


@dataclass
class Comparison:
    vllm_groups: list[GroupView]
    kvplan_groups: list[GroupView]
    vllm_num_blocks: int | None
    kvplan_num_blocks: int
    plan_id: str
    rule_set: str
    warnings: list[str] = field(default_factory=list)  # kvplan's flag-all warnings

    @property
    def same_groups(self) -> bool:
        return [g.layers for g in self.vllm_groups] == [g.layers for g in self.kvplan_groups]

    @property
    def same_flags(self) -> bool:
        return self.same_groups and [g.is_draft for g in self.vllm_groups] == [
            g.is_draft for g in self.kvplan_groups
        ]

    @property
    def same_blocks(self) -> bool:
        return self.vllm_num_blocks is None or self.vllm_num_blocks == self.kvplan_num_blocks

    @property
    def agrees(self) -> bool:
        return self.same_groups and self.same_flags and self.same_blocks

    def differences(self) -> list[str]:
        out: list[str] = []
        if not self.same_groups:
            out.append(
                f"groups: vLLM {_groups_text(self.vllm_groups)} kvplan "
                f"{_groups_text(self.kvplan_groups)}"
            )
        elif not self.same_flags:
            out.append(
                f"draft flags: vLLM {_flags_text(self.vllm_groups)} kvplan "
                f"{_flags_text(self.kvplan_groups)}"
            )
        if not self.same_blocks:
            out.append(f"num_blocks: vLLM {self.vllm_num_blocks} kvplan {self.kvplan_num_blocks}")
        return out

    def summary(self) -> str:
        """The one log line observe mode writes."""
        head = "agreement" if self.agrees else "DIFFERENCE (" + "; ".join(self.differences()) + ")"
        parts = [
            f"kvplan {head}",
            f"rule set {self.rule_set or 'kvplan'}",
            f"{len(self.kvplan_groups)} groups",
            f"draft groups {_flags_text(self.kvplan_groups)}",
            f"num_blocks {self.kvplan_num_blocks}",
        ]
        parts.extend(f"warning: {w}" for w in self.warnings)
        parts.append(f"plan {self.plan_id}")
        return ", ".join(parts)


def _short(layers: tuple[str, ...]) -> str:
    if len(layers) <= 2:
        return "[" + ", ".join(layers) + "]"
    return f"[{layers[0]} .. {layers[-1]} ({len(layers)})]"


def _groups_text(groups: Sequence[GroupView]) -> str:
    return "[" + "; ".join(_short(g.layers) for g in groups) + "]"


def _flags_text(groups: Sequence[GroupView]) -> str:
    flagged = [
        f"{i}" + (f" ({g.rule})" if g.rule else "") for i, g in enumerate(groups) if g.is_draft
    ]
    return "{" + ", ".join(flagged) + "}"


def vllm_groups(global_groups: Sequence[Any]) -> list[GroupView]:
    return [
        GroupView(tuple(g.layer_names), bool(getattr(g, "is_eagle_group", False)))
        for g in global_groups
    ]


def kvplan_groups(response: plan_pb2.PlanResponse) -> list[GroupView]:
    return [
        GroupView(
            tuple(g.layer_names),
            g.is_draft,
            plan_pb2.DraftRule.Name(g.draft_rule).removeprefix("DRAFT_RULE_").lower()
            if g.is_draft
            else "",
        )
        for g in response.groups
    ]


def compare(
    global_groups: Sequence[Any],
    vllm_num_blocks: int | None,
    response: plan_pb2.PlanResponse,
) -> Comparison:
    return Comparison(
        vllm_groups=vllm_groups(global_groups),
        kvplan_groups=kvplan_groups(response),
        vllm_num_blocks=vllm_num_blocks,
        kvplan_num_blocks=int(response.num_blocks),
        plan_id=response.plan_id,
        rule_set=response.rule_set,
        warnings=[w.message for w in response.diagnostics.warnings if w.code in FLAG_ALL_WARNINGS],
    )


def draft_flag_fix(global_groups: Sequence[Any], response: plan_pb2.PlanResponse) -> list[bool]:
    """kvplan's draft flags for vLLM's groups, or [] when nothing should change:
    only where the groups are the same, vLLM flagged none (or every) group, and
    kvplan flags some but not all."""
    ours = vllm_groups(global_groups)
    theirs = kvplan_groups(response)
    if [g.layers for g in ours] != [g.layers for g in theirs]:
        return []
    flagged = [g.is_draft for g in ours]
    if any(flagged) and not all(flagged):
        return []
    wanted = [g.is_draft for g in theirs]
    if not any(wanted) or all(wanted) or wanted == flagged:
        return []
    return wanted


def gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def blocks_for(bytes_: int, bytes_per_block: int) -> int:
    return math.floor(bytes_ / bytes_per_block) if bytes_per_block else 0
