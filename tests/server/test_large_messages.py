"""Parsing and serializing in pieces (server/large_messages.py) is exactly one
parse and one serialization: the same message from the same bytes, the same
bytes from the same message, and DecodeError for exactly the bytes a parse
refuses. Pieces far smaller than the server's make every path run."""

from __future__ import annotations

import random

import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.engines import gemma_style, qwen3_next_tp8
from kvplan.convert import plan_from_proto
from kvplan.server.large_messages import copy_in_pieces, merge_in_pieces, serialize_in_pieces
from kvplan.v1 import plan_pb2
from tests.server.test_fuzz import mutate, random_message

REQUESTS = [qwen3_next_tp8(), gemma_style(64)]


def _parsed_in_pieces(data: bytes, piece_bytes: int) -> plan_pb2.PlanRequest:
    message = plan_pb2.PlanRequest()
    merge_in_pieces(message, data, piece_bytes)
    return message


def _outcome(parse: object) -> bytes | None:
    """The message's bytes (unknown fields included), or None for DecodeError."""
    try:
        message = parse()  # type: ignore[operator]
    except DecodeError:
        return None
    assert isinstance(message, Message)
    return message.SerializeToString()


@pytest.mark.parametrize("request_message", REQUESTS, ids=["qwen3-next-tp8", "gemma-64l"])
@pytest.mark.parametrize("piece_bytes", [1, 7, 64, 1000, 1 << 20])
def test_a_request_parses_to_the_same_message(
    request_message: plan_pb2.PlanRequest, piece_bytes: int
) -> None:
    data = request_message.SerializeToString()
    parsed = _parsed_in_pieces(data, piece_bytes)
    assert parsed == request_message
    assert parsed.SerializeToString() == data


def test_a_large_sub_message_is_merged_in_its_own_pieces() -> None:
    """A worker larger than a piece, sent twice with the same rank and a singular
    field large enough to be recursed into: merged as a whole parse merges."""
    request = qwen3_next_tp8()
    request.options.engine_version = "x" * 5000  # a large field that is no message
    data = request.SerializeToString() + request.SerializeToString()
    whole = plan_pb2.PlanRequest.FromString(data)
    assert _parsed_in_pieces(data, 100) == whole
    assert len(whole.workers) == 2 * len(request.workers)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), piece_bytes=st.sampled_from([1, 3, 16, 200, 4096]))
def test_mutated_and_random_bytes_fare_as_in_one_parse(seed: int, piece_bytes: int) -> None:
    rng = random.Random(seed)
    base = rng.choice(REQUESTS).SerializeToString()
    kind = rng.randrange(3)
    if kind == 0:
        data = mutate(base, rng)
    elif kind == 1:
        data = random_message(plan_pb2.PlanRequest, rng, ["GPU-0"]).SerializeToString()
        data = mutate(data, rng) if rng.random() < 0.5 else data
    else:
        data = rng.randbytes(rng.randint(0, 300))
    one_parse = _outcome(lambda: plan_pb2.PlanRequest.FromString(data))
    in_pieces = _outcome(lambda: _parsed_in_pieces(data, piece_bytes))
    assert in_pieces == one_parse


@pytest.mark.parametrize("request_message", REQUESTS, ids=["qwen3-next-tp8", "gemma-64l"])
def test_a_plan_serializes_to_the_same_bytes(request_message: plan_pb2.PlanRequest) -> None:
    plan = plan_from_proto(request_message, plan_id="plan-x")
    assert serialize_in_pieces(plan) == plan.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_messages_serialize_to_the_same_bytes(seed: int) -> None:
    rng = random.Random(seed)
    for cls in (plan_pb2.PlanRequest, plan_pb2.PlanResponse):
        message = random_message(cls, rng, ["GPU-0"])
        assert serialize_in_pieces(message) == message.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_copy_in_pieces_equals_the_message(seed: int) -> None:
    rng = random.Random(seed)
    for cls in (plan_pb2.PlanRequest, plan_pb2.PlanResponse):
        message = random_message(cls, rng, ["GPU-0"])
        copy = copy_in_pieces(message)
        assert copy == message
        assert copy.SerializeToString() == message.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_parsed_bytes_with_unknown_fields_serialize_to_the_same_bytes(seed: int) -> None:
    rng = random.Random(seed)
    data = mutate(rng.choice(REQUESTS).SerializeToString(), rng)
    try:
        message = plan_pb2.PlanRequest.FromString(data)
    except DecodeError:
        return
    assert serialize_in_pieces(message) == message.SerializeToString()
