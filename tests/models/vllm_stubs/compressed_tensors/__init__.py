"""Import stand-ins for vLLM's CPU venvs (on PYTHONPATH for tests/models/vllm_model_side.py
only): `compressed_tensors` and `torchvision`, which the CPU venvs do not install, are
imported at module level on the way to Qwen3-Next / Qwen3.5 (the fused-MoE int-wNa16
oracle, Qwen2-VL's image processor) but nothing they provide is used by the layers built
on the meta device. Every name they are asked for is an inert placeholder class.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.12.0"
_STUBBED = ("compressed_tensors.", "torchvision")


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder


class Placeholder(metaclass=_PlaceholderMeta):
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return Placeholder

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return Placeholder()


def __getattr__(name: str) -> Any:
    return Placeholder


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__file__ = __file__
        module.__version__ = "0.24.0"  # type: ignore[attr-defined]
        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(_STUBBED):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


sys.meta_path.insert(0, _Finder())
