"""The device probes: NVML (through a fake pynvml), torch.cuda (a fake), static."""

from __future__ import annotations

import inspect
import json
import logging
import subprocess
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pynvml
import pytest

from kvplan.gpus import GPU_MEMORY_BYTES
from kvplan.server.devices import parse_inventory
from kvplan.server.probes import (
    DeviceMemory,
    NvmlProbe,
    ProbeUnavailable,
    StaticProbe,
    TorchProbe,
    open_probe,
)
from tests.fake_nvml import FAKED_FUNCTIONS, GIB, FakeGpu, FakeNvml

H100 = GPU_MEMORY_BYTES["H100-80GB"]


def test_fake_matches_pynvml() -> None:
    """Every faked function exists in pynvml with the same parameters."""
    fake = FakeNvml([]).module()
    for name in FAKED_FUNCTIONS:
        real = inspect.signature(getattr(pynvml, name))
        faked = inspect.signature(getattr(fake, name))
        assert list(faked.parameters) == list(real.parameters), name
    assert fake.NVMLError_NotFound is pynvml.NVMLError_NotFound
    assert fake.NVML_DEVICE_MIG_ENABLE == pynvml.NVML_DEVICE_MIG_ENABLE == 1


# --- NVML ----------------------------------------------------------------------------


def two_gpus() -> list[FakeGpu]:
    return [
        # NVML: 80 GiB in all, 512 MiB of it reserved by the driver, 9.5 GiB used.
        FakeGpu("GPU-aaaaaaaa-0000-0000-0000-000000000000", used=9 * GIB + (512 << 20)),
        FakeGpu("GPU-bbbbbbbb-0000-0000-0000-000000000000", name_as_bytes=True),
    ]


def test_nvml_plain_gpus_with_v2_memory() -> None:
    driver = FakeNvml(two_gpus())
    probe = NvmlProbe(driver.module())
    first, second = probe.snapshot()
    assert probe.name == "nvml"
    # The total is CUDA's: NVML's less the driver's reservation.
    assert first == DeviceMemory(
        uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000",
        name="NVIDIA H100 80GB HBM3",
        index=0,
        total_bytes=80 * GIB - (512 << 20),
        free_bytes=70 * GIB,
        used_bytes=9 * GIB + (512 << 20),
        reserved_bytes=512 << 20,
    )
    assert first.total_bytes == first.free_bytes + first.used_bytes
    assert second.index == 1
    assert second.name == "NVIDIA H100 80GB HBM3"  # bytes from the binding, decoded
    assert second.reserved_bytes == 512 << 20
    assert driver.calls.count("memory_v2") == 2
    assert "memory_v1" not in driver.calls
    assert driver.calls.count("nvmlInit") == 1


def test_nvml_total_is_what_cuda_reports_on_an_h200() -> None:
    """NVML's v2 reading and torch.cuda.mem_get_info on one H200, side by side
    (scripts/gpu-check, docs/gpu-check.md): the probe's total must be torch's, since
    vLLM budgets gpu_memory_utilization x torch's total."""
    reading = FakeGpu(
        "GPU-775c3238-4bcb-be23-7fd3-7ab35a4c08e1",
        name="NVIDIA H200",
        total=150_754_820_096,
        used=3_407_872,
        reserved=644_939_776,
    )
    assert reading.free == 150_106_472_448  # NVML's own free figure in that reading
    (device,) = NvmlProbe(FakeNvml([reading]).module()).snapshot()
    assert device.total_bytes == 150_109_880_320  # torch.cuda.mem_get_info's total
    assert device.free_bytes == 150_106_472_448


def test_nvml_snapshot_is_fresh() -> None:
    driver = FakeNvml(two_gpus())
    probe = NvmlProbe(driver.module())
    assert probe.snapshot()[0].free_bytes == 70 * GIB
    driver.gpus[0].used += 60 * GIB
    assert probe.snapshot()[0].free_bytes == 10 * GIB


def test_nvml_driver_without_v2_falls_back_to_v1_once() -> None:
    driver = FakeNvml(two_gpus(), memory_v2="no_symbol")
    probe = NvmlProbe(driver.module())
    first, second = probe.snapshot()
    # v1 counts the reservation as used and in the total: it cannot be taken out.
    assert (first.total_bytes, first.free_bytes, first.used_bytes) == (80 * GIB, 70 * GIB, 10 * GIB)
    assert first.reserved_bytes == 0 and second.reserved_bytes == 0
    probe.snapshot()
    # v2 was asked once; the driver's answer holds for every later reading.
    assert driver.calls.count("memory_v2") == 1
    assert driver.calls.count("memory_v1") == 4


@pytest.mark.parametrize(
    ("memory_v2", "has_constant"),
    [("no_version_arg", True), ("supported", False), ("not_supported", True)],
    ids=["old-module-no-version-arg", "old-module-no-constant", "device-not-supported"],
)
def test_nvml_other_v1_fallbacks(memory_v2: str, has_constant: bool) -> None:
    driver = FakeNvml(two_gpus(), memory_v2=memory_v2, has_v2_constant=has_constant)
    first, _second = NvmlProbe(driver.module()).snapshot()
    assert (first.total_bytes, first.free_bytes, first.reserved_bytes) == (80 * GIB, 70 * GIB, 0)
    assert driver.calls.count("memory_v1") == 2


def test_nvml_mig_instances_replace_their_gpu() -> None:
    parent = "GPU-11111111-0000-0000-0000-000000000000"
    gpus = [
        FakeGpu(
            parent,
            name="NVIDIA A100-SXM4-80GB",
            mig_supported=True,
            mig_enabled=True,
            mig_slots=[
                FakeGpu("MIG-aaaaaaaa-1111-1111-1111-111111111111", "A100 MIG 3g.40gb", 40 * GIB),
                None,  # an empty slot
                FakeGpu(
                    "MIG-bbbbbbbb-2222-2222-2222-222222222222",
                    "A100 MIG 1g.10gb",
                    10 * GIB,
                    reserved=0,
                ),
            ],
        ),
        FakeGpu("GPU-22222222-0000-0000-0000-000000000000", mig_supported=False),
        FakeGpu("GPU-33333333-0000-0000-0000-000000000000", mig_supported=True),  # MIG off
    ]
    devices = NvmlProbe(FakeNvml(gpus).module()).snapshot()
    assert [device.uuid for device in devices] == [
        "MIG-aaaaaaaa-1111-1111-1111-111111111111",
        "MIG-bbbbbbbb-2222-2222-2222-222222222222",
        "GPU-22222222-0000-0000-0000-000000000000",
        "GPU-33333333-0000-0000-0000-000000000000",
    ]
    assert [device.parent_uuid for device in devices] == [parent, parent, "", ""]
    assert [device.index for device in devices] == [0, 0, 1, 2]  # the parent's NVML index
    # Each instance's own total, less what the driver reserves of it.
    assert [device.total_bytes for device in devices[:2]] == [40 * GIB - (512 << 20), 10 * GIB]
    assert devices[1].name == "A100 MIG 1g.10gb"


def test_nvml_mig_mode_without_instances_reports_nothing_for_that_gpu() -> None:
    gpus = [FakeGpu("GPU-1", mig_supported=True, mig_enabled=True, mig_slots=[None, None])]
    assert NvmlProbe(FakeNvml(gpus).module()).snapshot() == ()


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "no loaded NVIDIA kernel driver"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions"),
    ],
)
def test_nvml_init_failures_are_probe_unavailable(code: int, words: str) -> None:
    driver = FakeNvml(two_gpus(), init_error=code)
    with pytest.raises(ProbeUnavailable, match=words) as raised:
        NvmlProbe(driver.module())
    assert isinstance(raised.value.__cause__, pynvml.NVMLError)
    assert "nvmlShutdown" not in driver.calls


def test_nvml_missing_module_is_probe_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(ProbeUnavailable, match="nvidia-ml-py"):
        NvmlProbe()


def test_nvml_close_shuts_down_once() -> None:
    driver = FakeNvml(two_gpus())
    probe = NvmlProbe(driver.module())
    probe.close()
    probe.close()
    assert driver.calls.count("nvmlShutdown") == 1


def test_nvml_default_imports_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(two_gpus()).module())
    assert len(NvmlProbe().snapshot()) == 2


# --- choosing a probe ----------------------------------------------------------------


def test_auto_falls_back_to_empty_static_without_nvml(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setitem(sys.modules, "pynvml", broken.module())
    with caplog.at_level(logging.WARNING, logger="kvplan.server.probes"):
        probe = open_probe("auto", "")
    assert probe.name == "static"
    assert probe.snapshot() == ()
    warning = next(record for record in caplog.records if record.levelno == logging.WARNING)
    assert "libnvidia-ml.so.1" in warning.getMessage()
    assert "--devices" in warning.getMessage()


def test_auto_uses_nvml_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(two_gpus()).module())
    probe = open_probe("auto", "")
    assert probe.name == "nvml"
    assert len(probe.snapshot()) == 2


def test_auto_with_an_inventory_is_static(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeNvml(two_gpus())
    monkeypatch.setitem(sys.modules, "pynvml", driver.module())
    probe = open_probe("auto", "3xL4-24GB")
    assert probe.name == "static"
    assert len(probe.snapshot()) == 3
    assert driver.calls == []  # NVML was never touched


def test_explicit_probes_raise_when_they_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    monkeypatch.setitem(sys.modules, "pynvml", broken.module())
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ProbeUnavailable, match="driver"):
        open_probe("nvml", "")
    with pytest.raises(ProbeUnavailable, match="PyTorch"):
        open_probe("torch", "")
    with pytest.raises(ValueError, match="unknown probe 'cuda'"):
        open_probe("cuda", "")
    assert open_probe("static", "").snapshot() == ()


def test_probe_module_imports_neither_torch_nor_pynvml() -> None:
    code = (
        "import sys, kvplan.server.probes\n"
        "assert 'torch' not in sys.modules and 'pynvml' not in sys.modules, sys.modules.keys()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- static --------------------------------------------------------------------------


def test_static_short_form() -> None:
    probe = open_probe("static", "2xH100-80GB")
    first, second = probe.snapshot()
    assert (first.index, second.index) == (0, 1)
    for device in (first, second):
        assert device.name == "H100-80GB"
        assert device.total_bytes == device.free_bytes == H100
        assert device.used_bytes == device.reserved_bytes == 0
        assert device.parent_uuid == ""
        assert device.uuid.startswith("GPU-")
        uuid.UUID(device.uuid.removeprefix("GPU-"))
    assert first.uuid != second.uuid
    # Deterministic: the same inventory names the same devices, on any host.
    assert open_probe("static", "2xH100-80GB").snapshot() == probe.snapshot()
    assert StaticProbe(parse_inventory("2xH100-80GB")).snapshot() == probe.snapshot()


def test_static_mixed_inventory_counts_indexes_across_entries() -> None:
    devices = open_probe("static", "2xH100-80GB, 1xl4-24gb").snapshot()
    assert [device.index for device in devices] == [0, 1, 2]
    assert devices[2].total_bytes == GPU_MEMORY_BYTES["L4-24GB"]
    # Extending an inventory keeps the UUIDs of the devices it already had.
    assert devices[:2] == open_probe("static", "2xH100-80GB").snapshot()


def test_static_json_file(tmp_path: Path) -> None:
    spec = tmp_path / "gpus.json"
    spec.write_text(
        json.dumps(
            [
                {"name": "H100-80GB"},
                {"name": "H100-80GB", "uuid": "GPU-fixed-uuid-1"},
                {"name": "lab-card", "total_bytes": 12 * GIB},
            ]
        )
    )
    devices = open_probe("static", str(spec)).snapshot()
    assert [device.uuid for device in devices][1] == "GPU-fixed-uuid-1"
    assert [device.total_bytes for device in devices] == [H100, H100, 12 * GIB]
    assert devices[2].free_bytes == 12 * GIB
    # A file and the short form describe the same first device the same way.
    assert devices[0] == open_probe("static", "1xH100-80GB").snapshot()[0]
    assert open_probe("static", str(spec)).snapshot() == devices


def test_static_yaml_file(tmp_path: Path) -> None:
    spec = tmp_path / "gpus.yaml"
    spec.write_text(
        "devices:\n"
        "  - name: H100-80GB\n"
        "  - name: H100-80GB\n"
        "  - name: A100-40GB\n"
        "    uuid: GPU-my-a100\n"
    )
    devices = open_probe("static", str(spec)).snapshot()
    assert [device.name for device in devices] == ["H100-80GB", "H100-80GB", "A100-40GB"]
    assert devices[2].uuid == "GPU-my-a100"
    assert devices[:2] == open_probe("static", "2xH100-80GB").snapshot()


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("2xNOPE-1GB", "unknown GPU 'NOPE-1GB'"),
        ("8xH100 80GB", "bad device inventory entry"),
        ("missing.yaml", "does not exist"),
    ],
)
def test_static_bad_inventories(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        open_probe("static", spec)


def test_static_file_entries_are_checked(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps([{"name": "mystery-card"}]))
    with pytest.raises(ValueError, match="total_bytes"):
        parse_inventory(str(unknown))
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps([{"name": "L4-24GB", "uuid": "GPU-x"}] * 2))
    with pytest.raises(ValueError, match="distinct"):
        parse_inventory(str(twice))


# --- torch.cuda ----------------------------------------------------------------------


class FakeCuUuid:
    """Like torch's _CUuuid: str() is the bare UUID."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


class FakeTorchCuda:
    """The four torch.cuda functions the probe calls."""

    def __init__(self, devices: list[tuple[str, Any, int, int]], available: bool = True) -> None:
        self.devices = devices  # (name, uuid, free, total)
        self.available = available
        self.memory_queries: list[int] = []

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return len(self.devices)

    def get_device_properties(self, device: int) -> Any:
        name, device_uuid, _free, total = self.devices[device]
        return types.SimpleNamespace(name=name, uuid=device_uuid, total_memory=total)

    def mem_get_info(self, device: int) -> tuple[int, int]:
        self.memory_queries.append(device)
        _name, _uuid, free, total = self.devices[device]
        return free, total


def test_torch_probe_reads_each_device() -> None:
    cuda = FakeTorchCuda(
        [
            ("NVIDIA H100 80GB HBM3", FakeCuUuid("58e4a5ff-0000-1111-2222-333344445555"), 70, 80),
            ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", FakeCuUuid("0badc0de-0000-1111-2222-3"), 4, 5),
            ("NVIDIA L4", "GPU-already-prefixed", 20, 24),
        ]
    )
    probe = TorchProbe(cuda)
    devices = probe.snapshot()
    assert probe.name == "torch"
    assert devices[0] == DeviceMemory(
        uuid="GPU-58e4a5ff-0000-1111-2222-333344445555",
        name="NVIDIA H100 80GB HBM3",
        index=0,
        total_bytes=80,
        free_bytes=70,
        used_bytes=10,
    )
    assert devices[1].uuid == "MIG-0badc0de-0000-1111-2222-3"
    assert devices[2].uuid == "GPU-already-prefixed"
    assert [device.index for device in devices] == [0, 1, 2]
    probe.snapshot()
    assert cuda.memory_queries == [0, 1, 2, 0, 1, 2]
    probe.close()


def test_torch_without_cuda_is_probe_unavailable() -> None:
    with pytest.raises(ProbeUnavailable, match="is_available"):
        TorchProbe(FakeTorchCuda([], available=False))


def test_torch_missing_is_probe_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ProbeUnavailable, match=r"kvplan\[torch\]"):
        TorchProbe()


def test_torch_default_imports_torch_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = types.ModuleType("torch")
    torch.cuda = FakeTorchCuda([("NVIDIA L4", FakeCuUuid("1234"), 1, 2)])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert TorchProbe().snapshot()[0].uuid == "GPU-1234"
