"""Every enum field reachable from a PlanRequest rejects a value the schema does
not name, with its field path, before planning: found by walking the schema, so
an enum added later is covered too. Integer ranges likewise."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvplan.convert.request import request_from_proto
from kvplan.core.errors import InvalidRequest
from kvplan.fieldcheck import MAX_64, check_fields
from kvplan.v1 import plan_pb2
from tests.server.conftest import engine_request


def enum_paths(descriptor: Descriptor, prefix: str = "", depth: int = 0) -> Iterator[str]:
    for field in descriptor.fields:
        name = f"{prefix}.{field.name}" if prefix else field.name
        if field.is_repeated:
            name += "[0]"
        if field.enum_type is not None:
            yield name
        elif (
            field.type == FieldDescriptor.TYPE_MESSAGE
            and field.message_type is not None
            and depth < 6
            and not field.message_type.full_name.startswith("google.")
        ):
            yield from enum_paths(field.message_type, name, depth + 1)


def set_path(message: Any, path: str, value: int) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        if part.endswith("[0]"):
            container = getattr(message, part[:-3])
            message = container[0] if len(container) else container.add()
        else:
            message = getattr(message, part)
    last = parts[-1]
    if last.endswith("[0]"):
        getattr(message, last[:-3]).append(value)
    else:
        setattr(message, last, value)


PATHS = sorted(enum_paths(plan_pb2.PlanRequest.DESCRIPTOR))


def test_the_walk_finds_the_issues_enums() -> None:
    for path in (
        "options.cache_dtype",
        "options.layout",
        "spec_decode.method",
        "workers[0].layers[0].mamba.mamba_type",
        "workers[0].layers[0].mla_attention.mla.cache_dtype",
    ):
        assert path in PATHS
    assert len(PATHS) > 20


@pytest.mark.parametrize("path", PATHS)
def test_every_enum_rejects_unknown_values(path: str) -> None:
    request = engine_request()
    set_path(request, path, 999)
    with pytest.raises(InvalidRequest) as caught:
        request_from_proto(request)
    assert caught.value.field == path
    assert "999" in caught.value.message


def test_ranges() -> None:
    request = engine_request()
    request.workers[0].memory.non_kv.weights_bytes = MAX_64
    check_fields(request, "")  # the bound itself is in range
    request.workers[0].memory.non_kv.weights_bytes = MAX_64 + 1
    with pytest.raises(InvalidRequest) as caught:
        check_fields(request, "")
    assert caught.value.field == "workers[0].memory.non_kv.weights_bytes"
    request = engine_request()
    request.options.max_model_len = -2
    with pytest.raises(InvalidRequest):
        check_fields(request, "")
    request.options.max_model_len = -1
    check_fields(request, "")
