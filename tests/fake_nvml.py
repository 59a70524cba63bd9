"""A stand-in for the `pynvml` module, faked at the library boundary.

Only the functions kvplan calls are faked, with pynvml's own names and
parameters (`test_fake_matches_pynvml` checks them against the installed
module). Exceptions, constants and the memory and PCI structures are pynvml's
real ones, so error mapping (NVMLError(code) -> NVMLError_<Name>) behaves
exactly as with a driver.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

FAKED_FUNCTIONS = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetPciInfo",
)
GIB = 1 << 30


@dataclass
class FakeGpu:
    """One device behind the fake driver: a GPU, or a MIG instance (in `mig_slots`).

    Its memory as NVML counts it, read off an H200 (docs/gpu-check.md): `total` is
    the physical memory, the driver's `reserved` share included, and the v2 query
    reports total = free + used + reserved (150,754,820,096 = 150,106,472,448 +
    3,407,872 + 644,939,776 B); the v1 query counts the reservation as used.
    CUDA (`cudaMemGetInfo`) reports total - reserved."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GIB
    used: int = 512 << 20  # allocated by processes (v2: the reservation not included)
    reserved: int = 512 << 20
    pci_bus_id: str = "00000000:00:00.0"
    mig_supported: bool = False  # nvmlDeviceGetMigMode raises NotSupported when False
    mig_enabled: bool = False
    mig_slots: list[FakeGpu | None] = field(default_factory=list)  # None: an empty slot
    name_as_bytes: bool = False  # a binding that hands back raw bytes

    @property
    def free(self) -> int:
        return self.total - self.reserved - self.used


class _Handle:
    """Opaque, like pynvml's c_nvmlDevice_t."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu


def _raise(code: int) -> Any:
    raise pynvml.NVMLError(code)


@dataclass
class FakeNvml:
    """The fake driver's state and a record of the calls made to it."""

    gpus: list[FakeGpu]
    init_error: int | None = None  # an NVML_ERROR_* code nvmlInit fails with
    memory_v2: str = "supported"  # "supported", "no_symbol", "no_version_arg", "not_supported"
    has_v2_constant: bool = True
    calls: list[str] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        """A module object exposing what pynvml exposes, for these GPUs."""
        module = types.ModuleType("pynvml")
        for name in dir(pynvml):
            if name.startswith(("NVMLError", "NVML_")):
                setattr(module, name, getattr(pynvml, name))
        if self.has_v2_constant:
            module.nvmlMemory_v2 = pynvml.nvmlMemory_v2  # type: ignore[attr-defined]
        functions: dict[str, Callable[..., Any]] = {
            "nvmlInit": self.nvmlInit,
            "nvmlShutdown": self.nvmlShutdown,
            "nvmlDeviceGetCount": self.nvmlDeviceGetCount,
            "nvmlDeviceGetHandleByIndex": self.nvmlDeviceGetHandleByIndex,
            "nvmlDeviceGetUUID": self.nvmlDeviceGetUUID,
            "nvmlDeviceGetName": self.nvmlDeviceGetName,
            "nvmlDeviceGetMemoryInfo": (
                self.nvmlDeviceGetMemoryInfo_v1_only
                if self.memory_v2 == "no_version_arg"
                else self.nvmlDeviceGetMemoryInfo
            ),
            "nvmlDeviceGetMigMode": self.nvmlDeviceGetMigMode,
            "nvmlDeviceGetMaxMigDeviceCount": self.nvmlDeviceGetMaxMigDeviceCount,
            "nvmlDeviceGetMigDeviceHandleByIndex": self.nvmlDeviceGetMigDeviceHandleByIndex,
            "nvmlDeviceGetPciInfo": self.nvmlDeviceGetPciInfo,
        }
        assert set(functions) == set(FAKED_FUNCTIONS)
        for name, function in functions.items():
            setattr(module, name, function)
        return module

    # --- the faked functions, parameters named as in pynvml ---

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            _raise(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(self.gpus[index])

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return handle.gpu.uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str | bytes:
        name = handle.gpu.name
        return name.encode() if handle.gpu.name_as_bytes else name

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        gpu = handle.gpu
        if not version:
            self.calls.append("memory_v1")
            return pynvml.c_nvmlMemory_t(
                total=gpu.total, free=gpu.free, used=gpu.used + gpu.reserved
            )
        self.calls.append("memory_v2")
        if self.memory_v2 == "no_symbol":  # pynvml's answer when the driver lacks the _v2 entry
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if self.memory_v2 == "not_supported":
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlMemory_v2_t(
            version=version, total=gpu.total, reserved=gpu.reserved, free=gpu.free, used=gpu.used
        )

    def nvmlDeviceGetMemoryInfo_v1_only(self, handle: _Handle) -> Any:
        """An older pynvml, whose nvmlDeviceGetMemoryInfo takes only the handle."""
        return self.nvmlDeviceGetMemoryInfo(handle)

    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        if not device.gpu.mig_supported:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if device.gpu.mig_enabled else 0
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: _Handle) -> int:
        return len(device.gpu.mig_slots) if device.gpu.mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: _Handle, index: int) -> _Handle:
        instance = device.gpu.mig_slots[index]
        if instance is None:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        assert instance is not None
        return _Handle(instance)

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> Any:
        info = pynvml.nvmlPciInfo_t()
        info.busId = handle.gpu.pci_bus_id.encode()
        return info
