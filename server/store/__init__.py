"""Where plans, rendezvous state and leases live: memory, SQLite or Redis."""

from __future__ import annotations

from pathlib import Path

from kvplan.server.store.base import (
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    Arrival,
    RendezvousResult,
    Store,
    StoreLostState,
    StoreUnavailable,
    TooManyEngines,
    TooManyLeases,
)

__all__ = [
    "Arrival",
    "RendezvousResult",
    "Store",
    "StoreLostState",
    "StoreUnavailable",
    "TooManyEngines",
    "TooManyLeases",
    "open_store",
]


def open_store(
    url: str,
    state_dir: str,
    *,
    max_plans: int = DEFAULT_MAX_PLANS,
    max_plan_bytes: int = DEFAULT_MAX_PLAN_BYTES,
    redis_allow_no_persistence: bool = False,
) -> Store:
    """`memory`, `sqlite:///PATH` (or empty: STATE_DIR/kvplan.sqlite3), `redis://...`."""
    if url == "memory":
        from kvplan.server.store.memory import MemoryStore

        return MemoryStore(max_plans=max_plans, max_plan_bytes=max_plan_bytes)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from kvplan.server.store.redis import RedisStore

        return RedisStore(
            url,
            max_plans=max_plans,
            max_plan_bytes=max_plan_bytes,
            require_persistence=not redis_allow_no_persistence,
        )
    if not url or url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://") if url else str(Path(state_dir) / "kvplan.sqlite3")
        from kvplan.server.store.sqlite import SQLiteStore

        return SQLiteStore(path, max_plans=max_plans, max_plan_bytes=max_plan_bytes)
    raise ValueError(f"unknown store {url!r}; use memory, sqlite:///PATH or redis://HOST:PORT/DB")
