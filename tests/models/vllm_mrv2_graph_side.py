"""Run in a vLLM CPU venv (0.32, 0.33): how Model Runner V2 turns its one throwaway
capture pass into the CUDA-graph estimate it subtracts (gpu/cudagraph_utils.py
`profile_cudagraph_memory`), and the allocator facts that decide what that pass's
figures hold. Stdin: {"cases": [[pass_drop, [full samples], full_graphs], ...]} (bytes);
stdout (last line): JSON with

- "rules": the sample count and per-graph floor vLLM uses;
- "estimates": per case, the value vLLM's own profile_cudagraph_memory returns when the
  runner's capture_model() reports `pass_drop` and the capture loop records `samples`
  (a stand-in runner and manager: no device is touched), and what the function set
  on the manager before the pass (the FULL cap, the throwaway pool, profile_only);
- "graph_entry_calls": what torch.cuda.graph's entry does before capture_begin while
  vLLM's piecewise-capture patch of torch.accelerator.empty_cache is in force;
- "order": where the capture loop reads free memory around a FULL capture, and whether
  capture_model() empties torch's cache before its first reading and under which
  condition between its two (source positions in the release's own functions)."""

import contextlib
import inspect
import json
import sys
import types
from unittest import mock

import torch

# No accelerator in the CPU venv: the profiler's own empty_cache() calls become no-ops.
torch.accelerator.empty_cache = lambda *args, **kwargs: None

import vllm.v1.worker.gpu.cudagraph_utils as cu  # noqa: E402
from vllm.compilation.cuda_graph import CUDAGraphWrapper  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # noqa: E402


class _Platform:
    """Stands in for current_platform: the pool handles the profiler swaps."""

    _global_graph_pool = "global-pool"

    def graph_pool_handle(self) -> str:
        return "throwaway-pool"


def estimate(pass_drop: int, samples: list[int], full_graphs: int) -> dict[str, object]:
    cu.current_platform = _Platform()
    cu.set_current_vllm_config = lambda config: contextlib.nullcontext()
    cu._init_minimal_kv_cache_for_profiling = lambda runner: None
    cu._teardown_profiling_state = lambda runner: None
    manager = types.SimpleNamespace(
        needs_capture=lambda: True,
        pool=None,
        use_breakable_cg=False,
        _capture_descs={CUDAGraphMode.FULL: list(range(full_graphs))},
        _max_full_descs_to_capture=None,
        _capture_mem_samples=None,
    )
    seen: dict[str, object] = {}

    def capture_model(profile_only: bool = False) -> int:
        seen.update(
            profile_only=profile_only,
            full_cap=manager._max_full_descs_to_capture,
            pool=manager.pool,
        )
        manager._capture_mem_samples.extend(samples)
        return pass_drop

    runner = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
        vllm_config=None,
        cudagraph_manager=manager,
        capture_model=capture_model,
        speculator=None,
        needs_cudagraph_capture=lambda: True,  # 0.33 asks the runner (encoder graphs too)
    )
    return {"estimate": cu.profile_cudagraph_memory(runner), **seen}


def graph_entry_calls() -> list[str]:
    """torch.cuda.graph.__enter__ with the device calls recorded, under the patch
    vLLM's CUDAGraphWrapper applies while it captures the pieces after the first."""
    calls: list[str] = []
    graph = torch.cuda.graph.__new__(torch.cuda.graph)
    graph.__dict__.update(
        _enable_annotations=False,
        stream_ctx=contextlib.nullcontext(),
        pool=(),
        capture_error_mode="global",
        check_input_liveness=False,
        cuda_graph=types.SimpleNamespace(
            capture_begin=lambda *args, **kwargs: calls.append("capture_begin")
        ),
    )
    with (
        mock.patch("torch.cuda.synchronize", lambda *args, **kwargs: None),
        mock.patch("torch.cuda.memory.is_initialized", lambda: True),
        # The CPU build has no CUDA binding: stand one in where torch.cuda reaches it.
        mock.patch(
            "torch._C._cuda_emptyCache", lambda: calls.append("cuda_empty_cache"), create=True
        ),
        mock.patch(
            "torch._C._host_emptyCache", lambda: calls.append("host_empty_cache"), create=True
        ),
        mock.patch("torch.accelerator.empty_cache", lambda *args, **kwargs: None),
    ):
        graph.__enter__()
    return calls


def order() -> dict[str, object]:
    loop = inspect.getsource(cu.CudaGraphManager.capture)
    capture = inspect.getsource(GPUModelRunner.capture_model)
    wrapper = inspect.getsource(CUDAGraphWrapper.__call__)
    start = capture.index("start_free_gpu_memory =")
    end = capture.index("end_free_gpu_memory =")
    return {
        "full_sample_reads": [
            loop.index("create_forward_fn(desc, warmup=True)"),
            loop.index("free_before ="),
            loop.index("torch.cuda.graph("),
            loop.index("free_after ="),
        ],
        "empties_before_start": "empty_cache()" in capture[:start],
        # Each empty_cache() between the two readings, with the `if` it sits under.
        "empties_between": [
            [line.strip() for line in capture[start:at].splitlines() if " if " in f" {line}"][-1]
            for at in range(start, end)
            if capture.startswith("empty_cache()", at)
        ],
        "wrapper_patches": [
            name
            for name in ("torch.accelerator.empty_cache", "torch.cuda.empty_cache")
            if f'"{name}"' in wrapper
        ],
    }


request = json.loads(sys.stdin.read())
print(
    json.dumps(
        {
            "rules": {
                "samples": cu._FULL_GRAPH_PROFILING_SAMPLES,
                "floor": cu._MIN_PER_GRAPH_BYTES,
            },
            "estimates": [estimate(*case) for case in request["cases"]],
            "graph_entry_calls": graph_entry_calls(),
            "order": order(),
        }
    )
)
