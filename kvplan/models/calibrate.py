"""`kvplan calibrate LOG`: kvplan's prediction beside every figure a vLLM startup log
measured, with the error.

The log gives the engine's settings (the `Initializing a V1 LLM engine (vX) with config:`
line and the `non-default args: {...}` line) and what the engine measured: model loading
GiB, available KV cache memory per worker, the KV cache size in tokens, the maximum
concurrency and the CUDA-graph memory. Settings the log lacks (the GPU, always; the model
config) come from the command line in vLLM's flag names.

vLLM 0.32-0.34 print the token count as `int(max_concurrency x max_model_len)`
(`get_kv_cache_capacity`, group-aware: for a hybrid model it counts the tokens of
concurrent max-length requests, state pages included). `num_blocks // groups x
block_size` is printed beside it as the per-group block count in tokens; for a
single-group model both agree to within one request's rounding.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30

_RELEASE = re.compile(r"Initializing a V1 LLM engine \(v([0-9][^)]*)\)|version ([0-9]+\.[0-9]+\S*)")
_CONFIG_LINE = re.compile(r"Initializing a V1 LLM engine \(v[^)]*\) with config: (.*)$")
_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
_LOADING = re.compile(r"Model loading took ([0-9.]+) GiB")
_WEIGHTS_V0 = re.compile(r"Loading model weights took ([0-9.]+) GB")
_AVAILABLE = re.compile(r"Available KV cache memory: ([0-9.]+) GiB")
_TOKENS = re.compile(r"KV cache size: ([0-9,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([0-9,]+) tokens per request: ([0-9.]+)x")
_GRAPHS = re.compile(r"Graph capturing finished in [0-9.]+ secs?, took ([0-9.]+) GiB")
_GRAPH_POOL = re.compile(r"CUDA graph pool memory: ([0-9.]+) GiB \(actual\), ([0-9.]+) GiB")
_PROFILE_V0 = re.compile(r"kv_cache_size=([0-9.]+)GiB")  # V0 engine's profiling line
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
    kv_cache_tokens: int | None = None
    num_gpu_blocks: int | None = None  # the V0 engine logged blocks, not tokens
    concurrency_len: int | None = None
    max_concurrency: float | None = None
    cuda_graph_gib: float | None = None
    cuda_graph_estimate_gib: float | None = None


def parse_log(text: str) -> StartupLog:
    log = StartupLog()
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
        if match := _LOADING.search(line) or _WEIGHTS_V0.search(line):
            log.model_loading_gib.append(float(match.group(1)))
        if match := _PROFILE_V0.search(line):
            log.available_kv_gib.append(float(match.group(1)))
        if match := _BLOCKS_V0.search(line):
            log.num_gpu_blocks = int(match.group(1))
        if match := _AVAILABLE.search(line):
            log.available_kv_gib.append(float(match.group(1)))
        if match := _TOKENS.search(line):
            log.kv_cache_tokens = int(match.group(1).replace(",", ""))
        if match := _CONCURRENCY.search(line):
            log.concurrency_len = int(match.group(1).replace(",", ""))
            log.max_concurrency = float(match.group(2))
        if match := _GRAPHS.search(line):
            log.cuda_graph_gib = float(match.group(1))
        if match := _GRAPH_POOL.search(line):
            log.cuda_graph_gib = float(match.group(1))
            log.cuda_graph_estimate_gib = float(match.group(2))
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
    length = args.get("max_model_len", config.get("max_seq_len"))
    if length is not None and integer(length) is not None:
        out["max_model_len"] = integer(length)
    for dest in ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs"):
        if dest in args:
            out[dest] = args[dest]
    dtype = str(args.get("kv_cache_dtype", config.get("kv_cache_dtype", "auto")))
    if dtype and dtype != "auto":
        out["kv_cache_dtype"] = dtype
    if "enable_prefix_caching" in args:
        out["enable_prefix_caching"] = bool(args["enable_prefix_caching"])
    if "block_size" in args:
        out["block_size"] = int(args["block_size"])
    return out


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
