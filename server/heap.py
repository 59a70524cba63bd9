"""Handing freed heap back to the OS once a burst is over.

A burst of calls (a fleet's rendezvous: 256 engines x 8 ranks, 2,048 calls at
once) makes gRPC and the planner allocate a few hundred MB for a moment. glibc
keeps what they free inside its heap, resident, wherever a live block sits
above it: the process stayed at 145-186 MB RSS after such a burst, though it
used about 15 MB of heap. `malloc_trim(0)` returns those free pages (it took
it back to 80 MB), in about 10 ms after a burst and well under 1 ms otherwise.
The server calls it from a background task once it has gone quiet after calls
(`QuietTrim`), and once more a second later: never under steady load, within a
second after a burst. Elsewhere
than glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from kvplan.server.guard import Drain


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _malloc_trim()


def trim() -> bool:
    """Return the heap's free pages to the OS; True if any were."""
    return _MALLOC_TRIM is not None and bool(_MALLOC_TRIM(0))


class QuietTrim:
    """`tick()` every interval: once the server went quiet after calls (none
    started since the previous tick, none in flight but those `parked`, waiting
    for something else: ranks waiting for their engines), trim at the first quiet
    tick and again at the `RETRIM_TICK`th, once per quiet spell. Some of a burst's
    memory is freed only a moment after its last call (gRPC's call state, the
    store thread's buffers): after each of 3 or 4 rendezvous bursts (2,048 calls)
    the idle RSS was 94-146 MB with the first trim alone, 100-131 MB with both,
    growing only with the plan cache.

    Parked calls count as quiet: each rank's request was parsed and converted
    before it waits, and glibc kept that freed memory resident under the waiting
    ranks' live blocks (100 waiting ranks of 8,192 layers: 175 MB RSS untrimmed,
    137 MB trimmed). A spell also starts when calls end without new ones (waiting
    ranks that were cancelled)."""

    RETRIM_TICK = 3

    def __init__(
        self,
        drain: Drain,
        release: Callable[[], bool] = trim,
        parked: Callable[[], int] = lambda: 0,
    ) -> None:
        self._drain = drain
        self._release = release
        self._parked = parked
        self._calls_at_tick = self._in_flight_at_tick = 0
        self._state_at_trim = (0, 0)  # (calls started, calls in flight) when trimmed
        self._quiet_ticks = 0  # of the current quiet spell
        self._retrim_due = False

    def tick(self) -> bool:
        """True when it trimmed."""
        calls = self._drain.calls_started
        in_flight = len(self._drain.in_flight)
        quiet = calls == self._calls_at_tick and in_flight <= self._parked()
        if not quiet:
            self._quiet_ticks = 0
        elif in_flight != self._in_flight_at_tick:  # parked calls ended: a new spell
            self._quiet_ticks = 1
        else:
            self._quiet_ticks += 1
        self._calls_at_tick, self._in_flight_at_tick = calls, in_flight
        if self._quiet_ticks == 1 and (calls, in_flight) != self._state_at_trim:
            self._state_at_trim = (calls, in_flight)
            self._retrim_due = True
        elif self._quiet_ticks == self.RETRIM_TICK and self._retrim_due:
            self._retrim_due = False
        else:
            return False
        self._release()
        return True
