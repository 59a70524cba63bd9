"""Builds the conformance scenario files: `python -m tests.conformance.build`.

Each scenario is a PlanRequest in the proto JSON mapping plus the plan figures
the reference (kv-cache-planning.md, vLLM 0.33 semantics) predicts; the
`release-*` scenarios name an engine_version and pin that release's rules (each
is also planned by every vLLM release in `make conformance`). Expected
numbers are written as the reference's own arithmetic, never read back from
kvplan. tests/conformance/test_scenarios.py checks the files are current.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
SCENARIO_DIR = Path(__file__).parent / "scenarios"

Json = dict[str, Any]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def attention(heads: int = 8, head: int = 128, **extra: Any) -> Json:
    return {"num_kv_heads": heads, "head_size": head, **extra}


def full(heads: int = 8, head: int = 128, **extra: Any) -> Json:
    return {"full_attention": {"attention": attention(heads, head, **extra)}}


def sw(window: int, heads: int = 8, head: int = 128, **extra: Any) -> Json:
    return {
        "sliding_window": {"attention": attention(heads, head, **extra), "sliding_window": window}
    }


def chunked(chunk: int, heads: int = 8, head: int = 128) -> Json:
    return {
        "chunked_local_attention": {
            "attention": attention(heads, head),
            "attention_chunk_size": chunk,
        }
    }


def mla(head: int = 576, **mla_params: Any) -> Json:
    tokens_per_state = mla_params.pop("tokens_per_state", None)
    params: Json = {"num_kv_heads": 1, "head_size": head}
    if tokens_per_state:
        params["tokens_per_state"] = {"tokens": tokens_per_state}
    return {"mla_attention": {"attention": params, "mla": mla_params}}


def sw_mla(window: int, head: int = 576, tokens_per_state: int | None = None) -> Json:
    params: Json = {"num_kv_heads": 1, "head_size": head}
    if tokens_per_state:
        params["tokens_per_state"] = {"tokens": tokens_per_state}
    return {"sliding_window_mla": {"attention": params, "sliding_window": window}}


def mamba(states: list[tuple[list[int], str]], padded: int | None = None, **extra: Any) -> Json:
    spec: Json = {"states": [{"shape": shape, "dtype": dtype} for shape, dtype in states], **extra}
    if padded is not None:
        spec["page_size_padded_bytes"] = padded
    return {"mamba": spec}


def layer(name: str, kind: Json, **extra: Any) -> Json:
    return {"name": name, **kind, **extra}


def worker(rank: int, layers: list[Json], kv_bytes: int | None = None, **memory: Any) -> Json:
    out: Json = {"rank": rank, "layers": layers}
    if kv_bytes is not None:
        out["memory"] = {"kv_cache_memory_bytes": kv_bytes}
    else:
        out["memory"] = memory.pop("memory")
        if memory:
            out["device"] = memory.pop("device")
    return out


def request(workers: list[Json], *, spec_decode: Json | None = None, **options: Any) -> Json:
    options.setdefault("max_model_len", 8192)
    out: Json = {"engine_id": "conformance", "options": options, "workers": workers}
    if spec_decode:
        out["spec_decode"] = spec_decode
    return out


SCENARIOS: list[Json] = []


def scenario(name: str, reference: str, req: Json, expect: Json) -> None:
    SCENARIOS.append({"name": name, "reference": reference, "request": req, "expect": expect})


def llama_layers(count: int = 32, **extra: Any) -> list[Json]:
    return [layer(f"model.layers.{i}.self_attn.attn", full(**extra)) for i in range(count)]


LLAMA_PAGE = 8 * 16 * (128 + 128) * 2  # 65,536
LLAMA_BPB = 32 * LLAMA_PAGE

# --- §7.1-7.8: uniform attention, budgets, override, errors, auto-fit -----------
scenario(
    "llama-uniform-54gib",
    "§5.8, §7.1",
    request([worker(0, llama_layers(), 54 * GIB)]),
    {
        "grouping_path": "GROUPING_PATH_UNIFORM_SPEC",
        "groups": [{"layers": 32, "block_size": 16, "page_size_bytes": LLAMA_PAGE}],
        "num_blocks": 54 * GIB // LLAMA_BPB,
        "kv_cache_size_tokens": 27_648 * 16,
        "max_concurrency": 27_648 / 512,
        "workers": [
            {
                "bytes_per_block": LLAMA_BPB,
                "tensors": [
                    {
                        "layers": 32,
                        "offset_bytes": 0,
                        "layer_stride_bytes": LLAMA_PAGE * 27_648,
                        "block_stride_bytes": LLAMA_PAGE,
                        "size_bytes": 57_982_058_496,
                    }
                ],
            }
        ],
    },
)
scenario(
    "llama-fp8-cache",
    "§7.2",
    request([worker(0, llama_layers(), 54 * GIB)], cache_dtype="KV_CACHE_DTYPE_FP8"),
    {
        "groups": [{"layers": 32, "page_size_bytes": LLAMA_PAGE // 2}],
        "num_blocks": 55_296,
        "kv_cache_size_tokens": 884_736,
        "max_concurrency": 108.0,
    },
)
TOTAL_80 = 80 * GIB
NON_KV_18 = {"weights_bytes": 16 * GIB, "activation_peak_bytes": 2 * GIB}
for utilization, blocks, tokens in ((0.9, 27_648, 442_368), (0.92, 28_467, 455_472)):
    requested = math.ceil(TOTAL_80 * utilization)
    available = requested - 18 * GIB
    assert available // LLAMA_BPB == blocks
    scenario(
        f"llama-utilization-{utilization}",
        "§5.8, §7.3",
        request(
            [
                worker(
                    0,
                    llama_layers(),
                    memory={"gpu_memory_utilization": utilization, "non_kv": NON_KV_18},
                    device={"total_memory_bytes": TOTAL_80},
                )
            ]
        ),
        {
            "num_blocks": blocks,
            "kv_cache_size_tokens": tokens,
            "workers": [
                {
                    "budget": {
                        "mode": "BUDGET_MODE_UTILIZATION",
                        "requested_bytes": requested,
                        "non_kv_bytes": 18 * GIB,
                        "available_bytes": available,
                    }
                }
            ],
        },
    )
scenario(
    "llama-utilization-by-gpu-name",
    "§5.1: total memory from the device name table",
    request(
        [
            worker(
                0,
                llama_layers(),
                memory={"gpu_memory_utilization": 0.9, "non_kv": NON_KV_18},
                device={"name": "H100-80GB"},
            )
        ]
    ),
    {
        "grouping_path": "GROUPING_PATH_UNIFORM_SPEC",
        "workers": [{"budget": {"mode": "BUDGET_MODE_UTILIZATION", "non_kv_bytes": 18 * GIB}}],
    },
)
scenario(
    "llama-override-1000",
    "§7.4",
    request([worker(0, llama_layers(), 54 * GIB)], num_gpu_blocks_override=1000),
    {
        "num_blocks": 1000,
        "max_concurrency": 1000 / 512,
        "kv_cache_size_tokens": 16_000,
        "workers": [
            {
                "tensors": [{"size_bytes": 1000 * LLAMA_BPB}],
                "budget": {"mode": "BUDGET_MODE_BLOCKS_OVERRIDE"},
            }
        ],
    },
)
scenario(
    "llama-512mib-not-enough",
    "§7.5",
    request([worker(0, llama_layers(), 512 * MIB)]),
    {
        "error": {
            "code": "RESOURCE_EXHAUSTED",
            "contains": ["(8192)", "1.0 GiB", "0.5 GiB", "4080"],
        }
    },
)
scenario(
    "llama-override-100-not-enough",
    "§7.6",
    request([worker(0, llama_layers(), 54 * GIB)], num_gpu_blocks_override=100),
    {"error": {"code": "RESOURCE_EXHAUSTED", "contains": ["1.0 GiB", "0.19 GiB", "1584"]}},
)
scenario(
    "llama-no-memory",
    "§7.7",
    request([worker(0, llama_layers(), 0)]),
    {"error": {"code": "RESOURCE_EXHAUSTED", "contains": ["No available memory"]}},
)
scenario(
    "llama-auto-fit",
    "§7.8",
    request([worker(0, llama_layers(), 5 * GIB)], max_model_len=-1, derived_max_model_len=131_072),
    {
        "max_model_len": 40_944,
        "num_blocks": 2560,
        "kv_cache_size_tokens": 40_960,
        "max_concurrency": 2560 / cdiv(40_944, 16),
        "warnings": ["WARNING_CODE_MAX_MODEL_LEN_AUTO_FIT"],
    },
)
scenario(
    "auto-fit-full-context-fits",
    "§5.6: the derived length fits",
    request([worker(0, llama_layers(), 54 * GIB)], max_model_len=-1, derived_max_model_len=8192),
    {
        "max_model_len": 8192,
        "num_blocks": 27_648,
        "warnings_absent": ["WARNING_CODE_MAX_MODEL_LEN_AUTO_FIT"],
    },
)
scenario(
    "auto-fit-impossible",
    "§5.6: not even one token",
    request([worker(0, llama_layers(), LLAMA_BPB)], max_model_len=-1, derived_max_model_len=8192),
    {"error": {"code": "RESOURCE_EXHAUSTED", "contains": ["Cannot auto-fit"]}},
)
scenario(
    "startup-free-below-requested",
    "§7.33",
    request(
        [
            worker(
                0,
                llama_layers(),
                memory={"gpu_memory_utilization": 0.9},
                device={"total_memory_bytes": TOTAL_80, "free_memory_bytes": 70 * GIB},
            )
        ]
    ),
    {"error": {"code": "RESOURCE_EXHAUSTED", "contains": ["70.0/80.0 GiB", "72.0 GiB"]}},
)

# --- §7.9-7.15: hybrid grouping, padding, page-size unification -----------------
fss = [layer(f"model.layers.{i}.attn", full() if i % 3 == 0 else sw(4096)) for i in range(30)]
SW_4096_PAGES = cdiv(min(4096 - 1 + 8192, 32_768), 16) + 1  # 769
scenario(
    "full-sliding-1-2",
    "§3.8, §7.9",
    request([worker(0, fss, 54 * GIB)], max_model_len=32_768),
    {
        "grouping_path": "GROUPING_PATH_HYBRID",
        "groups": [{"layers": 10}, {"layers": 10}, {"layers": 10}],
        "group_layer_names": {"0": [f"model.layers.{i}.attn" for i in range(0, 30, 3)]},
        "num_blocks": 54 * GIB // (10 * LLAMA_PAGE),
        "blocks_per_request": 2048 + 2 * SW_4096_PAGES,
        "kv_cache_size_tokens": 808_444,
    },
)
scenario(
    "full-sliding-2gib-not-enough",
    "§7.10",
    request([worker(0, fss, 2 * GIB)], max_model_len=32_768),
    {"error": {"code": "RESOURCE_EXHAUSTED", "contains": ["2.19 GiB", "2.0 GiB", "27792"]}},
)
gpt_oss = [
    layer(
        f"model.layers.{i}.self_attn.attn",
        sw(128, heads=8, head=64) if i % 2 == 0 else full(heads=8, head=64),
    )
    for i in range(24)
] + [layer("drafter.layers.0.self_attn.attn", full(heads=8, head=64), is_draft=True)]
scenario(
    "gpt-oss-eagle3-padding",
    "§3.8 (12 SW + 13 F), §7.11, §7.29",
    request(
        [worker(0, gpt_oss, 20 * GIB)],
        max_model_len=32_768,
        spec_decode={"method": "SPEC_DECODE_METHOD_EAGLE3", "num_speculative_tokens": 3},
    ),
    {
        "groups": [
            {"layers": 12, "is_draft": False, "padding_layers": 1},
            {"layers": 13, "is_draft": True, "draft_rule": "DRAFT_RULE_IS_DRAFT"},
        ],
        "warnings": ["WARNING_CODE_PADDING_LAYERS"],
        "warning_text": ["1 padding layers", "8.33%"],
        "num_blocks": 20 * GIB // (13 * 8 * 16 * 128 * 2),
    },
)
f20_sw30 = [layer(f"f.{i}", full()) for i in range(20)] + [
    layer(f"s.{i}", sw(1024)) for i in range(30)
]
scenario(
    "full-20-then-sliding-30",
    "§3.8, §7.12",
    request([worker(0, f20_sw30, 54 * GIB)]),
    {
        "groups": [{"layers": 20}, {"layers": 15}, {"layers": 15}],
        "group_layer_names": {"1": [f"s.{i}" for i in range(0, 30, 2)]},
        "warning_text": ["10 padding layers", "33.33%"],
        "workers": [{"bytes_per_block": 20 * LLAMA_PAGE}],
        "num_blocks": 54 * GIB // (20 * LLAMA_PAGE),
    },
)
gemma = [
    layer(f"model.layers.{i}.self_attn.attn", full(16) if i % 6 == 5 else sw(1024, 16))
    for i in range(62)
]
scenario(
    "gemma-3-5-to-1",
    "§3.8, §7.13",
    request([worker(0, gemma, 40 * GIB)], max_model_len=131_072),
    {
        "groups": [{"layers": n} for n in (9, 9, 9, 9, 8, 8, 10)],
        "workers": [{"bytes_per_block": 10 * 16 * 16 * 256 * 2}],
        "num_blocks": 32_768,
        "blocks_per_request": 6 * (cdiv(1023 + 8192, 16) + 1) + 131_072 // 16,
        "kv_cache_size_tokens": 368_540,
        "warning_text": ["8 padding layers", "15.38%"],
    },
)
scenario(
    "unify-by-block-size",
    "§3.4, §7.14",
    request(
        [
            worker(
                0,
                [layer(f"f{i}", full()) for i in range(4)]
                + [layer(f"s{i}", sw(1024, 4)) for i in range(8)],
                8 * GIB,
            )
        ]
    ),
    {
        "grouping_path": "GROUPING_PATH_HYBRID",
        "page_sizes_unified": True,
        "groups": [
            {"layers": 4, "block_size": 16, "page_size_bytes": LLAMA_PAGE},
            {"layers": 4, "block_size": 32, "page_size_bytes": LLAMA_PAGE},
            {"layers": 4, "block_size": 32, "page_size_bytes": LLAMA_PAGE},
        ],
    },
)
scenario(
    "unify-by-padding",
    "§3.4, §7.15",
    request(
        [
            worker(
                0,
                [layer(f"f{i}", full(8, 96)) for i in range(3)]
                + [layer(f"s{i}", sw(1024, 8, 128)) for i in range(3)],
                8 * GIB,
            )
        ]
    ),
    {
        "groups": [
            {"layers": 3, "page_size_bytes": LLAMA_PAGE, "spec_padded_bytes": LLAMA_PAGE},
            {"layers": 3, "page_size_bytes": LLAMA_PAGE},
        ]
    },
)
scenario(
    "mla-sliding-full-allocation-fallback",
    "§3.6, §7.16",
    request(
        [
            worker(
                0,
                [
                    layer("mla.0", mla()),
                    layer("mla.1", mla()),
                    layer("sw.0", sw(1024, heads=1, head=384)),
                ],
                8 * GIB,
            )
        ],
    ),
    {
        "grouping_path": "GROUPING_PATH_FULL_ALLOCATION_FALLBACK",
        "groups": [{"layers": 3, "page_size_bytes": 2 * 16 * 576 * 2 + 16 * 768 * 2}],
        "warnings": ["WARNING_CODE_FULL_ALLOCATION_FALLBACK"],
    },
)
# The reference says MLA next to a full layer of 24,576 bytes cannot be unified;
# vLLM 0.33 groups them as one type (MLA is full attention's kind), and so does
# kvplan. A chunked-local layer is what really cannot be unified.
scenario(
    "mla-full-uniform-type",
    "§3.3, §7.16 (vLLM 0.33's actual behaviour)",
    request(
        [
            worker(
                0,
                [layer("mla.0", mla()), layer("mla.1", mla()), layer("full.0", full(1, 384))],
                GIB,
            )
        ]
    ),
    {
        "grouping_path": "GROUPING_PATH_UNIFORM_TYPE",
        "groups": [{"layers": 3, "page_size_bytes": 61_440}],
    },
)
scenario(
    "mla-chunked-not-unifiable",
    "§3.4 step 4, §3.6 (no fallback with chunked layers)",
    request(
        [
            worker(
                0,
                [
                    layer("mla.0", mla()),
                    layer("mla.1", mla()),
                    layer("chunk.0", chunked(8192, heads=1, head=384)),
                ],
                8 * GIB,
            )
        ],
    ),
    {"error": {"code": "FAILED_PRECONDITION", "contains": ["mla.0", "cannot be padded"]}},
)
mamba_65k = mamba([([2, 512], "DTYPE_FLOAT32"), ([3, 32, 32], "DTYPE_FLOAT32")], padded=65_536)
scenario(
    "mamba-padded-to-draft-page",
    "§3.4, §7.17",
    request(
        [
            worker(
                0,
                [layer(f"mamba.{i}", mamba_65k) for i in range(3)]
                + [layer("attn.0", full()), layer("draft.0", full(16), is_draft=True)],
                8 * GIB,
            )
        ],
        mamba_cache_mode="MAMBA_CACHE_MODE_ALIGN",
    ),
    {
        "groups": [{"layers": 1, "page_size_bytes": 131_072} for _ in range(5)],
        "group_block_sizes": {"3": 32, "4": 16},
    },
)
uniform_type = [
    layer("a", full()),
    layer("b", full()),
    layer("c", full(4)),
    layer("d", full(4)),
]
scenario(
    "uniform-type-lbnhc",
    "§3.3, §5.3, §7.18",
    request([worker(0, uniform_type, GIB)]),
    {
        "grouping_path": "GROUPING_PATH_UNIFORM_TYPE",
        "groups": [{"layers": 4, "page_size_bytes": 196_608, "uniform_type": True}],
        "num_blocks": GIB // 196_608,
        "workers": [
            {
                "tensors": [
                    {"offset_bytes": 0, "layer_stride_bytes": LLAMA_PAGE * 5461},
                    {"offset_bytes": 2 * LLAMA_PAGE * 5461, "layer_stride_bytes": 32_768 * 5461},
                ]
            }
        ],
    },
)
# The reference lists 10,922 blocks here; vLLM 0.33 itself gives 5,461 (one
# block holds all four pages), which is what kvplan reproduces.
scenario(
    "uniform-type-blhnc",
    "§5.3, §7.18 (vLLM 0.33's actual figures)",
    request([worker(0, uniform_type, GIB)], layout="KV_CACHE_LAYOUT_BLHNC"),
    {
        "num_blocks": 5461,
        "workers": [
            {
                "tensors": [
                    {
                        "offset_bytes": 0,
                        "layer_stride_bytes": LLAMA_PAGE,
                        "block_stride_bytes": 196_608,
                    },
                    {
                        "offset_bytes": 2 * LLAMA_PAGE,
                        "layer_stride_bytes": 32_768,
                        "block_stride_bytes": 196_608,
                    },
                ]
            }
        ],
    },
)
scenario(
    "uniform-type-lhbnc-layout-error",
    "§5.2, §7.18",
    request([worker(0, uniform_type, GIB)], layout="KV_CACHE_LAYOUT_LHBNC"),
    {"error": {"code": "FAILED_PRECONDITION", "contains": ["LHBNC", "BLHNC"]}},
)


# --- §3.5, §7.19: packed path --------------------------------------------------
def packed_layers(count: int) -> list[Json]:
    out: list[Json] = []
    for i in range(count):
        out.append(layer(f"model.layers.{i}.self_attn.swa", sw_mla(128, tokens_per_state=None)))
        out.append(
            layer(
                f"model.layers.{i}.self_attn.attn",
                mla(tokens_per_state=4 if i % 2 == 0 or i == 8 else 128),
                block_size=256,
            )
        )
    return out


def packed_request(count: int, spec_decode: Json | None = None, draft_last: bool = False) -> Json:
    layers = packed_layers(count)
    if draft_last:
        layers[-1]["is_draft"] = True
        layers[-2]["is_draft"] = True
    return request(
        [worker(0, layers, GIB)],
        layout="KV_CACHE_LAYOUT_BLHNC",
        block_size=64,
        spec_decode=spec_decode,
    )


SWA_PAGE = 64 * 576 * 2  # 73,728
scenario(
    "packed-blhnc",
    "§3.5 worked example, §7.19",
    packed_request(8),
    {
        "grouping_path": "GROUPING_PATH_PACKED",
        "groups": [{"layers": 4}, {"layers": 4}, {"layers": 8}],
        "workers": [{"bytes_per_block": 4 * SWA_PAGE + 4 * 2 * 576 * 2}],
        "num_blocks": GIB // (4 * SWA_PAGE + 4 * 2_304),
    },
)
MTP = {"method": "SPEC_DECODE_METHOD_MTP", "num_speculative_tokens": 1}
scenario(
    "packed-blhnc-mtp-trailing-rule",
    "§3.5 with the MTP layer, §4.2 [FORK] rule 2, §7.19",
    packed_request(9, MTP),
    {
        "groups": [
            {"layers": 5, "is_draft": False},
            {"layers": 4, "is_draft": False},
            {"layers": 9, "is_draft": True, "draft_rule": "DRAFT_RULE_TRAILING_LAYER"},
        ],
        "workers": [{"bytes_per_block": 5 * SWA_PAGE + 4 * 2_304}],
        "num_blocks": 2841,
    },
)
scenario(
    "packed-blhnc-mtp-is-draft",
    "§4.2 [0.33]: explicit is_draft first",
    packed_request(9, MTP, draft_last=True),
    {
        "groups": [
            {"layers": 5, "is_draft": True, "draft_rule": "DRAFT_RULE_IS_DRAFT"},
            {"layers": 4, "is_draft": False},
            {"layers": 9, "is_draft": True, "draft_rule": "DRAFT_RULE_IS_DRAFT"},
        ]
    },
)


# DeepSeek-V4-shaped packed specs whose last registered layer is layer 3's attention.
def dsv4_request(method: str, model_type: str) -> Json:
    layers = []
    for i in range(4):
        layers.append(layer(f"model.layers.{i}.self_attn.swa", sw_mla(128)))
        layers.append(
            layer(
                f"model.layers.{i}.self_attn.attn",
                mla(tokens_per_state=4 if i % 2 == 0 else 128),
                block_size=256,
            )
        )
    return request(
        [worker(0, layers, GIB)],
        layout="KV_CACHE_LAYOUT_BLHNC",
        block_size=64,
        spec_decode={
            "method": method,
            "num_speculative_tokens": 1,
            "target_model_type": model_type,
        },
    )


for row, (method, model_type) in enumerate(
    [
        ("SPEC_DECODE_METHOD_MTP", "deepseek_v4"),
        ("SPEC_DECODE_METHOD_DSPARK", "deepseek_v4"),
        ("SPEC_DECODE_METHOD_DSPARK", "deepseek_v41"),
        ("SPEC_DECODE_METHOD_MTP", "some_other_model"),
    ],
    start=1,
):
    scenario(
        f"seed-{row}-packed-{method.rsplit('_', 1)[-1].lower()}-{model_type}",
        f"§4.6 row {row}",
        dsv4_request(method, model_type),
        {
            "flagged_groups": 1,
            "flagged_contains": "model.layers.3.self_attn.attn",
            "draft_rule": "DRAFT_RULE_TRAILING_LAYER",
        },
    )

# --- §4.6 rows 5-8: the Qwen3.5 hybrid --------------------------------------------
qwen_mamba = mamba([([2, 512], "DTYPE_FLOAT32"), ([3, 32, 32], "DTYPE_FLOAT32")])
qwen_full = {"full_attention": {"attention": attention(2, 64, dtype="DTYPE_FLOAT32")}}
qwen_layers = []
for i in range(8):
    name = f"model.layers.{i}.self_attn.attn" if i in (3, 7) else f"model.layers.{i}.linear_attn"
    qwen_layers.append(layer(name, qwen_full if i in (3, 7) else qwen_mamba))
qwen_layers.append(layer("mtp.layers.0.self_attn.attn", qwen_full))


def qwen_request(method: str, is_draft: bool = False) -> Json:
    layers = [dict(entry) for entry in qwen_layers]
    if is_draft:
        layers[-1]["is_draft"] = True
    return request(
        [worker(0, layers, GIB)],
        mamba_cache_mode="MAMBA_CACHE_MODE_ALIGN",
        spec_decode={
            "method": method,
            "num_speculative_tokens": 1,
            "target_model_type": "qwen3_5",
        },
    )


scenario(
    "seed-5-qwen3_5-mtp-trailing",
    "§3.8 table, §4.6 row 5",
    qwen_request("SPEC_DECODE_METHOD_MTP"),
    {
        "groups": [
            {"layers": 3, "is_draft": False},
            {"layers": 3, "is_draft": False},
            {"layers": 3, "is_draft": True, "draft_rule": "DRAFT_RULE_TRAILING_LAYER"},
        ],
        "group_layer_names": {
            "0": [
                "model.layers.0.linear_attn",
                "model.layers.2.linear_attn",
                "model.layers.5.linear_attn",
            ],
            "1": [
                "model.layers.1.linear_attn",
                "model.layers.4.linear_attn",
                "model.layers.6.linear_attn",
            ],
            "2": [
                "model.layers.3.self_attn.attn",
                "model.layers.7.self_attn.attn",
                "mtp.layers.0.self_attn.attn",
            ],
        },
        "warnings_absent": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"],
    },
)
for row, method in ((6, "EAGLE"), (7, "EAGLE3"), (8, "DSPARK")):
    scenario(
        f"seed-{row}-qwen3_5-{method.lower()}-warns",
        f"§4.6 row {row}, §4.4",
        qwen_request(f"SPEC_DECODE_METHOD_{method}"),
        {
            "flagged_groups": 0,
            "warnings": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"],
            "warning_text": ["could be identified as the draft model's"],
        },
    )
scenario(
    "qwen3_5-eagle-is-draft",
    "§4.6: with is_draft on the MTP layer, G2 alone is flagged",
    qwen_request("SPEC_DECODE_METHOD_EAGLE", is_draft=True),
    {
        "flagged_groups": 1,
        "flagged_contains": "mtp.layers.0.self_attn.attn",
        "draft_rule": "DRAFT_RULE_IS_DRAFT",
        "warnings_absent": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"],
    },
)
scenario(
    "disable-eagle-block-drop",
    "§7.29: no flags, no warning",
    request(
        [worker(0, qwen_request("SPEC_DECODE_METHOD_EAGLE", True)["workers"][0]["layers"], GIB)],
        mamba_cache_mode="MAMBA_CACHE_MODE_ALIGN",
        spec_decode={
            "method": "SPEC_DECODE_METHOD_EAGLE",
            "num_speculative_tokens": 1,
            "disable_eagle_block_drop": True,
        },
    ),
    {"flagged_groups": 0, "warnings_absent": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"]},
)
scenario(
    "ngram-no-annotation",
    "§4.1: ngram is no EAGLE-family drafter",
    request(
        [worker(0, qwen_layers, GIB)],
        mamba_cache_mode="MAMBA_CACHE_MODE_ALIGN",
        spec_decode={"method": "SPEC_DECODE_METHOD_NGRAM", "num_speculative_tokens": 3},
    ),
    {
        "flagged_groups": 0,
        "warnings_absent": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA", "WARNING_CODE_NO_DRAFT_GROUP"],
    },
)

# --- §7.29: 0.33 annotation on the uniform paths ---------------------------------
scenario(
    "eagle-uniform-spec-is-draft",
    "§7.29",
    request(
        [worker(0, [*llama_layers(4), layer("draft.0", full(), is_draft=True)], GIB)],
        spec_decode={"method": "SPEC_DECODE_METHOD_EAGLE", "num_speculative_tokens": 2},
    ),
    {
        "grouping_path": "GROUPING_PATH_UNIFORM_SPEC",
        "flagged_groups": 1,
        "draft_rule": "DRAFT_RULE_IS_DRAFT",
    },
)
scenario(
    "eagle-uniform-type-is-draft",
    "§7.29",
    request(
        [worker(0, [*llama_layers(4), layer("draft.0", full(4), is_draft=True)], GIB)],
        spec_decode={"method": "SPEC_DECODE_METHOD_EAGLE", "num_speculative_tokens": 2},
    ),
    {"grouping_path": "GROUPING_PATH_UNIFORM_TYPE", "flagged_groups": 1},
)
scenario(
    "eagle3-hybrid-without-draft-warns",
    "§4.5: multi-group without Mamba, nothing identified",
    request(
        [
            worker(
                0,
                [*gpt_oss[:-1], layer("drafter.layers.0.self_attn.attn", full(heads=8, head=64))],
                20 * GIB,
            )
        ],
        max_model_len=32_768,
        spec_decode={"method": "SPEC_DECODE_METHOD_EAGLE3", "num_speculative_tokens": 3},
    ),
    {
        "flagged_groups": 0,
        "warnings": ["WARNING_CODE_NO_DRAFT_GROUP", "WARNING_CODE_PADDING_LAYERS"],
    },
)

# --- §3.7, §7.20: hybrid manager disabled ---------------------------------------
scenario(
    "disable-hybrid-full-plus-sliding",
    "§3.7, §7.20",
    request(
        [worker(0, [layer("f0", full()), layer("s0", sw(1024))], GIB)],
        disable_hybrid_kv_cache_manager=True,
    ),
    {
        "grouping_path": "GROUPING_PATH_UNIFORM_SPEC",
        "local_attention_promoted": True,
        "groups": [{"layers": 2, "spec_sliding_window": 1024}],
        "warnings": ["WARNING_CODE_HYBRID_MANAGER_DISABLED"],
    },
)
scenario(
    "disable-hybrid-three-kinds",
    "§3.7: full + SW + chunked -> one wrapper group",
    request(
        [worker(0, [layer("f0", full()), layer("s0", sw(1024)), layer("c0", chunked(8192))], GIB)],
        disable_hybrid_kv_cache_manager=True,
    ),
    {"grouping_path": "GROUPING_PATH_UNIFORM_TYPE", "groups": [{"layers": 3}]},
)
scenario(
    "disable-hybrid-two-windows",
    "§7.20",
    request(
        [worker(0, [layer("f0", full()), layer("s0", sw(1024)), layer("s1", sw(2048))], GIB)],
        disable_hybrid_kv_cache_manager=True,
    ),
    {"error": {"code": "FAILED_PRECONDITION", "contains": ["window"]}},
)
scenario(
    "disable-hybrid-mamba",
    "§7.20",
    request(
        [worker(0, [layer("m0", mamba_65k), layer("f0", full())], GIB)],
        disable_hybrid_kv_cache_manager=True,
        mamba_cache_mode="MAMBA_CACHE_MODE_ALIGN",
    ),
    {"error": {"code": "FAILED_PRECONDITION", "contains": ["Failed to promote"]}},
)

# --- §5.4, §7.21, §7.30: pipeline parallelism -----------------------------------
scenario(
    "pipeline-unequal-memory",
    "§5.4, §7.21",
    request(
        [
            worker(0, llama_layers(32)[:16], 20 * GIB),
            worker(1, llama_layers(32)[16:], 10 * GIB),
        ]
    ),
    {
        "num_blocks": 10 * GIB // (16 * LLAMA_PAGE),
        "max_concurrency": 20.0,
        "workers": [
            {"tensors": [{"size_bytes": 10 * GIB, "layer_stride_bytes": LLAMA_PAGE * 10_240}]},
            {"tensors": [{"size_bytes": 10 * GIB, "layer_stride_bytes": LLAMA_PAGE * 10_240}]},
        ],
    },
)
scenario(
    "pipeline-strided-groups",
    "§3.8 PP row",
    request(
        [
            worker(
                0, [layer("full.0", full()), layer("sw.0", sw(1024)), layer("sw.1", sw(1024))], GIB
            ),
            worker(
                1, [layer("full.1", full()), layer("sw.2", sw(1024)), layer("sw.3", sw(1024))], GIB
            ),
        ]
    ),
    {
        "group_layer_names": {
            "0": ["full.0", "full.1"],
            "1": ["sw.0", "sw.2"],
            "2": ["sw.1", "sw.3"],
        }
    },
)
scenario(
    "pipeline-projection-keeps-flags",
    "§4.3 [0.33], §7.30",
    request(
        [
            worker(0, [layer("L0", full()), layer("L1", sw(1024))], GIB),
            worker(
                1,
                [
                    layer("L2", full()),
                    layer("L3", sw(1024)),
                    layer("draft", sw(1024), is_draft=True),
                ],
                GIB,
            ),
        ],
        spec_decode=MTP,
    ),
    {
        "group_layer_names": {"0": ["L0", "L2"], "1": ["L1", "draft"], "2": ["L3"]},
        "groups": [{"is_draft": False}, {"is_draft": True}, {"is_draft": False}],
        "warning_text": ["1 padding layers", "33.33%"],
        "projected": {
            "0": [["L0"], ["L1"], []],
            "1": [["L2"], ["draft"], ["L3"]],
        },
        "projected_draft": {"0": [False, True, False], "1": [False, True, False]},
    },
)
scenario(
    "pipeline-conflicting-spec",
    "§3.1 step 1",
    request(
        [worker(0, [layer("shared", full())], GIB), worker(1, [layer("shared", full(4))], GIB)]
    ),
    {
        "error": {
            "code": "INVALID_ARGUMENT",
            "field": "workers[1].layers[0]",
            "contains": ["shared"],
        }
    },
)
scenario(
    "duplicate-rank",
    "request validation",
    request([worker(0, llama_layers(2), GIB), worker(0, llama_layers(2), GIB)]),
    {"error": {"code": "INVALID_ARGUMENT", "field": "workers[1].rank"}},
)

# --- §7.22-7.26: attention-free, hidden states, windows, Mamba, cross, DCP ---------
scenario(
    "attention-free",
    "§7.22",
    request([worker(0, [], GIB)], max_model_len=-1, derived_max_model_len=4096),
    {
        "grouping_path": "GROUPING_PATH_ATTENTION_FREE",
        "num_blocks": 1,
        "groups": [],
        "max_model_len": 4096,
    },
)


def hidden(heads: int, head: int) -> Json:
    return {"hidden_state_cache": {"attention": {"num_kv_heads": heads, "head_size": head}}}


scenario(
    "hidden-state-aligned",
    "§3.9, §7.23",
    request(
        [
            worker(
                0, [layer("f0", full()), layer("s0", sw(1024)), layer("h0", hidden(1, 12_288))], GIB
            )
        ]
    ),
    {
        "groups": [
            {"layers": 1},
            {"layers": 1},
            {"layers": 1, "block_size": 2, "page_size_bytes": LLAMA_PAGE},
        ]
    },
)
scenario(
    "hidden-state-scales-groups",
    "§3.9, §7.23",
    request(
        [
            worker(
                0,
                [layer("f0", full(1)), layer("s0", sw(1024, 1)), layer("h0", hidden(1, 49_152))],
                GIB,
            )
        ]
    ),
    {
        "groups": [
            {"block_size": 192, "page_size_bytes": 98_304},
            {"block_size": 192, "page_size_bytes": 98_304},
            {"block_size": 1, "page_size_bytes": 98_304},
        ]
    },
)
one_sw = [layer("sw", sw(4096))]
window_cases: list[tuple[str, Json, int]] = [
    ("plain", {"max_num_batched_tokens": 2048, "max_model_len": 32_768}, 385),
    (
        "async",
        {"max_num_batched_tokens": 2048, "max_model_len": 32_768, "async_scheduling": True},
        513,
    ),
    ("short", {"max_num_batched_tokens": 2048, "max_model_len": 1000}, 64),
]
for label, options, pages in window_cases:
    scenario(
        f"sliding-window-pages-{label}",
        "§2.3, §7.24",
        request([worker(0, one_sw, GIB)], **options),
        {"blocks_per_request": pages},
    )
scenario(
    "sliding-window-retained-tokens-multi-mtp",
    "§2.3 extra_retained_tokens, §7.24",
    request(
        [worker(0, one_sw, GIB)],
        max_num_batched_tokens=2048,
        max_model_len=32_768,
        spec_decode={
            "method": "SPEC_DECODE_METHOD_MTP",
            "num_speculative_tokens": 3,
            "num_nextn_predict_layers": 3,
        },
    ),
    {"blocks_per_request": 386},
)
for label, max_len, pages in (("long", 32_768, 640), ("short", 1000, 63)):
    scenario(
        f"chunked-local-pages-{label}",
        "§2.3, §7.24",
        request(
            [worker(0, [layer("c", chunked(8192))], GIB)],
            max_num_batched_tokens=2048,
            max_model_len=max_len,
        ),
        {"blocks_per_request": pages},
    )
mamba_38k = mamba(
    [([3, 1024], "DTYPE_BFLOAT16"), ([4, 64, 64], "DTYPE_BFLOAT16")], num_speculative_blocks=2
)
for mode, pages in (("MAMBA_CACHE_MODE_ALIGN", 4), ("MAMBA_CACHE_MODE_NONE", 3)):
    scenario(
        f"mamba-pages-{mode.rsplit('_', 1)[-1].lower()}",
        "§2.4, §7.25",
        # A Mamba-only model defaults to no prefix caching, and vLLM sets the mode
        # from prefix caching: each mode is asked for the way an engine gets it.
        request(
            [worker(0, [layer("m", mamba_38k)], GIB)],
            mamba_cache_mode=mode,
            enable_prefix_caching=mode == "MAMBA_CACHE_MODE_ALIGN",
        ),
        {"blocks_per_request": pages, "groups": [{"page_size_bytes": 38_912}]},
    )
scenario(
    "cross-attention",
    "§2.3, §7.26",
    request(
        [
            worker(
                0,
                [
                    layer(
                        "cross",
                        {"cross_attention": {"attention": attention(8, 64, dtype="DTYPE_FLOAT16")}},
                    ),
                    layer("enc", {"encoder_only_attention": {"attention": attention(8, 64)}}),
                ],
                GIB,
            )
        ],
        max_num_encoder_input_tokens=1500,
    ),
    {
        "blocks_per_request": 94,
        "groups": [{"layers": 1, "page_size_bytes": 32_768}],
        "workers": [{"encoder_only_layers": ["enc"]}],
    },
)
scenario(
    "dcp-full-attention",
    "§2.3, §7.26",
    request(
        [worker(0, llama_layers(2), GIB)],
        # DCP shards over TP ranks: 4 ranks (this one worker stands for each).
        parallel={"tensor_parallel_size": 4, "decode_context_parallel_size": 4},
    ),
    {"blocks_per_request": 128},
)
scenario(
    "dcp-sliding-window-error",
    "§6: DCP does not support sliding window",
    request(
        [worker(0, [layer("f", full()), layer("s", sw(1024))], GIB)],
        parallel={"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    ),
    {"error": {"code": "FAILED_PRECONDITION", "contains": ["decode context parallel"]}},
)
scenario(
    "gdn-hybrid-align",
    "§2.4 alignment example, §7.27",
    request(
        [
            worker(
                0,
                [
                    layer(
                        f"model.layers.{i}",
                        {"full_attention": {"attention": attention(2, 256)}}
                        if i % 4 == 3
                        else mamba(
                            [([3, 2048], "DTYPE_BFLOAT16"), ([8, 128, 128], "DTYPE_FLOAT32")],
                            padded=557_056,
                            mamba_type="MAMBA_TYPE_GDN_ATTENTION",
                        ),
                        block_size=272,
                    )
                    for i in range(48)
                ],
                40 * GIB,
            )
        ],
        max_model_len=32_768,
        mamba_cache_mode="MAMBA_CACHE_MODE_ALIGN",
    ),
    {
        "groups": [{"layers": 12} for _ in range(4)],
        "workers": [
            {
                "bytes_per_block": 12 * 557_056,
                "budget": {"needed_per_request_bytes": 848_953_344},
            }
        ],
        "num_blocks": 6425,
        "blocks_per_request": 3 * 2 + cdiv(32_768, 272),
        "kv_cache_size_tokens": 1_657_751,
    },
)
scenario(
    "invalid-head-count",
    "request validation: field path",
    request([worker(0, [layer("bad", full(0))], GIB)]),
    {
        "error": {
            "code": "INVALID_ARGUMENT",
            "field": "workers[0].layers[0].full_attention.attention.num_kv_heads",
        }
    },
)


# --- engine releases: the same engine under each rule set (options.engine_version) ---
def for_release(req: Json, engine_version: str) -> Json:
    out: Json = json.loads(json.dumps(req))
    out["options"]["engine_version"] = engine_version
    return out


scenario(
    "release-0.32-qwen3_5-mtp-trailing",
    "vLLM 0.32 (PR #55390): MTP without is_draft flags the last layer's group",
    for_release(qwen_request("SPEC_DECODE_METHOD_MTP"), "vllm-0.32"),
    {
        "rule_set": "vllm-0.32",
        "flagged_groups": 1,
        "flagged_contains": "mtp.layers.0.self_attn.attn",
        "draft_rule": "DRAFT_RULE_TRAILING_LAYER",
        "warnings_absent": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"],
    },
)
scenario(
    "release-0.33-qwen3_5-mtp-unflagged",
    "vLLM 0.33: only is_draft flags; an unflagged Mamba group warns",
    for_release(qwen_request("SPEC_DECODE_METHOD_MTP"), "vllm-0.33"),
    {
        "rule_set": "vllm-0.33",
        "flagged_groups": 0,
        "warnings": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"],
    },
)
scenario(
    "release-0.33-qwen3_5-dspark-is-draft-not-flagged",
    "vLLM 0.33: DSpark needs no block drop, so is_draft flags nothing and nothing warns",
    for_release(qwen_request("SPEC_DECODE_METHOD_DSPARK", is_draft=True), "vllm-0.33"),
    {
        "flagged_groups": 0,
        "warnings_absent": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA", "WARNING_CODE_NO_DRAFT_GROUP"],
    },
)
scenario(
    "release-0.32-qwen3_5-dspark-warns",
    "vLLM 0.32: DSpark passes the gate; no marker, no trailing rule, so it warns",
    for_release(qwen_request("SPEC_DECODE_METHOD_DSPARK"), "vllm-0.32"),
    {"flagged_groups": 0, "warnings": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"]},
)
scenario(
    "release-0.32-is-draft-rejected",
    "vLLM 0.32 has no is_draft field: INVALID_ARGUMENT with the field path",
    for_release(qwen_request("SPEC_DECODE_METHOD_EAGLE", is_draft=True), "vllm-0.32"),
    {
        "error": {
            "code": "INVALID_ARGUMENT",
            "field": "workers[0].layers[8].is_draft",
            "contains": ["vLLM 0.32.0"],
        }
    },
)
_DISABLED_DROP = request(
    [worker(0, qwen_layers, GIB)],
    mamba_cache_mode="MAMBA_CACHE_MODE_ALIGN",
    spec_decode={
        "method": "SPEC_DECODE_METHOD_EAGLE",
        "num_speculative_tokens": 1,
        "disable_eagle_block_drop": True,
    },
)
scenario(
    "release-0.32-disabled-drop-still-warns",
    "vLLM 0.32 warns on use_eagle(), even with the block drop disabled",
    for_release(_DISABLED_DROP, "vllm-0.32"),
    {"flagged_groups": 0, "warnings": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"]},
)
scenario(
    "release-0.33-disabled-drop-no-warning",
    "vLLM 0.33 warns only when the block drop applies",
    for_release(_DISABLED_DROP, "vllm-0.33"),
    {"flagged_groups": 0, "warnings_absent": ["WARNING_CODE_NO_DRAFT_GROUP_MAMBA"]},
)


def marked_hybrid_request() -> Json:
    """Hybrid MLA + sliding-window engine, MTP; the first MLA layer carries the spec
    marker and the last registered layer is a sliding-window one."""
    marked = mla(512)
    marked["mla_attention"]["non_causal_multi_token_decode"] = True
    layers = [
        layer("mla.0", marked),
        layer("mla.1", mla(512)),
        layer("sw.0", sw(1024)),
        layer("sw.1", sw(1024)),
    ]
    return request([worker(0, layers, GIB)], spec_decode=MTP)


scenario(
    "release-0.32-marker-and-trailing",
    "vLLM 0.32 applies the spec marker and the trailing-layer rule together",
    for_release(marked_hybrid_request(), "vllm-0.32"),
    {
        "grouping_path": "GROUPING_PATH_HYBRID",
        "groups": [
            {"layers": 2, "is_draft": True, "draft_rule": "DRAFT_RULE_SPEC_MARKER"},
            {"layers": 2, "is_draft": True, "draft_rule": "DRAFT_RULE_TRAILING_LAYER"},
        ],
    },
)
scenario(
    "release-kvplan-marker-first",
    "kvplan's own rules: the spec marker decides, the trailing rule is not consulted",
    marked_hybrid_request(),
    {
        "rule_set": "kvplan",
        "groups": [
            {"layers": 2, "is_draft": True, "draft_rule": "DRAFT_RULE_SPEC_MARKER"},
            {"layers": 2, "is_draft": False},
        ],
    },
)

# Two stages: full attention on stage 0, sliding window on stage 1; the last
# registered layer (stage 1's) puts the sliding-window group under the drop.
_STAGES = request(
    [
        worker(0, [layer(f"model.layers.{i}.attn", full()) for i in range(2)], GIB),
        worker(1, [layer(f"model.layers.{i}.attn", sw(1024)) for i in range(2, 4)], GIB),
    ],
    parallel={"pipeline_parallel_size": 2},
    spec_decode=MTP,
)
scenario(
    "release-0.32-pp-flag-dropped-off-stage",
    "vLLM 0.32: a stage holding none of a draft group's layers sees it unflagged",
    for_release(_STAGES, "vllm-0.32"),
    {
        "flagged_groups": 1,
        "flagged_contains": "model.layers.3.attn",
        "projected_draft": {"0": [False, False], "1": [False, True]},
    },
)
_STAGES_MARKED: Json = json.loads(json.dumps(_STAGES))
_STAGES_MARKED["workers"][1]["layers"][1]["is_draft"] = True
scenario(
    "release-0.33-pp-flag-kept-off-stage",
    "vLLM 0.33: the flag survives on a stage holding none of the group's layers",
    for_release(_STAGES_MARKED, "vllm-0.33"),
    {"flagged_groups": 1, "projected_draft": {"0": [False, True], "1": [False, True]}},
)

# Mixed pages on a layout that cannot express them, and far too little memory.
_MISLAID_AND_SHORT = request(
    [worker(0, [layer("a", full()), layer("b", full(4))], 1 * MIB)],
    layout="KV_CACHE_LAYOUT_LHBNC",
)
scenario(
    "release-0.32-memory-checked-before-layout",
    "vLLM 0.32 validates the layout after the memory checks",
    for_release(_MISLAID_AND_SHORT, "vllm-0.32"),
    {"error": {"code": "RESOURCE_EXHAUSTED"}},
)
scenario(
    "release-0.33-layout-checked-first",
    "vLLM 0.33 validates the layout before the memory checks",
    for_release(_MISLAID_AND_SHORT, "vllm-0.33"),
    {"error": {"code": "FAILED_PRECONDITION", "contains": ["LHBNC"]}},
)

scenario(
    "release-0.34-default-block-size-64",
    "vLLM 0.34: CacheConfig.DEFAULT_BLOCK_SIZE is 64",
    for_release(request([worker(0, llama_layers(), 54 * GIB)]), "vllm-0.34"),
    {
        "rule_set": "vllm-0.34",
        "groups": [{"layers": 32, "block_size": 64}],
        "num_blocks": 54 * GIB // (4 * LLAMA_BPB),
    },
)
# MLA pages of 16,384 bytes next to sliding-window MLA pages of 18,432 bytes: the
# smaller does not divide the larger and MLA pages cannot be padded.
_MLA_SW_MLA = request(
    [worker(0, [layer("mla.0", mla(512)), layer("swmla.0", sw_mla(256))], GIB)],
    block_size=16,
)
scenario(
    "release-0.33-sw-mla-no-fallback",
    "vLLM 0.33: the full-allocation fallback refuses sliding-window MLA",
    for_release(_MLA_SW_MLA, "vllm-0.33"),
    {"error": {"code": "FAILED_PRECONDITION"}},
)
scenario(
    "release-0.34-sw-mla-fallback",
    "vLLM 0.34: the fallback admits sliding-window MLA (one uniform-type group)",
    for_release(_MLA_SW_MLA, "vllm-0.34"),
    {
        "grouping_path": "GROUPING_PATH_FULL_ALLOCATION_FALLBACK",
        "groups": [{"layers": 2, "uniform_type": True}],
        "warnings": ["WARNING_CODE_FULL_ALLOCATION_FALLBACK"],
        "workers": [{"bytes_per_block": 16 * 512 * 2 + 16 * 576 * 2}],
    },
)
_MLA_SW_MLA_NO_HYBRID = for_release(_MLA_SW_MLA, "vllm-0.34")
_MLA_SW_MLA_NO_HYBRID["options"]["disable_hybrid_kv_cache_manager"] = True
scenario(
    "release-0.34-sw-mla-promoted",
    "vLLM 0.34: promotion drops bounded_replay, so SW-MLA becomes MLA",
    _MLA_SW_MLA_NO_HYBRID,
    {
        "local_attention_promoted": True,
        "groups": [{"layers": 2, "uniform_type": True}],
        "warnings": ["WARNING_CODE_HYBRID_MANAGER_DISABLED"],
    },
)
scenario(
    "release-0.33-sw-mla-promotion-fails",
    "vLLM 0.33: promoting SW-MLA fails (its bounded_replay has no MLA counterpart)",
    for_release(_MLA_SW_MLA_NO_HYBRID, "vllm-0.33"),
    {"error": {"code": "FAILED_PRECONDITION"}},
)


def sw_mla_quant_request(engine_version: str) -> Json:
    layers = [layer(f"swmla.{i}", sw_mla(256)) for i in range(2)]
    layers[1]["sliding_window_mla"]["attention"]["kv_quant_mode"] = "KV_QUANT_MODE_FP8_PER_TENSOR"
    return for_release(request([worker(0, layers, GIB)]), engine_version)


scenario(
    "release-0.33-sw-mla-merge-ignores-quant-mode",
    "vLLM 0.33: sliding-window MLA layers of two quant modes merge into one spec",
    sw_mla_quant_request("vllm-0.33"),
    {"grouping_path": "GROUPING_PATH_UNIFORM_SPEC", "groups": [{"uniform_type": False}]},
)
scenario(
    "release-0.34-sw-mla-merge-needs-one-quant-mode",
    "vLLM 0.34: sliding-window MLA merges need one KV quant mode (uniform type instead)",
    sw_mla_quant_request("vllm-0.34"),
    {"grouping_path": "GROUPING_PATH_UNIFORM_TYPE", "groups": [{"uniform_type": True}]},
)


def async_pp_request(engine_version: str) -> Json:
    layers = [layer(f"l.{i}", full() if i % 2 else sw(4096)) for i in range(4)]
    req = request(
        [worker(0, layers, GIB)],
        max_model_len=65_536,
        block_size=16,
        async_scheduling=True,
        parallel={"pipeline_parallel_size": 2},
    )
    return for_release(req, engine_version)


# One sliding-window block table row: the window plus every in-flight batch's tokens.
SW_PAGE = LLAMA_PAGE
for version, batches in (("vllm-0.33", 3), ("vllm-0.34", 3)):
    scenario(
        f"release-{version.removeprefix('vllm-')}-async-pp-in-flight",
        f"{version}: async scheduling with pp=2 keeps {batches} batches in flight "
        "(model runner V2, 0.33's default and 0.34's only runner: pp + 1; 0.33's V1 "
        "refuses pp > 1 with async scheduling)",
        async_pp_request(version),
        {
            "blocks_per_request": cdiv(65_536, 16)
            + cdiv(min(4095 + batches * 8192, 65_536), 16)
            + 1,
        },
    )

# One uniform-type group over two stages: stage 0 mixes bfloat16 and fp8 pages,
# stage 1 holds bfloat16 only. 0.33 zeroes new blocks where the precisions mix
# (stage 0), 0.34 on every stage.
_ZEROING = request(
    [
        worker(
            0,
            [
                layer("attn.0", full()),
                layer(
                    "attn.1",
                    full(dtype="DTYPE_UINT8", kv_quant_mode="KV_QUANT_MODE_FP8_PER_TENSOR"),
                ),
            ],
            GIB,
        ),
        worker(1, [layer(f"attn.{i}", full()) for i in (2, 3)], GIB),
    ],
    parallel={"pipeline_parallel_size": 2},
)
for version, stage_1 in (("vllm-0.33", False), ("vllm-0.34", True)):
    scenario(
        f"release-{version.removeprefix('vllm-')}-kv-cache-zeroing",
        f"{version}: KV-cache zeroing per worker (0.33) or OR-ed across workers (0.34)",
        for_release(_ZEROING, version),
        {
            "grouping_path": "GROUPING_PATH_UNIFORM_TYPE",
            "workers": [
                {"needs_kv_cache_zeroing": True},
                {"needs_kv_cache_zeroing": stage_1},
            ],
        },
    )


# --- HiSparse (every release): host source, indexer, resident and hot groups -------
def hisparse_layers() -> list[Json]:
    """Four sparse-MLA layers (index-group leaders 0 and 2), two indexer layers,
    and the hot / resident entries the model runner derives."""
    out: list[Json] = []
    for i in range(4):
        spec = mla(656)
        spec["mla_attention"]["attention"]["dtype"] = "DTYPE_UINT8"
        spec["mla_attention"]["is_index_group_leader"] = i % 2 == 0
        out.append(layer(f"layers.{i}.attn", spec))
    for i in range(2):
        spec = mla(132)
        spec["mla_attention"]["attention"]["dtype"] = "DTYPE_UINT8"
        spec["mla_attention"]["cache_role"] = "SPARSE_CACHE_ROLE_INDEXER"
        out.append(layer(f"layers.{i}.indexer", spec))
    for i in range(4):
        page = {"page_size_bytes": 64 * 656}
        out.append(layer(f"layers.{i}.attn.hisparse_resident", {"hisparse_resident": page}))
        out.append(
            layer(
                f"layers.{i}.attn.hisparse_hot",
                {"hisparse_hot": {**page, "blocks_per_request": 1}},
            )
        )
    return out


def hisparse_request(host_pool_gib: float, **options: Any) -> Json:
    options.setdefault("layout", "KV_CACHE_LAYOUT_BLHNC")
    return request(
        [worker(0, hisparse_layers(), 4 * GIB)],
        block_size=64,
        hisparse={"host_pool_gib": host_pool_gib, "index_topk": 2048},
        **options,
    )


SPARSE_PAGE = 64 * 656  # 41,984
HOT_BPB = 2 * SPARSE_PAGE  # a hot / resident group holds one index unit (2 layers)
HOST_PAGE = 4 * SPARSE_PAGE
# Indexer 128 + two resident groups x 128 + two hot groups x 4096 rows / 64.
DEVICE_BLOCKS = 128 + 2 * 128 + 2 * (2 * 2048 // 64)
scenario(
    "hisparse-groups-and-host-pool",
    "HiSparse: source (host), indexer, resident and hot groups; host-bounded capacity",
    hisparse_request(4.0),
    {
        "grouping_path": "GROUPING_PATH_HISPARSE",
        "groups": [
            {"layers": 4, "host_resident": True, "uniform_type": True},
            {"layers": 2, "host_resident": False},
            {"layers": 2, "page_size_bytes": SPARSE_PAGE},
            {"layers": 2, "page_size_bytes": SPARSE_PAGE},
            {"layers": 2, "block_size": 64},
            {"layers": 2, "block_size": 64},
        ],
        "group_layer_names": {
            "2": ["layers.0.attn.hisparse_resident", "layers.1.attn.hisparse_resident"],
            "5": ["layers.2.attn.hisparse_hot", "layers.3.attn.hisparse_hot"],
        },
        "num_blocks": 4 * GIB // HOT_BPB,
        "hisparse_host_num_blocks": 4 * GIB // HOST_PAGE,
        "workers": [{"bytes_per_block": HOT_BPB}],
        "blocks_per_request": DEVICE_BLOCKS,
        "max_concurrency": min(
            (4 * GIB // HOT_BPB) / DEVICE_BLOCKS, (4 * GIB // HOST_PAGE) / cdiv(8192, 64)
        ),
    },
)
scenario(
    "hisparse-host-pool-too-small",
    "HiSparse: the host pool must hold one max_model_len request (+ 2 blocks)",
    hisparse_request(0.01, max_model_len=131_072),
    {"error": {"code": "RESOURCE_EXHAUSTED", "field": "options.hisparse.host_pool_gib"}},
)
scenario(
    "hisparse-auto-fit-bounded-by-host-pool",
    "HiSparse: auto-fit stops where the host pool ends",
    hisparse_request(0.25, max_model_len=-1, derived_max_model_len=1_048_576),
    # 0.25 GiB / 167,936 bytes = 1,598 host blocks: (1,598 - 2) x 64 tokens.
    {"max_model_len": (GIB // 4 // HOST_PAGE - 2) * 64},
)


# --- the engine's layout from the workers' supported layouts --------------------------


def _layouts(*names: str) -> list[str]:
    return [f"KV_CACHE_LAYOUT_{name}" for name in names]


NO_PREFERENCE = _layouts("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")


def staged_request(lists: list[list[str]], **options: Any) -> Json:
    """Pipeline stages of 4 full-attention layers each, each stage reporting a list."""
    workers = [
        worker(rank, [layer(f"stage{rank}.{i}.attn", full()) for i in range(4)], 2 * GIB)
        for rank in range(len(lists))
    ]
    for stage, names in zip(workers, lists, strict=True):
        stage["supported_layouts"] = names
    options.setdefault("parallel", {"pipeline_parallel_size": len(lists)})
    return request(workers, **options)


_TIE = [_layouts("LBHNC", "LBNHC"), _layouts("LBNHC", "LBHNC")]
for version in ("vllm-0.32", "vllm-0.33"):
    scenario(
        f"release-{version.removeprefix('vllm-')}-layout-lists-must-match",
        f"{version}: the engine core asserts every worker reports the same layouts",
        for_release(staged_request(_TIE), version),
        {"error": {"code": "FAILED_PRECONDITION", "contains": ["different KV cache layouts"]}},
    )
for version in ("vllm-0.34", ""):
    scenario(
        f"release-{version.removeprefix('vllm-') or 'kvplan'}-layout-tie-in-enum-order",
        f"{version or 'kvplan'}: one first choice each; the tie goes to vLLM's enum order",
        for_release(staged_request(_TIE), version),
        {"layout": "LBHNC", "layout_candidates": ["LBHNC", "LBNHC"]},
    )
scenario(
    "release-0.33-layout-equal-lists-keep-their-order",
    "vLLM 0.33: equal lists, the first entry wins",
    for_release(staged_request([_layouts("BLHNC", "LBNHC")] * 2), "vllm-0.33"),
    {"layout": "BLHNC", "layout_candidates": ["BLHNC", "LBNHC"]},
)
scenario(
    "release-0.34-layout-most-first-choices",
    "vLLM 0.34: the layout most workers put first leads",
    for_release(
        staged_request(
            [_layouts("BLHNC", "LBHNC"), _layouts("LBHNC", "BLHNC"), _layouts("LBHNC", "BLHNC")]
        ),
        "vllm-0.34",
    ),
    {
        "layout": "LBHNC",
        "layout_candidates": ["LBHNC", "BLHNC"],
        "num_blocks": 2 * GIB // (4 * 4 * LLAMA_PAGE),
    },
)
scenario(
    "release-0.34-layout-no-shared-layout",
    "vLLM 0.34: no layout in every worker's list",
    for_release(staged_request([_layouts("LBHNC"), _layouts("LBNHC")]), "vllm-0.34"),
    {"error": {"code": "FAILED_PRECONDITION", "contains": ["no KV cache layout"]}},
)
scenario(
    "release-0.34-layout-default-list-does-not-vote",
    "vLLM 0.34: a worker reporting the no-preference default does not vote",
    for_release(staged_request([NO_PREFERENCE, _layouts("LHBNC", "LBHNC")]), "vllm-0.34"),
    {"layout": "LHBNC", "layout_candidates": ["LHBNC", "LBHNC"]},
)
scenario(
    "release-0.33-layout-asked-for-must-be-supported",
    "vLLM 0.33: the asked-for layout (VLLM_KV_CACHE_LAYOUT) must be a candidate",
    for_release(
        staged_request([_layouts("LBHNC", "LBNHC")] * 2, layout="KV_CACHE_LAYOUT_BLHNC"),
        "vllm-0.33",
    ),
    {"error": {"code": "INVALID_ARGUMENT", "field": "options.layout"}},
)
scenario(
    "release-0.34-layout-asked-for-wins",
    "vLLM 0.34: a supported asked-for layout wins over the first candidate",
    for_release(
        staged_request([_layouts("LBHNC", "LBNHC")] * 2, layout="KV_CACHE_LAYOUT_LBNHC"),
        "vllm-0.34",
    ),
    {"layout": "LBNHC", "layout_candidates": ["LBHNC", "LBNHC"]},
)
_MIXED_HEADS = request(
    [worker(0, [layer("a.0", full()), layer("b.0", full(4))], GIB)],
)
_MIXED_HEADS["workers"][0]["supported_layouts"] = _layouts("LHBNC", "BHLNC", "LBHNC")
for version in ("vllm-0.32", "vllm-0.33", "vllm-0.34"):
    scenario(
        f"release-{version.removeprefix('vllm-')}-layout-mixed-shapes-block-compact",
        f"{version}: layers of different head counts keep only block-compact layouts",
        for_release(_MIXED_HEADS, version),
        {
            "layout": "LBHNC",
            "layout_candidates": ["LBHNC"],
            "grouping_path": "GROUPING_PATH_UNIFORM_TYPE",
        },
    )

for version in ("vllm-0.33", "vllm-0.34"):
    for names, chosen in ((("BLNHC", "BLHNC"), "BLHNC"), (("BLNHC", "LBHNC"), "BLNHC")):
        _connector = for_release(hisparse_request(4.0), version)
        del _connector["options"]["layout"]
        _connector["workers"][0]["supported_layouts"] = _layouts(*names)
        scenario(
            f"release-{version.removeprefix('vllm-')}-layout-hisparse-connector-{chosen.lower()}",
            f"{version}: HiSparse's connector asks for BLHNC, taken when the workers "
            f"support it ({', '.join(names)})",
            _connector,
            {"layout": chosen, "grouping_path": "GROUPING_PATH_HISPARSE"},
        )

# Speculative settings SpeculativeConfig / VllmConfig refuse before any worker starts.
_DRAFTED = [worker(0, llama_layers(4), GIB)]


def _spec(method: str, tokens: int, **extra: Any) -> Json:
    return {
        "method": f"SPEC_DECODE_METHOD_{method.upper()}",
        "num_speculative_tokens": tokens,
        **extra,
    }


scenario(
    "spec-mtp-tokens-not-whole-module-rounds",
    "SpeculativeConfig: 3 draft tokens over 2 MTP modules (not a multiple) are refused",
    request(_DRAFTED, spec_decode=_spec("mtp", 3, num_nextn_predict_layers=2)),
    {"error": {"code": "INVALID_ARGUMENT", "field": "spec_decode.num_speculative_tokens"}},
)
scenario(
    "spec-mtp-deepseek-v41-target",
    "SpeculativeConfig: a DeepSeek-V4.1 target has no MTP drafter (its stages are DSpark's)",
    request(_DRAFTED, spec_decode=_spec("mtp", 1, target_model_type="deepseek_v41")),
    {"error": {"code": "INVALID_ARGUMENT", "field": "spec_decode.method"}},
)
for version, batched in (("vllm-0.32", 3), ("vllm-0.33", 4)):
    scenario(
        f"release-{version.removeprefix('vllm-')}-spec-dflash-step-without-room",
        f"{version}: a step of {batched} tokens leaves none beside DFlash's slots for 3 "
        "draft tokens (0.32 counts K, 0.33 the lookahead K + 1)",
        for_release(
            request(_DRAFTED, spec_decode=_spec("dflash", 3), max_num_batched_tokens=batched),
            version,
        ),
        {"error": {"code": "INVALID_ARGUMENT", "field": "options.max_num_batched_tokens"}},
    )
scenario(
    "release-0.32-spec-suffix-async-v2",
    "vLLM 0.32: async scheduling refuses the suffix drafter, also on the V2 model runner",
    for_release(
        request(
            _DRAFTED,
            spec_decode=_spec("suffix", 3),
            async_scheduling=True,
            use_v2_model_runner=True,
        ),
        "vllm-0.32",
    ),
    {"error": {"code": "INVALID_ARGUMENT", "field": "options.async_scheduling"}},
)
scenario(
    "release-0.33-spec-medusa",
    "vLLM 0.33: the speculative config has no Medusa method",
    for_release(request(_DRAFTED, spec_decode=_spec("medusa", 2)), "vllm-0.33"),
    {"error": {"code": "INVALID_ARGUMENT", "field": "spec_decode.method"}},
)

# The model runner (issue 31): unset is the release's default; each runner refuses
# what it lacks (VllmConfig's V1 / V2 feature lists in 0.32 / 0.33).
for version in ("vllm-0.32", "vllm-0.33"):
    short = version.removeprefix("vllm-")
    v1_pp_async = async_pp_request(version)
    v1_pp_async["options"]["use_v2_model_runner"] = False
    scenario(
        f"release-{short}-v1-runner-pp-async",
        f"{version}: model runner V1 does not run pipeline parallelism with async scheduling",
        v1_pp_async,
        {"error": {"code": "INVALID_ARGUMENT", "field": "options.use_v2_model_runner"}},
    )
    scenario(
        f"release-{short}-v1-runner-dspark",
        f"{version}: DSpark runs on model runner V2 only",
        for_release(
            request(_DRAFTED, spec_decode=_spec("dspark", 2), use_v2_model_runner=False), version
        ),
        {"error": {"code": "INVALID_ARGUMENT", "field": "options.use_v2_model_runner"}},
    )
    scenario(
        f"release-{short}-v2-runner-suffix",
        f"{version}: model runner V2 does not run the suffix drafter",
        for_release(
            request(_DRAFTED, spec_decode=_spec("suffix", 2), use_v2_model_runner=True), version
        ),
        {"error": {"code": "INVALID_ARGUMENT", "field": "options.use_v2_model_runner"}},
    )
    scenario(
        f"release-{short}-v2-runner-parallel-eagle",
        f"{version}: model runner V2 drafts in parallel only for DFlash and DSpark",
        for_release(
            request(
                _DRAFTED,
                spec_decode=_spec("eagle", 3, parallel_drafting=True),
                use_v2_model_runner=True,
            ),
            version,
        ),
        {"error": {"code": "INVALID_ARGUMENT", "field": "options.use_v2_model_runner"}},
    )
    scenario(
        f"release-{short}-default-runner-parallel-ngram-pp-async",
        f"{version}: parallel n-gram drafting makes the default runner V1, which does not "
        "run pipeline parallelism with async scheduling",
        for_release(
            request(
                _DRAFTED,
                spec_decode=_spec("ngram", 3, parallel_drafting=True),
                async_scheduling=True,
                parallel={"pipeline_parallel_size": 2},
            ),
            version,
        ),
        {"error": {"code": "INVALID_ARGUMENT", "field": "options.async_scheduling"}},
    )
scenario(
    "release-0.33-default-runner-dspark-pp-async",
    "vllm-0.33: unset, the runner is V2, which runs DSpark with pp > 1 and async scheduling",
    for_release(
        request(
            _DRAFTED,
            spec_decode=_spec("dspark", 2),
            async_scheduling=True,
            parallel={"pipeline_parallel_size": 2},
        ),
        "vllm-0.33",
    ),
    {"grouping_path": "GROUPING_PATH_UNIFORM_SPEC"},
)
scenario(
    "release-0.33-default-runner-suffix-async",
    "vllm-0.33: unset, the suffix drafter runs on V1, where async scheduling refuses it",
    for_release(
        request(_DRAFTED, spec_decode=_spec("suffix", 2), async_scheduling=True), "vllm-0.33"
    ),
    {"error": {"code": "INVALID_ARGUMENT", "field": "options.async_scheduling"}},
)
scenario(
    "release-0.32-parallel-eagle-batch-slots",
    "vllm-0.32: a parallel EAGLE drafter takes K - 1 slots of a step (3 tokens: 2), "
    "so a step of 2 tokens leaves none",
    for_release(
        request(
            _DRAFTED,
            spec_decode=_spec("eagle", 3, parallel_drafting=True),
            max_num_batched_tokens=2,
        ),
        "vllm-0.32",
    ),
    {"error": {"code": "INVALID_ARGUMENT", "field": "options.max_num_batched_tokens"}},
)
scenario(
    "release-0.34-parallel-drafting-eagle",
    "vllm-0.34: parallel_drafting is taken for DFlash and DSpark only",
    for_release(
        request(_DRAFTED, spec_decode=_spec("eagle", 3, parallel_drafting=True)), "vllm-0.34"
    ),
    {"error": {"code": "INVALID_ARGUMENT", "field": "spec_decode.parallel_drafting"}},
)


def main() -> None:
    SCENARIO_DIR.mkdir(exist_ok=True)
    for old in SCENARIO_DIR.glob("*.json"):
        old.unlink()
    for index, item in enumerate(SCENARIOS, start=1):
        path = SCENARIO_DIR / f"{index:02d}-{item['name']}.json"
        path.write_text(json.dumps(item, indent=1) + "\n")
    print(f"wrote {len(SCENARIOS)} scenarios to {SCENARIO_DIR}")


if __name__ == "__main__":
    main()
