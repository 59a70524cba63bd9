"""The engines the benchmarks plan, as PlanRequests."""

from __future__ import annotations

from pathlib import Path

from kvplan.cli import load_request
from kvplan.v1 import plan_pb2, spec_pb2

ROOT = Path(__file__).resolve().parents[1]
QWEN3_NEXT_EXAMPLE = ROOT / "examples" / "qwen3-next-80b-a3b-mtp.yaml"
GIB = 1 << 30
MIB = 1 << 20

QWEN3_NEXT_LAYERS = 64
QWEN3_NEXT_WORKERS = 8
HYBRID_BLOCK_SIZE = 272  # 16 * cdiv(Mamba page 270,336 B, 16 * 1,024 B per attention token)
WEIGHTS_BYTES_PER_RANK = 20_000_000_000  # 80e9 params x 2 bytes / TP 8


def qwen3_next_tp8() -> plan_pb2.PlanRequest:
    """Qwen3-Next-80B-A3B + MTP rescaled to 64 layers on TP 8 (8 workers, all layers each),
    from examples/qwen3-next-80b-a3b-mtp.yaml: about 29 KB on the wire.

    Per TP-8 rank: conv state (4, (2*16*128 + 32*128) / 8) = (4, 1024) bf16, temporal state
    (32 / 8, 128, 128) fp32: 270,336 bytes; attention 1 KV head x 256: 1,024 bytes per token,
    so the hybrid block is 272 tokens (page 278,528 bytes, the Mamba page padded to it).
    """
    example = load_request(str(QWEN3_NEXT_EXAMPLE))
    source_layers = example.workers[0].layers
    mamba_layer = next(layer for layer in source_layers if layer.HasField("mamba"))
    attention_layer = next(layer for layer in source_layers if layer.HasField("full_attention"))
    mtp_layer = source_layers[-1]
    layers: list[spec_pb2.LayerSpec] = []
    for index in range(QWEN3_NEXT_LAYERS):
        layer = spec_pb2.LayerSpec()
        if index % 4 == 3:
            layer.CopyFrom(attention_layer)
            layer.name = f"model.layers.{index}.self_attn.attn"
            layer.block_size = HYBRID_BLOCK_SIZE
        else:
            layer.CopyFrom(mamba_layer)
            layer.name = f"model.layers.{index}.linear_attn"
            conv_state, temporal_state = layer.mamba.states
            conv_state.shape[:] = [4, 1024]
            temporal_state.shape[:] = [4, 128, 128]
        layers.append(layer)
    mtp = spec_pb2.LayerSpec()
    mtp.CopyFrom(mtp_layer)
    mtp.block_size = HYBRID_BLOCK_SIZE
    layers.append(mtp)

    request = plan_pb2.PlanRequest()
    request.CopyFrom(example)
    request.engine_id = f"qwen3-next-{QWEN3_NEXT_LAYERS}l-tp{QWEN3_NEXT_WORKERS}"
    request.options.block_size = HYBRID_BLOCK_SIZE
    request.options.parallel.tensor_parallel_size = QWEN3_NEXT_WORKERS
    template_worker = example.workers[0]
    del request.workers[:]
    for rank in range(QWEN3_NEXT_WORKERS):
        worker = request.workers.add()
        worker.CopyFrom(template_worker)
        worker.rank = rank
        worker.memory.non_kv.weights_bytes = WEIGHTS_BYTES_PER_RANK
        del worker.layers[:]
        worker.layers.extend(layers)
    return request


def _gemma_layers(first: int, count: int) -> list[spec_pb2.LayerSpec]:
    """Layers first..first+count-1 of a Gemma-3-style hybrid (5 sliding-window : 1 full)."""
    layers = []
    for index in range(first, first + count):
        layer = spec_pb2.LayerSpec(name=f"model.layers.{index}.self_attn.attn")
        if index % 6 == 5:
            layer.full_attention.attention.num_kv_heads = 8
            layer.full_attention.attention.head_size = 128
        else:
            layer.sliding_window.attention.num_kv_heads = 8
            layer.sliding_window.attention.head_size = 128
            layer.sliding_window.sliding_window = 1024
        layers.append(layer)
    return layers


def gemma_style(num_layers: int, tensor_parallel: int = 1) -> plan_pb2.PlanRequest:
    """A Gemma-3-style hybrid (5 sliding-window : 1 full) of `num_layers` layers on
    `tensor_parallel` TP ranks (every rank holds every layer), 1 TiB of KV per worker."""
    request = plan_pb2.PlanRequest(engine_id=f"gemma-style-{num_layers}l-tp{tensor_parallel}")
    request.options.max_model_len = 32_768
    if tensor_parallel > 1:
        request.options.parallel.tensor_parallel_size = tensor_parallel
    layers = _gemma_layers(0, num_layers)
    for rank in range(tensor_parallel):
        worker = request.workers.add(rank=rank)
        worker.memory.kv_cache_memory_bytes = 1024 * GIB  # ample for any layer count here
        worker.layers.extend(layers)
    return request


def gemma_style_pipeline(stages: int, layers_per_stage: int = 8) -> plan_pb2.PlanRequest:
    """The same hybrid on `stages` pipeline stages, each holding its own
    `layers_per_stage` layers: the model grows with the stages, so linear cost in
    workers is linear cost in layers."""
    request = plan_pb2.PlanRequest(engine_id=f"gemma-style-pp{stages}x{layers_per_stage}")
    request.options.max_model_len = 32_768
    request.options.parallel.pipeline_parallel_size = stages
    for rank in range(stages):
        worker = request.workers.add(rank=rank)
        worker.memory.kv_cache_memory_bytes = 1024 * GIB
        worker.layers.extend(_gemma_layers(rank * layers_per_stage, layers_per_stage))
    return request


def leased_engine(device_uuid: str, kv_bytes: int = 4 * MIB) -> plan_pb2.PlanRequest:
    """A one-layer engine whose single worker names `device_uuid`: every plan of a new
    engine id is a grant of a `kv_bytes` lease (explicit budget, no non-KV memory), so
    thousands of them fit on one device."""
    request = plan_pb2.PlanRequest(engine_id="leased")
    request.options.max_model_len = 2048
    worker = request.workers.add(rank=0)
    worker.device.uuid = device_uuid
    worker.memory.kv_cache_memory_bytes = kv_bytes
    layer = worker.layers.add(name="model.layers.0.self_attn.attn")
    layer.full_attention.attention.num_kv_heads = 1
    layer.full_attention.attention.head_size = 64
    return request
