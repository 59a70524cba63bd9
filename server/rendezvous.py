"""Rank-mode rendezvous: hold each rank's call until its engine is complete,
plan once over the merged workers, answer every rank with the same plan.

Everything runs on the server's event loop, so the state needs no locks. Plans
travel serialized (bytes of a PlanResponse), as the servicer's cache keeps them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplan.server.errors import ServiceError
from kvplan.server.metrics import Metrics
from kvplan.v1 import plan_pb2


@dataclass
class _Pending:
    engine_id: str
    world_size: int
    template: plan_pb2.PlanRequest  # options and spec decode, no workers
    template_bytes: bytes  # its deterministic serialization, to compare other ranks with
    workers: dict[int, plan_pb2.WorkerSpec]
    result: asyncio.Future[bytes]  # the serialized PlanResponse
    created: float = field(default_factory=time.monotonic)


@dataclass
class _Finished:
    workers: dict[int, bytes]  # rank -> digest of its worker's deterministic serialization
    template: bytes  # digest of the template's deterministic serialization
    response: bytes  # the serialized PlanResponse
    finished: float = field(default_factory=time.monotonic)


def _template_of(request: plan_pb2.PlanRequest) -> plan_pb2.PlanRequest:
    template = plan_pb2.PlanRequest()
    template.CopyFrom(request)
    del template.workers[:]
    return template


def _bytes(message: plan_pb2.PlanRequest | plan_pb2.WorkerSpec) -> bytes:
    return message.SerializeToString(deterministic=True)


def _digest(message: plan_pb2.PlanRequest | plan_pb2.WorkerSpec) -> bytes:
    """Stands for the message in a finished engine: 32 bytes, not the whole spec."""
    return hashlib.sha256(_bytes(message)).digest()


class Rendezvous:
    def __init__(
        self,
        plan: Callable[[plan_pb2.PlanRequest], asyncio.Future[bytes]],
        metrics: Metrics,
        *,
        max_pending: int,
        ttl_s: float,
    ) -> None:
        self._plan = plan
        self._metrics = metrics
        self._max_pending = max_pending
        self._ttl_s = ttl_s
        self._pending: dict[str, _Pending] = {}
        self._finished: dict[str, _Finished] = {}
        self._draining = False
        self._waiting = 0

    @property
    def pending_engines(self) -> int:
        return len(self._pending)

    def _expire(self) -> None:
        """Forget what is older than the TTL.

        Both dicts are in the order of their timestamps (an entry is inserted when it
        is stamped and never moved), so the expired entries are a prefix: the scan
        stops at the first live one instead of visiting every engine on every join.
        """
        now = time.monotonic()
        while self._pending:
            engine_id, pending = next(iter(self._pending.items()))
            if now - pending.created <= self._ttl_s:
                break
            del self._pending[engine_id]
            if not pending.result.done():
                pending.result.set_exception(
                    ServiceError(
                        "DEADLINE_EXCEEDED",
                        f"engine {engine_id!r}: rendezvous expired after {self._ttl_s:.0f} s "
                        f"with ranks {sorted(pending.workers)} of {pending.world_size}",
                    )
                )
        while self._finished:
            engine_id, finished = next(iter(self._finished.items()))
            if now - finished.finished <= self._ttl_s:
                break
            del self._finished[engine_id]

    def _validate(self, request: plan_pb2.PlanRequest) -> plan_pb2.WorkerSpec:
        if not request.engine_id:
            raise ServiceError(
                "INVALID_ARGUMENT", "rank mode needs an engine_id", field="engine_id"
            )
        if len(request.workers) != 1:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"rank mode carries exactly one worker, got {len(request.workers)}",
                field="workers",
            )
        worker = request.workers[0]
        if worker.rank >= request.world_size:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"rank {worker.rank} is outside world_size {request.world_size}",
                field="workers[0].rank",
            )
        return worker

    def _join_finished(
        self, request: plan_pb2.PlanRequest, worker: plan_pb2.WorkerSpec, template_bytes: bytes
    ) -> bytes | None:
        finished = self._finished.get(request.engine_id)
        if finished is None:
            return None
        planned = finished.workers.get(worker.rank)
        if (
            planned == _digest(worker)
            and finished.template == hashlib.sha256(template_bytes).digest()
        ):
            return finished.response  # a late joiner or a restarted rank
        raise ServiceError(
            "FAILED_PRECONDITION",
            f"engine {request.engine_id!r} was already planned and rank {worker.rank}'s spec "
            "differs from the planned one; plan a changed engine under a new engine_id",
            field="workers[0]",
        )

    async def join(self, request: plan_pb2.PlanRequest, timeout_s: float | None) -> bytes:
        """The serialized plan of the rank's engine, once all its ranks arrived."""
        if self._draining:
            raise ServiceError("UNAVAILABLE", "server is shutting down; retry on another replica")
        self._expire()
        worker = self._validate(request)
        template = _template_of(request)
        template_bytes = _bytes(template)
        done = self._join_finished(request, worker, template_bytes)
        if done is not None:
            return done
        pending = self._pending.get(request.engine_id)
        if pending is None:
            if len(self._pending) >= self._max_pending:
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"{len(self._pending)} engines are already waiting for ranks (limit "
                    f"{self._max_pending}); retry later",
                    details={"pending": len(self._pending), "limit": self._max_pending},
                )
            pending = _Pending(
                engine_id=request.engine_id,
                world_size=request.world_size,
                template=template,
                template_bytes=template_bytes,
                workers={},
                result=asyncio.get_running_loop().create_future(),
            )
            self._pending[request.engine_id] = pending
        self._check_compatible(pending, request, worker, template_bytes)
        pending.workers[worker.rank] = worker
        if len(pending.workers) == pending.world_size:
            self._complete(pending)
        return await self._wait(pending, worker.rank, timeout_s)

    def _check_compatible(
        self,
        pending: _Pending,
        request: plan_pb2.PlanRequest,
        worker: plan_pb2.WorkerSpec,
        template_bytes: bytes,
    ) -> None:
        if request.world_size != pending.world_size:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"engine {pending.engine_id!r}: world_size {request.world_size} disagrees with "
                f"{pending.world_size} sent by the first rank",
                field="world_size",
            )
        if template_bytes != pending.template_bytes:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"engine {pending.engine_id!r}: rank {worker.rank} sent engine options or a "
                "spec-decode config that differ from the other ranks'",
                field="options",
            )
        seen = pending.workers.get(worker.rank)
        if seen is not None and _bytes(seen) != _bytes(worker):
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"engine {pending.engine_id!r}: rank {worker.rank} already joined with a "
                "different spec",
                field="workers[0].rank",
            )

    def _complete(self, pending: _Pending) -> None:
        del self._pending[pending.engine_id]
        merged = plan_pb2.PlanRequest()
        merged.CopyFrom(pending.template)
        merged.world_size = 0
        merged.workers.extend(pending.workers[rank] for rank in sorted(pending.workers))
        planned = self._plan(merged)

        def finish(future: asyncio.Future[bytes]) -> None:
            if pending.result.done():
                return
            error = future.exception()
            if error is not None:
                pending.result.set_exception(error)
                return
            response = future.result()
            self._finished.pop(pending.engine_id, None)  # re-inserted last: in time order
            self._finished[pending.engine_id] = _Finished(
                workers={rank: _digest(w) for rank, w in pending.workers.items()},
                template=hashlib.sha256(pending.template_bytes).digest(),
                response=response,
            )
            pending.result.set_result(response)

        planned.add_done_callback(finish)

    async def _wait(self, pending: _Pending, rank: int, timeout_s: float | None) -> bytes:
        start = time.perf_counter()
        self._waiting += 1
        self._metrics.rendezvous_waiting.set(self._waiting)
        try:
            return await asyncio.wait_for(asyncio.shield(pending.result), timeout_s)
        except TimeoutError:
            self._leave(pending, rank)
            raise ServiceError(
                "DEADLINE_EXCEEDED",
                f"engine {pending.engine_id!r}: deadline passed with ranks "
                f"{sorted(pending.workers)} of {pending.world_size} arrived",
            ) from None
        except asyncio.CancelledError:
            self._leave(pending, rank)
            raise
        finally:
            self._waiting -= 1
            self._metrics.rendezvous_waiting.set(self._waiting)
            self._metrics.rendezvous_wait.observe(time.perf_counter() - start)

    def _leave(self, pending: _Pending, rank: int) -> None:
        """A rank that stops waiting leaves an unfinished rendezvous."""
        if pending.result.done():
            return
        pending.workers.pop(rank, None)
        if not pending.workers and self._pending.get(pending.engine_id) is pending:
            del self._pending[pending.engine_id]

    def drain(self) -> None:
        """Shutdown: waiting ranks get UNAVAILABLE and retry elsewhere."""
        self._draining = True
        for pending in self._pending.values():
            if not pending.result.done():
                pending.result.set_exception(
                    ServiceError(
                        "UNAVAILABLE",
                        f"server shutting down before engine {pending.engine_id!r} completed; "
                        "retry (all ranks) on another replica",
                        details={"retry_after_s": 1},
                    )
                )
        self._pending.clear()

    def finished_plan(self, engine_id: str) -> bytes | None:
        """The serialized plan of a finished engine."""
        finished = self._finished.get(engine_id)
        return finished.response if finished else None
