"""Deterministic generator of PlanRequests for the differential check.

`generate_cases(seed)` returns several hundred `Case`s (id, category, description,
request). Every case is built from a fixed seed, so two runs produce the same
requests. The categories cover every spec kind and grouping path, spec decoding,
pipeline splits, memory budgets and the worked examples of the planning reference
(kv-cache-planning.md §7). The scenario files of tests/conformance/scenarios are
appended as their own category when present.

Usage: python -m conformance.generate [--seed N] [--out cases.jsonl] [--list]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kvplan.v1 import plan_pb2, spec_pb2

GIB = 1 << 30
MIB = 1 << 20
SCENARIO_DIR = Path(__file__).resolve().parent.parent / "tests" / "conformance" / "scenarios"

Layer = spec_pb2.LayerSpec


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    description: str
    request: plan_pb2.PlanRequest

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "category": self.category,
            "description": self.description,
            "request": json_format.MessageToDict(self.request),
        }


# --- layer builders ----------------------------------------------------------------

_DTYPES = {
    None: spec_pb2.DTYPE_UNSPECIFIED,
    "fp32": spec_pb2.DTYPE_FLOAT32,
    "fp16": spec_pb2.DTYPE_FLOAT16,
    "bf16": spec_pb2.DTYPE_BFLOAT16,
    "u8": spec_pb2.DTYPE_UINT8,
    "i8": spec_pb2.DTYPE_INT8,
    "e4m3": spec_pb2.DTYPE_FLOAT8_E4M3FN,
    "e5m2": spec_pb2.DTYPE_FLOAT8_E5M2,
}


def _clean(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def attn(
    heads: int = 8,
    head: int = 128,
    *,
    dtype: str | None = None,
    head_v: int | None = None,
    padded: int | None = None,
    slots: int | None = None,
    content: int | None = None,
    tokens: int | None = None,
    states_per_token: int | None = None,
    tp_shards: int | None = None,
    dcp_sharded: bool | None = None,
    quant: int = 0,
) -> spec_pb2.AttentionParams:
    params = spec_pb2.AttentionParams(
        **_clean(
            num_kv_heads=heads,
            head_size=head,
            head_size_v=head_v,
            dtype=_DTYPES[dtype],
            kv_quant_mode=quant,
            page_size_padded_bytes=padded,
            num_head_slots=slots,
            state_content_bytes=content,
            max_tp_shards=tp_shards,
            dcp_sharded=dcp_sharded,
        )
    )
    if tokens is not None:
        params.tokens_per_state.tokens = tokens
    if states_per_token is not None:
        params.tokens_per_state.states_per_token = states_per_token
    return params


def _layer(
    name: str,
    *,
    draft: bool = False,
    block: int | None = None,
    align_bytes: int | None = None,
    align_kernel: int | None = None,
    **kind: Any,
) -> Layer:
    layer = Layer(name=name, is_draft=draft, **kind)
    if block is not None:
        layer.block_size = block
    if align_bytes is not None:
        layer.block_stride_alignment.bytes = align_bytes
    if align_kernel is not None:
        layer.block_stride_alignment.multiple_of_kernel_block_tokens = align_kernel
    return layer


def full(
    name: str,
    heads: int = 8,
    head: int = 128,
    *,
    window: int | None = None,
    chunk: int | None = None,
    non_causal: bool = False,
    a: dict[str, Any] | None = None,
    **common: Any,
) -> Layer:
    body = spec_pb2.FullAttentionSpec(
        attention=attn(heads, head, **(a or {})),
        **_clean(sliding_window=window, attention_chunk_size=chunk),
        non_causal=non_causal,
    )
    return _layer(name, full_attention=body, **common)


def sw(
    name: str,
    window: int,
    heads: int = 8,
    head: int = 128,
    *,
    a: dict[str, Any] | None = None,
    **common: Any,
) -> Layer:
    body = spec_pb2.SlidingWindowSpec(
        attention=attn(heads, head, **(a or {})), sliding_window=window
    )
    return _layer(name, sliding_window=body, **common)


def chunked(
    name: str,
    chunk: int,
    heads: int = 8,
    head: int = 128,
    *,
    a: dict[str, Any] | None = None,
    **common: Any,
) -> Layer:
    body = spec_pb2.ChunkedLocalAttentionSpec(
        attention=attn(heads, head, **(a or {})), attention_chunk_size=chunk
    )
    return _layer(name, chunked_local_attention=body, **common)


def _mla_params(
    cache_dtype: int = spec_pb2.KV_CACHE_DTYPE_AUTO,
    topk: int | None = None,
    alignment: int | None = None,
    version: str = "",
) -> spec_pb2.MLAParams:
    return spec_pb2.MLAParams(
        cache_dtype=spec_pb2.KVCacheDtype.ValueType(cache_dtype),
        **_clean(topk_buffer_width=topk, alignment_bytes=alignment),
        model_version=version,
    )


def mla(
    name: str,
    head: int = 576,
    *,
    a: dict[str, Any] | None = None,
    cache_dtype: int = spec_pb2.KV_CACHE_DTYPE_AUTO,
    topk: int | None = None,
    alignment: int | None = None,
    version: str = "",
    indexer: bool = False,
    leader: bool = False,
    marker: bool = False,
    **common: Any,
) -> Layer:
    body = spec_pb2.MLAAttentionSpec(
        attention=attn(1, head, **(a or {})),
        mla=_mla_params(cache_dtype, topk, alignment, version),
        cache_role=(
            spec_pb2.SPARSE_CACHE_ROLE_INDEXER if indexer else spec_pb2.SPARSE_CACHE_ROLE_SPARSE
        ),
        is_index_group_leader=leader,
        non_causal_multi_token_decode=marker,
    )
    return _layer(name, mla_attention=body, **common)


def sw_mla(
    name: str,
    window: int,
    head: int = 576,
    *,
    a: dict[str, Any] | None = None,
    cache_dtype: int = spec_pb2.KV_CACHE_DTYPE_AUTO,
    alignment: int | None = None,
    version: str = "",
    bounded_replay: bool = False,
    **common: Any,
) -> Layer:
    body = spec_pb2.SlidingWindowMLASpec(
        attention=attn(1, head, **(a or {})),
        mla=_mla_params(cache_dtype, None, alignment, version),
        sliding_window=window,
        bounded_replay=bounded_replay,
    )
    return _layer(name, sliding_window_mla=body, **common)


def sink(
    name: str,
    sink_len: int = 16,
    heads: int = 8,
    head: int = 128,
    *,
    a: dict[str, Any] | None = None,
    **common: Any,
) -> Layer:
    body = spec_pb2.SinkFullAttentionSpec(
        attention=attn(heads, head, **(a or {})), sink_len=sink_len
    )
    return _layer(name, sink_full_attention=body, **common)


def rswa(
    name: str,
    window: int = 512,
    heads: int = 8,
    head: int = 128,
    *,
    a: dict[str, Any] | None = None,
    **common: Any,
) -> Layer:
    body = spec_pb2.RSWASpec(attention=attn(heads, head, **(a or {})), rswa_window=window)
    return _layer(name, rswa=body, **common)


def hidden(
    name: str, heads: int = 1, head: int = 4096, *, dtype: str = "bf16", **common: Any
) -> Layer:
    body = spec_pb2.HiddenStateCacheSpec(
        attention=attn(heads, head, dtype=dtype), mla=_mla_params()
    )
    return _layer(name, hidden_state_cache=body, **common)


def cross(
    name: str, heads: int = 8, head: int = 64, *, dtype: str | None = None, **common: Any
) -> Layer:
    body = spec_pb2.CrossAttentionSpec(attention=attn(heads, head, dtype=dtype))
    return _layer(name, cross_attention=body, **common)


def encoder_only(name: str, heads: int = 8, head: int = 64, **common: Any) -> Layer:
    body = spec_pb2.EncoderOnlyAttentionSpec(attention=attn(heads, head))
    return _layer(name, encoder_only_attention=body, **common)


def circular(name: str, heads: int = 1, head: int = 512, **common: Any) -> Layer:
    body = spec_pb2.CircularBufferSpec(attention=attn(heads, head))
    return _layer(name, circular_buffer=body, **common)


GDN_STATES: list[tuple[list[int], str]] = [([3, 2048], "bf16"), ([8, 128, 128], "fp32")]
SMALL_STATES: list[tuple[list[int], str]] = [([2, 512], "fp32"), ([3, 32, 32], "fp32")]  # 16,384


def mamba(
    name: str,
    states: list[tuple[list[int], str]] | None = None,
    *,
    padded: int | None = None,
    mamba_type: int = spec_pb2.MAMBA_TYPE_MAMBA2,
    spec_blocks: int = 0,
    checkpoint_blocks: int = 0,
    checkpoint_alignment: int | None = None,
    heads: int = 0,
    tp_replicated: bool = False,
    **common: Any,
) -> Layer:
    body = spec_pb2.MambaSpec(
        states=[
            spec_pb2.StateTensor(shape=shape, dtype=_DTYPES[dtype])
            for shape, dtype in (states or SMALL_STATES)
        ],
        mamba_type=spec_pb2.MambaType.ValueType(mamba_type),
        num_speculative_blocks=spec_blocks,
        num_prefill_checkpoint_blocks=checkpoint_blocks,
        num_heads=heads,
        tp_replicated=tp_replicated,
        **_clean(page_size_padded_bytes=padded, prefill_checkpoint_alignment=checkpoint_alignment),
    )
    return _layer(name, mamba=body, **common)


# --- request builders ------------------------------------------------------------

LAYOUTS = {
    "LBNHC": plan_pb2.KV_CACHE_LAYOUT_LBNHC,
    "LBHNC": plan_pb2.KV_CACHE_LAYOUT_LBHNC,
    "LHBNC": plan_pb2.KV_CACHE_LAYOUT_LHBNC,
    "BLHNC": plan_pb2.KV_CACHE_LAYOUT_BLHNC,
    "BLNHC": plan_pb2.KV_CACHE_LAYOUT_BLNHC,
    "BHLNC": plan_pb2.KV_CACHE_LAYOUT_BHLNC,
}

METHODS = {  # vLLM's method names are the enum's value names, lower-cased
    name.removeprefix("SPEC_DECODE_METHOD_").lower(): number
    for name, number in plan_pb2.SpecDecodeMethod.items()
}


@dataclass
class W:
    """One worker: its layers and budget (explicit bytes, or utilization of a device)."""

    layers: list[Layer]
    kv_bytes: int | None = None
    total: int | None = None
    utilization: float | None = None
    non_kv: tuple[int, int, int, int] = (0, 0, 0, 0)
    rank: int | None = None


def request(
    workers: list[W] | W,
    *,
    max_model_len: int = 8192,
    derived: int | None = None,
    block_size: int = 0,
    cache_dtype: int = spec_pb2.KV_CACHE_DTYPE_AUTO,
    model_dtype: str | None = None,
    disable_hybrid: bool = False,
    override: int | None = None,
    batched: int = 0,
    async_scheduling: bool = False,
    v2_runner: bool | None = None,
    tp: int = 0,
    pp: int = 0,
    dcp: int = 0,
    layout: str = "LBNHC",
    mamba_align: bool | None = None,
    encoder_tokens: int = 0,
    prefix_caching: bool | None = None,
    method: str = "none",
    spec_tokens: int = 0,
    target_model_type: str = "",
    disable_block_drop: bool = False,
    nextn: int | None = None,
) -> plan_pb2.PlanRequest:
    if isinstance(workers, W):
        workers = [workers]
    req = plan_pb2.PlanRequest(engine_id="conformance")
    o = req.options
    o.max_model_len = max_model_len
    if derived is not None:
        o.derived_max_model_len = derived
    o.block_size = block_size
    o.cache_dtype = cache_dtype  # type: ignore[assignment]
    o.model_dtype = _DTYPES[model_dtype]
    o.disable_hybrid_kv_cache_manager = disable_hybrid
    if override is not None:
        o.num_gpu_blocks_override = override
    o.max_num_batched_tokens = batched
    o.async_scheduling = async_scheduling
    if v2_runner is not None:  # unset: the release's default runner
        o.use_v2_model_runner = v2_runner
    o.parallel.tensor_parallel_size = tp
    o.parallel.pipeline_parallel_size = pp
    o.parallel.decode_context_parallel_size = dcp
    o.layout = LAYOUTS[layout]
    if mamba_align:
        o.mamba_cache_mode = plan_pb2.MAMBA_CACHE_MODE_ALIGN
    if (
        prefix_caching is None
        and mamba_align is not None
        and any(layer.WhichOneof("kind") == "mamba" for w in workers for layer in w.layers)
    ):
        # vLLM runs Mamba in "align" mode exactly when prefix caching is on: a mode
        # asked for is asked the way an engine gets it. (Unset: the engine's default.)
        prefix_caching = mamba_align
    o.max_num_encoder_input_tokens = encoder_tokens
    if prefix_caching is not None:
        o.enable_prefix_caching = prefix_caching
    if method != "none":
        s = req.spec_decode
        s.method = METHODS[method]
        s.num_speculative_tokens = spec_tokens or 1
        s.target_model_type = target_model_type
        s.disable_eagle_block_drop = disable_block_drop
        if nextn is not None:
            s.num_nextn_predict_layers = nextn
    for index, w in enumerate(workers):
        out = req.workers.add(rank=index if w.rank is None else w.rank)
        out.device.uuid = f"GPU-{index:04d}"
        if w.kv_bytes is not None:
            out.memory.kv_cache_memory_bytes = w.kv_bytes
        else:
            out.device.total_memory_bytes = w.total or 80 * GIB
            if w.utilization is not None:
                out.memory.gpu_memory_utilization = w.utilization
            weights, activation, non_torch, graphs = w.non_kv
            out.memory.non_kv.weights_bytes = weights
            out.memory.non_kv.activation_peak_bytes = activation
            out.memory.non_kv.non_torch_bytes = non_torch
            out.memory.non_kv.cuda_graph_bytes = graphs
        out.layers.extend(w.layers)
    return req


# --- model shapes ------------------------------------------------------------------


def llama(
    n: int = 32, heads: int = 8, head: int = 128, prefix: str = "model.layers", **kw: Any
) -> list[Layer]:
    return [full(f"{prefix}.{i}.self_attn.attn", heads, head, **kw) for i in range(n)]


def pattern(
    n: int,
    is_full: Callable[[int], bool],
    local: Callable[[str], Layer],
    heads: int = 8,
    head: int = 128,
    a: dict[str, Any] | None = None,
) -> list[Layer]:
    """n decoder layers: full attention where is_full(i), else local(name)."""
    return [
        full(f"model.layers.{i}.attn", heads, head, a=a)
        if is_full(i)
        else local(f"model.layers.{i}.attn")
        for i in range(n)
    ]


def qwen35(*, draft: bool = False) -> list[Layer]:
    """Qwen3.5-like seed specs: L0-2 Mamba, L3 full, L4-6 Mamba, L7 full, mtp.0 full."""
    out: list[Layer] = []
    for i in range(8):
        if i in (3, 7):
            out.append(full(f"model.layers.{i}.self_attn.attn", 2, 256, a={"dtype": "fp32"}))
        else:
            out.append(mamba(f"model.layers.{i}.linear_attn", SMALL_STATES))
    out.append(full("mtp.layers.0.self_attn.attn", 2, 256, a={"dtype": "fp32"}, draft=draft))
    return out


def dsv4_packed(n: int = 8, mtp: bool = False, draft: bool = False) -> list[Layer]:
    """§3.5 packed example: per layer an SW-MLA cache and a full MLA cache whose
    tokens_per_state alternates 4 and 128 (block 256)."""
    out: list[Layer] = []
    for i in range(n):
        out.append(sw_mla(f"model.layers.{i}.swa", 128, block=64))
        tps = 4 if i % 2 == 0 else 128
        out.append(mla(f"model.layers.{i}.mla", block=256, a={"tokens": tps}))
    if mtp:
        out.append(sw_mla(f"mtp.{n}.swa", 128, block=64, draft=draft))
        out.append(mla(f"mtp.{n}.mla", block=256, a={"tokens": 4}, draft=draft))
    return out


# --- case collection -------------------------------------------------------------


class Cases:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.items: list[Case] = []
        self._ids: set[str] = set()

    def add(self, category: str, cid: str, description: str, req: plan_pb2.PlanRequest) -> None:
        full_id = f"{category}/{cid}"
        if full_id in self._ids:
            raise ValueError(f"duplicate case id {full_id}")
        self._ids.add(full_id)
        self.items.append(Case(full_id, category, description, req))

    def pick(self, values: Iterable[Any]) -> Any:
        return self.rng.choice(list(values))


def _reference(c: Cases) -> None:
    """Worked examples of the reference §7 (expressible ones)."""
    cat = "reference"
    c.add(cat, "r01", "§7.1 32xF(8,128), 54 GiB, len 8192", request(W(llama(), 54 * GIB)))
    c.add(
        cat,
        "r02",
        "§7.2 fp8 cache",
        request(W(llama(), 54 * GIB), cache_dtype=spec_pb2.KV_CACHE_DTYPE_FP8),
    )
    c.add(
        cat,
        "r03",
        "§7.3 utilization 0.92 on 80 GiB, 18 GiB non-KV",
        request(W(llama(), total=80 * GIB, utilization=0.92, non_kv=(16 * GIB, 2 * GIB, 0, 0))),
    )
    c.add(
        cat,
        "r03b",
        "§5.8 utilization 0.9 on 80 GiB",
        request(W(llama(), total=80 * GIB, utilization=0.9, non_kv=(16 * GIB, 2 * GIB, 0, 0))),
    )
    c.add(cat, "r04", "§7.4 override 1000", request(W(llama(), 54 * GIB), override=1000))
    c.add(cat, "r05", "§7.5 512 MiB not enough", request(W(llama(), 512 * MIB)))
    c.add(cat, "r06", "§7.6 override 100 not enough", request(W(llama(), 54 * GIB), override=100))
    c.add(cat, "r07", "§7.7 available 0", request(W(llama(), 0)))
    c.add(
        cat,
        "r08",
        "§7.8 auto-fit derived 131072, 5 GiB",
        request(W(llama(), 5 * GIB), max_model_len=-1, derived=131072),
    )
    fss = pattern(30, lambda i: i % 3 == 0, lambda n: sw(n, 4096))
    c.add(
        cat,
        "r09",
        "§7.9 F,S,S x10, 54 GiB, len 32768",
        request(W(fss, 54 * GIB), max_model_len=32768, batched=8192),
    )
    c.add(
        cat, "r10", "§7.10 same, 2 GiB", request(W(fss, 2 * GIB), max_model_len=32768, batched=8192)
    )
    gpt = [
        sw(f"model.layers.{i}.attn", 128) if i % 2 == 0 else full(f"model.layers.{i}.attn")
        for i in range(24)
    ] + [full("draft.layers.0.attn", draft=True)]
    c.add(cat, "r11", "§7.11 12 SW(128) + 13 F (draft)", request(W(gpt, 16 * GIB)))
    f20s30 = [full(f"f.{i}") for i in range(20)] + [sw(f"s.{i}", 1024) for i in range(30)]
    c.add(cat, "r12", "§7.12 20 F then 30 SW, 54 GiB", request(W(f20s30, 54 * GIB)))
    gemma = pattern(62, lambda i: i % 6 == 5, lambda n: sw(n, 1024, 16), heads=16)
    c.add(
        cat,
        "r13",
        "§7.13 Gemma-3-like 62 layers, 40 GiB, len 131072",
        request(W(gemma, 40 * GIB), max_model_len=131072, batched=8192),
    )
    l14 = [full(f"f.{i}") for i in range(4)] + [sw(f"s.{i}", 1024, 4) for i in range(8)]
    c.add(cat, "r14", "§7.14 4 F(8) + 8 SW(4 heads): SW block 32", request(W(l14, 8 * GIB)))
    l15 = [full(f"f.{i}", 8, 96) for i in range(3)] + [sw(f"s.{i}", 1024) for i in range(3)]
    c.add(cat, "r15", "§7.15 F head 96 padded to 65,536", request(W(l15, 8 * GIB)))
    mla_pair = [mla(f"m.{i}", block=64, a={"tokens": 4}) for i in range(2)]
    c.add(
        cat,
        "r16",
        "§7.16 2 MLA(18,432) + SW(1,384: 24,576): full-allocation fallback",
        request(W([*mla_pair, sw("s.0", 1024, 1, 384)], 4 * GIB)),
    )
    c.add(
        cat,
        "r16b",
        "§7.16 2 MLA(18,432) + F(1,384): NotImplementedError",
        request(W([*mla_pair, full("f.0", 1, 384)], 4 * GIB)),
    )
    l17 = [mamba(f"m.{i}", padded=65536) for i in range(3)] + [
        full("f.0"),
        full("draft.0", 16, 128, draft=True),
    ]
    c.add(cat, "r17", "§7.17 Mamba padded to draft page", request(W(l17, 8 * GIB), method="eagle"))
    l18 = [full("a.0"), full("a.1"), full("b.0", 4), full("b.1", 4)]
    for layout in ("LBNHC", "BLHNC", "LHBNC"):
        c.add(
            cat,
            f"r18-{layout}",
            f"§7.18 uniform-type 2xF(8)+2xF(4), 1 GiB, {layout}",
            request(W(l18, GIB), layout=layout),
        )
    c.add(
        cat,
        "r19",
        "§7.19 packed (BLHNC) 8 SW-MLA + 8 MLA, 1 GiB",
        request(W(dsv4_packed(), GIB), layout="BLHNC", max_model_len=8192),
    )
    c.add(
        cat,
        "r19b",
        "§7.19 packed with MTP layer (mtp, no is_draft)",
        request(W(dsv4_packed(mtp=True), GIB), layout="BLHNC", method="mtp"),
    )
    c.add(
        cat,
        "r19c",
        "§7.19 packed with MTP layer (is_draft)",
        request(W(dsv4_packed(mtp=True, draft=True), GIB), layout="BLHNC", method="mtp"),
    )
    c.add(
        cat,
        "r20a",
        "§7.20 disable HMA: F + SW(1024)",
        request(W([full("f.0"), sw("s.0", 1024)], 4 * GIB), disable_hybrid=True),
    )
    c.add(
        cat,
        "r20b",
        "§7.20 disable HMA: F + SW1024 + SW2048 error",
        request(W([full("f.0"), sw("s.0", 1024), sw("s.1", 2048)], 4 * GIB), disable_hybrid=True),
    )
    c.add(
        cat,
        "r20c",
        "§7.20 disable HMA: Mamba + F error",
        request(W([mamba("m.0", padded=65536), full("f.0")], 4 * GIB), disable_hybrid=True),
    )
    c.add(
        cat,
        "r21",
        "§7.21 PP 2x16 F, 20 and 10 GiB",
        request([W(llama(16), 20 * GIB), W(llama(16, prefix="model.layers2"), 10 * GIB)], pp=2),
    )
    c.add(
        cat,
        "r22",
        "§7.22 attention-free (encoder-only only)",
        request(W([encoder_only("enc.0"), encoder_only("enc.1")], 4 * GIB)),
    )
    c.add(
        cat,
        "r22b",
        "§7.22 attention-free auto-fit unchanged",
        request(W([encoder_only("enc.0")], 4 * GIB), max_model_len=-1, derived=4096),
    )
    c.add(
        cat,
        "r23a",
        "§7.23 F + SW + hidden 12,288/token",
        request(W([full("f.0"), sw("s.0", 1024), hidden("h.0", 1, 6144)], 4 * GIB)),
    )
    c.add(
        cat,
        "r23b",
        "§7.23 1-head F + SW + hidden 49,152/token: scaled groups",
        request(W([full("f.0", 1), sw("s.0", 1024, 1), hidden("h.0", 1, 24576)], 4 * GIB)),
    )
    sw4096 = [sw(f"s.{i}", 4096) for i in range(2)] + [full("f.0")]
    c.add(
        cat,
        "r24a",
        "§7.24 SW(4096) T 2048 len 32768",
        request(W(sw4096, 8 * GIB), max_model_len=32768, batched=2048),
    )
    c.add(
        cat,
        "r24b",
        "§7.24 SW(4096) async T 4096",
        request(W(sw4096, 8 * GIB), max_model_len=32768, batched=2048, async_scheduling=True),
    )
    c.add(
        cat,
        "r24c",
        "§7.24 SW(4096) len 1000",
        request(W(sw4096, 8 * GIB), max_model_len=1000, batched=2048),
    )
    ch = [chunked(f"c.{i}", 8192) for i in range(3)] + [full("f.0")]
    c.add(
        cat,
        "r24d",
        "§7.24 chunked(8192) T 2048 len 32768",
        request(W(ch, 8 * GIB), max_model_len=32768, batched=2048),
    )
    c.add(
        cat,
        "r24e",
        "§7.24 chunked(8192) len 1000",
        request(W(ch, 8 * GIB), max_model_len=1000, batched=2048),
    )
    m25 = [([3, 1024], "bf16"), ([4, 64, 64], "bf16")]
    for align in (True, False):
        mode = "align" if align else "none"
        c.add(
            cat,
            f"r25-{mode}",
            f"§7.25 Mamba 38,912 page, 2 spec blocks, {mode}",
            request(
                W([mamba(f"m.{i}", m25, spec_blocks=2) for i in range(2)], 2 * GIB),
                mamba_align=align,
            ),
        )
    c.add(
        cat,
        "r26a",
        "§7.26 cross-attention fp16, 1500 encoder tokens",
        request(
            W([cross("x.0", dtype="fp16"), cross("x.1", dtype="fp16")], 2 * GIB),
            encoder_tokens=1500,
        ),
    )
    c.add(cat, "r26b", "§7.26 DCP 4, F at 8192", request(W(llama(8), 8 * GIB), dcp=4, tp=4))
    gdn = [
        full(f"model.layers.{i}.attn", 2, 256, block=272)
        if i % 4 == 3
        else mamba(
            f"model.layers.{i}.linear",
            GDN_STATES,
            padded=557056,
            mamba_type=spec_pb2.MAMBA_TYPE_GDN_ATTENTION,
            block=272,
        )
        for i in range(48)
    ]
    c.add(
        cat,
        "r27",
        "§7.27 GDN hybrid 36 Mamba + 12 F, align, 40 GiB, len 32768",
        request(W(gdn, 40 * GIB), max_model_len=32768, mamba_align=True),
    )
    drafted = [*llama(4), full("draft.0", draft=True)]
    c.add(
        cat,
        "r29a",
        "§7.29 4 F + draft F, eagle: 1 group flagged",
        request(W(drafted, 4 * GIB), method="eagle"),
    )
    c.add(
        cat,
        "r29b",
        "§7.29 draft with 4 heads: wrapper flagged",
        request(W([*llama(4), full("draft.0", 4, draft=True)], 4 * GIB), method="eagle"),
    )
    c.add(
        cat,
        "r29c",
        "§7.29 SW/F target + draft F, eagle3",
        request(
            W(
                [
                    *pattern(8, lambda i: i % 2 == 1, lambda n: sw(n, 1024)),
                    full("draft.0", draft=True),
                ],
                4 * GIB,
            ),
            method="eagle3",
        ),
    )
    c.add(
        cat,
        "r29d",
        "§7.29 disable_eagle_block_drop: none flagged",
        request(W(drafted, 4 * GIB), method="eagle", disable_block_drop=True),
    )
    c.add(
        cat,
        "r30",
        "§7.30 PP projection with draft SW, mtp",
        request(
            [
                W([full("L0"), sw("L1", 1024)], 4 * GIB),
                W([full("L2"), sw("L3", 1024), sw("draft", 1024, draft=True)], 4 * GIB),
            ],
            pp=2,
            method="mtp",
        ),
    )
    for method in ("mtp", "eagle", "eagle3", "dspark"):
        c.add(
            cat,
            f"r31-qwen35-{method}",
            f"§4.6 Qwen3.5 seed specs, {method}, no is_draft",
            request(W(qwen35(), GIB), method=method, mamba_align=True, target_model_type="qwen3_5"),
        )
    c.add(
        cat,
        "r31-qwen35-mtp-draft",
        "§4.6 Qwen3.5 seed specs, mtp, is_draft on mtp.0",
        request(W(qwen35(draft=True), GIB), method="mtp", mamba_align=True),
    )


def _uniform(c: Cases) -> None:
    cat = "uniform"
    dtypes = [
        ("auto", spec_pb2.KV_CACHE_DTYPE_AUTO, None),
        ("auto-fp16", spec_pb2.KV_CACHE_DTYPE_AUTO, "fp16"),
        ("auto-fp32", spec_pb2.KV_CACHE_DTYPE_AUTO, "fp32"),
        ("fp8", spec_pb2.KV_CACHE_DTYPE_FP8, None),
        ("fp8_e5m2", spec_pb2.KV_CACHE_DTYPE_FP8_E5M2, None),
        ("int8pth", spec_pb2.KV_CACHE_DTYPE_INT8_PER_TOKEN_HEAD, None),
        ("fp8_inc", spec_pb2.KV_CACHE_DTYPE_FP8_INC, None),
        ("nvfp4", spec_pb2.KV_CACHE_DTYPE_NVFP4, None),
        ("float32", spec_pb2.KV_CACHE_DTYPE_FLOAT32, None),
    ]
    for i in range(36):
        name, cache_dtype, model_dtype = dtypes[i % len(dtypes)]
        n = c.pick([1, 2, 16, 24, 32, 40, 61, 80])
        heads = c.pick([1, 2, 4, 8, 16])
        head = c.pick([64, 80, 96, 128, 256])
        block = c.pick([0, 16, 32, 64, 128, 256])
        mem = c.pick([GIB, 6 * GIB, 17 * GIB + 12345, 54 * GIB, 70 * GIB + 3])
        mml = c.pick([2048, 4096, 8192, 32768, 131072])
        c.add(
            cat,
            f"u{i:02d}-{name}",
            f"{n}xF({heads},{head}) block {block or 16} {name}",
            request(
                W(llama(n, heads, head), mem),
                cache_dtype=cache_dtype,
                model_dtype=model_dtype,
                block_size=block,
                max_model_len=mml,
            ),
        )
    c.add(
        cat,
        "quant-content",
        "int8 per-token-head content 264 B (Triton)",
        request(
            W(llama(8, a={"content": 264, "quant": 2}), 4 * GIB),
            cache_dtype=spec_pb2.KV_CACHE_DTYPE_INT8_PER_TOKEN_HEAD,
        ),
    )
    c.add(
        cat,
        "head-v",
        "F with head_size_v 64 (K 128)",
        request(W(llama(8, a={"head_v": 64}), 4 * GIB)),
    )
    c.add(
        cat,
        "slots",
        "F with num_head_slots 4 (8 kv heads)",
        request(W(llama(8, a={"slots": 4}), 4 * GIB)),
    )
    c.add(
        cat,
        "padded",
        "F with page_size_padded 70,000",
        request(W(llama(8, a={"padded": 70000}), 4 * GIB)),
    )
    c.add(
        cat,
        "padded-small",
        "F with page_size_padded below real page (assertion)",
        request(W(llama(4, a={"padded": 1000}), 4 * GIB)),
    )
    c.add(
        cat,
        "states-per-token",
        "F with states_per_token 2",
        request(W(llama(8, a={"states_per_token": 2}), 4 * GIB)),
    )
    c.add(
        cat,
        "tokens-per-state",
        "F with tokens_per_state 4",
        request(W(llama(8, a={"tokens": 4}), 4 * GIB)),
    )
    c.add(
        cat,
        "align-bytes",
        "F with block_stride_alignment 100,000 B (LBNHC)",
        request(W(llama(4, align_bytes=100_000), 4 * GIB)),
    )
    c.add(
        cat,
        "align-bytes-blhnc",
        "F with block_stride_alignment 100,000 B (BLHNC)",
        request(W(llama(4, align_bytes=100_000), 4 * GIB), layout="BLHNC"),
    )
    c.add(
        cat,
        "align-kernel",
        "F block 64 with MultipleOf(16) alignment",
        request(W(llama(4, align_kernel=16), 4 * GIB), block_size=64),
    )
    c.add(
        cat,
        "align-kernel-blhnc",
        "F block 48 with MultipleOf(32) alignment, BLHNC",
        request(W(llama(4, align_kernel=32), 4 * GIB), block_size=48, layout="BLHNC"),
    )
    c.add(
        cat,
        "align-zero",
        "block_stride_alignment 0 bytes (vLLM ValueError)",
        request(W(llama(2, align_bytes=0), 4 * GIB)),
    )
    c.add(
        cat,
        "window-meta",
        "F layers, some with sliding_window metadata (merge)",
        request(W([full("f.0"), full("f.1", window=1024), full("f.2", window=1024)], 4 * GIB)),
    )
    c.add(
        cat,
        "window-meta-two",
        "F with two window metadata values (merge ValueError)",
        request(W([full("f.0", window=512), full("f.1", window=1024)], 4 * GIB)),
    )
    c.add(
        cat,
        "window-and-chunk",
        "F with window and chunk metadata (assertion)",
        request(W([full("f.0", window=512), full("f.1", chunk=1024)], 4 * GIB)),
    )
    c.add(
        cat,
        "non-causal",
        "F with one non-causal layer",
        request(W([full("f.0"), full("f.1", non_causal=True)], 4 * GIB)),
    )
    for layout in ("LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
        c.add(
            cat,
            f"layout-{layout}",
            f"32xF on {layout}",
            request(W(llama(), 54 * GIB), layout=layout),
        )


def _uniform_type(c: Cases) -> None:
    cat = "uniform_type"
    for i in range(14):
        a_heads, b_heads = c.pick([(8, 4), (8, 2), (16, 8), (4, 1), (8, 6)])
        n_a, n_b = c.pick([(2, 2), (4, 4), (16, 16), (3, 5), (30, 2)])
        layout = c.pick(["LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC", "LHBNC"])
        layers = [full(f"a.{j}", a_heads) for j in range(n_a)] + [
            full(f"b.{j}", b_heads) for j in range(n_b)
        ]
        c.rng.shuffle(layers)
        mem = c.pick([GIB, 4 * GIB, 13 * GIB + 777])
        c.add(
            cat,
            f"t{i:02d}-{layout}",
            f"{n_a}xF({a_heads}) + {n_b}xF({b_heads}) on {layout}",
            request(W(layers, mem), layout=layout),
        )
    c.add(
        cat,
        "mla-full",
        "MLA + F same block: one wrapper (FullAttention base)",
        request(W([mla("m.0"), mla("m.1"), full("f.0"), full("f.1")], 4 * GIB), layout="BLHNC"),
    )
    c.add(
        cat,
        "mla-full-lbnhc",
        "MLA + F same block on LBNHC (mixed pages)",
        request(W([mla("m.0"), full("f.0")], 4 * GIB)),
    )
    c.add(
        cat,
        "sink-full",
        "sink + full: uniform type",
        request(W([sink("s.0"), full("f.0", 4), full("f.1")], 4 * GIB), layout="BLHNC"),
    )
    c.add(
        cat,
        "rswa-full",
        "RSWA + full (FullAttention base)",
        request(W([rswa("r.0"), rswa("r.1"), full("f.0")], 4 * GIB)),
    )
    c.add(
        cat,
        "sw-mixed-heads",
        "SW(1024) with 8 and 4 heads",
        request(W([sw("s.0", 1024), sw("s.1", 1024, 4)], 4 * GIB), layout="BLHNC"),
    )
    c.add(
        cat,
        "sw-two-windows",
        "SW(1024) + SW(2048): not uniform type",
        request(W([sw("s.0", 1024), sw("s.1", 2048)], 4 * GIB)),
    )
    c.add(
        cat,
        "dcp-mixed",
        "F dcp_sharded + F not sharded (different dcp flag)",
        request(W([full("f.0"), full("f.1", a={"dcp_sharded": False})], 4 * GIB)),
    )
    c.add(
        cat,
        "sink-tps",
        "sink with tokens_per_state 2 (sink merge resets it)",
        request(W([sink("s.0", a={"tokens": 2}), sink("s.1", a={"tokens": 2})], 4 * GIB)),
    )
    c.add(
        cat,
        "sink-tps-hybrid",
        "sink tokens_per_state 2 + SW (hybrid merge)",
        request(W([sink("s.0", a={"tokens": 2}), sw("w.0", 512), sw("w.1", 512)], 4 * GIB)),
    )


def _local_builder(kind: int, window: int) -> Callable[[str], Layer]:
    """Local-attention layer factories for the hybrid ratios."""

    def build(name: str) -> Layer:
        if kind == 1:
            return chunked(name, window * 2)
        if kind == 2:
            return sw(name, window, 4)
        if kind == 3:
            return sw(name, window, 8, 96)
        return sw(name, window)

    return build


def _hybrid(c: Cases) -> None:
    cat = "hybrid"
    ratios = [
        ("5to1", lambda i: i % 6 == 5, 48),
        ("3to1", lambda i: i % 4 == 3, 48),
        ("2to1", lambda i: i % 3 == 0, 30),
        ("1to1", lambda i: i % 2 == 1, 24),
        ("5to1-62", lambda i: i % 6 == 5, 62),
        ("3to1-odd", lambda i: i % 4 == 3, 46),
        ("7to1", lambda i: i % 8 == 7, 40),
    ]
    for name, is_full, n in ratios:
        for variant in range(4):
            window = c.pick([128, 512, 1024, 4096])
            batched = c.pick([0, 2048, 8192])
            mml = c.pick([8192, 32768, 131072])
            mem = c.pick([2 * GIB, 12 * GIB, 40 * GIB])
            local_kind = variant % 4
            local = _local_builder(local_kind, window)
            kind = ["sw", "chunked", "sw-4heads", "sw-head96"][local_kind]
            c.add(
                cat,
                f"{name}-{kind}",
                f"{n} layers {name} full:{kind}, window {window}",
                request(W(pattern(n, is_full, local), mem), max_model_len=mml, batched=batched),
            )
    c.add(
        cat,
        "12sw-13f",
        "12 SW + 13 F (gpt-oss + eagle): group size 13",
        request(
            W([sw(f"s.{i}", 128) for i in range(12)] + [full(f"f.{i}") for i in range(13)], 8 * GIB)
        ),
    )
    c.add(
        cat,
        "20f-30sw",
        "20 F then 30 SW: group size 20",
        request(
            W(
                [full(f"f.{i}") for i in range(20)] + [sw(f"s.{i}", 1024) for i in range(30)],
                54 * GIB,
            )
        ),
    )
    c.add(
        cat,
        "2sw-3f",
        "2 SW + 3 F: group size 2, padding",
        request(
            W([sw("s.0", 512), full("f.0"), sw("s.1", 512), full("f.1"), full("f.2")], 2 * GIB)
        ),
    )
    c.add(
        cat,
        "three-kinds",
        "F + SW + chunked, 1:1:1",
        request(W([full("f.0"), sw("s.0", 1024), chunked("c.0", 2048)] * 1, 4 * GIB)),
    )
    c.add(
        cat,
        "identical-mla-sw",
        "2 identical MLA + 1 SW-MLA: three groups of one",
        request(W([mla("m.0"), mla("m.1"), sw_mla("s.0", 128)], 4 * GIB)),
    )
    c.add(
        cat,
        "sink-sw",
        "sink + SW",
        request(W([sink("k.0"), sw("s.0", 1024), sink("k.1"), sw("s.1", 1024)], 4 * GIB)),
    )
    c.add(
        cat,
        "rswa-sw",
        "RSWA + SW",
        request(W([rswa("r.0"), sw("s.0", 1024), rswa("r.1"), sw("s.1", 1024)], 4 * GIB)),
    )
    c.add(
        cat,
        "cross-full",
        "decoder F + cross-attention (whisper-like)",
        request(
            W(
                [full(f"d.{i}", 8, 64) for i in range(4)] + [cross(f"x.{i}") for i in range(4)],
                2 * GIB,
            ),
            encoder_tokens=1500,
        ),
    )
    c.add(
        cat,
        "circular-full",
        "F + circular buffer ring",
        request(W([full("f.0"), full("f.1"), circular("r.0", 2, 256, block=16)], 2 * GIB)),
    )
    c.add(
        cat,
        "window-meta-coalesce",
        "F + F(window meta) + SW: coalesced full bucket",
        request(
            W([full("f.0"), full("f.1", window=2048), sw("s.0", 1024), sw("s.1", 1024)], 4 * GIB)
        ),
    )
    for i in range(10):
        n_f = c.pick([2, 3, 4, 6, 10])
        n_s = c.pick([3, 5, 7, 9, 13, 20])
        layers = [full(f"f.{j}") for j in range(n_f)] + [sw(f"s.{j}", 256) for j in range(n_s)]
        c.rng.shuffle(layers)
        c.add(
            cat,
            f"random-{i:02d}",
            f"{n_f} F + {n_s} SW shuffled",
            request(W(layers, c.pick([GIB, 8 * GIB])), max_model_len=c.pick([4096, 16384])),
        )


def _page_unify(c: Cases) -> None:
    cat = "page_unify"
    for i, (fh, sh) in enumerate([(8, 4), (8, 2), (16, 4), (4, 1)]):
        c.add(
            cat,
            f"divisible-{i}",
            f"F({fh}) + SW({sh} heads): SW block scaled",
            request(
                W(
                    [full(f"f.{j}", fh) for j in range(4)]
                    + [sw(f"s.{j}", 1024, sh) for j in range(8)],
                    4 * GIB,
                )
            ),
        )
    for i, (fhead, shead) in enumerate([(96, 128), (80, 128), (128, 192), (64, 80)]):
        c.add(
            cat,
            f"padding-{i}",
            f"F head {fhead} + SW head {shead}: page padding",
            request(
                W(
                    [full(f"f.{j}", 8, fhead) for j in range(3)]
                    + [sw(f"s.{j}", 1024, 8, shead) for j in range(3)],
                    4 * GIB,
                )
            ),
        )
    c.add(
        cat,
        "mla-impossible",
        "MLA (18,432) + F (24,576): NotImplementedError",
        request(W([mla("m.0", block=64, a={"tokens": 4}), full("f.0", 1, 384, block=32)], 4 * GIB)),
    )
    c.add(
        cat,
        "mla-sw-fallback",
        "MLA + SW non-divisible: full-allocation fallback",
        request(
            W(
                [
                    mla("m.0", block=64, a={"tokens": 4}),
                    mla("m.1", block=64, a={"tokens": 4}),
                    sw("s.0", 1024, 1, 384, block=32),
                ],
                4 * GIB,
            )
        ),
    )
    c.add(
        cat,
        "mla-sw-fallback-chunk",
        "MLA + SW + chunked: no fallback",
        request(
            W(
                [
                    mla("m.0", block=64, a={"tokens": 4}),
                    sw("s.0", 1024, 1, 384, block=32),
                    chunked("c.0", 4096, 1, 384, block=32),
                ],
                4 * GIB,
            )
        ),
    )
    c.add(
        cat,
        "mla-divisible",
        "MLA(36,864 fp8) + SW 73,728: MLA block scaled",
        request(
            W(
                [
                    mla(
                        "m.0", block=64, cache_dtype=spec_pb2.KV_CACHE_DTYPE_FP8, a={"dtype": "u8"}
                    ),
                    sw("s.0", 1024, 1, 576, block=64),
                ],
                4 * GIB,
            )
        ),
    )
    c.add(
        cat,
        "mamba-pad",
        "Mamba 16,384 + F 65,536: Mamba padded",
        request(W([mamba(f"m.{i}") for i in range(3)] + [full("f.0")], 4 * GIB)),
    )
    c.add(
        cat,
        "mamba-bigger",
        "Mamba 536,576 + F 65,536: F padded (not divisible)",
        request(
            W([mamba(f"m.{i}", GDN_STATES) for i in range(3)] + [full("f.0")], 8 * GIB),
            mamba_align=True,
        ),
    )
    c.add(
        cat,
        "mamba-bigger-divisible",
        "Mamba 131,072 + F 65,536: F block doubles",
        request(
            W([mamba(f"m.{i}", [([32768], "fp32")]) for i in range(3)] + [full("f.0")], 8 * GIB),
            mamba_align=True,
        ),
    )
    c.add(
        cat,
        "mamba-mla-impossible",
        "Mamba bigger than MLA non-divisible: error",
        request(
            W([mamba("m.0", [([10000], "fp32")]), mla("l.0", block=16)], 8 * GIB), mamba_align=True
        ),
    )
    c.add(
        cat,
        "hidden-scaled",
        "hidden state with per-token above common page",
        request(W([full("f.0", 1), sw("s.0", 1024, 1), hidden("h.0", 1, 24576)], 4 * GIB)),
    )
    c.add(
        cat,
        "hidden-two",
        "two hidden-state layers next to hybrid groups",
        request(
            W(
                [full("f.0"), sw("s.0", 512), hidden("h.0", 1, 4096), hidden("h.1", 1, 2048)],
                4 * GIB,
            )
        ),
    )
    c.add(
        cat,
        "hidden-only-uniform",
        "F + hidden-state only (uniform type)",
        request(W([full("f.0"), hidden("h.0", 1, 4096)], 4 * GIB)),
    )
    c.add(
        cat,
        "hidden-packed",
        "hidden state on the packed path (BLHNC)",
        request(
            W([full("f.0"), sw("s.0", 512, 4), hidden("h.0", 1, 4096)], 4 * GIB), layout="BLHNC"
        ),
    )
    for i in range(8):
        heads = [c.pick([1, 2, 4, 8]) for _ in range(3)]
        heads_ = sorted(set(heads))
        layers = []
        for j, h in enumerate(heads_):
            layers += [sw(f"s{j}.{k}", 512, h) for k in range(2)]
        layers += [full(f"f.{k}", c.pick([2, 8])) for k in range(2)]
        c.add(
            cat,
            f"random-{i}",
            f"SW heads {heads_} + F: unification",
            request(W(layers, c.pick([GIB, 4 * GIB]))),
        )


def _mla(c: Cases) -> None:
    cat = "mla"
    variants: list[tuple[str, dict[str, Any]]] = [
        ("bf16", {}),
        ("fp8", {"cache_dtype": spec_pb2.KV_CACHE_DTYPE_FP8, "a": {"dtype": "u8"}}),
        (
            "fp8_ds_mla",
            {
                "cache_dtype": spec_pb2.KV_CACHE_DTYPE_FP8_DS_MLA,
                "a": {"dtype": "u8", "content": 656},
            },
        ),
        (
            "nvfp4_ds_mla",
            {
                "cache_dtype": spec_pb2.KV_CACHE_DTYPE_NVFP4_DS_MLA,
                "a": {"dtype": "u8", "content": 352, "quant": 10},
            },
        ),
        ("align576", {"alignment": 576}),
        ("align4096", {"alignment": 4096, "a": {"tokens": 4}}),
        ("tps4", {"a": {"tokens": 4}}),
        ("tps128", {"a": {"tokens": 128}}),
        ("topk", {"topk": 2048}),
        ("dsv4", {"version": "deepseek_v4", "alignment": 576}),
        ("indexer", {"indexer": True, "a": {"head": 128}}),
    ]
    for name, variant in variants:
        a = dict(variant.get("a", {}))
        head = a.pop("head", 576)
        kw = {k: v for k, v in variant.items() if k != "a"}
        for block in (16, 64):
            layers = [mla(f"model.layers.{i}.attn", head, a=a, block=block, **kw) for i in range(4)]
            c.add(
                cat,
                f"{name}-b{block}",
                f"4 MLA {name} block {block}",
                request(W(layers, 2 * GIB), max_model_len=16384),
            )
    c.add(
        cat,
        "mla-mixed-dtype",
        "MLA bf16 + MLA fp8 strings: not uniform",
        request(
            W(
                [
                    mla("m.0"),
                    mla("m.1", cache_dtype=spec_pb2.KV_CACHE_DTYPE_FP8, a={"dtype": "u8"}),
                ],
                2 * GIB,
            ),
            layout="BLHNC",
        ),
    )
    c.add(
        cat,
        "mla-marker",
        "MLA with non_causal_multi_token_decode marker, eagle",
        request(
            W([mla(f"m.{i}") for i in range(3)] + [mla("mtp.0", marker=True)], 2 * GIB),
            method="eagle",
        ),
    )
    c.add(
        cat,
        "mla-marker-draft",
        "MLA marker + is_draft, mtp",
        request(
            W([mla(f"m.{i}") for i in range(3)] + [mla("mtp.0", marker=True, draft=True)], 2 * GIB),
            method="mtp",
        ),
    )
    for i, window in enumerate((128, 512)):
        c.add(
            cat,
            f"sw-mla-{window}",
            f"SW-MLA({window}) + MLA",
            request(
                W(
                    [sw_mla(f"s.{j}", window) for j in range(4)]
                    + [mla(f"m.{j}") for j in range(4)],
                    2 * GIB,
                )
            ),
        )
        c.add(
            cat,
            f"sw-mla-only-{i}",
            f"SW-MLA({window}) only, bounded replay {bool(i)}",
            request(
                W([sw_mla(f"s.{j}", window, bounded_replay=bool(i)) for j in range(4)], 2 * GIB)
            ),
        )
    c.add(
        cat,
        "sw-mla-bad-version",
        "SW-MLA model_version 'other' (assertion)",
        request(W([sw_mla("s.0", 128, version="other")], 2 * GIB)),
    )
    c.add(
        cat,
        "sw-mla-quant",
        "SW-MLA with kv_quant_mode (merge drops it)",
        request(
            W(
                [
                    sw_mla("s.0", 128, a={"quant": 1, "dtype": "u8"}),
                    sw_mla("s.1", 128, a={"quant": 1, "dtype": "u8"}),
                    mla("m.0"),
                ],
                2 * GIB,
            )
        ),
    )
    c.add(
        cat,
        "sw-mla-dcp",
        "SW-MLA with DCP 2 (sharded): assertion",
        request(W([sw_mla("s.0", 128), mla("m.0")], 2 * GIB), dcp=2, tp=2),
    )


def _packed(c: Cases) -> None:
    cat = "packed"
    for layout in ("BLHNC", "BLNHC", "BHLNC"):
        c.add(
            cat,
            f"dsv4-{layout}",
            f"§3.5 packed example on {layout}",
            request(W(dsv4_packed(), GIB), layout=layout),
        )
        c.add(
            cat,
            f"dsv4-mtp-{layout}",
            f"§3.5 packed example + MTP on {layout}",
            request(W(dsv4_packed(mtp=True), GIB), layout=layout),
        )
        c.add(
            cat,
            f"mixed-{layout}",
            f"F(8) + SW(4 heads) mixed pages on {layout}",
            request(
                W(pattern(12, lambda i: i % 3 == 0, lambda n: sw(n, 1024, 4)), 4 * GIB),
                layout=layout,
            ),
        )
        c.add(
            cat,
            f"mamba-{layout}",
            f"Mamba + F mixed pages on {layout}",
            request(
                W([mamba(f"m.{i}") for i in range(6)] + [full("f.0"), full("f.1")], 4 * GIB),
                layout=layout,
                mamba_align=True,
            ),
        )
        c.add(
            cat,
            f"circ-{layout}",
            f"circular + F + SW on {layout}",
            request(
                W([full("f.0"), sw("s.0", 256, 4), circular("r.0", block=16)], 4 * GIB),
                layout=layout,
            ),
        )
    for i in range(12):
        n = c.pick([4, 6, 8, 10])
        tps = c.pick([(4, 128), (4, 64), (2, 8)])
        layout = c.pick(["BLHNC", "BLNHC", "BHLNC"])
        mtp = c.pick([False, True])
        layers: list[Layer] = []
        for j in range(n):
            layers.append(sw_mla(f"l.{j}.swa", c.pick([64, 128]) if j == 0 else 128, block=64))
            layers.append(mla(f"l.{j}.mla", block=256, a={"tokens": tps[j % 2]}))
        if mtp:
            layers.append(sw_mla("mtp.swa", 128, block=64))
            layers.append(mla("mtp.mla", block=256, a={"tokens": tps[0]}))
        c.add(
            cat,
            f"random-{i:02d}",
            f"packed {n} SW-MLA+MLA tps {tps} mtp={mtp} {layout}",
            request(
                W(layers, c.pick([GIB, 3 * GIB])),
                layout=layout,
                method=c.pick(["none", "mtp", "eagle"]),
            ),
        )
    c.add(
        cat,
        "gcd-bucket",
        "packed with unbalanced bucket and SW state bucket",
        request(
            W(
                [full(f"f.{i}", 8) for i in range(3)]
                + [full(f"g.{i}", 4) for i in range(2)]
                + [sw(f"s.{i}", 512, 2) for i in range(7)],
                2 * GIB,
            ),
            layout="BLHNC",
        ),
    )
    c.add(
        cat,
        "align-lcm",
        "packed with byte alignments (lcm round-up)",
        request(
            W([full("f.0", align_bytes=4096), sw("s.0", 512, 4, align_bytes=6144)], 2 * GIB),
            layout="BLHNC",
        ),
    )


def _layout_errors(c: Cases) -> None:
    cat = "layout"
    mixed = [full("a.0"), full("a.1"), full("b.0", 4), full("b.1", 4)]
    for layout in ("LHBNC", "LBHNC", "LBNHC"):
        c.add(
            cat,
            f"uniform-type-{layout}",
            f"uniform-type mixed pages on {layout}",
            request(W(mixed, GIB), layout=layout),
        )
    hybrid_mixed = [full("f.0"), sw("s.0", 512, 4), sw("s.1", 512, 4)]
    for layout in ("LHBNC", "LBHNC", "LBNHC"):
        c.add(
            cat,
            f"unified-{layout}",
            f"hybrid unified pages on {layout}",
            request(W(hybrid_mixed, GIB), layout=layout),
        )
    c.add(
        cat,
        "padded-lhbnc",
        "padded pages (head 96) on LHBNC",
        request(W([full("f.0", 8, 96), sw("s.0", 512)], GIB), layout="LHBNC"),
    )
    c.add(
        cat,
        "padded-lbhnc",
        "padded pages (head 96) on LBHNC",
        request(W([full("f.0", 8, 96), sw("s.0", 512)], GIB), layout="LBHNC"),
    )
    c.add(
        cat,
        "mamba-lhbnc",
        "Mamba padded next to F on LHBNC",
        request(W([mamba("m.0"), full("f.0")], GIB), layout="LHBNC"),
    )
    c.add(
        cat,
        "slots-padded-lhbnc",
        "padded page with 4 head slots on LHBNC",
        request(W([full("f.0", a={"padded": 70000, "slots": 4})], GIB), layout="LHBNC"),
    )
    c.add(
        cat,
        "hidden-lhbnc",
        "hidden-state aligned pages on LHBNC",
        request(W([full("f.0"), sw("s.0", 512), hidden("h.0", 1, 6144)], GIB), layout="LHBNC"),
    )


def _disable_hybrid(c: Cases) -> None:
    cat = "disable_hybrid"
    cases: list[tuple[str, str, list[Layer]]] = [
        ("f-sw", "F + SW(1024)", [full("f.0"), sw("s.0", 1024), sw("s.1", 1024)]),
        ("f-chunk", "F + chunked(8192)", [full("f.0"), chunked("c.0", 8192)]),
        (
            "f-sw-chunk",
            "F + SW + chunked: wrapper",
            [full("f.0"), sw("s.0", 1024), chunked("c.0", 8192)],
        ),
        (
            "two-windows",
            "F + SW1024 + SW2048: error",
            [full("f.0"), sw("s.0", 1024), sw("s.1", 2048)],
        ),
        ("sw-only", "SW1024 + SW2048 only: error", [sw("s.0", 1024), sw("s.1", 2048)]),
        ("mamba-f", "Mamba + F: error", [mamba("m.0", padded=65536), full("f.0")]),
        ("mla-swmla", "MLA + SW-MLA: promoted to MLA", [mla("m.0"), sw_mla("s.0", 128)]),
        ("f-sw-heads", "F(8) + SW(4 heads): wrapper", [full("f.0"), sw("s.0", 1024, 4)]),
        ("f-sw-blocks", "F block 32 + SW block 16", [full("f.0", block=32), sw("s.0", 1024)]),
        (
            "f-sw-padded",
            "F + padded SW (head 96)",
            [full("f.0"), sw("s.0", 1024, 8, 96, a={"padded": 65536})],
        ),
        ("uniform", "already uniform: no warning", llama(4)),
        (
            "f-sw-replicated",
            "F + SW + replicated draft F (dcp_sharded False)",
            [full("f.0"), sw("s.0", 1024), full("d.0", a={"dcp_sharded": False}, draft=True)],
        ),
        (
            "f-sw-replicated-sw",
            "F + SW + replicated SW draft",
            [full("f.0"), sw("s.0", 1024), sw("d.0", 512, a={"dcp_sharded": False}, draft=True)],
        ),
        ("sink-sw", "sink + SW", [sink("k.0"), sw("s.0", 512)]),
        (
            "f-f-blocks-sw",
            "F block 16 + F block 32 + SW",
            [full("f.0"), full("f.1", block=32), sw("s.0", 512)],
        ),
        ("gemma", "Gemma-like 5:1", pattern(24, lambda i: i % 6 == 5, lambda n: sw(n, 1024))),
    ]
    for cid, desc, layers in cases:
        c.add(cat, cid, f"disable HMA: {desc}", request(W(layers, 4 * GIB), disable_hybrid=True))


def _pipeline(c: Cases) -> None:
    cat = "pipeline"
    for n_workers in (2, 3, 4):
        for variant in range(6):
            n_layers = c.pick([16, 24, 32, 48])
            per = n_layers // n_workers
            kind = variant % 3
            workers = []
            names = list(range(n_layers))
            for w in range(n_workers):
                own = names[w * per : (w + 1) * per] if w < n_workers - 1 else names[w * per :]
                if kind == 0:
                    layers = [full(f"model.layers.{i}.attn") for i in own]
                elif kind == 1:
                    layers = [
                        full(f"model.layers.{i}.attn")
                        if i % 4 == 3
                        else sw(f"model.layers.{i}.attn", 1024)
                        for i in own
                    ]
                else:
                    layers = [full(f"model.layers.{i}.attn", 8 if i % 2 else 4) for i in own]
                mem = c.pick([2 * GIB, 5 * GIB + 4097, 10 * GIB, 20 * GIB])
                workers.append(W(layers, mem))
            kind_name = ["full", "hybrid", "uniform-type"][kind]
            c.add(
                cat,
                f"pp{n_workers}-{kind_name}-{variant}",
                f"PP {n_workers} workers, {n_layers} layers, {kind_name}, unequal memory",
                request(
                    workers,
                    pp=n_workers,
                    max_model_len=c.pick([4096, 8192, 32768]),
                    override=c.pick([None, None, None, 2000]),
                ),
            )
    c.add(
        cat,
        "pp-strided",
        "PP {f0,s0,s1} / {f1,s2,s3}: strided groups",
        request(
            [
                W([full("full.0"), sw("sw.0", 512), sw("sw.1", 512)], 2 * GIB),
                W([full("full.1"), sw("sw.2", 512), sw("sw.3", 512)], 3 * GIB),
            ],
            pp=2,
        ),
    )
    c.add(
        cat,
        "pp-conflict",
        "PP same layer name with different specs (assertion)",
        request([W([full("x.0")], 2 * GIB), W([full("x.0", 4)], 2 * GIB)], pp=2),
    )
    c.add(
        cat,
        "pp-same-layer",
        "PP same layer on both workers (TP-like)",
        request([W(llama(4), 2 * GIB), W(llama(4), 3 * GIB)], pp=2),
    )
    c.add(
        cat,
        "pp-empty-worker",
        "PP with a worker that has no layers",
        request([W(llama(4), 2 * GIB), W([], 3 * GIB)], pp=2),
    )
    c.add(
        cat,
        "pp-one-tight",
        "PP one worker too small: error names it",
        request([W(llama(16), 20 * GIB), W(llama(16, prefix="m2"), 100 * MIB)], pp=2),
    )
    c.add(
        cat,
        "pp-autofit",
        "PP auto-fit limited by the smaller worker",
        request(
            [W(llama(16), 2 * GIB), W(llama(16, prefix="m2"), GIB)],
            pp=2,
            max_model_len=-1,
            derived=131072,
        ),
    )
    c.add(
        cat,
        "pp-ranks-reversed",
        "PP workers listed in reverse rank order",
        request([W(llama(8, prefix="b"), 3 * GIB, rank=1), W(llama(8), 2 * GIB, rank=0)], pp=2),
    )
    c.add(
        cat,
        "pp-mamba",
        "PP hybrid Mamba + F",
        request(
            [
                W([mamba(f"m.{i}") for i in range(3)] + [full("f.0")], 2 * GIB),
                W([mamba(f"m.{i}") for i in range(3, 6)] + [full("f.1")], 2 * GIB),
            ],
            pp=2,
            mamba_align=True,
        ),
    )
    c.add(
        cat,
        "pp-packed",
        "PP on the packed path (BLHNC)",
        request(
            [
                W(dsv4_packed(4), GIB),
                W(
                    dsv4_packed(4)[:0]
                    + [sw_mla(f"b.{i}.swa", 128, block=64) for i in range(4)]
                    + [
                        mla(f"b.{i}.mla", block=256, a={"tokens": 4 if i % 2 == 0 else 128})
                        for i in range(4)
                    ],
                    2 * GIB,
                ),
            ],
            pp=2,
            layout="BLHNC",
        ),
    )
    c.add(
        cat,
        "pp-async-v2",
        "PP 2 async V2 runner, SW layers",
        request(
            [
                W(pattern(8, lambda i: i % 2 == 0, lambda n: sw(n, 2048)), 4 * GIB),
                W([sw(f"b.{i}", 2048) if i % 2 else full(f"b.{i}") for i in range(8)], 4 * GIB),
            ],
            pp=2,
            async_scheduling=True,
            v2_runner=True,
            max_model_len=32768,
        ),
    )


def _spec_decode(c: Cases) -> None:
    cat = "spec_decode"
    methods = ["eagle", "eagle3", "mtp", "dspark", "dflash", "ngram", "suffix", "draft_model"]
    targets: list[tuple[str, Callable[[bool], list[Layer]], bool]] = [
        ("uniform", lambda d: [*llama(8), full("draft.0", draft=d)], False),
        ("uniform-type", lambda d: [*llama(8), full("draft.0", 4, draft=d)], False),
        (
            "hybrid",
            lambda d: (
                [
                    *pattern(12, lambda i: i % 3 == 0, lambda n: sw(n, 1024)),
                    full("draft.0", draft=d),
                ]
            ),
            False,
        ),
        (
            "hybrid-sw-draft",
            lambda d: (
                [
                    *pattern(12, lambda i: i % 3 == 0, lambda n: sw(n, 1024)),
                    sw("draft.0", 1024, draft=d),
                ]
            ),
            False,
        ),
        ("qwen35", lambda d: qwen35(draft=d), True),
        (
            "mamba-gdn",
            lambda d: (
                [mamba(f"m.{i}", padded=65536) for i in range(6)]
                + [full("f.0"), full("f.1"), full("draft.0", draft=d)]
            ),
            True,
        ),
    ]
    for tname, build, align in targets:
        for method in methods:
            for draft in (False, True):
                if method in ("ngram", "suffix") and draft:
                    continue
                c.add(
                    cat,
                    f"{tname}-{method}-{'draft' if draft else 'nodraft'}",
                    f"{tname} target, {method}, is_draft={draft}",
                    request(
                        W(build(draft), 4 * GIB),
                        method=method,
                        spec_tokens=c.pick([1, 2, 3, 4]),
                        mamba_align=align,
                    ),
                )
    for tname, build, align in targets:
        for method in ("eagle", "mtp", "dspark"):
            c.add(
                cat,
                f"{tname}-{method}-nodrop",
                f"{tname}, {method}, disable_eagle_block_drop",
                request(
                    W(build(True), 4 * GIB),
                    method=method,
                    disable_block_drop=True,
                    mamba_align=align,
                ),
            )
    # Multi-module MTP: extra retained tokens on sliding windows.
    for k, nextn in ((1, 1), (3, 1), (3, 3), (4, 2), (5, 5), (2, 4)):
        c.add(
            cat,
            f"mtp-multi-k{k}-n{nextn}",
            f"MTP k={k} nextn={nextn} with SW layers",
            request(
                W(
                    [
                        *pattern(12, lambda i: i % 3 == 0, lambda n: sw(n, 512)),
                        sw("mtp.0", 512, draft=True),
                    ],
                    4 * GIB,
                ),
                method="mtp",
                spec_tokens=k,
                nextn=nextn,
                batched=2048,
                max_model_len=32768,
            ),
        )
        c.add(
            cat,
            f"mtp-multi-swmla-k{k}-n{nextn}",
            f"MTP k={k} nextn={nextn} SW-MLA",
            request(
                W(
                    [sw_mla(f"s.{i}", 128) for i in range(4)] + [mla(f"m.{i}") for i in range(4)],
                    4 * GIB,
                ),
                method="mtp",
                spec_tokens=k,
                nextn=nextn,
                max_model_len=16384,
            ),
        )
    c.add(
        cat,
        "eagle-multi-module-flag",
        "eagle with nextn 3 (not MTP: lookahead 1)",
        request(
            W(pattern(6, lambda i: i % 3 == 0, lambda n: sw(n, 512)), 4 * GIB),
            method="eagle",
            spec_tokens=3,
            nextn=3,
        ),
    )
    for mt in ("deepseek_v4", "deepseek_v41", "qwen3_5", ""):
        c.add(
            cat,
            f"trailing-{mt or 'none'}-eagle",
            f"trailing-layer rule candidate, target {mt}",
            request(
                W(dsv4_packed(mtp=True), 2 * GIB),
                layout="BLHNC",
                method="eagle",
                target_model_type=mt,
            ),
        )
    c.add(
        cat,
        "alternating-eagle3-nodraft",
        "SW/F + eagle3 without draft: every group drops",
        request(
            W(pattern(12, lambda i: i % 2 == 0, lambda n: sw(n, 128)), 4 * GIB), method="eagle3"
        ),
    )


def _memory(c: Cases) -> None:
    cat = "memory"
    hybrid = pattern(30, lambda i: i % 3 == 0, lambda n: sw(n, 4096))
    for i in range(12):
        mem = c.pick([0, 1, 65535, 2 * MIB, 100 * MIB, 512 * MIB, GIB, 2 * GIB + 1])
        mml = c.pick([1024, 8192, 32768, 131072])
        layers = llama() if i % 2 == 0 else hybrid
        c.add(
            cat,
            f"tight-{i:02d}",
            f"tight memory {mem} B len {mml}",
            request(W(layers, mem), max_model_len=mml, batched=8192),
        )
    c.add(
        cat,
        "negative",
        "non-KV above the budget: negative available",
        request(W(llama(), total=80 * GIB, utilization=0.5, non_kv=(40 * GIB, GIB, 0, 0))),
    )
    c.add(
        cat,
        "default-utilization",
        "no memory fields: utilization 0.92 of 80 GiB",
        request(W(llama(), total=80 * GIB)),
    )
    for i, util in enumerate((0.3, 0.5, 0.85, 0.9, 0.95, 1.0)):
        c.add(
            cat,
            f"util-{i}",
            f"utilization {util}, weights + activation + non-torch + graphs",
            request(
                W(
                    llama(),
                    total=c.pick([24 * GIB, 80 * GIB, 141 * GIB]),
                    utilization=util,
                    non_kv=(c.pick([2, 8, 16]) * GIB, 512 * MIB, 300 * MIB, 100 * MIB),
                )
            ),
        )
    for i, override in enumerate((1, 2, 64, 513, 1000, 100000)):
        c.add(
            cat,
            f"override-{i}",
            f"num_gpu_blocks_override {override}",
            request(W(llama(), 54 * GIB), override=override),
        )
    c.add(
        cat,
        "override-hybrid",
        "override on hybrid",
        request(W(hybrid, 54 * GIB), override=5000, max_model_len=32768),
    )
    for i in range(10):
        derived = c.pick([4096, 32768, 131072, 1 << 20])
        mem = c.pick([64 * MIB, 512 * MIB, GIB, 5 * GIB, 80 * GIB])
        layers = [
            llama(),
            hybrid,
            pattern(62, lambda j: j % 6 == 5, lambda n: sw(n, 1024, 16), heads=16),
        ][i % 3]
        c.add(
            cat,
            f"autofit-{i:02d}",
            f"auto-fit derived {derived}, {mem} B",
            request(W(layers, mem), max_model_len=-1, derived=derived, batched=8192),
        )
    c.add(
        cat,
        "autofit-impossible",
        "auto-fit with one block of memory",
        request(W(llama(), 2 * 2097152), max_model_len=-1, derived=8192),
    )
    c.add(
        cat,
        "autofit-override",
        "auto-fit with override",
        request(W(llama(), 54 * GIB), max_model_len=-1, derived=131072, override=3000),
    )
    c.add(
        cat,
        "autofit-mamba-none",
        "auto-fit Mamba none mode (block = derived)",
        request(
            W([mamba(f"m.{i}") for i in range(3)] + [full("f.0", 2, 64)], GIB),
            max_model_len=-1,
            derived=65536,
        ),
    )
    c.add(
        cat,
        "exactly-one-request",
        "memory exactly one request + null block",
        request(W(llama(), 512 * 2097152 + 2097152)),
    )
    c.add(
        cat,
        "one-short",
        "memory one byte short of one request + null block",
        request(W(llama(), 512 * 2097152 + 2097152 - 1)),
    )


def _sliding_of_worker(worker: int) -> Callable[[str], Layer]:
    """Sliding-window layers named after their pipeline stage."""
    return lambda name: sw(f"w{worker}.{name}", 2048)


def _parallel(c: Cases) -> None:
    cat = "parallel"
    for dcp in (2, 4, 8):
        c.add(
            cat,
            f"dcp{dcp}-full",
            f"DCP {dcp}, F layers",
            request(W(llama(8), 4 * GIB), dcp=dcp, tp=dcp, max_model_len=32768),
        )
        c.add(
            cat,
            f"dcp{dcp}-replicated",
            f"DCP {dcp}, F not DCP-sharded",
            request(W(llama(8, a={"dcp_sharded": False}), 4 * GIB), dcp=dcp, tp=dcp),
        )
        c.add(
            cat,
            f"dcp{dcp}-sw",
            f"DCP {dcp} with SW (assertion)",
            request(W([full("f.0"), sw("s.0", 1024)], 4 * GIB), dcp=dcp, tp=dcp),
        )
        c.add(
            cat,
            f"dcp{dcp}-sw-replicated",
            f"DCP {dcp} with replicated SW",
            request(
                W([full("f.0"), sw("s.0", 1024, a={"dcp_sharded": False})], 4 * GIB),
                dcp=dcp,
                tp=dcp,
            ),
        )
        c.add(
            cat,
            f"dcp{dcp}-mamba",
            f"DCP {dcp} Mamba + F",
            request(
                W([mamba("m.0"), mamba("m.1"), full("f.0", 2, 64)], 4 * GIB),
                dcp=dcp,
                tp=dcp,
                mamba_align=True,
            ),
        )
        c.add(
            cat,
            f"dcp{dcp}-draft-replicated",
            f"DCP {dcp} with replicated draft, BLHNC",
            request(
                W([*llama(4), full("d.0", 4, a={"dcp_sharded": False}, draft=True)], 4 * GIB),
                dcp=dcp,
                tp=dcp,
                layout="BLHNC",
                method="eagle",
            ),
        )
    for tp, shards in ((2, 1), (4, 2), (8, 1), (8, 8), (4, 3)):
        c.add(
            cat,
            f"tp{tp}-shards{shards}",
            f"TP {tp}, max_tp_shards {shards}",
            request(W(llama(4, a={"tp_shards": shards}), 4 * GIB), tp=tp),
        )
    c.add(
        cat,
        "tp-mixed-shards",
        "TP 8, layers with shards 2 and 4",
        request(
            W([full("f.0", a={"tp_shards": 2}), full("f.1", a={"tp_shards": 4})], 4 * GIB),
            tp=8,
            layout="BLHNC",
        ),
    )
    for async_, v2, pp in (
        (True, False, 1),
        (True, True, 1),
        (True, False, 2),
        (True, True, 2),
        (False, True, 2),
        (False, False, 3),
    ):
        workers = [
            W(pattern(6, lambda i: i % 3 == 0, _sliding_of_worker(w)), 4 * GIB) for w in range(pp)
        ]
        c.add(
            cat,
            f"async{int(async_)}-v2{int(v2)}-pp{pp}",
            f"async={async_} v2={v2} pp={pp}: in-flight tokens",
            request(
                workers,
                async_scheduling=async_,
                v2_runner=v2,
                pp=pp,
                batched=4096,
                max_model_len=65536,
            ),
        )


def _mamba(c: Cases) -> None:
    cat = "mamba"
    for align in (True, False):
        mode = "align" if align else "none"
        for spec_blocks, ckpt in ((0, 0), (2, 0), (0, 3), (1, 1)):
            c.add(
                cat,
                f"only-{mode}-s{spec_blocks}-c{ckpt}",
                f"Mamba only, {mode}, spec {spec_blocks}, checkpoint {ckpt}",
                request(
                    W(
                        [
                            mamba(f"m.{i}", spec_blocks=spec_blocks, checkpoint_blocks=ckpt)
                            for i in range(4)
                        ],
                        GIB,
                    ),
                    mamba_align=align,
                ),
            )
        c.add(
            cat,
            f"gdn-hybrid-{mode}",
            f"GDN 3:1 hybrid, {mode}",
            request(
                W(
                    [
                        full(f"l.{i}", 2, 256, block=272)
                        if i % 4 == 3
                        else mamba(
                            f"l.{i}",
                            GDN_STATES,
                            padded=557056,
                            block=272,
                            mamba_type=spec_pb2.MAMBA_TYPE_GDN_ATTENTION,
                        )
                        for i in range(16)
                    ],
                    8 * GIB,
                ),
                mamba_align=align,
                max_model_len=32768,
            ),
        )
        c.add(
            cat,
            f"unpadded-hybrid-{mode}",
            f"Mamba without padding next to F, {mode}",
            request(
                W([mamba(f"m.{i}") for i in range(3)] + [full("f.0", 2, 64)] * 1, GIB),
                mamba_align=align,
            ),
        )
        c.add(
            cat,
            f"types-{mode}",
            f"Mamba1 + ShortConv (different types), {mode}",
            request(
                W(
                    [
                        mamba("a.0", mamba_type=spec_pb2.MAMBA_TYPE_MAMBA1),
                        mamba("b.0", mamba_type=spec_pb2.MAMBA_TYPE_SHORT_CONV),
                        full("f.0", 2, 64),
                    ],
                    GIB,
                ),
                mamba_align=align,
            ),
        )
        c.add(
            cat,
            f"different-pages-{mode}",
            f"two Mamba page sizes + F, {mode}",
            request(
                W([mamba("a.0"), mamba("b.0", [([1024], "fp32")]), full("f.0", 2, 64)], GIB),
                mamba_align=align,
            ),
        )
    c.add(
        cat,
        "tp-replicated",
        "Mamba tp_replicated next to sharded Mamba",
        request(
            W([mamba("a.0"), mamba("b.0", tp_replicated=True), full("f.0", 2, 64)], GIB),
            mamba_align=True,
            tp=2,
        ),
    )
    c.add(
        cat,
        "heads",
        "Mamba num_heads 4",
        request(W([mamba("a.0", heads=4), mamba("a.1", heads=4)], GIB), mamba_align=True),
    )
    c.add(
        cat,
        "checkpoint-alignment",
        "Mamba prefill_checkpoint_alignment 64",
        request(
            W(
                [
                    mamba("a.0", checkpoint_alignment=64, checkpoint_blocks=1),
                    mamba("a.1", checkpoint_alignment=64, checkpoint_blocks=1),
                ],
                GIB,
            ),
            mamba_align=True,
        ),
    )
    # Hybrids whose Mamba layers have prefill checkpoint blocks: the scheduler lets a
    # prompt's last chunk run past the checkpoint where it tests the backend can
    # export it there (against the cache block), the manager writes it only where
    # its own test passes (against the Mamba block).
    for mamba_block, attention_block, unit in ((64, 16, None), (256, 16, 8)):
        hybrid = request(
            W(
                [
                    *[
                        mamba(
                            f"a.{i}",
                            block=mamba_block,
                            checkpoint_alignment=16,
                            checkpoint_blocks=1,
                        )
                        for i in range(2)
                    ],
                    full("f.0", 2, 256, block=attention_block),
                ],
                GIB,
            ),
            mamba_align=True,
        )
        c.add(
            cat,
            f"checkpoint-alignment-hybrid-{mamba_block}-{attention_block}-unit{unit}",
            f"Mamba {mamba_block} with prefill checkpoint blocks (alignment 16) beside "
            f"{attention_block}-token full attention, prefix_match_unit {unit}",
            _with_unit(hybrid, unit),
        )
    c.add(
        cat,
        "padded-below",
        "Mamba page_size_padded below the real page (assertion)",
        request(W([mamba("a.0", padded=100)], GIB), mamba_align=True),
    )
    c.add(
        cat,
        "explicit-block",
        "Mamba with explicit block size in none mode",
        request(W([mamba("a.0", block=64), full("f.0", block=64)], GIB)),
    )
    c.add(
        cat,
        "none-mode-prefix-caching",
        "Mamba none mode with prefix caching on",
        request(W([mamba("a.0"), full("f.0", 2, 64)], GIB), prefix_caching=True),
    )
    c.add(
        cat,
        "tight",
        "Mamba hybrid, tight memory",
        request(
            W([mamba(f"m.{i}") for i in range(3)] + [full("f.0")], 300 * 65536), mamba_align=True
        ),
    )


def _kinds(c: Cases) -> None:
    cat = "kinds"
    c.add(
        cat,
        "cross-only",
        "cross-attention only",
        request(W([cross(f"x.{i}") for i in range(4)], GIB), encoder_tokens=1500),
    )
    c.add(
        cat,
        "cross-default-encoder",
        "cross-attention, encoder tokens default (batched)",
        request(W([cross(f"x.{i}") for i in range(4)], GIB), batched=4096),
    )
    c.add(
        cat,
        "encoder-only-mixed",
        "decoder F + encoder-only layers (excluded)",
        request(W(llama(4) + [encoder_only(f"e.{i}") for i in range(4)], GIB)),
    )
    c.add(
        cat,
        "circular-only",
        "circular buffer only",
        request(W([circular(f"r.{i}", block=8) for i in range(2)], GIB)),
    )
    c.add(
        cat,
        "circular-sw",
        "circular + SW",
        request(W([circular("r.0", 8, 128), sw("s.0", 128)], GIB)),
    )
    c.add(
        cat,
        "sink-only",
        "sink full attention only",
        request(W([sink(f"k.{i}", 32) for i in range(4)], GIB)),
    )
    c.add(
        cat,
        "sink-window-meta",
        "sink with sliding_window metadata",
        request(W([sink("k.0"), full("f.0", window=1024)], GIB)),
    )
    c.add(cat, "rswa-only", "RSWA only", request(W([rswa(f"r.{i}", 256) for i in range(4)], GIB)))
    c.add(
        cat,
        "rswa-two-windows",
        "RSWA with two windows (merge assertion)",
        request(W([rswa("r.0", 256), rswa("r.1", 512)], GIB)),
    )
    c.add(cat, "hidden-only", "hidden-state cache only", request(W([hidden("h.0", 1, 4096)], GIB)))
    c.add(
        cat,
        "chunked-only",
        "chunked local attention only",
        request(W([chunked(f"c.{i}", 8192) for i in range(4)], GIB), max_model_len=32768),
    )
    c.add(
        cat,
        "chunked-two-sizes",
        "chunked 4096 + 8192",
        request(W([chunked("c.0", 4096), chunked("c.1", 8192)], GIB), max_model_len=32768),
    )
    c.add(
        cat,
        "sw-only",
        "sliding window only",
        request(W([sw(f"s.{i}", 4096) for i in range(4)], GIB), max_model_len=131072),
    )
    c.add(cat, "no-workers", "no workers at all", request([], max_model_len=8192))
    c.add(cat, "empty-worker", "one worker without layers", request(W([], GIB)))
    c.add(
        cat,
        "all-kinds",
        "one layer of every kind, BLHNC",
        request(
            W(
                [
                    full("a"),
                    mla("b"),
                    sw("c", 512),
                    sw_mla("d", 128),
                    chunked("e", 2048),
                    sink("f"),
                    rswa("g"),
                    hidden("h", 1, 4096),
                    cross("i"),
                    encoder_only("j"),
                    circular("k", block=16),
                    mamba("l"),
                ],
                4 * GIB,
            ),
            layout="BLHNC",
            mamba_align=True,
        ),
    )
    c.add(
        cat,
        "all-kinds-lbnhc",
        "one layer of every kind, LBNHC",
        request(
            W(
                [
                    full("a"),
                    mla("b"),
                    sw("c", 512),
                    sw_mla("d", 128),
                    chunked("e", 2048),
                    sink("f"),
                    rswa("g"),
                    hidden("h", 1, 4096),
                    cross("i"),
                    encoder_only("j"),
                    circular("k", block=16),
                    mamba("l"),
                ],
                4 * GIB,
            ),
            mamba_align=True,
        ),
    )


def _scenario_files(c: Cases) -> None:
    if not SCENARIO_DIR.is_dir():
        return
    for path in sorted(SCENARIO_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        req = json_format.ParseDict(data["request"], plan_pb2.PlanRequest())
        c.add("scenarios", path.stem, f"{data.get('reference', '')} {data.get('name', '')}", req)


FINDS_DIR = Path(__file__).resolve().parent / "finds"


def _fuzz_finds(c: Cases) -> None:
    """Engines a fuzz campaign found kvplan and a vLLM release disagreeing on, kept
    as found (a PlanRequest in the proto JSON mapping) once the cause was fixed."""
    for path in sorted(FINDS_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        req = json_format.ParseDict(data["request"], plan_pb2.PlanRequest())
        c.add("fuzz_finds", path.stem, f"{data['description']} [{data['found_as']}]", req)


# --- random engines ----------------------------------------------------------------

FUZZ_CASES = 240


def _fuzz_layer(
    c: Cases, kind: str, name: str, heads: int, head: int, dtype: str | None, window: int
) -> Layer:
    a = {"dtype": dtype} if dtype else None
    if kind == "full":
        return full(name, heads, head, a=a)
    if kind == "sw":
        return sw(name, window, heads, head, a=a)
    if kind == "chunked":
        return chunked(name, c.pick([256, 2048, 8192]), heads, head, a=a)
    if kind == "mla":
        return mla(name, c.pick([576, 512, 656]))
    if kind == "sw_mla":
        return sw_mla(name, window)
    if kind == "sink":
        return sink(name, c.pick([16, 64]), heads, head, a=a)
    if kind == "cross":
        return cross(name, heads, head)
    if kind == "encoder_only":
        return encoder_only(name, heads, head)
    return mamba(name, c.pick([SMALL_STATES, GDN_STATES]))


# Kind mixes real engines use: dense, local+global, MLA, Mamba hybrids, encoder-decoder.
_FUZZ_MIXES: tuple[tuple[str, ...], ...] = (
    ("full",),
    ("full", "sw"),
    ("full", "chunked"),
    ("sw",),
    ("mla",),
    ("mla", "sw_mla"),
    ("full", "mamba"),
    ("mamba",),
    ("full", "sw", "mamba"),
    ("full", "sink"),
    ("full", "cross"),
    ("full", "encoder_only"),
    ("full", "sw", "chunked"),
)


def _fuzz(c: Cases) -> None:
    """Random engines: kind mixes, ratios, head shapes, dtypes, drafts, pipeline
    splits, layouts and budgets, so agreement is not limited to hand-picked shapes."""
    cat = "fuzz"
    for i in range(FUZZ_CASES):
        mix = c.pick(_FUZZ_MIXES)
        n_layers = c.pick([1, 2, 3, 5, 8, 12, 16, 24, 30, 36, 48, 61, 64])
        # One "minority" kind every `period` layers, like Gemma's 5:1 or Qwen3-Next's 3:1.
        period = c.pick([1, 2, 3, 4, 6, 8])
        heads = c.pick([1, 2, 4, 8, 16])
        head = c.pick([64, 96, 128, 256])
        dtype = c.pick([None, None, "fp16", "fp32", "e4m3"])
        # One window per engine, as a model config has (mixed windows are an error).
        window = c.pick([128, 512, 1024, 4096])
        names = [f"model.layers.{j}.attn" for j in range(n_layers)]
        kinds = [
            mix[0] if len(mix) == 1 or j % period == period - 1 else mix[1 + j % (len(mix) - 1)]
            for j in range(n_layers)
        ]
        # Some engines vary KV heads across layers (uniform-type / unification paths).
        mixed_heads = c.pick([False, False, True])
        layers = [
            _fuzz_layer(
                c,
                kind,
                name,
                c.pick([heads, 2 * heads]) if mixed_heads else heads,
                head,
                dtype,
                window,
            )
            for kind, name in zip(kinds, names, strict=True)
        ]
        method = c.pick(["none", "none", "mtp", "eagle", "eagle3", "dspark", "ngram"])
        if method in ("mtp", "eagle", "eagle3", "dspark") and c.pick([True, False]):
            draft_kind = "mla" if mix[0] == "mla" else "full"
            for d in range(c.pick([1, 1, 2])):
                layer = _fuzz_layer(
                    c, draft_kind, f"mtp.layers.{d}.attn", heads, head, dtype, window
                )
                layer.is_draft = c.pick([True, False])
                layers.append(layer)
        pp = c.pick([1, 1, 1, 2, 3, 4]) if len(layers) >= 4 else 1
        tp = c.pick([1, 1, 2, 4])
        per_stage = len(layers) // pp
        workers: list[W] = []
        utilization_mode = c.pick([False, False, True])
        for stage in range(pp):
            own = layers[stage * per_stage : (stage + 1) * per_stage]
            if stage == pp - 1:
                own = layers[stage * per_stage :]
            for _ in range(tp):
                workers.append(_fuzz_worker(c, own, utilization_mode))
        auto_fit = c.pick([False, False, False, True])
        c.add(
            cat,
            f"f{i:03d}",
            f"{n_layers} layers {'+'.join(mix)} period {period} heads {heads}x{head} "
            f"{dtype or 'auto'} {method} pp{pp} tp{tp}",
            request(
                workers,
                max_model_len=-1 if auto_fit else c.pick([2048, 8192, 32768, 131072]),
                derived=c.pick([32768, 131072]) if auto_fit else None,
                block_size=c.pick([0, 0, 16, 32, 64]),
                cache_dtype=c.pick(
                    [spec_pb2.KV_CACHE_DTYPE_AUTO] * 3 + [spec_pb2.KV_CACHE_DTYPE_FP8]
                ),
                disable_hybrid=c.pick([False, False, False, True]),
                override=c.pick([None, None, None, None, 64, 4096]),
                batched=c.pick([0, 2048, 8192]),
                async_scheduling=c.pick([False, True]),
                pp=pp if pp > 1 else 0,
                tp=tp if tp > 1 else 0,
                dcp=c.pick([0, 0, 0, 2]) if tp > 1 else 0,
                layout=c.pick(["LBNHC", "LBNHC", "LBHNC", "BLHNC"]),
                mamba_align="mamba" in mix and c.pick([False, True]),
                encoder_tokens=c.pick([0, 4096]) if "cross" in mix else 0,
                method=method,
                spec_tokens=c.pick([1, 2, 3]),
                target_model_type=c.pick(["", "qwen3_next", "deepseek_v3"]),
            ),
        )


def _fuzz_worker(c: Cases, own: list[Layer], utilization_mode: bool) -> W:
    """One rank: explicit KV bytes, or a device fraction minus what it already uses."""
    if utilization_mode:
        return W(
            own,
            total=c.pick([24 * GIB, 80 * GIB, 141 * GIB]),
            utilization=c.pick([0.5, 0.9, 0.92]),
            non_kv=(c.pick([1, 8, 16]) * GIB, 512 * MIB, 200 * MIB, 0),
        )
    return W(own, c.pick([16 * MIB, 256 * MIB, GIB, 3 * GIB + 12345, 20 * GIB, 60 * GIB]))


def _with_release_options(
    req: plan_pb2.PlanRequest,
    *,
    extensible: bool | None = None,
    measured: list[int] | None = None,
    granule: int | None = None,
) -> plan_pb2.PlanRequest:
    """0.34-only request fields (the comparison clears them for older releases)."""
    if extensible is not None:
        req.options.extensible_kv_cache = extensible
    for index, worker in enumerate(req.workers):
        if measured is not None:
            worker.memory.measured_kv_cache_bytes = measured[index]
        if granule is not None:
            worker.memory.allocation_granule_bytes = granule
    return req


def _releases(c: Cases) -> None:
    """Engines that reach every rule that differs between vLLM 0.32, 0.33 and 0.34:
    the draft rules on every path (is_draft, spec marker, trailing layer, gate,
    warning, flags on stages without the group's layers), the layout-check order,
    the default block size, SW-MLA fallback / promotion / merge, in-flight
    batches, kv_head_major_slots, Mamba state alignment and the extensible cache."""
    rng = c.rng
    methods = ("eagle", "eagle3", "mtp", "dspark", "dflash", "ngram")

    # Draft rules on the uniform, uniform-type, hybrid and packed paths, with and
    # without is_draft / the spec marker, the drop on or off, one or two stages.
    for index in range(60):
        path = rng.choice(("uniform", "uniform_type", "hybrid", "hybrid_mla", "packed", "qwen"))
        method = rng.choice(methods)
        draft_at = rng.choice((None, "last", "first"))
        kw: dict[str, Any] = {}
        if path == "uniform":
            layers = [*llama(rng.choice((2, 4, 6)), 8, 64), full("mtp.0.attn", 8, 64)]
        elif path == "uniform_type":
            layers = [*llama(4, 8, 64), full("mtp.0.attn", 4, 64)]
        elif path == "hybrid":
            layers = pattern(6, lambda i: i % 2 == 1, lambda name: sw(name, 1024, 8, 64))
            layers.append(rng.choice((full, lambda n, h, d: sw(n, 1024, h, d)))("mtp.0", 8, 64))
        elif path == "hybrid_mla":
            layers = [mla(f"mla.{i}", 512, marker=rng.random() < 0.3) for i in range(2)]
            layers += [sw(f"sw.{i}", 1024) for i in range(2)]
            if rng.random() < 0.5:
                layers.append(mla("mtp.0", 512, marker=rng.random() < 0.5))
        elif path == "packed":
            layers = dsv4_packed(rng.choice((4, 8)), mtp=rng.random() < 0.5)
            if rng.random() < 0.4:
                layers[
                    rng.randrange(len(layers))
                ].mla_attention.non_causal_multi_token_decode = True
            kw.update(layout="BLHNC", block_size=64)
        else:
            layers = qwen35()
            kw.update(mamba_align=True)
        if draft_at == "last":
            layers[-1].is_draft = True
        elif draft_at == "first":
            layers[0].is_draft = True
        stages = 2 if path in ("hybrid", "uniform") and rng.random() < 0.4 else 1
        if stages == 2:
            cut = len(layers) // 2
            workers = [W(layers[:cut], kv_bytes=GIB), W(layers[cut:], kv_bytes=GIB)]
            kw["pp"] = 2
        else:
            workers = [W(layers, kv_bytes=GIB)]
        req = request(
            workers,
            method=method,
            target_model_type=rng.choice(("", "deepseek_v4", "deepseek_v41", "qwen3_5")),
            disable_block_drop=rng.random() < 0.2,
            **kw,
        )
        c.add("releases", f"draft-{index:02d}-{path}-{method}", f"draft rules, {path}", req)

    # A layout that cannot express mixed pages, with and without enough memory.
    for index, kv in enumerate((1 << 20, 64 << 20, GIB)):
        for layout in ("LHBNC", "BHLNC"):
            req = request(W([full("a", 8, 128), full("b", 4, 128)], kv_bytes=kv), layout=layout)
            c.add("releases", f"layout-order-{layout}-{index}", "layout vs memory order", req)

    # Default block size (unset), async scheduling with pipeline stages, V1 / V2.
    for index in range(8):
        layers = pattern(8, lambda i: i % 4 == 3, lambda name: sw(name, rng.choice((512, 4096))))
        req = request(
            W(layers, kv_bytes=rng.choice((GIB, 4 * GIB))),
            max_model_len=rng.choice((8192, 65_536)),
            async_scheduling=rng.random() < 0.8,
            pp=rng.choice((1, 2, 3)),
            v2_runner=rng.random() < 0.5,
            batched=rng.choice((0, 2048)),
        )
        c.add("releases", f"in-flight-{index}", "default block size, in-flight batches", req)

    # Sliding-window MLA next to MLA: fallback, promotion, merge of quant / alignment.
    for index in range(16):
        mla_head, sw_head = rng.choice(((512, 576), (576, 512), (576, 576), (512, 512)))
        quant = rng.choice((0, 0, 1))
        alignment = rng.choice((None, None, 4096))
        layers = [mla(f"mla.{i}", mla_head) for i in range(rng.choice((1, 2)))]
        for i in range(rng.choice((1, 2, 3))):
            layer = sw_mla(
                f"swmla.{i}",
                256,
                sw_head,
                a={"quant": quant if i else 0},
                alignment=alignment if i else None,
                bounded_replay=rng.random() < 0.3,
            )
            layer.sliding_window_mla.non_causal_multi_token_decode = rng.random() < 0.3
            layers.append(layer)
        if rng.random() < 0.3:
            layers = layers[len(layers) // 2 :]  # sometimes SW-MLA only
        req = request(
            W(layers, kv_bytes=GIB),
            block_size=16,
            disable_hybrid=rng.random() < 0.4,
            method=rng.choice(("none", "dspark")),
        )
        c.add("releases", f"sw-mla-{index:02d}", "SW-MLA fallback / promotion / merge", req)

    # kv_head_major_slots (own tensor entries) and Mamba state alignment.
    for index in range(10):
        layers = llama(4, 8, 64, a={"slots": 16, "content": 128})
        for i in rng.sample(range(4), rng.choice((1, 2))):
            layers[i].full_attention.attention.kv_head_major_slots = True
        if rng.random() < 0.5:
            for i in range(3):
                layer = mamba(f"mamba.{i}", [([3, 130], "bf16"), ([4, 30, 30], "fp32")])
                if rng.random() < 0.7:
                    layer.mamba.state_alignment_bytes = rng.choice((256, 4096))
                layers.append(layer)
        req = request(
            W(layers, kv_bytes=GIB),
            layout=rng.choice(("LBNHC", "BLHNC")),
            mamba_align=True,
        )
        c.add("releases", f"slots-alignment-{index}", "kv_head_major_slots, state alignment", req)

    # The extensible cache: reservations (utilization 1.0 by default) and final
    # plans from measured KV bytes, over layouts, granules, stages and auto-fit.
    for index in range(40):
        shape = rng.choice(("llama", "hybrid", "mamba", "mla"))
        if shape == "llama":
            layers = llama(rng.choice((4, 16, 32)), 8, 128)
        elif shape == "hybrid":
            layers = pattern(8, lambda i: i % 2 == 1, lambda name: sw(name, 2048))
        elif shape == "mamba":
            layers = [
                full(f"model.layers.{i}.attn", 2, 256)
                if i % 4 == 3
                else mamba(f"model.layers.{i}.mamba", [([3, 2048], "bf16"), ([8, 64, 64], "fp32")])
                for i in range(8)
            ]
        else:
            layers = [mla(f"mla.{i}", 576) for i in range(6)]
        stages = rng.choice((1, 1, 2))
        utilization_mode = rng.random() < 0.5
        cut = len(layers) // stages
        parts = [
            layers[i * cut : (i + 1) * cut] if i < stages - 1 else layers[i * cut :]
            for i in range(stages)
        ]
        workers = [
            W(
                part,
                total=rng.choice((24, 80)) * GIB,
                utilization=rng.choice((None, 0.9)),
                non_kv=(rng.choice((2, 8)) * GIB, GIB, 0, 0),
            )
            if utilization_mode
            else W(part, kv_bytes=rng.choice((256 << 20, 2 * GIB, 40 * GIB)))
            for part in parts
        ]
        auto_fit = rng.random() < 0.3
        req = request(
            workers,
            max_model_len=-1 if auto_fit else rng.choice((8192, 131_072)),
            derived=rng.choice((32_768, 1_048_576)) if auto_fit else None,
            layout=rng.choice(("LBNHC", "LBNHC", "BLHNC", "LBHNC", "LHBNC")),
            pp=stages if stages > 1 else 0,
            mamba_align=shape == "mamba",
        )
        final = rng.random() < 0.75
        measured = None
        if final:
            measured = [
                rng.choice((64 << 20, 700 << 20, 3 * GIB, 30 * GIB, 100 * GIB))
                + rng.randrange(1 << 20)
                for _ in workers
            ]
        _with_release_options(
            req,
            extensible=rng.choice((None, None, True, False)),
            measured=measured,
            granule=rng.choice((None, 64 << 10, 2 << 20)),
        )
        if not req.options.extensible_kv_cache and req.options.HasField("extensible_kv_cache"):
            for worker in req.workers:  # measured bytes belong to an extensible cache
                worker.memory.ClearField("measured_kv_cache_bytes")
                worker.memory.ClearField("allocation_granule_bytes")
        c.add("releases", f"extensible-{index:02d}-{shape}", "extensible KV cache", req)

    # Extensible final plans with a block override, hidden-state and cross-attention
    # layers, chunked-local layers, DCP, and an attention-free engine.
    extras: list[tuple[str, plan_pb2.PlanRequest]] = [
        ("override", request(W(llama(8), kv_bytes=8 * GIB), override=rng.choice((500, 5000)))),
        (
            "hidden",
            request(W([*llama(4), hidden("hs.0", 1, 4096)], kv_bytes=4 * GIB)),
        ),
        (
            "chunked",
            request(
                W(pattern(8, lambda i: i % 4 == 3, lambda n: chunked(n, 8192)), kv_bytes=4 * GIB),
                async_scheduling=True,
                pp=2,
            ),
        ),
        ("dcp", request([W(llama(4), kv_bytes=2 * GIB) for _ in range(2)], tp=2, dcp=2)),
        ("attention-free", request(W([encoder_only("enc.0")], kv_bytes=GIB))),
    ]
    for name, req in extras:
        _with_release_options(req, measured=[rng.choice((300 << 20, 2 * GIB)) for _ in req.workers])
        if name == "override":
            # A block override sizes the cache: 0.34 refuses an engine that asks for
            # the extensible one as well.
            req.options.extensible_kv_cache = True
        c.add("releases", f"extensible-final-{name}", "extensible final plan", req)


def _hisparse_engine(
    rng: random.Random,
    *,
    sparse: int,
    indexers: int,
    leader_every: int,
    block: int,
    sparse_head: int,
    others: list[Layer],
    topk: int | None,
    mixed_pages: bool = False,
) -> list[Layer]:
    """A DeepSeek-V3.2-like engine under HiSparse: sparse-MLA and indexer layers,
    other layers, then the hot / resident entries the model runner derives."""
    layers: list[Layer] = []
    for i in range(sparse):
        head = sparse_head if not (mixed_pages and i == sparse - 1) else sparse_head + 64
        layers.append(
            mla(
                f"model.layers.{i}.attn",
                head,
                a={"dtype": "u8"},
                topk=topk,
                leader=i % leader_every == 0,
                block=block,
            )
        )
    for i in range(indexers):
        layers.append(
            mla(f"model.layers.{i}.indexer", 132, a={"dtype": "u8"}, indexer=True, block=block)
        )
    layers += others
    for i in range(sparse):
        page = block * sparse_head
        hot = Layer(name=f"model.layers.{i}.attn.hisparse_hot")
        hot.hisparse_hot.page_size_bytes = page
        hot.hisparse_hot.blocks_per_request = 1
        resident = Layer(name=f"model.layers.{i}.attn.hisparse_resident")
        resident.hisparse_resident.page_size_bytes = page
        layers += [resident, hot]
    rng.shuffle(layers[len(layers) - 2 * sparse :])  # the runner's order is a dict merge
    return layers


def _hisparse(c: Cases) -> None:
    """HiSparse (every release): its grouping path, hot-unit packing, host pool
    sizing and its limits on max_model_len, layouts, spec decode and the regular
    groups planned beside it."""
    rng = c.rng
    for index in range(60):
        others: list[Layer] = []
        kind = rng.choice(("none", "none", "sw", "mamba", "full"))
        if kind == "sw":
            others = [sw(f"swa.{i}", 1024, 4, 64, block=64) for i in range(rng.choice((2, 4)))]
        elif kind == "mamba":
            others = [mamba(f"mamba.{i}", SMALL_STATES) for i in range(2)]
        elif kind == "full":
            others = [full(f"full.{i}", 4, 64) for i in range(2)]
        block = rng.choice((64, 64, 32))
        layers = _hisparse_engine(
            rng,
            sparse=rng.choice((2, 4, 8)),
            indexers=rng.choice((1, 2, 4)),
            leader_every=rng.choice((1, 2, 4)),
            block=block,
            sparse_head=rng.choice((656, 576)),
            others=others,
            topk=rng.choice((None, 2048, 512)),
            mixed_pages=rng.random() < 0.1,
        )
        auto_fit = rng.random() < 0.3
        req = request(
            W(layers, kv_bytes=rng.choice((256 << 20, 4 * GIB, 40 * GIB))),
            max_model_len=-1 if auto_fit else rng.choice((8192, 131_072)),
            derived=rng.choice((163_840, 1_048_576)) if auto_fit else None,
            layout=rng.choice(("BLHNC", "BLHNC", "BLHNC", "BLNHC", "LBNHC")),
            tp=rng.choice((0, 0, 2)),
            mamba_align=kind == "mamba",
            block_size=64,
            async_scheduling=rng.random() < 0.5,
            method=rng.choice(("none", "mtp", "eagle")),
            spec_tokens=rng.choice((1, 3)),
            override=rng.choice((None, None, 2000)),
        )
        config = req.options.hisparse
        config.host_pool_gib = rng.choice((0.001, 0.25, 4.0, 64.0, 64.0, 256.0))
        config.shared_host_pool = rng.random() < 0.3
        config.index_topk = 2048
        if rng.random() < 0.4:
            config.device_buffer_size = rng.choice((1024, 8192, 8192, 16384, 40000))
        if rng.random() < 0.05:
            layers[0].mla_attention.mla.model_version = "deepseek_v4"
            req.workers[0].layers[0].CopyFrom(layers[0])
        c.add("hisparse", f"h{index:02d}-{kind}", "HiSparse grouping and host pool", req)


# --- layout resolution from the workers' supported-layout lists ---------------------

# What a worker reports when none of its backends declares a list (vLLM's default
# preference): such a worker does not vote in vLLM 0.34's merge.
NO_PREFERENCE = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]


def with_layouts(
    req: plan_pb2.PlanRequest, lists: list[list[str]], asked: str | None
) -> plan_pb2.PlanRequest:
    """`req` with each worker's supported layouts and the layout asked for (None:
    options.layout unset, the resolution picks)."""
    out = plan_pb2.PlanRequest()
    out.CopyFrom(req)
    if asked is None:
        out.options.ClearField("layout")
    else:
        out.options.layout = LAYOUTS[asked]
    for worker, names in zip(out.workers, lists, strict=True):
        del worker.supported_layouts[:]
        worker.supported_layouts.extend(LAYOUTS[name] for name in names)
    return out


def _random_list(rng: random.Random, size: int | None = None) -> list[str]:
    names = list(LAYOUTS)
    rng.shuffle(names)
    return names[: size or rng.randint(1, len(names))]


def _layout_patterns(rng: random.Random, n_workers: int) -> list[tuple[str, list[list[str]]]]:
    """(name, per-worker lists) for an engine of `n_workers` workers."""
    same = _random_list(rng)
    patterns = [("same", [same] * n_workers)]
    if n_workers > 1:
        patterns.append(("differ", [_random_list(rng) for _ in range(n_workers)]))
        shared = rng.choice(list(LAYOUTS))
        overlap = []
        for _ in range(n_workers):
            extra = [x for x in _random_list(rng) if x != shared]
            extra.insert(rng.randint(0, len(extra)), shared)
            overlap.append(extra)
        patterns.append(("overlap", overlap))
        first, rest = same[:1], [x for x in LAYOUTS if x not in same[:1]]
        patterns.append(("disjoint", [first] + [rest] * (n_workers - 1)))
        lists = [list(NO_PREFERENCE) if i % 2 else _random_list(rng) for i in range(n_workers)]
        patterns.append(("no-vote", lists))
    return patterns


def _layout_resolution(c: Cases) -> None:
    """Engines whose workers report the layouts they support: the engine core's
    resolution (0.32 / 0.33: lists must be equal; 0.34: layouts shared by all,
    first choices voting), narrowed by mixed page shapes, DCP sharding and (0.34)
    an extensible cache behind HiSparse's connector, and the asked-for layout."""
    cat = "layout_resolution"
    rng = c.rng
    # Engines the other sections built (every path, HiSparse, DCP, pipeline); not
    # fuzz_c's, fuzz_v's or fuzz_j's, which came later: a seed's sample stays what it
    # was before them.
    base = [
        case
        for case in c.items
        if case.category not in ("scenarios", "fuzzc", "fuzzv", "fuzzj") and case.request.workers
    ]
    sample = rng.sample(base, min(160, len(base)))
    for case in sample:
        n_workers = len(case.request.workers)
        name, lists = rng.choice(_layout_patterns(rng, n_workers))
        asked = rng.choice([None, None, rng.choice(list(LAYOUTS))])
        if asked is None and rng.random() < 0.3:
            asked = rng.choice(lists[0])  # one the first worker supports
        c.add(
            cat,
            f"{case.id.replace('/', '.')}-{name}-{asked or 'unset'}",
            f"{case.description}; lists {name} {lists}, asked {asked}",
            with_layouts(case.request, lists, asked),
        )

    # HiSparse engines: the host pool needs a block-outermost layout, and 0.34's
    # extensible cache behind its connector a block-compact one (BHLNC is not).
    hisparse = [case for case in c.items if case.category == "hisparse"][:4]
    for case in hisparse:
        n_workers = len(case.request.workers)
        for cid, names in (
            ("outermost", ["BHLNC", "BLHNC"]),
            ("bhlnc-only", ["BHLNC"]),
            # HiSparse's connector asks for BLHNC: taken when a candidate, else dropped.
            ("connector-wins", ["BLNHC", "BLHNC"]),
            ("connector-dropped", ["BLNHC", "LBHNC"]),
        ):
            c.add(
                cat,
                f"{case.id.replace('/', '.')}-{cid}",
                f"{case.description}; every worker lists {names}",
                with_layouts(case.request, [names] * n_workers, None),
            )

    # Sparse-MLA layers only (no indexer, nothing else): one page shape, so only
    # 0.34's connector rule (extensible cache, on by default) narrows the list.
    for extensible in (None, False):
        solo = request(
            W(
                _hisparse_engine(
                    rng,
                    sparse=4,
                    indexers=0,
                    leader_every=1,
                    block=64,
                    sparse_head=656,
                    others=[],
                    topk=2048,
                ),
                kv_bytes=4 * GIB,
            ),
            block_size=64,
        )
        solo.options.hisparse.host_pool_gib = 4.0
        solo.options.hisparse.index_topk = 2048
        if extensible is not None:
            solo.options.extensible_kv_cache = extensible
        for cid, names in (("outermost", ["BHLNC", "BLHNC"]), ("bhlnc-only", ["BHLNC"])):
            c.add(
                cat,
                f"hisparse-solo-{cid}-extensible-{extensible}",
                f"HiSparse sparse-MLA layers only, extensible {extensible}, list {names}",
                with_layouts(solo, [names], None),
            )

    # By hand: the rules one by one.
    two_stages = request([W(llama(4, prefix="a"), 2 * GIB), W(llama(4, prefix="b"), 2 * GIB)], pp=2)
    for cid, lists in (
        ("equal", [["LBHNC", "LBNHC"], ["LBHNC", "LBNHC"]]),
        ("reordered-tie", [["LBHNC", "LBNHC"], ["LBNHC", "LBHNC"]]),
        ("majority-first", [["BLHNC", "LBHNC"], ["LBHNC", "BLHNC"], ["LBHNC"]]),
        ("subset", [["LHBNC", "LBHNC", "LBNHC"], ["LBNHC"]]),
        ("disjoint", [["LBHNC"], ["LBNHC"]]),
        ("no-vote", [NO_PREFERENCE, ["LHBNC", "LBHNC"]]),
        ("all-default", [NO_PREFERENCE, NO_PREFERENCE]),
        ("unvoted-only", [["BLHNC", "LBHNC", "BHLNC"], ["LBNHC", "BHLNC", "LBHNC"]]),
    ):
        engine = two_stages
        if len(lists) == 3:
            engine = request([W(llama(4, prefix=p), 2 * GIB) for p in ("a", "b", "c")], pp=3)
        for asked in (None, "LBHNC"):
            c.add(
                cat,
                f"pp-{cid}-{asked or 'unset'}",
                f"PP stages reporting {lists}, asked {asked}",
                with_layouts(engine, lists, asked),
            )
    # Mixed (heads, states, page bytes): block-compact only.
    mixed = request(W([full("f.0"), full("f.1", 4), sw("s.0", 512)], GIB))
    for cid, names in (
        ("hnc-keeps-compact", ["LHBNC", "BHLNC", "LBHNC", "BLNHC"]),
        ("hnc-none-compact", ["LHBNC", "BHLNC"]),
        ("hnc-asked-outside", ["LHBNC", "BLHNC"]),
    ):
        asked = "LHBNC" if cid == "hnc-asked-outside" else None
        c.add(cat, cid, f"mixed HNC shapes, list {names}", with_layouts(mixed, [names], asked))
    # DCP-sharded and replicated layers with mixed pages: block-outermost only.
    dcp = request(
        [W([full("f.0"), full("d.0", 4, a={"dcp_sharded": False})], 2 * GIB)] * 2,
        dcp=2,
        tp=2,
    )
    for cid, names in (
        ("dcp-keeps-outermost", ["LBNHC", "BHLNC", "BLHNC"]),
        ("dcp-none-outermost", ["LBNHC", "LBHNC"]),
    ):
        c.add(cat, cid, f"DCP mixed sharding, list {names}", with_layouts(dcp, [names] * 2, None))


def _with_low_free_memory(req: plan_pb2.PlanRequest) -> plan_pb2.PlanRequest:
    """Every worker's device with 30 GiB free: below what utilization 0.9 of 80 GiB
    asks, which vLLM's worker refuses as it starts (a non-extensible cache)."""
    for worker in req.workers:
        worker.device.free_memory_bytes = 30 * GIB
    return _with_release_options(req, extensible=False)


def _engine_start(c: Cases) -> None:
    """Engines with two faults, where the engine's start order decides which one it
    reports: a worker's free memory (checked as it starts, before the model exists),
    padded pages the layout cannot express (vLLM 0.33+ places one block before its
    memory checks), too little memory; and the sink manager's own check of the sink
    length against its block (the differential check starts that manager with vLLM's
    defect worked around, D10)."""
    cat = "engine_start"
    padded_sw = [full("f.0"), sw("s.0", 1024, 8, 96, a={"padded": 65536})]
    for layout in ("LHBNC", "BHLNC", "LBNHC"):
        for kv_bytes, memory in ((MIB, "1MiB"), (4 * GIB, "4GiB")):
            c.add(
                cat,
                f"padded-{layout}-{memory}",
                f"a padded SW page, layout {layout}, {memory} of KV cache",
                request(W(padded_sw, kv_bytes), layout=layout, block_size=16),
            )

    def on_80gib(layers: list[Layer]) -> W:
        return W(layers, total=80 * GIB, utilization=0.9)

    c.add(
        cat,
        "free-memory-vs-no-hybrid-manager",
        "Mamba + full attention with the hybrid manager off, on a device with too "
        "little free memory",
        _with_low_free_memory(
            request(on_80gib([mamba("m.0"), full("f.0", 2, 64)]), disable_hybrid=True)
        ),
    )
    differing = request([on_80gib(llama(2)), on_80gib(llama(2, prefix="b"))], pp=2)
    differing.workers[0].supported_layouts.append(LAYOUTS["LBNHC"])
    differing.workers[1].supported_layouts.append(LAYOUTS["BLHNC"])
    c.add(
        cat,
        "free-memory-vs-layout-lists",
        "two stages supporting different layouts, on devices with too little free memory",
        _with_low_free_memory(differing),
    )
    c.add(
        cat,
        "free-memory-vs-padded-layout",
        "a padded SW page in LHBNC, on a device with too little free memory",
        _with_low_free_memory(request(on_80gib(padded_sw), layout="LHBNC")),
    )
    sinks = {
        "sink16-block16": (16, 16, 0),
        "sink16-block32": (16, 32, 0),
        "sink48-block32": (48, 32, 0),
        "sink128-block64": (128, 64, 0),
        "sink0-block16": (0, 16, 0),
        "sink16-block16-dcp2": (16, 16, 2),
        "sink32-block16-dcp2": (32, 16, 2),
    }
    for cid, (sink_len, block, dcp) in sinks.items():
        layers = [sink("k.0", sink_len), sink("k.1", sink_len)]
        workers = [W(layers, GIB)] * max(dcp, 1)
        c.add(
            cat,
            cid,
            f"sink attention, sink {sink_len} tokens, block {block}, DCP {dcp}",
            request(workers, block_size=block, tp=dcp, dcp=dcp),
        )
    c.add(
        cat,
        "sink16-with-sw-block32",
        "sink attention beside sliding-window layers, sink 16 tokens, block 32",
        request(W([sink("k.0", 16), sw("s.0", 512), sw("s.1", 512)], GIB), block_size=32),
    )
    # Sliding-window layers of two page sizes that do not occur equally often: the
    # packed layout's grouping leaves one out (vLLM 0.32 notices as it builds each
    # worker's configuration, after the memory checks; later releases at grouping).
    heads = (8, 8, 8, 8, 8, 8, 4, 8, 4, 4, 4, 8)
    uneven = [
        full(f"u.{i}", h, 96) if i % 4 == 3 else sw(f"u.{i}", 128, h, 96)
        for i, h in enumerate(heads)
    ]
    for kv_bytes, memory in ((16 * MIB, "16MiB"), (64 * GIB, "64GiB")):
        c.add(
            cat,
            f"packed-drops-a-layer-{memory}",
            f"BLHNC, sliding-window pages of uneven counts, {memory} of KV cache",
            request(W(uneven, kv_bytes), layout="BLHNC", block_size=32, max_model_len=131072),
        )
        c.add(
            cat,
            f"packed-drops-a-layer-pp2-{memory}",
            f"the same in two pipeline stages (the layer left out is the second's), "
            f"{memory} of KV cache each",
            request(
                [W(uneven[:4], kv_bytes), W(uneven[4:], kv_bytes)],
                layout="BLHNC",
                block_size=32,
                max_model_len=131072,
                pp=2,
            ),
        )


def _block_sizes(c: Cases) -> None:
    """The scheduler's block sizes and what its KV cache manager refuses at start:
    prefix_match_unit, DCP, compressed states, the MTP lookahead, caching defaults."""
    cat = "block_sizes"
    for dcp in (0, 2):
        for unit in (None, 16, 32, 8):
            for caching in (None, False):
                c.add(
                    cat,
                    f"single-dcp{dcp}-unit{unit}-caching{caching}",
                    f"one full group, DCP {dcp}, prefix_match_unit {unit}, caching {caching}",
                    _with_unit(
                        request(W(llama(4), GIB), dcp=dcp, tp=dcp, prefix_caching=caching), unit
                    ),
                )
    hybrids: dict[str, Callable[[], list[Layer]]] = {
        "qwen35": qwen35,
        "sw": lambda: pattern(8, lambda i: i % 4 == 3, lambda name: sw(name, 1024)),
        "sw-blocks": lambda: [
            *llama(2, block=32),
            *[sw(f"s.{i}", 512, 16, 64, block=16) for i in range(2)],
        ],
        "packed": lambda: dsv4_packed(4),
        "mamba-compressed": lambda: [
            *[mamba(f"m.{i}", SMALL_STATES) for i in range(3)],
            full("f.0", 2, 256, a={"tokens": 4}, block=64),
        ],
    }
    for name, layers in hybrids.items():
        for unit in (None, 1, 2, 4, 8, 16, 48):
            for dcp in (0, 2):
                c.add(
                    cat,
                    f"{name}-unit{unit}-dcp{dcp}",
                    f"{name} groups, prefix_match_unit {unit}, DCP {dcp}",
                    _with_unit(
                        request(
                            W(layers(), 4 * GIB),
                            dcp=dcp,
                            tp=dcp,
                            mamba_align=name.startswith(("qwen35", "mamba")),
                        ),
                        unit,
                    ),
                )
    c.add(cat, "unit-zero", "prefix_match_unit 0", _with_unit(request(W(llama(2), GIB)), 0))
    # Multi-module MTP: the lookahead must fit the scheduler's block.
    for block in (16, 64):
        for caching in (None, False):
            for draft in (True, False):
                c.add(
                    cat,
                    f"mtp-lookahead-b{block}-caching{caching}-draft{draft}",
                    f"MTP k=32, nextn 32, block {block}, caching {caching}, is_draft {draft}",
                    request(
                        W([*llama(2), full("mtp.layers.0.attn", draft=draft)], GIB),
                        block_size=block,
                        prefix_caching=caching,
                        method="mtp",
                        spec_tokens=32,
                        nextn=32,
                    ),
                )
    # A non-causal layer turns prefix caching off: the hash block is the scheduler's.
    for unit in (None, 8):
        c.add(
            cat,
            f"non-causal-unit{unit}",
            f"SW blocks of two sizes with a non-causal full layer, prefix_match_unit {unit}",
            _with_unit(
                request(
                    W(
                        [
                            full("f.0", block=32),
                            full("f.1", block=32, non_causal=True),
                            *[sw(f"s.{i}", 512, 16, 128, block=16) for i in range(2)],
                        ],
                        GIB,
                    )
                ),
                unit,
            ),
        )
    # HiSparse runs a KV connector: hashes are consumed without prefix caching, and
    # (0.33+) the connector keeps the legacy hashes, so the block drop applies again.
    rng = random.Random(7)
    for caching in (False, None):
        for unit, sw_block in ((16, None), (48, None), (None, 64)):
            others = (
                []
                if sw_block is None
                else [sw(f"swa.{i}", 1024, 4, 64, block=64) for i in range(2)]
            )
            req = request(
                W(
                    _hisparse_engine(
                        rng,
                        sparse=2,
                        indexers=1,
                        leader_every=1,
                        block=32 if sw_block else 64,
                        sparse_head=656,
                        others=others,
                        topk=2048,
                    ),
                    kv_bytes=40 * GIB,
                ),
                layout="BLHNC",
                block_size=64,
                prefix_caching=caching,
            )
            req.options.hisparse.host_pool_gib = 4.0
            req.options.hisparse.index_topk = 2048
            c.add(
                cat,
                f"hisparse-caching{caching}-unit{unit}-sw{sw_block}",
                f"HiSparse, prefix caching {caching}, prefix_match_unit {unit}, SW {sw_block}",
                _with_unit(req, unit),
            )
    mtp = request(
        W(
            _hisparse_engine(
                rng,
                sparse=2,
                indexers=1,
                leader_every=1,
                block=32,
                sparse_head=656,
                others=[],
                topk=512,
            ),
            kv_bytes=40 * GIB,
        ),
        layout="BLHNC",
        block_size=32,
        method="mtp",
        spec_tokens=40,
        nextn=2,
    )
    mtp.options.hisparse.host_pool_gib = 4.0
    mtp.options.hisparse.index_topk = 512
    c.add(cat, "hisparse-mtp-lookahead", "HiSparse, MTP k=40 over a 32-token block", mtp)
    # Bounded-replay windows must agree (the scheduler asserts it, caching or not).
    for windows in ((128, 128), (128, 256)):
        for caching in (None, False):
            c.add(
                cat,
                f"replay-windows-{windows[0]}-{windows[1]}-caching{caching}",
                f"SW-MLA bounded replay windows {windows}, caching {caching}",
                request(
                    W(
                        [
                            mla("m.0", block=64),
                            *[
                                sw_mla(f"s.{i}", window, block=64, bounded_replay=True)
                                for i, window in enumerate(windows)
                            ],
                        ],
                        GIB,
                    ),
                    block_size=64,
                    prefix_caching=caching,
                ),
            )
    # Mamba beside a bounded-replay window: the scheduler's Mamba align split measures
    # a request's first chunk from the KV cache manager's hit, not from where the
    # replay rewinds it to; later requests see the state the first one's chunks left.
    for mamba_block in (64, 128):
        c.add(
            cat,
            f"replay-window-mamba{mamba_block}",
            f"Mamba {mamba_block} beside MLA and a bounded-replay SW-MLA window of 128, "
            "64-token attention blocks",
            request(
                W(
                    [
                        *[mamba(f"a.{i}", block=mamba_block) for i in range(2)],
                        mla("m.0", block=64),
                        sw_mla("s.0", 128, block=64, bounded_replay=True),
                    ],
                    GIB,
                ),
                mamba_align=True,
                prefix_caching=True,
            ),
        )
    # A hybrid MTP with a lookahead over the scheduler block (kvplan's own rules flag
    # the drafter's group, which then takes the check: D1).
    c.add(
        cat,
        "mtp-lookahead-hybrid",
        "full + SW + trailing MTP layer, MTP k=32, block 16",
        request(
            W([full("f.0"), sw("s.0", 512), full("mtp.layers.0.self_attn.attn")], GIB),
            method="mtp",
            spec_tokens=32,
            nextn=32,
        ),
    )
    # RSWA (Unlimited-OCR, whose config hook turns prefix caching off).
    for caching in (None, True):
        c.add(
            cat,
            f"rswa-unit32-caching{caching}",
            f"RSWA layers, prefix_match_unit 32, caching {caching}",
            _with_unit(
                request(W([rswa(f"r.{i}") for i in range(4)], GIB), prefix_caching=caching), 32
            ),
        )
    # Groups that opt out of prefix caching, and the defaults by model kind.
    kinds: dict[str, list[Layer]] = {
        "circular-only": [circular("c.0"), circular("c.1", head=256)],
        "encoder-only": [encoder_only(f"e.{i}") for i in range(2)],
        "mamba-only": [mamba(f"m.{i}", SMALL_STATES) for i in range(2)],
        "cross": [*llama(2), cross("x.0")],
        "gdn-hybrid": qwen35(),
        "mamba-attention-drafter": [
            *[mamba(f"m.{i}", SMALL_STATES) for i in range(2)],
            full("mtp.0", 2, 256, a={"dtype": "fp32"}, draft=True),
        ],
        "hybrid-cross": [
            mamba("m.0", SMALL_STATES),
            full("f.0", 2, 256, a={"dtype": "fp32"}),
            cross("x.0"),
        ],
    }
    for name, kind_layers in kinds.items():
        for caching in (None, True, False):
            c.add(
                cat,
                f"default-{name}-caching{caching}",
                f"{name}, prefix caching {caching}",
                request(W(kind_layers, GIB), prefix_caching=caching),
            )


def _mamba_junction(c: Cases) -> None:
    """vLLM's opt-in enable_mamba_shared_prefix_checkpoint on Mamba hybrids: a request
    whose groups' hits part ends a chunk at that junction and keeps its Mamba state
    there. It takes effect only with partial hash hits (prefix_match_unit finer than
    the Mamba block), a drafter's group and no multi-module MTP tail: each shape
    with and without those, so the later-request probes see it on and ignored. No
    random draws: the sections after it are unchanged."""
    cat = "mamba_junction"
    shapes: dict[str, Callable[[bool], list[Layer]]] = {
        # One block for every group: a junction lands on a Mamba block boundary.
        "qwen35": lambda draft: qwen35(draft=draft),
        # Mamba blocks coarser than the attention's: a junction can fall inside one.
        "mamba64-full16": lambda draft: [
            *[mamba(f"m.{i}", SMALL_STATES, block=64) for i in range(2)],
            full("f.0", 2, 256, block=16),
            full("mtp.layers.0.attn", 2, 256, block=16, draft=draft),
        ],
        "mamba128-full32": lambda draft: [
            *[mamba(f"m.{i}", SMALL_STATES, block=128) for i in range(2)],
            full("f.0", 4, 128, block=32),
            full("mtp.layers.0.attn", 4, 128, block=32, draft=draft),
        ],
        "mamba64-mla16": lambda draft: [
            *[mamba(f"m.{i}", SMALL_STATES, block=64) for i in range(2)],
            mla("a.0", block=16),
            mla("mtp.layers.0.attn", block=16, draft=draft),
        ],
    }
    drafters = [
        ("mtp-draft", "mtp", 1, True),
        ("mtp-unmarked", "mtp", 1, False),
        ("eagle-draft", "eagle", 1, True),
        ("mtp2-draft", "mtp", 2, True),  # a multi-module tail: the checkpoint is off
        ("none", "none", 0, False),
    ]
    for shape, layers in shapes.items():
        for unit in (None, 4, 16):
            for name, method, tokens, draft in drafters:
                for dcp in (0, 2) if unit == 16 else (0,):
                    req = request(
                        W(layers(draft), 4 * GIB),
                        mamba_align=True,
                        method=method,
                        spec_tokens=tokens,
                        dcp=dcp,
                        tp=dcp,
                    )
                    req.options.enable_mamba_shared_prefix_checkpoint = True
                    c.add(
                        cat,
                        f"{shape}-unit{unit}-{name}-dcp{dcp}",
                        f"{shape}, prefix_match_unit {unit}, {name}, DCP {dcp}, junction "
                        "checkpoint on",
                        _with_unit(req, unit),
                    )


def _with_unit(req: plan_pb2.PlanRequest, unit: int | None) -> plan_pb2.PlanRequest:
    if unit is not None:
        req.options.prefix_match_unit = unit
    return req


SECTIONS: tuple[Callable[[Cases], None], ...] = (
    _reference,
    _uniform,
    _uniform_type,
    _hybrid,
    _page_unify,
    _mla,
    _packed,
    _layout_errors,
    _disable_hybrid,
    _pipeline,
    _spec_decode,
    _memory,
    _parallel,
    _mamba,
    _kinds,
    _fuzz,
    _releases,
    _hisparse,
    _block_sizes,
    _engine_start,
    _layout_resolution,  # after the sections whose engines it samples
    _fuzz_finds,
    _scenario_files,
    _mamba_junction,  # draws nothing: the sections before it keep their engines
)


def generate_cases(
    seed: int = 20260, *, scenarios: bool = True, fuzz: Mapping[str, int] | None = None
) -> list[Case]:
    """The cases of `seed`. `fuzz`: the wide random sections of conformance/fuzz.py
    to add, with their case counts (a campaign's, not `make conformance`'s); they
    draw right after `_fuzz`, in fuzz.py's order, so that a seed and the same counts
    give the same engines."""
    cases = Cases(seed)
    for section in SECTIONS:
        if section is _scenario_files and not scenarios:
            continue
        section(cases)
        if section is _fuzz and fuzz:
            from conformance.fuzz import add_fuzz_sections

            add_fuzz_sections(cases, fuzz)
    return cases.items


def add_fuzz_argument(parser: argparse.ArgumentParser) -> None:
    """`--fuzz SECTION[=COUNT]`, repeatable (`all`: every section at its default
    count): the wide random sections of conformance/fuzz.py, for a fuzz campaign."""
    parser.add_argument(
        "--fuzz",
        action="append",
        default=[],
        metavar="SECTION[=COUNT]",
        help="add a wide random section of conformance/fuzz.py (repeatable; 'all')",
    )


def add_split_arguments(parser: argparse.ArgumentParser) -> None:
    """`--stride K --offset I`: every K-th case from the I-th on (after --only), so
    that K processes (or K runs one after another) with offsets 0..K-1 share a
    campaign's engines between them, each engine in exactly one; one of them alone
    is a 1/K sample spread over every section."""
    parser.add_argument(
        "--stride", type=int, default=1, metavar="K", help="take every K-th case (default 1)"
    )
    parser.add_argument(
        "--offset", type=int, default=0, metavar="I", help="from the I-th case on (0 <= I < K)"
    )


def check_split(stride: int, offset: int) -> None:
    """ValueError for a split that would drop or repeat cases (before any is drawn)."""
    if stride < 1:
        raise ValueError(f"--stride {stride}: a stride is 1 or more")
    if not 0 <= offset < stride:
        raise ValueError(f"--offset {offset}: an offset is 0 to stride - 1 ({stride - 1})")


def split_cases(cases: Sequence[Case], stride: int, offset: int) -> list[Case]:
    """`cases[offset::stride]` (check_split's split)."""
    check_split(stride, offset)
    return list(cases[offset::stride])


def fuzz_sections(values: Iterable[str]) -> dict[str, int]:
    """What `--fuzz` asked for: section name -> case count."""
    from conformance.fuzz import parse_fuzz_sections

    return parse_fuzz_sections(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20260)
    parser.add_argument("--out", type=Path, help="write the cases as JSON lines")
    parser.add_argument("--list", action="store_true", help="print id and description")
    add_fuzz_argument(parser)
    args = parser.parse_args(argv)
    cases = generate_cases(args.seed, fuzz=fuzz_sections(args.fuzz))
    if args.out:
        with args.out.open("w") as fh:
            for case in cases:
                fh.write(json.dumps(case.to_json()) + "\n")
    if args.list:
        for case in cases:
            print(f"{case.id:55s} {case.description}")
    counts: dict[str, int] = {}
    for case in cases:
        counts[case.category] = counts.get(case.category, 0) + 1
    print(
        f"{len(cases)} cases: " + ", ".join(f"{k} {v}" for k, v in counts.items()), file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
