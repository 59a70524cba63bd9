"""The fleet's fingerprint and what its measurements say (kvplan.client.fleet)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvplan.client.fleet import (
    config_key,
    fleet_figures,
    gpu_name,
    model_config_hash,
    runtime_matches,
)
from kvplan.v1 import service_pb2

GIB = 1 << 30
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0",
    "_name_or_path": "/models/llama",
}


def fingerprint(**fields: object) -> service_pb2.ConfigFingerprint:
    values: dict[str, object] = {
        "model_config_hash": model_config_hash(CONFIG),
        "engine_version": "vllm-0.33",
        "gpu_name": "H100-80GB",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "dtype": "bfloat16",
        "kv_cache_dtype": "auto",
    }
    values.update(fields)
    return service_pb2.ConfigFingerprint(**values)  # type: ignore[arg-type]


def test_the_config_hash_ignores_who_saved_it_and_key_order() -> None:
    resaved = dict(reversed(list(CONFIG.items())))
    resaved.update(transformers_version="4.57.1", _name_or_path="meta-llama/x", dtype="bf16")
    assert model_config_hash(resaved) == model_config_hash(CONFIG)
    assert model_config_hash({**CONFIG, "num_hidden_layers": 31}) != model_config_hash(CONFIG)


def test_gpu_names_as_cuda_and_people_spell_them() -> None:
    assert gpu_name("NVIDIA H100 80GB HBM3") == "H100-80GB"
    assert gpu_name("h100") == "H100-80GB"
    assert gpu_name("NVIDIA H200") == "H200-141GB"
    assert gpu_name("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert gpu_name("NVIDIA RTX 9999 Ultra") == "RTX-9999-ULTRA"  # not in the catalog


def test_the_key_is_the_configuration_not_the_runtime_nor_the_spelling() -> None:
    base = config_key(fingerprint())
    assert base.startswith("cfg-")
    same = fingerprint(
        gpu_name="NVIDIA H100 80GB HBM3",
        dtype="torch.bfloat16",
        engine_version="VLLM-0.33",
        kv_cache_dtype="",
        quantization="none",
        max_num_batched_tokens=8192,
        cuda_graphs="FULL_AND_PIECEWISE",
        model="meta-llama/Llama-3.1-8B",
    )
    assert config_key(same) == base
    for changed in (
        fingerprint(tensor_parallel_size=2),
        fingerprint(pipeline_parallel_size=2),
        fingerprint(engine_version="vllm-0.34"),
        fingerprint(gpu_name="H200"),
        fingerprint(kv_cache_dtype="fp8"),
        fingerprint(quantization="fp8"),
        fingerprint(dtype="float16"),
        fingerprint(model_config_hash=model_config_hash({**CONFIG, "hidden_size": 2048})),
    ):
        assert config_key(changed) != base, changed


@given(
    tokens=st.integers(min_value=0, max_value=1 << 20),
    graphs=st.text(max_size=20),
    model=st.text(max_size=20),
)
def test_runtime_fields_never_change_the_key(tokens: int, graphs: str, model: str) -> None:
    assert config_key(
        fingerprint(max_num_batched_tokens=tokens, cuda_graphs=graphs, model=model)
    ) == config_key(fingerprint())


def engine(
    kv: list[int], tokens: int = 8192, graphs: str = "FULL", weights: int | None = None
) -> service_pb2.EngineMeasurement:
    workers = []
    for rank, available in enumerate(kv):
        worker = service_pb2.WorkerMeasurement(
            rank=rank, available_kv_bytes=available, total_bytes=80 * GIB, requested_bytes=72 * GIB
        )
        if weights is not None:
            worker.weights_bytes = weights
        workers.append(worker)
    return service_pb2.EngineMeasurement(
        max_num_batched_tokens=tokens, cuda_graphs=graphs, workers=workers
    )


def test_runtime_matching_treats_unset_as_any() -> None:
    measured = engine([GIB], tokens=8192, graphs="FULL")
    assert runtime_matches(measured, 0, "")
    assert runtime_matches(measured, 8192, "FULL")
    assert not runtime_matches(measured, 4096, "")
    assert not runtime_matches(measured, 0, "PIECEWISE")


def test_figures_take_the_smallest_rank_of_any_engine() -> None:
    assert fleet_figures([]) is None
    figures = fleet_figures(
        [engine([60 * GIB, 59 * GIB], weights=15 * GIB), engine([61 * GIB, 62 * GIB], 4096)]
    )
    assert figures is not None
    assert (figures.engines, figures.ranks) == (2, 2)
    assert figures.min_available_kv_bytes == 59 * GIB
    assert figures.max_available_kv_bytes == 62 * GIB
    assert figures.weights_bytes == 15 * GIB
    assert figures.max_non_kv_bytes == 13 * GIB  # 72 GiB requested, 59 GiB left for KV
    assert figures.total_bytes == 80 * GIB
    assert figures.activation_peak_bytes is None  # no engine reported one
    text = figures.describe()
    assert text.startswith(
        "measured on 2 engines: available KV 59.00 GiB .. 62.00 GiB per worker, non-KV 13.00 GiB"
    )
    assert "weights 15.00 GiB" in text and "activation" not in text
    assert "max_num_batched_tokens 4096" in text and "max_num_batched_tokens 8192" in text
