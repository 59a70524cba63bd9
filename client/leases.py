"""Keep an engine's leases alive while it runs, and give them back when it stops.

    plan = planner.plan(request)
    with LeaseKeeper(planner, plan, on_lost=stop_serving) as keeper:  # renews every ttl/3
        ... serve ...
    # leaving the block releases the leases

No failure is silent; each is delivered once, to its handler when one was
given, else raised by the next `check()`, `renew_now()`, `stop()` or the exit
of the `with` block (when the block itself did not raise):

- UNAVAILABLE / DEADLINE_EXCEEDED (server or network): retried every
  `retry_s` until the lease would expire; then the leases count as lost.
- NOT_FOUND / FAILED_PRECONDITION / PERMISSION_DENIED / ...: the leases are
  gone (expired, released elsewhere): lost at once.
- A renewal whose answer lacks a rank the plan leased (that rank released
  elsewhere, or the engine re-granted with fewer ranks): lost at once, as
  FAILED_PRECONDITION naming the ranks. The ranks left are not released on
  stop (the engine's leases may now be another grant's); unrenewed, they expire.
- Lost leases go to `on_lost(PlannerError)`: the engine should stop using the
  memory, or plan again.
- The `allocations` callback raising: the renewal goes on without the report
  (the lease stays alive) and the error goes to `on_error(exception)`.
- Leaving the `with` block on an exception never replaces that exception: a
  failed release is added to it as a note.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Self

import grpc

from kvplan.client.errors import PlannerError
from kvplan.client.model import PlanResult
from kvplan.v1 import plan_pb2

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
        on_error: Callable[[Exception], None] | None = None,
        retry_s: float | None = None,
    ) -> None:
        self.engine_id = plan.engine_id
        # The ranks this engine leased: a renewal must keep every one of them.
        self.ranks = frozenset(lease.rank for lease in plan.leases)
        self.interval_s = _interval(plan, interval_s)
        self.retry_s = retry_s if retry_s is not None else min(1.0, self.interval_s / 4)
        self._ttl_s = plan.lease_ttl_s or 3 * self.interval_s
        # When the leases expire unless renewed (this process's clock).
        self.expires_at = time.monotonic() + self._ttl_s
        self._allocations = allocations
        self._on_lost = on_lost
        self._on_error = on_error
        self._release_on_exit = release_on_exit
        self._undelivered: BaseException | None = None
        self.renewals = 0
        self.last_error: BaseException | None = None
        self.lost = False

    def _deliver(self, error: BaseException, handler: Callable[..., None] | None) -> None:
        self.last_error = error
        if handler is None:
            if self._undelivered is None:
                self._undelivered = error
            return
        try:
            handler(error)
        except Exception as handler_error:  # the handler's own failure is not lost either
            if self._undelivered is None:
                self._undelivered = handler_error

    def _report(self) -> Mapping[int, int] | None:
        if self._allocations is None:
            return None
        try:
            return self._allocations()
        except Exception as error:
            self._deliver(error, self._on_error)
            return None  # renew anyway: the lease must not die for a report

    def _renewed(self, started: float, leases: tuple[plan_pb2.Lease, ...]) -> None:
        """Count a renewal, or raise when its answer dropped a rank: the server
        renews whatever the engine still holds, so a success alone proves nothing."""
        missing = sorted(self.ranks - {lease.rank for lease in leases})
        if missing:
            # Lost, whoever asked (renew_now too): stop() must not release what may
            # now be another grant's.
            self.lost = True
            raise PlannerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"engine {self.engine_id!r} no longer holds the leases of rank(s) "
                f"{', '.join(map(str, missing))} (released elsewhere, expired, or replaced "
                "by a grant with fewer ranks); their memory may be granted to another engine",
                metadata={"missing_ranks": ",".join(map(str, missing))},
            )
        ttl = min((lease.ttl_seconds for lease in leases), default=0.0)
        self.expires_at = started + (ttl or self._ttl_s)
        self.renewals += 1

    def _failed(self, error: BaseException) -> float | None:
        """A failed renewal: the delay before the next try, or None when the
        leases are lost (on_lost has been told)."""
        if isinstance(error, PlannerError) and error.code in _TRANSIENT:
            self.last_error = error
            left = self.expires_at - time.monotonic()
            if left > 0:
                return min(self.retry_s, left)
            error = PlannerError(
                error.code,
                f"the leases of engine {self.engine_id!r} expired while renewals failed "
                f"({error.details}); their memory may be granted to another engine",
                error.violations,
                error.metadata,
            )
        elif not isinstance(error, PlannerError):
            error = PlannerError(
                grpc.StatusCode.UNKNOWN,
                f"the lease keeper of engine {self.engine_id!r} failed: "
                f"{type(error).__name__}: {error}",
            )
        self.lost = True
        self._deliver(error, self._on_lost)
        return None

    def check(self) -> None:
        """Raise the first failure no handler took (once)."""
        error, self._undelivered = self._undelivered, None
        if error is not None:
            raise error

    def _exit_error(self, release: BaseException | None, exc: BaseException | None) -> None:
        if exc is not None:
            if release is not None:
                exc.add_note(f"kvplan: releasing the leases failed too: {release}")
            return  # never replace the engine's own exception
        if release is not None:
            raise release
        self.check()


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
        on_error: Callable[[Exception], None] | None = None,
        retry_s: float | None = None,
    ) -> None:
        super().__init__(plan, interval_s, allocations, on_lost, release_on_exit, on_error, retry_s)
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvplan-leases-{self.engine_id}", daemon=True
        )

    def _renew(self) -> None:
        started = time.monotonic()
        leases = self._client.renew_leases(
            self.engine_id, self._report(), timeout_s=self.interval_s
        )
        self._renewed(started, leases)

    def renew_now(self) -> None:
        """One renewal now; raises its error, or an earlier undelivered one."""
        self.check()
        self._renew()

    def _run(self) -> None:
        delay: float | None = self.interval_s
        while delay is not None and not self._stop.wait(delay):
            try:
                self._renew()
                delay = self.interval_s
            except BaseException as error:
                delay = self._failed(error)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing; release the leases unless told not to (or lost)."""
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
        release: BaseException | None = None
        try:
            self.stop()
        except Exception as error:
            release = error
        self._exit_error(release, exc)


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
        on_error: Callable[[Exception], None] | None = None,
        retry_s: float | None = None,
    ) -> None:
        super().__init__(plan, interval_s, allocations, on_lost, release_on_exit, on_error, retry_s)
        self._client = client
        self._task: asyncio.Task[None] | None = None

    async def _renew(self) -> None:
        started = time.monotonic()
        leases = await self._client.renew_leases(
            self.engine_id, self._report(), timeout_s=self.interval_s
        )
        self._renewed(started, leases)

    async def renew_now(self) -> None:
        self.check()
        await self._renew()

    async def _run(self) -> None:
        delay: float | None = self.interval_s
        while delay is not None:
            await asyncio.sleep(delay)
            try:
                await self._renew()
                delay = self.interval_s
            except asyncio.CancelledError:
                raise
            except BaseException as error:
                delay = self._failed(error)

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
        release: BaseException | None = None
        try:
            await self.stop()
        except Exception as error:
            release = error
        self._exit_error(release, exc)
