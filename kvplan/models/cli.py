"""`kvplan plan --model ...` and `kvplan capacity ...`: capacity answers from a config."""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvplan.gpus import CATALOG, GpuModel, UnknownGpu, lookup_gpu
from kvplan.models.chart import (
    ChartUnavailable,
    apply_prices,
    check_chart_path,
    model_title,
    parse_price,
    write_chart,
)
from kvplan.models.config import HFConfig, ModelConfigError, load_config
from kvplan.models.encoder import MultimodalOptions, parse_limit_mm_per_prompt
from kvplan.models.fit import TP_CANDIDATES, catalog_name, explain_no_fit, name_gpus
from kvplan.models.importer import Speculative, import_layers
from kvplan.models.request import (
    CapacitySummary,
    ModelPlanInputs,
    ModelPlanOptions,
    auto_fit_request,
    build_plan_request,
    parse_speculative,
    state_pages_per_request,
    summarize,
)
from kvplan.v1 import plan_pb2, service_pb2

if TYPE_CHECKING:
    from kvplan.models.calibrate import Comparison, StartupLog
    from kvplan.models.weights import OverheadEstimate

GIB = 1 << 30
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "tib": 1 << 40,
}  # fmt: skip
# vLLM's human-readable integers (vllm.utils.argparse_utils.human_readable_int, used by
# --max-model-len, --max-num-batched-tokens, --kv-cache-memory-bytes): a lower-case
# suffix is decimal, an upper-case one binary: 32k = 32,000 and 32K = 32,768.
_VLLM_SUFFIXES = {
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from `80GiB`, `80GB`, `81559MiB`, `1.5e9`, a plain integer, or vLLM's
    one-letter suffixes (`20G` = 20 GiB, `20g` = 20 x 10^9)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    suffix = match.group(2) if match else ""
    factor = _VLLM_SUFFIXES.get(suffix) or _UNITS.get(suffix.lower())
    if match is None or factor is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GiB, 81559MiB, 24GB)")
    try:
        value = float(match.group(1)) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return int(value)


def parse_tokens(text: str) -> int:
    """Tokens as vLLM reads them: `32768`, `32K` (= 32,768), `32k` (= 32,000), `1M`,
    `25.6k`; `-1` or `auto` asks for auto-fit."""
    cleaned = text.strip()
    if cleaned.lower() in ("auto", "-1"):
        return -1
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)", cleaned)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a token count: {text!r} (e.g. 32768, 32K = 32,768, 32k = 32,000, auto)"
        )
    value = int(float(match.group(1)) * _VLLM_SUFFIXES.get(match.group(2), 1))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def parse_fraction(text: str) -> float:
    """`0.9` or `90%`."""
    cleaned = text.strip()
    try:
        value = float(cleaned[:-1]) / 100 if cleaned.endswith("%") else float(cleaned)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction: {text!r} (e.g. 0.9 or 90%)") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return value


def parse_batch_tokens(text: str) -> int:
    """--max-num-batched-tokens as vLLM reads it (`8192`, `8K`, `8k`): no `auto`."""
    if text.strip().lower() in ("auto", "-1"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: vLLM takes a token count here (e.g. 8192, 8K, 16K); leave the flag "
            "out for vllm serve's default for the GPU"
        )
    return parse_tokens(text)


def parse_tp_list(text: str) -> list[int]:
    """`capacity --tensor-parallel-size 1,2,4,8`: the sizes to sweep, each >= 1."""
    try:
        sizes = [_count(part.strip()) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError as error:
        raise ModelConfigError(f"--tensor-parallel-size {text!r}: {error}") from None
    if not sizes:
        raise ModelConfigError(f"--tensor-parallel-size {text!r}: expected sizes, e.g. 1,2,4,8")
    return sizes


def parse_token_list(text: str) -> list[int]:
    """`8K,32K,auto`: one or more lengths to sweep."""
    values = [parse_tokens(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no length in {text!r} (e.g. 8K,32K,128K)")
    return values


def _layer_partition(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma list of layer counts: {text!r} (e.g. 17,15)"
        ) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


# Options of a model deployment, by argparse dest: a request file states all of them
# itself, so `plan FILE` refuses each one given beside it (nothing silently ignored).
MODEL_ONLY_OPTIONS = {
    "tp": "--tensor-parallel-size",
    "pp": "--pipeline-parallel-size",
    "pp_layer_partition": "--pp-layer-partition",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "kv_cache_dtype": "--kv-cache-dtype",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "num_gpu_blocks_override": "--num-gpu-blocks-override",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "mamba_ssm_cache_dtype": "--mamba-ssm-cache-dtype",
    "speculative": "--speculative",
    "speculative_config": "--speculative-config",
    "draft_model": "--draft-model",
    "quantization": "--quantization",
    "dtype": "--dtype",
    "enable_prefix_caching": "--enable-prefix-caching / --disable-prefix-caching",
    "block_size": "--block-size",
    "non_kv_bytes": "--non-kv-bytes",
    "skip_mm_profiling": "--skip-mm-profiling",
    "limit_mm_per_prompt": "--limit-mm-per-prompt",
    "language_model_only": "--language-model-only",
    "disable_custom_all_reduce": "--disable-custom-all-reduce",
    "enable_extensible_kv_cache": "--enable-extensible-kv-cache / --no-enable-extensible-kv-cache",
}


def add_model_options(parser: argparse.ArgumentParser, *, sweep: bool) -> None:
    """A model deployment in vLLM's flag names (`vllm serve --help`); kvplan's earlier
    short forms (--tp, --pp, --speculative, --no-prefix-caching) stay as aliases."""
    parser.add_argument(
        "--model",
        required=sweep,
        help="config.json, a model directory, or a model id in the local HF cache (offline)",
    )
    if sweep:
        parser.add_argument(
            "--gpu", required=True, help="comma-separated catalog names or sizes (96GiB)"
        )
        parser.add_argument(
            "--engine-version",
            help="the engine release that will run the model: vllm-0.32, vllm-0.33, "
            "vllm-0.34, or '' for kvplan's own rules (vLLM 0.33's registration)",
        )
        parser.add_argument(
            "--tensor-parallel-size", "-tp", "--tp", dest="tp", default="1,2,4,8",
            help="comma-separated TP sizes to sweep (default %(default)s)",
        )  # fmt: skip
        parser.add_argument(
            "--max-model-len",
            type=parse_token_list,
            help="tokens per request, one or a comma-separated sweep (8K,32K,128K; auto; "
            "as vLLM reads them, 32K = 32,768 and 32k = 32,000); "
            "default: the model's own maximum",
        )
    else:
        parser.add_argument(
            "--tensor-parallel-size", "-tp", "--tp", dest="tp", type=_count,
            help="tensor-parallel size (default 1)",
        )  # fmt: skip
        parser.add_argument(
            "--max-model-len",
            type=parse_tokens,
            help="tokens per request (32768, 32K = 32,768, 32k = 32,000 as vLLM reads them, "
            "auto); default: the model's own maximum",
        )
    parser.add_argument(
        "--pipeline-parallel-size", "-pp", "--pp", dest="pp", type=_count,
        help="pipeline-parallel size (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--pp-layer-partition", type=_layer_partition, metavar="N,N,...",
        help="decoder layers per pipeline stage, as vLLM's VLLM_PP_LAYER_PARTITION "
        "lists them (default: vLLM's own partition)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-memory-utilization",
        type=parse_fraction,
        help="0.9 or 90%%; default: the release's (0.92; vllm-0.34's extensible cache "
        "reserves at 1.0 and keeps what is free after warm-up)",
    )
    parser.add_argument(
        "--kv-cache-dtype", help="auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2, bfloat16"
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=parse_size,
        help="KV cache size per worker (bytes, 20GiB): vLLM then ignores the utilization",
    )
    parser.add_argument(
        "--num-gpu-blocks-override", type=_count, help="the number of KV blocks, as vLLM's"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=_count,
        help="requests per step (the sampler's share of the activation estimate); "
        "default: vllm serve's for the device",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=parse_batch_tokens,
        help="tokens per step; default: vllm serve's for the device (2K/8K/16K by memory)",
    )
    parser.add_argument(
        "--skip-mm-profiling",
        action="store_true",
        default=None,
        help="a multimodal model: vLLM skips the vision encoder's profile run, so the "
        "estimate leaves it out",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        metavar="JSON",
        help='items per prompt by modality, as vLLM takes it (\'{"image": 2, "video": 0}\'); '
        "sets how many dummy items the encoder is profiled with; 0 for every modality "
        "leaves the vision tower unloaded",
    )
    parser.add_argument(
        "--language-model-only",
        action="store_true",
        default=None,
        help="a multimodal model without its vision tower (every modality limit 0, as vLLM's)",
    )
    parser.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        default=None,
        help="vLLM's flag: the TP ranks all-reduce through NCCL only, and the non-KV "
        "estimate reserves the TP 1 non-torch figure (0.25 GiB) instead of 2.07 GiB",
    )
    parser.add_argument(
        "--enable-extensible-kv-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM 0.34's flag (default: on, unless --kv-cache-memory-bytes or "
        "--num-gpu-blocks-override): the cache is reserved at utilization 1.0 and sized "
        "again after warm-up and CUDA-graph capture, which the tokens report; --no-... "
        "sizes it once, as 0.33 does (utilization 0.92, graphs estimated beforehand)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float16", "half", "float32", "float"),
        help="model dtype (default auto: the checkpoint's)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        help="the checkpoint's quantization method (fp8, awq, gptq, mxfp4, "
        "compressed-tensors), or fp8 to quantize an unquantized checkpoint on load",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=("auto", "float32", "float16", "bfloat16"),  # vLLM's MambaDType, 0.32-0.34
        help="Mamba/GDN recurrent state dtype: auto (the model's; NemotronH float32), "
        "float32, bfloat16, float16",
    )
    parser.add_argument(
        "--speculative-config",
        "-sc",
        help='vLLM\'s JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\' or '
        '\'{"method": "eagle3", "model": "DRAFTER_DIR", "num_speculative_tokens": 3}\'',
    )
    parser.add_argument(
        "--speculative", help="short form: mtp:TOKENS, or eagle3:TOKENS / eagle:TOKENS"
    )
    parser.add_argument("--draft-model", help="with --speculative: the EAGLE drafter's config")
    parser.add_argument(
        "--block-size",
        type=_count,
        help="attention block size (tokens): a multiple of 16 on CUDA, as vLLM's attention "
        "backends take (any size for an MLA model on ROCm); default: the release's",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="prefix caching (default on; off keeps Mamba state per request only)",
    )
    parser.add_argument(
        "--disable-prefix-caching",  # vLLM 0.32-0.34 pair --enable-x with --disable-x
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_const",
        const=False,
        help="as --no-enable-prefix-caching",
    )
    parser.add_argument(
        "--non-kv-bytes",
        type=parse_size,
        help="measured non-KV memory per worker (weights + activations + runtime), e.g. 20GiB",
    )


_MTP_METHODS = ("mtp", "deepseek_mtp", "qwen3_next_mtp", "ernie_mtp", "glm4_moe_mtp")
_SPECULATIVE_KEYS = {"method", "num_speculative_tokens", "model"}


def speculative_from_config(text: str) -> Speculative:
    """vLLM's --speculative-config JSON; keys kvplan does not model are an error."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ModelConfigError(f"--speculative-config: not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ModelConfigError("--speculative-config: expected a JSON object")
    unknown = sorted(set(data) - _SPECULATIVE_KEYS)
    if unknown:
        raise ModelConfigError(
            f"--speculative-config: {', '.join(unknown)} not modelled by kvplan "
            f"(it reads {', '.join(sorted(_SPECULATIVE_KEYS))})"
        )
    method = str(data.get("method", "")).lower()
    tokens = data.get("num_speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ModelConfigError("--speculative-config: num_speculative_tokens must be >= 1")
    if method in _MTP_METHODS:
        if "model" in data:
            raise ModelConfigError("--speculative-config: MTP uses the model's own layers")
        return Speculative("mtp", tokens)
    if method in ("eagle", "eagle3"):
        if not data.get("model"):
            raise ModelConfigError(f"--speculative-config: {method} needs the drafter's model")
        return Speculative(method, tokens, load_config(str(data["model"])))
    raise ModelConfigError(
        f"--speculative-config: method {method!r} is not supported; expected one of "
        f"{', '.join((*_MTP_METHODS, 'eagle', 'eagle3'))}"
    )


def options_from_args(args: argparse.Namespace) -> ModelPlanOptions:
    if args.draft_model and not args.speculative:
        raise ModelConfigError("--draft-model needs --speculative eagle3:TOKENS (or eagle:)")
    if args.speculative and args.speculative_config:
        raise ModelConfigError("give --speculative-config or its short form --speculative")
    if args.kv_cache_memory_bytes is not None and args.gpu_memory_utilization is not None:
        raise ModelConfigError(
            "--kv-cache-memory-bytes sets the KV cache size; vLLM then ignores "
            "--gpu-memory-utilization: give one"
        )
    speculative: Speculative | None = None
    if args.speculative_config:
        speculative = speculative_from_config(args.speculative_config)
    elif args.speculative:
        draft = load_config(args.draft_model) if args.draft_model else None
        speculative = parse_speculative(args.speculative, draft)
    max_len = args.max_model_len
    return ModelPlanOptions(
        max_model_len=max_len[0] if isinstance(max_len, list) else max_len,
        pipeline_parallel_size=args.pp or 1,
        pp_layer_partition=args.pp_layer_partition,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype or "auto",
        speculative=speculative,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching is not False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        non_kv_bytes=args.non_kv_bytes,
        engine_version=args.engine_version or "",
        quantization=args.quantization,
        dtype=args.dtype or "auto",
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs,
        multimodal=MultimodalOptions(
            skip_mm_profiling=bool(args.skip_mm_profiling),
            limit_mm_per_prompt=(
                parse_limit_mm_per_prompt(args.limit_mm_per_prompt)
                if args.limit_mm_per_prompt is not None
                else {}
            ),
            language_model_only=bool(args.language_model_only),
        ),
        disable_custom_all_reduce=bool(args.disable_custom_all_reduce),
        extensible_kv_cache=args.enable_extensible_kv_cache,
    )


def _gib(value: int) -> str:
    return f"{value / GIB:,.2f} GiB"


def format_capacity(summary: CapacitySummary, inputs: ModelPlanInputs, gpu: GpuModel | None) -> str:
    layers = inputs.layers
    lines = ["", f"capacity of {layers.architecture} (model_type {layers.model_type})"]
    kinds = ", ".join(f"{count} {kind}" for kind, count in layers.kinds.items())
    lines.append(f"  layers per worker: {kinds}; block {layers.block_size} tokens")
    for note in inputs.notes:
        lines.append(f"  note: {note}")
    lines.append("  exact (from the config and the planning rules):")
    for group in summary.groups:
        draft = ""
        if group.draft_layers and group.draft_layers < group.layers:
            count = group.draft_layers
            draft = f" (draft group: {count} drafter layer{'s' if count > 1 else ''} among them)"
        elif group.is_draft:
            draft = " (draft group: the drafter's layers)"
        head = f"    group {group.group_id} {group.kind}{draft}: {group.layers} layers, "
        if group.per_token_bytes is None:
            lines.append(head + f"state page {group.page_size_bytes:,} B per layer per request")
            continue
        held = f", at most {group.window:,} tokens held" if group.window else ""
        lines.append(
            head + f"{group.per_token_bytes:,} B per token{held} "
            f"(page {group.page_size_bytes:,} B per layer / {group.block_size} tokens)"
        )
    state = (
        f" + {summary.state_bytes_per_request:,} B of state per request"
        if summary.state_bytes_per_request
        else ""
    )
    lines.append(f"    KV bytes per token, all groups: {summary.kv_bytes_per_token:,} B{state}")
    if summary.needed_per_request_bytes:
        average = summary.needed_per_request_bytes / max(summary.max_model_len, 1)
        lines.append(
            f"    one {summary.max_model_len:,}-token request holds "
            f"{summary.needed_per_request_bytes:,} B of blocks ({average:,.0f} B per token)"
        )
    what = "KV budget per worker"
    if summary.reserved_num_blocks is not None:
        what = "KV cache per worker after warm-up (vLLM 0.34's final size, estimated)"
    lines.append(
        f"    {_gib(summary.available_kv_bytes)} {what}: {summary.num_blocks:,} "
        f"blocks, {summary.kv_cache_tokens:,} tokens, max concurrency "
        f"{summary.max_concurrency:.2f}x at {summary.max_model_len:,} tokens"
    )
    if summary.reserved_num_blocks is not None and summary.reserved_kv_bytes is not None:
        lines.append(
            f'    reserved before warm-up (the cap; vLLM\'s "Available KV cache memory"): '
            f"{_gib(summary.reserved_kv_bytes)}, {summary.reserved_num_blocks:,} blocks, "
            f"{summary.reserved_kv_cache_tokens or 0:,} tokens"
        )
    if len(summary.groups) > 1:
        # calibrate is imported here only: plan --model and capacity need it for this
        # line alone. The release bounds come from the one table calibrate marks by.
        from kvplan.models.calibrate import (
            CONCURRENCY_FORMULA,
            PER_GROUP_FORMULA,
            printed_token_releases,
        )

        smallest = min(group.block_size for group in summary.groups)
        first, _ = printed_token_releases(CONCURRENCY_FORMULA)
        _, last = printed_token_releases(PER_GROUP_FORMULA)
        lines.append(
            f'    vLLM\'s "GPU KV cache size" line: {summary.kv_cache_tokens:,} tokens from '
            f"{first} (int(max concurrency x max_model_len)), {summary.per_group_tokens:,} "
            f"up to {last} (num_blocks // {len(summary.groups)} groups x {smallest})"
        )
    if summary.auto_fit_max_model_len is not None:
        lines.append(f"    auto-fit max_model_len: {summary.auto_fit_max_model_len:,} tokens")
    lines.append("  estimated (per worker):")
    lines += non_kv_lines(inputs)
    if gpu is not None:
        kind = "driver figure" if gpu.measured else "vendor capacity, not the driver's figure"
        lines.append(
            f"  device: {gpu.name} {gpu.total_memory_bytes:,} B ({kind}; source: {gpu.source})"
        )
    return "\n".join(lines)


def final_sizing_lines(inputs: ModelPlanInputs) -> list[str]:
    """vLLM 0.34's final size of an extensible cache, term by term (the limiting
    stage's)."""
    sizing = inputs.limiting_sizing
    if sizing is None:
        return []
    used = _gib(sizing.non_kv_used_bytes)
    budget = f"{_gib(sizing.requested_bytes)} requested ({sizing.utilization:g} x total) - {used}"
    device = (
        f"{_gib(sizing.init_free_bytes)} free at start (total - "
        f"{_gib(sizing.startup_reserved_bytes)} CUDA context, assumed) - {used} - "
        f"{_gib(sizing.margin_bytes)} margin"
    )
    bound = "the utilization" if sizing.bound_by_utilization else "the device"
    return [
        f"    final KV cache after warm-up (vLLM 0.34): min({budget}, {device}) - "
        f"{_gib(sizing.transient_bytes)} transient peak = {_gib(sizing.kv_cache_bytes)}, "
        f"bound by {bound}; in use: weights + non-torch + {_gib(sizing.graph_bytes)} CUDA "
        f"graphs (captured, estimated); margin = max({sizing.margin_floor_bytes / GIB:g} GiB, "
        "0.75 x transient)"
    ]


def non_kv_lines(inputs: ModelPlanInputs) -> list[str]:
    """The non-KV memory per worker: given, or the estimate with its formula."""
    if inputs.non_kv_given:
        return [
            f"    non-KV memory (given): {_gib(inputs.non_kv_bytes)}",
            *final_sizing_lines(inputs),
        ]
    assert inputs.weights is not None and inputs.overhead is not None
    weights, overhead = inputs.weights, inputs.overhead
    quantization = weights.quantization if weights.quantization != "none" else "unquantized"
    stages = ""
    if len(weights.bytes_per_stage) > 1:  # each stage's rank; the largest is shown first
        stages = "; per pipeline stage " + " / ".join(
            _gib(value) for value in weights.bytes_per_stage
        )
    lines = [
        f"    weights: {_gib(weights.bytes_per_worker)} ({weights.params.total / 1e9:,.2f}B "
        f"params, {quantization}{stages})",
        f"    activations + runtime: {_gib(overhead.total_bytes)} ({overhead.formula}); "
        "override with --non-kv-bytes",
    ]
    lines += final_sizing_lines(inputs)
    encoder = overhead.encoder
    if encoder is not None:  # what vLLM logs as "Encoder cache will be initialized ..."
        lines.append(
            f"    vision encoder profile: budget {encoder.encoder_budget:,} tokens, "
            f"{encoder.items} {encoder.modality} item(s) of {encoder.tokens_per_item:,} tokens; "
            f"its phase {_gib(encoder.encoder_phase_bytes)} (dummy inputs + forward), "
            f"{_gib(encoder.held_bytes)} held through the decoder's "
            "(--skip-mm-profiling leaves it out)"
        )
    return lines


Planner = Callable[[plan_pb2.PlanRequest], plan_pb2.PlanResponse]


def plan_model(
    config: HFConfig, options: ModelPlanOptions, planner: Planner
) -> tuple[plan_pb2.PlanResponse, CapacitySummary, ModelPlanInputs]:
    request, inputs = build_plan_request(config, options)
    return plan_built(request, inputs, planner)


def plan_built(
    request: plan_pb2.PlanRequest, inputs: ModelPlanInputs, planner: Planner
) -> tuple[plan_pb2.PlanResponse, CapacitySummary, ModelPlanInputs]:
    """Plan a request `build_plan_request` built, with its auto-fit length."""
    response = planner(request)
    fitted: plan_pb2.PlanResponse | None = None
    if request.options.max_model_len != -1:
        try:
            fitted = planner(auto_fit_request(request))
        except Exception:
            fitted = None
    check_device_holds(response, inputs)
    pages = state_pages_per_request(inputs.layers)
    drafts = frozenset(layer.name for layer in inputs.layers.layers if layer.is_draft)
    summary = summarize(response, fitted, pages, drafts, inputs.final_kv_cache_bytes)
    return response, summary, inputs


_FIXED_SIZE_MODES = {
    plan_pb2.BUDGET_MODE_EXPLICIT_BYTES: "--kv-cache-memory-bytes",
    plan_pb2.BUDGET_MODE_BLOCKS_OVERRIDE: "--num-gpu-blocks-override",
}


def check_device_holds(response: plan_pb2.PlanResponse, inputs: ModelPlanInputs) -> None:
    """A KV cache sized by --kv-cache-memory-bytes or --num-gpu-blocks-override is planned
    whatever the device holds, as vLLM's planner does; vLLM then fails allocating it.
    Refused where the KV tensors and the weights (loaded before them) alone exceed the
    device: a lower bound of what must be resident, so no estimate of the activations
    or CUDA graphs can make the refusal false."""
    for worker in response.workers:
        budget = worker.budget
        flag = _FIXED_SIZE_MODES.get(budget.mode)
        if flag is None or not budget.total_bytes:
            continue
        # Blocks x block bytes, not the tensors' sizes: a hybrid model's tensors are listed
        # once per KV cache group that shares them.
        kv = worker.num_blocks * worker.bytes_per_block
        if inputs.weights is not None:
            resident, what = inputs.weights.bytes_per_worker, "the weights (estimated)"
        else:
            resident, what = inputs.non_kv_bytes, "the non-KV memory (given)"
        if kv + resident <= budget.total_bytes:
            continue
        sized = (
            f"{worker.num_blocks:,} blocks of {worker.bytes_per_block:,} B"
            if budget.mode == plan_pb2.BUDGET_MODE_BLOCKS_OVERRIDE
            else "the size given"
        )
        room = _gib(max(budget.total_bytes - resident, 0))
        hint = (
            f"less than {room} fits beside the weights (the activations and CUDA graphs "
            "need part of it)"
            if inputs.weights is not None
            else f"at most {room} fits beside the given non-KV memory"
        )
        raise ModelConfigError(
            f"{flag}: a KV cache of {_gib(kv)} per worker ({sized}) and {what}, "
            f"{_gib(resident)}, need {_gib(kv + resident)}, more than the device's "
            f"{_gib(budget.total_bytes)}: vLLM runs out of memory allocating the KV cache; "
            f"{hint}"
        )


def gpu_or_size(text: str) -> GpuModel:
    """A catalog GPU, or a device of the given size (`96GiB`) for anything else."""
    try:
        return lookup_gpu(text)
    except UnknownGpu:
        try:
            size = parse_size(text)
        except argparse.ArgumentTypeError:
            known = ", ".join(gpu.name for gpu in CATALOG)
            raise UnknownGpu(
                f"unknown GPU {text!r}; known: {known} (or a size such as 96GiB)"
            ) from None
        return GpuModel(text.strip(), size, True, "given on the command line")


def resolve_gpu(name: str | None) -> GpuModel | None:
    """`--gpu` of `plan --model`: a catalog name or a size, like `capacity --gpu`."""
    return gpu_or_size(name) if name else None


NO_FIT = "does not fit"


def capacity_rows(
    config: HFConfig,
    options: ModelPlanOptions,
    gpus: Sequence[GpuModel],
    tps: Sequence[int],
    planner: Planner,
    progress: Callable[[int, int, str], None] | None = None,
    lengths: Sequence[int | None] = (None,),
) -> list[dict[str, Any]]:
    """One row per GPU x TP x max_model_len. A point the memory cannot hold is a row with
    status "does not fit", where its memory went and what would fit; a point the
    config refuses (heads that do not split over the TP size) has status "error"."""
    from kvplan.core.errors import PlanningError

    rows: list[dict[str, Any]] = []
    total = len(gpus) * len(tps) * len(lengths)
    for gpu in gpus:
        for tp in tps:
            for length in lengths:
                step = replace(
                    options,
                    tensor_parallel_size=tp,
                    gpu=catalog_name(gpu),
                    gpu_memory_bytes=gpu.total_memory_bytes,
                    max_model_len=length if length is not None else options.max_model_len,
                )
                row: dict[str, Any] = {"gpu": gpu.name, "tp": tp, "status": "ok"}
                if len(lengths) > 1 or step.max_model_len == -1:
                    row["requested_max_model_len"] = step.max_model_len
                inputs: ModelPlanInputs | None = None
                try:
                    request, inputs = build_plan_request(config, step)
                    # Known before planning: a point that does not fit still shows it.
                    row["non_kv_bytes_per_worker"] = inputs.non_kv_bytes
                    response, summary, inputs = plan_built(request, inputs, planner)
                    # The shortest prompt that hits when sent again (0: never).
                    row["min_cached_prefix"] = min_cached_prefix(response)
                    # The shortest shared prefix of any stored prompt that hits.
                    row["min_any_hit_prefix"] = min_any_hit_prefix(response)
                    row["rule_set"] = response.rule_set  # the planner's (a server's)
                    row.update(
                        kv_budget_bytes=summary.available_kv_bytes,
                        kv_bytes_per_token=summary.kv_bytes_per_token,
                        state_bytes_per_request=summary.state_bytes_per_request,
                        num_blocks=summary.num_blocks,
                        kv_cache_tokens=summary.kv_cache_tokens,
                        max_concurrency=round(summary.max_concurrency, 2),
                        max_model_len=summary.max_model_len,
                        auto_fit_max_model_len=summary.auto_fit_max_model_len,
                    )
                    if summary.reserved_num_blocks is not None:
                        # vLLM 0.34's extensible cache: the columns above are its final
                        # size after warm-up; the reservation before it is the cap.
                        row.update(
                            kv_sizing="final after warm-up (estimated)",
                            reserved_kv_budget_bytes=summary.reserved_kv_bytes,
                            reserved_kv_cache_tokens=summary.reserved_kv_cache_tokens,
                        )
                except PlanningError as error:
                    if error.code != "RESOURCE_EXHAUSTED":
                        row.update(status="error", error=error.message)
                    else:
                        why = explain_no_fit(config, step, gpu, inputs, planner, error.details)
                        asked = step.max_model_len
                        if asked is None and inputs is not None:
                            asked = inputs.layers.derived_max_model_len
                        row.update(
                            status=NO_FIT,
                            max_model_len="auto" if asked == -1 else asked,
                            error="; ".join(line.strip() for line in why.where),
                            fits_from_tp=why.smallest_tp,
                            fits_on=why.gpus,
                            fits_max_model_len=why.max_model_len,
                        )
                except ModelConfigError as error:
                    row.update(status="error", error=str(error))
                rows.append(row)
                if progress is not None:
                    progress(len(rows), total, _row_name(row, len(lengths) > 1))
    return rows


_COLUMNS = (
    ("gpu", "GPU"),
    ("tp", "TP"),
    ("max_model_len", "max_model_len"),
    ("non_kv_bytes_per_worker", "non-KV/worker"),
    ("kv_budget_bytes", "KV budget"),
    ("kv_cache_tokens", "tokens"),
    ("max_concurrency", "concurrency"),
    ("auto_fit_max_model_len", "auto-fit len"),
    ("min_cached_prefix", "min cached prefix"),
    ("memory", "memory"),  # "estimated" or "measured on N engines" (kvplan/models/fleet.py)
)


def min_cached_prefix(response: plan_pb2.PlanResponse) -> int:
    """docs/prefix-caching.md: PrefixCacheDiagnostics.min_shared_prefix_tokens."""
    return int(response.diagnostics.prefix_cache.min_shared_prefix_tokens)


def min_any_hit_prefix(response: plan_pb2.PlanResponse) -> int:
    """docs/prefix-caching.md: PrefixCacheDiagnostics.min_any_hit_prefix_tokens."""
    return int(response.diagnostics.prefix_cache.min_any_hit_prefix_tokens)


_PRICE_COLUMNS = (("usd_per_hour", "USD/h"), ("kv_tokens_per_usd_hour", "tokens per USD/h"))


def _row_name(row: dict[str, Any], length_sweep: bool) -> str:
    name = f"{row['gpu']} tp={row['tp']}"
    if length_sweep:
        asked = row.get("requested_max_model_len")
        name += " max_model_len " + ("auto" if asked == -1 else f"{asked:,}")
    return name


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The sweep as a table; under it, each row that does not fit (where its memory went,
    the smallest TP and the smallest catalog GPUs that hold it) or that the config refuses."""

    def cell(row: dict[str, Any], key: str) -> str:
        if key.startswith(("usd_", "kv_tokens_per_")) and key not in row:
            return "-"
        if row.get("status") != "ok" and key not in row:
            return "-" if row.get("status") == "error" else "no fit"
        value = row.get(key)
        if key == "max_model_len" and row.get("requested_max_model_len") == -1:
            return f"auto: {value:,}" if isinstance(value, int) else "auto"
        if row.get("status") != "ok" and key == "max_model_len":
            return f"{value:,}" if isinstance(value, int) else str(value)
        if key == "min_cached_prefix" and value == 0:
            return "never"  # prefix caching off or nothing cacheable
        lower = row.get("min_any_hit_prefix")
        if key == "min_cached_prefix" and isinstance(lower, int) and 0 < lower < (value or 0):
            return f"{value:,} ({lower:,})"  # a shared prefix of a longer stored prompt
        if value is None:
            return "-"
        if key == "usd_per_hour":
            return f"{value:,.2f}"
        if key.endswith("bytes") or key.endswith("_per_worker"):
            return _gib(int(value))
        if isinstance(value, float):
            return f"{value:.2f}x"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    columns = _COLUMNS + (_PRICE_COLUMNS if any("usd_per_hour" in row for row in rows) else ())
    table = [[title for _, title in columns]]
    table += [[cell(row, key) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    out = [
        "  ".join(text.rjust(width) for text, width in zip(line, widths, strict=True))
        for line in table
    ]
    if any(cell(row, "min_cached_prefix").endswith(")") for row in rows):
        out.append(
            "min cached prefix: a prompt sent again; in brackets, where lower, a shared "
            "prefix of a longer stored prompt"
        )
    length_sweep = len({row.get("requested_max_model_len") for row in rows}) > 1
    for row in rows:
        name = _row_name(row, length_sweep)
        if row.get("status") == NO_FIT:
            tp_hint = (
                f"fits from --tensor-parallel-size {row['fits_from_tp']}"
                if row["fits_from_tp"]
                else f"no TP size up to {TP_CANDIDATES[-1]} fits on this GPU"
            )
            gpus = name_gpus(row["fits_on"]) if row["fits_on"] else "no catalog GPU"
            out.append(
                f"{name}: does not fit: {row['error']}; {tp_hint}; "
                f"at tp={row['tp']} it fits on: {gpus}"
            )
        elif row.get("status") == "error":
            out.append(f"{name}: {row['error']}")
    return "\n".join(out)


def format_csv(rows: Sequence[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys(key for row in rows for key in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def chart_subtitle(args: argparse.Namespace, lengths: Sequence[int | None]) -> str:
    """What the chart holds fixed: the length (or TP in a length sweep) and the release."""
    if len(lengths) > 1:
        fixed = f"TP {args.tp}"
    elif lengths[0] is None:
        fixed = "max_model_len: the model's own"
    else:
        fixed = f"max_model_len {'auto' if lengths[0] == -1 else f'{lengths[0]:,}'}"
    planned = f"; planned by the kvplan server at {args.target}" if args.target else ""
    return f"{fixed}; rules {args.engine_version or 'kvplan'}{planned}"


def _local_planner(request: plan_pb2.PlanRequest) -> plan_pb2.PlanResponse:
    from kvplan.convert import plan_from_proto

    return plan_from_proto(request)


class RemotePlanner:
    """`capacity --target`: every plan of the sweep (each row, its auto-fit length, the
    alternatives a row that does not fit names, a measured row's replan) asked of one
    kvplan server over one channel, so the rows are the server's answer: its rule set
    and its release of the planning core. The request is what the client builds in
    every mode (kvplan's estimate of the non-KV memory, or the fleet's measurement):
    the wire carries layer specs and budgets, not model configs.

    A refusal of the plan comes back as the planning error it is (its field path and
    ErrorInfo numbers), so a row says it as in-process; anything else (no server,
    credentials) raises the CLI's RemoteError and ends the sweep."""

    def __init__(self, target: str, environ: dict[str, str]) -> None:
        from kvplan.client import ChannelSecurity, PlannerClient

        self.target = target
        self._client = PlannerClient(target, security=ChannelSecurity.from_env(environ))

    def __call__(self, request: plan_pb2.PlanRequest) -> plan_pb2.PlanResponse:
        from kvplan.cli import EXIT_CODES, RemoteError, remote_error_text
        from kvplan.client import PlannerError

        asked = plan_pb2.PlanRequest()
        asked.CopyFrom(request)
        # A what-if, not an engine: no engine id for the server to claim for this
        # identity or to publish the plan under (GetPlan of a real engine unchanged).
        asked.engine_id = ""
        try:
            return self._client.plan(asked).response
        except PlannerError as error:
            refusal = _planning_error(error)
            if refusal is not None:
                raise refusal from error
            raise RemoteError(
                remote_error_text(error), EXIT_CODES.get(error.code_name, 1)
            ) from error

    def get_measurements(
        self, fingerprint: service_pb2.ConfigFingerprint
    ) -> service_pb2.GetMeasurementsResponse:
        """The fleet's measurements, over the sweep's channel (kvplan/models/fleet.py)."""
        return self._client.get_measurements(fingerprint)

    def close(self) -> None:
        self._client.close()


def _planning_error(error: Any) -> Exception | None:
    """The server's refusal of a plan as the core's error (None: not a refusal)."""
    from kvplan.core.errors import (
        InsufficientMemory,
        InvalidRequest,
        UnknownDevice,
        UnplannableSpecs,
    )

    kinds = {
        "INVALID_ARGUMENT": InvalidRequest,
        "FAILED_PRECONDITION": UnplannableSpecs,
        "RESOURCE_EXHAUSTED": InsufficientMemory,
        "NOT_FOUND": UnknownDevice,
    }
    kind = kinds.get(error.code_name)
    # The planner's refusals carry their error class as the reason; the server's own
    # (a request over its limits: reason = the code) are not the plan's answer.
    if kind is None or error.metadata.get("reason", error.code_name) == error.code_name:
        return None
    field = error.violations[0].field if error.violations else ""
    details: dict[str, int | float | str] = {
        key: int(value) if value.isdigit() else value for key, value in error.metadata.items()
    }
    return kind(error.details, field=field, details=details)


def capacity_command(args: argparse.Namespace) -> int:
    """Exit 0 when the sweep ran (rows that do not fit are marked, not failures); 2 for a
    bad config or flag, as `plan` exits, including when every row is refused by it."""
    try:
        config = load_config(args.model)
        gpus = [gpu_or_size(name) for name in args.gpu.split(",") if name.strip()]
        tps = parse_tp_list(args.tp)
        options = options_from_args(args)
        prices = dict(args.price or [])
        unpriced = sorted(set(prices) - {gpu.name for gpu in gpus})
        if unpriced:
            raise ModelConfigError(
                f"--price {', '.join(unpriced)}: not among --gpu {args.gpu} (price the GPUs "
                "the sweep runs on)"
            )
        if args.chart:
            check_chart_path(args.chart)
    except (ModelConfigError, UnknownGpu, ValueError, ChartUnavailable) as error:
        print(
            f"error: {error.args[0] if isinstance(error, UnknownGpu) else error}", file=sys.stderr
        )
        return 2
    lengths: list[int | None] = list(args.max_model_len or [None])
    total = len(gpus) * len(tps) * len(lengths)
    show_progress = (
        total > 4 and not (args.json or args.csv) and sys.stderr.isatty()
    ) or args.progress

    def progress(done: int, count: int, what: str) -> None:
        print(f"\r[{done}/{count}] {what}   ", end="" if done < count else "\n", file=sys.stderr)

    from kvplan.cli import RemoteError, connection_setup_error, security_environ

    remote: RemotePlanner | None = None
    try:
        if args.target:
            try:
                remote = RemotePlanner(args.target, security_environ(args))
            except (OSError, ValueError) as error:
                raise connection_setup_error(error) from error
        planner: Planner = remote or _local_planner
        rows = capacity_rows(
            config, options, gpus, tps, planner, progress if show_progress else None, lengths
        )
        rows = fleet_rows(args, rows, config, options, gpus, planner)  # models/fleet.py
    except RemoteError as error:  # no server, credentials: no row can be answered
        print(f"error: {args.target}: {error}", file=sys.stderr)
        return error.exit_code
    finally:
        if remote is not None:
            remote.close()
    apply_prices(rows, prices, options.pipeline_parallel_size)
    if all(row["status"] == "error" for row in rows):
        length_sweep = len(lengths) > 1
        for row in rows:
            print(f"error: {_row_name(row, length_sweep)}: {row['error']}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.csv:
        print(format_csv(rows), end="")
    else:
        print(format_table(rows))
        if any("reserved_kv_cache_tokens" in row for row in rows):
            print(EXTENSIBLE_TABLE_NOTE)
        print(planned_by_line(rows, args.target))
    if args.chart:
        write_chart(rows, args.chart, model_title(args.model), chart_subtitle(args, lengths))
        print(f"chart written to {args.chart}", file=sys.stderr)
    return 0


EXTENSIBLE_TABLE_NOTE = (
    "KV budget and tokens: vLLM 0.34's extensible KV cache after warm-up and CUDA-graph "
    "capture (estimated, below the reservation made before warm-up: "
    "reserved_kv_cache_tokens in --json / --csv)"
)


def planned_by_line(rows: Sequence[dict[str, Any]], target: str | None) -> str:
    """Who planned the rows, with which rule set: said under every table."""
    rule_sets = ", ".join(sorted({row["rule_set"] for row in rows if row.get("rule_set")}))
    rules = f"rule set {rule_sets}" if rule_sets else "no row planned"
    if target:
        return (
            f"plans: asked of the kvplan server at {target} ({rules}, as the server "
            "answered); the non-KV memory each request carries is this client's estimate "
            "unless the row says measured"
        )
    return f"plans: in-process ({rules}); --target HOST:PORT asks a kvplan server"


def fleet_rows(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    config: HFConfig,
    options: ModelPlanOptions,
    gpus: Sequence[GpuModel],
    planner: Planner = _local_planner,
) -> list[dict[str, Any]]:
    """The rows with their memory's source: the fleet's measurements with --target (a
    measured row planned again by `planner`, the server's with --target)."""
    from kvplan.cli import security_environ
    from kvplan.models.fleet import remote_ask, with_fleet

    def replan(
        step: ModelPlanOptions, gpu: GpuModel, tp: int, length: int | None
    ) -> dict[str, Any]:
        (row,) = capacity_rows(config, step, [gpu], [tp], planner, None, [length])
        return row

    target = getattr(args, "target", None)
    ask: Any = None
    if isinstance(planner, RemotePlanner):
        ask = planner.get_measurements
    elif target:
        ask = remote_ask(target, security_environ(args))
    return with_fleet(rows, config, options, gpus, replan, ask)


def add_capacity_parser(commands: Any) -> None:
    capacity = commands.add_parser(
        "capacity",
        help="sweep GPUs x TP sizes for a model config: tokens and concurrency",
    )
    add_model_options(capacity, sweep=True)
    output = capacity.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="rows as JSON")
    output.add_argument("--csv", action="store_true", help="rows as CSV")
    capacity.add_argument(
        "--chart",
        metavar="FILE",
        help="draw the sweep to FILE (.png, .svg or .pdf): tokens, concurrency (and tokens "
        "per USD/h with --price) against TP, or against length in a length sweep; needs "
        "matplotlib (pip install 'kvplan[chart]')",
    )
    capacity.add_argument(
        "--price",
        metavar="GPU=USD/h",
        type=parse_price,
        action="append",
        help="price of one GPU an hour (repeat per GPU type): adds the KV cache tokens each "
        "USD an hour buys (an engine costs TP x PP GPUs)",
    )
    capacity.add_argument("--progress", action="store_true", help="always show progress")
    capacity.add_argument(
        "--target",
        help="plan every row on the kvplan server at HOST:PORT (its rule set and release) "
        "with the fleet's measurements it keeps",
    )
    from kvplan.cli import add_security_options

    add_security_options(capacity)


def add_calibrate_parser(commands: Any) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="kvplan's prediction beside every figure a vLLM startup log measured",
        description="Read a vLLM startup log (engine config, model loading, available KV "
        "memory, KV cache size, maximum concurrency, CUDA-graph memory) and print kvplan's "
        "prediction beside each, with the error. The log's settings fill every flag not "
        "given; --model and --gpu are needed (a log names neither file nor device size).",
    )
    calibrate.add_argument("log", help="the startup log (text)")
    calibrate.add_argument("--gpu", required=True, help="catalog name or size (96GiB)")
    calibrate.add_argument(
        "--engine-version",
        help="rules to plan with (vllm-0.32/0.33/0.34); default kvplan's own",
    )
    calibrate.add_argument(
        "--release",
        help="the vLLM release (0.21.0) when the quoted lines do not print it (the engine "
        "banner); it picks the release's profiling rules and printed token formula",
    )
    add_model_options(calibrate, sweep=False)
    calibrate.add_argument(
        "--no-flashinfer",
        action="store_true",
        help="the engine ran without FlashInfer (read from the log's sampler line when it is "
        "quoted): vLLM <= 0.11.0 then sorts the logits in the profile run's sampler, 38 B per "
        "logit where kvplan otherwise counts 16; 0.11.1-0.16 sort either way, and 0.17 and "
        "later plan the same either way",
    )
    calibrate.add_argument("--json", action="store_true", help="the comparison as JSON")


def calibrate_command(args: argparse.Namespace) -> int:
    from kvplan.core.errors import PlanningError
    from kvplan.models.calibrate import (
        CONCURRENCY_FORMULA,
        PER_GROUP_FORMULA,
        Comparison,
        component_rows,
        engine_budget_gib,
        format_comparisons,
        hybrid_prefix_caching_default,
        parse_log,
        printed_stage,
        printed_token_formula,
        profiled_tokens,
        settings_from_log,
    )

    try:
        with open(args.log, encoding="utf-8", errors="replace") as handle:
            log = parse_log(handle.read())
    except OSError as error:
        print(f"error: {args.log}: cannot read: {error.strerror}", file=sys.stderr)
        return 2
    if args.release and log.release and args.release != log.release:
        print(f"error: --release {args.release}: the log says {log.release}", file=sys.stderr)
        return 2
    log.release = log.release or args.release or ""
    from_log = settings_from_log(log)
    for dest, value in from_log.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)
    if args.max_num_batched_tokens is None:  # the V0 engine's profile length
        args.max_num_batched_tokens = profiled_tokens(log, args.max_model_len)
    try:
        if not args.model:
            raise ModelConfigError("give --model CONFIG: the log does not carry the config")
        config = load_config(args.model)
        release_default = hybrid_prefix_caching_default(log.release)
        # Neither the command nor the log says: the release's default for a hybrid model
        # (kvplan's own default, on, is 0.26+'s).
        if (
            args.enable_prefix_caching is None
            and release_default is not None
            and any(layer.is_state for layer in import_layers(config).layers)
        ):
            args.enable_prefix_caching = release_default
        gpu = gpu_or_size(args.gpu)
        options = replace(
            options_from_args(args),
            tensor_parallel_size=args.tp or 1,
            gpu=catalog_name(gpu),
            gpu_memory_bytes=gpu.total_memory_bytes,
            engine_release="v0" if log.engine == "v0" else log.release,
            flashinfer=not (args.no_flashinfer or from_log.get("no_flashinfer")),
            mxfp4_backend=from_log.get("mxfp4_backend"),  # the log's MoE backend line
            block_size_ran=from_log.get("block_size", 0) == args.block_size,  # the log ran it
            use_v2_model_runner=log.model_runner_v2,  # the runner the log's lines name
        )
        request, inputs = build_plan_request(config, options)
        budget = engine_budget_gib(log, options.gpu_memory_utilization)
        if budget is not None and budget <= 0:
            # The engine had no room for the cache (its log prints a budget <= 0 and it
            # refused to start): nothing to plan; the estimate's parts are compared.
            return _calibrate_no_room(args, log, from_log, inputs, gpu.total_memory_bytes,
                                      options.gpu_memory_utilization)  # fmt: skip
        try:
            response, summary, inputs = plan_built(request, inputs, _local_planner)
        except PlanningError:  # a log of an engine that refused its length: same budget
            options = replace(options, max_model_len=-1)
            request, inputs = build_plan_request(config, options)
            response, summary, inputs = plan_built(request, inputs, _local_planner)
        given: plan_pb2.PlanResponse | None = None
        if budget is not None:
            measured_budget = replace(
                options, gpu_memory_utilization=None, kv_cache_memory_bytes=int(budget * GIB)
            )
            given = _local_planner(build_plan_request(config, measured_budget)[0])
    except (ModelConfigError, UnknownGpu, PlanningError) as error:
        message = getattr(error, "message", None) or (
            error.args[0] if isinstance(error, UnknownGpu) else str(error)
        )
        print(f"error: {message}", file=sys.stderr)
        return 2
    worker = response.workers[0]
    groups = max(len(response.groups), 1)
    block = min((group.block_size for group in response.groups), default=16)
    # With PP the log prints its own stage's budget (0.19: the first stage's only), and
    # kvplan plans one budget per stage: compare that stage with kvplan's for it.
    stage = printed_stage(log)
    staged = len(inputs.stage_overheads) > 1
    stage_worker = response.workers[min(stage * (args.tp or 1), len(response.workers) - 1)]
    weights_bytes = inputs.weights.stage_bytes(stage) if inputs.weights is not None else None
    weights = weights_bytes / GIB if weights_bytes is not None else None
    rows = [
        Comparison("model loading (weights) per worker",
                   _first(log.model_loading_gib), weights, "GiB"),
        Comparison("available KV cache memory per worker",
                   min(log.available_kv_gib) if log.available_kv_gib else None,
                   stage_worker.budget.available_bytes / GIB, "GiB"),
        Comparison("KV cache tokens, " + CONCURRENCY_FORMULA,
                   _num(log.kv_cache_tokens), float(worker.kv_cache_size_tokens), "tokens"),
        Comparison("KV cache tokens, " + PER_GROUP_FORMULA,
                   _num(log.kv_cache_tokens), float(response.num_blocks // groups * block),
                   "tokens"),
        Comparison(f"maximum concurrency at {summary.max_model_len:,} tokens",
                   log.max_concurrency, summary.max_concurrency
                   if log.concurrency_len in (None, summary.max_model_len) else None, "x"),
        Comparison("CUDA-graph memory captured (after the KV cache)",
                   log.cuda_graph_gib, None, "GiB"),
        Comparison("CUDA-graph estimate the release logged (kvplan's, from 0.20)",
                   log.cuda_graph_estimate_gib,
                   inputs.overhead.cudagraph_logged_bytes / GIB
                   if inputs.overhead is not None else None, "GiB"),
    ]  # fmt: skip
    overhead = inputs.stage_overheads[stage] if staged else inputs.overhead
    rows += _encoder_rows(log, overhead)
    if staged:  # the printed stage's own profiling figures
        log = replace(
            log,
            peak_torch_increase_gib=log.stage_activation_gib.get(stage),
            non_torch_gib=log.stage_non_torch_gib.get(stage),
        )
    rows += component_rows(
        log, weights_bytes,
        overhead.activation_peak_bytes if overhead is not None else None,
        overhead.non_torch_bytes if overhead is not None else None,
        overhead.cudagraph_bytes if overhead is not None else None,
        gpu.total_memory_bytes, options.gpu_memory_utilization,
    )  # fmt: skip
    printed = printed_token_formula(log.release)
    rows = [replace(row, figure=f"{row.figure} (printed by {log.release})")
            if printed is not None and printed in row.figure else row
            for row in rows]  # fmt: skip
    if log.num_gpu_blocks is not None:
        rows.append(Comparison("GPU blocks (V0 engine)", float(log.num_gpu_blocks),
                               float(response.num_blocks), "blocks"))  # fmt: skip
    if given is not None and log.num_gpu_blocks is not None:
        blocks = float(log.num_gpu_blocks), float(given.num_blocks)
        rows.append(Comparison("GPU blocks from the logged budget (the exact part)", *blocks,
                               "blocks"))  # fmt: skip
    if given is not None:
        given_block = min((group.block_size for group in given.groups), default=16)
        rows.append(
            Comparison(
                "KV cache tokens from the logged budget, " + PER_GROUP_FORMULA,
                _num(log.kv_cache_tokens),
                float(given.num_blocks // max(len(given.groups), 1) * given_block),
                "tokens",
            )
        )
        rows.append(
            Comparison(
                "KV cache tokens from the logged budget, " + CONCURRENCY_FORMULA,
                _num(log.kv_cache_tokens),
                float(given.workers[0].kv_cache_size_tokens),
                "tokens",
            )
        )
    if args.json:
        _print_comparisons_json(log, from_log, stage, rows)
        return 0
    print(f"vLLM {log.release or '(release not in the log)'}; settings from the log: "
          f"{from_log or 'none'}")  # fmt: skip
    if staged:
        print(f"pipeline stage {stage}: the stage whose budget the log printed; its weights, "
              "activation and non-torch figures, beside kvplan's for that stage")  # fmt: skip
    print(format_comparisons(rows))
    return 0


def _calibrate_no_room(
    args: argparse.Namespace,
    log: Any,
    from_log: dict[str, Any],
    inputs: Any,
    device_bytes: int,
    utilization: float | None,
) -> int:
    """calibrate on the log of an engine whose budget was <= 0: kvplan's available KV
    memory is utilization x total less its non-KV estimate (negative too), beside the
    logged one, and the estimate's parts beside the log's."""
    from kvplan.models.calibrate import Comparison, component_rows, format_comparisons

    overhead, weights = inputs.overhead, inputs.weights
    weights_bytes = weights.stage_bytes(0) if weights is not None else None
    parts: list[int | None] = [weights_bytes, None, None, None]
    if overhead is not None:
        parts[1:] = [overhead.activation_peak_bytes, overhead.non_torch_bytes,
                     overhead.cudagraph_bytes]  # fmt: skip
    available = (
        (utilization * device_bytes - sum(parts)) / GIB  # type: ignore[arg-type]
        if utilization is not None and None not in parts
        else None
    )
    rows = [
        Comparison("model loading (weights) per worker", _first(log.model_loading_gib),
                   weights_bytes / GIB if weights_bytes is not None else None, "GiB"),
        Comparison("available KV cache memory per worker", min(log.available_kv_gib),
                   available, "GiB"),
        Comparison("CUDA-graph estimate the release logged (kvplan's, from 0.20)",
                   log.cuda_graph_estimate_gib,
                   overhead.cudagraph_logged_bytes / GIB if overhead is not None else None,
                   "GiB"),
    ]  # fmt: skip
    rows += _encoder_rows(log, overhead)
    rows += component_rows(log, weights_bytes, parts[1], parts[2], parts[3], device_bytes,
                           utilization)  # fmt: skip
    if args.json:
        _print_comparisons_json(log, from_log, 0, rows, no_room_for_the_cache=True)
        return 0
    print(
        f"vLLM {log.release or '(release not in the log)'}; settings from the log: "
        f"{from_log or 'none'}; the engine had no room for the KV cache (budget <= 0)"
    )
    print(format_comparisons(rows))
    return 0


def _print_comparisons_json(
    log: StartupLog,
    from_log: dict[str, Any],
    stage: int,
    rows: Sequence[Comparison],
    **extra: bool,
) -> None:
    """calibrate --json: the log's release and settings, the stage compared, each row."""
    rows_json = [
        {"figure": r.figure, "measured": r.measured, "predicted": r.predicted,
         "unit": r.unit, "error": r.error}
        for r in rows
    ]  # fmt: skip
    print(json.dumps({
        "release": log.release, "engine": log.engine, "settings_from_log": from_log,
        "pipeline_stage": stage, **extra, "rows": rows_json,
    }, indent=1))  # fmt: skip


def _encoder_rows(log: StartupLog, overhead: OverheadEstimate | None) -> list[Comparison]:
    """The profile run's encoder budget and items beside the log's "Encoder cache
    will be initialized" line, where the log has one."""
    from kvplan.models.calibrate import Comparison

    if log.encoder_budget is None:
        return []
    encoder = overhead.encoder if overhead is not None else None
    return [
        Comparison("encoder budget of the profile run (tokens)", float(log.encoder_budget),
                   _num(encoder.encoder_budget if encoder else None), "tokens"),
        Comparison("encoder items profiled", _num(log.encoder_items),
                   _num(encoder.items if encoder else None), "items"),
    ]  # fmt: skip


def _first(values: Sequence[float]) -> float | None:
    return values[0] if values else None


def _num(value: int | None) -> float | None:
    return float(value) if value is not None else None
