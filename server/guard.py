"""Every call's envelope: request id, a body that parses, credentials, drain,
and an explained answer for every fault.

- A body that does not parse is INVALID_ARGUMENT (the deserializer never
  raises; gRPC would answer UNKNOWN and skip the interceptors' counts).
- A body over LARGE_MESSAGE_BYTES is parsed once its caller is authenticated, in
  a worker thread, one at a time (server/large_messages.py), not on the event
  loop: a 57 MB request held every other call for 2-3 s.
- The caller's identity (server/security.py) is checked before the handler
  runs: UNAUTHENTICATED otherwise. Health stays open (it says only SERVING).
- An exception no handler expected is logged with its traceback and request
  id and answered INTERNAL naming that id.
- Drain (SIGTERM): calls keep being served until none is in flight or the
  grace period ends; those still running then are answered UNAVAILABLE with a
  retry hint instead of being cut off.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from kvplan.server.errors import ServiceError, to_status
from kvplan.server.large_messages import LARGE_MESSAGE_BYTES
from kvplan.server.metrics import HandlerCache, Metrics, wrapped_once
from kvplan.server.security import ANONYMOUS, Authenticator, Identity, Unauthenticated

log = logging.getLogger("kvplan.server")

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvplan_request_id", default="")
IDENTITY: contextvars.ContextVar[Identity] = contextvars.ContextVar(
    "kvplan_identity", default=ANONYMOUS
)
# The call's body was over LARGE_MESSAGE_BYTES (parsed off the event loop).
LARGE_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvplan_large_request", default=False
)
_REQUEST_ID_FORM = re.compile(r"[A-Za-z0-9._-]{1,64}")
OPEN_SERVICES = ("grpc.health.v1.Health",)


def current_identity() -> Identity:
    return IDENTITY.get()


def current_request_id() -> str:
    return REQUEST_ID.get()


def request_was_large() -> bool:
    """The current call's body was over LARGE_MESSAGE_BYTES."""
    return LARGE_REQUEST.get()


class Unparseable:
    """What the deserializer returns for bytes that are not the request type."""

    __slots__ = ("error", "size")

    def __init__(self, error: str, size: int) -> None:
        self.error = error
        self.size = size


class LargeBody:
    """What the deserializer returns for a body over LARGE_MESSAGE_BYTES: the
    guard parses it off the event loop once the caller is authenticated."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _parsed(deserializer: Callable[[bytes], Any], raw: bytes) -> Any:
    try:
        return deserializer(raw)
    except Exception as error:
        return Unparseable(str(error) or type(error).__name__, len(raw))


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        if len(raw) > LARGE_MESSAGE_BYTES:
            return LargeBody(raw)
        return _parsed(deserializer, raw)

    return parse


def _call_over(context: grpc.aio.ServicerContext) -> bool:
    """The call ended on the caller's side (deadline passed, cancelled)."""
    remaining = context.time_remaining()
    return bool(context.cancelled() or context.done()) or (remaining is not None and remaining <= 0)


# Ids of calls that bring none: this process's random prefix and a serial, unique
# without a call into the kernel for randomness per call.
_PROCESS_PREFIX = secrets.token_hex(4)
_SERIALS = itertools.count(1)


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and _REQUEST_ID_FORM.fullmatch(value):
            return value
    return f"{_PROCESS_PREFIX}{next(_SERIALS):08x}"


class Drain:
    """Calls in flight, and the shutdown that waits for them."""

    def __init__(self) -> None:
        self.in_flight: set[asyncio.Task[Any]] = set()
        self.calls_started = 0  # ever (server/heap.py trims after calls)
        self.draining = False
        self.expired = False
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.calls_started += 1
        task = asyncio.current_task()
        if task is not None:
            self.in_flight.add(task)
            self._idle.clear()

    def leave(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.in_flight.discard(task)
        if not self.in_flight:
            self._idle.set()

    async def wait(self, grace_s: float, quiet_s: float = 0.5) -> int:
        """Serve until no call is in flight (for `quiet_s`) or `grace_s` passed;
        then answer the calls still running with UNAVAILABLE. Returns how many."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._idle.wait(), left)
            except TimeoutError:
                break
            # Calls the server core had already received may still be on their way in.
            await asyncio.sleep(min(quiet_s, max(deadline - loop.time(), 0)))
            if self._idle.is_set():
                return 0
        self.expired = True
        cut = list(self.in_flight)
        for task in cut:
            task.cancel("kvplan drain: grace period over")
        if cut:
            await asyncio.wait(cut, timeout=1.0)
        return len(cut)


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """See the module docstring. Wraps each method's handler once."""

    def __init__(self, authenticator: Authenticator, drain: Drain, metrics: Metrics) -> None:
        self._authenticator = authenticator
        self._drain = drain
        self._metrics = metrics
        self._wrapped: HandlerCache = {}
        # One large body parsed at a time: each is held several times over meanwhile.
        self._large_bodies = asyncio.Semaphore(1)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return wrapped_once(self._wrapped, handler_call_details.method, handler, self._wrap)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        service = method.split("/")[1] if method.count("/") >= 2 else ""
        open_service = service in OPEN_SERVICES
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(
                    handler.unary_unary, method, open_service, handler.request_deserializer
                ),
                request_deserializer=_safe(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None and not open_service:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        try:
            IDENTITY.set(self._authenticator.identify(context))
        except Unauthenticated as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))

    def _unary(
        self,
        inner: Callable[..., Awaitable[Any]],
        method: str,
        open_service: bool,
        deserializer: Callable[[bytes], Any] | None,
    ) -> Callable[..., Awaitable[Any]]:
        drain = self._drain
        kind = method.rsplit("/", 1)[-1]

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request_id = _request_id(context)
            REQUEST_ID.set(request_id)
            drain.enter()
            try:
                if not open_service:
                    await self._authenticate(context)
                if isinstance(request, LargeBody) and deserializer is not None:
                    LARGE_REQUEST.set(True)
                    async with self._large_bodies:
                        request = await asyncio.to_thread(_parsed, deserializer, request.data)
                if isinstance(request, Unparseable):
                    await context.abort_with_status(
                        to_status(
                            ServiceError(
                                "INVALID_ARGUMENT",
                                f"the request body ({request.size} bytes) is not a valid "
                                f"{kind} request message: {request.error}",
                            )
                        )
                    )
                return await inner(request, context)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                if drain.expired:
                    await context.abort_with_status(
                        to_status(
                            ServiceError(
                                "UNAVAILABLE",
                                "the server shut down before this call finished; retry "
                                "(another replica, or this one once it is back)",
                                details={"retry_after_s": 1},
                            )
                        )
                    )
                raise
            except Exception as error:
                if _call_over(context):
                    # The caller's deadline passed or it went away while the answer
                    # was being sent: nobody is left to answer, and it is no fault.
                    log.info(
                        "call ended before its answer was sent",
                        extra={"request_id": request_id, "method": method, "error": str(error)},
                    )
                    raise
                self._metrics.unexpected_errors.inc()
                log.exception(
                    "unexpected error in a handler",
                    extra={"request_id": request_id, "method": method},
                )
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"internal error (request id {request_id}); the server logged it",
                )
                raise
            finally:
                drain.leave()

        return guarded

    def _streaming(
        self, inner: Callable[..., AsyncIterator[Any]], method: str
    ) -> Callable[..., AsyncIterator[Any]]:
        async def guarded(
            request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            REQUEST_ID.set(_request_id(context))
            await self._authenticate(context)
            async for response in inner(request_iterator, context):
                yield response

        return guarded
