"""Keep an engine's leases alive while it runs, and give them back when it stops.

    plan = planner.plan(request)
    with LeaseKeeper(planner, plan) as keeper:   # renews every ttl/3 in a thread
        ... serve ...
    # leaving the block releases the leases

A renewal that fails with UNAVAILABLE or DEADLINE_EXCEEDED is retried at the next
tick (a lease outlives a few missed beats); NOT_FOUND or FAILED_PRECONDITION
means the leases are gone (expired or released elsewhere): the keeper stops and
reports it through `on_lost`, and the engine should plan again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Self

import grpc

from kvplan.client.errors import PlannerError
from kvplan.client.model import PlanResult

if TYPE_CHECKING:
    from kvplan.client.planner import AsyncPlannerClient, PlannerClient

Allocations = Callable[[], Mapping[int, int]]
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _interval(plan: PlanResult, interval_s: float | None) -> float:
    if interval_s is not None:
        return interval_s
    if plan.lease_ttl_s <= 0:
        raise ValueError(f"plan {plan.plan_id} holds no leases to keep")
    return plan.lease_ttl_s / 3  # two beats may be lost before a lease expires


class _Keeper:
    """What both keepers hold: the engine, the beat, and how renewals went."""

    def __init__(
        self,
        plan: PlanResult,
        interval_s: float | None,
        allocations: Allocations | None,
        on_lost: Callable[[PlannerError], None] | None,
        release_on_exit: bool,
    ) -> None:
        self.engine_id = plan.engine_id
        self.interval_s = _interval(plan, interval_s)
        self._allocations = allocations
        self._on_lost = on_lost
        self._release_on_exit = release_on_exit
        self.renewals = 0
        self.last_error: PlannerError | None = None
        self.lost = False

    def _failed(self, error: PlannerError) -> bool:
        """Record a failed renewal; True when the leases are gone (stop renewing)."""
        self.last_error = error
        if error.code in _TRANSIENT:
            return False
        self.lost = True
        if self._on_lost is not None:
            self._on_lost(error)
        return True


class LeaseKeeper(_Keeper):
    """Renews a plan's leases from a daemon thread (sync client)."""

    def __init__(
        self,
        client: PlannerClient,
        plan: PlanResult,
        *,
        interval_s: float | None = None,
        allocations: Allocations | None = None,
        on_lost: Callable[[PlannerError], None] | None = None,
        release_on_exit: bool = True,
    ) -> None:
        super().__init__(plan, interval_s, allocations, on_lost, release_on_exit)
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvplan-leases-{self.engine_id}", daemon=True
        )

    def renew_now(self) -> None:
        allocations = self._allocations() if self._allocations else None
        self._client.renew_leases(self.engine_id, allocations, timeout_s=self.interval_s)
        self.renewals += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.renew_now()
            except PlannerError as error:
                if self._failed(error):
                    return

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing; release the leases unless told not to."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._release_on_exit and not self.lost:
            self._client.release_plan(self.engine_id)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class AsyncLeaseKeeper(_Keeper):
    """Renews a plan's leases from an asyncio task (asyncio client)."""

    def __init__(
        self,
        client: AsyncPlannerClient,
        plan: PlanResult,
        *,
        interval_s: float | None = None,
        allocations: Allocations | None = None,
        on_lost: Callable[[PlannerError], None] | None = None,
        release_on_exit: bool = True,
    ) -> None:
        super().__init__(plan, interval_s, allocations, on_lost, release_on_exit)
        self._client = client
        self._task: asyncio.Task[None] | None = None

    async def renew_now(self) -> None:
        allocations = self._allocations() if self._allocations else None
        await self._client.renew_leases(self.engine_id, allocations, timeout_s=self.interval_s)
        self.renewals += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.renew_now()
            except PlannerError as error:
                if self._failed(error):
                    return

    def start(self) -> Self:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._release_on_exit and not self.lost:
            await self._client.release_plan(self.engine_id)

    async def __aenter__(self) -> Self:
        return self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()
