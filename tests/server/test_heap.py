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


async def test_trim_once_quiet_after_calls() -> None:
    drain = Drain()
    trims: list[int] = []

    def release() -> bool:
        trims.append(drain.calls_started)
        return True

    quiet_trim = heap.QuietTrim(drain, release)
    assert not quiet_trim.tick()  # no call yet
    drain.enter()
    assert not quiet_trim.tick()  # a call started since the last tick
    assert not quiet_trim.tick()  # quiet, but the call is still in flight
    drain.leave()
    assert quiet_trim.tick() and trims == [1]  # gone quiet after it
    assert not quiet_trim.tick()
    assert quiet_trim.tick() and trims == [1, 1]  # again: what was freed late
    for _ in range(5):
        assert not quiet_trim.tick()  # twice per quiet spell
    for _ in range(3):  # steady load: a call between every two ticks
        drain.enter()
        drain.leave()
        assert not quiet_trim.tick()
    assert quiet_trim.tick() and trims == [1, 1, 4]
    drain.enter()  # a call between the two trims: the next spell trims twice anew
    drain.leave()
    assert not quiet_trim.tick()
    assert quiet_trim.tick() and trims == [1, 1, 4, 5]
    assert not quiet_trim.tick()
    assert quiet_trim.tick() and trims == [1, 1, 4, 5, 5]
    await asyncio.sleep(0)


async def test_parked_calls_count_as_quiet() -> None:
    """Ranks waiting for their engines do not keep the trim away, and their end
    (cancelled, no new call) starts a new quiet spell."""
    drain = Drain()
    parked = [0]
    trims: list[int] = []

    def release() -> bool:
        trims.append(len(drain.in_flight))
        return True

    quiet_trim = heap.QuietTrim(drain, release, parked=lambda: parked[0])

    async def waiting_rank() -> None:
        drain.enter()
        try:
            await asyncio.sleep(10)
        finally:
            drain.leave()

    ranks = [asyncio.create_task(waiting_rank()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not quiet_trim.tick()  # calls started since the last tick
    assert not quiet_trim.tick()  # in flight, not yet waiting
    parked[0] = 3
    assert quiet_trim.tick() and trims == [3]  # all of them wait: quiet
    assert not quiet_trim.tick()
    assert quiet_trim.tick() and trims == [3, 3]
    assert not quiet_trim.tick()
    for rank in ranks:
        rank.cancel()
    await asyncio.gather(*ranks, return_exceptions=True)
    parked[0] = 0
    assert quiet_trim.tick() and trims == [3, 3, 0]  # they are gone: trimmed again
    assert not quiet_trim.tick()
    assert quiet_trim.tick() and trims == [3, 3, 0, 0]
