"""`kvplan serve` with the event-loop thread's CPU time counted per step of a plan.

    python -m bench.instrumented_server OUT.json serve --port ... (bench/cpu_breakdown.py)

Each step is wrapped where the servicer calls it, and its thread CPU time
(time.thread_time_ns: CPU, not waiting) is added up; the RPC handlers count their
calls. At exit the totals go to OUT.json. Each wrapper costs about a microsecond.
A step that awaits (the store hand-off, the handler) is charged the loop's other work
while it waits: at concurrency 1 there is none but the hand-off's own wake-up.
"""

from __future__ import annotations

import atexit
import functools
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

spent_ns: Counter[str] = Counter()
calls: Counter[str] = Counter()
loop_thread_ns: dict[str, int] = {}


def _timed(label: str, step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time_ns()
        try:
            return step(*args, **kwargs)
        finally:
            spent_ns[label] += time.thread_time_ns() - started

    return run


def _timed_handler(label: str, handler: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """An RPC handler: counted, timed, and the loop thread's clock read at the first
    call's start and at each call's end."""

    @functools.wraps(handler)
    async def run(*args: Any, **kwargs: Any) -> Any:
        loop_thread_ns.setdefault("first_call", time.thread_time_ns())
        calls[label] += 1
        started = time.thread_time_ns()
        try:
            return await handler(*args, **kwargs)
        finally:
            now = loop_thread_ns["last_call"] = time.thread_time_ns()
            spent_ns[label] += now - started

    return run


def _timed_await(label: str, step: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    @functools.wraps(step)
    async def run(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time_ns()
        try:
            return await step(*args, **kwargs)
        finally:
            spent_ns[label] += time.thread_time_ns() - started

    return run


def _wrap(owner: Any, name: str, label: str, timer: Callable[..., Any]) -> None:
    setattr(owner, name, timer(label, getattr(owner, name)))


def install() -> None:
    from kvplan.server import limits, plan_cache, servicer
    from kvplan.server.store import bodies

    planner, cache = servicer.PlannerServicer, plan_cache.PlanCache
    _wrap(servicer, "plan_from_proto", "planning", _timed)
    _wrap(servicer, "encode_workers", "encode workers", _timed)
    _wrap(limits.RequestLimits, "check_request", "limits", _timed)
    _wrap(cache, "keys", "plan keys", _timed)
    _wrap(cache, "keep", "plan cache", _timed)
    _wrap(planner, "_record", "metrics and log line", _timed)
    _wrap(planner, "_persist", "store hand-off", _timed_await)
    _wrap(planner, "PlanKVCache", "PlanKVCache", _timed_handler)
    _wrap(planner, "Echo", "Echo", _timed_handler)
    cut = vars(bodies.PlanParts)["of"].__func__  # the classmethod's function
    bodies.PlanParts.of = classmethod(_timed("reply bytes", cut))  # type: ignore[method-assign,assignment]


def write(path: Path) -> None:
    # From the first call's start to the last one's end: start-up and shutdown left out.
    first, last = loop_thread_ns.get("first_call", 0), loop_thread_ns.get("last_call", 0)
    report = {"calls": dict(calls), "spent_ns": dict(spent_ns), "loop_thread_ns": last - first}
    path.write_text(json.dumps(report))


def main() -> int:
    out = Path(sys.argv[1])
    install()
    atexit.register(write, out)  # the main thread, after the server has stopped
    from kvplan.cli import main as kvplan_main

    return kvplan_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
