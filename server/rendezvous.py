"""Rank-mode rendezvous: hold each rank's call until its engine is complete,
plan once over the merged workers, answer every rank with the same plan.

The ranks' specs live in the store, so a rendezvous survives a restart (SQLite)
and spans replicas (Redis): the rank that completes an engine plans it, on
whichever replica it reached, and the store tells every replica's waiting
ranks. This module only keeps the local waiters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from google.rpc import status_pb2

from kvplan.core.errors import PlanningError
from kvplan.server.errors import RemoteStatus, ServiceError, limit_exceeded, to_rpc_status
from kvplan.server.guard import current_request_id
from kvplan.server.large_messages import LARGE_MESSAGE_BYTES
from kvplan.server.metrics import Metrics
from kvplan.server.store import RendezvousResult, Store, StoreUnavailable
from kvplan.server.store.base import DEFAULT_MAX_RESULT_BYTES
from kvplan.v1 import plan_pb2

log = logging.getLogger("kvplan.server")

PlanFn = Callable[[plan_pb2.PlanRequest], Awaitable[bytes]]
_WORKERS_FIELD = plan_pb2.PlanRequest.WORKERS_FIELD_NUMBER


def _template_bytes(request: plan_pb2.PlanRequest) -> bytes:
    """The request without its workers: what every rank must send alike."""
    template = plan_pb2.PlanRequest()
    # Field by field, so the worker's layers are never copied just to be dropped.
    for field, value in request.ListFields():
        if field.number == _WORKERS_FIELD:
            continue
        if field.message_type is not None:
            getattr(template, field.name).CopyFrom(value)
        else:
            setattr(template, field.name, value)
    return template.SerializeToString(deterministic=True)


def _merged(template: bytes, workers: tuple[bytes, ...]) -> plan_pb2.PlanRequest:
    merged = plan_pb2.PlanRequest.FromString(template)
    merged.world_size = 0
    for worker in workers:
        merged.workers.add().ParseFromString(worker)
    return merged


def _unavailable(what: str, *, prefix: str = "cannot reach ") -> bytes:
    """A serialized UNAVAILABLE status with a retry hint."""
    error = ServiceError(
        "UNAVAILABLE", f"{prefix}{what}; retry shortly", details={"retry_after_s": 1}
    )
    return to_rpc_status(error).SerializeToString()


# What one waiting rank holds, in multiples of its spec's bytes: the received
# body and the spec. Measured: 100-200 waiting ranks of 8,192 layers (367,552 B on
# the wire) added 0.75-0.8 MB of RSS each, 2.1-2.2x their spec (gRPC keeps the
# body and its own copy of it a while).
HELD_COPIES = 2

# The server answers a waiting rank this long before the caller's deadline, so
# the caller hears which ranks are missing instead of a bare DEADLINE_EXCEEDED.
ANSWER_BEFORE_DEADLINE_S = 0.5


def _ranges(ranks: Sequence[int]) -> str:
    """0,1,2,5,7,8 -> "0-2,5,7-8"."""
    parts: list[str] = []
    start = previous = None
    for rank in ranks:
        if previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            parts.append(f"{start}-{previous}" if previous != start else f"{start}")
        start = previous = rank
    if start is not None:
        parts.append(f"{start}-{previous}" if previous != start else f"{start}")
    return ",".join(parts) or "none"


def _raise_for(result: RendezvousResult) -> bytes:
    if result.ok:
        return result.payload
    raise RemoteStatus(status_pb2.Status.FromString(result.payload))


@dataclass(frozen=True, slots=True)
class RankSpec:
    """A waiting rank, as the bytes `--max-pending-rendezvous-bytes` counts: its
    request without workers and its worker, serialized. Its parsed request is not
    kept: upb held a rank of 8,192 layers (367,566 B on the wire) in about 3.5 MB,
    with the worker's layer spans, so 730 waiting ranks took 3.11 GB of RSS
    against the 256 MiB bound. They are parsed again when the engine is merged."""

    engine_id: str
    world_size: int
    rank: int
    template: bytes
    worker: bytes


class Rendezvous:
    def __init__(
        self,
        store: Store,
        plan: PlanFn,
        metrics: Metrics,
        *,
        max_pending: int,
        ttl_s: float,
        claim_timeout_s: float,
        max_pending_bytes: int = 256 * 1024 * 1024,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        max_pending_per_identity: int | None = None,
        max_pending_bytes_per_identity: int | None = None,
    ) -> None:
        self._store = store
        self._plan = plan
        self._metrics = metrics
        self._max_pending = max_pending
        self._ttl_s = ttl_s
        self._claim_timeout_s = claim_timeout_s
        # Each local rank's future, by engine, resolved by the store's news.
        self._waiters: dict[str, list[asyncio.Future[RendezvousResult]]] = {}
        self._planning: set[asyncio.Task[None]] = set()
        self._draining = False
        self._waiting = 0
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # HELD_COPIES x wire bytes of the ranks inside join() here
        self._max_result_bytes = max_result_bytes
        self._max_pending_per_identity = max_pending_per_identity
        # Each identity's share of the bytes above (with authentication).
        self._max_pending_bytes_per_identity = max_pending_bytes_per_identity
        self._pending_bytes_of: dict[str, int] = {}
        store.subscribe(self._on_finished)

    def _on_finished(self, engine_id: str, result: RendezvousResult) -> None:
        for future in self._waiters.pop(engine_id, ()):
            if not future.done():
                future.set_result(result)

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

    def rank_spec(
        self, request: plan_pb2.PlanRequest, worker_bytes: bytes | None = None
    ) -> RankSpec:
        """The rank's request, validated, as the bytes a waiting rank keeps.
        `worker_bytes`: the worker's deterministic serialization, when the caller
        has made it already."""
        worker = self._validate(request)
        if worker_bytes is None:
            worker_bytes = worker.SerializeToString(deterministic=True)
        return RankSpec(
            engine_id=request.engine_id,
            world_size=request.world_size,
            rank=worker.rank,
            template=_template_bytes(request),
            worker=worker_bytes,
        )

    async def join(
        self,
        request: plan_pb2.PlanRequest,
        timeout_s: float | None,
        identity: str = "",
        *,
        worker_bytes: bytes | None = None,
    ) -> bytes:
        """`join_rank` of the request's `rank_spec`."""
        if self._draining:
            raise ServiceError("UNAVAILABLE", "server is shutting down; retry on another replica")
        return await self.join_rank(self.rank_spec(request, worker_bytes), timeout_s, identity)

    async def join_rank(self, spec: RankSpec, timeout_s: float | None, identity: str = "") -> bytes:
        """The serialized plan of the rank's engine, once all its ranks arrived.
        `identity`: the engine's owner, whose share of pending engines it takes
        ("" without authentication: one identity, the global limit only).
        The caller keeps no parsed request meanwhile (see RankSpec)."""
        if self._draining:
            raise ServiceError("UNAVAILABLE", "server is shutting down; retry on another replica")
        engine_id, template, worker_bytes = spec.engine_id, spec.template, spec.worker
        # Counted twice: gRPC keeps the call's received body (about these bytes)
        # until it is answered, and the rank keeps its spec.
        size = HELD_COPIES * (len(template) + len(worker_bytes))
        if self._pending_bytes + size > self._max_pending_bytes:
            self._metrics.limits_hit.labels("max_pending_rendezvous_bytes").inc()
            raise limit_exceeded(
                "max_pending_rendezvous_bytes",
                self._pending_bytes + size,
                self._max_pending_bytes,
                "bytes held by ranks waiting for their engines on this server (twice each "
                "rank's request size), with this rank's",
            )
        held = self._pending_bytes_of.get(identity, 0)
        share = self._max_pending_bytes_per_identity
        if identity and share is not None and held + size > share:
            self._metrics.limits_hit.labels("max_pending_rendezvous_bytes_per_identity").inc()
            raise limit_exceeded(
                "max_pending_rendezvous_bytes_per_identity",
                held + size,
                share,
                f"bytes held by ranks of identity {identity!r} waiting for their engines on "
                "this server (twice each rank's request size), with this rank's",
            )
        self._pending_bytes += size
        self._pending_bytes_of[identity] = held + size
        # Registered before joining, so news of the engine cannot slip past.
        future: asyncio.Future[RendezvousResult] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(engine_id, []).append(future)
        try:
            try:
                arrival = await self._store.rendezvous_join(
                    engine_id=engine_id,
                    world_size=spec.world_size,
                    template=template,
                    rank=spec.rank,
                    worker=worker_bytes,
                    now=time.time(),
                    ttl_s=self._ttl_s,
                    max_pending=self._max_pending,
                    claim_timeout_s=self._claim_timeout_s,
                    identity=identity,
                    max_pending_per_identity=self._max_pending_per_identity if identity else None,
                )
            except ServiceError as refusal:  # a pending limit: counted as the others are
                if refusal.code == "RESOURCE_EXHAUSTED":
                    self._metrics.limits_hit.labels(str(refusal.details["limit"])).inc()
                raise
            if arrival.state == "finished":
                assert arrival.result is not None
                return _raise_for(arrival.result)
            if arrival.state == "plan":
                task = asyncio.create_task(self._plan_engine(engine_id, template, arrival.workers))
                self._planning.add(task)
                task.add_done_callback(self._planning.discard)
            # Bounded by the rendezvous TTL even without a deadline, and ended by the
            # server shortly before the caller's deadline so it hears what is missing.
            wait_s = self._ttl_s
            if timeout_s is not None:
                wait_s = min(wait_s, max(timeout_s - ANSWER_BEFORE_DEADLINE_S, timeout_s * 0.9))
            return await self._wait(engine_id, future, spec.rank, spec.world_size, wait_s)
        finally:
            self._pending_bytes -= size
            self._pending_bytes_of[identity] -= size
            if not self._pending_bytes_of[identity]:
                del self._pending_bytes_of[identity]
            waiting = self._waiters.get(engine_id)
            if waiting is not None and future in waiting:  # not yet resolved: unregister
                waiting.remove(future)
                if not waiting:
                    del self._waiters[engine_id]

    async def _plan_engine(
        self, engine_id: str, template: bytes, workers: tuple[bytes, ...]
    ) -> None:
        """This replica completed the engine: plan it and tell every replica."""
        # A failed plan is kept for the engine's ranks until the rendezvous TTL (a
        # rank that comes back unchanged gets the same error at once); a transient
        # failure (UNAVAILABLE) is not: the ranks retry from scratch.
        remember = True
        try:
            if len(template) + sum(map(len, workers)) > LARGE_MESSAGE_BYTES:
                # Parsed in a thread, a rank at a time (server/large_messages.py).
                merged = await asyncio.to_thread(_merged, template, workers)
            else:
                merged = _merged(template, workers)
            result = RendezvousResult(True, await self._plan(merged))
        except (PlanningError, ServiceError) as error:
            result = RendezvousResult(False, to_rpc_status(error).SerializeToString())
            remember = error.code != "UNAVAILABLE"
        except StoreUnavailable as error:  # the grant could not reach the ledger
            result = RendezvousResult(False, _unavailable(f"the state store ({error})"))
            remember = False
        except RemoteStatus as error:
            result = RendezvousResult(False, error.status.SerializeToString())
        except Exception:  # a fault: every waiting rank hears it, with the request id
            request_id = current_request_id()
            log.exception(
                "unexpected error planning a rendezvous",
                extra={"engine_id": engine_id, "request_id": request_id},
            )
            internal = ServiceError(
                "INTERNAL", f"internal error (request id {request_id}); the server logged it"
            )
            result = RendezvousResult(False, to_rpc_status(internal).SerializeToString())
            remember = False
        try:
            await self._store.rendezvous_finish(
                engine_id,
                result,
                time.time(),
                remember_failure=remember and not result.ok,
                max_kept_bytes=self._max_result_bytes,
            )
        except StoreUnavailable as error:
            # The claim stays in the store, so a retry after claim_timeout_s plans
            # again; the ranks waiting here learn now instead of at their deadline.
            self._on_finished(
                engine_id, RendezvousResult(False, _unavailable(f"the state store ({error})"))
            )

    async def _wait(
        self,
        engine_id: str,
        future: asyncio.Future[RendezvousResult],
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> bytes:
        start = time.perf_counter()
        self._waiting += 1
        self._metrics.rendezvous_waiting.set(self._waiting)
        try:
            async with asyncio.timeout(timeout_s):
                result = await future  # this rank's own: cancelling it touches no other
        except TimeoutError:
            try:
                arrived = await self._store.rendezvous_ranks(engine_id)
            except StoreUnavailable:
                arrived = (rank,)
            await self._leave(engine_id, rank)
            missing = sorted(set(range(world_size)) - set(arrived))
            raise ServiceError(
                "DEADLINE_EXCEEDED",
                f"engine {engine_id!r}: not all ranks arrived within {timeout_s:.1f} s "
                f"(rank {rank} waited {time.perf_counter() - start:.1f} s); arrived: "
                f"{_ranges(arrived)}; missing: {_ranges(missing)} of world_size {world_size}",
                details={
                    "arrived_ranks": _ranges(arrived),
                    "missing_ranks": _ranges(missing),
                    "world_size": world_size,
                },
            ) from None
        except asyncio.CancelledError:
            await self._leave(engine_id, rank)
            raise
        finally:
            self._waiting -= 1
            self._metrics.rendezvous_waiting.set(self._waiting)
            self._metrics.rendezvous_wait.observe(time.perf_counter() - start)
        return _raise_for(result)

    async def _leave(self, engine_id: str, rank: int) -> None:
        """A rank that stops waiting leaves an unfinished rendezvous."""
        try:
            await self._store.rendezvous_leave(engine_id, rank)
        except Exception:  # the caller is gone; the TTL cleans up what this could not
            return

    def waiting(self) -> int:
        """Ranks of this process waiting for their engines' other ranks."""
        return self._waiting

    async def pending_engines(self) -> int:
        return await self._store.pending_engines()

    def drain(self) -> None:
        """Shutdown: local waiting ranks get UNAVAILABLE and retry elsewhere; their
        specs stay in the store, so a retry is accepted as the same rank."""
        self._draining = True
        unavailable = _unavailable(
            "server shutting down before the engine completed; retry (every waiting rank "
            "does so by itself) on another replica",
            prefix="",
        )
        waiters, self._waiters = self._waiters, {}
        for futures in waiters.values():
            for future in futures:
                if not future.done():
                    future.set_result(RendezvousResult(False, unavailable))
