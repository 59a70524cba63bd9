"""Run in a vLLM CPU venv (0.32-0.34): Model Runner V2's own Sampler on the profile run's
dummy batch, as `_dummy_sampler_run` calls it (v1/worker/gpu/model_runner.py), with
every tensor vLLM's Python code allocates counted while it lives. stdin: {"rows": int,
"vocab": int, "dtype": "bfloat16" | "float32", "warmup": bool}; `warmup` adds 0.33-0.34's
second pass (`SamplingParams.for_sampler_warmup()` on every request). stdout (last line):
{"passes": {"default": B, "warmup": B}, "calls": [...]} with bytes per logit above the
logits themselves' start (the logits included).

Stand-ins, at the hardware boundary only: the CPU has no UVA or pinned memory (vLLM's
own non-UVA buffers are taken), no Triton (each `*_kernel` launch is a no-op: the
kernels write into tensors the Python wrappers allocated, which are counted), and no
FlashInfer (`flashinfer_sample` records what it is handed; FlashInfer's own
allocations are read from its source, docs/capacity.md). `use_flashinfer` is set as
`flashinfer_sampler_supported()` answers on a CUDA part FlashInfer supports."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import sys
from typing import Any

import torch
from vllm_live_bytes import LiveBytes  # type: ignore[import-not-found]  # beside this script

request = json.loads(sys.stdin.read())
rows, vocab = int(request["rows"]), int(request["vocab"])


class NoKernel:
    """A Triton launch the CPU cannot run: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: object) -> Any:
        return lambda *args, **kwargs: None


import vllm.triton_utils as triton_utils  # noqa: E402
import vllm.utils.torch_utils as torch_utils  # noqa: E402
import vllm.v1.worker.gpu.buffer_utils as buffer_utils  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

buffer_utils.is_uva_available = lambda: False
if hasattr(buffer_utils, "is_pin_memory_available"):
    buffer_utils.is_pin_memory_available = lambda: False
torch_utils.PIN_MEMORY = False
current_platform.device_type = "cpu"
triton_utils.triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
triton_utils.triton.cdiv = lambda a, b: -(-a // b)

import vllm.v1.worker.gpu.sample as sample_package  # noqa: E402
from vllm.v1.worker.gpu import input_batch  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers  # noqa: E402
from vllm.v1.worker.gpu.sample import sampler as mrv2  # noqa: E402
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402

for info in pkgutil.iter_modules(sample_package.__path__):
    importlib.import_module(f"vllm.v1.worker.gpu.sample.{info.name}")
for name, module in list(sys.modules.items()):
    if module is not None and name.startswith(("vllm.v1.worker.gpu", "vllm.v1.sample")):
        for attr in dir(module):
            if attr.endswith("_kernel") and callable(getattr(module, attr)):
                setattr(module, attr, NoKernel())


# The per-request bookkeeping after sampling is one Triton kernel over two rows-long
# outputs it allocates itself: the same two tensors here.
def num_sampled_and_rejected(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    rows_here = args[0].shape[0]
    return torch.ones(rows_here, dtype=torch.int32), torch.zeros(rows_here, dtype=torch.int32)


input_batch.get_num_sampled_and_rejected = num_sampled_and_rejected
mrv2.get_num_sampled_and_rejected = num_sampled_and_rejected

device = torch.device("cpu")
config = VllmConfig(device_config=DeviceConfig(device="cpu"))
states = RequestState(rows, 4096, 4096, 0, vocab, device)
offered = {"vllm_config": config, "max_num_reqs": rows, "vocab_size": vocab,
           "device": device, "req_states": states}  # fmt: skip
accepted = inspect.signature(mrv2.Sampler.__init__).parameters
sampler = mrv2.Sampler(**{key: value for key, value in offered.items() if key in accepted})
sampler.use_flashinfer = True

mode = LiveBytes()
base = 0
calls: list[dict[str, object]] = []


def flashinfer_sample(logits: torch.Tensor, k: Any, p: Any, *rest: Any) -> torch.Tensor:
    held = (mode.current - base) / (rows * vocab)
    calls.append({"call": "flashinfer_sample", "held": held, "dtype": str(logits.dtype),
                  "top_k": k is not None, "top_p": p is not None})  # fmt: skip
    return torch.zeros(logits.shape[0], dtype=torch.int32)


gumbel_sample = mrv2.gumbel_sample


def gumbel_spy(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    calls.append({"call": "gumbel_sample", "held": (mode.current - base) / (rows * vocab),
                  "dtype": str(logits.dtype)})  # fmt: skip
    return gumbel_sample(logits, *args, **kwargs)


mrv2.flashinfer_sample = flashinfer_sample
mrv2.gumbel_sample = gumbel_spy
batch = InputBatch.make_dummy(rows, rows, InputBuffers(rows, rows, device))
passes: dict[str, float] = {}
with mode:
    base = mode.current
    logits = torch.randn(rows, vocab, dtype=getattr(torch, request["dtype"]))
    start = len(mode.after)
    sampler(logits, batch)
    passes["default"] = (max(mode.after[start:]) - base) / (rows * vocab)
    if request["warmup"]:
        warmup = SamplingParams.for_sampler_warmup()
        for index in range(rows):
            sampler.add_request(index, warmup)
        sampler.apply_staged_writes()
        start = len(mode.after)
        sampler(logits, batch)
        passes["warmup"] = (max(mode.after[start:]) - base) / (rows * vocab)
print(json.dumps({"passes": passes, "calls": calls}))
