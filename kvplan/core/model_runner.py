"""Which model runner an engine runs on, and what that runner refuses.

vLLM 0.32 / 0.33 have two model runners. `VllmConfig.use_v2_model_runner` picks one:
HiSparse forces V2; VLLM_USE_V2_MODEL_RUNNER forces either; unset, V2 is chosen
unless the engine uses something V2 lacks, and then V1. The engine's configuration
is then checked against the chosen runner, which refuses what it cannot run.
vLLM 0.34 has only V2. kvplan's `EngineOptions.use_v2_model_runner` is that
tri-state: None = the release's default.

kvplan plans off the GPU, so it cannot see whether the engine's host has Triton (V2
needs it; without it 0.32 / 0.33 fall back to V1). It assumes Triton is present, as
it is in every CUDA build of vLLM (docs/releases.md, "Model runner"); an engine
without it sends its settled runner (the vLLM plugin does).

The rules are `RuleSet` fields; this module only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplan.core.errors import InvalidRequest
from kvplan.core.rules import RuleSet

FIELD_RUNNER = "options.use_v2_model_runner"
FIELD_PARALLEL_DRAFTING = "spec_decode.parallel_drafting"


@dataclass(frozen=True)
class RunnerInputs:
    """What the runner choice and its checks read from a request."""

    asked: bool | None  # options.use_v2_model_runner; None = unset
    hisparse: bool
    method: str  # speculative method ("none" without one)
    parallel_drafting: bool  # the drafter drafts in parallel (SpecDecode.drafts_in_parallel)
    pipeline_parallel_size: int
    async_scheduling: bool


def check_parallel_drafting(rules: RuleSet, method: str, asked: bool | None) -> None:
    """SpeculativeConfig's own check of parallel_drafting (0.34: DFlash and DSpark only)."""
    allowed = rules.parallel_drafting_methods
    if not asked or allowed is None or method in allowed:
        return
    raise InvalidRequest(
        f"{rules.description} drafts in parallel only with the "
        f"{' and '.join(sorted(allowed))} methods, not {method!r}: leave "
        "parallel_drafting unset (or false), or choose one of those methods",
        field=FIELD_PARALLEL_DRAFTING,
    )


def _v2_lacks(rules: RuleSet, inputs: RunnerInputs) -> tuple[str, str] | None:
    """(what, field) of the first feature model runner V2 does not run, or None."""
    if inputs.method in rules.v2_runner_unsupported_methods:
        return f"the {inputs.method} speculative method", "spec_decode.method"
    if inputs.parallel_drafting and inputs.method not in rules.v2_runner_parallel_drafting_methods:
        return f"parallel drafting with the {inputs.method} method", FIELD_PARALLEL_DRAFTING
    return None


def _v1_lacks(rules: RuleSet, inputs: RunnerInputs) -> tuple[str, str] | None:
    """(what, field) of the first feature model runner V1 does not run, or None."""
    if rules.v1_runner_refuses_pp_async and (
        inputs.pipeline_parallel_size > 1 and inputs.async_scheduling
    ):
        return (
            f"pipeline parallelism (pipeline_parallel_size {inputs.pipeline_parallel_size}) "
            "with async scheduling",
            "options.async_scheduling",
        )
    if inputs.method in rules.v1_runner_unsupported_methods:
        return f"the {inputs.method} speculative method", "spec_decode.method"
    return None


def choose_model_runner(rules: RuleSet, inputs: RunnerInputs) -> bool:
    """True for model runner V2: the release's choice for the request
    (VllmConfig.use_v2_model_runner). HiSparse needs V2: asking for V1 with it is
    INVALID_ARGUMENT."""
    if not rules.has_v1_runner:
        return True
    if inputs.hisparse:
        if inputs.asked is False:
            raise InvalidRequest(
                f"HiSparse runs on model runner V2 only ({rules.description}): leave "
                "use_v2_model_runner unset or set it true",
                field=FIELD_RUNNER,
            )
        return True
    if inputs.asked is not None:
        return inputs.asked
    return _v2_lacks(rules, inputs) is None


def check_model_runner(rules: RuleSet, inputs: RunnerInputs, use_v2: bool) -> None:
    """The chosen runner's checks (VllmConfig's validation of it, after its other
    checks): INVALID_ARGUMENT naming the field to change."""
    if not rules.has_v1_runner:
        return
    if use_v2:
        lacking = _v2_lacks(rules, inputs)
        if lacking is not None:
            what, field = lacking
            remedy = (
                "HiSparse needs V2: change it"
                if inputs.hisparse
                else "leave use_v2_model_runner unset (V1 then runs it) or change it"
            )
            raise InvalidRequest(
                f"{rules.description}'s model runner V2 does not run {what}: {remedy}",
                field=field if inputs.asked is None else FIELD_RUNNER,
            )
        return
    lacking = _v1_lacks(rules, inputs)
    if lacking is None:
        return
    what, field = lacking
    if inputs.asked is False:
        raise InvalidRequest(
            f"{rules.description}'s model runner V1 does not run {what}: leave "
            "use_v2_model_runner unset or set it true, or change that setting",
            field=FIELD_RUNNER,
        )
    # Unset, V1 was chosen for a feature V2 lacks; the two cannot meet.
    v2_what, _ = _v2_lacks(rules, inputs) or ("", "")
    raise InvalidRequest(
        f"{rules.description} runs {v2_what} on model runner V1 only, and V1 does "
        f"not run {what}: change one of them",
        field=field,
    )
