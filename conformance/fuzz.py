"""Wide random engines for fuzz campaigns against each vLLM release's own planner.

`make conformance` checks the fixed sections of conformance/generate.py, including its
small `_fuzz` one, on every release. A campaign adds these wider sections, drawn from
their own seed, to look for disagreements beyond every list (`make fuzz`, or
`python -m conformance.compare --seed N --fuzz all`); what one finds is kept in
conformance/finds/ and pinned by tests/test_fuzz_finds.py once fixed. Every section
takes the case generator and a case count:

- fuzz_wide: kind mixes with Mamba, hybrid block alignment as vLLM derives it, Mamba
  speculative blocks, TP x DCP, uneven pipeline splits, drafters of several shapes,
  prefix caching settings, layouts, budgets and vLLM 0.34's extensible cache;
- fuzz_x: engine families (DeepSeek V3.2 sparse MLA with indexers, DeepSeek V4 packed
  SW-MLA, MLA cache dtypes, Mamba checkpoints, Qwen3-Next, RSWA, padded SW pages);
- fuzz_y: the fields and values the others fix: odd head sizes, quantized caches,
  dtypes, compressed states, block sizes 1-2048, stride alignments, every kind alone
  and in pairs, Mamba types, TP x DCP x PP, edge lengths and budgets;
- fuzz_h: HiSparse with TP, DCP, pipeline stages and other layer kinds;
- fuzz_l: supported-layout lists over fuzz_y's and fuzz_h's engines;
- fuzz_z: real model families (Llama 4, gpt-oss, Gemma 3, DeepSeek V3 / V3.2 / V4,
  Qwen3-Next, Jamba, Nemotron-H, Falcon-H1, MiniMax, Whisper, BERT, HiSparse) moved to
  the edges kvplan's own plan of each shows (one byte short of one request, one block,
  an override at the blocks one request needs, auto-fit at the fitted length, the
  extensible cache's measured bytes, free memory at the utilization's edge), lengths
  beside windows, chunks and blocks, and explicit zeros. Its engines depend on kvplan's
  plans under the installed release's rules: a seed reproduces them only for the same
  kvplan and release;
- fuzz_c: what a listing of every request field's values over the other sections and
  the fixed scenarios showed nothing varies: RSWA, cross, circular, hidden-state and
  encoder-only layers with their attention parameters varied, beside every other kind
  and with TP / DCP / pipeline stages; SW-MLA with MLA cache dtypes, quantization and
  alignments; non-causal or windowed sinks; several windows; per-layer dtypes;
  quantized head slots grouped by KV head on every kind; stride alignments on every
  kind; drafters of any kind anywhere in the layer order; workers of one engine with
  budgets of different modes, devices named instead of sized. It draws from a
  generator of its own, so adding it left every other section's engines as they were;
- fuzz_v: vLLM 0.34's own rules on engines sized to plan (fuzz_c's mostly draw
  refusals, which compare only the error): block size unset (0.34's 64) or set, the
  extensible cache on / off / unset with overrides, explicit, measured and
  unset-utilization budgets, head slots grouped by KV head, Mamba state alignment,
  SW-MLA markers and merges, zeroing across pipeline stages, own-layer tensors,
  workers' differing layout lists, drafters marked is_draft, HiSparse. A generator
  of its own, like fuzz_c's.
"""

# The sections build each engine from helpers defined in the loop iteration that
# calls them (they read that iteration's draws), which B023 cannot tell apart from a
# late-binding closure.
# ruff: noqa: B023

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from conformance.generate import (
    _DTYPES,
    GDN_STATES,
    GIB,
    LAYOUTS,
    MIB,
    SMALL_STATES,
    Cases,
    Layer,
    W,
    chunked,
    cross,
    encoder_only,
    full,
    mamba,
    mla,
    request,
    sink,
    sw,
    sw_mla,
)
from kvplan.gpus import GPU_MEMORY_BYTES as GPU_BYTES
from kvplan.v1 import plan_pb2, spec_pb2

_BYTES = {None: 2, "fp16": 2, "bf16": 2, "fp32": 4, "e4m3": 1}

# (attention kinds, with mamba). The first kind is the "global" one.
_MIXES: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("full",), False),
    (("full", "sw"), False),
    (("full", "chunked"), False),
    (("full", "sw", "chunked"), False),
    (("sw",), False),
    (("mla",), False),
    (("mla", "sw_mla"), False),
    (("full",), True),
    (("full", "sw"), True),
    (("sw", "chunked"), True),
    (("mla",), True),
    ((), True),
    (("full", "sink"), False),
    (("full", "cross"), False),
    (("full", "encoder_only"), False),
    (("full", "sw", "encoder_only"), False),
)

# Speculative methods with a drafter or a proposer (vLLM's names).
_SPEC_METHODS = ("mtp", "eagle", "eagle3", "dspark", "dflash", "ngram", "draft_model", "suffix")

_MAMBA_STATES = (
    SMALL_STATES,
    GDN_STATES,
    [([4, 8192], "bf16"), ([64, 128, 64], "bf16")],  # Mamba2-ish
    [([2, 3072], "bf16")],  # short conv
)


def _attn_per_token(kind: str, heads: int, head: int, head_v: int, dtype: str | None) -> int:
    if kind in ("mla", "sw_mla"):
        return head * _BYTES[dtype]
    return heads * (head + head_v) * _BYTES[dtype]


def _mamba_page(states: list[tuple[list[int], str]]) -> int:
    return sum(math.prod(shape) * _BYTES[dtype] for shape, dtype in states)


def _wide_layer(
    c: Cases,
    kind: str,
    name: str,
    *,
    heads: int,
    head: int,
    head_v: int,
    dtype: str | None,
    window: int,
    chunk: int,
    mla_head: int,
    states: list[tuple[list[int], str]],
    padded: int | None,
    spec_blocks: int,
    mamba_type: int,
    tp_replicated: bool,
    sw_block: int | None,
    tp_shards: int | None,
    dcp_sharded: bool | None,
    draft: bool = False,
) -> Layer:
    a: dict[str, Any] = {}
    if dtype:
        a["dtype"] = dtype
    if head_v != head:
        a["head_v"] = head_v
    if tp_shards is not None:
        a["tp_shards"] = tp_shards
    if dcp_sharded is not None:
        a["dcp_sharded"] = dcp_sharded
    if kind == "full":
        return full(name, heads, head, a=a or None, draft=draft)
    if kind == "sw":
        return sw(name, window, heads, head, a=a or None, draft=draft, block=sw_block)
    if kind == "chunked":
        return chunked(name, chunk, heads, head, a=a or None, draft=draft)
    if kind == "sink":
        return sink(name, window_sink(window), heads, head, a=a or None, draft=draft)
    if kind == "cross":
        return cross(name, heads, head)
    if kind == "encoder_only":
        return encoder_only(name, heads, head)
    mla_a: dict[str, Any] = {"tp_shards": 1}
    if dcp_sharded is not None:
        mla_a["dcp_sharded"] = dcp_sharded
    if kind == "mla":
        return mla(name, mla_head, a=mla_a, draft=draft)
    if kind == "sw_mla":
        return sw_mla(name, window, mla_head, a=mla_a, draft=draft, block=sw_block)
    assert kind == "mamba"
    return mamba(
        name,
        states,
        padded=padded,
        spec_blocks=spec_blocks,
        mamba_type=mamba_type,
        tp_replicated=tp_replicated,
        draft=draft,
    )


def _split(c: Cases, n: int, pp: int) -> list[int]:
    """pp cut points (uneven), every stage non-empty."""
    if pp == 1:
        return [0, n]
    if c.pick([True, False]):
        per = n // pp
        return [i * per for i in range(pp)] + [n]
    cuts = sorted(c.rng.sample(range(1, n), pp - 1))
    return [0, *cuts, n]


def fuzz_wide(c: Cases, count: int) -> None:
    cat = "fuzzw"
    for i in range(count):
        attn_kinds, with_mamba = c.pick(_MIXES)
        n_layers = c.pick([1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 40, 48, 61, 64, 80])
        period = c.pick([1, 2, 3, 4, 5, 6, 8])
        heads = c.pick([1, 2, 4, 8, 16, 32])
        head = c.pick([64, 80, 96, 128, 192, 256])
        head_v = head if c.rng.random() < 0.85 else c.pick([64, 128, 256])
        dtype = c.pick([None, None, None, "fp16", "fp32", "e4m3"])
        window = c.pick([128, 256, 512, 1024, 2048, 4096, 8192])
        chunk = c.pick([256, 1024, 2048, 8192])
        mla_head = c.pick([576, 576, 512])
        states = c.pick(_MAMBA_STATES)
        mamba_type = c.pick(
            [
                spec_pb2.MAMBA_TYPE_MAMBA2,
                spec_pb2.MAMBA_TYPE_GDN_ATTENTION,
                spec_pb2.MAMBA_TYPE_SHORT_CONV,
                spec_pb2.MAMBA_TYPE_LINEAR,
            ]
        )
        tp_replicated = c.rng.random() < 0.1
        cache_dtype = c.pick([spec_pb2.KV_CACHE_DTYPE_AUTO] * 4 + [spec_pb2.KV_CACHE_DTYPE_FP8])
        model_dtype = c.pick([None, None, "fp16", "bf16"])
        # Layer kinds: one "global" kind every `period` layers, the others between.
        kinds: list[str] = []
        pool = list(attn_kinds)
        if with_mamba:
            pool = ["mamba", *pool]
        for j in range(n_layers):
            if len(pool) == 1:
                kinds.append(pool[0])
            elif with_mamba:
                # Mamba most layers, attention every `period`.
                if j % period == period - 1 and attn_kinds:
                    kinds.append(attn_kinds[(j // period) % len(attn_kinds)])
                else:
                    kinds.append("mamba")
            elif j % period == period - 1:
                kinds.append(pool[0])
            else:
                kinds.append(pool[1 + j % (len(pool) - 1)])
        tp = c.pick([1, 1, 2, 4, 8])
        dcp = 0
        if tp > 1 and c.rng.random() < 0.3:
            dcp = c.pick([d for d in (2, 4, 8) if d <= tp and tp % d == 0])
        pp = c.pick([1, 1, 1, 2, 3, 4]) if n_layers >= 4 else 1
        method = c.pick(["none"] * 3 + list(_SPEC_METHODS))
        spec_tokens = c.pick([1, 2, 3, 4, 5, 7]) if method != "none" else 0
        nextn = c.pick([None, None, 1, 2, 3]) if method == "mtp" else None
        # Block size, realistic hybrid alignment (vLLM's _align_hybrid_block_size).
        block_size = c.pick([0, 0, 16, 32, 64, 128, 256])
        prefix_caching = c.pick([None, None, None, True, False])
        disable_hybrid = c.rng.random() < 0.15
        padded = None
        engine_block = block_size
        align_mode: bool | None = None
        has_attention = any(k not in ("mamba", "cross", "encoder_only") for k in kinds)
        if with_mamba:
            # The engine's default: on for hybrid, off for Mamba only.
            caching = prefix_caching if prefix_caching is not None else has_attention
            align_mode = caching
            if has_attention:
                main = "mla" if "mla" in attn_kinds else "full"
                per_token = _attn_per_token(main, heads, head, head_v, dtype)
                if cache_dtype == spec_pb2.KV_CACHE_DTYPE_FP8 and not dtype:
                    per_token = _attn_per_token(main, heads, head, head_v, "e4m3")
                elif not dtype and model_dtype == "fp32":
                    per_token *= 2
                page = _mamba_page(states)
                base = block_size or 16
                align = max(16, base)
                if main == "mla":
                    align = max(align, 128)
                attn_block = align * -(-page // (align * per_token))
                attn_block = 16 * -(-attn_block // 16)
                engine_block = max(base, attn_block)
                if engine_block * per_token != page:
                    padded = engine_block * per_token
        spec_blocks = spec_tokens if (with_mamba and method != "none") else 0
        # Per-layer SW block (vLLM's SW layers choose their own kernel block).
        sw_block = None
        if c.rng.random() < 0.15 and not with_mamba:
            sw_block = c.pick([16, 32, 64])
        tp_shards = None
        if tp > 1 and c.rng.random() < 0.2:
            tp_shards = c.pick([1, 2, heads])
        dcp_sharded = None
        if dcp and c.rng.random() < 0.3:
            dcp_sharded = False
        shape = dict(
            heads=heads,
            head=head,
            head_v=head_v,
            dtype=dtype,
            window=window,
            chunk=chunk,
            mla_head=mla_head,
            states=states,
            padded=padded,
            spec_blocks=spec_blocks,
            mamba_type=mamba_type,
            tp_replicated=tp_replicated,
            sw_block=sw_block,
            tp_shards=tp_shards,
            dcp_sharded=dcp_sharded,
        )
        mixed_heads = c.rng.random() < 0.2 and not with_mamba
        layers: list[Layer] = []
        for j, kind in enumerate(kinds):
            s = dict(shape)
            if mixed_heads and kind not in ("mla", "sw_mla", "mamba"):
                s["heads"] = c.pick([heads, 2 * heads, max(1, heads // 2)])
            layers.append(_wide_layer(c, kind, f"model.layers.{j}.attn", **s))
        # Drafters: EAGLE-family heads with a drafter model of their own.
        if method in ("mtp", "eagle", "eagle3", "dspark", "dflash", "draft_model") and (
            c.rng.random() < 0.7
        ):
            attn_only = [k for k in kinds if k not in ("mamba", "cross", "encoder_only")]
            draft_kind = c.pick(
                (attn_only or ["full"]) + (["full"] if "mla" not in attn_kinds else ["mla"])
            )
            n_draft = c.pick([1, 1, 1, 2, 3])
            mark = c.pick([True, True, False])
            for d in range(n_draft):
                s = dict(shape)
                if c.rng.random() < 0.3 and draft_kind not in ("mla", "sw_mla"):
                    s["heads"] = c.pick([1, 2, 4, 8])
                    s["head"] = c.pick([64, 128])
                    s["head_v"] = s["head"]
                prefix = "mtp.layers" if method == "mtp" else "draft_model.layers"
                layers.append(_wide_layer(c, draft_kind, f"{prefix}.{d}.attn", draft=mark, **s))
        n_all = len(layers)
        pp = min(pp, n_all)
        cuts = _split(c, n_all, pp)
        utilization_mode = c.rng.random() < 0.3
        workers: list[W] = []
        base_bytes = c.pick([16 * MIB, 128 * MIB, 512 * MIB, GIB, 4 * GIB, 20 * GIB, 60 * GIB])
        for stage in range(pp):
            own = layers[cuts[stage] : cuts[stage + 1]]
            for _ in range(tp):
                if utilization_mode:
                    workers.append(
                        W(
                            own,
                            total=c.pick([24 * GIB, 80 * GIB, 141 * GIB]),
                            utilization=c.pick([0.5, 0.9, 0.92, 0.95]),
                            non_kv=(c.pick([1, 8, 16]) * GIB, 512 * MIB, 200 * MIB, 64 * MIB),
                        )
                    )
                else:
                    jitter = c.pick([0, 0, 0, 4097, 3 * MIB])
                    workers.append(W(own, base_bytes + jitter))
        auto_fit = c.rng.random() < 0.2
        max_model_len = c.pick([512, 2048, 4096, 8192, 32768, 131072, 262144])
        batched = c.pick([0, 0, 256, 512, 2048, 8192, 16384, 65536])
        req = request(
            workers,
            max_model_len=-1 if auto_fit else max_model_len,
            derived=c.pick([8192, 32768, 131072, 1 << 20]) if auto_fit else None,
            block_size=engine_block,
            cache_dtype=cache_dtype,
            model_dtype=model_dtype,
            disable_hybrid=disable_hybrid,
            override=c.pick([None] * 6 + [16, 64, 1000, 4096]),
            batched=batched,
            async_scheduling=c.pick([False, True]),
            v2_runner=c.pick([False, True]),
            pp=pp if pp > 1 else 0,
            tp=tp if tp > 1 else 0,
            dcp=dcp,
            layout=c.pick(["LBNHC", "LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]),
            mamba_align=align_mode,
            encoder_tokens=c.pick([0, 1500, 4096]) if "cross" in attn_kinds else 0,
            prefix_caching=prefix_caching,
            method=method,
            spec_tokens=spec_tokens,
            target_model_type=c.pick(["", "", "qwen3_next", "deepseek_v3", "deepseek_v4"]),
            disable_block_drop=c.rng.random() < 0.1,
            nextn=nextn,
        )
        if c.rng.random() < 0.1:
            req.options.prefix_match_unit = c.pick([1, 8, 16, 32, 64])
        if c.rng.random() < 0.25:
            # vLLM 0.34's extensible cache (cleared for older releases).
            req.options.extensible_kv_cache = c.pick([True, True, False])
            if c.rng.random() < 0.7 and req.options.extensible_kv_cache:
                granule = c.pick([None, 64 << 10, 2 << 20])
                for worker in req.workers:
                    worker.memory.measured_kv_cache_bytes = c.pick(
                        [64 * MIB, 700 * MIB, 3 * GIB, 30 * GIB]
                    ) + c.rng.randrange(1 << 20)
                    if granule:
                        worker.memory.allocation_granule_bytes = granule
        mix_name = "+".join((("mamba",) if with_mamba else ()) + attn_kinds)
        c.add(
            cat,
            f"w{i:04d}",
            f"{n_layers} layers {mix_name} period {period} heads {heads}x{head}/{head_v} "
            f"{dtype or 'auto'} {method}x{spec_tokens} pp{pp} tp{tp} dcp{dcp} "
            f"block {engine_block} padded {padded}",
            req,
        )


_MLA_VARIANTS: tuple[tuple[str, dict[str, Any], int], ...] = (
    # (name, mla() kwargs, cache dtype)
    ("bf16", {}, spec_pb2.KV_CACHE_DTYPE_AUTO),
    ("fp8", {"a": {"dtype": "u8"}}, spec_pb2.KV_CACHE_DTYPE_FP8),
    ("fp8_ds_mla", {"a": {"dtype": "u8", "content": 656}}, spec_pb2.KV_CACHE_DTYPE_FP8_DS_MLA),
    (
        "nvfp4_ds_mla",
        {"a": {"dtype": "u8", "content": 352, "quant": 10}},
        spec_pb2.KV_CACHE_DTYPE_NVFP4_DS_MLA,
    ),
)


def _with(a: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
    out = dict(a or {})
    out.update({k: v for k, v in more.items() if v is not None})
    return out


def fuzz_x(c: Cases, count: int) -> None:
    """Engine families the first wide fuzz leaves out: DeepSeek-V3.2-like sparse MLA
    with indexers, DeepSeek-V4-like packed SW-MLA + compressed MLA, MLA cache dtypes,
    Mamba prefill checkpoints, Qwen3-Next-like GDN hybrids with MTP, RSWA, padded SW
    pages and SW blocks of their own, free-memory checks."""
    cat = "fuzzx"
    from conformance.generate import rswa

    families = ("dsv32", "dsv4", "mla", "mamba-ckpt", "qwen-next", "rswa", "sw-padded", "gemma")
    for i in range(count):
        fam = c.pick(families)
        n = c.pick([2, 3, 4, 6, 8, 12, 16, 24, 32, 61])
        method = c.pick(["none", "none", "mtp", "eagle", "eagle3", "dspark", "ngram"])
        spec_tokens = c.pick([1, 2, 3, 4]) if method != "none" else 0
        nextn = c.pick([None, 1, 2, 3]) if method == "mtp" else None
        tp = c.pick([1, 1, 2, 4, 8])
        dcp = 0
        block_size = c.pick([0, 16, 32, 64])
        layout = c.pick(["LBNHC", "LBNHC", "BLHNC", "BLNHC", "LBHNC", "LHBNC", "BHLNC"])
        cache_dtype = spec_pb2.KV_CACHE_DTYPE_AUTO
        prefix_caching = c.pick([None, None, True, False])
        mamba_align: bool | None = None
        max_model_len = c.pick([2048, 8192, 32768, 131072, 163840])
        disable_hybrid = c.rng.random() < 0.1
        layers: list[Layer] = []
        draft_mark = c.pick([True, True, False])
        with_drafter = method in ("mtp", "eagle", "eagle3", "dspark") and c.rng.random() < 0.7
        if fam == "dsv32":
            _, kw, cache_dtype = c.pick(_MLA_VARIANTS)
            block_size = 64
            topk = c.pick([None, 2048])
            for j in range(n):
                a = _with(kw.get("a"), tp_shards=1)
                layers.append(
                    mla(
                        f"model.layers.{j}.self_attn.attn",
                        576,
                        a=a,
                        topk=topk,
                        leader=(j % c.pick([1, 1, 2]) == 0),
                    )
                )
                if c.rng.random() < 0.9:
                    layers.append(
                        mla(
                            f"model.layers.{j}.self_attn.indexer.k_cache",
                            132,
                            a={"dtype": "u8", "tp_shards": 1},
                            indexer=True,
                        )
                    )
            if with_drafter:
                a = _with(kw.get("a"), tp_shards=1)
                layers.append(
                    mla(
                        "model.layers.61.self_attn.attn",
                        576,
                        a=a,
                        topk=topk,
                        draft=draft_mark,
                        leader=True,
                    )
                )
                layers.append(
                    mla(
                        "model.layers.61.self_attn.indexer.k_cache",
                        132,
                        a={"dtype": "u8", "tp_shards": 1},
                        indexer=True,
                        draft=draft_mark,
                    )
                )
            if tp > 1 and c.rng.random() < 0.3:
                dcp = c.pick([d for d in (2, 4, 8) if d <= tp])
        elif fam == "dsv4":
            block_size = c.pick([64, 128, 256])
            layout = c.pick(["BLHNC", "BLHNC", "BLNHC", "LBNHC"])
            window = c.pick([128, 256])
            replay = c.rng.random() < 0.3
            for j in range(n):
                layers.append(
                    sw_mla(
                        f"model.layers.{j}.swa",
                        window,
                        a={"tp_shards": 1},
                        block=64,
                        version="deepseek_v4",
                        alignment=576,
                        bounded_replay=replay,
                    )
                )
                if c.rng.random() < 0.8:
                    tps = c.pick([4, 128])
                    layers.append(
                        mla(
                            f"model.layers.{j}.mla",
                            a={"tokens": tps, "tp_shards": 1},
                            block=256,
                            version="deepseek_v4",
                            alignment=576,
                        )
                    )
            if with_drafter:
                layers.append(
                    sw_mla(
                        f"mtp.{n}.swa",
                        window,
                        a={"tp_shards": 1},
                        block=64,
                        version="deepseek_v4",
                        alignment=576,
                        bounded_replay=replay,
                        draft=draft_mark,
                    )
                )
                layers.append(
                    mla(
                        f"mtp.{n}.mla",
                        a={"tokens": 4, "tp_shards": 1},
                        block=256,
                        version="deepseek_v4",
                        alignment=576,
                        draft=draft_mark,
                    )
                )
        elif fam == "mla":
            _, kw, cache_dtype = c.pick(_MLA_VARIANTS)
            extra = c.pick([{}, {}, {"alignment": 4096}, {"tokens": 4}, {"topk": 2048}])
            a = _with(kw.get("a"), tp_shards=1, tokens=extra.get("tokens"))
            for j in range(n):
                layers.append(
                    mla(
                        f"model.layers.{j}.attn",
                        576,
                        a=a,
                        alignment=extra.get("alignment"),
                        topk=extra.get("topk"),
                    )
                )
            if with_drafter:
                for d in range(c.pick([1, 1, 2])):
                    layers.append(
                        mla(
                            f"mtp.layers.{d}.attn",
                            576,
                            a=a,
                            alignment=extra.get("alignment"),
                            topk=extra.get("topk"),
                            draft=draft_mark,
                            marker=c.rng.random() < 0.2,
                        )
                    )
            if tp > 1 and c.rng.random() < 0.4:
                dcp = c.pick([d for d in (2, 4, 8) if d <= tp])
        elif fam in ("mamba-ckpt", "qwen-next"):
            states = GDN_STATES if fam == "qwen-next" else c.pick([SMALL_STATES, GDN_STATES])
            heads, head = c.pick([(2, 256), (4, 256), (8, 128), (2, 128)])
            dtype = c.pick([None, "fp32"]) if fam == "qwen-next" else None
            with_attention = fam == "qwen-next" or c.rng.random() < 0.6
            caching = prefix_caching if prefix_caching is not None else with_attention
            mamba_align = caching
            ckpt = c.pick([0, 0, 1, 2]) if caching else 0
            ckpt_align = c.pick([None, 64]) if ckpt else None
            engine = block_size or 16
            padded = None
            if with_attention:
                per_token = heads * head * 2 * _BYTES[dtype]
                page = _mamba_page(states)
                align = max(16, engine)
                if ckpt_align and caching:
                    align = math.lcm(align, ckpt_align)
                attn_block = align * -(-page // (align * per_token))
                engine = max(engine, 16 * -(-attn_block // 16))
                if engine * per_token != page:
                    padded = engine * per_token
            block_size = engine
            period = c.pick([2, 3, 4])
            for j in range(n):
                if with_attention and j % period == period - 1:
                    layers.append(
                        full(
                            f"model.layers.{j}.self_attn.attn",
                            heads,
                            head,
                            a={"dtype": dtype} if dtype else None,
                        )
                    )
                else:
                    layers.append(
                        mamba(
                            f"model.layers.{j}.linear_attn",
                            states,
                            padded=padded,
                            spec_blocks=spec_tokens,
                            checkpoint_blocks=ckpt,
                            checkpoint_alignment=ckpt_align,
                            mamba_type=spec_pb2.MAMBA_TYPE_GDN_ATTENTION
                            if fam == "qwen-next"
                            else spec_pb2.MAMBA_TYPE_MAMBA2,
                        )
                    )
            if with_drafter and with_attention:
                layers.append(
                    full(
                        "mtp.layers.0.self_attn.attn",
                        heads,
                        head,
                        a={"dtype": dtype} if dtype else None,
                        draft=draft_mark,
                    )
                )
        elif fam == "rswa":
            w = c.pick([256, 512, 1024])
            for j in range(n):
                layers.append(rswa(f"model.layers.{j}.attn", w, 8, 128))
            if c.rng.random() < 0.5:
                layers.append(full("model.layers.full.attn", 8, 128))
        elif fam == "sw-padded":
            heads, head = c.pick([(8, 128), (4, 64), (8, 96), (16, 128)])
            engine = block_size or 16
            window = c.pick([128, 512, 1024, 4096])
            sw_block = c.pick([None, 16, 32])
            sw_heads, sw_head = c.pick([(heads, head), (4, 64), (8, 96), (heads, 96)])
            full_page = engine * heads * head * 4
            sw_block_eff = sw_block or engine
            sw_page = sw_block_eff * sw_heads * sw_head * 4
            padded = (
                full_page
                if (sw_page < full_page and full_page % sw_page and c.rng.random() < 0.7)
                else None
            )
            period = c.pick([2, 4, 6])
            for j in range(n):
                if j % period == period - 1:
                    layers.append(full(f"model.layers.{j}.attn", heads, head))
                else:
                    layers.append(
                        sw(
                            f"model.layers.{j}.attn",
                            window,
                            sw_heads,
                            sw_head,
                            a={"padded": padded} if padded else None,
                            block=sw_block,
                        )
                    )
            if with_drafter:
                layers.append(
                    c.pick(
                        [
                            full("draft.layers.0.attn", heads, head, draft=draft_mark),
                            sw(
                                "draft.layers.0.attn",
                                window,
                                sw_heads,
                                sw_head,
                                draft=draft_mark,
                                a={"padded": padded} if padded else None,
                                block=sw_block,
                            ),
                        ]
                    )
                )
        else:  # gemma: 5:1 SW with global full, different head dims per type
            heads, head = c.pick([(8, 128), (16, 256), (4, 256), (1, 256)])
            g_heads, g_head = c.pick([(heads, head), (heads, 2 * head), (2 * heads, head)])
            window = c.pick([512, 1024, 4096])
            for j in range(n):
                if j % 6 == 5:
                    layers.append(full(f"model.layers.{j}.attn", g_heads, g_head))
                else:
                    layers.append(sw(f"model.layers.{j}.attn", window, heads, head))
            if with_drafter:
                layers.append(sw("draft.layers.0.attn", window, heads, head, draft=draft_mark))
        pp = c.pick([1, 1, 1, 2, 3]) if len(layers) >= 4 else 1
        cuts = _split(c, len(layers), pp)
        free_check = c.rng.random() < 0.15
        utilization_mode = free_check or c.rng.random() < 0.2
        base = c.pick([64 * MIB, 512 * MIB, 2 * GIB, 8 * GIB, 40 * GIB])
        workers: list[W] = []
        for stage in range(pp):
            own = layers[cuts[stage] : cuts[stage + 1]]
            for _ in range(tp):
                if utilization_mode:
                    workers.append(
                        W(
                            own,
                            total=80 * GIB,
                            utilization=c.pick([0.5, 0.9]),
                            non_kv=(c.pick([2, 20]) * GIB, GIB, 256 * MIB, 0),
                        )
                    )
                else:
                    workers.append(W(own, base + c.pick([0, 0, 12345])))
        auto_fit = c.rng.random() < 0.2
        req = request(
            workers,
            max_model_len=-1 if auto_fit else max_model_len,
            derived=c.pick([32768, 163840, 1 << 20]) if auto_fit else None,
            block_size=block_size,
            cache_dtype=cache_dtype,
            disable_hybrid=disable_hybrid,
            override=c.pick([None] * 8 + [64, 3000]),
            batched=c.pick([0, 0, 1024, 4096, 16384]),
            async_scheduling=c.pick([False, True]),
            v2_runner=c.pick([False, True]),
            pp=pp if pp > 1 else 0,
            tp=tp if tp > 1 else 0,
            dcp=dcp,
            layout=layout,
            mamba_align=mamba_align,
            prefix_caching=prefix_caching,
            method=method,
            spec_tokens=spec_tokens,
            target_model_type=c.pick(
                ["", "deepseek_v3", "deepseek_v32", "deepseek_v4", "qwen3_next"]
            ),
            disable_block_drop=c.rng.random() < 0.1,
            nextn=nextn,
        )
        if free_check:
            for worker in req.workers:
                worker.device.free_memory_bytes = c.pick([80 * GIB, 60 * GIB, 30 * GIB])
        if c.rng.random() < 0.1:
            req.options.prefix_match_unit = c.pick([1, 4, 16, 64])
        c.add(
            cat,
            f"x{i:04d}",
            f"{fam} {len(layers)} layers {method}x{spec_tokens} pp{pp} tp{tp} dcp{dcp} "
            f"block {block_size} {layout}",
            req,
        )


def window_sink(window: int) -> int:
    """One sink length per engine (a model config has one), from the engine's draw."""
    return {128: 16, 256: 64, 512: 128, 1024: 16, 2048: 64, 4096: 128, 8192: 256}[window]


# --- fuzz_y: fields and values the earlier sections fix or leave out ---------------


_Y_BYTES = {None: 2, "fp16": 2, "bf16": 2, "fp32": 4, "e4m3": 1, "e5m2": 1, "i8": 1, "u8": 1}

# (dtype, kv_quant_mode, content-bytes rule) of quantized attention caches a backend
# publishes: per-token-head int8/fp8 (a scale per head and token), int4 / NVFP4 /
# TurboQuant packing (opaque uint8 content).
_Y_QUANT: tuple[tuple[str, int, str | None], ...] = (
    ("i8", spec_pb2.KV_QUANT_MODE_INT8_PER_TOKEN_HEAD, "scales"),
    ("e4m3", spec_pb2.KV_QUANT_MODE_FP8_PER_TOKEN_HEAD, "scales"),
    ("u8", spec_pb2.KV_QUANT_MODE_INT4_PER_TOKEN_HEAD, "int4"),
    ("u8", spec_pb2.KV_QUANT_MODE_NVFP4, "nvfp4"),
    ("u8", spec_pb2.KV_QUANT_MODE_TURBOQUANT_K8V4, "k8v4"),
    ("u8", spec_pb2.KV_QUANT_MODE_TURBOQUANT_4BIT_NC, "int4"),
    ("e4m3", spec_pb2.KV_QUANT_MODE_FP8_PER_TENSOR, None),
    ("e5m2", spec_pb2.KV_QUANT_MODE_FP8_PER_TENSOR, None),
)

_Y_CACHE_DTYPES = (
    spec_pb2.KV_CACHE_DTYPE_AUTO,
    spec_pb2.KV_CACHE_DTYPE_AUTO,
    spec_pb2.KV_CACHE_DTYPE_AUTO,
    spec_pb2.KV_CACHE_DTYPE_FLOAT16,
    spec_pb2.KV_CACHE_DTYPE_BFLOAT16,
    spec_pb2.KV_CACHE_DTYPE_FLOAT32,
    spec_pb2.KV_CACHE_DTYPE_FP8,
    spec_pb2.KV_CACHE_DTYPE_FP8_E4M3,
    spec_pb2.KV_CACHE_DTYPE_FP8_E5M2,
    spec_pb2.KV_CACHE_DTYPE_INT8_PER_TOKEN_HEAD,
    spec_pb2.KV_CACHE_DTYPE_FP8_INC,
)

_Y_KINDS = (
    "full",
    "sw",
    "chunked",
    "sink",
    "hidden",
    "circular",
    "cross",
    "encoder_only",
    "mamba",
    "mla",
    "sw_mla",
    "full_window",
    "full_chunk",
    "nonc",
)

_Y_MIXES: tuple[tuple[str, ...], ...] = (
    ("full",),
    ("sw",),
    ("chunked",),
    ("sink",),
    ("mamba",),
    ("mla",),
    ("sw_mla",),
    ("hidden",),
    ("circular",),
    ("cross",),
    ("encoder_only",),
    ("nonc",),
    ("full", "sw"),
    ("full", "chunked"),
    ("sw", "chunked"),
    ("full", "mamba"),
    ("sw", "mamba"),
    ("chunked", "mamba"),
    ("full", "sink"),
    ("sink", "sw"),
    ("full", "hidden"),
    ("full", "circular"),
    ("sw", "circular"),
    ("full", "cross"),
    ("sw", "cross"),
    ("full", "encoder_only"),
    ("mamba", "encoder_only"),
    ("mla", "mamba"),
    ("mla", "sw"),
    ("mla", "full"),
    ("full", "full_window"),
    ("full", "full_chunk"),
    ("full", "nonc"),
    ("nonc", "sw"),
    ("full", "sw", "mamba"),
    ("full", "sw", "chunked", "mamba"),
    ("full", "sink", "sw"),
    ("full", "cross", "sw"),
)


def _y_states(c: Cases) -> list[tuple[list[int], str]]:
    states: list[tuple[list[int], str]] = c.pick(
        [
            SMALL_STATES,
            GDN_STATES,
            [([4, 8192], "bf16"), ([64, 128, 64], "bf16")],
            [([2, 3072], "bf16")],
            [([1, 1], "fp32")],  # a degenerate (tiny) state
            [([3, 1536], "fp16"), ([16, 64, 64], "fp16")],
            [([7, 333], "fp32")],  # odd sizes
            [([2, 1000], "bf16"), ([4, 100, 10], "fp32")],
        ]
    )
    return states


def fuzz_y(c: Cases, count: int) -> None:
    """Odd head sizes, quantized caches (num_head_slots, state_content_bytes,
    kv_quant_mode), cache / model dtypes, compressed and pooled states, block sizes
    and stride alignments, per-layer blocks, every kind alone and in pairs (hidden,
    circular, non-causal, FullAttention with window / chunk metadata), Mamba types,
    heads, state alignment, checkpoints, drafters of other kinds and methods,
    TP x DCP x PP, and edge values of max_model_len, batched tokens, overrides,
    budgets (bytes, utilization 1.0, too small)."""
    from conformance.generate import circular, hidden, rswa  # noqa: F401

    cat = "fuzzy"
    for i in range(count):
        rng = c.rng
        mix = c.pick(_Y_MIXES)
        n = c.pick([1, 1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 33, 48, 64, 95])
        heads = c.pick([1, 1, 2, 3, 4, 5, 8, 12, 16, 20, 32, 64, 128])
        head = c.pick([8, 16, 32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256, 320, 512])
        head_v = head if rng.random() < 0.8 else c.pick([0, 16, 64, 96, 128, 256, 512])
        if head_v == 0:
            head_v = head
        dtype = c.pick([None, None, None, "fp16", "bf16", "fp32", "e4m3", "e5m2", "i8", "u8"])
        quant = None
        if rng.random() < 0.2:
            quant = c.pick(_Y_QUANT)
            dtype = quant[0]
        window = c.pick([1, 2, 16, 17, 64, 100, 128, 1000, 4096, 32768, 1 << 20])
        chunk = c.pick([1, 16, 64, 100, 256, 1024, 8192, 1 << 20])
        sink_len = c.pick([0, 1, 16, 32, 64, 100, 128, 512])
        mla_head = c.pick([576, 512, 656, 64, 1, 320])
        states = _y_states(c)
        mamba_type = c.pick(
            [
                spec_pb2.MAMBA_TYPE_MAMBA1,
                spec_pb2.MAMBA_TYPE_MAMBA2,
                spec_pb2.MAMBA_TYPE_SHORT_CONV,
                spec_pb2.MAMBA_TYPE_LINEAR,
                spec_pb2.MAMBA_TYPE_GDN_ATTENTION,
                spec_pb2.MAMBA_TYPE_CUSTOM,
            ]
        )
        mamba_heads = c.pick([0, 0, 0, 1, 2, 8, 32])
        state_align = c.pick([None, None, None, 16, 64, 512, 4096])
        cache_dtype = c.pick(_Y_CACHE_DTYPES)
        model_dtype = c.pick([None, None, "fp16", "bf16", "fp32"])
        slots = None
        content = None
        if quant is not None and quant[2] is not None:
            rule = quant[2]
            total = head + head_v
            if rule == "scales":
                content = total + 8  # values + a 4-byte scale for K and V
            elif rule == "int4":
                content = total // 2 + 8
            elif rule == "nvfp4":
                content = total // 2 + total // 16
            else:
                content = head + head_v // 2 + 8
            if rng.random() < 0.3:
                slots = c.pick([1, heads, 2 * heads])
        engine_block = c.pick([0, 0, 0, 1, 2, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048])
        layer_block = None
        if rng.random() < 0.15:
            layer_block = c.pick([1, 8, 16, 32, 64, 128, 256])
        align_bytes = None
        align_kernel = None
        r = rng.random()
        if r < 0.08:
            align_bytes = c.pick([1, 2, 256, 512, 4096, 65536, 2 << 20])
        elif r < 0.16:
            align_kernel = c.pick([1, 8, 16, 32, 64, 128])
        # Compressed / pooled states: a block holds at least one state (D8 refuses
        # fewer, which vLLM may or may not trip over).
        tps: dict[str, Any] = {}
        r = rng.random()
        smallest = min(engine_block or 16, layer_block or (1 << 30))
        if align_kernel:
            smallest = min(smallest, math.gcd(align_kernel, smallest))
        fits = [t for t in (2, 4, 8, 128) if t <= smallest]
        if r < 0.07 and fits:
            tps = {"tokens": c.pick(fits)}
        elif r < 0.12:
            tps = {"states_per_token": c.pick([2, 4])}
        padded_attn = None
        if rng.random() < 0.05:
            padded_attn = c.pick([4096, 65536, 1 << 20])
        tp = c.pick([1, 1, 1, 2, 2, 4, 8, 16])
        dcp = 0
        if tp > 1 and rng.random() < 0.3:
            dcp = c.pick([d for d in (2, 4, 8, 16) if d <= tp and tp % d == 0])
        tp_shards = None
        if tp > 1 and rng.random() < 0.2:
            tp_shards = c.pick([1, 2, max(1, heads), tp])
        dcp_sharded = None
        if rng.random() < 0.15:
            dcp_sharded = c.pick([False, True])

        def a_params(h: int = heads, hs: int = head) -> dict[str, Any]:
            a: dict[str, Any] = {}
            if dtype:
                a["dtype"] = dtype
            if head_v != hs or hs != head:
                a["head_v"] = head_v if hs == head else hs
            if quant is not None:
                a["quant"] = quant[1]
            if content is not None:
                a["content"] = content
            if slots is not None:
                a["slots"] = slots
            a.update(tps)
            if padded_attn is not None:
                a["padded"] = padded_attn
            if tp_shards is not None:
                a["tp_shards"] = tp_shards
            if dcp_sharded is not None:
                a["dcp_sharded"] = dcp_sharded
            return a

        common: dict[str, Any] = {}
        if layer_block is not None:
            common["block"] = layer_block
        if align_bytes is not None:
            common["align_bytes"] = align_bytes
        if align_kernel is not None:
            common["align_kernel"] = align_kernel
        mamba_common = {} if rng.random() < 0.7 else dict(common)
        spec_tokens = 0
        method = c.pick(["none"] * 4 + [*_SPEC_METHODS, "medusa"])
        if method != "none":
            spec_tokens = c.pick([1, 2, 3, 4, 5, 8, 10, 15])
        prefix_caching = c.pick([None, None, None, True, False])
        ckpt = c.pick([0, 0, 0, 1, 2, 4])
        ckpt_align = c.pick([None, None, 16, 64, 128]) if ckpt else None

        def make(kind: str, name: str, draft: bool = False) -> Layer:
            h = heads
            if mixed_heads and kind in ("full", "sw", "chunked", "sink"):
                h = c.pick([heads, 2 * heads, max(1, heads // 2)])
            if kind == "full":
                return full(name, h, head, a=a_params(h), draft=draft, **common)
            if kind == "full_window":
                return full(name, h, head, window=window, a=a_params(h), draft=draft, **common)
            if kind == "full_chunk":
                return full(name, h, head, chunk=chunk, a=a_params(h), draft=draft, **common)
            if kind == "nonc":
                return full(name, h, head, non_causal=True, a=a_params(h), draft=draft, **common)
            if kind == "sw":
                return sw(name, window, h, head, a=a_params(h), draft=draft, **common)
            if kind == "chunked":
                return chunked(name, chunk, h, head, a=a_params(h), draft=draft, **common)
            if kind == "sink":
                return sink(name, sink_len, h, head, a=a_params(h), draft=draft, **common)
            if kind == "cross":
                return cross(name, h, head, dtype=dtype, draft=draft, **common)
            if kind == "encoder_only":
                return encoder_only(name, h, head, draft=draft, **common)
            if kind == "circular":
                return circular(
                    name, c.pick([1, heads]), c.pick([128, 512, head]), draft=draft, **common
                )
            if kind == "hidden":
                return hidden(name, 1, hidden_size, dtype=hidden_dtype, draft=draft, **common)
            if kind == "mla":
                ma: dict[str, Any] = {}
                if tps.get("tokens"):
                    ma["tokens"] = tps["tokens"]
                if dcp_sharded is not None:
                    ma["dcp_sharded"] = dcp_sharded
                return mla(name, mla_head, a=ma or None, draft=draft, **common)
            if kind == "sw_mla":
                return sw_mla(name, window, mla_head, draft=draft, **common)
            assert kind == "mamba"
            layer = mamba(
                name,
                states,
                padded=mamba_padded,
                mamba_type=mamba_type,
                spec_blocks=spec_tokens if method != "none" and rng.random() < 0.8 else 0,
                checkpoint_blocks=ckpt,
                checkpoint_alignment=ckpt_align,
                heads=mamba_heads,
                tp_replicated=rng.random() < 0.15,
                draft=draft,
                **mamba_common,
            )
            if state_align is not None:
                layer.mamba.state_alignment_bytes = state_align
            return layer

        mixed_heads = rng.random() < 0.15
        # One hidden size per model (hidden-state caches of all layers alike).
        hidden_size = c.pick([1024, 4096, 7168])
        hidden_dtype = c.pick(["bf16", "fp16", "fp32"])
        # Mamba hybrids: pad the Mamba page to the attention page as the engine does
        # (most of the time), from the block size the engine would pick.
        mamba_padded = None
        if "mamba" in mix and len(mix) > 1 and rng.random() < 0.75:
            other = next(k for k in mix if k != "mamba")
            per = (head + head_v) * heads * _Y_BYTES[dtype]
            if other in ("mla",):
                per = mla_head * 2
            page = sum(math.prod(s) * _Y_BYTES[d] for s, d in states)
            base = engine_block or 16
            blk = base * -(-page // (base * per))
            engine_block = max(engine_block or 16, blk)
            if engine_block * per > page:
                mamba_padded = engine_block * per
            elif rng.random() < 0.5:
                mamba_padded = page + c.pick([0, 1, 4096])
        period = c.pick([1, 2, 3, 4, 6])
        kinds = [
            mix[0] if len(mix) == 1 or j % period == period - 1 else mix[1 + j % (len(mix) - 1)]
            for j in range(n)
        ]
        if rng.random() < 0.2:
            rng.shuffle(kinds)
        layers = [make(k, f"model.layers.{j}.attn") for j, k in enumerate(kinds)]
        if method in ("mtp", "eagle", "eagle3", "dspark", "dflash", "draft_model", "medusa") and (
            rng.random() < 0.7
        ):
            draft_kind = c.pick([*mix, "full", "sw", "mla", "mamba"])
            if draft_kind in ("encoder_only", "cross"):
                draft_kind = "full"
            mark = c.pick([True, True, False])
            for d in range(c.pick([1, 1, 2, 3])):
                layers.append(make(draft_kind, f"draft.layers.{d}.attn", draft=mark))
        pp = c.pick([1, 1, 1, 2, 3, 4, 8]) if len(layers) >= 2 else 1
        pp = min(pp, len(layers))
        cuts = _split(c, len(layers), pp)
        mode = c.pick(["bytes", "bytes", "bytes", "util", "edge"])
        workers: list[W] = []
        base_bytes = int(2 ** rng.uniform(12, 37))  # 4 KiB .. 128 GiB, log-uniform
        for stage in range(pp):
            own = layers[cuts[stage] : cuts[stage + 1]]
            for _ in range(tp):
                if mode == "util":
                    workers.append(
                        W(
                            own,
                            total=c.pick([8 * GIB, 24 * GIB, 80 * GIB, 141 * GIB]),
                            utilization=c.pick([0.05, 0.3, 0.9, 0.99, 1.0]),
                            non_kv=(
                                c.pick([0, 1, 7, 60]) * GIB,
                                c.pick([0, 512 * MIB]),
                                c.pick([0, 200 * MIB]),
                                c.pick([0, 64 * MIB]),
                            ),
                        )
                    )
                elif mode == "edge":
                    workers.append(W(own, c.pick([1, 4096, 1 << 20, (1 << 40) + 3])))
                else:
                    workers.append(W(own, base_bytes + c.pick([0, 0, 1, 4095])))
        auto_fit = rng.random() < 0.15
        max_model_len = c.pick(
            [1, 2, 15, 16, 17, 100, 511, 2048, 8192, 32768, 131072, 1 << 20, 10_000_000]
        )
        req = request(
            workers,
            max_model_len=-1 if auto_fit else max_model_len,
            derived=c.pick([1, 17, 8192, 131072, 1 << 21]) if auto_fit else None,
            block_size=engine_block,
            cache_dtype=cache_dtype,
            model_dtype=model_dtype,
            disable_hybrid=rng.random() < 0.15,
            override=c.pick([None] * 10 + [1, 2, 3, 17, 1000, 1 << 20]),
            batched=c.pick([0, 0, 0, 1, 16, 100, 2048, 8192, 1 << 20]),
            async_scheduling=c.pick([False, True]),
            v2_runner=c.pick([False, False, True]),
            pp=pp if pp > 1 else 0,
            tp=tp if tp > 1 else 0,
            dcp=dcp,
            layout=c.pick(["LBNHC", "LBNHC", "LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]),
            mamba_align=None,
            encoder_tokens=c.pick([0, 1, 1500, 4096, 1 << 20]) if "cross" in mix else 0,
            prefix_caching=prefix_caching,
            method=method,
            spec_tokens=spec_tokens,
            target_model_type=c.pick(["", "", "qwen3_next", "deepseek_v3", "deepseek_v4", "llama"]),
            disable_block_drop=rng.random() < 0.1,
            nextn=c.pick([None, 1, 2, 3]) if method == "mtp" else None,
        )
        if rng.random() < 0.1:
            req.options.prefix_match_unit = c.pick([1, 2, 8, 16, 32, 64, 128])
        if rng.random() < 0.2:
            req.options.extensible_kv_cache = c.pick([True, False])
            if req.options.extensible_kv_cache and rng.random() < 0.5:
                for worker in req.workers:
                    worker.memory.measured_kv_cache_bytes = int(2 ** rng.uniform(16, 36))
                    if rng.random() < 0.5:
                        worker.memory.allocation_granule_bytes = c.pick([4096, 2 << 20])
        c.add(
            cat,
            f"y{i:04d}",
            f"{n} layers {'+'.join(mix)} heads {heads}x{head}/{head_v} {dtype or 'auto'} "
            f"q{quant[1] if quant else 0} {method}x{spec_tokens} pp{pp} tp{tp} dcp{dcp} "
            f"block {engine_block} {mode}",
            req,
        )


def _as_engines_run_hisparse(req: plan_pb2.PlanRequest, case_id: str) -> None:
    """vLLM refuses HiSparse with pipeline stages, DCP or the hybrid manager off before
    anything is planned: most HiSparse engines drop those settings (their workers
    keep holding different layers, which the planner's stage rules read), one in
    eight keeps them for the refusals. Decided by the case id, not the shared
    generator, so the engines drawn after are unchanged."""
    if zlib.crc32(case_id.encode()) % 8:
        req.options.parallel.ClearField("pipeline_parallel_size")
        req.options.parallel.ClearField("decode_context_parallel_size")
        req.options.disable_hybrid_kv_cache_manager = False


def fuzz_h(c: Cases, count: int) -> None:
    """HiSparse beyond the fixed section: TP (with DCP), pipeline stages, other
    layer kinds beside it, block sizes, hot-unit counts, host page sizes, the
    shared pool, index_topk / device buffer edges, budgets, lengths, spec decode."""
    from conformance.generate import _hisparse_engine, chunked, sink

    cat = "fuzzh"
    for i in range(count):
        rng = c.rng
        kind = c.pick(["none", "none", "sw", "mamba", "full", "chunked", "sink", "mla"])
        block = c.pick([16, 32, 64, 64, 128, 256])
        others: list[Layer] = []
        n_other = c.pick([1, 2, 4])
        if kind == "sw":
            others = [
                sw(f"swa.{j}", c.pick([128, 1024]), 4, 64, block=c.pick([block, 64]))
                for j in range(n_other)
            ]
        elif kind == "mamba":
            others = [mamba(f"mamba.{j}", SMALL_STATES) for j in range(n_other)]
        elif kind == "full":
            others = [full(f"full.{j}", 4, 64) for j in range(n_other)]
        elif kind == "chunked":
            others = [chunked(f"chunk.{j}", 2048, 4, 64) for j in range(n_other)]
        elif kind == "sink":
            others = [sink(f"sink.{j}", 64, 4, 64) for j in range(n_other)]
        elif kind == "mla":
            others = [mla(f"dense.{j}", 576, block=block) for j in range(n_other)]
        sparse = c.pick([1, 2, 4, 8, 16])
        layers = _hisparse_engine(
            rng,
            sparse=sparse,
            indexers=c.pick([0, 1, 2, 4, sparse]),
            leader_every=c.pick([1, 2, 4]),
            block=block,
            sparse_head=c.pick([656, 576, 584]),
            others=others,
            topk=c.pick([None, 512, 2048, 4096]),
            mixed_pages=rng.random() < 0.1,
        )
        if rng.random() < 0.3:
            for layer in layers:
                if layer.WhichOneof("kind") == "hisparse_hot":
                    layer.hisparse_hot.blocks_per_request = c.pick([1, 2, 4, 32])
        tp = c.pick([1, 1, 2, 4, 8])
        dcp = c.pick([0, 0, 2]) if tp >= 2 else 0
        pp = c.pick([1, 1, 1, 2])
        workers: list[W] = []
        base = c.pick([64 * MIB, 256 * MIB, 4 * GIB, 40 * GIB, 120 * GIB])
        if pp == 2:
            # Stages split between decoder layers: a layer's indexer and its hot /
            # resident entries stay with it; the other layers go to the last stage.
            def stage(name: str) -> int:
                if name.startswith("model.layers."):
                    return 0 if int(name.split(".")[2]) < max(1, sparse // 2) else 1
                return 1

            stages = [[layer for layer in layers if stage(layer.name) == s] for s in (0, 1)]
            if not stages[1]:
                stages = [layers]
        else:
            stages = [layers]
        pp = len(stages)
        for own in stages:
            for _ in range(tp):
                workers.append(W(own, kv_bytes=base + c.pick([0, 0, 12345])))
        auto_fit = rng.random() < 0.3
        method = c.pick(["none", "none", "mtp", "eagle", "ngram"])
        req = request(
            workers,
            max_model_len=-1 if auto_fit else c.pick([16, 2048, 8192, 131_072, 1 << 20]),
            derived=c.pick([4096, 163_840, 1_048_576]) if auto_fit else None,
            layout=c.pick(["BLHNC", "BLHNC", "BLNHC", "BHLNC", "LBNHC", "LHBNC"]),
            tp=tp if tp > 1 else 0,
            pp=pp if pp > 1 else 0,
            dcp=dcp,
            mamba_align=kind == "mamba",
            block_size=block,
            async_scheduling=rng.random() < 0.5,
            v2_runner=rng.random() < 0.3,
            batched=c.pick([0, 0, 512, 2048, 32768]),
            method=method,
            spec_tokens=c.pick([1, 2, 3, 5]),
            override=c.pick([None, None, None, 1, 64, 2000]),
            disable_hybrid=rng.random() < 0.1,
            prefix_caching=c.pick([None, None, True, False]),
        )
        config = req.options.hisparse
        config.host_pool_gib = c.pick([0.0005, 0.01, 0.25, 4.0, 64.0, 256.0, 2048.0])
        config.shared_host_pool = rng.random() < 0.4
        if rng.random() < 0.8:
            config.index_topk = c.pick([256, 512, 2048, 4096])
        if rng.random() < 0.5:
            config.device_buffer_size = c.pick([1, 64, 1024, 2048, 8192, 40000, 1 << 20])
        if rng.random() < 0.3:
            config.host_page_size_bytes = c.pick([4096, 65536, 2 << 20])
        if rng.random() < 0.25:
            req.options.extensible_kv_cache = c.pick([True, False])
        _as_engines_run_hisparse(req, f"{cat}/h{i:04d}")
        c.add(
            cat,
            f"h{i:04d}",
            f"HiSparse {kind} block {block} sparse {sparse} tp{tp} dcp{dcp} pp{pp} {method}",
            req,
        )


def fuzz_l(c: Cases, count: int) -> None:
    """Supported-layout lists over the widened engines (fuzzy, fuzzh): the
    resolution meets quantized / padded / aligned pages, Mamba and HiSparse."""
    from conformance.generate import LAYOUTS, _layout_patterns, with_layouts

    rng = c.rng
    base = [
        case for case in c.items if case.category in ("fuzzy", "fuzzh") and case.request.workers
    ]
    for case in rng.sample(base, min(count, len(base))):
        n_workers = len(case.request.workers)
        name, lists = rng.choice(_layout_patterns(rng, n_workers))
        asked = rng.choice([None, None, rng.choice(list(LAYOUTS))])
        c.add(
            "fuzzl",
            f"{case.id.replace('/', '.')}-{name}-{asked or 'unset'}",
            f"{case.description}; lists {name} {lists}, asked {asked}",
            with_layouts(case.request, lists, asked),
        )


# --- fuzz_z: real model families at the memory / length / block-count edges --------

_Z_FAMILIES = (
    "llama4",
    "gptoss",
    "gemma3",
    "dsv3",
    "dsv32",
    "qwen3next",
    "jamba",
    "nemotronh",
    "falconh1",
    "minimax",
    "whisper",
    "bert",
    "llama",
    "mistral-sw",
    "sinkwin",
    "phi-mla",
    "hisparse",
    "hisparse",
    "dsv4",
)


def _z_engine_version() -> str:
    """The rule set of the installed vLLM release (without vLLM: 0.33's)."""
    try:
        from conformance.vllm_driver import ENGINE_VERSION
    except ImportError:
        return "vllm-0.33"
    return str(ENGINE_VERSION)


def _z_probe(req: plan_pb2.PlanRequest) -> plan_pb2.PlanResponse | None:
    """kvplan's plan of the request as the installed release can express it, in its
    rule set (the case is then moved to the edges the plan shows), or None when
    kvplan refuses it. Without vLLM: the request as it is, under 0.33's rules."""
    from kvplan.convert import plan_from_proto
    from kvplan.gpus import GPU_MEMORY_BYTES

    try:
        from conformance.compare import for_release

        adapted = for_release(req, _z_engine_version())
    except ImportError:
        adapted = plan_pb2.PlanRequest()
        adapted.CopyFrom(req)
        adapted.options.engine_version = _z_engine_version()
    try:
        return plan_from_proto(adapted, gpu_memory_table=GPU_MEMORY_BYTES)
    except Exception:  # refused (or a fault the comparison itself will report)
        return None


def _z_bisect(req: Any, apply: Any, good: Any, hi: int = 1 << 42) -> int | None:
    """The least x in [1, hi] for which kvplan's plan of `apply(copy, x)` is `good`
    (None when even `hi` is not): the exact edge of a budget, as kvplan sees it."""

    def test(x: int) -> bool:
        trial = plan_pb2.PlanRequest()
        trial.CopyFrom(req)
        apply(trial, x)
        return bool(good(_z_probe(trial)))

    if not test(hi):
        return None
    lo = 0  # lo is bad (or untested 0), hi good
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if test(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _z_layers(c: Cases, fam: str) -> tuple[list[Layer], dict[str, Any]]:
    """One model family's layers (target, then drafter) and the options it implies."""
    from conformance.generate import circular  # noqa: F401

    rng = c.rng
    opts: dict[str, Any] = {}
    layers: list[Layer] = []
    method = c.pick(
        ["none", "none", "eagle", "eagle3", "mtp", "ngram", "suffix", "medusa", "draft_model"]
    )
    spec_tokens = c.pick([1, 2, 3, 4, 5, 7, 15]) if method != "none" else 0
    mark = rng.random() < 0.7
    n = c.pick([2, 4, 6, 8, 12, 24, 48])
    drafter = method in ("eagle", "eagle3", "mtp", "draft_model", "medusa") and rng.random() < 0.8
    if fam == "llama4":  # chunked local 3:1 full (NoPE)
        chunk = c.pick([8192, 8192, 2048, 256])
        for j in range(n):
            if j % 4 == 3:
                layers.append(full(f"model.layers.{j}.self_attn.attn", 8, 128))
            else:
                layers.append(chunked(f"model.layers.{j}.self_attn.attn", chunk, 8, 128))
        if drafter:
            layers.append(full("draft.layers.0.self_attn.attn", 8, 128, draft=mark))
        opts["chunk"] = chunk
    elif fam == "gptoss":  # alternating SW 128 / full, 8 KV heads x 64
        window = c.pick([128, 128, 256])
        for j in range(n):
            if j % 2 == 0:
                layers.append(sw(f"model.layers.{j}.attn", window, 8, 64))
            else:
                layers.append(full(f"model.layers.{j}.attn", 8, 64))
        if drafter:
            layers.append(full("draft.layers.0.attn", 8, 64, draft=mark))
        opts["window"] = window
    elif fam == "gemma3":  # 5 SW : 1 full, head 256
        window = c.pick([512, 1024, 4096])
        heads = c.pick([1, 2, 4, 8, 16])
        for j in range(n):
            if j % 6 == 5:
                layers.append(full(f"model.layers.{j}.attn", heads, 256))
            else:
                layers.append(sw(f"model.layers.{j}.attn", window, heads, 256))
        if drafter:
            layers.append(sw("draft.layers.0.attn", window, heads, 256, draft=mark))
        opts["window"] = window
    elif fam in ("dsv3", "phi-mla"):
        _, kw, cache_dtype = c.pick(_MLA_VARIANTS)
        opts["cache_dtype"] = cache_dtype
        opts["block_size"] = c.pick([16, 32, 64, 64, 128])
        head = 576 if fam == "dsv3" else c.pick([576, 320, 192])
        for j in range(n):
            layers.append(
                mla(
                    f"model.layers.{j}.self_attn.attn",
                    head,
                    a=_with(kw.get("a"), tp_shards=1),
                    cache_dtype=cache_dtype,
                )
            )
        if drafter:
            for d in range(c.pick([1, 1, 2])):
                layers.append(
                    mla(
                        f"model.layers.{n + d}.self_attn.attn",
                        head,
                        a=_with(kw.get("a"), tp_shards=1),
                        cache_dtype=cache_dtype,
                        draft=mark,
                        marker=rng.random() < 0.2,
                    )
                )
        if method == "mtp":
            opts["nextn"] = c.pick([None, 1, 2])
    elif fam == "dsv32":
        _, kw, cache_dtype = c.pick(_MLA_VARIANTS)
        opts["cache_dtype"] = cache_dtype
        opts["block_size"] = 64
        topk = c.pick([None, 2048])
        for j in range(n + (1 if drafter else 0)):
            d = j == n
            a = _with(kw.get("a"), tp_shards=1)
            layers.append(
                mla(
                    f"model.layers.{j}.self_attn.attn",
                    576,
                    a=a,
                    topk=topk,
                    leader=True,
                    draft=d and mark,
                    cache_dtype=cache_dtype,
                )
            )
            layers.append(
                mla(
                    f"model.layers.{j}.self_attn.indexer.k_cache",
                    132,
                    a={"dtype": "u8", "tp_shards": 1},
                    indexer=True,
                    draft=d and mark,
                )
            )
    elif fam in ("qwen3next", "jamba", "nemotronh", "falconh1", "minimax"):
        if fam == "qwen3next":
            states, mtype, heads, head, period = (
                GDN_STATES,
                spec_pb2.MAMBA_TYPE_GDN_ATTENTION,
                2,
                256,
                4,
            )
        elif fam == "jamba":
            states, mtype, heads, head, period = (
                [([8192, 3], "bf16"), ([8192, 16], "fp32")],
                spec_pb2.MAMBA_TYPE_MAMBA1,
                8,
                128,
                8,
            )
        elif fam == "nemotronh":
            states, mtype, heads, head, period = (
                [([3, 10240], "bf16"), ([128, 64, 128], "fp32")],
                spec_pb2.MAMBA_TYPE_MAMBA2,
                8,
                128,
                c.pick([5, 6, 7]),
            )
        elif fam == "falconh1":
            states, mtype, heads, head, period = (
                [([3, 5120], "bf16"), ([32, 64, 128], "fp32")],
                spec_pb2.MAMBA_TYPE_MAMBA2,
                2,
                128,
                1,
            )
        else:
            states, mtype, heads, head, period = (
                [([64, 96, 96], "fp32")],
                spec_pb2.MAMBA_TYPE_LINEAR,
                8,
                128,
                8,
            )
        opts["mamba"] = (states, heads, head)
        caching = c.pick([None, None, True, False])
        opts["prefix_caching"] = caching
        on = caching if caching is not None else True
        engine = c.pick([0, 16, 64])
        per_token = heads * head * 2 * 2
        page = _mamba_page(states)
        padded = None
        base = engine or 16
        blk = base * -(-page // (base * per_token))
        blk = 16 * -(-blk // 16)
        engine = max(base, blk) if on else (engine or 0)
        if on or rng.random() < 0.5:
            eb = engine or 16
            tokens = -(-page // per_token)  # the fewest tokens whose page holds the state
            eb = max(eb, 16 * -(-tokens // 16))
            engine = eb
            if eb * per_token > page:
                padded = eb * per_token
        opts["block_size"] = engine
        ckpt = c.pick([0, 0, 1]) if on else 0
        spec_blocks = spec_tokens if method != "none" else 0
        for j in range(n):
            mk: dict[str, Any] = dict(
                padded=padded, mamba_type=mtype, spec_blocks=spec_blocks, checkpoint_blocks=ckpt
            )
            if fam == "falconh1":
                layers.append(mamba(f"model.layers.{j}.mamba", states, **mk))
                layers.append(full(f"model.layers.{j}.self_attn.attn", heads, head))
            elif j % period == period - 1:
                layers.append(full(f"model.layers.{j}.self_attn.attn", heads, head))
            else:
                layers.append(mamba(f"model.layers.{j}.mixer", states, **mk))
        if drafter:
            layers.append(full(f"mtp.layers.{n}.self_attn.attn", heads, head, draft=mark))
            if rng.random() < 0.3:
                layers.append(
                    mamba(
                        f"mtp.layers.{n}.mixer",
                        states,
                        padded=padded,
                        mamba_type=mtype,
                        spec_blocks=spec_blocks,
                        draft=mark,
                    )
                )
    elif fam == "hisparse":
        from conformance.generate import _hisparse_engine

        block = c.pick([64, 64, 32, 128])
        others: list[Layer] = []
        kind = c.pick(["none", "none", "sw", "full"])
        if kind == "sw":
            others = [sw(f"swa.{j}", c.pick([128, 1024]), 4, 64, block=block) for j in range(2)]
        elif kind == "full":
            others = [full(f"full.{j}", 4, 64) for j in range(2)]
        sparse = c.pick([1, 2, 4, 8])
        layers = _hisparse_engine(
            rng,
            sparse=sparse,
            indexers=c.pick([1, sparse]),
            leader_every=c.pick([1, 2]),
            block=block,
            sparse_head=c.pick([656, 576]),
            others=others,
            topk=c.pick([None, 2048]),
        )
        opts["block_size"] = block
        opts["hisparse"] = True
        if method not in ("none", "mtp", "eagle", "ngram"):
            method, spec_tokens = "mtp", c.pick([1, 2, 3])
    elif fam == "dsv4":
        window = c.pick([128, 256])
        opts["block_size"] = c.pick([64, 128, 256])
        replay = rng.random() < 0.3
        for j in range(n):
            layers.append(
                sw_mla(
                    f"model.layers.{j}.swa",
                    window,
                    a={"tp_shards": 1},
                    block=64,
                    version="deepseek_v4",
                    alignment=576,
                    bounded_replay=replay,
                )
            )
            if j % 2 == 0:
                layers.append(
                    mla(
                        f"model.layers.{j}.mla",
                        a={"tokens": c.pick([4, 128]), "tp_shards": 1},
                        block=256,
                        version="deepseek_v4",
                        alignment=576,
                    )
                )
        if drafter:
            layer = sw_mla(
                f"mtp.{n}.swa",
                window,
                a={"tp_shards": 1},
                block=64,
                version="deepseek_v4",
                alignment=576,
                bounded_replay=replay,
                draft=mark,
            )
            layer.sliding_window_mla.non_causal_multi_token_decode = rng.random() < 0.7
            layers.append(layer)
            layers.append(
                mla(
                    f"mtp.{n}.mla",
                    a={"tokens": 4, "tp_shards": 1},
                    block=256,
                    version="deepseek_v4",
                    alignment=576,
                    draft=mark,
                    marker=rng.random() < 0.5,
                )
            )
        opts["layout"] = c.pick(["BLHNC", "BLHNC", "BLNHC", "LBNHC"])
    elif fam == "whisper":
        heads, head = c.pick([(6, 64), (20, 64), (8, 64)])
        for j in range(n):
            layers.append(full(f"decoder.layers.{j}.self_attn.attn", heads, head))
            layers.append(cross(f"decoder.layers.{j}.encoder_attn.attn", heads, head))
        if rng.random() < 0.5:
            for j in range(n):
                layers.append(encoder_only(f"encoder.layers.{j}.self_attn.attn", heads, head))
        opts["encoder_tokens"] = c.pick([1500, 1500, 448, 3000, 1])
        method, spec_tokens = "none", 0
    elif fam == "bert":
        for j in range(n):
            layers.append(encoder_only(f"encoder.layer.{j}.attention", 12, 64))
        if rng.random() < 0.3:
            layers.append(full("head.attn", 12, 64))
        method, spec_tokens = "none", 0
    elif fam == "mistral-sw":  # every layer one SW spec
        window = c.pick([4096, 32768, 128])
        for j in range(n):
            layers.append(sw(f"model.layers.{j}.attn", window, 8, 128))
        if drafter:
            layers.append(sw("draft.layers.0.attn", window, 8, 128, draft=mark))
        opts["window"] = window
    elif fam == "sinkwin":  # attention sinks, with window / chunk metadata
        sink_len = c.pick([16, 64, 128, 256])
        window = c.pick([128, 1024])
        meta = c.pick(["none", "window", "chunk"])
        for j in range(n):
            body = spec_pb2.SinkFullAttentionSpec(sink_len=sink_len)
            body.attention.CopyFrom(full("x", 8, 64).full_attention.attention)
            if meta == "window" and j % 2 == 0:
                body.sliding_window = window
            if meta == "chunk" and j % 2 == 0:
                body.attention_chunk_size = window
            layer = Layer(name=f"model.layers.{j}.attn", sink_full_attention=body)
            layers.append(layer)
            if rng.random() < 0.3:
                layers.append(sw(f"model.layers.{j}.swa", window, 8, 64))
        opts["window"] = window
        opts["sink"] = sink_len
    else:  # llama: full attention, optional FullAttention window / chunk metadata
        heads, head = c.pick([(8, 128), (4, 128), (1, 128), (32, 128), (8, 64)])
        meta = c.pick([{}, {}, {"window": 4096}, {"chunk": 8192}])
        for j in range(n):
            layers.append(full(f"model.layers.{j}.self_attn.attn", heads, head, **meta))
        if drafter:
            for d in range(c.pick([1, 1, 2])):
                layers.append(full(f"draft.layers.{d}.attn", heads, head, draft=mark))
    opts["method"] = method
    opts["spec_tokens"] = spec_tokens
    return layers, opts


def _z_bisect_edge(c: Cases, req: Any, util_mode: bool) -> str:
    """Move the request to an edge found by bisecting kvplan's own plans: the least
    KV bytes (every worker alike) that plan; that let auto-fit reach the model's own
    length; or (vLLM 0.34's extensible cache) the least measured bytes giving the
    final plan its reservation's block count, or one block more than a request."""
    rng = c.rng
    kind = c.pick(["plans", "plans", "fits", "final"])
    if kind == "final" and _z_engine_version() != "vllm-0.34":
        kind = "plans"

    def set_bytes(trial: Any, x: int) -> None:
        for worker in trial.workers:
            worker.memory.kv_cache_memory_bytes = x

    if kind == "fits":
        derived = req.options.max_model_len
        req.options.max_model_len = -1
        req.options.derived_max_model_len = derived
        edge = _z_bisect(req, set_bytes, lambda p: p is not None and p.max_model_len >= derived)
    elif kind == "final":
        req.options.extensible_kv_cache = True
        base = _z_probe(req)
        if base is None or not base.workers or not base.num_blocks:
            return ""
        target = c.pick([base.num_blocks, base.workers[0].blocks_per_request + 2])
        granule = c.pick([None, 4096, 2 << 20, 64 << 10])

        def set_measured(trial: Any, x: int) -> None:
            for worker in trial.workers:
                worker.memory.measured_kv_cache_bytes = x
                if granule:
                    worker.memory.allocation_granule_bytes = granule

        edge = _z_bisect(
            req, set_measured, lambda p: p is not None and p.num_blocks >= target, hi=1 << 44
        )
        if edge is None:
            return ""
        d = c.pick([-1, 0, 0, 1])
        set_measured(req, max(1, edge + d))
        return f"bisect final {target} blocks measured {edge}{d:+d} granule {granule}"
    else:
        edge = _z_bisect(req, set_bytes, lambda p: p is not None and bool(p.workers))
    if edge is None:
        return ""
    d = c.pick([-1, 0, 0, 1])
    for worker in req.workers:
        _z_set_bytes(worker, max(0, edge + d), util_mode and rng.random() < 0.8, c)
    return f"bisect {kind} {edge}{d:+d}"


def _z_set_bytes(worker: Any, kv: int, util_mode: bool, c: Cases) -> None:
    """Give the worker exactly `kv` KV bytes (explicit, or a device whose
    utilization leaves that much after its non-KV memory)."""
    memory = worker.memory
    if util_mode and kv >= 0:
        total = c.pick([24 * GIB, 80 * GIB, 141 * GIB])
        util = c.pick([0.9, 0.92, 0.95, 1.0])
        requested = math.ceil(total * util)
        if requested - kv < 0:
            memory.kv_cache_memory_bytes = kv
            return
        worker.device.total_memory_bytes = total
        memory.gpu_memory_utilization = util
        memory.non_kv.weights_bytes = requested - kv
    else:
        memory.kv_cache_memory_bytes = max(0, kv)


def _z_h2nd(c: Cases, layers: list[Layer]) -> None:
    """Quantized per-token-head caches: head slots, content bytes, and (vLLM 0.34)
    slots grouped by KV head; applied to every plain attention layer alike."""
    quant = c.pick(
        [
            ("i8", spec_pb2.KV_QUANT_MODE_INT8_PER_TOKEN_HEAD, 8),
            ("e4m3", spec_pb2.KV_QUANT_MODE_FP8_PER_TOKEN_HEAD, 8),
            ("u8", spec_pb2.KV_QUANT_MODE_INT4_PER_TOKEN_HEAD, 0),
        ]
    )
    major = c.rng.random() < 0.7
    slot_factor = c.pick([1, 1, 2])
    for layer in layers:
        kind = layer.WhichOneof("kind")
        if kind not in (
            "full_attention",
            "sliding_window",
            "chunked_local_attention",
            "sink_full_attention",
            "cross_attention",
        ):
            continue
        a = getattr(layer, kind).attention
        a.dtype = {
            "i8": spec_pb2.DTYPE_INT8,
            "e4m3": spec_pb2.DTYPE_FLOAT8_E4M3FN,
            "u8": spec_pb2.DTYPE_UINT8,
        }[quant[0]]
        a.kv_quant_mode = quant[1]
        hv = a.head_size_v if a.HasField("head_size_v") else a.head_size
        total = a.head_size + hv
        a.state_content_bytes = (total + quant[2]) if quant[2] else (total // 2 + 8)
        a.num_head_slots = a.num_kv_heads * slot_factor
        a.kv_head_major_slots = major


def _z_zero(c: Cases, req: Any) -> str:
    """One optional field at 0 (or 1) on one layer name, on every worker holding it,
    or an option at 0: values a caller can send that no section sends."""
    names = [layer.name for w in req.workers for layer in w.layers]
    choice = c.pick(["layer", "layer", "option"])
    if choice == "option" or not names:
        field, value = c.pick(
            [
                ("num_gpu_blocks_override", 0),
                ("num_gpu_blocks_override", 1),
                ("derived_max_model_len", 0),
                ("prefix_match_unit", 0),
                ("max_num_batched_tokens", 1),
                ("max_num_encoder_input_tokens", 1),
            ]
        )
        setattr(req.options, field, value)
        return f" {field}={value}"
    name = c.pick(names)
    field, value = c.pick(
        [
            ("head_size_v", 0),
            ("page_size_padded_bytes", 0),
            ("num_head_slots", 0),
            ("state_content_bytes", 0),
            ("max_tp_shards", 0),
            ("block_size", 0),
            ("sliding_window", 0),
            ("attention_chunk_size", 0),
            ("topk_buffer_width", 0),
            ("alignment_bytes", 0),
            ("prefill_checkpoint_alignment", 0),
            ("state_alignment_bytes", 0),
            ("mamba_page_size_padded", 0),
            ("sink_len", 0),
            ("topk_buffer_width", 1),
            ("prefill_checkpoint_alignment", 1),
            ("max_tp_shards", 1),
            ("num_head_slots", 1),
            ("head_size_v", 1),
            ("num_speculative_blocks", 0),
            ("num_heads", 3),
            ("block_size", 1),
        ]
    )
    for worker in req.workers:
        for layer in worker.layers:
            if layer.name != name:
                continue
            kind = layer.WhichOneof("kind")
            body = getattr(layer, kind)
            if field == "block_size":
                layer.block_size = value
            elif kind == "mamba":
                f = {"mamba_page_size_padded": "page_size_padded_bytes"}.get(field, field)
                if f in (
                    "page_size_padded_bytes",
                    "prefill_checkpoint_alignment",
                    "state_alignment_bytes",
                    "num_speculative_blocks",
                    "num_heads",
                ):
                    setattr(body, f, value)
            elif field in ("sliding_window", "attention_chunk_size") and kind in (
                "full_attention",
                "sink_full_attention",
            ):
                setattr(body, field, value)
            elif field == "sink_len" and kind == "sink_full_attention":
                body.sink_len = value
            elif field in ("topk_buffer_width", "alignment_bytes") and hasattr(body, "mla"):
                setattr(body.mla, field, value)
            elif field in (
                "head_size_v",
                "page_size_padded_bytes",
                "num_head_slots",
                "state_content_bytes",
                "max_tp_shards",
            ) and hasattr(body, "attention"):
                setattr(body.attention, field, value)
    return f" {name}.{field}={value}"


def _z_free(c: Cases, req: Any) -> None:
    """Utilization budgets with the device's free memory at the worker's request."""
    for worker in req.workers:
        memory = worker.memory
        if memory.WhichOneof("budget") != "gpu_memory_utilization":
            total = c.pick([80 * GIB, 141 * GIB])
            util = c.pick([0.9, 0.92, 0.5, 0.333])
            worker.device.total_memory_bytes = total
            memory.gpu_memory_utilization = util
            memory.non_kv.weights_bytes = c.pick([0, 4 * GIB, 40 * GIB])
        total = worker.device.total_memory_bytes
        requested = math.ceil(total * memory.gpu_memory_utilization)
        worker.device.free_memory_bytes = max(0, requested + c.pick([-1, 0, 1, -GIB, GIB]))


def fuzz_z(c: Cases, count: int) -> None:
    """Real model families (Llama 4, gpt-oss, Gemma 3, DeepSeek V3 / V3.2, Qwen3-Next,
    Jamba, Nemotron-H, Falcon-H1, MiniMax, Whisper, BERT, Mistral SW, sinks with
    window / chunk metadata) placed at the edges kvplan's own plan shows: KV bytes
    just enough / one byte short for one max_model_len request, for one block, for
    a few blocks; num_gpu_blocks_override at blocks_per_request and next to it;
    auto-fit with derived_max_model_len at the fitted length; max_model_len next to
    windows, chunks, block multiples and the batch size; spec-decode lookahead next
    to the block; utilization-derived budgets at the same edges."""
    cat = "fuzzz"
    rng = c.rng
    for i in range(count):
        fam = c.pick(_Z_FAMILIES)
        layers, opts = _z_layers(c, fam)
        block_size = opts.get("block_size", c.pick([0, 0, 16, 32, 64, 128, 256]))
        bs = block_size or 16
        window = opts.get("window", 4096)
        chunk = opts.get("chunk", 8192)
        batched = c.pick([0, 0, 256, 2048, 8192, 16384])
        length_pool = [
            bs,
            bs + 1,
            bs - 1,
            2 * bs,
            3 * bs + 1,
            window - 1,
            window,
            window + 1,
            2 * window,
            chunk - 1,
            chunk,
            chunk + 1,
            2 * chunk + 1,
            (batched or 8192) - 1,
            (batched or 8192) + 1,
            8192,
            32768,
            131072,
            163840,
            1 << 20,
        ]
        max_model_len = max(1, c.pick(length_pool))
        tp = c.pick([1, 1, 2, 4, 8])
        dcp = 0
        if tp > 1 and rng.random() < 0.3:
            dcp = c.pick([d for d in (2, 4, 8) if d <= tp and tp % d == 0])
        pp = c.pick([1, 1, 1, 2, 4]) if len(layers) >= 4 else 1
        twist = c.pick(
            ["none", "none", "none", "none", "zero", "draft_first", "h2nd", "free", "encoder"]
        )
        if twist == "draft_first":
            drafts = [
                layer
                for layer in layers
                if layer.is_draft or "draft" in layer.name or layer.name.startswith("mtp.")
            ]
            rest = [layer for layer in layers if layer not in drafts]
            if drafts and rng.random() < 0.5:
                layers = drafts + rest
            elif drafts:
                k = rng.randrange(len(rest) + 1)
                layers = rest[:k] + drafts + rest[k:]
        if twist == "h2nd":
            _z_h2nd(c, layers)
        cuts = _split(c, len(layers), pp)
        workers: list[W] = []
        for stage in range(pp):
            own = layers[cuts[stage] : cuts[stage + 1]]
            for _ in range(tp):
                workers.append(W(own, 1 << 40))
        spec_tokens = opts["spec_tokens"]
        if opts["method"] != "none" and rng.random() < 0.3:
            spec_tokens = c.pick([bs - 1, bs, bs + 1, 2 * bs]) or 1
        req = request(
            workers,
            max_model_len=max_model_len,
            block_size=block_size,
            cache_dtype=opts.get(
                "cache_dtype",
                c.pick([spec_pb2.KV_CACHE_DTYPE_AUTO] * 5 + [spec_pb2.KV_CACHE_DTYPE_FP8]),
            ),
            model_dtype=c.pick([None, None, "fp16"]),
            disable_hybrid=rng.random() < 0.1,
            batched=batched,
            async_scheduling=c.pick([False, True]),
            v2_runner=c.pick([False, True]),
            pp=pp if pp > 1 else 0,
            tp=tp if tp > 1 else 0,
            dcp=dcp,
            layout=opts.get("layout")
            or c.pick(["LBNHC", "LBNHC", "LBNHC", "BLHNC", "BLNHC", "LBHNC"]),
            mamba_align=None,
            encoder_tokens=opts.get("encoder_tokens", 0),
            prefix_caching=opts.get("prefix_caching", c.pick([None, None, True, False])),
            method=opts["method"],
            spec_tokens=spec_tokens,
            target_model_type=c.pick(["", "deepseek_v3", "qwen3_next", "llama4"]),
            disable_block_drop=rng.random() < 0.05,
            nextn=opts.get("nextn"),
        )
        if rng.random() < 0.3:
            req.options.extensible_kv_cache = False
        if opts.get("hisparse"):
            req.options.layout = c.pick([LAYOUTS["BLHNC"]] * 3 + [LAYOUTS["BLNHC"]])
            h = req.options.hisparse
            h.host_pool_gib = 1024.0
            h.shared_host_pool = rng.random() < 0.4
            h.index_topk = c.pick([512, 2048, 2048])
            req.options.parallel.decode_context_parallel_size = 0
            req.options.disable_hybrid_kv_cache_manager = False
            if req.spec_decode.num_speculative_tokens > 3:
                req.spec_decode.num_speculative_tokens = c.pick([1, 2, 3])
            if rng.random() < 0.3:
                h.device_buffer_size = c.pick([8192, 16384, 32768])
            if rng.random() < 0.3:
                h.host_page_size_bytes = c.pick([4096, 65536, 2 << 20])
        if twist == "encoder":
            req.options.max_num_encoder_input_tokens = max(
                1, c.pick([bs - 1, bs, bs + 1, max_model_len, 1500])
            )
        note_zero = _z_zero(c, req) if twist == "zero" else ""
        edge = c.pick(
            [
                "request",
                "request",
                "request",
                "block",
                "blocks",
                "override",
                "autofit",
                "autofit",
                "random",
            ]
        )
        util_mode = rng.random() < 0.25
        if rng.random() < 0.35:
            note = _z_bisect_edge(c, req, util_mode)
            if note:
                if twist == "free":
                    _z_free(c, req)
                c.add(
                    cat,
                    f"z{i:04d}",
                    f"{fam} {len(layers)} layers {opts['method']}x{spec_tokens} pp{pp} tp{tp} "
                    f"dcp{dcp} block {block_size} len {max_model_len} {note} {twist}{note_zero}",
                    req,
                )
                continue
        plan = _z_probe(req)
        note = "" if plan is not None and plan.workers and edge != "random" else edge
        if plan is not None and plan.workers and edge != "random":
            per = {w.rank: w for w in plan.workers}
            delta = c.pick([-1, 0, 0, 1, 2, -4096])
            extra_blocks = c.pick([0, 0, 1, 2, -1])
            only_one = rng.random() < 0.3 and len(req.workers) > 1
            victim = rng.randrange(len(req.workers))
            if opts.get("hisparse") and plan.hisparse_host_num_blocks and rng.random() < 0.6:
                host = sum(t.size_bytes for t in plan.workers[0].tensors if t.host_resident)
                stride = host // plan.hisparse_host_num_blocks if host else 0
                if stride:
                    blocks = -(-plan.max_model_len // bs) + 2 + c.pick([-1, 0, 0, 1])
                    hd = c.pick([-1, 0, 0, 1])
                    req.options.hisparse.host_pool_gib = max(1, blocks * stride + hd) / 2**30
                    if edge == "autofit":
                        req.options.hisparse.host_pool_gib += c.pick([0, 64]) * stride / 2**30
                    note = f"host {blocks} blocks of {stride} d{hd} "
            if edge == "override":
                bpr = plan.workers[0].blocks_per_request
                req.options.num_gpu_blocks_override = max(1, bpr + c.pick([-1, 0, 1, 2, 3]))
                note += f"override {req.options.num_gpu_blocks_override} bpr {bpr}"
            elif edge == "autofit":
                fitted = plan.max_model_len
                req.options.max_model_len = -1
                req.options.derived_max_model_len = max(1, fitted + c.pick([-1, 0, 1, bs]))
                for index, worker in enumerate(req.workers):
                    w = per.get(worker.rank)
                    if w is None or (only_one and index != victim):
                        continue
                    kv = (
                        w.budget.needed_per_request_bytes
                        + (1 + extra_blocks) * (w.bytes_per_block)
                        + delta
                    )
                    _z_set_bytes(worker, kv, util_mode, c)
                note += f"autofit derived {req.options.derived_max_model_len} d{delta}"
            else:
                for index, worker in enumerate(req.workers):
                    w = per.get(worker.rank)
                    if w is None or (only_one and index != victim):
                        continue
                    bpb = w.bytes_per_block
                    if edge == "request":
                        kv = w.budget.needed_per_request_bytes + (1 + extra_blocks) * bpb + delta
                    elif edge == "block":
                        kv = c.pick([1, 2]) * bpb + delta
                    else:
                        kv = c.pick([3, 5, 17, 64]) * bpb + delta
                    _z_set_bytes(worker, kv, util_mode, c)
                note += f"{edge} +{extra_blocks} blocks d{delta}"
        else:
            base = int(2 ** rng.uniform(20, 38))
            for worker in req.workers:
                _z_set_bytes(worker, base, util_mode, c)
        if twist == "free":
            _z_free(c, req)
        note = f"{note} {twist}{note_zero}"
        c.add(
            cat,
            f"z{i:04d}",
            f"{fam} {len(layers)} layers {opts['method']}x{spec_tokens} pp{pp} tp{tp} "
            f"dcp{dcp} block {block_size} len {max_model_len} {note}",
            req,
        )


# --- fuzz_c: the fields, kinds and combinations no other section varies -----------

# Layer kinds, weighted toward the ones the other sections fix (RSWA, cross, circular,
# hidden-state, SW-MLA and sinks appear there with one shape each).
_C_KINDS = (
    "full",
    "full",
    "sw",
    "sw",
    "chunked",
    "sink",
    "rswa",
    "rswa",
    "cross",
    "cross",
    "encoder_only",
    "circular",
    "circular",
    "hidden",
    "hidden",
    "mla",
    "sw_mla",
    "sw_mla",
    "mamba",
)

_C_PLAIN = ("full", "sw", "chunked", "sink", "rswa", "cross", "encoder_only", "circular")

_C_DTYPES = (None, None, None, "fp16", "bf16", "fp32", "e4m3", "e5m2", "i8", "u8")

_C_DEVICES = ("H100-80GB", "A100-40GB", "L4-24GB", "H200-141GB", "B200-180GB", "MI300X-192GB")

_C_METHODS = ("none", "none", "none", *_SPEC_METHODS, "medusa")


def _c_attention(
    c: Cases, a: spec_pb2.AttentionParams, kind: str, block: int, tp: int, h2nd: bool
) -> None:
    """Vary the attention parameters the other sections leave at their defaults on
    this kind: dtype, V head, quantized head slots (grouped by KV head on 0.34),
    padded pages, TP shards, DCP sharding, compressed / expanded states."""
    rng = c.rng
    mla_kind = kind in ("mla", "sw_mla", "hidden")
    if rng.random() < 0.35:
        dtype = c.pick(_C_DTYPES)
        a.dtype = _DTYPES[dtype]
    if not mla_kind and rng.random() < 0.2:
        a.head_size_v = c.pick([a.head_size // 2 or 1, 2 * a.head_size, 96, 128])
    if not mla_kind and (h2nd or rng.random() < 0.1):
        dtype, quant, extra = c.pick(
            [
                ("i8", spec_pb2.KV_QUANT_MODE_INT8_PER_TOKEN_HEAD, 8),
                ("e4m3", spec_pb2.KV_QUANT_MODE_FP8_PER_TOKEN_HEAD, 8),
                ("u8", spec_pb2.KV_QUANT_MODE_INT4_PER_TOKEN_HEAD, 0),
                ("u8", spec_pb2.KV_QUANT_MODE_TURBOQUANT_K8V4, 0),
            ]
        )
        a.dtype = _DTYPES[dtype]
        a.kv_quant_mode = quant
        hv = a.head_size_v if a.HasField("head_size_v") else a.head_size
        total = a.head_size + hv
        a.state_content_bytes = total + extra if extra else total // 2 + 8
        a.num_head_slots = a.num_kv_heads * c.pick([1, 1, 2])
        a.kv_head_major_slots = rng.random() < 0.7
    elif mla_kind and rng.random() < 0.15:
        a.dtype = _DTYPES[c.pick(["u8", "e4m3"])]
        a.kv_quant_mode = c.pick(
            [spec_pb2.KV_QUANT_MODE_FP8_PER_TENSOR, spec_pb2.KV_QUANT_MODE_NVFP4_DS_MLA]
        )
        if rng.random() < 0.5:
            a.state_content_bytes = c.pick([656, 352, a.head_size])
    if kind not in ("encoder_only",) and rng.random() < 0.1:
        if rng.random() < 0.6 and block >= 2:
            a.tokens_per_state.tokens = c.pick([t for t in (2, 4, 8, 16) if t <= block] or [2])
        else:
            a.tokens_per_state.states_per_token = c.pick([2, 4])
    if rng.random() < 0.08:
        # Unspecified: the engine's cache dtype, at most 4 bytes an element.
        per = _Y_BYTES[_C_DTYPE_NAMES[a.dtype]] if a.dtype else 4
        heads = 1 if mla_kind else (a.num_head_slots or a.num_kv_heads)
        width = (
            a.head_size
            if mla_kind
            else a.head_size + (a.head_size_v if a.HasField("head_size_v") else a.head_size)
        )
        states = block * (a.tokens_per_state.states_per_token or 1)
        states //= a.tokens_per_state.tokens or 1
        page = states * heads * (a.state_content_bytes or width * per)
        a.page_size_padded_bytes = page + c.pick([0, 0, 64, 4096, page]) if page > 1 else 4096
    if tp > 1 and rng.random() < 0.25:
        a.max_tp_shards = c.pick([1, 2, tp, max(1, a.num_kv_heads)])
    if rng.random() < 0.15:
        a.dcp_sharded = rng.random() < 0.5


_C_DTYPE_NAMES = {number: name for name, number in _DTYPES.items() if name is not None}


def _c_layer(
    c: Cases,
    kind: str,
    name: str,
    *,
    shape: Mapping[str, Any],
    block: int,
    tp: int,
    h2nd: bool,
    draft: bool,
) -> Layer:
    """One layer of `kind` with its own variation of the engine's shape."""
    from conformance.generate import circular, hidden, rswa

    rng = c.rng
    heads = shape["heads"]
    head = shape["head"]
    common: dict[str, Any] = {"draft": draft}
    if rng.random() < 0.1:
        common["block"] = c.pick([8, 16, 32, 64, 128, block])
    r = rng.random()
    if r < 0.06:
        common["align_bytes"] = c.pick([256, 4096, 65536, 2 << 20])
    elif r < 0.1:
        common["align_kernel"] = c.pick([16, 32, 64])
    if kind == "full":
        layer = full(name, heads, head, **common)
    elif kind == "sw":
        layer = sw(name, c.pick(shape["windows"]), heads, head, **common)
    elif kind == "chunked":
        layer = chunked(name, shape["chunk"], heads, head, **common)
    elif kind == "sink":
        layer = sink(name, shape["sink"], heads, head, **common)
        layer.sink_full_attention.non_causal = rng.random() < 0.3
        if rng.random() < 0.2:
            layer.sink_full_attention.sliding_window = c.pick(shape["windows"])
    elif kind == "rswa":
        layer = rswa(name, shape["rswa"], heads, head, **common)
    elif kind == "cross":
        layer = cross(name, heads, head, **common)
    elif kind == "encoder_only":
        layer = encoder_only(name, heads, head, **common)
    elif kind == "circular":
        layer = circular(name, c.pick([1, heads]), c.pick([head, 512]), **common)
    elif kind == "hidden":
        layer = hidden(name, shape["hidden_heads"], shape["hidden"], **common)
        if rng.random() < 0.2:
            layer.hidden_state_cache.mla.alignment_bytes = c.pick([512, 576, 4096])
    elif kind == "mla":
        layer = mla(name, shape["mla_head"], cache_dtype=shape["mla_cache"], **common)
        if rng.random() < 0.15:
            layer.mla_attention.mla.alignment_bytes = c.pick([576, 1024, 4096])
    elif kind == "sw_mla":
        layer = sw_mla(
            name,
            c.pick(shape["windows"]),
            shape["mla_head"],
            cache_dtype=shape["mla_cache"],
            bounded_replay=rng.random() < 0.3,
            **common,
        )
        if rng.random() < 0.2:
            layer.sliding_window_mla.mla.alignment_bytes = c.pick([576, 1024, 4096])
        if rng.random() < 0.15:
            layer.sliding_window_mla.mla.model_version = c.pick(["deepseek_v4"] * 4 + ["other"])
    else:
        assert kind == "mamba"
        return mamba(
            name,
            shape["states"],
            padded=shape["mamba_padded"],
            mamba_type=shape["mamba_type"],
            spec_blocks=shape["spec_blocks"],
            heads=shape["mamba_heads"],
            tp_replicated=rng.random() < 0.2,
            **common,
        )
    body = getattr(layer, str(layer.WhichOneof("kind")))
    if kind in ("mla", "sw_mla", "hidden") and tp > 1:
        body.attention.max_tp_shards = 1
    _c_attention(c, body.attention, kind, common.get("block", block), tp, h2nd)
    return layer


def _c_budget(c: Cases, worker: Any, mode: str, base: int) -> str:
    """One worker's budget in `mode`: explicit bytes (log-uniform around the engine's
    base), a utilization of a device given by total or by name, with non-KV memory,
    and the device's free memory near what the utilization asks."""
    rng = c.rng
    memory = worker.memory
    if mode == "bytes":
        memory.kv_cache_memory_bytes = max(1, int(base * 2 ** rng.uniform(-3, 3)))
        return "b"
    name = c.pick(_C_DEVICES)
    total = GPU_BYTES[name]
    if rng.random() < 0.5:
        worker.device.name = name
    else:
        worker.device.total_memory_bytes = total
    util = c.pick([0.3, 0.5, 0.8, 0.9, 0.95, 1.0])
    memory.gpu_memory_utilization = util
    memory.non_kv.weights_bytes = int(total * c.pick([0.0, 0.05, 0.2, 0.5, 0.85]))
    memory.non_kv.activation_peak_bytes = c.pick([0, 512 * MIB, 2 * GIB])
    memory.non_kv.non_torch_bytes = c.pick([0, 200 * MIB])
    memory.non_kv.cuda_graph_bytes = c.pick([0, 64 * MIB, GIB])
    if rng.random() < 0.2:
        requested = math.ceil(total * util)
        worker.device.free_memory_bytes = max(0, requested + c.pick([-GIB, -1, 0, 1, GIB]))
    return name if worker.device.name else "u"


def _on_own_generator(
    c: Cases, name: str, section: Callable[[Cases, int], None], count: int
) -> None:
    """Run `section` on a generator of its own, seeded from the shared one's state
    without drawing from it: the sections after it draw what they drew before it
    existed, so `--fuzz all` keeps reproducing a seed's older engines."""
    shared = c.rng
    c.rng = random.Random(f"{name} {shared.getstate()[1][:8]}")
    try:
        section(c, count)
    finally:
        c.rng = shared


def fuzz_c(c: Cases, count: int) -> None:
    """The fields, kinds and combinations no other section varies (found by listing
    every request field's values across the sections and scenarios): RSWA, cross,
    circular, hidden-state and encoder-only layers with their attention parameters
    varied (dtypes, V heads, quantized head slots grouped by KV head, padded pages,
    TP shards, DCP sharding, compressed states, stride alignments, their own
    blocks) and beside every other kind, with TP / DCP / unequal pipeline stages;
    SW-MLA with MLA cache dtypes, quantization, alignments and model versions;
    sinks that are non-causal or carry a window; several windows (many groups);
    per-layer dtype overrides within a kind; drafters of every kind first, in the
    middle or last; heterogeneous workers in one engine (each its own budget mode:
    bytes, utilization of a device by total or by name, free memory at its edge,
    measured bytes of the extensible cache); devices named instead of sized."""
    # Its own generator (the sections after it, conformance/generate.py's fixed ones,
    # draw what they drew before fuzz_c existed).
    _on_own_generator(c, "fuzz_c", _fuzz_c, count)


def _fuzz_c(c: Cases, count: int) -> None:
    cat = "fuzzc"
    rng = c.rng
    for i in range(count):
        n_kinds = c.pick([1, 2, 2, 3, 3, 4])
        kinds = list(dict.fromkeys(c.pick(_C_KINDS) for _ in range(n_kinds)))
        n = c.pick([1, 2, 3, 4, 6, 8, 12, 16, 24, 36])
        tp = c.pick([1, 1, 2, 2, 4, 8])
        dcp = c.pick([0, 0, 0, 0, 0, 2, tp]) if tp > 1 else 0
        if dcp and tp % dcp:
            dcp = 0
        block = c.pick([0, 0, 16, 32, 64, 128, 256])
        bs = block or 16
        h2nd = rng.random() < 0.1
        method = c.pick(_C_METHODS)
        spec_tokens = c.pick([1, 2, 3, 4, 7]) if method != "none" else 0
        windows = sorted({c.pick([32, 128, 512, 1024, 4096]) for _ in range(c.pick([1, 1, 2, 3]))})
        states = c.pick(_MAMBA_STATES)
        heads = c.pick([1, 2, 4, 8, 16])
        head = c.pick([64, 96, 128, 256])
        shape: dict[str, Any] = {
            "heads": heads,
            "head": head,
            "windows": windows,
            "chunk": c.pick([256, 2048, 8192]),
            "sink": c.pick([0, 16, 64, 128]),
            "rswa": c.pick([128, 512, 1024]),
            "hidden": c.pick([1024, 4096, 7168]),
            "hidden_heads": c.pick([1, 1, 1, 2]),
            "mla_head": c.pick([576, 576, 512, 656]),
            "mla_cache": c.pick(
                [spec_pb2.KV_CACHE_DTYPE_AUTO] * 3
                + [
                    spec_pb2.KV_CACHE_DTYPE_FP8,
                    spec_pb2.KV_CACHE_DTYPE_FP8_DS_MLA,
                    spec_pb2.KV_CACHE_DTYPE_NVFP4_DS_MLA,
                ]
            ),
            "states": states,
            "mamba_padded": None,
            "mamba_type": c.pick([spec_pb2.MAMBA_TYPE_MAMBA2, spec_pb2.MAMBA_TYPE_GDN_ATTENTION]),
            "spec_blocks": spec_tokens if method != "none" and rng.random() < 0.8 else 0,
            "mamba_heads": c.pick([0, 0, 1, 8]),
        }
        if "mamba" in kinds and len(kinds) > 1 and rng.random() < 0.7:
            # Pad the Mamba page to an attention page as the engine does.
            per = heads * 2 * head * 2
            page = _mamba_page(states)
            blk = bs * -(-page // (bs * per))
            block = bs = 16 * -(-max(bs, blk) // 16)
            if bs * per > page:
                shape["mamba_padded"] = bs * per
        per_layer_dtype = rng.random() < 0.15
        order = c.pick(["period", "period", "blocks", "shuffle"])
        layer_kinds = [kinds[j % len(kinds)] for j in range(n)]
        if order == "blocks":
            layer_kinds.sort(key=kinds.index)
        elif order == "shuffle":
            rng.shuffle(layer_kinds)
        layers: list[Layer] = []
        for j, kind in enumerate(layer_kinds):
            layer = _c_layer(
                c,
                kind,
                f"model.layers.{j}.attn",
                shape=shape,
                block=bs,
                tp=tp,
                h2nd=h2nd,
                draft=False,
            )
            if per_layer_dtype and kind in _C_PLAIN and rng.random() < 0.4:
                body = getattr(layer, str(layer.WhichOneof("kind")))
                body.attention.dtype = _DTYPES[c.pick(["fp16", "fp32", "e4m3"])]
            layers.append(layer)
        hisparse = rng.random() < 0.12
        if hisparse:
            # HiSparse beside these layers, its hot / resident entries with blocks of
            # their own or marked as the drafter's (fuzz_h leaves both alone).
            from conformance.generate import _hisparse_engine

            block = bs = c.pick([32, 64, 64, 128])
            others = layers[: c.pick([0, 1, 2, 4])]
            for j, layer in enumerate(others):
                layer.name = f"others.{j}.attn"
            sparse = c.pick([1, 2, 4])
            layers = _hisparse_engine(
                rng,
                sparse=sparse,
                indexers=c.pick([1, sparse]),
                leader_every=c.pick([1, 2]),
                block=block,
                sparse_head=c.pick([656, 576]),
                others=others,
                topk=c.pick([None, 2048]),
            )
            # The last sparse-MLA layer (and its indexer) may be the drafter's (an MTP
            # layer of DeepSeek V3.2).
            drafter_mla = rng.random() < 0.25
            for layer in layers:
                if layer.WhichOneof("kind") in ("hisparse_hot", "hisparse_resident"):
                    if rng.random() < 0.3:
                        layer.block_size = c.pick([16, block, 2 * block])
                    layer.is_draft = rng.random() < 0.1
                elif drafter_mla and layer.name.startswith(f"model.layers.{sparse - 1}."):
                    layer.is_draft = layer.WhichOneof("kind") == "mla_attention"
            dcp = 0
        where = "none"
        if method in ("mtp", "eagle", "eagle3", "dspark", "dflash", "draft_model", "medusa") and (
            rng.random() < 0.75
        ):
            draft_kind = c.pick([*kinds, *kinds, "full", "hidden", "cross", "rswa", "sw_mla"])
            mark = rng.random() < 0.7
            drafts = [
                _c_layer(
                    c,
                    draft_kind,
                    f"draft.layers.{d}.attn",
                    shape=shape,
                    block=bs,
                    tp=tp,
                    h2nd=h2nd,
                    draft=mark,
                )
                for d in range(c.pick([1, 1, 2, 3]))
            ]
            where = c.pick(["last", "last", "first", "middle", "spread"])
            if where == "last":
                layers = layers + drafts
            elif where == "first":
                layers = drafts + layers
            elif where == "middle":
                k = rng.randrange(len(layers) + 1)
                layers = layers[:k] + drafts + layers[k:]
            else:
                for d in drafts:
                    layers.insert(rng.randrange(len(layers) + 1), d)
        pp = c.pick([1, 1, 2, 3, 4]) if len(layers) >= 2 else 1
        pp = min(pp, len(layers))
        cuts = _split(c, len(layers), pp)
        workers = [
            W(layers[cuts[stage] : cuts[stage + 1]], 1) for stage in range(pp) for _ in range(tp)
        ]
        req = request(
            workers,
            max_model_len=c.pick([1, 16, 17, 511, 2048, 8192, 32768, 131072]),
            block_size=block,
            cache_dtype=c.pick(_Y_CACHE_DTYPES),
            model_dtype=c.pick([None, None, "fp16", "bf16", "fp32"]),
            disable_hybrid=rng.random() < 0.1,
            override=c.pick([None] * 8 + [1, 64, 1000]),
            batched=c.pick([0, 0, 16, 2048, 8192]),
            async_scheduling=c.pick([False, True]),
            v2_runner=c.pick([False, True]),
            pp=pp if pp > 1 else 0,
            tp=tp if tp > 1 else 0,
            dcp=dcp,
            layout=c.pick(["LBNHC", "LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]),
            mamba_align=None,
            encoder_tokens=c.pick([0, 1, 448, 1500, 8192]) if "cross" in kinds else 0,
            prefix_caching=c.pick([None, None, True, False]),
            method=method,
            spec_tokens=spec_tokens,
            target_model_type=c.pick(["", "", "llama", "deepseek_v3", "qwen3_next"]),
            disable_block_drop=rng.random() < 0.1,
            nextn=c.pick([None, 1, 2]) if method == "mtp" else None,
        )
        if rng.random() < 0.15:
            req.options.max_model_len = -1
            req.options.derived_max_model_len = c.pick([4096, 131072, 1 << 20])
        # Workers: one budget mode for all, each its own, or one worker unlike the rest.
        hetero = c.pick(["same", "same", "each", "one"])
        base = int(2 ** rng.uniform(22, 36))
        mode = c.pick(["bytes", "bytes", "util"])
        victim = rng.randrange(len(req.workers))
        budgets: list[str] = []
        for index, worker in enumerate(req.workers):
            worker.memory.ClearField("kv_cache_memory_bytes")
            own = mode
            if hetero == "each" or (hetero == "one" and index == victim):
                own = (
                    c.pick(["bytes", "util"])
                    if hetero == "each"
                    else ("util" if mode == "bytes" else "bytes")
                )
            budgets.append(_c_budget(c, worker, own, base))
        if rng.random() < 0.2:
            req.options.extensible_kv_cache = c.pick([True, True, False])
            if req.options.extensible_kv_cache and rng.random() < 0.6:
                measured = int(2 ** rng.uniform(24, 36))
                for worker in req.workers:
                    spread = hetero != "same" and rng.random() < 0.5
                    worker.memory.measured_kv_cache_bytes = (
                        int(measured * rng.uniform(0.5, 1.5)) if spread else measured
                    )
        if rng.random() < 0.08:
            req.options.prefix_match_unit = c.pick([1, 16, bs])
        if hisparse:
            req.options.layout = c.pick([LAYOUTS["BLHNC"]] * 3 + [LAYOUTS["BLNHC"]])
            config = req.options.hisparse
            config.host_pool_gib = c.pick([0.01, 4.0, 256.0])
            config.shared_host_pool = rng.random() < 0.4
            config.index_topk = c.pick([512, 2048])
            if rng.random() < 0.3:
                config.device_buffer_size = c.pick([2048, 8192, 16384, 32768])
            req.options.disable_hybrid_kv_cache_manager = rng.random() < 0.03
            _as_engines_run_hisparse(req, f"{cat}/c{i:04d}")
        c.add(
            cat,
            f"c{i:04d}",
            f"{n} layers {'+'.join(kinds)} ({order}) heads {heads}x{head} windows {windows} "
            f"{method}x{spec_tokens} drafts {where} pp{pp} tp{tp} dcp{dcp} block {block} "
            f"h2nd {h2nd} hisparse {hisparse} workers {hetero} {','.join(sorted(set(budgets)))}",
            req,
        )


# --- fuzz_v: vLLM 0.34's own rules, on engines that plan ---------------------------

# Model shapes whose layers plan together: (attention kinds, with Mamba). Chunked
# attention stays out (0.34's hybrid manager refuses it beside a drafter) and so do
# kinds the other sections cover alone.
_V_MIXES: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("full",), False),
    (("full", "sw"), False),
    (("full", "sw"), False),
    (("sw",), False),
    (("full",), True),
    (("full",), True),
    (("full", "sw"), True),
    (("sw",), True),
    (("mla",), False),
    (("mla", "sw_mla"), False),
    (("mla", "sw_mla"), False),
    (("sw_mla",), False),
    (("mla",), True),
    (("full", "chunked"), False),
)

# Layouts every planning path can lay mixed page sizes out in (block-compact).
_V_COMPACT = ("LBNHC", "LBHNC", "BLHNC", "BLNHC")

# Quantized head slots (attention dtype, quant mode, scale bytes per slot; 0: packed).
_V_HEAD_QUANT = (
    ("i8", spec_pb2.KV_QUANT_MODE_INT8_PER_TOKEN_HEAD, 8),
    ("e4m3", spec_pb2.KV_QUANT_MODE_FP8_PER_TOKEN_HEAD, 8),
    ("u8", spec_pb2.KV_QUANT_MODE_INT4_PER_TOKEN_HEAD, 0),
)


def fuzz_v(c: Cases, count: int) -> None:
    """vLLM 0.34's own rules on engines sized to plan (most of fuzz_c's 0.34 engines are
    refusals, which compare only the error): default block size 64 (block unset) beside
    set ones, the extensible cache on, off and unset, with and without
    num_gpu_blocks_override, explicit KV bytes and measured bytes; head slots grouped
    by KV head; Mamba state alignment; SW-MLA multi-token-decode markers and merges of
    equal or different quantization / alignment; KV-cache zeroing across workers
    (Mamba or mixed dtypes on some pipeline stages only); own-layer tensors of
    pipeline stages; workers' differing layout lists; drafters (EAGLE, MTP, a draft
    model) marked is_draft; HiSparse. Budgets are sized from the engine's pages, a
    few at the edge. Its own generator, like fuzz_c's: every other section's engines
    stay as they were."""
    _on_own_generator(c, "fuzz_v", _fuzz_v, count)


def _v_attention(c: Cases, layer: Layer, quant: tuple[str, int, int] | None, major: bool) -> None:
    """Quantized head slots on a plain attention layer: `kv_head_major_slots` is part
    of 0.34's spec identity."""
    if quant is None:
        return
    body = getattr(layer, str(layer.WhichOneof("kind")))
    a = body.attention
    dtype, mode, scale = quant
    a.dtype = _DTYPES[dtype]
    a.kv_quant_mode = mode
    total = a.head_size + (a.head_size_v if a.HasField("head_size_v") else a.head_size)
    a.state_content_bytes = total + scale if scale else total // 2 + 8
    a.num_head_slots = a.num_kv_heads * c.pick([1, 1, 2])
    a.kv_head_major_slots = major


def _v_page_bytes(layer: Layer, block: int) -> int:
    """A layer's page, roughly (for sizing budgets, not a planning rule)."""
    kind = str(layer.WhichOneof("kind"))
    body = getattr(layer, kind)
    if kind == "mamba":
        return int(
            body.page_size_padded_bytes
            or _mamba_page(
                [(list(s.shape), _C_DTYPE_NAMES.get(s.dtype, "bf16")) for s in body.states]
            )
        )
    if kind.startswith("hisparse"):
        return int(body.page_size_bytes)
    a = body.attention
    per = _Y_BYTES[_C_DTYPE_NAMES[a.dtype]] if a.dtype else 2
    if kind in ("mla_attention", "sliding_window_mla"):
        return int(block * a.head_size * per)
    heads = a.num_head_slots or a.num_kv_heads
    width = (
        a.state_content_bytes
        or (a.head_size + (a.head_size_v if a.HasField("head_size_v") else a.head_size)) * per
    )
    return int(block * heads * width)


def _fuzz_v(c: Cases, count: int) -> None:
    cat = "fuzzv"
    rng = c.rng
    for i in range(count):
        kinds, with_mamba = c.pick(_V_MIXES)
        all_kinds = [*kinds, *(["mamba"] if with_mamba else [])]
        n = c.pick([2, 3, 4, 6, 8, 12, 16, 24])
        tp = c.pick([1, 1, 2, 2, 4])
        plain_only = set(kinds) <= {"full", "mla"} and not with_mamba
        dcp = tp if tp > 1 and plain_only and rng.random() < 0.2 else 0
        block = c.pick([0, 0, 0, 16, 32, 64, 128])
        bs = block or 64  # 0.34's default
        method = c.pick(["none", "none", "eagle", "eagle3", "mtp", "draft_model"])
        if "chunked" in kinds:
            method = "none"  # the hybrid manager refuses chunked local beside a drafter
        spec_tokens = c.pick([1, 2, 3, 4]) if method != "none" else 0
        heads = c.pick([1, 2, 4, 8])
        head = c.pick([64, 128, 256])
        windows = sorted({c.pick([128, 512, 1024, 4096]) for _ in range(c.pick([1, 1, 2]))})
        quant = c.pick(_V_HEAD_QUANT) if rng.random() < 0.25 else None
        major = rng.random() < 0.6
        mixed_major = rng.random() < 0.3
        mla_head = c.pick([576, 576, 512])
        mla_cache = c.pick([spec_pb2.KV_CACHE_DTYPE_AUTO] * 3 + [spec_pb2.KV_CACHE_DTYPE_FP8])
        # SW-MLA layers alike (they merge) or each its own quantization / alignment.
        sw_mla_alike = rng.random() < 0.6
        sw_mla_align = c.pick([None, None, 576, 1024])
        sw_mla_quant = c.pick([0, 0, spec_pb2.KV_QUANT_MODE_FP8_PER_TENSOR])
        version = c.pick(["", "", "deepseek_v4"])
        states = c.pick(_MAMBA_STATES)
        state_align = c.pick([None, None, 64, 256, 4096])
        # One head count for every Mamba layer (a head-split page pads less often).
        mamba_heads = c.pick([0, 0, 0, 8])
        per_layer_dtype = rng.random() < 0.15

        def layer(kind: str, name: str, draft: bool) -> Layer:
            common: dict[str, Any] = {"draft": draft}
            if rng.random() < 0.05:
                common["align_bytes"] = c.pick([256, 4096])
            if kind == "full":
                out = full(name, heads, head, **common)
            elif kind == "sw":
                out = sw(name, c.pick(windows), heads, head, **common)
            elif kind == "chunked":
                out = chunked(name, c.pick([2048, 8192]), heads, head, **common)
            elif kind == "mla":
                out = mla(name, mla_head, cache_dtype=mla_cache, **common)
                return out
            elif kind == "sw_mla":
                out = sw_mla(
                    name,
                    windows[0],
                    mla_head,
                    cache_dtype=mla_cache,
                    version=version,
                    bounded_replay=rng.random() < 0.2,
                    **common,
                )
                body = out.sliding_window_mla
                body.non_causal_multi_token_decode = rng.random() < 0.4
                align = sw_mla_align if sw_mla_alike else c.pick([None, 576, 1024])
                if align is not None:
                    body.mla.alignment_bytes = align
                mode = sw_mla_quant if sw_mla_alike else c.pick([0, 0, sw_mla_quant])
                if mode:
                    body.attention.kv_quant_mode = mode
                    body.attention.dtype = _DTYPES["e4m3"]
                return out
            else:
                raise AssertionError(kind)
            # Some layers grouped by KV head and some not: 0.34 tells their specs apart.
            _v_attention(c, out, quant, major if not mixed_major else rng.random() < 0.5)
            if per_layer_dtype and rng.random() < 0.4 and quant is None:
                body = getattr(out, str(out.WhichOneof("kind")))
                body.attention.dtype = _DTYPES[c.pick(["fp16", "fp32", "e4m3"])]
            return out

        # The Mamba page padded to the attention page, the block raised to hold the
        # state, as the engine's model config does.
        mamba_padded: int | None = None
        if with_mamba:
            probe = layer(kinds[0], "probe", False)
            per_block = _v_page_bytes(probe, 1)
            page = _mamba_page(states)
            if state_align:
                page = sum(
                    -(-math.prod(shape) * _BYTES[dtype] // state_align) * state_align
                    for shape, dtype in states
                )
            blk = 16 * -(-page // (16 * per_block))
            if blk > bs:
                bs = blk
                block = bs
            if rng.random() < 0.85 and bs * per_block > page:
                mamba_padded = bs * per_block
            if state_align and (mamba_padded or page) % state_align:
                state_align = None

        order = c.pick(["period", "blocks", "shuffle"])
        layer_kinds = [all_kinds[j % len(all_kinds)] for j in range(max(n, len(all_kinds)))]
        if order == "blocks":
            layer_kinds.sort(key=all_kinds.index)
        elif order == "shuffle":
            rng.shuffle(layer_kinds)
        layers: list[Layer] = []
        for j, kind in enumerate(layer_kinds):
            name = f"model.layers.{j}.{'mixer' if kind == 'mamba' else 'attn'}"
            if kind == "mamba":
                one = mamba(
                    name,
                    states,
                    padded=mamba_padded,
                    mamba_type=c.pick(
                        [spec_pb2.MAMBA_TYPE_MAMBA2, spec_pb2.MAMBA_TYPE_GDN_ATTENTION]
                    ),
                    spec_blocks=spec_tokens if method != "none" else 0,
                    heads=mamba_heads,
                )
                if state_align:
                    one.mamba.state_alignment_bytes = state_align
                layers.append(one)
            else:
                layers.append(layer(kind, name, False))

        hisparse = not with_mamba and rng.random() < 0.08
        if hisparse:
            from conformance.generate import _hisparse_engine

            block = bs = c.pick([64, 64, 128])
            sparse = c.pick([1, 2, 4])
            others = [x for x in layers if x.WhichOneof("kind") != "mla_attention"][:2]
            for j, other in enumerate(others):
                other.name = f"others.{j}.attn"
            layers = _hisparse_engine(
                rng,
                sparse=sparse,
                indexers=c.pick([1, sparse]),
                leader_every=1,
                block=block,
                sparse_head=656,
                others=others,
                topk=None,
            )
            dcp = 0

        if method != "none":
            draft_kind = (
                "mla"
                if (method == "mtp" and "mla" in kinds)
                else c.pick([k for k in kinds if k != "chunked"] + ["full"])
            )
            mark = rng.random() < 0.9
            drafts = [
                layer(draft_kind, f"draft.layers.{d}.attn", mark) for d in range(c.pick([1, 1, 2]))
            ]
            layers = layers + drafts if rng.random() < 0.85 else drafts + layers
        pp = min(c.pick([1, 1, 2, 2, 3, 4]) if not hisparse else 1, len(layers))
        cuts = _split(c, len(layers), pp)
        workers = [
            W(layers[cuts[stage] : cuts[stage + 1]], 1) for stage in range(pp) for _ in range(tp)
        ]
        max_len = c.pick([2048, 8192, 32768, 131072])
        req = request(
            workers,
            max_model_len=max_len,
            block_size=block,
            cache_dtype=c.pick([spec_pb2.KV_CACHE_DTYPE_AUTO] * 4 + [spec_pb2.KV_CACHE_DTYPE_FP8]),
            model_dtype=c.pick([None, None, "bf16", "fp16"]),
            disable_hybrid=rng.random() < 0.05,
            batched=c.pick([0, 0, 2048, 8192]),
            async_scheduling=c.pick([False, True]),
            v2_runner=c.pick([False, True]),
            pp=pp if pp > 1 else 0,
            tp=tp if tp > 1 else 0,
            dcp=dcp,
            layout=c.pick([*_V_COMPACT, "LBNHC"]),
            mamba_align=c.pick([None, None, True]) if with_mamba else None,
            prefix_caching=c.pick([None, None, True, False]),
            method=method,
            spec_tokens=spec_tokens,
            target_model_type=c.pick(
                ["", "qwen3_next"]
                if with_mamba
                else ["", "deepseek_v3", "deepseek_v4"]
                if "sw_mla" in kinds
                else ["", "deepseek_v3"]
            ),
            nextn=c.pick([None, 1]) if method == "mtp" else None,
        )
        if rng.random() < 0.3:
            req.options.ClearField("layout")
        auto_fit = rng.random() < 0.1
        if auto_fit:
            req.options.max_model_len = -1
            req.options.derived_max_model_len = c.pick([32768, 131072])
        # Budgets from the worker's own pages for one request at the longest length,
        # times a headroom: most plan, one in ten sits near the edge.
        headroom = 2 ** rng.uniform(1, 7) if rng.random() < 0.9 else rng.uniform(0.5, 1.5)
        mode = c.pick(["bytes", "util", "util", "mixed"])
        for index, worker in enumerate(req.workers):
            length = req.options.derived_max_model_len if auto_fit else max_len
            blocks = -(-length // bs) + 2
            need = sum(
                _v_page_bytes(x, bs)
                * (1 + spec_tokens if x.WhichOneof("kind") == "mamba" else blocks)
                for x in worker.layers
            )
            budget = max(MIB, int(need * headroom))
            worker.memory.ClearField("kv_cache_memory_bytes")
            own = mode if mode != "mixed" else c.pick(["bytes", "util"])
            if own == "bytes":
                worker.memory.kv_cache_memory_bytes = budget
                continue
            util = c.pick([0.5, 0.8, 0.9, 0.95])
            weights = c.pick([0, GIB, 8 * GIB])
            total = int((budget + weights + 512 * MIB) / util) + GIB
            if rng.random() < 0.8:
                worker.memory.gpu_memory_utilization = util
            # Unset: the engine's default (0.34's extensible cache reserves at 1.0).
            worker.memory.non_kv.weights_bytes = weights
            worker.memory.non_kv.activation_peak_bytes = c.pick([0, 512 * MIB])
            worker.device.total_memory_bytes = total
            if rng.random() < 0.1:
                # Free memory short of what the utilization asks: the classic cache's
                # start-up check refuses it, the extensible reservation does not.
                worker.device.free_memory_bytes = int(total * util * rng.uniform(0.8, 1.05))
            if index == 0 and rng.random() < 0.1:
                worker.device.ClearField("total_memory_bytes")
                worker.device.name = c.pick(["H200-141GB", "B200-180GB", "MI300X-192GB"])
        # The extensible cache: unset (0.34's default on), on or off; an override
        # settles it off (and asked for as well, a refusal); measured bytes on every
        # worker for the final plan.
        extensible = c.pick([None, None, True, False])
        if extensible is not None:
            req.options.extensible_kv_cache = extensible
        if (rng.random() < 0.1 and extensible is not True) or rng.random() < 0.01:
            req.options.num_gpu_blocks_override = c.pick([64, 1000, 4096])
        elif extensible is not False and rng.random() < 0.45:
            granule = c.pick([None, None, 64 << 10, 2 << 20])
            fraction = rng.uniform(0.05, 1.1)
            for worker in req.workers:
                size = worker.memory.kv_cache_memory_bytes or int(
                    worker.device.total_memory_bytes * (worker.memory.gpu_memory_utilization or 1)
                    - worker.memory.non_kv.weights_bytes
                    or 40 * GIB
                )
                spread = 1.0 if rng.random() < 0.7 else rng.uniform(0.8, 1.0)
                worker.memory.measured_kv_cache_bytes = max(1, int(size * fraction * spread))
                if granule:
                    worker.memory.allocation_granule_bytes = granule
        if len(req.workers) > 1 and rng.random() < 0.3:
            # Each worker its own list of the layouts its backends support, one shared.
            # A worker reporting exactly the no-preference default does not vote.
            from conformance.generate import NO_PREFERENCE

            shared_layout = c.pick(_V_COMPACT)
            for worker in req.workers:
                if rng.random() < 0.2:
                    worker.supported_layouts.extend(LAYOUTS[x] for x in NO_PREFERENCE)
                    continue
                candidates = [*_V_COMPACT, "BHLNC", "LHBNC"]
                names = [x for x in candidates if x != shared_layout and rng.random() < 0.4]
                names.insert(rng.randint(0, len(names)), shared_layout)
                worker.supported_layouts.extend(LAYOUTS[x] for x in names)
            req.options.ClearField("layout")
        if hisparse:
            req.options.layout = LAYOUTS[c.pick(["BLHNC", "BLHNC", "BLNHC"])]
            config = req.options.hisparse
            config.host_pool_gib = c.pick([4.0, 64.0, 256.0])
            config.index_topk = c.pick([512, 2048])
        c.add(
            cat,
            f"v{i:04d}",
            f"{n} layers {'+'.join(all_kinds)} ({order}) heads {heads}x{head} windows {windows} "
            f"{method}x{spec_tokens} pp{pp} tp{tp} dcp{dcp} block {block} quant "
            f"{quant[0] if quant else None} major {major} state_align {state_align} "
            f"hisparse {hisparse} budget {mode} x{headroom:.2f} extensible {extensible}",
            req,
        )


def fuzz_j(c: Cases, count: int) -> None:
    """vLLM's opt-in enable_mamba_shared_prefix_checkpoint on random Mamba hybrids:
    Mamba blocks set or left to the engine's, attention (full or MLA) blocks at or
    below them, a hash unit finer than both or unset, MTP / EAGLE / EAGLE3 drafters
    of one to three tokens marked is_draft or not (or none), DCP, now and then a
    sliding-window layer (which turns partial hash hits off), the option on in most
    engines. The later-request probes check where it keeps a Mamba state at the
    junction. Its own generator, like fuzz_c's: every other section's engines stay
    as they were."""
    _on_own_generator(c, "fuzz_j", _fuzz_j, count)


def _fuzz_j(c: Cases, count: int) -> None:
    rng = c.rng
    for index in range(count):
        mamba_block = c.pick([None, 32, 64, 64, 128, 256])
        attention_block = c.pick(
            [None] + [b for b in (16, 32, 64) if mamba_block is None or b <= mamba_block]
        )
        states = c.pick([SMALL_STATES, GDN_STATES])
        layers: list[Layer] = [
            mamba(f"model.layers.{i}.mixer", states, block=mamba_block)
            for i in range(c.pick([1, 2, 3, 4]))
        ]
        kind = c.pick(["full", "full", "mla"])
        heads, head = c.pick([(2, 256), (4, 128), (8, 64)])

        def attention(name: str, draft: bool = False) -> Layer:
            if kind == "mla":
                return mla(name, block=attention_block, draft=draft)
            return full(name, heads, head, block=attention_block, draft=draft)

        layers += [attention(f"model.layers.a{i}.attn") for i in range(c.pick([1, 2]))]
        window = c.pick([0, 0, 0, 0, 0, 64, 1024])
        if window:
            layers.append(sw("model.layers.s0.attn", window, heads, head, block=attention_block))
        method = c.pick(["mtp", "mtp", "eagle", "eagle3", "none"])
        tokens = c.pick([1, 1, 1, 2, 3]) if method != "none" else 0
        draft = method != "none" and rng.random() < 0.7
        if method != "none":
            layers.append(attention("mtp.layers.0.attn", draft=draft))
        dcp = c.pick([0, 0, 0, 0, 2])
        req = request(
            W(layers, 4 * GIB),
            max_model_len=c.pick([4096, 8192]),
            mamba_align=True,
            method=method,
            spec_tokens=tokens,
            dcp=dcp,
            tp=dcp,
        )
        unit = c.pick([None, 1, 2, 4, 8, 16])
        if unit is not None:
            req.options.prefix_match_unit = unit
        checkpoint = rng.random() < 0.85
        if checkpoint:
            req.options.enable_mamba_shared_prefix_checkpoint = True
        c.add(
            "fuzzj",
            f"j{index:04d}",
            f"{len(layers)} layers, Mamba block {mamba_block}, {kind} block {attention_block}, "
            f"window {window}, {method}x{tokens} draft {draft}, dcp {dcp}, unit {unit}, "
            f"junction checkpoint {checkpoint}",
            req,
        )


# Name -> (section, default case count), in the order they draw: a seed and the
# same counts give the same engines.
SECTIONS: dict[str, tuple[Callable[[Cases, int], None], int]] = {
    "fuzz_wide": (fuzz_wide, 1500),
    "fuzz_x": (fuzz_x, 1000),
    "fuzz_y": (fuzz_y, 3000),
    "fuzz_h": (fuzz_h, 600),
    "fuzz_l": (fuzz_l, 600),  # drawn from fuzz_y's and fuzz_h's engines: after them
    "fuzz_z": (fuzz_z, 3000),
    "fuzz_c": (fuzz_c, 1500),
    "fuzz_v": (fuzz_v, 1000),
    "fuzz_j": (fuzz_j, 500),
}


def parse_fuzz_sections(values: Iterable[str]) -> dict[str, int]:
    """`--fuzz` values (`SECTION`, `SECTION=COUNT` or `all`) -> section -> count."""
    counts: dict[str, int] = {}
    for value in values:
        name, _, count = value.partition("=")
        names = list(SECTIONS) if name == "all" else [name]
        for one in names:
            if one not in SECTIONS:
                raise ValueError(f"no fuzz section {one!r}; the sections: {', '.join(SECTIONS)}")
            counts[one] = int(count) if count else SECTIONS[one][1]
            if counts[one] < 0:
                raise ValueError(f"--fuzz {value}: a count is 0 or more")
    return counts


def add_fuzz_sections(c: Cases, counts: Mapping[str, int]) -> None:
    """The sections asked for, in SECTIONS' order."""
    for name, (section, _) in SECTIONS.items():
        if name in counts:
            section(c, counts[name])
