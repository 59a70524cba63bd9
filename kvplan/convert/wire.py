"""Wire decoding: fast paths on a request's serialized bytes.

A worker is serialized once per request (`WorkerBytes`): the plan id hashes those
bytes and the conversion reads each worker's settings, its layer list and each
layer's bytes out of them instead of serializing workers and layers again (8 workers
x 65 layers: plan id and conversion 510 µs with serializations per worker and per
layer, 355 µs so). Nothing outside this module (and the layer loop of
`kvplan.convert.request`, which reads a layer's name inline) knows the wire format.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvplan.core.cached import cached_value
from kvplan.v1 import plan_pb2, spec_pb2


def encode_varint(value: int) -> bytes:
    """Protobuf's base-128 varint (field lengths of hand-framed wire bytes)."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The base-128 varint at `pos`: (value, position after it)."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _skip_value(data: bytes, pos: int, wire_type: int) -> int:
    """The position after the value of a field of `wire_type` that starts at `pos`."""
    if wire_type == 0:
        return _read_varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        length, pos = _read_varint(data, pos)
        return pos + length
    if wire_type == 5:
        return pos + 4
    if wire_type == 3:  # a group (kept only as an unknown field): up to its end tag
        while True:
            tag, pos = _read_varint(data, pos)
            if tag & 7 == 4:
                return pos
            pos = _skip_value(data, pos, tag & 7)
    raise ValueError(f"protobuf wire type {wire_type} out of place")


def _wire_fields(data: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, field start, value start, field end) of each top-level field of
    the message serialized in data[pos:end] (protobuf's own, well-formed bytes); the
    value of a length-delimited field starts after its length."""
    while pos < end:
        start = pos
        tag, pos = _read_varint(data, pos)
        if tag & 7 == 2:
            length, value = _read_varint(data, pos)
            pos = value + length
        else:
            value = pos
            pos = _skip_value(data, pos, tag & 7)
        yield tag >> 3, start, value, pos


_RANK = plan_pb2.WorkerSpec.RANK_FIELD_NUMBER


_DEVICE = plan_pb2.WorkerSpec.DEVICE_FIELD_NUMBER


_MEMORY = plan_pb2.WorkerSpec.MEMORY_FIELD_NUMBER


_LAYERS = plan_pb2.WorkerSpec.LAYERS_FIELD_NUMBER


# Tags of length-delimited fields (one byte each).
_LAYERS_TAG = _LAYERS << 3 | 2


_RANK_TAG = bytes([_RANK << 3])  # a varint


_DEVICE_TAG = bytes([_DEVICE << 3 | 2])


_MEMORY_TAG = bytes([_MEMORY << 3 | 2])


_NAME_TAG = spec_pb2.LayerSpec.NAME_FIELD_NUMBER << 3 | 2


class WorkerBytes:
    """One worker's deterministic serialization, made once per request: the plan id
    hashes it and the converter reads the worker's identity from it, so that no
    worker or layer is serialized again (8 workers x 65 layers: plan id and
    conversion 510 µs with serializations per worker and per layer, 355 µs so).

    Protobuf writes known fields in field-number order: rank, device and memory
    (the worker's settings) come first, then the layers. `layers_key` is what
    follows the settings: equal keys, equal layer lists. Were the order ever
    different, a key would merely hold more than the layers: still exact, less shared.
    """

    def __init__(self, worker: plan_pb2.WorkerSpec) -> None:
        self._worker = worker

    @cached_value
    def data(self) -> bytes:
        # On first use: a caller that finds the plan by the request's digest never
        # needs the workers' bytes.
        return self._worker.SerializeToString(deterministic=True)

    @cached_value
    def _settings(self) -> tuple[bytes, int]:
        """(device and memory fields as sent, where the fields after them start):
        rank, device and memory are written first, in that order, each at most once
        (read by their one-byte tags: 8 workers 17 -> 6 µs)."""
        data = self.data
        pos = _read_varint(data, 1)[1] if data[:1] == _RANK_TAG else 0
        start = pos
        for tag in (_DEVICE_TAG, _MEMORY_TAG):
            if data[pos : pos + 1] == tag:
                length, value = _read_varint(data, pos + 1)
                pos = value + length
        return data[start:pos], pos

    @property
    def settings_key(self) -> bytes:
        """Equal for workers with equal device and memory settings (tensor-parallel
        ranks often differ in rank alone)."""
        return self._settings[0]

    @property
    def layers_start(self) -> int:
        return self._settings[1]

    @cached_value
    def layers_key(self) -> bytes:
        return self.data[self.layers_start :]

    @cached_value
    def layer_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each layer's serialization, in order. A layer's tag is one
        byte and its length mostly one: read inline, with no call per layer (64
        layers: 19 -> 6 µs); other fields are stepped over by `_wire_fields`."""
        data, pos, end = self.data, self.layers_start, len(self.data)
        spans: list[tuple[int, int]] = []
        while pos < end:
            if data[pos] == _LAYERS_TAG:
                length, start = data[pos + 1], pos + 2
                if length > 0x7F:
                    length, start = _read_varint(data, pos + 1)
                pos = start + length
                spans.append((start, pos))
                continue
            number, _, payload, pos = next(_wire_fields(data, pos, end))
            if number == _LAYERS:
                spans.append((payload, pos))
        return spans


def encode_workers(message: plan_pb2.PlanRequest) -> list[WorkerBytes]:
    return [WorkerBytes(worker) for worker in message.workers]


def encoded_now(message: plan_pb2.PlanRequest) -> list[WorkerBytes]:
    """`encode_workers(message)` with what each worker's bytes give made now rather
    than on first use (for a large request, in a worker thread): its layer list and
    that list's hash, and the layers' spans of each distinct list (the limit check
    and the conversion read them of the first worker with the list only)."""
    encoded = encode_workers(message)
    lists: set[bytes] = set()
    for worker in encoded:
        if worker.layers_key not in lists:
            lists.add(worker.layers_key)
            _ = worker.layer_spans
    return encoded
