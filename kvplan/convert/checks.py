"""Request validation beyond field ranges: the per-release field rules (a field one
engine release does not have) and the engine configurations a release refuses, each
error naming the request's field path."""

from __future__ import annotations

from typing import Any

from kvplan.core.errors import InvalidRequest
from kvplan.core.request import (
    EAGLE_FAMILY,
    EngineOptions,
    SpecDecode,
)
from kvplan.core.rules import (
    FIELD_EXTENSIBLE_KV_CACHE,
    FIELD_IS_DRAFT,
    FIELD_KV_HEAD_MAJOR_SLOTS,
    FIELD_MEASURED_KV_BYTES,
    FIELD_STATE_ALIGNMENT,
    FIELD_SW_MLA_SPEC_MARKER,
    FIELD_TOPK_BUFFER_WIDTH,
    AsyncDraftCheck,
    RuleSet,
    versions_with_spec_method,
)
from kvplan.v1 import plan_pb2, spec_pb2


def _enum_suffix(enum_type: Any, value: int, prefix: str) -> str:
    return str(enum_type.Name(value)).removeprefix(prefix).lower()


def _require(value: int, path: str, what: str) -> int:
    if value <= 0:
        raise InvalidRequest(f"{what} must be >= 1", field=path)
    return value


def _release_fields_set(layer: spec_pb2.LayerSpec, kind: str, body: Any) -> list[tuple[str, str]]:
    """(rule-set field name, path suffix) of the release-specific fields `layer` sets."""
    found: list[tuple[str, str]] = []
    if layer.is_draft:
        found.append((FIELD_IS_DRAFT, "is_draft"))
    if kind in ("mla_attention", "hidden_state_cache") and body.mla.HasField("topk_buffer_width"):
        found.append((FIELD_TOPK_BUFFER_WIDTH, f"{kind}.mla.topk_buffer_width"))
    if kind not in ("mamba", "hisparse_hot", "hisparse_resident") and (
        body.attention.kv_head_major_slots
    ):
        found.append((FIELD_KV_HEAD_MAJOR_SLOTS, f"{kind}.attention.kv_head_major_slots"))
    if kind == "sliding_window_mla" and body.non_causal_multi_token_decode:
        found.append((FIELD_SW_MLA_SPEC_MARKER, f"{kind}.non_causal_multi_token_decode"))
    if kind == "mamba" and body.HasField("state_alignment_bytes"):
        found.append((FIELD_STATE_ALIGNMENT, f"{kind}.state_alignment_bytes"))
    return found


def _check_engine_configuration(options: plan_pb2.EngineOptions, rules: RuleSet) -> None:
    """What vLLM's engine configuration refuses before any worker starts (its
    ParallelConfig and VllmConfig checks; docs/semantics.md, "Engine options")."""
    parallel = options.parallel
    tp = parallel.tensor_parallel_size or 1
    dcp = parallel.decode_context_parallel_size or 1
    # ParallelConfig refuses it in every release (no prefill context parallelism here).
    if tp % dcp:
        raise InvalidRequest(
            f"decode_context_parallel_size {dcp} does not divide tensor_parallel_size "
            f"{tp}: DCP shards the KV cache over the TP ranks",
            field="options.parallel.decode_context_parallel_size",
        )
    if (
        rules.nvfp4_ds_mla_refuses_dcp
        and dcp > 1
        and options.cache_dtype == spec_pb2.KV_CACHE_DTYPE_NVFP4_DS_MLA
    ):
        raise InvalidRequest(
            f"{rules.description} does not run the nvfp4_ds_mla KV cache with decode "
            "context parallelism: choose another cache_dtype or decode_context_parallel_size 1",
            field="options.cache_dtype",
        )
    if options.HasField("hisparse"):
        for size, name in (
            (parallel.pipeline_parallel_size or 1, "pipeline_parallel_size"),
            (dcp, "decode_context_parallel_size"),
        ):
            if size > 1:
                raise InvalidRequest(
                    f"HiSparse does not run with {name} {size} (vLLM refuses the "
                    "engine's configuration)",
                    field=f"options.parallel.{name}",
                )
        if options.disable_hybrid_kv_cache_manager:
            raise InvalidRequest(
                "HiSparse needs the hybrid KV cache manager: "
                "disable_hybrid_kv_cache_manager must be false",
                field="options.disable_hybrid_kv_cache_manager",
            )


def _check_hybrid_manager(
    options: plan_pb2.EngineOptions, spec_decode: SpecDecode, kinds: set[str | None]
) -> None:
    """vLLM (0.32-0.34) turns the hybrid KV cache manager off for a model with chunked
    local attention whose drafter reads its hidden states (the EAGLE family: vLLM's
    use_eagle(), and 0.34's uses_target_hidden_states for the same methods), and
    refuses an engine that asks for it on: no such engine runs with the manager on.
    `kinds`: the target's layer kinds (`_target_kinds`)."""
    if options.disable_hybrid_kv_cache_manager or not spec_decode.uses_eagle:
        return
    if "chunked_local_attention" in kinds:
        raise InvalidRequest(
            "vLLM runs chunked local attention with a drafter that reads the target's "
            f"hidden states ({spec_decode.method}) only with the hybrid KV cache manager "
            "off: set disable_hybrid_kv_cache_manager",
            field="options.disable_hybrid_kv_cache_manager",
        )


# Drafters async scheduling overlaps: the EAGLE family, the draft model and vLLM's
# GPU n-gram, which the vLLM plugin sends as ngram too (so ngram is not refused).
_ASYNC_DRAFTERS = EAGLE_FAMILY | {"draft_model", "ngram"}


# The target model type whose checkpoints carry DSpark stages, not MTP modules.
_DSPARK_ONLY_TARGET = "deepseek_v41"


def _check_spec_decode(
    spec_decode: SpecDecode, options: EngineOptions, rules: RuleSet, *, nextn_given: bool
) -> None:
    """What vLLM's SpeculativeConfig and VllmConfig refuse of the speculative settings
    before any worker starts (docs/semantics.md, "Engine options"). `nextn_given`:
    whether the request set num_nextn_predict_layers (unset, vLLM reads no module
    count and checks none)."""
    method = spec_decode.method
    if method == "none":
        return
    tokens = spec_decode.num_speculative_tokens
    if tokens < 1:
        raise InvalidRequest(
            f"speculative method {method!r} drafts at least one token: set "
            "num_speculative_tokens to 1 or more (or the method to NONE)",
            field="spec_decode.num_speculative_tokens",
        )
    if method == "mtp":
        if spec_decode.target_model_type == _DSPARK_ONLY_TARGET:
            raise InvalidRequest(
                f"a {_DSPARK_ONLY_TARGET} target has no MTP drafter (its checkpoints carry "
                "DSpark stages): use method DSPARK",
                field="spec_decode.method",
            )
        modules = spec_decode.num_nextn_predict_layers
        if nextn_given and modules < 1:
            raise InvalidRequest(
                "an MTP drafter has at least one module: set num_nextn_predict_layers "
                "to 1 or more, or leave it unset",
                field="spec_decode.num_nextn_predict_layers",
            )
        if nextn_given and tokens > modules and tokens % modules:
            raise InvalidRequest(
                f"num_speculative_tokens {tokens} is more than the drafter's {modules} MTP "
                f"modules and not a multiple of them (the modules are reused in whole "
                f"rounds): use at most {modules}, or a multiple of {modules}",
                field="spec_decode.num_speculative_tokens",
            )
    slots = spec_decode.batch_slots_for_drafting(rules)
    if options.max_num_batched_tokens <= slots:
        raise InvalidRequest(
            f"max_num_batched_tokens {options.max_num_batched_tokens} leaves no token to "
            f"schedule: the {method} drafter takes {slots} of each step's tokens per "
            f"request in {rules.description}; raise it above {slots} or lower "
            "num_speculative_tokens",
            field="options.max_num_batched_tokens",
        )
    if options.async_scheduling and method not in _ASYNC_DRAFTERS:
        v2_runner = options.use_v2_model_runner
        check = rules.async_draft_check
        if check is AsyncDraftCheck.ANY_RUNNER or (
            check is AsyncDraftCheck.V1_RUNNER and not v2_runner
        ):
            runner = " on the V1 model runner" if check is AsyncDraftCheck.V1_RUNNER else ""
            raise InvalidRequest(
                f"{rules.description} does not run async scheduling with the {method} "
                f"drafter{runner}: turn async_scheduling off"
                + (" or use the V2 model runner" if runner else ""),
                field="options.async_scheduling",
            )


def _extensible_kv_cache(message: plan_pb2.PlanRequest, rules: RuleSet) -> bool:
    """The extensible KV cache as vLLM 0.34 settles it before planning: sized from
    measured memory, it cannot run with a block override. Unset, it is off then;
    asked for, the engine is refused. (vLLM's kv_cache_memory_bytes turns it off
    too, but a worker's KV bytes here may be the budget an engine measured, as the
    vLLM plugin sends it with the engine's settled value.)"""
    options = message.options
    if options.HasField("extensible_kv_cache"):
        if options.extensible_kv_cache and options.HasField("num_gpu_blocks_override"):
            raise InvalidRequest(
                "the extensible KV cache is sized from measured memory, which "
                "options.num_gpu_blocks_override overrides (vLLM refuses the engine): "
                "drop options.extensible_kv_cache or the override",
                field="options.extensible_kv_cache",
            )
        return options.extensible_kv_cache
    return rules.extensible_kv_cache and not options.HasField("num_gpu_blocks_override")


def _check_release_request_fields(message: plan_pb2.PlanRequest, rules: RuleSet) -> bool:
    """Engine- and worker-level fields only some releases have; measured KV bytes
    belong to an extensible cache and are given by every worker or none. Returns
    whether the extensible cache is on (settled)."""
    options = message.options
    method = (
        _enum_suffix(plan_pb2.SpecDecodeMethod, message.spec_decode.method, "SPEC_DECODE_METHOD_")
        if rules.unsupported_spec_methods
        else ""
    )
    if method in rules.unsupported_spec_methods:
        raise InvalidRequest(
            f"speculative method {method!r} does not exist in {rules.description}; choose "
            f"another method, or an engine_version that has it "
            f"({', '.join(repr(v) for v in versions_with_spec_method(method))})",
            field="spec_decode.method",
        )
    if options.HasField("extensible_kv_cache") and not rules.has_field(FIELD_EXTENSIBLE_KV_CACHE):
        raise rules.unsupported_field(FIELD_EXTENSIBLE_KV_CACHE, "options.extensible_kv_cache")
    extensible = _extensible_kv_cache(message, rules)
    measured = [w.memory.HasField("measured_kv_cache_bytes") for w in message.workers]
    for index, worker in enumerate(message.workers):
        memory = worker.memory
        for name in ("measured_kv_cache_bytes", "allocation_granule_bytes"):
            if not memory.HasField(name):
                continue
            path = f"workers[{index}].memory.{name}"
            if not rules.has_field(FIELD_MEASURED_KV_BYTES):
                raise rules.unsupported_field(FIELD_MEASURED_KV_BYTES, path)
            if not extensible:
                raise InvalidRequest(
                    f"{name} applies to the extensible KV cache, which is off for this "
                    "request (options.extensible_kv_cache false, or a block override)",
                    field=path,
                )
        if memory.HasField("allocation_granule_bytes"):
            _require(
                memory.allocation_granule_bytes,
                f"workers[{index}].memory.allocation_granule_bytes",
                "allocation_granule_bytes",
            )
    if any(measured) and not all(measured):
        index = measured.index(False)
        raise InvalidRequest(
            "the final extensible plan needs measured_kv_cache_bytes from every worker "
            "(or from none, for the reservation)",
            field=f"workers[{index}].memory.measured_kv_cache_bytes",
        )
    return extensible
