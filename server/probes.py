"""GPU memory probes: where the server's device totals and free bytes come from.

Three probes share one interface (`DeviceProbe`):

- `NvmlProbe` ("nvml", the default where a driver is present) reads the NVIDIA
  management library. It is cheap, needs no CUDA and touches no device memory.
- `TorchProbe` ("torch") asks `torch.cuda`. It needs PyTorch and creates a CUDA
  context on every device; use it only where NVML cannot run.
- `StaticProbe` ("static") serves a fixed inventory (`8xH100-80GB` or a file):
  hosts without GPUs, capacity planning, tests. Free is always the total.

`open_probe` picks one from the `--probe` and `--devices` settings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from kvplan.server.devices import Device, parse_inventory

log = logging.getLogger("kvplan.server.probes")

PROBE_KINDS = ("auto", "nvml", "torch", "static")


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of one device (a GPU, or a MIG instance in place of its GPU)."""

    uuid: str  # "GPU-..." or "MIG-...", as NVML and nvidia-smi -L print it
    name: str  # e.g. "NVIDIA H100 80GB HBM3"; static: the inventory name
    index: int  # NVML order (PCI bus order); static: inventory order; torch: CUDA index
    total_bytes: int  # what CUDA reports as the device's total (cudaMemGetInfo)
    free_bytes: int
    used_bytes: int
    # NVML v2 memory query: what the driver reserves, outside total_bytes (CUDA's total).
    reserved_bytes: int = 0
    parent_uuid: str = ""  # a MIG instance: the physical GPU's UUID


class ProbeUnavailable(Exception):
    """The probe cannot run here: no driver, no library, no torch, no CUDA."""


class DeviceProbe(Protocol):
    name: str  # "nvml", "torch" or "static"

    def snapshot(self) -> tuple[DeviceMemory, ...]:
        """A fresh reading of every device, ordered by index."""
        ...

    def close(self) -> None: ...


# --- NVML ----------------------------------------------------------------------------


class NvmlProbe:
    """Reads device memory through NVML (nvidia-ml-py's `pynvml`).

    NVML talks to the kernel driver only: it never creates a CUDA context, so
    the probe costs no device memory and does not count as a process on the GPU.

    A GPU in MIG mode is reported as its MIG instances (each with `parent_uuid`
    set and the parent's NVML index), not as the whole GPU, because a CUDA
    process on such a GPU runs on an instance and sees only that instance's
    memory. A GPU in MIG mode with no instances yet contributes no devices.

    Errors NVML raises while reading (a GPU fallen off the bus, say) propagate
    from `snapshot` as `pynvml.NVMLError`.
    """

    name = "nvml"

    def __init__(self, nvml: ModuleType | None = None) -> None:
        if nvml is None:
            try:
                import pynvml
            except ImportError as error:
                raise ProbeUnavailable(
                    "the nvml probe needs nvidia-ml-py (pip install 'kvplan[server]')"
                ) from error
            nvml = pynvml
        self._nvml: Any = nvml
        nvml = self._nvml  # pynvml has no type information: Any from here on
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound as error:
            raise ProbeUnavailable(
                "NVML (libnvidia-ml.so.1) was not found: this host has no NVIDIA driver, "
                "or the container was started without the GPU runtime (--gpus / "
                "NVIDIA Container Toolkit); use --probe static --devices ... on a host "
                "without GPUs"
            ) from error
        except nvml.NVMLError_DriverNotLoaded as error:
            raise ProbeUnavailable(
                "NVML found no loaded NVIDIA kernel driver (is the nvidia module loaded? "
                "check nvidia-smi); use --probe static --devices ... on a host without GPUs"
            ) from error
        except nvml.NVMLError as error:
            raise ProbeUnavailable(f"NVML failed to initialise: {error}") from error
        self._open = True
        # v2 reports driver-reserved memory separately; older modules lack the constant.
        self._memory_v2: int | None = getattr(nvml, "nvmlMemory_v2", None)
        # The driver (no nvmlDeviceGetMemoryInfo_v2) or the module (no version
        # argument) lacks v2 altogether: every device falls back to v1.
        self._v2_missing: tuple[type[BaseException], ...] = (
            nvml.NVMLError_FunctionNotFound,
            TypeError,
        )

    def snapshot(self) -> tuple[DeviceMemory, ...]:
        nvml = self._nvml
        devices: list[DeviceMemory] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            if self._mig_enabled(handle):
                devices.extend(
                    self._reading(mig, index, parent_uuid=uuid) for mig in self._mig_handles(handle)
                )
            else:
                devices.append(self._reading(handle, index, uuid=uuid))
        return tuple(devices)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as error:  # shutting down; nothing left to do
            log.debug("nvmlShutdown failed: %s", error)

    # --- helpers ---

    def _reading(
        self, handle: Any, index: int, *, uuid: str = "", parent_uuid: str = ""
    ) -> DeviceMemory:
        nvml = self._nvml
        total, free, used, reserved = self._memory(handle)
        return DeviceMemory(
            uuid=uuid or _text(nvml.nvmlDeviceGetUUID(handle)),
            name=_text(nvml.nvmlDeviceGetName(handle)),
            index=index,
            total_bytes=total,
            free_bytes=free,
            used_bytes=used,
            reserved_bytes=reserved,
            parent_uuid=parent_uuid,
        )

    def _memory(self, handle: Any) -> tuple[int, int, int, int]:
        """(total, free, used, reserved) bytes, the v2 query where the driver has it.

        The total is what a CUDA process sees (`cudaMemGetInfo`, which vLLM multiplies
        by gpu_memory_utilization): NVML's total less the memory the driver reserves.
        Read on an H200 (scripts/gpu-check, docs/gpu-check.md): NVML's total
        150,754,820,096 B with 644,939,776 B reserved, torch's 150,109,880,320 B.
        The v1 query counts the reservation as used and cannot tell it apart: its
        total overstates CUDA's by that much."""
        nvml = self._nvml
        if self._memory_v2 is not None:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=self._memory_v2)
                reserved = int(info.reserved)
                return int(info.total) - reserved, int(info.free), int(info.used), reserved
            except self._v2_missing:
                self._memory_v2 = None  # stop asking on every snapshot
            except nvml.NVMLError_NotSupported:
                pass  # this device only; others may still answer v2
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.free), int(info.used), 0

    def _mig_enabled(self, handle: Any) -> bool:
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
            return False  # a GPU (or driver) without MIG
        return bool(current == nvml.NVML_DEVICE_MIG_ENABLE)

    def _mig_handles(self, handle: Any) -> Iterator[Any]:
        nvml = self._nvml
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                yield nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError_NotFound:
                continue  # an empty slot: no compute instance there


def _text(value: str | bytes) -> str:
    # pynvml decodes strings on Python 3; a raw binding hands back bytes.
    return value.decode() if isinstance(value, bytes) else value


# --- torch.cuda ------------------------------------------------------------------------


class TorchProbe:
    """Reads device memory through `torch.cuda.mem_get_info`.

    Costly: the first query on a device creates a CUDA context there, which
    takes seconds at start and typically holds a few hundred MiB of device
    memory per device for the whole life of the server process. That memory
    counts as in use by a process kvplan holds no lease for, so it lowers the
    free memory of every device the server plans. Hence NVML is the default;
    use this probe only where NVML cannot run.

    Indexes are CUDA's, so they follow CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER of the server process.
    """

    name = "torch"

    def __init__(self, torch_cuda: Any | None = None) -> None:
        if torch_cuda is None:
            try:
                import torch  # lazy: the server never needs torch otherwise
            except (ImportError, OSError) as error:
                raise ProbeUnavailable(
                    f"the torch probe needs PyTorch with CUDA (pip install 'kvplan[torch]'): "
                    f"{error}"
                ) from error
            torch_cuda = torch.cuda
        if not torch_cuda.is_available():
            raise ProbeUnavailable(
                "torch.cuda.is_available() is False: this torch build has no CUDA, "
                "or no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
            )
        self._cuda = torch_cuda
        # Names and UUIDs do not change; read them once.
        self._identities = [
            _torch_identity(torch_cuda.get_device_properties(index))
            for index in range(torch_cuda.device_count())
        ]

    def snapshot(self) -> tuple[DeviceMemory, ...]:
        devices = []
        for index, (uuid, name) in enumerate(self._identities):
            free, total = self._cuda.mem_get_info(index)
            devices.append(
                DeviceMemory(
                    uuid=uuid,
                    name=name,
                    index=index,
                    total_bytes=int(total),
                    free_bytes=int(free),
                    used_bytes=int(total) - int(free),
                )
            )
        return tuple(devices)

    def close(self) -> None:
        """Nothing to release: the CUDA contexts live as long as the process."""


def _torch_identity(props: Any) -> tuple[str, str]:
    """(uuid, name) of one device from torch's device properties.

    torch renders `props.uuid` as a bare UUID ("58e4a5ff-..."); NVML prefixes
    it with "GPU-", or "MIG-" for a MIG instance, whose CUDA name carries a
    "MIG" word ("NVIDIA A100-SXM4-40GB MIG 1g.5gb"). A prefixed string is kept.
    """
    name = str(props.name)
    raw = str(props.uuid)
    if raw.startswith(("GPU-", "MIG-")):
        return raw, name
    prefix = "MIG-" if "MIG" in name.split() else "GPU-"
    return prefix + raw, name


# --- static inventory ------------------------------------------------------------------


class StaticProbe:
    """A fixed inventory: free is always the total and nothing is in use."""

    name = "static"

    def __init__(self, devices: Sequence[Device]) -> None:
        self._devices = tuple(
            DeviceMemory(
                uuid=device.uuid,
                name=device.name,
                index=device.index,
                total_bytes=device.total_bytes,
                free_bytes=device.total_bytes,
                used_bytes=0,
            )
            for device in sorted(devices, key=lambda device: device.index)
        )

    def snapshot(self) -> tuple[DeviceMemory, ...]:
        return self._devices

    def close(self) -> None:
        pass


# --- choosing one ----------------------------------------------------------------------


def open_probe(kind: str, devices: str) -> DeviceProbe:
    """The probe for `--probe kind` and `--devices devices`.

    auto: the static inventory when `devices` is given, else NVML, else (no
    driver here) an empty static inventory, with a warning saying why.
    nvml / torch: that probe, or ProbeUnavailable saying what is missing.
    static: the inventory in `devices` (may be empty).
    """
    if kind == "auto":
        if devices:
            return StaticProbe(parse_inventory(devices))
        try:
            return NvmlProbe()
        except ProbeUnavailable as error:
            log.warning(
                "no NVML here (%s); serving an empty static inventory: requests that "
                "name a device will get NOT_FOUND. Pass --devices (e.g. 8xH100-80GB) "
                "to plan for a fixed inventory",
                error,
            )
            return StaticProbe([])
    if kind == "nvml":
        return NvmlProbe()
    if kind == "torch":
        return TorchProbe()
    if kind == "static":
        return StaticProbe(parse_inventory(devices))
    raise ValueError(f"unknown probe {kind!r}; expected one of {', '.join(PROBE_KINDS)}")


__all__ = [
    "PROBE_KINDS",
    "DeviceMemory",
    "DeviceProbe",
    "NvmlProbe",
    "ProbeUnavailable",
    "StaticProbe",
    "TorchProbe",
    "open_probe",
]
