"""Runs in a vLLM CPU venv: what each pipeline stage of vLLM's own model classes holds,
built on the meta device with vLLM's partition (`get_pp_indices`, read through the
pipeline group's rank and size as the model code reads them).

Two answers per case: vLLM's `get_pp_indices` for every stage under the case's
VLLM_PP_LAYER_PARTITION (or the error it raises), and, for cases with a config, each
stage's decoder-layer range, the parameters of its embedding and LM-head modules
(vocab-parallel tables) and the bytes of its RoPE cos/sin caches, counted from the
built model. The stand-ins of
vllm_model_side.py apply (no attention kernels, MoE experts as empty modules: experts
are not counted here). The pipeline group is the one-rank group with its rank and size
set as a stage's would be; nothing communicates on the meta device.

stdin: {"port": P, "partitions": [{"layers": N, "pp": S, "env": "17,15" | null}],
        "stages": [{"path": DIR, "pp": S, "rank": R}]}
stdout (last line): {"partitions": [[[start, end], ...] | "error: ..."],
                     "stages": [{"layers": [first, end], "embedding_params": N,
                                 "rope_cache_bytes": B}]}
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
sys.path.insert(0, str(Path(__file__).parent))

import torch
import vllm.config
from vllm.distributed import parallel_state
from vllm.distributed.utils import get_pp_indices
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm_model_side import (  # type: ignore[import-not-found]
    cpu_vllm_config,
    install_stand_ins,
    join_one_rank_groups,
)

_TABLES = re.compile(r"(^|\.)(embed_tokens|embedding|lm_head)\.")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def partition_of(case: dict[str, object]) -> object:
    if case["env"] is None:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    else:
        os.environ["VLLM_PP_LAYER_PARTITION"] = str(case["env"])
    try:
        pp = int(case["pp"])  # type: ignore[call-overload]
        layers = int(case["layers"])  # type: ignore[call-overload]
        return [list(get_pp_indices(layers, rank, pp)) for rank in range(pp)]
    except ValueError as error:
        return f"error: {error}"
    finally:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)


def stage_of(case: dict[str, object], port: int) -> dict[str, object]:
    config = cpu_vllm_config(str(case["path"]), 4096)
    with vllm.config.set_current_vllm_config(config):
        join_one_rank_groups(port)
        group = parallel_state._PP
        pp, rank = int(case["pp"]), int(case["rank"])  # type: ignore[call-overload]
        # A stage's view of its group: is_first_rank / is_last_rank compare `rank`
        # with `ranks`; make_layers reads rank_in_group and world_size.
        group.ranks, group.world_size, group.rank_in_group = list(range(pp)), pp, rank
        group.rank = rank
        # As vLLM's loader builds it: the model dtype is torch's default meanwhile.
        with set_default_torch_dtype(config.model_config.dtype), torch.device("meta"):
            model = initialize_model(config)
        group.ranks, group.world_size, group.rank_in_group, group.rank = [0], 1, 0, 0
    indexes: set[int] = set()
    tables = 0
    for name, parameter in model.named_parameters():
        if match := _LAYER.search(name):
            indexes.add(int(match.group(1)))
        elif _TABLES.search(name):
            tables += parameter.numel()
    # RoPE cos/sin caches: buffers, one per distinct rotary embedding (get_rope shares
    # an instance between layers; named_buffers lists a shared buffer once).
    rope = sum(
        buffer.numel() * buffer.element_size()
        for name, buffer in model.named_buffers()
        if name.endswith("cos_sin_cache")
    )
    return {
        "layers": [min(indexes), max(indexes) + 1],
        "embedding_params": tables,
        "rope_cache_bytes": rope,
    }


def main() -> None:
    payload = json.load(sys.stdin)
    install_stand_ins()
    partitions = [partition_of(case) for case in payload["partitions"]]
    stages = [stage_of(case, payload["port"]) for case in payload["stages"]]
    print(json.dumps({"partitions": partitions, "stages": stages}))


if __name__ == "__main__":
    main()
