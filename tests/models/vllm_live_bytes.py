"""Imported by the side scripts that run in a vLLM CPU venv (vllm_v1_sampler_side.py,
vllm_mrv2_sampler_side.py): counts the bytes of the tensors vLLM's Python code holds."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):  # type: ignore[misc]
    """Bytes of the storages alive after each aten op, by storage; an in-place op on a
    tensor made before counting began (a Sampler's state) adds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}
        self.current = 0
        self.after: list[int] = []

    def _drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self.live[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                ptr = tensor.untyped_storage().data_ptr()
                if ptr not in self.live and func.__name__.split(".")[0].endswith("_"):
                    continue
                if ptr not in self.live:
                    self.live[ptr] = [tensor.untyped_storage().nbytes(), 0]
                    self.current += tensor.untyped_storage().nbytes()
                self.live[ptr][1] += 1
                weakref.finalize(tensor, self._drop, ptr)
        self.after.append(self.current)
        return out
