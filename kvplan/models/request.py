"""A PlanRequest built from a model config, and the capacity answer read off the plan.

`build_plan_request` is what both the CLI (in-process planning) and the thin client
(planning on a server) use, so the two plan exactly the same request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from kvplan.gpus import UnknownGpu, lookup_gpu
from kvplan.models.block_sizes import block_size_problem, platform_of
from kvplan.models.config import HFConfig, ModelConfigError
from kvplan.models.encoder import MultimodalOptions, tower_built, vision_tower
from kvplan.models.extensible import (
    FinalSizing,
    final_sizing,
    final_sizing_note,
    utilization_warning_note,
)
from kvplan.models.importer import (
    REGISTRATIONS,
    Deployment,
    ModelLayers,
    Speculative,
    import_layers,
)
from kvplan.models.profiling import custom_all_reduce_on
from kvplan.models.weights import (
    OverheadEstimate,
    WeightEstimate,
    estimate_overhead,
    estimate_weights,
)
from kvplan.v1 import plan_pb2, spec_pb2

GIB = 1 << 30


def serve_defaults(total_memory_bytes: int | None, gpu_name: str = "") -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) `vllm serve` 0.33 picks on a CUDA / ROCm
    device of this size when none is given: 16384 / 1024 from 160 GiB, 8192 / 1024 from
    70 GiB except A100s, else 2048 / 256."""
    if total_memory_bytes is None:
        return 8192, 1024
    if total_memory_bytes >= 160 * GIB:
        return 16384, 1024
    if total_memory_bytes >= 70 * GIB and "a100" not in gpu_name.lower():
        return 8192, 1024
    return 2048, 256


@dataclass(frozen=True)
class ModelPlanOptions:
    """One deployment of a model: the CLI flags and the client helper's arguments."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's own maximum; -1: auto-fit
    gpu: str | None = None  # catalog name (resolved by the planner's name table)
    gpu_memory_bytes: int | None = None
    # None: the release's default (0.92; vLLM 0.34's extensible cache reserves at 1.0)
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"  # vLLM's --mamba-ssm-cache-dtype
    speculative: Speculative | None = None
    block_size: int | None = None
    # The block size a real engine ran with (a startup log's, `calibrate`): taken as
    # given, whatever release or platform ran it; else checked (models/block_sizes.py).
    block_size_ran: bool = False
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None  # None: vllm serve's default for the device
    non_kv_bytes: int | None = None  # measured non-KV memory per worker; None: estimate
    engine_id: str = ""
    # The engine release that runs the plan: its layer registration and its planning
    # rules (vllm-0.32, vllm-0.33, vllm-0.34; "" = kvplan's own, vLLM 0.33 registration).
    engine_version: str = ""
    # vLLM's --quantization (None: the checkpoint's own) and --dtype (auto: the config's)
    quantization: str | None = None
    dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # vLLM's --kv-cache-memory-bytes
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int | None = None  # None: vllm serve's default for the device
    # The release whose start-up profile the non-KV estimate follows ("0.19.0", "v0"
    # for the V0 engine); "" = engine_version's, else the newest (profiling.PROFILES).
    engine_release: str = ""
    # Whether FlashInfer is installed, as vLLM's wheels (from 0.11) and images have it:
    # without it vLLM <= 0.11.0's sampler sorts (`calibrate` reads the log's fallback
    # line); 0.11.1-0.16 sort either way.
    flashinfer: bool = True
    # The MoE backend a log says vLLM ran MXFP4 experts with (`calibrate`; weights.py
    # `mxfp4_moe_backend`'s names); None: the release's default for the GPU.
    mxfp4_backend: str | None = None
    # Decoder layers per pipeline stage, as vLLM's VLLM_PP_LAYER_PARTITION lists them;
    # None: vLLM's own partition.
    pp_layer_partition: tuple[int, ...] | None = None
    # vLLM's --skip-mm-profiling, --limit-mm-per-prompt and --language-model-only: the
    # encoder's part of the profile run, and whether the vision tower is loaded.
    multimodal: MultimodalOptions = field(default_factory=MultimodalOptions)
    # vLLM's --disable-custom-all-reduce (`calibrate` also sets it where the log's own
    # WARNING says vLLM turned custom all-reduce off): the non-torch figure is then
    # what one GPU leaves (profiling.py `custom_all_reduce_on`).
    disable_custom_all_reduce: bool = False
    # vLLM's model runner (True: Model Runner V2; None: the release's default for the
    # model, profiling.py `default_runner_is_v2`): whether a CUDA-graph estimate runs
    # before the cache is sized (`calibrate` takes it from the log's module names).
    use_v2_model_runner: bool | None = None
    # vLLM 0.34's --[no-]enable-extensible-kv-cache (None: the release's default, on
    # unless --kv-cache-memory-bytes or --num-gpu-blocks-override): whether the cache is
    # sized again after warm-up (`cache_sizing`).
    extensible_kv_cache: bool | None = None


@dataclass(frozen=True)
class ModelPlanInputs:
    """What the request was built from, with every estimate it contains."""

    layers: ModelLayers
    weights: WeightEstimate | None
    overhead: OverheadEstimate | None
    non_kv_bytes: int
    non_kv_given: bool
    notes: tuple[str, ...] = field(default=())
    # One estimate per pipeline stage, first to last (`overhead` is the stage with the
    # most memory outside the KV cache); empty where the non-KV memory was given.
    stage_overheads: tuple[OverheadEstimate, ...] = ()
    # vLLM 0.34's extensible cache: each pipeline stage's final size after warm-up
    # (the plan's num_blocks; the request's budget is the reservation). Empty where
    # the release sizes the cache once.
    final_sizings: tuple[FinalSizing, ...] = ()

    @property
    def limiting_sizing(self) -> FinalSizing | None:
        """The stage whose final size is the smallest, which the cache takes (None:
        sized once)."""
        return limiting_sizing(self.final_sizings)

    @property
    def final_kv_cache_bytes(self) -> int | None:
        """The smallest worker's final KV cache bytes (None: sized once)."""
        sizing = self.limiting_sizing
        return sizing.kv_cache_bytes if sizing is not None else None


def limiting_sizing(final: Sequence[FinalSizing]) -> FinalSizing | None:
    """The final sizing with the fewest KV cache bytes (None where there is none)."""
    return min(final, key=lambda sizing: sizing.kv_cache_bytes, default=None)


def parse_speculative(text: str, draft_config: HFConfig | None = None) -> Speculative:
    """`mtp:1` -> Speculative("mtp", 1); `eagle3:3` with the drafter's config."""
    method, _, tokens = text.partition(":")
    if not method or not tokens.isdigit() or int(tokens) < 1:
        raise ModelConfigError(
            f"speculative setting {text!r}: expected METHOD:TOKENS, e.g. mtp:1 or eagle3:3"
        )
    return Speculative(method.strip().lower(), int(tokens), draft_config)


def _as_loaded(config: HFConfig, multimodal: MultimodalOptions) -> HFConfig:
    """The config as vLLM builds the model: without the vision tower where every
    modality it serves has a limit of 0 (vLLM's _mark_tower_model skips building and
    loading it)."""
    if vision_tower(config, 1) is None or tower_built(config, multimodal):
        return config
    data = {key: value for key, value in config.data.items() if key != "vision_config"}
    loaded = HFConfig(data, config.path, config.source)
    loaded.defaulted = config.defaulted
    return loaded


def build_plan_request(
    config: HFConfig, options: ModelPlanOptions
) -> tuple[plan_pb2.PlanRequest, ModelPlanInputs]:
    tp = options.tensor_parallel_size
    pp = options.pipeline_parallel_size
    if pp < 1:
        raise ModelConfigError("pipeline_parallel_size must be >= 1")
    max_len_for_mamba = options.max_model_len if (options.max_model_len or 0) > 0 else None
    device_name, device_bytes = options.gpu or "", options.gpu_memory_bytes
    gpu_arch = ""  # an unlisted device (a size given): no kernel-specific padding
    pcie_only = False  # unknown: planned as NVLink-connected (the larger non-torch figure)
    gpu_sms = 0  # unknown: the sampler's row buffer at an H100's SM count
    if options.gpu:
        with contextlib.suppress(UnknownGpu):
            listed = lookup_gpu(options.gpu)
            gpu_arch, pcie_only, gpu_sms = listed.arch, listed.pcie_only, listed.sm_count
    if options.gpu and device_bytes is None:
        # The catalog's driver figure travels with the name, so a server plans with the
        # same total as the CLI (DeviceRef.total_memory_bytes wins over its name table).
        try:
            gpu = lookup_gpu(options.gpu)
        except UnknownGpu as error:
            raise ModelConfigError(str(error.args[0])) from None
        device_name, device_bytes = gpu.name, gpu.total_memory_bytes
    batched_default, max_num_seqs = serve_defaults(device_bytes, device_name)
    batched = options.max_num_batched_tokens or batched_default
    max_num_seqs = options.max_num_seqs or max_num_seqs
    if batched < max_num_seqs:  # vLLM's SchedulerConfig refuses it (0.32-0.34)
        raise ModelConfigError(
            f"max_num_batched_tokens ({batched:,}"
            f"{'' if options.max_num_batched_tokens else ', vllm serve default for this GPU'})"
            f" must be >= max_num_seqs ({max_num_seqs:,}"
            f"{'' if options.max_num_seqs else ', vllm serve default for this GPU'}), as vLLM "
            "requires: raise --max-num-batched-tokens or lower --max-num-seqs"
        )
    layers = import_layers(
        config,
        Deployment(
            tensor_parallel_size=tp,
            kv_cache_dtype=options.kv_cache_dtype,
            block_size=options.block_size,
            enable_prefix_caching=options.enable_prefix_caching,
            speculative=options.speculative,
            mamba_ssm_cache_dtype=options.mamba_ssm_cache_dtype,
            max_model_len=max_len_for_mamba,
            engine_version=options.engine_version,
            dtype=options.dtype,
        ),
    )
    if options.block_size is not None and not options.block_size_ran:
        attention = [layer for layer in layers.layers if not layer.is_state]
        problem = attention and block_size_problem(
            options.block_size,
            platform=platform_of(gpu_arch),
            mla=any(layer.kind == "mla_attention" for layer in attention),
        )
        if problem:
            raise ModelConfigError(problem)
    extensible = extensible_cache_on(options)
    extensible_flags = extensible_setting(options)  # as the flags leave it, per stage below
    weights: WeightEstimate | None = None
    overhead: OverheadEstimate | None = None
    stage_overheads: tuple[OverheadEstimate, ...] = ()
    if options.non_kv_bytes is not None:
        non_kv = plan_pb2.NonKVMemory(weights_bytes=options.non_kv_bytes)
        total_non_kv = options.non_kv_bytes
    else:
        release = options.engine_release or options.engine_version
        weights = estimate_weights(
            _as_loaded(config, options.multimodal),
            layers,
            tp,
            pp,
            gpu_arch,
            options.quantization,
            options.pp_layer_partition,
            release,
            max_num_batched_tokens=batched,
            flashinfer=options.flashinfer,
            mxfp4_backend=options.mxfp4_backend,
        )
        # Each pipeline stage profiles its own phases (only the last samples; the others
        # keep what they receive): one estimate per stage.
        stage_overheads = tuple(
            estimate_overhead(
                config, layers, tp, batched, max_num_seqs, release, options.flashinfer,
                max_model_len=options.max_model_len,  # None or -1 (auto): the model's
                pcie_only_gpu=pcie_only,
                multimodal=options.multimodal,
                disable_custom_all_reduce=options.disable_custom_all_reduce,
                gpu_arch=gpu_arch,
                pipeline_stage=stage,
                pipeline_parallel_size=pp,
                gpu_sms=gpu_sms,
                quantization=options.quantization,
                use_v2_model_runner=options.use_v2_model_runner,
                extensible_kv_cache=extensible_flags,
            )
            for stage in range(pp)
        )  # fmt: skip
        # The stage with the most memory outside the KV cache is the one that limits it.
        stage_non_kv = [
            weights.stage_bytes(stage) + stage_overheads[stage].total_bytes for stage in range(pp)
        ]
        largest = stage_non_kv.index(max(stage_non_kv))
        overhead = stage_overheads[largest]
        non_kv = plan_pb2.NonKVMemory(
            weights_bytes=weights.bytes_per_worker,
            # As vLLM 0.34 counts it: the CUDA-graph estimate with the activation peak.
            activation_peak_bytes=overhead.activation_peak_bytes + overhead.cudagraph_bytes,
            non_torch_bytes=overhead.non_torch_bytes,
        )
        total_non_kv = weights.stage_bytes(largest) + overhead.total_bytes
    max_model_len = options.max_model_len or layers.derived_max_model_len
    if max_model_len > layers.derived_max_model_len:
        raise ModelConfigError(
            f"max_model_len {max_model_len:,} exceeds the model's maximum "
            f"{layers.derived_max_model_len:,} (vLLM refuses it too)"
        )
    if layers.encoder_decoder and options.max_num_batched_tokens and batched < max_model_len:
        # vLLM turns chunked prefill off for encoder-decoder models, and its
        # SchedulerConfig then wants a whole request in one step (0.32-0.34).
        raise ModelConfigError(
            f"max_num_batched_tokens ({batched:,}) is smaller than max_model_len "
            f"({max_model_len:,}): an encoder-decoder model runs without chunked prefill in "
            "vLLM, which refuses this; raise --max-num-batched-tokens or lower --max-model-len"
        )
    request = plan_pb2.PlanRequest(engine_id=options.engine_id or layers.model_type or "model")
    opts = request.options
    opts.engine_version = options.engine_version
    opts.max_model_len = max_model_len
    opts.derived_max_model_len = layers.derived_max_model_len
    opts.block_size = layers.block_size
    opts.model_dtype = layers.model_dtype.proto  # type: ignore[assignment]
    opts.cache_dtype = spec_pb2.KVCacheDtype.Value(
        f"KV_CACHE_DTYPE_{options.kv_cache_dtype.upper()}"
    )
    opts.max_num_batched_tokens = batched
    if release_has_extensible_cache(options.engine_version) and not extensible:
        opts.extensible_kv_cache = False  # as vLLM settles it: the classic cache
    if options.num_gpu_blocks_override is not None:
        opts.num_gpu_blocks_override = options.num_gpu_blocks_override
    opts.parallel.tensor_parallel_size = tp
    if pp > 1:
        opts.parallel.pipeline_parallel_size = pp
    # vLLM turns prefix caching off for encoder-decoder models and sizes the
    # cross-attention cache by max_num_encoder_input_tokens = max_num_batched_tokens.
    opts.enable_prefix_caching = options.enable_prefix_caching and not layers.encoder_decoder
    if layers.encoder_decoder:
        opts.max_num_encoder_input_tokens = batched
    if layers.mamba_cache_mode == "align":
        opts.mamba_cache_mode = plan_pb2.MAMBA_CACHE_MODE_ALIGN
    if options.speculative is not None:
        spec = request.spec_decode
        spec.method = plan_pb2.SpecDecodeMethod.Value(
            f"SPEC_DECODE_METHOD_{options.speculative.method.upper()}"
        )
        spec.num_speculative_tokens = options.speculative.num_speculative_tokens
        spec.target_model_type = layers.model_type
        if options.speculative.method == "mtp":
            spec.num_nextn_predict_layers = max(layers.num_nextn_predict_layers, 1)
    stages = [
        layers.layer_protos(layers.stage_layers(stage, pp, options.pp_layer_partition))
        for stage in range(pp)
    ]
    final = (
        cache_sizing(options, device_bytes, gpu_arch, weights, stage_overheads, total_non_kv)
        if extensible
        else ()
    )
    for rank in range(tp * pp):
        worker = request.workers.add(rank=rank)
        worker.layers.extend(stages[rank // tp])  # ranks: TP innermost, then PP stage
        if device_name:
            worker.device.name = device_name
        if device_bytes is not None:
            worker.device.total_memory_bytes = device_bytes
        if options.kv_cache_memory_bytes is not None:
            worker.memory.kv_cache_memory_bytes = options.kv_cache_memory_bytes
        elif options.gpu_memory_utilization is not None:
            worker.memory.gpu_memory_utilization = options.gpu_memory_utilization
        worker.memory.non_kv.CopyFrom(non_kv)
        if weights is not None:  # each stage holds its own layers and embeddings
            worker.memory.non_kv.weights_bytes = weights.stage_bytes(rank // tp)
        if stage_overheads:  # and profiles its own phases
            mine = stage_overheads[rank // tp]
            worker.memory.non_kv.activation_peak_bytes = (
                mine.activation_peak_bytes + mine.cudagraph_bytes
            )
        if final:  # the planner's final plan: the blocks these bytes map
            worker.memory.measured_kv_cache_bytes = final[rank // tp].kv_cache_bytes
    inputs = ModelPlanInputs(
        layers=layers,
        weights=weights,
        overhead=overhead,
        stage_overheads=stage_overheads,
        non_kv_bytes=total_non_kv,
        non_kv_given=options.non_kv_bytes is not None,
        final_sizings=final,
        notes=layers.notes
        + _final_sizing_notes(final, options.non_kv_bytes is not None)
        + _graph_estimate_notes(
            tp > 1 and not custom_all_reduce_on(tp, pcie_only, options.disable_custom_all_reduce),
            overhead,
        )
        + _multimodal_notes(config, options, overhead is not None),
    )
    return request, inputs


def release_has_extensible_cache(engine_version: str) -> bool:
    """Whether the engine rule set has vLLM 0.34's extensible KV cache (its
    registration's flag, which mirrors `RuleSet.extensible_kv_cache`)."""
    registration = REGISTRATIONS.get(engine_version)
    return registration is not None and registration.extensible_kv_cache


def extensible_setting(options: ModelPlanOptions) -> bool | None:
    """vLLM 0.34's extensible KV cache as the flags leave it (vllm/config/vllm.py
    `_resolve_extensible_kv_cache`): False where --kv-cache-memory-bytes,
    --num-gpu-blocks-override or --no-enable-extensible-kv-cache turn it off, None for
    the release's default (on on CUDA and ROCm: every catalog GPU). Asking for it with
    a fixed size is vLLM's ValueError, and outside 0.34 kvplan's refusal."""
    fixed = (
        "--kv-cache-memory-bytes"
        if options.kv_cache_memory_bytes is not None
        else "--num-gpu-blocks-override"
        if options.num_gpu_blocks_override is not None
        else None
    )
    if options.extensible_kv_cache and not release_has_extensible_cache(options.engine_version):
        raise ModelConfigError(
            "--enable-extensible-kv-cache: only vLLM 0.34 has the extensible KV cache "
            "(--engine-version vllm-0.34)"
        )
    if options.extensible_kv_cache and fixed is not None:
        raise ModelConfigError(
            f"--enable-extensible-kv-cache: it sizes the KV cache from measured memory, "
            f"which {fixed} overrides (vLLM 0.34 refuses both)"
        )
    if fixed is not None or options.extensible_kv_cache is False:
        return False
    return None if options.extensible_kv_cache is None else True


def extensible_cache_on(options: ModelPlanOptions) -> bool:
    """Whether the plan follows vLLM 0.34's extensible cache: the 0.34 rules
    (--engine-version vllm-0.34), and the flags leave it on. (A profile release of 0.34
    under kvplan's own rules, as `calibrate` plans a 0.34 log, only drops the graph
    estimate: `graph_estimate_runs`.)"""
    setting = extensible_setting(options)
    return release_has_extensible_cache(options.engine_version) and setting is not False


def cache_sizing(
    options: ModelPlanOptions,
    device_bytes: int | None,
    gpu_arch: str,
    weights: WeightEstimate | None,
    stage_overheads: tuple[OverheadEstimate, ...],
    given_non_kv: int,
) -> tuple[FinalSizing, ...]:
    """vLLM 0.34's extensible cache: each pipeline stage's final size after warm-up
    (kvplan/models/extensible.py), from the device total, the utilization (1.0 unset)
    and the non-KV estimate of the stage: its weights, non-torch memory and captured
    CUDA graphs in use, its activation peak kept free. A given --non-kv-bytes is taken
    as everything in use outside the cache, with no transient beyond it. Empty without
    a device size (the planner refuses utilization planning then)."""
    if device_bytes is None:
        return ()
    utilization = options.gpu_memory_utilization or 1.0
    sizing = partial(
        final_sizing,
        total_bytes=device_bytes,
        utilization=utilization,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        platform=platform_of(gpu_arch),
    )
    if weights is None:
        given = sizing(non_kv_used_bytes=given_non_kv, graph_bytes=0, transient_bytes=0)
        return (given,) * options.pipeline_parallel_size
    return tuple(
        sizing(
            non_kv_used_bytes=weights.stage_bytes(stage)
            + overhead.non_torch_bytes
            + overhead.cudagraph_captured_bytes,
            graph_bytes=overhead.cudagraph_captured_bytes,
            transient_bytes=overhead.activation_peak_bytes,
        )
        for stage, overhead in enumerate(stage_overheads)
    )


def _final_sizing_notes(final: tuple[FinalSizing, ...], given: bool) -> tuple[str, ...]:
    """What the final size assumes, and vLLM 0.34's warning on a utilization just
    under 1.0 where it applies."""
    limiting = limiting_sizing(final)
    if limiting is None:
        return ()
    notes = [final_sizing_note(limiting, given)]
    if limiting.utilization_warning():
        notes.append(utilization_warning_note(limiting))
    return tuple(notes)


def _graph_estimate_notes(
    nccl_all_reduce: bool, overhead: OverheadEstimate | None
) -> tuple[str, ...]:
    """What the plan cannot vouch for in the CUDA-graph estimate it subtracts: a TP group
    without custom all-reduce (`nccl_all_reduce`), whose graphs all-reduce through NCCL.
    The estimate counts NCCL's state per captured all-reduce at a figure fitted on one
    log and checked on two more (docs/capacity.md, "The CUDA-graph estimate"); the
    figure moves with the driver and NCCL."""
    if overhead is None or not overhead.cudagraph_bytes or not nccl_all_reduce:
        return ()
    return (
        f"CUDA-graph estimate {overhead.cudagraph_bytes / GIB:.2f} GiB per worker, of which "
        f"{overhead.cudagraph_nccl_bytes / GIB:.2f} for the NCCL all-reduces the graphs "
        "capture with custom all-reduce off: 167 KiB each, fitted on 4 x L40S at TP 4 "
        "(2.73 GiB logged) and within 0.02 GiB of two RTX 3090 logs; older drivers cost "
        "more (vllm#5517: 3.3 x on A10G with CUDA 12.2 drivers against 12.4), so the KV "
        "budget may be smaller than planned (--non-kv-bytes takes a measured figure)",
    )


def _multimodal_notes(
    config: HFConfig, options: ModelPlanOptions, estimated: bool
) -> tuple[str, ...]:
    """Said where the multimodal flags or a vision tower are not modelled, rather than
    left silent."""
    multimodal = options.multimodal
    flags = multimodal != MultimodalOptions()
    if config.sub("vision_config") is None:
        if flags:
            return (
                "the model has no vision tower: --skip-mm-profiling, --limit-mm-per-prompt "
                "and --language-model-only change nothing (vLLM ignores them too)",
            )
        return ()
    if vision_tower(config, 1) is None and estimated:
        return ("vLLM also loads and profiles this model's vision tower, which kvplan does "
                "not estimate for this family (Gemma 3, Llama 4, Qwen2.5-VL, Qwen3-VL, "
                "Qwen3.5 / 3.6 only): the non-KV estimate leaves its weights and its encoder "
                "run out; --non-kv-bytes takes a measured figure",)  # fmt: skip
    return ()


def auto_fit_request(request: plan_pb2.PlanRequest) -> plan_pb2.PlanRequest:
    """The same request asking for the longest max_model_len the memory allows."""
    fitted = plan_pb2.PlanRequest()
    fitted.CopyFrom(request)
    fitted.options.max_model_len = -1
    return fitted


@dataclass(frozen=True)
class GroupCapacity:
    group_id: int
    kind: str
    layers: int
    block_size: int
    page_size_bytes: int
    per_token_bytes: int | None  # None for state (Mamba-style) groups: per request
    is_draft: bool  # a draft group: it holds at least one drafter layer
    window: int | None = None  # sliding window / attention chunk: tokens held at most
    draft_layers: int = 0  # how many of its layers are the drafter's


@dataclass(frozen=True)
class CapacitySummary:
    groups: tuple[GroupCapacity, ...]
    kv_bytes_per_token: int  # all token-proportional groups of one worker
    state_bytes_per_request: int  # all Mamba-style layers of one worker, pages it holds
    needed_per_request_bytes: int  # blocks one max_model_len request holds, all groups
    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    max_model_len: int
    # The KV cache bytes the tokens come from: the budget, or for vLLM 0.34's extensible
    # cache the final size estimated after warm-up (`ModelPlanInputs.final_sizings`).
    available_kv_bytes: int
    auto_fit_max_model_len: int | None = None
    # vLLM 0.34's extensible cache: the reservation made before warm-up (its budget,
    # "Available KV cache memory"; its blocks, the cap; its tokens at max_model_len),
    # which the final figures above stay under. None where the cache is sized once.
    reserved_kv_bytes: int | None = None
    reserved_num_blocks: int | None = None
    reserved_kv_cache_tokens: int | None = None

    @property
    def per_group_tokens(self) -> int:
        """The "GPU KV cache size" vLLM printed up to 0.20.0: num_blocks // groups x the
        smallest block; `kv_cache_tokens` is what 0.20.1 and later print
        (int(max_concurrency x max_model_len)). They differ for several KV-cache groups
        (calibrate.PRINTED_TOKEN_FORMULA says which release prints which)."""
        if not self.groups:
            return self.kv_cache_tokens
        smallest = min(group.block_size for group in self.groups)
        return self.num_blocks // len(self.groups) * smallest

    def as_dict(self) -> dict[str, Any]:
        out = {key: value for key, value in self.__dict__.items() if key != "groups"}
        out["groups"] = [group.__dict__ for group in self.groups]
        return out


def state_pages_per_request(layers: ModelLayers) -> int:
    """Pages one request holds in each Mamba-style layer (vLLM's per-mode rule)."""
    states = [layer for layer in layers.layers if layer.is_state]
    if not states:
        return 0
    fixed = 2 if layers.mamba_cache_mode == "align" else 1
    return fixed + states[0].num_speculative_blocks


def summarize(
    response: plan_pb2.PlanResponse,
    auto_fit: plan_pb2.PlanResponse | None = None,
    state_pages_per_request: int = 1,
    draft_layer_names: frozenset[str] = frozenset(),
    final_kv_bytes: int | None = None,
) -> CapacitySummary:
    """The capacity a plan gives. `final_kv_bytes`: the final size of vLLM 0.34's
    extensible cache (`ModelPlanInputs.final_kv_cache_bytes`), for a final plan."""
    groups: list[GroupCapacity] = []
    per_token = per_request = 0
    for group in response.groups:
        kind = group.spec.WhichOneof("kind") or "-"
        # A uniform-type group's page already covers all its layers; otherwise the page
        # is one layer's and every layer of the group holds its own.
        group_page = group.page_size_bytes * (1 if group.uniform_type else len(group.layer_names))
        if kind == "mamba":
            token_bytes = None
            per_request += group_page * state_pages_per_request
        else:
            token_bytes = group_page // group.block_size
            per_token += token_bytes
        window: int | None = None
        if kind == "sliding_window":
            window = group.spec.sliding_window.sliding_window
        elif kind == "chunked_local_attention":
            window = group.spec.chunked_local_attention.attention_chunk_size
        groups.append(
            GroupCapacity(
                group.group_id,
                kind,
                len(group.layer_names),
                group.block_size,
                group.page_size_bytes,
                token_bytes,
                group.is_draft,
                window,
                sum(1 for name in group.layer_names if name in draft_layer_names),
            )
        )
    worker = response.workers[0]
    # A final extensible plan: the reservation it stays under.
    final = response.plan_stage == plan_pb2.PLAN_STAGE_EXTENSIBLE_FINAL
    reserved_bytes: int | None = None
    reserved_blocks: int | None = None
    reserved_tokens: int | None = None
    if final and final_kv_bytes is not None:
        reserved_bytes = worker.budget.available_bytes
        reserved_blocks = response.reserved_num_blocks
        blocks_per_request = worker.blocks_per_request
        # vLLM's int(max concurrency x max_model_len), at the reservation's blocks.
        reserved_tokens = (
            int(reserved_blocks / blocks_per_request * response.max_model_len)
            if blocks_per_request
            else 0
        )
    return CapacitySummary(
        groups=tuple(groups),
        kv_bytes_per_token=per_token,
        state_bytes_per_request=per_request,
        needed_per_request_bytes=worker.budget.needed_per_request_bytes,
        num_blocks=response.num_blocks,
        kv_cache_tokens=worker.kv_cache_size_tokens,
        max_concurrency=worker.max_concurrency,
        max_model_len=response.max_model_len,
        available_kv_bytes=(
            final_kv_bytes
            if final and final_kv_bytes is not None
            else worker.budget.available_bytes
        ),
        auto_fit_max_model_len=auto_fit.max_model_len if auto_fit is not None else None,
        reserved_kv_bytes=reserved_bytes,
        reserved_num_blocks=reserved_blocks,
        reserved_kv_cache_tokens=reserved_tokens,
    )


def with_tp(options: ModelPlanOptions, tp: int) -> ModelPlanOptions:
    return replace(options, tensor_parallel_size=tp)


def mamba_layer_count(layers: ModelLayers) -> int:
    return sum(1 for layer in layers.layers if layer.is_state)
