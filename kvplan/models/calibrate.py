"""`kvplan calibrate LOG`: kvplan's prediction beside every figure a vLLM startup log
measured, with the error.

The log gives the engine's settings (the `Initializing a V1 LLM engine (vX) with config:`
line and the `non-default args: {...}` line) and what the engine measured: model loading
GiB, available KV cache memory per worker, the KV cache size in tokens, the maximum
concurrency and the CUDA-graph memory. Settings the log lacks (the GPU, always; the model
config) come from the command line in vLLM's flag names.

vLLM from 0.20.1 prints the token count as `int(max_concurrency x max_model_len)`
(group-aware: for a hybrid model it counts the tokens of concurrent max-length
requests, state pages included); up to 0.20.0 it printed `num_blocks // groups x
block_size`, the per-group block count in tokens. Both are printed, the release's own
marked (PRINTED_TOKEN_FORMULA); for a single-group model they agree to within one
request's rounding.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvplan.models.profiling import release_version

GIB = 1 << 30

_RELEASE = re.compile(r"Initializing a V1 LLM engine \(v([0-9][^)]*)\)|version ([0-9]+\.[0-9]+\S*)")
_CONFIG_LINE = re.compile(r"Initializing a V1 LLM engine \(v[^)]*\) with config: (.*)$")
_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
_LOADING = re.compile(r"Model loading took ([0-9.]+) GiB")
# The API server's line with the length the engine resolved (model.py, 0.19-0.34):
# "Using max model len 4096".
_MAX_MODEL_LEN = re.compile(r"Using max model len ([0-9]+)")
# vLLM's own decision (custom_all_reduce.py, 0.19 and 0.32-0.34): "Custom allreduce is
# disabled because it's not supported on more than two PCIe-only GPUs", "... because
# your platform lacks GPU P2P capability or P2P test failed", "... due to an
# unsupported world size"; not the INFO line of a build without the kernels.
_CUSTOM_AR_OFF = re.compile(r"WARNING .*Custom allreduce is disabled (?:because|due to) (.*)$")
_WEIGHTS_V0 = re.compile(r"Loading model weights took ([0-9.]+) GB")
# Negative where the engine had no room left for the cache (it then refuses to start:
# "No available memory for the cache blocks").
_AVAILABLE = re.compile(r"Available KV cache memory: (-?[0-9.]+) GiB")
# The worker a line came from (vLLM 0.19 and 0.32-0.34 multiproc_executor names it
# Worker[_DP<r>][_PP<r>][_PCP<r>][_TP<r>]...): its pipeline stage, 0 where none is named.
_PP_STAGE = re.compile(r"^\(Worker\w*?_PP(\d+)")
# 0.19's profiling summary (DEBUG), per worker: the non-KV total it subtracted.
_NON_KV_TOTAL = re.compile(r"Total non KV cache memory: ([0-9.]+) ?GiB")
_TOKENS = re.compile(r"KV cache size: ([0-9,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([0-9,]+) tokens per request: ([0-9.]+)x")
_GRAPHS = re.compile(r"Graph capturing finished in [0-9.]+ secs?, took ([0-9.]+) GiB")
_GRAPH_POOL = re.compile(r"CUDA graph pool memory: ([0-9.]+) GiB \(actual\), ([0-9.]+) GiB")
_PROFILE_V0 = re.compile(r"kv_cache_size=([0-9.]+)GiB")  # V0 engine's profiling line
_V0_FIELD = re.compile(r"(total_gpu_memory|peak_torch_memory|non_torch_memory)=([0-9.]+)GiB")
# vLLM >= 0.20 subtract their CUDA-graph estimate from the KV budget and say so as a
# utilization: the difference of the two figures is the estimate over the total.
_GRAPH_UTIL = re.compile(
    r"gpu-memory-utilization=([0-9.]+) is equivalent to --gpu-memory-utilization=([0-9.]+)"
)
_GRAPH_ESTIMATE = re.compile(r"Estimated CUDA graph memory: ([0-9.]+) GiB")
# vLLM 0.19's advice line when it logs the graph estimate without subtracting it ("In
# v0.19, CUDA graph memory profiling will be enabled by default ... increase
# --gpu-memory-utilization from 0.9000 to 0.9616 to maintain ..."): the first figure is
# the utilization the engine ran with.
_GRAPH_ADVICE = re.compile(r"increase --gpu-memory-utilization from ([0-9.]+) to ([0-9.]+)")
# V1's profiling summary (DEBUG) and its init snapshot: the parts of the non-KV memory.
_PROFILE_V1 = re.compile(
    r"torch peak memory increase: ([0-9.]+)GiB; non-torch forward increase memory: "
    r"([0-9.]+)GiB; weights memory: ([0-9.]+)GiB"
)
# The newer summary (vLLM 0.32-0.34's MemoryProfilingResult): "Total non KV cache memory:
# NGiB; torch peak memory increase: PGiB; total consumed (from mem_get_info): CGiB; weights
# memory: WGiB." The non-KV total is the consumed memory (weights, non-torch and persistent
# torch allocations) plus the transient peak above it; the non-torch part is at most C - W.
_PROFILE_V1_CONSUMED = re.compile(
    r"Total non KV cache memory: ([0-9.]+)GiB; torch peak memory increase: ([0-9.]+)GiB; "
    r"total consumed \(from mem_get_info\): ([0-9.]+)GiB; weights memory: ([0-9.]+)GiB"
)
_INIT_TOTAL = re.compile(r"init memory snapshot: .*total_memory=([0-9.]+)GiB")
# The batch settings the engine states: the scheduler's line, and the compile range the
# profile run compiled ("compile range (1, 2048)": max_num_batched_tokens; the scheduler's
# line wins, and a split compile, "(1, 292)" then "(293, 8192)" where a TP 4 engine's
# all-reduce fusion ends at 292 tokens, ends at the last range's end); the CUDA-graph
# profile's counts ("PIECEWISE=51 (largest=512), FULL=35 (largest=256)"): FULL decode
# graphs stop at max_num_seqs, so a largest FULL size below the largest PIECEWISE one is
# max_num_seqs (rounded down to a capture size).
_CHUNKED_PREFILL = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
_COMPILE_RANGE = re.compile(r"compile range \((\d+), (\d+)\)")
_GRAPH_PROFILE_COUNTS = re.compile(
    r"Profiling CUDA graph memory: PIECEWISE=\d+ \(largest=(\d+)\), FULL=\d+ \(largest=(\d+)\)"
)
# V1's account after graph capture (INFO, 0.10 onward): "Free memory on device (F/T GiB)
# on startup. Desired GPU memory utilization is (U, X GiB). Actual usage is W GiB for
# weight, A GiB for peak activation, N GiB for non-torch memory, and G GiB for CUDAGraph
# memory" (later releases: "W GiB for consumed memory (weights + non-torch), A GiB ...").
_FREE_MEMORY = re.compile(r"Free memory on device \(([0-9.]+)/([0-9.]+) GiB\) on startup")
_DESIRED = re.compile(r"Desired GPU memory utilization is \(([0-9.]+),")
_ACTUAL_ACTIVATION = re.compile(r"([0-9.]+) GiB for peak activation")
_ACTUAL_NON_TORCH = re.compile(r"([0-9.]+) GiB for non-torch memory")
_ACTUAL_GRAPHS = re.compile(r"([0-9.]+) GiB for CUDAGraph memory")
_ACTUAL_CONSUMED = re.compile(r"([0-9.]+) GiB for consumed memory \(weights \+ non-torch\)")
# The V1 sampler's line when FlashInfer is not installed: "FlashInfer is not
# available. Falling back to the PyTorch-native implementation" (0.10.2), "FlashInfer
# top-p/top-k sampling unavailable: ...; falling back" (0.32-0.34).
_NO_FLASHINFER = re.compile(
    r"FlashInfer is not available\. Falling back|FlashInfer top-p/top-k sampling unavailable"
)
# A multimodal model's profile run (vLLM 0.19-0.34's GPU model runner): "Encoder cache
# will be initialized with a budget of 8192 tokens, and profiled with 32 image items of
# the maximum feature size."
_ENCODER = re.compile(
    r"Encoder cache will be initialized with a budget of ([0-9]+) tokens, and profiled "
    r"with ([0-9]+) (\w+) items"
)
# The MoE backend vLLM ran MXFP4 experts with, where the log names it (it sets their
# padding, weights.mxfp4_moe_backend): quantization/mxfp4.py's "Using Marlin backend" /
# "Using Triton backend" (0.10.2-0.18; the source tag keeps XPU's attention line "Using
# Triton backend." out) and its FlashInfer lines, fused_moe/oracle/mxfp4.py's "Using
# 'TRITON' Mxfp4 MoE backend." (0.19-0.34), and the Marlin fallback's WARNING from
# marlin_utils_fp4.py ("... leveraging the Marlin kernel", vllm#23278 on 0.10.1).
_MXFP4_SOURCE_LINE = re.compile(
    r"mxfp4\.py:\d+\] (?:\[get_mxfp4_backend_with_lora\] )?Using (Triton|Marlin) backend\s*$"
)
_MXFP4_FLASHINFER_LINE = re.compile(
    r"Using FlashInfer MXFP4 (?:MXFP8 )?(?:BF16 )?(TRTLLM|CUTLASS)?"
)
_MXFP4_ORACLE_LINE = re.compile(r"Using '(\w+)' Mxfp4 MoE backend")
_FP4_MARLIN_WARNING = re.compile(
    r"marlin_utils_fp4\.py:\d+\] .*Weight-only FP4 compression will be used leveraging "
    r"the Marlin kernel"
)
# The oracle's backend names (0.19-0.34) kvplan plans a layout for.
_MXFP4_ORACLE_BACKENDS = {
    "TRITON": "triton",
    "TRITON_UNFUSED": "triton",
    "MARLIN": "marlin",
    "BATCHED_MARLIN": "marlin",
    "FLASHINFER_TRTLLM_MXFP4_BF16": "flashinfer-trtllm",
    "FLASHINFER_TRTLLM_MXFP4_MXFP8": "flashinfer-trtllm",
    "FLASHINFER_CUTLASS_MXFP4_BF16": "flashinfer-cutlass",
    "FLASHINFER_CUTLASS_MXFP4_MXFP8": "flashinfer-cutlass",
}


def mxfp4_backend_in_line(line: str) -> str | None:
    """The MXFP4 MoE backend a vLLM log line says it chose (kvplan's name), or None."""
    if match := _MXFP4_SOURCE_LINE.search(line):
        return match.group(1).lower()
    if _FP4_MARLIN_WARNING.search(line):
        return "marlin"
    if match := _MXFP4_ORACLE_LINE.search(line):
        return _MXFP4_ORACLE_BACKENDS.get(match.group(1))
    if "mxfp4.py:" in line and (match := _MXFP4_FLASHINFER_LINE.search(line)):
        # 0.10.2-0.18: SM90's BF16 and SM100's MXFP8 CUTLASS run FlashInfer's CUTLASS
        # kernel, SM100's BF16 and MXFP8 TRT-LLM its TRT-LLM one.
        cutlass = match.group(1) == "CUTLASS" or "for SM90" in line
        return "flashinfer-cutlass" if cutlass else "flashinfer-trtllm"
    return None


_BLOCKS_V0 = re.compile(r"(?:^|[#\s])GPU blocks: ([0-9]+)")
_CONFIG_FIELDS = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|[^,]*)")


@dataclass
class StartupLog:
    """The figures a vLLM startup log states, each as printed."""

    release: str = ""
    engine_config: dict[str, str] = field(default_factory=dict)
    non_default_args: dict[str, Any] = field(default_factory=dict)
    model_loading_gib: list[float] = field(default_factory=list)  # one per worker
    available_kv_gib: list[float] = field(default_factory=list)  # one per worker
    # The pipeline stage of each printed figure above (V1: 0 without PP). vLLM prints
    # its own worker's budget and sizes the cache from the smallest over all workers,
    # which a stage that did not print it may hold.
    available_kv_stage: list[int] = field(default_factory=list)
    # Per pipeline stage, as its workers' profiling lines state them (V1).
    stage_non_kv_gib: dict[int, float] = field(default_factory=dict)
    stage_activation_gib: dict[int, float] = field(default_factory=dict)
    stage_non_torch_gib: dict[int, float] = field(default_factory=dict)
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None  # the API server's "Using max model len" line
    num_gpu_blocks: int | None = None  # the V0 engine logged blocks, not tokens
    concurrency_len: int | None = None
    max_concurrency: float | None = None
    cuda_graph_gib: float | None = None
    cuda_graph_estimate_gib: float | None = None
    cudagraph_subtracted_fraction: float | None = None  # of the total, from _GRAPH_UTIL
    # The utilization the engine states it ran with (the 0.21+ CUDA-graph line, or the
    # "Desired GPU memory utilization" of the post-capture account): its default then.
    graph_line_utilization: float | None = None
    engine: str = "v1"  # "v0": the V0 engine's profiling line / weights line
    # What the V0 engine's profiling line states beside the KV size.
    total_gpu_gib: float | None = None
    peak_torch_gib: float | None = None
    peak_torch_increase_gib: float | None = None  # V1: the profile run's activation peak
    # The post-capture account's "peak activation" in its 0.27+ form (the one with
    # "consumed memory (weights + non-torch)"): there vLLM prints the transient peak
    # plus the CUDA-graph estimate it subtracted (0.27.0-0.34 gpu_worker
    # `peak_activation_memory = transient_peak_headroom + cudagraph_memory_estimate_applied`;
    # 0.20-0.26 print the torch peak alone, in the "for weight" form). The activation
    # peak is that less the estimate where the log states the estimate.
    account_peak_with_graph_estimate_gib: float | None = None
    non_torch_gib: float | None = None
    flashinfer: bool = True  # False where the sampler says FlashInfer is missing
    mxfp4_backend: str | None = None  # the MXFP4 MoE backend a line names (kvplan's name)
    # Batch settings the engine's own lines state (scheduler, compile range, graph counts).
    max_num_batched_tokens: int | None = None
    max_num_seqs_from_graphs: int | None = None
    # The encoder part of a multimodal model's profile run: budget (tokens), items
    encoder_budget: int | None = None
    encoder_items: int | None = None
    # Why vLLM turned custom all-reduce off, where a worker's WARNING says so
    custom_all_reduce_off: str | None = None
    # The model runner, by the module a line names: V1's gpu_model_runner.py, Model
    # Runner V2's gpu/model_runner.py ("[model_runner.py:N]"); None where no line says
    # (and on the V0 engine, whose own runner module is also model_runner.py).
    model_runner_v2: bool | None = None


_RUNNER_MODULE = re.compile(r"\[((?:gpu_)?model_runner\.py):\d+\]")


def parse_log(text: str) -> StartupLog:
    log = StartupLog()
    scheduler_tokens: int | None = None  # the scheduler's own line, over compile ranges
    for line in text.splitlines():
        if not log.release and (match := _RELEASE.search(line)):
            log.release = match.group(1) or match.group(2)
        if match := _CONFIG_LINE.search(line):
            log.engine_config = {
                key: value.strip().strip("'") for key, value in _CONFIG_FIELDS.findall(match[1])
            }
        if match := _NON_DEFAULT.search(line):
            try:
                parsed = ast.literal_eval(match.group(1))
            except (ValueError, SyntaxError):
                parsed = {}
            if isinstance(parsed, dict):
                log.non_default_args = parsed
        if log.custom_all_reduce_off is None and (match := _CUSTOM_AR_OFF.search(line)):
            log.custom_all_reduce_off = match.group(1).split(". To silence")[0].strip()
        if match := _MAX_MODEL_LEN.search(line):
            log.max_model_len = int(match.group(1))
        if match := _LOADING.search(line) or _WEIGHTS_V0.search(line):
            log.model_loading_gib.append(float(match.group(1)))
        if match := _PROFILE_V0.search(line):
            log.available_kv_gib.append(float(match.group(1)))
            log.available_kv_stage.append(0)
            log.engine = "v0"
            fields = dict(_V0_FIELD.findall(line))
            for name, attribute in (("total_gpu_memory", "total_gpu_gib"),
                                    ("peak_torch_memory", "peak_torch_gib"),
                                    ("non_torch_memory", "non_torch_gib")):  # fmt: skip
                if name in fields:
                    setattr(log, attribute, float(fields[name]))
        if _WEIGHTS_V0.search(line):
            log.engine = "v0"
        if _NO_FLASHINFER.search(line):
            log.flashinfer = False
        if log.mxfp4_backend is None:
            log.mxfp4_backend = mxfp4_backend_in_line(line)
        if match := _RUNNER_MODULE.search(line):
            log.model_runner_v2 = match.group(1) == "model_runner.py"
        if match := _ENCODER.search(line):
            log.encoder_budget, log.encoder_items = int(match.group(1)), int(match.group(2))
        if match := _BLOCKS_V0.search(line):
            log.num_gpu_blocks = int(match.group(1))
        stage_match = _PP_STAGE.search(line)
        stage = int(stage_match.group(1)) if stage_match else 0
        if match := _AVAILABLE.search(line):
            log.available_kv_gib.append(float(match.group(1)))
            log.available_kv_stage.append(stage)
        if match := _NON_KV_TOTAL.search(line):
            log.stage_non_kv_gib[stage] = float(match.group(1))
        if match := _TOKENS.search(line):
            log.kv_cache_tokens = int(match.group(1).replace(",", ""))
        if match := _CONCURRENCY.search(line):
            log.concurrency_len = int(match.group(1).replace(",", ""))
            log.max_concurrency = float(match.group(2))
        if match := _GRAPHS.search(line):
            log.cuda_graph_gib = float(match.group(1))
        if match := _GRAPH_UTIL.search(line):
            log.cudagraph_subtracted_fraction = float(match.group(1)) - float(match.group(2))
            log.graph_line_utilization = float(match.group(1))
        if match := _PROFILE_V1.search(line):
            log.peak_torch_increase_gib = float(match.group(1))
            log.non_torch_gib = float(match.group(2))
            log.stage_activation_gib[stage] = log.peak_torch_increase_gib
            log.stage_non_torch_gib[stage] = log.non_torch_gib
        if match := _PROFILE_V1_CONSUMED.search(line):
            non_kv, consumed, weights = (float(match.group(i)) for i in (1, 3, 4))
            log.peak_torch_increase_gib = round(non_kv - consumed, 2)  # the transient peak
            log.non_torch_gib = round(consumed - weights, 2)
        if match := _GRAPH_ADVICE.search(line):
            log.graph_line_utilization = float(match.group(1))
        if match := _CHUNKED_PREFILL.search(line):
            log.max_num_batched_tokens = scheduler_tokens = int(match.group(1))
        elif (match := _COMPILE_RANGE.search(line)) and scheduler_tokens is None:
            end = int(match.group(2))
            log.max_num_batched_tokens = max(end, log.max_num_batched_tokens or 0)
        if match := _GRAPH_PROFILE_COUNTS.search(line):
            piecewise, full = int(match.group(1)), int(match.group(2))
            log.max_num_seqs_from_graphs = full if full < piecewise else None
        if match := _INIT_TOTAL.search(line):
            log.total_gpu_gib = float(match.group(1))
        if match := _FREE_MEMORY.search(line):
            log.total_gpu_gib = float(match.group(2))
            if desired := _DESIRED.search(line):
                log.graph_line_utilization = float(desired.group(1))
            activation = _ACTUAL_ACTIVATION.search(line)
            together = _ACTUAL_CONSUMED.search(line)
            if activation and together:
                log.account_peak_with_graph_estimate_gib = float(activation.group(1))
            elif activation:
                log.peak_torch_increase_gib = float(activation.group(1))
            if non_torch := _ACTUAL_NON_TORCH.search(line):
                log.non_torch_gib = float(non_torch.group(1))
            if graphs := _ACTUAL_GRAPHS.search(line):
                log.cuda_graph_gib = float(graphs.group(1))
            if together and log.model_loading_gib:
                # The later account: weights and non-torch as one figure.
                log.non_torch_gib = round(float(together.group(1)) - log.model_loading_gib[0], 2)
        if match := _GRAPH_ESTIMATE.search(line):
            log.cuda_graph_estimate_gib = float(match.group(1))
        if match := _GRAPH_POOL.search(line):
            log.cuda_graph_gib = float(match.group(1))
            log.cuda_graph_estimate_gib = float(match.group(2))
    account = log.account_peak_with_graph_estimate_gib
    if account is not None and log.cuda_graph_estimate_gib is not None:
        # The estimate line (printed before the account) says what the account adds.
        log.peak_torch_increase_gib = round(account - log.cuda_graph_estimate_gib, 2)
    if log.engine == "v0":
        log.model_runner_v2 = None
    return log


def settings_from_log(log: StartupLog) -> dict[str, Any]:
    """vLLM settings (argparse dests of the model options) the log states."""
    out: dict[str, Any] = {}
    config, args = log.engine_config, log.non_default_args

    def integer(value: Any) -> int | None:
        try:
            return int(str(value))
        except ValueError:
            return None

    for dest, key in (("tp", "tensor_parallel_size"), ("pp", "pipeline_parallel_size")):
        value = args.get(key, config.get(key))
        if value is not None and integer(value) is not None:
            out[dest] = integer(value)
    length = args.get("max_model_len", config.get("max_seq_len", log.max_model_len))
    if length is not None and integer(length) is not None:
        out["max_model_len"] = integer(length)
    for dest in ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs"):
        if dest in args:
            out[dest] = args[dest]
    if "max_num_batched_tokens" not in out and log.max_num_batched_tokens is not None:
        out["max_num_batched_tokens"] = log.max_num_batched_tokens  # the engine's own line
    no_drafts = config.get("speculative_config", "None") == "None"  # drafts widen FULL graphs
    if "max_num_seqs" not in out and log.max_num_seqs_from_graphs is not None and no_drafts:
        out["max_num_seqs"] = log.max_num_seqs_from_graphs
    if "gpu_memory_utilization" not in out and log.graph_line_utilization is not None:
        # The engine restated the utilization it ran with (a release's own default).
        out["gpu_memory_utilization"] = log.graph_line_utilization
    # The model dtype the engine resolved ("dtype=torch.float32" on its config line, the
    # non-default args' 'dtype'): a float32 run loads twice the bytes of its checkpoint.
    model_dtype = str(args.get("dtype", config.get("dtype", "auto"))).removeprefix("torch.")
    if model_dtype in ("bfloat16", "float16", "half", "float32", "float"):
        out["dtype"] = model_dtype
    dtype = str(args.get("kv_cache_dtype", config.get("kv_cache_dtype", "auto")))
    if dtype and dtype != "auto":
        out["kv_cache_dtype"] = dtype
    if "enable_prefix_caching" in args:
        out["enable_prefix_caching"] = bool(args["enable_prefix_caching"])
    elif config.get("enable_prefix_caching") in ("True", "False"):
        # The engine's config line: what it ran with (a hybrid model's 0.10 engine turned
        # it off itself).
        out["enable_prefix_caching"] = config["enable_prefix_caching"] == "True"
    if "block_size" in args:
        out["block_size"] = int(args["block_size"])
    # --quantization as the command gave it (the non-default args only: the engine's
    # config line names the kernel's method, e.g. gptq_marlin for a gptq checkpoint).
    if args.get("quantization"):
        out["quantization"] = str(args["quantization"])
    if not log.flashinfer:  # the sampler's fallback line
        out["no_flashinfer"] = True
    if log.mxfp4_backend is not None:  # the MoE backend's own line
        out["mxfp4_backend"] = log.mxfp4_backend
    for dest in ("skip_mm_profiling", "language_model_only"):  # a multimodal model's flags
        if args.get(dest):
            out[dest] = True
    limits = args.get("limit_mm_per_prompt")
    if isinstance(limits, dict):
        out["limit_mm_per_prompt"] = json.dumps(limits)
    # --disable-custom-all-reduce: the non-default args, the engine's config line, or
    # vLLM's WARNING that it turned custom all-reduce off (a failed P2P probe included,
    # which nothing else in a log shows).
    flag = args.get("disable_custom_all_reduce", config.get("disable_custom_all_reduce"))
    if flag in (True, "True") or log.custom_all_reduce_off is not None:
        out["disable_custom_all_reduce"] = True
    return out


# Whether a hybrid model (attention beside Mamba / GDN state) gets prefix caching when
# neither the command nor the engine's config line says: `ModelConfig.
# is_prefix_caching_supported` answers False for the "hybrid" attention type in the
# 0.19.0-0.25.1 wheels ("Hybrid models do not support prefix caching since the feature
# is still experimental") and True from 0.26.0 (read in every 0.26.0-0.31.0 wheel and
# the 0.32-0.34 CPU venvs). Off, each request holds one state block per Mamba group (vLLM's
# mamba_cache_mode "none") instead of two ("align"), which is what the 0.23 record
# qwen3.5-4b-rtx4090d-selfllm-v0.23 prints: 235,706 tokens = int(633 / 11 x 4,096).
HYBRID_PREFIX_CACHING_CHECKED = ((0, 19), (0, 34))  # the minor releases read
HYBRID_PREFIX_CACHING_FROM = (0, 26)


def hybrid_prefix_caching_default(release: str) -> bool | None:
    """The release's prefix-caching default for a hybrid model, where checked (None
    outside `HYBRID_PREFIX_CACHING_CHECKED` or for a release that does not parse)."""
    version = release_version(release)
    if version is None:
        return None
    first, last = HYBRID_PREFIX_CACHING_CHECKED
    if not first <= version[:2] <= last:
        return None
    return version[:2] >= HYBRID_PREFIX_CACHING_FROM


# V0's scheduler (vLLM <= 0.7 and VLLM_USE_V1=0): without chunked prefill a step
# holds a whole prompt, so max_num_batched_tokens defaulted to max(max_model_len,
# 2,048) and the profile run pushed that many tokens through the model; the
# OpenAI server turned chunked prefill on by default only above 32K tokens, with
# 512-token steps. V1 (every release kvplan plans for) profiles
# max_num_batched_tokens, chunked prefill always on.
V0_CHUNKED_PREFILL_FROM = 32_768
V0_CHUNKED_PREFILL_TOKENS = 512
V0_MIN_BATCHED_TOKENS = 2_048


def profiled_tokens(log: StartupLog, max_model_len: int | None) -> int | None:
    """The tokens the log's engine profiled when the log does not say: the V0
    scheduler's default; None for V1 (the caller's default applies)."""
    if log.engine != "v0" or max_model_len is None:
        return None
    if max_model_len > V0_CHUNKED_PREFILL_FROM:
        return V0_CHUNKED_PREFILL_TOKENS
    return max(max_model_len, V0_MIN_BATCHED_TOKENS)


# The formula behind "GPU KV cache size: N tokens", by release, read from each release's
# vllm/v1/core/kv_cache_utils.py (every V1 wheel from 0.8.0 to 0.31.0 on PyPI, and
# 0.32-0.34 in their CPU venvs; docs/capacity.md names the function per range):
# - 0.8.0-0.9.0.1 support one KV-cache group only and print num_blocks x block_size
#   (_get_kv_cache_config_uniform_type): the per-group count with one group.
# - 0.9.1-0.20.0 print num_blocks // number of groups x the smallest block size (the
#   uniform-page-size path from 0.9.1; get_kv_cache_config_from_groups in 0.11.0,
#   _report_kv_cache_config from 0.11.1), times the decode (and from 0.12 prefill)
#   context-parallel size.
# - 0.20.1 onward print int(max_concurrency x max_model_len) (_report_kv_cache_config,
#   get_kv_cache_capacity from 0.24): 0.20.0 and 0.20.1 differ, so 0.20 is keyed by patch.
# For one KV-cache group the two agree to within one request's rounding; for a hybrid
# model they differ (state pages count in the second, each group's blocks are divided out
# in the first). The Qwen3-Next record (0.10.2, 4 groups of 544-token blocks): 973,760 =
# 7,162 blocks // 4 x 544; gemma-2-9b (0.19.0, two groups): 168,880 = 16 x 10,555 blocks,
# while 20.60x x 8,192 is 168,755; club-3090#612 (0.24.0, hybrid Qwen3.6): 567,978, no
# multiple of any block size, = int(4.333 x 131,072).
CONCURRENCY_FORMULA = "int(concurrency x max_model_len)"
PER_GROUP_FORMULA = "num_blocks // groups x block"
PRINTED_TOKEN_FORMULA: dict[str, str] = {
    **{f"0.{minor}": PER_GROUP_FORMULA for minor in range(8, 20)},
    "0.20.0": PER_GROUP_FORMULA,
    "0.20.1": CONCURRENCY_FORMULA,
    "0.20.2": CONCURRENCY_FORMULA,
    **{f"0.{minor}": CONCURRENCY_FORMULA for minor in range(21, 35)},
}


def printed_token_formula(release: str) -> str | None:
    """Which formula this release prints (its patch release's entry, else its minor
    series'); None where not checked (V0, or a release after 0.34). A release
    candidate or dev build counts as its release: 0.23.1rc1 as 0.23."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", release)
    if match is None:
        return None
    major, minor, patch = match.groups()
    series = f"{major}.{minor}"
    if patch is not None and f"{series}.{patch}" in PRINTED_TOKEN_FORMULA:
        return PRINTED_TOKEN_FORMULA[f"{series}.{patch}"]
    return PRINTED_TOKEN_FORMULA.get(series)


def printed_token_releases(formula: str) -> tuple[str, str]:
    """The first and last release (as PRINTED_TOKEN_FORMULA keys them) printing this
    formula: the bounds `plan --model` names."""
    ordered = sorted(PRINTED_TOKEN_FORMULA, key=lambda key: tuple(map(int, key.split("."))))
    keys = [key for key in ordered if PRINTED_TOKEN_FORMULA[key] == formula]
    return keys[0], keys[-1]


@dataclass(frozen=True)
class Comparison:
    figure: str
    measured: float | None
    predicted: float | None
    unit: str

    @property
    def error(self) -> float | None:
        if self.measured is None or self.predicted is None or self.measured == 0:
            return None
        return (self.predicted - self.measured) / self.measured


def format_comparisons(rows: list[Comparison]) -> str:
    def show(value: float | None, unit: str) -> str:
        if value is None:
            return "-"
        if unit == "GiB":
            return f"{value:,.2f} GiB"
        return f"{value:,.2f}x" if unit == "x" else f"{value:,.0f}"

    table = [["figure", "measured (log)", "kvplan", "error"]]
    for row in rows:
        error = f"{row.error:+.1%}" if row.error is not None else "-"
        table.append([row.figure, show(row.measured, row.unit), show(row.predicted, row.unit),
                      error])  # fmt: skip
    widths = [max(len(line[i]) for line in table) for i in range(4)]
    lines = []
    for line in table:
        cells = [text.rjust(w) for text, w in zip(line, widths, strict=True)]
        cells[0] = line[0].ljust(widths[0])
        lines.append("  ".join(cells))
    return "\n".join(lines)


def printed_stage(log: StartupLog) -> int:
    """The pipeline stage whose budget the log's smallest printed "Available KV cache
    memory" is (0 without PP, or where no worker is named)."""
    if not log.available_kv_gib:
        return 0
    smallest = min(range(len(log.available_kv_gib)), key=log.available_kv_gib.__getitem__)
    return log.available_kv_stage[smallest] if log.available_kv_stage else 0


def engine_budget_gib(log: StartupLog, utilization: float | None) -> float | None:
    """The budget vLLM sized the cache from: the smallest over its workers (0.19
    kv_cache_utils.get_kv_cache_configs gives every worker the smallest block count).
    A pipeline stage that did not print its budget still logs its non-KV total, so its
    budget is utilization x total - that; the smallest of those and the printed ones."""
    if not log.available_kv_gib:
        return None
    budgets = list(log.available_kv_gib)
    if utilization is not None and log.total_gpu_gib is not None:
        requested = utilization * log.total_gpu_gib
        budgets += [requested - non_kv for non_kv in log.stage_non_kv_gib.values()]
    return min(budgets)


def component_rows(
    log: StartupLog,
    weights_bytes: int | None,
    activation_bytes: int | None,
    non_torch_bytes: int | None,
    cudagraph_bytes: int | None,
    device_bytes: int,
    utilization: float | None,
) -> list[Comparison]:
    """The memory outside the KV cache, part by part, beside what the log states:
    the V0 profiling line gives the activation peak (peak torch memory less the
    weights), the non-torch memory and CUDA's total; any log gives the non-KV total
    its engine subtracted (utilization x total - available, CUDA graphs included
    where the release subtracts their estimate: vLLM 0.32-0.34 do by default)."""
    loading = log.model_loading_gib[0] if log.model_loading_gib else None
    activation = (
        log.peak_torch_gib - loading
        if log.peak_torch_gib is not None and loading is not None
        else log.peak_torch_increase_gib
    )
    total = log.total_gpu_gib * GIB if log.total_gpu_gib is not None else device_bytes
    implied = (
        utilization * total / GIB - min(log.available_kv_gib)
        if utilization is not None and log.available_kv_gib
        else None
    )
    # The graph estimate counts only where the release subtracts it (>= 0.20 says so).
    subtracted = (
        log.cudagraph_subtracted_fraction * total / GIB
        if log.cudagraph_subtracted_fraction is not None
        else None
    )
    parts = [weights_bytes, activation_bytes, non_torch_bytes, cudagraph_bytes]
    predicted_non_kv = sum(p for p in parts if p is not None) / GIB if None not in parts else None

    def gib(value: int | None) -> float | None:
        return value / GIB if value is not None else None

    rows = [
        Comparison("GPU total (CUDA's, as the engine saw it)", log.total_gpu_gib,
                   device_bytes / GIB, "GiB"),
        Comparison("activation peak of the profile run", activation, gib(activation_bytes),
                   "GiB"),
        # Where the 0.27+ account's figure cannot be split (no estimate line quoted), it
        # is compared whole with kvplan's activation peak plus graph estimate.
        Comparison("activation peak + CUDA-graph estimate (0.27+ account)",
                   log.account_peak_with_graph_estimate_gib if activation is None else None,
                   gib(activation_bytes + cudagraph_bytes)
                   if activation_bytes is not None and cudagraph_bytes is not None else None,
                   "GiB"),
        Comparison("non-torch memory", log.non_torch_gib, gib(non_torch_bytes), "GiB"),
        Comparison("CUDA-graph estimate subtracted", subtracted, gib(cudagraph_bytes), "GiB"),
        Comparison("non-KV memory (utilization x total - available)", implied,
                   predicted_non_kv, "GiB"),
    ]  # fmt: skip
    return [row for row in rows if row.measured is not None]
