"""Name a worker's device the way the server does: by its NVML UUID.

A worker knows its device as a CUDA index (`cuda:0`), which depends on the
process's CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER. The server knows devices
by UUID ("GPU-..." or "MIG-...", as `nvidia-smi -L` prints them). Put the
result of `cuda_device_uuid(index)` in `WorkerSpec.device.uuid`.

This module needs only the standard library. It loads the CUDA driver
(libcuda.so.1) through ctypes when asked, and imports pynvml only as a
fallback, never at import time.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

CUDA_SUCCESS: Final = 0
CUDA_ERROR_NO_DEVICE: Final = 100
CUDA_ERROR_INVALID_DEVICE: Final = 101
_UUID_BYTES: Final = 16
_NAME_BUFFER: Final = 256
_LOAD: Final = object()  # default for injectable libraries: load the real one


class DeviceResolutionError(LookupError):
    """The CUDA index cannot be turned into a device UUID (no driver, no
    NVML, index out of range, or an enumeration this module cannot emulate)."""


@dataclass(frozen=True)
class NvmlDevice:
    """One physical GPU as NVML lists it (NVML order is PCI bus order)."""

    uuid: str  # "GPU-..."
    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    pci_bus_id: str = ""  # e.g. "00000000:07:00.0"; empty when unknown
    mig_enabled: bool = False  # MIG mode is on (CUDA runs on its instances)
    mig_uuids: tuple[str, ...] = ()  # "MIG-..." of its instances, when MIG is on


# --- the primary path: the CUDA driver API ----------------------------------------------


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * _UUID_BYTES)]


def format_device_uuid(raw: bytes, prefix: str = "GPU-") -> str:
    """16 raw UUID bytes as NVML writes them: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    if len(raw) != _UUID_BYTES:
        raise ValueError(f"a device UUID is {_UUID_BYTES} bytes, got {len(raw)}")
    hex_digits = raw.hex()
    groups = (hex_digits[:8], hex_digits[8:12], hex_digits[12:16], hex_digits[16:20])
    return prefix + "-".join((*groups, hex_digits[20:]))


def cuda_device_uuid(
    index: int,
    *,
    libcuda: Any = _LOAD,
    nvml: Any = _LOAD,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The UUID of CUDA device `index` of this process ("GPU-..." or "MIG-...").

    First through the CUDA driver API (cuInit, cuDeviceGet, cuDeviceGetUuid_v2):
    the driver applies CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER itself, so
    the answer is exact. This creates no CUDA context and uses no device
    memory, but it does initialise the driver in this process: call it in the
    worker process itself, not in a parent that later forks CUDA workers (a
    child forked after cuInit cannot use CUDA).

    Where libcuda is missing, NVML lists the devices and `resolve_cuda_index`
    emulates CUDA's enumeration from the environment.

    `libcuda` and `nvml` default to loading libcuda.so.1 and importing pynvml;
    pass None to treat one as missing, or an object with the same functions
    (tests). `environ` defaults to os.environ (NVML fallback only).
    """
    if index < 0:
        raise DeviceResolutionError(f"CUDA device index must be >= 0, got {index}")
    driver = _load_libcuda() if libcuda is _LOAD else libcuda
    if driver is not None and all(
        hasattr(driver, symbol) for symbol in ("cuInit", "cuDeviceGetCount", "cuDeviceGet")
    ):
        return _uuid_from_driver(driver, index)
    env = os.environ if environ is None else environ
    try:
        devices = list_nvml_devices(nvml)
    except DeviceResolutionError as error:
        raise DeviceResolutionError(
            f"cannot name CUDA device {index}: the CUDA driver library (libcuda.so.1) is "
            f"not loadable and {error}. Run on a host with the NVIDIA driver (in a "
            "container: the NVIDIA runtime with the 'utility,compute' capabilities), or "
            "set WorkerSpec.device.uuid yourself (nvidia-smi -L)"
        ) from error
    return resolve_cuda_index(
        index, devices, env.get("CUDA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_ORDER")
    )


def cuda_device_name(index: int, *, libcuda: Any = _LOAD) -> str:
    """CUDA's name of device `index` of this process ("NVIDIA H100 80GB HBM3"), or ""
    where the driver cannot say. Call it where `cuda_device_uuid` may be called."""
    driver = _load_libcuda() if libcuda is _LOAD else libcuda
    if driver is None or not hasattr(driver, "cuDeviceGet"):
        return ""
    try:
        _check(driver, driver.cuInit(0), "cuInit")
        device = ctypes.c_int(0)
        _check(driver, driver.cuDeviceGet(ctypes.pointer(device), index), "cuDeviceGet")
        return _device_name(driver, device.value)
    except DeviceResolutionError:
        return ""


def _load_libcuda() -> Any | None:
    name = "nvcuda.dll" if sys.platform.startswith("win") else "libcuda.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _uuid_from_driver(driver: Any, index: int) -> str:
    _check(driver, driver.cuInit(0), "cuInit")
    count = ctypes.c_int(0)
    _check(driver, driver.cuDeviceGetCount(ctypes.pointer(count)), "cuDeviceGetCount")
    if index >= count.value:
        raise DeviceResolutionError(_out_of_range(index, count.value, os.environ))
    device = ctypes.c_int(0)  # CUdevice is an int ordinal
    _check(driver, driver.cuDeviceGet(ctypes.pointer(device), index), "cuDeviceGet")
    raw = _CUuuid()
    # v2 returns a MIG instance's own UUID; v1 (drivers before CUDA 11.4) cannot.
    has_v2 = hasattr(driver, "cuDeviceGetUuid_v2")
    get_uuid = driver.cuDeviceGetUuid_v2 if has_v2 else driver.cuDeviceGetUuid
    _check(driver, get_uuid(ctypes.pointer(raw), device.value), "cuDeviceGetUuid")
    is_mig = _is_mig_name(_device_name(driver, device.value))
    if is_mig and not has_v2:
        raise DeviceResolutionError(
            f"CUDA device {index} is a MIG instance and this driver has no "
            "cuDeviceGetUuid_v2 to name it; upgrade the driver or set "
            "WorkerSpec.device.uuid from nvidia-smi -L"
        )
    return format_device_uuid(bytes(raw.bytes), "MIG-" if is_mig else "GPU-")


def _device_name(driver: Any, device: int) -> str:
    if not hasattr(driver, "cuDeviceGetName"):
        return ""
    buffer = ctypes.create_string_buffer(_NAME_BUFFER)
    _check(driver, driver.cuDeviceGetName(buffer, _NAME_BUFFER, device), "cuDeviceGetName")
    return buffer.value.decode(errors="replace")


def _is_mig_name(name: str) -> bool:
    # CUDA names a MIG instance after its GPU and profile: "NVIDIA A100-SXM4-40GB MIG 1g.5gb".
    return "MIG" in name.split()


def _check(driver: Any, result: int, call: str) -> None:
    if result == CUDA_SUCCESS:
        return
    if result == CUDA_ERROR_NO_DEVICE:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceResolutionError(
            f"{call}: no CUDA device is visible to this process"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
        )
    raise DeviceResolutionError(f"{call} failed: {_cuda_error_name(driver, result)}")


def _cuda_error_name(driver: Any, result: int) -> str:
    if hasattr(driver, "cuGetErrorName"):
        text = ctypes.c_char_p()
        if driver.cuGetErrorName(result, ctypes.pointer(text)) == CUDA_SUCCESS and text.value:
            return f"{text.value.decode(errors='replace')} ({result})"
    return f"CUresult {result}"


# --- the fallback: NVML plus an emulation of CUDA's enumeration ---------------------------


def list_nvml_devices(nvml: Any = _LOAD) -> list[NvmlDevice]:
    """Every physical GPU in NVML order, with its MIG instances.

    `nvml` defaults to importing pynvml; None means it is missing. NVML creates
    no CUDA context. Raises DeviceResolutionError when NVML cannot run.
    """
    if nvml is _LOAD:
        nvml = _import_pynvml()
    if nvml is None:
        raise DeviceResolutionError("NVML is not installed (pip install nvidia-ml-py)")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        raise DeviceResolutionError(f"NVML cannot start ({error})") from error
    try:
        return [
            _nvml_device(nvml, nvml.nvmlDeviceGetHandleByIndex(position))
            for position in range(nvml.nvmlDeviceGetCount())
        ]
    finally:
        nvml.nvmlShutdown()


def _import_pynvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _nvml_device(nvml: Any, handle: Any) -> NvmlDevice:
    try:
        bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except nvml.NVMLError:
        bus_id = ""
    try:
        current_mode, _pending = nvml.nvmlDeviceGetMigMode(handle)
        mig_enabled = bool(current_mode == nvml.NVML_DEVICE_MIG_ENABLE)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
        mig_enabled = False
    mig_uuids: list[str] = []
    if mig_enabled:
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                instance = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError_NotFound:
                continue  # an empty slot
            mig_uuids.append(_text(nvml.nvmlDeviceGetUUID(instance)))
    return NvmlDevice(
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        pci_bus_id=bus_id,
        mig_enabled=mig_enabled,
        mig_uuids=tuple(mig_uuids),
    )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class _Visible:
    """One CUDA device of the process: a whole GPU, or a MIG instance of it."""

    gpu: NvmlDevice | None  # None: a legacy MIG-GPU-<uuid>/<gi>/<ci> entry
    mig_uuid: str = ""
    entry: str = ""  # the CUDA_VISIBLE_DEVICES entry that named it


_DECIMAL = re.compile(r"[0-9]+")
_MixCheck = Callable[[Sequence[NvmlDevice]], None]  # raises where FASTEST_FIRST is unknowable


def resolve_cuda_index(
    index: int,
    nvml_devices: Sequence[NvmlDevice],
    visible_devices: str | None,
    device_order: str | None,
) -> str:
    """The UUID of CUDA device `index`, emulating CUDA's enumeration.

    `nvml_devices` is NVML's list (PCI bus order); `visible_devices` and
    `device_order` are the values of CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER
    (None: unset). The rules, from CUDA's documentation:

    - CUDA_DEVICE_ORDER=PCI_BUS_ID orders devices by PCI bus id, as NVML does.
      The default, FASTEST_FIRST, puts faster models first by a heuristic
      this module does not reproduce; with one model it is PCI order (ties go
      by bus id), so only a mix of models is refused.
    - CUDA_VISIBLE_DEVICES unset: every device. Set but empty: none.
      Otherwise comma-separated entries, whitespace around each ignored, in
      the order they enumerate: an integer (an index into the full order),
      "GPU-" and a full UUID or a prefix matching one GPU, or "MIG-" and a MIG
      instance's full UUID. The first entry that names no device, or names one
      already listed, ends the list; the entries before it stay visible.

    Assumptions where the documentation is silent, chosen to raise rather
    than guess: a MIG entry must be a full UUID (a MIG prefix ends the list);
    with FASTEST_FIRST and several models among the listed GPUs the order is
    refused even when every entry is a UUID; a GPU in MIG mode named as a
    whole GPU (or listed by default) cannot be mapped to an instance, nor can
    the old MIG-GPU-<uuid>/<gi>/<ci> form, when such an entry is at or before
    `index`.
    """
    if index < 0:
        raise DeviceResolutionError(f"CUDA device index must be >= 0, got {index}")
    # Compared exactly, as CUDA reads it: any other value leaves the default.
    fastest_first = device_order != "PCI_BUS_ID"
    ordered = list(nvml_devices)
    if all(device.pci_bus_id for device in ordered):
        # PCI_BUS_ID order, which is also FASTEST_FIRST's order among equal models.
        ordered.sort(key=lambda device: _bus_id_key(device.pci_bus_id))

    def refuse_mixed(devices: Sequence[NvmlDevice]) -> None:
        names = sorted({device.name for device in devices})
        if fastest_first and len(names) > 1:
            raise DeviceResolutionError(
                f"this host mixes GPU models ({', '.join(names)}) and CUDA_DEVICE_ORDER is "
                f"{device_order or 'unset (FASTEST_FIRST)'}, whose order cannot be derived "
                "from NVML: set CUDA_DEVICE_ORDER=PCI_BUS_ID for the worker, or install the "
                "NVIDIA driver's libcuda.so.1 where the worker runs so the driver answers"
            )

    visible: list[_Visible]
    stopped_at = ""
    if visible_devices is None:
        refuse_mixed(ordered)
        visible = [_Visible(device) for device in ordered]
    else:
        visible, stopped_at = _parse_visible(visible_devices, ordered, refuse_mixed)
        refuse_mixed([entry.gpu for entry in visible if entry.gpu is not None])

    if index >= len(visible):
        detail = _out_of_range(index, len(visible), {"CUDA_VISIBLE_DEVICES": visible_devices})
        if stopped_at:
            detail += f"; CUDA stops reading CUDA_VISIBLE_DEVICES at {stopped_at}"
        raise DeviceResolutionError(detail)
    for position, entry in enumerate(visible[: index + 1]):
        if entry.gpu is None:
            raise DeviceResolutionError(
                f"CUDA_VISIBLE_DEVICES entry {entry.entry!r} uses the old "
                "MIG-GPU-<uuid>/<gi>/<ci> form, which NVML cannot map; name the instance "
                "by its MIG-<uuid> (nvidia-smi -L)"
            )
        if entry.gpu.mig_enabled and not entry.mig_uuid:
            raise DeviceResolutionError(
                f"CUDA device {position} is GPU {entry.gpu.uuid}, which is in MIG mode: CUDA "
                "runs on one of its instances, and which cannot be told from NVML. Name the "
                "instance in CUDA_VISIBLE_DEVICES=MIG-<uuid> (nvidia-smi -L), or install "
                "libcuda.so.1 where the worker runs"
            )
    chosen = visible[index]
    assert chosen.gpu is not None  # checked in the loop above
    return chosen.mig_uuid or chosen.gpu.uuid


def _parse_visible(
    spec: str,
    ordered: Sequence[NvmlDevice],
    refuse_mixed: _MixCheck,
) -> tuple[list[_Visible], str]:
    """The devices CUDA_VISIBLE_DEVICES lists, and why parsing stopped ("" if it did not)."""
    if spec == "":
        return [], ""
    visible: list[_Visible] = []
    seen: set[str] = set()
    for raw_entry in spec.split(","):
        entry = raw_entry.strip()
        found = _lookup(entry, ordered, refuse_mixed)
        if found is None:
            return visible, f"{entry!r}, which names no device"
        key = found.mig_uuid or (found.gpu.uuid if found.gpu else entry)
        if key in seen:
            return visible, f"{entry!r}, which repeats a device"
        seen.add(key)
        visible.append(found)
    return visible, ""


def _lookup(entry: str, ordered: Sequence[NvmlDevice], refuse_mixed: _MixCheck) -> _Visible | None:
    if _DECIMAL.fullmatch(entry):
        # An index into the full order, which FASTEST_FIRST makes unknowable with mixed models.
        refuse_mixed(ordered)
        position = int(entry)
        return _Visible(ordered[position], entry=entry) if position < len(ordered) else None
    if entry.startswith("MIG-GPU-"):
        return _Visible(None, entry=entry)
    if entry.startswith("MIG-"):
        for device in ordered:
            for mig_uuid in device.mig_uuids:
                if mig_uuid == entry:
                    return _Visible(device, mig_uuid=mig_uuid, entry=entry)
        return None
    if entry.startswith("GPU-"):
        matches = [device for device in ordered if device.uuid.startswith(entry)]
        return _Visible(matches[0], entry=entry) if len(matches) == 1 else None
    return None


def _bus_id_key(bus_id: str) -> tuple[int, ...]:
    # "00000000:07:00.0" (NVML) or "0000:07:00.0": compare the numbers, not the text.
    parts = re.split(r"[:.]", bus_id.strip())
    try:
        return tuple(int(part, 16) for part in parts)
    except ValueError:
        return (sys.maxsize,)


def _out_of_range(index: int, count: int, environ: Mapping[str, str | None]) -> str:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    where = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"CUDA device {index} does not exist: {count} visible{where}"


__all__ = [
    "DeviceResolutionError",
    "NvmlDevice",
    "cuda_device_uuid",
    "format_device_uuid",
    "list_nvml_devices",
    "resolve_cuda_index",
]
