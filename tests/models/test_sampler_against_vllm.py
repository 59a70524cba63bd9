"""The dummy sampler's PyTorch top-k/top-p path (what vLLM runs without FlashInfer
where no Triton kernel replaces it), run in each release's CPU venv with every tensor
vLLM's code allocates counted while it lives. kvplan's sort-path figure is this part
plus torch.sort's CUDA workspace, which a CPU run cannot show (profiling.py says where
that comes from)."""

from __future__ import annotations

import pytest

from kvplan.models import profiling
from tests.vllm_envs import run_in_vllm

# Counts the bytes of the tensors alive (by storage) after each aten op: the model-dtype
# logits as compute_logits returns them, the sampler's float32 copy with temperature
# applied in place, then vLLM's own apply_top_k_top_p_pytorch with the profile run's
# top-k and top-p on every row.
VLLM_SIDE = """
import json, weakref
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from vllm.v1.sample.ops import topk_topp_sampler

class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live, self.current, self.after = {}, 0, []
    def _drop(self, ptr):
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self.live[ptr]
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self.live:
                    self.live[ptr] = [storage.nbytes(), 0]
                    self.current += storage.nbytes()
                self.live[ptr][1] += 1
                weakref.finalize(tensor, self._drop, ptr)
        self.after.append((func.__name__, self.current))
        return out

rows, vocab = 8, 151936
with LiveBytes() as mode:
    hidden = torch.randn(rows, 64, dtype=torch.bfloat16)
    head = torch.randn(vocab, 64, dtype=torch.bfloat16)
    base = mode.current
    start = len(mode.after)
    logits_model = hidden @ head.t()
    logits = logits_model.to(torch.float32)
    logits.div_(torch.full((rows, 1), 0.5))
    k = torch.full((rows,), vocab - 1, dtype=torch.int64)
    p = torch.full((rows,), 0.99)
    topk_topp_sampler.apply_top_k_top_p_pytorch(logits, k, p)
steps = mode.after[start:]
at_sort = next(current for name, current in steps if name.startswith("sort"))
peak = max(current for _, current in steps)
print(json.dumps({"at_sort": (at_sort - base) / (rows * vocab),
                  "peak": (peak - base) / (rows * vocab)}))
"""


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_sort_path_holds_what_kvplan_counts(release: str) -> None:
    measured = run_in_vllm(release, ["-c", VLLM_SIDE], timeout=240)
    # What vLLM's code holds when torch.sort returns, per logit (a few bytes of k, p
    # and the temperature spread over 1.2M logits are below a rounding).
    assert round(measured["at_sort"]) == profiling._SORT_HELD_PER_LOGIT, (release, measured)
    # No later step (the masks, softmax of the sorted values, the scatter back) holds
    # as much as the sort with its CUDA workspace.
    assert measured["peak"] < profiling._SORT_SAMPLER, (release, measured)
