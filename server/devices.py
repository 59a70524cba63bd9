"""The static device inventory (hosts without GPUs, capacity planning, tests)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvplan.gpus import GPU_MEMORY_BYTES

_SHORT_FORM = re.compile(r"^(?:(\d+)\s*[xX]\s*)?([A-Za-z0-9][A-Za-z0-9_.-]*)$")
_NAMESPACE = uuid.UUID("6f1d8a52-4c8e-4f0e-9b1a-6b7c0d2e9a11")


@dataclass(frozen=True)
class Device:
    uuid: str
    name: str
    index: int
    total_bytes: int


def _device(name: str, index: int, total: int) -> Device:
    # Deterministic UUIDs: the same inventory string names the same devices.
    return Device(f"GPU-{uuid.uuid5(_NAMESPACE, f'{name}/{index}')}", name, index, total)


def parse_inventory(spec: str) -> list[Device]:
    """`8xH100-80GB`, `2xH100-80GB,1xL4-24GB`, or a YAML/JSON file listing
    {name, total_bytes, uuid?} entries."""
    if not spec:
        return []
    path = Path(spec)
    if path.suffix.lower() in (".json", ".yaml", ".yml"):
        if not path.is_file():
            raise ValueError(f"device inventory file {spec!r} does not exist")
        return _from_file(path)
    devices: list[Device] = []
    for part in spec.split(","):
        match = _SHORT_FORM.match(part.strip())
        if match is None:
            raise ValueError(f"bad device inventory entry {part!r}; expected e.g. 8xH100-80GB")
        count = int(match.group(1) or 1)
        name = match.group(2)
        total = _known_size(name)
        first = len(devices)  # fixed before extend: a generator would see the list grow
        devices.extend(_device(name, first + offset, total) for offset in range(count))
    return devices


def _known_size(name: str) -> int:
    sizes = {key.lower(): value for key, value in GPU_MEMORY_BYTES.items()}
    if name.lower() not in sizes:
        raise ValueError(
            f"unknown GPU {name!r}; known: {', '.join(sorted(GPU_MEMORY_BYTES))} "
            "(or give total_bytes in an inventory file)"
        )
    return sizes[name.lower()]


def _from_file(path: Path) -> list[Device]:
    text = path.read_text()
    if path.suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml  # PyYAML: a server extra, needed only for YAML inventories

        data = yaml.safe_load(text)
    entries = data.get("devices", data) if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of devices (or {{devices: [...]}})")
    devices = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ValueError(f"{path}: device {index} needs a name, e.g. {{name: H100-80GB}}")
        name = str(entry["name"])
        total = int(entry.get("total_bytes") or _known_size(name))
        device = _device(name, index, total)
        if entry.get("uuid"):
            device = Device(str(entry["uuid"]), name, index, total)
        devices.append(device)
    uuids = [device.uuid for device in devices]
    if len(set(uuids)) != len(uuids):
        raise ValueError(f"{path}: device uuids must be distinct")
    return devices
