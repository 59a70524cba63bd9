"""Messages too large to parse or serialize in one call without stalling the server.

upb parses or serializes a message in one C call that holds the GIL for all of it:
a 57 MB PlanRequest (160 workers x 8,192 layers) took 0.4-2.4 s to parse and its
52 MB plan about 1.1 s to serialize (2 loaded cores), so even in a worker thread
the event loop, and every other call with it, stood still that long. Done here in
pieces of about `PIECE_BYTES`, the GIL passes between the pieces.

Parsing the concatenation of two serialized messages merges them (the protobuf
encoding's rule), so merging a message's fields a few at a time gives the message
that one parse gives; a field larger than a piece that holds a sub-message is
merged into that sub-message piece by piece in turn (the schema's nesting bounds
the recursion). Serializing a message field by field, in field-number order,
writes the bytes upb writes for it (tests/server/test_large_messages.py checks
both).
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from kvplan.convert.wire import encode_varint

_M = TypeVar("_M", bound=Message)

# About 10 ms of parsing each. Smaller pieces split workers (a few hundred KB)
# into their layers, a Python step per layer: a 56 MB request was planned in
# 2.2-3.2 s with 256 KiB pieces, 1.3-1.9 s with these (1.1-1.8 s parsed whole);
# other calls waited at most 95-135 ms either way (bench/large_request.py).
PIECE_BYTES = 1024 * 1024

_LENGTH_DELIMITED = 2
_START_GROUP, _END_GROUP = 3, 4


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    """The base-128 varint at `pos`: (value, position after it). Bounds-checked:
    these bytes come from the network (kvplan/convert/wire.py's reader trusts protobuf's own)."""
    value = shift = 0
    end = len(data)
    while pos < end and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise DecodeError("truncated or over-long varint")


def _field_end(data: memoryview, pos: int, wire_type: int) -> int:
    """The position after the value of a field of `wire_type` starting at `pos`."""
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == _LENGTH_DELIMITED:
        length, pos = _varint(data, pos)
        return pos + length
    if wire_type == 5:
        return pos + 4
    raise DecodeError(f"wire type {wire_type} out of place")


def _merge(message: Message, piece: memoryview) -> None:
    message.MergeFromString(piece)  # type: ignore[arg-type]  # upb reads any buffer: no copy


def _message_field(message: Message, number: int) -> FieldDescriptor | None:
    """The field `number` of `message` when it holds a message (maps excepted)."""
    field = message.DESCRIPTOR.fields_by_number.get(number)
    if field is None or field.message_type is None:
        return None
    if field.message_type.GetOptions().map_entry:
        return None
    return cast(FieldDescriptor, field)  # the stubs know upb's descriptor by another class


def merge_in_pieces(
    message: Message, data: bytes | memoryview, piece_bytes: int = PIECE_BYTES
) -> None:
    """`message.MergeFromString(data)`, a piece at a time. Bytes that are not the
    message raise DecodeError, as MergeFromString does."""
    view = memoryview(data)
    end = len(view)
    pos = piece_start = 0
    while pos < end:
        field_start = pos
        tag, pos = _varint(view, pos)
        wire_type = tag & 7
        if wire_type in (_START_GROUP, _END_GROUP):
            break  # groups (unknown fields only here): the rest in one piece
        if wire_type != _LENGTH_DELIMITED:
            pos = _field_end(view, pos, wire_type)
        else:
            length, value_start = _varint(view, pos)
            pos = value_start + length
            field = _message_field(message, tag >> 3) if length > piece_bytes else None
            if field is not None and pos <= end:
                _merge(message, view[piece_start:field_start])
                if field.is_repeated:
                    inner = getattr(message, field.name).add()
                else:
                    inner = getattr(message, field.name)
                    inner.SetInParent()  # present, as a parse makes it, even if empty
                merge_in_pieces(inner, view[value_start:pos], piece_bytes)
                piece_start = pos
                continue
        if pos - piece_start >= piece_bytes:
            _merge(message, view[piece_start:pos])
            piece_start = pos
    # The rest, and bytes that run past the end: MergeFromString reports them.
    _merge(message, view[piece_start:])


def serialize_in_pieces(message: Message) -> bytes:
    """`message.SerializeToString()`, a field (a sub-message) at a time; in one
    call for a message with unknown fields of its own (not reachable by field)."""
    if len(UnknownFieldSet(message)):
        return message.SerializeToString()
    pieces: list[bytes] = []
    for field, value in message.ListFields():
        if _message_field(message, field.number) is not None:
            tag = encode_varint(field.number << 3 | _LENGTH_DELIMITED)
            repeated = field.is_repeated
            for element in value if repeated else (value,):
                serialized = element.SerializeToString()
                pieces += (tag, encode_varint(len(serialized)), serialized)
            continue
        alone = type(message)()
        _copy_small_field(alone, field, value)
        pieces.append(alone.SerializeToString())
    return b"".join(pieces)


LARGE_MESSAGE_BYTES = 1024 * 1024  # bodies parsed off the event loop, in pieces


def parse_message(message_class: type[_M], data: bytes) -> _M:
    """`message_class.FromString(data)`; in pieces for bodies over LARGE_MESSAGE_BYTES."""
    if len(data) <= LARGE_MESSAGE_BYTES:
        return message_class.FromString(data)
    message = message_class()
    merge_in_pieces(message, data)
    return message


def copy_in_pieces(message: _M) -> _M:
    """`copy.CopyFrom(message)` into a new message, a field (a sub-message) at a time."""
    copy = type(message)()
    for field, value in message.ListFields():
        if _message_field(message, field.number) is None:
            _copy_small_field(copy, field, value)
        elif field.is_repeated:
            elements = getattr(copy, field.name)
            for element in value:
                elements.add().CopyFrom(element)
        else:
            getattr(copy, field.name).CopyFrom(value)
    return copy


def _copy_small_field(target: Message, field: FieldDescriptor, value: Any) -> None:
    """Set a field that holds no sub-message (a scalar, a list of them, a map)."""
    if field.message_type is not None:  # a map
        getattr(target, field.name).MergeFrom(value)
    elif field.is_repeated:
        getattr(target, field.name).extend(value)
    else:
        setattr(target, field.name, value)
