"""Run in a vLLM CPU venv (0.32, 0.33: the V1 runner's profiler, the same as 0.26-0.28's
but for a ROCm stream fix): vLLM's own GPUModelRunner.profile_cudagraph_memory on a
stand-in runner whose device reports no memory change, with the release's own capture
sizes (VllmConfig._set_cudagraph_sizes) and graph keys (CudagraphDispatcher). It prints,
per setting, every sample the profiler takes: mode, tokens, requests and the context it
asks each request to have (profile_seq_lens). Settings on stdin as JSON:
[[max_num_seqs, max_num_batched_tokens, max_model_len, num_speculative_tokens], ...]."""

import contextlib
import json
import sys
import types

import torch
from vllm.config import CompilationConfig, VllmConfig
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.forward_context import BatchDescriptor
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.worker import gpu_model_runner as runner_module


def engine_config(seqs: int, tokens: int, spec_tokens: int) -> VllmConfig:
    """A bare config with what the capture sizes and graph keys read (the default
    FULL_AND_PIECEWISE mode with attention split out, as on CUDA)."""
    config = object.__new__(VllmConfig)
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    speculative = None
    if spec_tokens:
        speculative = types.SimpleNamespace(
            num_speculative_tokens=spec_tokens,
            method="mtp",
            parallel_drafting=False,
            use_eagle=lambda: False,
            uses_dynamic_speculative_decoding=lambda: False,
        )
    config.__dict__.update(
        model_config=types.SimpleNamespace(enforce_eager=False),
        compilation_config=compilation,
        scheduler_config=types.SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens),
        speculative_config=speculative,
        performance_mode="balanced",
        lora_config=None,
    )
    config._set_cudagraph_sizes()
    compilation.splitting_ops = list(CompilationConfig._attention_ops)
    return config


# No device: the profiler's capture context, graph pool and memory queries are inert.
runner_module.graph_capture = lambda device: contextlib.nullcontext()
runner_module.set_current_vllm_config = lambda config: contextlib.nullcontext()
runner_module.current_platform.graph_pool_handle = lambda: object()
torch.accelerator.synchronize = lambda *args: None
torch.accelerator.empty_cache = lambda *args: None
torch.accelerator.get_memory_info = lambda *args: (1 << 40, 1 << 40)

answers = []
for seqs, tokens, max_model_len, spec_tokens in json.loads(sys.stdin.read()):
    config = engine_config(seqs, tokens, spec_tokens)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, 1 + spec_tokens)
    samples: list[list[object]] = []

    def warmup_and_capture(
        desc: BatchDescriptor,
        cudagraph_runtime_mode: CUDAGraphMode,
        profile_seq_lens: int | None = None,
        samples: list[list[object]] = samples,
        **kwargs: object,
    ) -> None:
        samples.append(
            [cudagraph_runtime_mode.name, desc.num_tokens, desc.num_reqs, profile_seq_lens]
        )

    stand_in = types.SimpleNamespace(
        vllm_config=config,
        cudagraph_dispatcher=dispatcher,
        max_model_len=max_model_len,
        max_num_tokens=tokens,
        device=torch.device("cpu"),
        lora_config=None,
        _init_minimal_kv_cache_for_profiling=lambda: None,
        _cleanup_profiling_kv_cache=lambda: None,
        _create_encoder_cudagraph_manager=lambda: None,
        maybe_remove_all_loras=lambda lora_config: None,
        _freeze_gc=runner_module.GPUModelRunner._freeze_gc,
        _warmup_and_capture=warmup_and_capture,
    )
    runner_module.GPUModelRunner.profile_cudagraph_memory(stand_in)
    answers.append(samples)
print(json.dumps(answers))
