"""Freed heap handed back to the OS once a burst is over (server/heap.py)."""

from __future__ import annotations

import asyncio

from kvplan.server import heap
from kvplan.server.guard import Drain


def test_trim_returns_the_free_pages_a_burst_left() -> None:
    # 30 KB blocks (below glibc's mmap threshold: they come from the heap), one in
    # fifty still alive, as a burst's buffers leave the heap behind it.
    blocks = [bytearray(30_000) for _ in range(4_000)]
    alive = blocks[::50]
    del blocks
    assert heap.trim()  # the image and CI run on glibc
    assert len(alive) == 80


async def test_trim_only_after_calls_and_when_none_is_in_flight() -> None:
    drain = Drain()
    trims: list[int] = []

    def release() -> bool:
        trims.append(drain.calls_started)
        return True

    assert heap.trim_if_idle(drain, 0, release) == 0 and trims == []  # no call yet
    drain.enter()  # a call in flight: not now
    assert heap.trim_if_idle(drain, 0, release) == 0 and trims == []
    drain.leave()
    seen = heap.trim_if_idle(drain, 0, release)
    assert seen == 1 and trims == [1]
    assert heap.trim_if_idle(drain, seen, release) == 1 and trims == [1]  # nothing new
    await asyncio.sleep(0)
