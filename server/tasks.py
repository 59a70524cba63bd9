"""Ending the server's background tasks (lease sweeper, store health watch,
Redis listener) for sure."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

RECANCEL_S = 0.1  # how long to wait for a cancelled task before cancelling it again


async def cancel_and_wait(task: asyncio.Task[Any], recancel_s: float = RECANCEL_S) -> None:
    """Cancel `task` and return once it has ended.

    One cancel() is not always enough. On Python 3.11 `asyncio.wait_for`
    returns the inner result instead of raising CancelledError when the
    cancellation arrives just as the inner call finishes (CPython gh-86296,
    fixed in 3.12), and redis-py wraps each socket write in `wait_for`; redis-py
    can also turn a cancellation inside a read into its own TimeoutError. A
    loop whose cancellation was lost runs on, and a shutdown that awaits it
    never ends. So cancel again until the task is done."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
    with contextlib.suppress(asyncio.CancelledError):
        await task
