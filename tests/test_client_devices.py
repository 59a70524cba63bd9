"""kvplan.client.devices: CUDA index -> device UUID, by the driver or by emulation."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import uuid
from typing import Any

import pynvml
import pytest

from kvplan.client import devices as client_devices
from kvplan.client.devices import (
    DeviceResolutionError,
    NvmlDevice,
    cuda_device_uuid,
    format_device_uuid,
    list_nvml_devices,
    resolve_cuda_index,
)
from tests.fake_nvml import FakeGpu, FakeNvml

UUIDS = [f"GPU-{digit * 8}-1111-2222-3333-444444444444" for digit in "abcd"]
H100 = "NVIDIA H100 80GB HBM3"
L4 = "NVIDIA L4"


def four_h100() -> list[NvmlDevice]:
    return [
        NvmlDevice(device_uuid, H100, f"00000000:{bus:02X}:00.0")
        for device_uuid, bus in zip(UUIDS, (0x07, 0x0B, 0x48, 0x4C), strict=True)
    ]


def resolve(index: int, visible: str | None, order: str | None = None) -> str:
    return resolve_cuda_index(index, four_h100(), visible, order)


# --- CUDA_VISIBLE_DEVICES --------------------------------------------------------------


def test_unset_means_every_device_in_pci_order() -> None:
    assert [resolve(i, None) for i in range(4)] == UUIDS
    with pytest.raises(DeviceResolutionError, match="CUDA device 4 does not exist: 4 visible"):
        resolve(4, None)


def test_empty_means_no_device() -> None:
    with pytest.raises(DeviceResolutionError, match="0 visible with CUDA_VISIBLE_DEVICES=''"):
        resolve(0, "")


def test_indices_reorder() -> None:
    assert resolve(0, "2,0") == UUIDS[2]
    assert resolve(1, "2,0") == UUIDS[0]
    assert resolve(0, " 3 , 1 ") == UUIDS[3]  # whitespace around entries is ignored
    assert resolve(1, " 3 , 1 ") == UUIDS[1]
    with pytest.raises(DeviceResolutionError, match="2 visible"):
        resolve(2, "2,0")


def test_uuid_full_and_unique_prefix() -> None:
    assert resolve(0, UUIDS[3]) == UUIDS[3]
    assert resolve(0, "GPU-bbbb") == UUIDS[1]
    assert resolve(1, f"GPU-cc,{UUIDS[0]}") == UUIDS[0]


def test_ambiguous_or_unknown_uuid_ends_the_list() -> None:
    devices = [*four_h100(), NvmlDevice("GPU-abcdef00-0000-0000-0000-000000000000", H100)]
    assert resolve_cuda_index(0, devices, "2,GPU-a,1", None) == UUIDS[2]  # prefix of two GPUs
    with pytest.raises(DeviceResolutionError, match=r"stops reading .* at 'GPU-a'"):
        resolve_cuda_index(1, devices, "2,GPU-a,1", None)
    with pytest.raises(DeviceResolutionError, match="names no device"):
        resolve(1, "0,GPU-ffff,1")
    with pytest.raises(DeviceResolutionError, match="names no device"):
        resolve(0, "aaaaaaaa-1111-2222-3333-444444444444")  # a UUID needs its GPU- prefix


def test_invalid_entry_truncates() -> None:
    # CUDA's own example: 0,2,-1,1 leaves devices 0 and 2.
    assert resolve(0, "0,2,-1,1") == UUIDS[0]
    assert resolve(1, "0,2,-1,1") == UUIDS[2]
    with pytest.raises(DeviceResolutionError, match=r"2 visible.*'-1'"):
        resolve(2, "0,2,-1,1")


def test_out_of_range_index_entry_truncates() -> None:
    assert resolve(0, "1,7,2") == UUIDS[1]
    with pytest.raises(DeviceResolutionError, match="'7', which names no device"):
        resolve(1, "1,7,2")


def test_duplicate_truncates() -> None:
    assert resolve(1, "1,3,1,0") == UUIDS[3]
    with pytest.raises(DeviceResolutionError, match="repeats a device"):
        resolve(2, "1,3,1,0")
    with pytest.raises(DeviceResolutionError, match="repeats a device"):
        resolve(1, f"0,{UUIDS[0]}")  # the same GPU by index and by UUID


def test_negative_index() -> None:
    with pytest.raises(DeviceResolutionError, match=">= 0"):
        resolve(-1, None)


# --- MIG -------------------------------------------------------------------------------

MIG_A = "MIG-aaaaaaaa-5555-6666-7777-888888888888"
MIG_B = "MIG-bbbbbbbb-5555-6666-7777-888888888888"


def mig_host() -> list[NvmlDevice]:
    a100 = "NVIDIA A100-SXM4-80GB"
    return [
        NvmlDevice(UUIDS[0], a100, "00000000:07:00.0", mig_enabled=True, mig_uuids=(MIG_A, MIG_B)),
        NvmlDevice(UUIDS[1], a100, "00000000:0B:00.0"),
    ]


def test_mig_uuid_entries() -> None:
    assert resolve_cuda_index(0, mig_host(), MIG_B, None) == MIG_B
    assert resolve_cuda_index(1, mig_host(), f"{MIG_A},1", None) == UUIDS[1]
    assert resolve_cuda_index(0, mig_host(), f"{MIG_A},{MIG_A}", None) == MIG_A
    with pytest.raises(DeviceResolutionError, match="repeats"):
        resolve_cuda_index(1, mig_host(), f"{MIG_A},{MIG_A}", None)
    # A MIG entry must be a full UUID.
    with pytest.raises(DeviceResolutionError, match="names no device"):
        resolve_cuda_index(0, mig_host(), "MIG-aaaa", None)


def test_a_gpu_in_mig_mode_cannot_be_mapped_to_an_instance() -> None:
    for visible in (None, "0", UUIDS[0]):
        with pytest.raises(DeviceResolutionError, match="MIG mode"):
            resolve_cuda_index(0, mig_host(), visible, None)
    # It is only refused where it matters: a device listed before it still resolves.
    assert resolve_cuda_index(0, mig_host(), "1,0", None) == UUIDS[1]


def test_legacy_mig_form_is_refused() -> None:
    legacy = f"MIG-{UUIDS[0]}/1/0"
    with pytest.raises(DeviceResolutionError, match="old MIG-GPU"):
        resolve_cuda_index(0, mig_host(), legacy, None)
    assert resolve_cuda_index(0, mig_host(), f"1,{legacy}", None) == UUIDS[1]


# --- CUDA_DEVICE_ORDER -----------------------------------------------------------------


def mixed_host() -> list[NvmlDevice]:
    # NVML lists them in bus order: the L4 first, then the H100.
    return [
        NvmlDevice(UUIDS[0], L4, "00000000:07:00.0"),
        NvmlDevice(UUIDS[1], H100, "0000:0B:00.0"),
    ]


@pytest.mark.parametrize("order", [None, "FASTEST_FIRST", "pci_bus_id"])
@pytest.mark.parametrize("visible", [None, "0", "1,0", f"{UUIDS[0]},{UUIDS[1]}"])
def test_mixed_models_need_pci_bus_id(order: str | None, visible: str | None) -> None:
    with pytest.raises(DeviceResolutionError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        resolve_cuda_index(0, mixed_host(), visible, order)


def test_mixed_models_in_pci_bus_id_order() -> None:
    assert resolve_cuda_index(0, mixed_host(), None, "PCI_BUS_ID") == UUIDS[0]
    assert resolve_cuda_index(1, mixed_host(), None, "PCI_BUS_ID") == UUIDS[1]
    assert resolve_cuda_index(0, mixed_host(), "1", "PCI_BUS_ID") == UUIDS[1]


def test_mixed_models_one_device_named_by_uuid_needs_no_order() -> None:
    assert resolve_cuda_index(0, mixed_host(), UUIDS[1], None) == UUIDS[1]


@pytest.mark.parametrize("order", [None, "FASTEST_FIRST", "PCI_BUS_ID"])
def test_identical_models_any_order(order: str | None) -> None:
    assert [resolve(i, None, order) for i in range(4)] == UUIDS
    assert resolve(0, "3,2", order) == UUIDS[3]


def test_pci_order_sorts_by_bus_number_not_by_nvml_position() -> None:
    shuffled = list(reversed(four_h100()))
    assert [resolve_cuda_index(i, shuffled, None, "PCI_BUS_ID") for i in range(4)] == UUIDS


# --- the CUDA driver path ----------------------------------------------------------------


class FakeLibcuda:
    """The CUDA driver entry points cuda_device_uuid calls, as a ctypes library
    exposes them: each takes C arguments and returns a CUresult."""

    def __init__(
        self,
        devices: list[tuple[bytes, str]],
        *,
        init_result: int = 0,
        has_v2: bool = True,
    ) -> None:
        self.devices = devices  # (16 raw UUID bytes, CUDA device name)
        self.init_result = init_result
        self.calls: list[str] = []
        self._error_names: list[bytes] = []  # kept alive for the c_char_p handed out
        if has_v2:
            self.cuDeviceGetUuid_v2 = self._get_uuid_v2

    def cuInit(self, flags: int) -> int:
        self.calls.append(f"cuInit({flags})")
        return self.init_result

    def cuDeviceGetCount(self, count: Any) -> int:
        count.contents.value = len(self.devices)
        return 0

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:
        self.calls.append(f"cuDeviceGet({ordinal})")
        if ordinal >= len(self.devices):
            return client_devices.CUDA_ERROR_INVALID_DEVICE
        device.contents.value = ordinal
        return 0

    def cuDeviceGetUuid(self, uuid_out: Any, device: int) -> int:
        self.calls.append("cuDeviceGetUuid")
        uuid_out.contents.bytes[:] = self.devices[device][0]
        return 0

    def _get_uuid_v2(self, uuid_out: Any, device: int) -> int:
        self.calls.append("cuDeviceGetUuid_v2")
        uuid_out.contents.bytes[:] = self.devices[device][0]
        return 0

    def cuDeviceGetName(self, name: Any, length: int, device: int) -> int:
        name.value = self.devices[device][1].encode()[: length - 1]
        return 0

    def cuGetErrorName(self, result: int, text: Any) -> int:
        self._error_names.append(b"CUDA_ERROR_UNKNOWN" if result == 999 else b"")
        text.contents.value = self._error_names[-1]
        return 0


RAW = bytes(range(16))


def test_format_device_uuid() -> None:
    assert format_device_uuid(RAW) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert format_device_uuid(RAW) == f"GPU-{uuid.UUID(bytes=RAW)}"
    assert format_device_uuid(RAW, "MIG-").startswith("MIG-00010203-")
    with pytest.raises(ValueError, match="16 bytes"):
        format_device_uuid(b"short")


def test_driver_path_formats_the_raw_uuid() -> None:
    lib = FakeLibcuda([(bytes(16), H100), (RAW, H100)])
    assert cuda_device_uuid(1, libcuda=lib, nvml=None) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert lib.calls == ["cuInit(0)", "cuDeviceGet(1)", "cuDeviceGetUuid_v2"]


def test_driver_path_names_a_mig_instance() -> None:
    lib = FakeLibcuda([(RAW, "NVIDIA A100-SXM4-40GB MIG 1g.5gb")])
    assert cuda_device_uuid(0, libcuda=lib, nvml=None) == "MIG-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_driver_without_v2_uses_v1() -> None:
    lib = FakeLibcuda([(RAW, H100)], has_v2=False)
    assert cuda_device_uuid(0, libcuda=lib, nvml=None) == format_device_uuid(RAW)
    assert "cuDeviceGetUuid" in lib.calls
    mig = FakeLibcuda([(RAW, "NVIDIA A100-SXM4-40GB MIG 1g.5gb")], has_v2=False)
    with pytest.raises(DeviceResolutionError, match="cuDeviceGetUuid_v2"):
        cuda_device_uuid(0, libcuda=mig, nvml=None)


def test_driver_path_errors() -> None:
    lib = FakeLibcuda([(RAW, H100)])
    with pytest.raises(DeviceResolutionError, match="CUDA device 3 does not exist: 1 visible"):
        cuda_device_uuid(3, libcuda=lib, nvml=None)
    assert "cuDeviceGet(3)" not in lib.calls
    none_visible = FakeLibcuda([], init_result=client_devices.CUDA_ERROR_NO_DEVICE)
    with pytest.raises(DeviceResolutionError, match="no CUDA device is visible"):
        cuda_device_uuid(0, libcuda=none_visible, nvml=None)
    broken = FakeLibcuda([(RAW, H100)], init_result=999)
    with pytest.raises(DeviceResolutionError, match=r"cuInit failed: CUDA_ERROR_UNKNOWN \(999\)"):
        cuda_device_uuid(0, libcuda=broken, nvml=None)
    with pytest.raises(DeviceResolutionError, match=">= 0"):
        cuda_device_uuid(-1, libcuda=lib, nvml=None)


# --- the NVML fallback ---------------------------------------------------------------------


def fake_nvml_host() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(UUIDS[0], pci_bus_id="00000000:07:00.0"),
            FakeGpu(
                UUIDS[1],
                pci_bus_id="00000000:0B:00.0",
                mig_supported=True,
                mig_enabled=True,
                mig_slots=[None, FakeGpu(MIG_A)],
            ),
        ]
    )


def test_list_nvml_devices() -> None:
    driver = fake_nvml_host()
    assert list_nvml_devices(driver.module()) == [
        NvmlDevice(UUIDS[0], H100, "00000000:07:00.0"),
        NvmlDevice(UUIDS[1], H100, "00000000:0B:00.0", mig_enabled=True, mig_uuids=(MIG_A,)),
    ]
    assert driver.calls == ["nvmlInit", "nvmlShutdown"]


def test_without_libcuda_nvml_and_the_environment_decide() -> None:
    nvml = fake_nvml_host().module()
    env = {"CUDA_VISIBLE_DEVICES": f"{MIG_A},0"}
    assert cuda_device_uuid(0, libcuda=None, nvml=nvml, environ=env) == MIG_A
    assert cuda_device_uuid(1, libcuda=None, nvml=nvml, environ=env) == UUIDS[0]
    assert cuda_device_uuid(0, libcuda=None, nvml=nvml, environ={}) == UUIDS[0]
    # A library object without the driver's entry points counts as missing.
    assert cuda_device_uuid(0, libcuda=object(), nvml=nvml, environ={}) == UUIDS[0]


@pytest.mark.parametrize(
    "nvidia_visible",
    [UUIDS[2], "void", None],
    ids=["device-plugin-envvar-uuid", "dra-cdi", "unset"],
)
def test_in_a_pod_the_container_sees_only_its_gpu(nvidia_visible: str | None) -> None:
    """In a Kubernetes pod the runtime mounts only the allocated GPU, so the container's
    NVML lists that one. NVIDIA_VISIBLE_DEVICES (the device plugin's UUIDs; `void`
    under the DRA driver's CDI spec, docs/kubernetes.md#wiring-vllm) is read by the
    container runtime, not by CUDA: the UUID follows from CUDA's view alone."""
    nvml = FakeNvml([FakeGpu(UUIDS[2], pci_bus_id="00000000:48:00.0")]).module()
    env = {} if nvidia_visible is None else {"NVIDIA_VISIBLE_DEVICES": nvidia_visible}
    assert cuda_device_uuid(0, libcuda=None, nvml=nvml, environ=env) == UUIDS[2]
    with pytest.raises(DeviceResolutionError, match="CUDA device 1 does not exist: 1 visible"):
        cuda_device_uuid(1, libcuda=None, nvml=nvml, environ=env)


def test_without_libcuda_or_nvml() -> None:
    with pytest.raises(
        DeviceResolutionError, match=r"libcuda\.so\.1.*NVML is not installed"
    ) as raised:
        cuda_device_uuid(0, libcuda=None, nvml=None)
    assert isinstance(raised.value, LookupError)
    stopped = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).module()
    with pytest.raises(DeviceResolutionError, match="NVML cannot start"):
        cuda_device_uuid(0, libcuda=None, nvml=stopped)


def test_default_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default libcuda.so.1 is loaded through ctypes and pynvml imported lazily."""
    loaded: list[str] = []

    def no_library(name: str) -> Any:
        loaded.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(DeviceResolutionError, match="not loadable"):
        cuda_device_uuid(0)
    assert loaded == ["libcuda.so.1"]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml_host().module())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert cuda_device_uuid(0) == UUIDS[0]


def test_imports_with_only_the_client_dependencies() -> None:
    blocked = ("pynvml", "torch", "prometheus_client", "yaml", "redis", "kvplan.server")
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # import of it now raises ImportError\n"
        "import kvplan.client.devices as devices\n"
        "assert devices.resolve_cuda_index(0, [devices.NvmlDevice('GPU-1', 'x')], None, None)"
        " == 'GPU-1'\n"
        "try:\n"
        "    devices.cuda_device_uuid(0, libcuda=None)\n"
        "except devices.DeviceResolutionError as error:\n"
        "    assert 'NVML is not installed' in str(error), error\n"
        "else:\n"
        "    raise AssertionError('resolved without libcuda or NVML')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
