"""Differential check: plan every generated request with vLLM 0.33.0 and kvplan.

Runs in the vLLM reference venv with the repository root on sys.path (see
conformance/run). Each case is classified as

* agree: every compared field matches;
* deviation: the only differences are ones kvplan makes on purpose (draft flags
  from DRAFT_RULE_SPEC_MARKER / DRAFT_RULE_TRAILING_LAYER, or DSpark treated as
  eligible for draft flags and the Mamba warning);
* disagree: anything else (the first differing field is reported).

Writes conformance/report.md and conformance/report.json and prints the summary.
Exit status 1 on any disagreement unless --allow-disagreement.

Usage: python -m conformance.compare [--only SUBSTR] [--vllm-only] [--allow-disagreement]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from conformance.generate import (  # noqa: E402
    Case,
    add_fuzz_argument,
    add_split_arguments,
    check_split,
    fuzz_sections,
    generate_cases,
    split_cases,
)
from kvplan.v1 import plan_pb2  # noqa: E402

Json = dict[str, Any]
HERE = Path(__file__).resolve().parent
CONCURRENCY_RTOL = 1e-9

KIND_CLASS = {
    "full_attention": "FullAttentionSpec",
    "mla_attention": "MLAAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "sliding_window_mla": "SlidingWindowMLASpec",
    "chunked_local_attention": "ChunkedLocalAttentionSpec",
    "sink_full_attention": "SinkFullAttentionSpec",
    "rswa": "RSWASpec",
    "hidden_state_cache": "HiddenStateCacheSpec",
    "cross_attention": "CrossAttentionSpec",
    "encoder_only_attention": "EncoderOnlyAttentionSpec",
    "circular_buffer": "CircularBufferSpec",
    "mamba": "MambaSpec",
    "hisparse_hot": "HiSparseHotSpec",
    "hisparse_resident": "HiSparseResidentSpec",
}
# Warnings vLLM 0.33 logs that kvplan reports with a WarningCode; compared as sets.
COMPARED_WARNINGS = (
    "PADDING_LAYERS",
    "FULL_ALLOCATION_FALLBACK",
    "HYBRID_MANAGER_DISABLED",
    "NO_DRAFT_GROUP_MAMBA",
)
DEVIATION_RULES = ("DRAFT_RULE_SPEC_MARKER", "DRAFT_RULE_TRAILING_LAYER")


@dataclass(frozen=True)
class ValidationDeviation:
    """A request kvplan refuses up front (INVALID_ARGUMENT on a field matching
    `field`, its message holding `message`) where vLLM's planner goes on: to a plan
    ("plans"), to an error of its own ("fails"), or either ("either")."""

    field: re.Pattern[str]
    vllm: str
    reason: str
    message: str = ""

    def explains(self, v: Json, kvplan_error: Json) -> bool:
        if self.vllm != "either" and bool(v.get("ok")) != (self.vllm == "plans"):
            return False
        return bool(self.field.match(kvplan_error.get("field", ""))) and (
            self.message in kvplan_error.get("message", "")
        )


# docs/semantics.md, D5, D7, D8, D11.
VALIDATION_DEVIATIONS = (
    # vLLM's planner function plans it (an engine never builds one); kvplan takes
    # requests from the wire.
    ValidationDeviation(
        re.compile(r"^workers\[\d+\]\.rank$"),
        "plans",
        "(c) kvplan rejects a rank given twice (D7)",
    ),
    # vLLM fails too: at the worker's config (ZeroDivisionError), or first at
    # another worker's memory check, which a 0-byte block leaves to the others.
    ValidationDeviation(
        re.compile(r"^workers\[\d+\]\.layers$"),
        "fails",
        "(f) a worker with no layer in any group refused up front (D5)",
        message="holds no layers of this engine's KV cache groups",
    ),
    # vLLM divides by the 0-byte page, plans a group of such pages, or refuses
    # first on memory.
    ValidationDeviation(
        re.compile(r"^workers\[\d+\]\.layers\[\d+\]\.\w+\.attention\.tokens_per_state\.tokens$"),
        "either",
        "(g) tokens_per_state larger than the block refused up front (D8)",
    ),
    # Values no attention backend publishes: vLLM's planner takes them as given
    # (a 0-byte or 0-slot page, window metadata of 0) and plans, or fails later.
    ValidationDeviation(
        re.compile(
            r"^(options\.derived_max_model_len|workers\[\d+\]\.layers\[\d+\]\.(block_size|"
            r"\w+\.(sliding_window|attention_chunk_size)|\w+\.attention\.(max_tp_shards|"
            r"num_head_slots|state_content_bytes|page_size_padded_bytes)))$"
        ),
        "either",
        "(h) a count or size of 0 that no backend publishes refused up front (D11)",
        message="must be >= 1",
    ),
    ValidationDeviation(
        re.compile(r"^workers\[\d+\]\.layers\[\d+\]\.\w+\.attention\.head_size_v$"),
        "either",
        "(h) a V head size on an MLA layer refused up front (D11)",
        message="MLA layers have no separate V head",
    ),
    ValidationDeviation(
        re.compile(r"^workers\[\d+\]\.layers\[\d+\]\.sliding_window_mla\.mla\.topk_buffer_width$"),
        "either",
        "(h) a top-k index buffer on a sliding-window MLA layer refused up front (D11)",
    ),
)

# vLLM 0.32 / 0.33's assertion when the workers' supported-layout lists differ.
LAYOUT_LISTS_DISAGREE = "Workers disagree on supported KV cache layouts"

PlanFn = Callable[[plan_pb2.PlanRequest], plan_pb2.PlanResponse]


def load_kvplan() -> tuple[PlanFn | None, type[BaseException] | None, str]:
    """kvplan's proto entry point (None when kvplan is not importable)."""
    try:
        from kvplan.convert import plan_from_proto
        from kvplan.core.errors import PlanningError
    except ImportError:
        return None, None, ""
    return plan_from_proto, PlanningError, "kvplan.convert"


# --- kvplan -> the driver's dict shape ----------------------------------------------


def normalize_kvplan(resp: plan_pb2.PlanResponse) -> Json:
    groups = []
    for g in resp.groups:
        kind = g.spec.WhichOneof("kind") or ""
        groups.append(
            {
                "layers": list(g.layer_names),
                "spec": KIND_CLASS.get(kind, kind),
                "uniform_type": bool(g.uniform_type),
                "block_size": int(g.block_size),
                "page_size_bytes": int(g.page_size_bytes),
                "is_draft": bool(g.is_draft),
                "draft_rule": plan_pb2.DraftRule.Name(g.draft_rule),
            }
        )
    workers = []
    for w in resp.workers:
        workers.append(
            {
                "rank": int(w.rank),
                "num_blocks": int(w.num_blocks),
                "hisparse_host_num_blocks": int(resp.hisparse_host_num_blocks),
                "bytes_per_block": int(w.bytes_per_block),
                "needed_per_request_bytes": int(w.budget.needed_per_request_bytes),
                "kv_tp_replicas": int(w.kv_tp_replicas),
                "needs_kv_cache_zeroing": bool(w.needs_kv_cache_zeroing),
                "encoder_only_layers": list(w.encoder_only_layers),
                "tensors": [
                    {
                        "size": int(t.size_bytes),
                        "layers": list(t.layer_names),
                        "offset": int(t.offset_bytes),
                        "layer_stride": int(t.layer_stride_bytes),
                        "block_stride": int(t.block_stride_bytes),
                        "host_resident": bool(t.host_resident),
                    }
                    for t in w.tensors
                ],
                "groups": [
                    {"layers": list(p.layer_names), "is_draft": bool(p.is_draft)} for p in w.groups
                ],
            }
        )
    capacity = None
    if resp.groups and resp.workers:
        capacity = {
            "kv_cache_size_tokens": int(resp.workers[0].kv_cache_size_tokens),
            "max_concurrency": float(resp.workers[0].max_concurrency),
        }
    diag = resp.diagnostics
    warnings = [
        {
            "code": plan_pb2.WarningCode.Name(x.code).removeprefix("WARNING_CODE_"),
            "message": x.message,
        }
        for x in diag.warnings
    ]
    return {
        "ok": True,
        "error": None,
        "max_model_len": int(resp.max_model_len),
        "num_blocks": int(resp.num_blocks),
        "groups": groups,
        "workers": workers,
        "capacity": capacity,
        "block_sizes": {
            "scheduler": int(diag.scheduler_block_size),
            "hash": int(diag.hash_block_size),
        },
        "warnings": warnings,
        "padding": [[int(p.padding_layers), f"{p.waste_percent:.2f}"] for p in diag.padding],
        "grouping_path": plan_pb2.GroupingPath.Name(diag.grouping_path),
        "layout": plan_pb2.KVCacheLayout.Name(diag.kv_cache_layout).removeprefix(
            "KV_CACHE_LAYOUT_"
        ),
    }


def plan_with_kvplan(
    fn: PlanFn, error_type: type[BaseException], req: plan_pb2.PlanRequest
) -> Json:
    try:
        resp = fn(req)
    except error_type as exc:
        return {
            "ok": False,
            "error": {
                "code": str(getattr(exc, "code", "")),
                "field": str(getattr(exc, "field", "")),
                "message": str(exc),
                "details": dict(getattr(exc, "details", {}) or {}),
            },
        }
    except Exception as exc:
        return {
            "ok": False,
            "crash": True,
            "error": {
                "code": "CRASH",
                "field": "",
                "message": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=6),
            },
        }
    return normalize_kvplan(resp)


# --- comparison ----------------------------------------------------------------------


@dataclass
class Diff:
    path: str
    vllm: Any
    kvplan: Any

    def to_json(self) -> Json:
        return {"path": self.path, "vllm": _short(self.vllm), "kvplan": _short(self.kvplan)}


def _short(value: Any, limit: int = 400) -> Any:
    text = json.dumps(value, default=str)
    return value if len(text) <= limit else text[:limit] + "..."


_NEEDED_RE = re.compile(r"([0-9.]+) GiB KV\s+cache is needed")
_AVAILABLE_RE = re.compile(r"available KV cache memory \(([0-9.]+) GiB\)")
_ESTIMATE_RE = re.compile(r"estimated maximum model length is (\d+)")
_MAXLEN_RE = re.compile(r"max seq len \((\d+)\)")


def _memory_numbers(message: str) -> Json:
    out: Json = {}
    for key, pattern in (
        ("needed_gib", _NEEDED_RE),
        ("available_gib", _AVAILABLE_RE),
        ("estimated_max_model_len", _ESTIMATE_RE),
        ("max_model_len", _MAXLEN_RE),
    ):
        if match := pattern.search(message):
            out[key] = match.group(1)
    return out


def error_class(result: Json, side: str) -> str:
    """ "ok", "memory" or "other" (kvplan: by status code)."""
    if result.get("ok"):
        return "ok"
    error = result.get("error") or {}
    if side == "vllm":
        return "memory" if error.get("kind") == "memory" else "other"
    code = error.get("code")
    if code == "RESOURCE_EXHAUSTED":
        return "memory"
    if code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"):
        return "other"
    return f"kvplan:{code}"


def _cmp(diffs: list[Diff], path: str, a: Any, b: Any) -> None:
    if a != b:
        diffs.append(Diff(path, a, b))


def compare_results(v: Json, k: Json) -> list[Diff]:
    """Every differing field, most significant first."""
    diffs: list[Diff] = []
    v_class, k_class = error_class(v, "vllm"), error_class(k, "kvplan")
    if v_class != k_class:
        diffs.append(Diff("error", v.get("error") or "ok", k.get("error") or "ok"))
        return diffs
    if v_class != "ok":
        if v_class == "memory":
            v_nums = _memory_numbers(v["error"]["message"])
            k_nums = _memory_numbers(k["error"]["message"])
            for key in sorted(set(v_nums) | set(k_nums)):
                _cmp(diffs, f"error.{key}", v_nums.get(key), k_nums.get(key))
        return diffs
    _cmp(diffs, "layout", v.get("layout"), k.get("layout"))
    _cmp(diffs, "groups.count", len(v["groups"]), len(k["groups"]))
    for i, (vg, kg) in enumerate(zip(v["groups"], k["groups"], strict=False)):
        for key in ("layers", "spec", "uniform_type", "block_size", "page_size_bytes"):
            _cmp(diffs, f"groups[{i}].{key}", vg[key], kg[key])
    for i, (vg, kg) in enumerate(zip(v["groups"], k["groups"], strict=False)):
        _cmp(diffs, f"groups[{i}].is_draft", vg["is_draft"], kg["is_draft"])
    _cmp(diffs, "max_model_len", v["max_model_len"], k["max_model_len"])
    _cmp(diffs, "num_blocks", v["num_blocks"], k["num_blocks"])
    _cmp(diffs, "workers.count", len(v["workers"]), len(k["workers"]))
    for w, (vw, kw) in enumerate(zip(v["workers"], k["workers"], strict=False)):
        for key in ("rank", "num_blocks", "bytes_per_block", "hisparse_host_num_blocks"):
            _cmp(diffs, f"workers[{w}].{key}", vw[key], kw[key])
        _cmp(diffs, f"workers[{w}].tensors.count", len(vw["tensors"]), len(kw["tensors"]))
        for t, (vt, kt) in enumerate(zip(vw["tensors"], kw["tensors"], strict=False)):
            for key in (
                "layers",
                "size",
                "offset",
                "layer_stride",
                "block_stride",
                "host_resident",
            ):
                _cmp(diffs, f"workers[{w}].tensors[{t}].{key}", vt[key], kt[key])
        _cmp(diffs, f"workers[{w}].groups.count", len(vw["groups"]), len(kw["groups"]))
        for g, (vp, kp) in enumerate(zip(vw["groups"], kw["groups"], strict=False)):
            _cmp(diffs, f"workers[{w}].groups[{g}].layers", vp["layers"], kp["layers"])
            _cmp(diffs, f"workers[{w}].groups[{g}].is_draft", vp["is_draft"], kp["is_draft"])
        for key in (
            "needed_per_request_bytes",
            "kv_tp_replicas",
            "encoder_only_layers",
            "needs_kv_cache_zeroing",
        ):
            _cmp(diffs, f"workers[{w}].{key}", vw[key], kw[key])
    vc, kc = v["capacity"], k["capacity"]
    if (vc is None) != (kc is None):
        diffs.append(Diff("capacity", vc, kc))
    elif vc is not None and kc is not None:
        _cmp(
            diffs,
            "capacity.kv_cache_size_tokens",
            vc["kv_cache_size_tokens"],
            kc["kv_cache_size_tokens"],
        )
        if not math.isclose(vc["max_concurrency"], kc["max_concurrency"], rel_tol=CONCURRENCY_RTOL):
            diffs.append(
                Diff("capacity.max_concurrency", vc["max_concurrency"], kc["max_concurrency"])
            )
    v_codes = {w["code"] for w in v["warnings"]} & set(COMPARED_WARNINGS)
    k_codes = {w["code"] for w in k["warnings"]} & set(COMPARED_WARNINGS)
    for code in COMPARED_WARNINGS:
        if (code in v_codes) != (code in k_codes):
            diffs.append(Diff(f"warnings.{code}", code in v_codes, code in k_codes))
    _cmp(diffs, "padding", v["padding"], k["padding"])
    vb, kb = v.get("block_sizes") or {}, k.get("block_sizes") or {}
    for key in ("scheduler", "hash"):
        _cmp(diffs, f"block_sizes.{key}", vb.get(key), kb.get(key))
    return diffs


def informational_diffs(v: Json, k: Json) -> list[Diff]:
    """Reported, never gating: the auto-fit notice."""
    diffs: list[Diff] = []
    if not (v.get("ok") and k.get("ok")):
        return diffs
    v_fit = any(w["code"] == "MAX_MODEL_LEN_AUTO_FIT" for w in v["warnings"])
    k_fit = any(w["code"] == "MAX_MODEL_LEN_AUTO_FIT" for w in k["warnings"])
    _cmp(diffs, "warnings.MAX_MODEL_LEN_AUTO_FIT", v_fit, k_fit)
    return diffs


_GROUP_FLAG = re.compile(r"^groups\[(\d+)\]\.is_draft$")
_PROJECTED_FLAG = re.compile(r"^workers\[\d+\]\.groups\[(\d+)\]\.is_draft$")


def documented_deviation(
    case: Case, v: Json, k: Json, diffs: list[Diff], *, own_rules: bool = True
) -> str | None:
    """The deviation that explains every diff, or None. Under a release's rule set
    only the validation deviations (D5, D7, D8, D11) apply; D1, D2 and D4 are kvplan's own rules."""
    if not diffs:
        return None
    vllm_error = (v.get("error") or {}).get("message", "")
    kvplan_error = k.get("error") or {}
    if kvplan_error.get("code") == "INVALID_ARGUMENT":
        for deviation in VALIDATION_DEVIATIONS:
            if deviation.explains(v, kvplan_error):
                return deviation.reason
    if own_rules and vllm_error.startswith(LAYOUT_LISTS_DISAGREE):
        # 0.33 stops there; kvplan's own rules go on with 0.34's merge.
        return "(e) workers' differing layout lists merged as vLLM 0.34 does (D9)"
    if v.get("ok") and not k.get("ok"):
        error = k.get("error") or {}
        if (
            own_rules
            and error.get("field") == "spec_decode.num_speculative_tokens"
            and error.get("message", "").startswith("multi-module MTP with prefix caching")
        ):
            # kvplan's own rules flag the drafter's group, and vLLM's KV cache manager
            # checks the lookahead of every flagged group.
            return "(a) the drafter's group flagged by D1 takes the MTP lookahead check (D1)"
        return None
    if not (v.get("ok") and k.get("ok")) or not own_rules:
        return None
    method = plan_pb2.SpecDecodeMethod.Name(case.request.spec_decode.method)
    # The seed's gate, use_eagle() and not disable_eagle_block_drop, admits both.
    dspark = method in ("SPEC_DECODE_METHOD_DSPARK", "SPEC_DECODE_METHOD_DFLASH")
    flagged: set[int] = set()
    for d in diffs:
        if m := _GROUP_FLAG.match(d.path):
            flagged.add(int(m.group(1)))
    for d in diffs:
        if m := _GROUP_FLAG.match(d.path):
            index = int(m.group(1))
            if d.vllm or not d.kvplan:
                return None  # kvplan never removes a flag vLLM sets
            if not dspark and k["groups"][index]["draft_rule"] not in DEVIATION_RULES:
                return None
        elif m := _PROJECTED_FLAG.match(d.path):
            if int(m.group(1)) not in flagged:
                return None
        elif d.path == "warnings.NO_DRAFT_GROUP_MAMBA":
            # Rule (a) finds a group where vLLM found none (so vLLM warns);
            # under (b) kvplan may warn where vLLM's gate is off.
            if not ((d.vllm and flagged) or (dspark and d.kvplan)):
                return None
        else:
            return None
    if dspark:
        return "(b) DSpark/DFlash are eligible for draft flags and the Mamba warning (D2)"
    return "(a) draft flag from DRAFT_RULE_SPEC_MARKER / DRAFT_RULE_TRAILING_LAYER (D1)"


# --- running ---------------------------------------------------------------------


@dataclass
class Outcome:
    case: Case
    status: str  # agree | deviation | disagree | vllm-only
    vllm: Json
    kvplan: Json | None
    diffs: list[Diff] = field(default_factory=list)
    info: list[Diff] = field(default_factory=list)
    reason: str = ""

    def to_json(self, verbose: bool) -> Json:
        out: Json = {
            "id": self.case.id,
            "category": self.case.category,
            "description": self.case.description,
            "status": self.status,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.diffs:
            out["first_diff"] = self.diffs[0].to_json()
            out["diffs"] = [d.to_json() for d in self.diffs[:20]]
        if self.info:
            out["info"] = [d.to_json() for d in self.info[:10]]
        out["vllm_error"] = self.vllm.get("error")
        if self.kvplan is not None:
            out["kvplan_error"] = self.kvplan.get("error")
        if verbose:
            out["vllm"] = self.vllm
            out["kvplan"] = self.kvplan
            out["request"] = self.case.to_json()["request"]
        return out


def for_release(request: plan_pb2.PlanRequest, engine_version: str) -> plan_pb2.PlanRequest:
    """The request as the installed release can express it: fields it lacks are
    cleared (kvplan answers INVALID_ARGUMENT for them under that rule set, which
    tests/test_rule_sets.py checks), and kvplan is told the rule set to use."""
    from conformance import vllm_driver as driver

    adapted = plan_pb2.PlanRequest()
    adapted.CopyFrom(request)
    adapted.options.engine_version = engine_version
    if not driver.HAS_EXTENSIBLE_KV_CACHE:
        adapted.options.ClearField("extensible_kv_cache")
    for worker in adapted.workers:
        if not driver.HAS_EXTENSIBLE_KV_CACHE:
            worker.memory.ClearField("measured_kv_cache_bytes")
            worker.memory.ClearField("allocation_granule_bytes")
        for layer in worker.layers:
            if not driver.HAS_IS_DRAFT:
                layer.is_draft = False
            kind = layer.WhichOneof("kind")
            if kind is None:
                continue
            body = getattr(layer, kind)
            if not driver.HAS_TOPK_BUFFER_WIDTH and kind in ("mla_attention", "hidden_state_cache"):
                body.mla.ClearField("topk_buffer_width")
            if kind == "mamba":
                if not driver.HAS_STATE_ALIGNMENT:
                    body.ClearField("state_alignment_bytes")
                continue
            if kind in ("hisparse_hot", "hisparse_resident"):
                continue
            if not driver.HAS_KV_HEAD_MAJOR_SLOTS:
                body.attention.kv_head_major_slots = False
            if kind == "sliding_window_mla" and not driver.HAS_SW_MLA_SPEC_MARKER:
                body.non_causal_multi_token_decode = False
    return adapted


def run_case(
    case: Case, kv: tuple[PlanFn, type[BaseException]] | None, engine_version: str
) -> Outcome:
    from conformance.vllm_driver import plan_with_vllm
    from kvplan.gpus import GPU_MEMORY_BYTES

    request = for_release(case.request, engine_version)
    case = Case(case.id, case.category, case.description, request)
    # The same device-name table kvplan resolves names with: an input, not a rule.
    v = plan_with_vllm(request, GPU_MEMORY_BYTES)
    if kv is None:
        return Outcome(case, "vllm-only", v, None)
    k = plan_with_kvplan(kv[0], kv[1], request)
    diffs = compare_results(v, k)
    info = informational_diffs(v, k)
    if not diffs:
        return Outcome(case, "agree", v, k, diffs, info)
    reason = documented_deviation(case, v, k, diffs, own_rules=not engine_version)
    if reason:
        return Outcome(case, "deviation", v, k, diffs, info, reason)
    if engine_version:
        return Outcome(case, "disagree", v, k, diffs, info)
    without_phantoms = drop_phantom_tensors(v, case.request)
    if without_phantoms is not None:
        remaining = compare_results(without_phantoms, k)
        d4 = "(d) no tensors for another stage's layers (D4)"
        if not remaining:
            return Outcome(case, "deviation", v, k, diffs, info, d4)
        reason = documented_deviation(case, without_phantoms, k, remaining)
        if reason:
            return Outcome(case, "deviation", v, k, diffs, info, f"{d4} and {reason}")
    return Outcome(case, "disagree", v, k, diffs, info)


def drop_phantom_tensors(v: Json, request: plan_pb2.PlanRequest) -> Json | None:
    """vLLM's result without tensors that hold only layers the worker does not have
    (a projected uniform-type group keeps its global layers; docs D4), or None when
    there is no such tensor."""
    if not v.get("ok"):
        return None
    own = {w.rank: {layer.name for layer in w.layers} for w in request.workers}
    dropped = False
    workers = []
    for worker in v["workers"]:
        names = own.get(worker["rank"], set())
        tensors = [t for t in worker["tensors"] if names.intersection(t["layers"])]
        dropped |= len(tensors) != len(worker["tensors"])
        workers.append({**worker, "tensors": tensors})
    return {**v, "workers": workers} if dropped else None


def vllm_digest(v: Json) -> str:
    """A short fingerprint of the compared part of vLLM's answer, so answers of two
    releases can be told apart (conformance/summary.py counts the differences)."""
    import hashlib

    error = v.get("error") or {}
    kind = error_class(v, "vllm")
    core = {
        "error": [kind, _memory_numbers(error.get("message", ""))] if kind != "ok" else None,
        "groups": v.get("groups") if kind == "ok" else None,
        "plan": [v.get(key) for key in ("max_model_len", "num_blocks", "workers", "capacity")],
        "padding": v.get("padding"),
        "warnings": sorted({w["code"] for w in v.get("warnings", [])} & set(COMPARED_WARNINGS)),
    }
    return hashlib.sha256(json.dumps(core, sort_keys=True, default=str).encode()).hexdigest()[:16]


def summarize(outcomes: list[Outcome]) -> list[Json]:
    rows: dict[str, Json] = {}
    for o in outcomes:
        row = rows.setdefault(
            o.case.category,
            {"category": o.case.category, "total": 0, "agree": 0, "deviation": 0, "disagree": 0},
        )
        row["total"] += 1
        if o.status in ("agree", "deviation", "disagree"):
            row[o.status] += 1
    total = {"category": "overall", "total": 0, "agree": 0, "deviation": 0, "disagree": 0}
    for row in rows.values():
        for key in ("total", "agree", "deviation", "disagree"):
            total[key] += row[key]
    out = [*rows.values(), total]
    for row in out:
        n = row["total"] or 1
        row["agreement_pct"] = round(100.0 * (row["agree"] + row["deviation"]) / n, 2)
        row["strict_agree_pct"] = round(100.0 * row["agree"] / n, 2)
    return out


def refusal_reason(v: Json) -> str:
    """vLLM's refusal as "stage: Class: message head", numbers and quoted names
    replaced, so that refusals of one cause count together; "planned" when it planned."""
    if v.get("ok"):
        return "planned"
    error = v.get("error") or {}
    head = str(error.get("message", "")).split("\n")[0]
    head = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", head)
    head = re.sub(r"\d+(\.\d+)?", "N", head)[:110]
    return f"{error.get('stage', '?')}: {error.get('class', '?')}: {head}"


def refusal_breakdown(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Category -> vLLM's answer (planned, or a refusal reason) -> cases: how much of a
    section reaches the planning rules rather than a refusal (which compares only the
    error)."""
    table: dict[str, dict[str, int]] = {}
    for o in outcomes:
        if o.vllm is None:
            continue
        row = table.setdefault(o.case.category, {})
        reason = refusal_reason(o.vllm)
        row[reason] = row.get(reason, 0) + 1
    return {
        category: dict(sorted(row.items(), key=lambda item: -item[1]))
        for category, row in table.items()
    }


def render_markdown(summary: list[Json], outcomes: list[Outcome], meta: Json) -> str:
    lines = [
        f"# kvplan (rule set `{meta['rule_set']}`) vs vLLM {meta['vllm']}'s own planner",
        "",
        f"- cases: {meta['cases']} (seed {meta['seed']}); kvplan entry point: "
        f"`{meta['kvplan_entry'] or 'none (vLLM only)'}`; wall time {meta['seconds']:.1f} s",
        "- agreement % counts documented deviations as agreeing; strict % does not.",
        "",
        "| category | cases | agree | deviation | disagree | agreement % | strict % |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        name = f"**{row['category']}**" if row["category"] == "overall" else row["category"]
        lines.append(
            f"| {name} | {row['total']} | {row['agree']} | {row['deviation']} | "
            f"{row['disagree']} | {row['agreement_pct']:.2f} | {row['strict_agree_pct']:.2f} |"
        )
    disagreements = [o for o in outcomes if o.status == "disagree"]
    lines += ["", f"## Disagreements ({len(disagreements)})", ""]
    for o in disagreements:
        first = o.diffs[0]
        lines.append(f"### `{o.case.id}` — {o.case.description}")
        lines.append("")
        lines.append(f"- first differing field: `{first.path}`")
        lines.append(f"  - vLLM: `{json.dumps(_short(first.vllm, 300), default=str)}`")
        lines.append(f"  - kvplan: `{json.dumps(_short(first.kvplan, 300), default=str)}`")
        if len(o.diffs) > 1:
            more = ", ".join(f"`{d.path}`" for d in o.diffs[1:8])
            lines.append(f"- also: {more}{' ...' if len(o.diffs) > 8 else ''}")
        lines.append("")
    lines += ["## vLLM's answers: planned or refused, by reason", ""]
    lines += ["| category | planned | refused | top refusals |", "|---|---:|---:|---|"]
    for category, row in refusal_breakdown(outcomes).items():
        planned = row.get("planned", 0)
        refused = sum(row.values()) - planned
        # Whole entries only, up to about 600 characters (a cut one breaks the table).
        entries: list[str] = []
        for reason, n in row.items():
            if reason != "planned" and sum(len(e) + 2 for e in entries) < 600:
                entries.append(f"{n}× `{reason}`")
        lines.append(f"| {category} | {planned} | {refused} | {'; '.join(entries)} |")
    lines.append("")
    deviations = [o for o in outcomes if o.status == "deviation"]
    lines += [f"## Documented deviations ({len(deviations)})", ""]
    by_reason: dict[str, int] = {}
    for o in deviations:
        by_reason[o.reason] = by_reason.get(o.reason, 0) + 1
    lines += ["| deviation (docs/semantics.md) | cases |", "|---|---:|"]
    lines += [f"| {reason} | {count} |" for reason, count in sorted(by_reason.items())]
    lines.append("")
    for o in deviations:
        paths = ", ".join(f"`{d.path}`" for d in o.diffs[:4])
        lines.append(f"- `{o.case.id}`: {o.reason}; {paths}")
    info = [o for o in outcomes if o.info]
    lines += ["", f"## Informational differences ({len(info)} cases, not gating)", ""]
    for o in info[:60]:
        d = o.info[0]
        lines.append(
            f"- `{o.case.id}`: `{d.path}` vLLM `{json.dumps(_short(d.vllm, 160), default=str)}`"
            f" kvplan `{json.dumps(_short(d.kvplan, 160), default=str)}`"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from conformance.vllm_driver import ENGINE_VERSION, VLLM_VERSION

    parser = argparse.ArgumentParser(description="kvplan vs the installed vLLM release")
    parser.add_argument("--seed", type=int, default=20260)
    parser.add_argument("--only", action="append", default=[], help="id substring filter")
    parser.add_argument("--vllm-only", action="store_true", help="dump vLLM results only")
    parser.add_argument("--allow-disagreement", action="store_true")
    parser.add_argument("--no-scenarios", action="store_true", help="skip tests/ scenarios")
    parser.add_argument("--out-dir", type=Path, default=HERE / "reports")
    parser.add_argument(
        "--engine-version",
        default=ENGINE_VERSION,
        help="kvplan's rule set ('' = kvplan's own rules; default: the installed release)",
    )
    parser.add_argument("--verbose-json", action="store_true", help="full results in json")
    add_fuzz_argument(parser)
    add_split_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_split(args.stride, args.offset)
    except ValueError as error:
        parser.error(str(error))

    fuzz = fuzz_sections(args.fuzz)
    cases = generate_cases(args.seed, scenarios=not args.no_scenarios, fuzz=fuzz)
    if args.only:
        cases = [c for c in cases if any(s in c.id for s in args.only)]
    cases = split_cases(cases, args.stride, args.offset)
    fn, error_type, entry = (None, None, "") if args.vllm_only else load_kvplan()
    kv = (fn, error_type) if fn is not None and error_type is not None else None
    if kv is None and not args.vllm_only:
        print("kvplan's plan_from_proto is not importable: running vLLM only", file=sys.stderr)

    start = time.perf_counter()
    outcomes = [run_case(case, kv, args.engine_version) for case in cases]
    seconds = time.perf_counter() - start
    rule_set = args.engine_version or "kvplan"
    meta = {
        "cases": len(cases),
        "seed": args.seed,
        "fuzz": fuzz,
        "stride": args.stride,
        "offset": args.offset,
        "kvplan_entry": entry,
        "seconds": seconds,
        "vllm": VLLM_VERSION,
        "rule_set": rule_set,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)

    if kv is None:
        dump = {"meta": meta, "results": [{"id": o.case.id, **o.vllm} for o in outcomes]}
        path = args.out_dir / f"vllm-{VLLM_VERSION}-results.json"
        path.write_text(json.dumps(dump, indent=1, default=str) + "\n")
        errors = sum(1 for o in outcomes if not o.vllm["ok"])
        print(f"{len(outcomes)} cases planned with vLLM ({errors} raised) -> {path}")
        return 0

    summary = summarize(outcomes)
    report = {
        "meta": meta,
        "summary": summary,
        "vllm_digests": {o.case.id: vllm_digest(o.vllm) for o in outcomes},
        "vllm_answers": refusal_breakdown(outcomes),
        "outcomes": [
            o.to_json(args.verbose_json or o.status == "disagree")
            for o in outcomes
            if args.verbose_json or o.status != "agree" or o.info
        ],
    }
    stem = f"vllm-{VLLM_VERSION}-{rule_set}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    markdown = render_markdown(summary, outcomes, meta)
    (args.out_dir / f"{stem}.md").write_text(markdown)
    print(markdown.split("\n## Documented deviations")[0])
    disagreements = summary[-1]["disagree"]
    if disagreements and not args.allow_disagreement:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
