"""A model config planned over the wire: the thin client's helper builds the request."""

from __future__ import annotations

from pathlib import Path

from kvplan.client import AsyncPlannerClient, ModelPlanOptions, build_plan_request
from kvplan.convert import plan_from_proto
from kvplan.models import Speculative, load_config

MODELS = Path(__file__).parents[2] / "examples" / "models"


async def test_client_plans_a_model_config_on_the_server(client: AsyncPlannerClient) -> None:
    config = load_config(str(MODELS / "qwen3-next-defaults" / "config.json"))
    options = ModelPlanOptions(
        tensor_parallel_size=4,
        max_model_len=32768,
        gpu="h200",  # the catalog's driver figure travels with the name
        gpu_memory_utilization=0.9,
        speculative=Speculative("mtp", 1),
        engine_id="qwen3-next-remote",
    )
    request, inputs = build_plan_request(config, options)
    remote = (await client.plan(request)).response
    local = plan_from_proto(request)
    assert remote.num_blocks == local.num_blocks > 0
    assert [list(g.layer_names) for g in remote.groups] == [
        list(g.layer_names) for g in local.groups
    ]
    draft = [g for g in remote.groups if g.is_draft]
    assert len(draft) == 1 and "mtp.layers.0.self_attn.attn" in draft[0].layer_names
    assert remote.workers[0].budget.non_kv_bytes == inputs.non_kv_bytes
    assert remote.workers[0].budget.total_bytes == 143_771 * 2**20
