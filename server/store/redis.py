"""The shared store: several server replicas behind one address use one Redis.

Every change is one MULTI/EXEC transaction guarded by WATCH (optimistic: a
concurrent change to a watched key makes EXEC fail and the method starts
over), or one Lua script, so a replica that dies or loses Redis mid-call
leaves nothing half-written. Decisions (the ledger's `grant_leases`, the
rendezvous rules) run here in Python, between the reads and the EXEC, with the
helpers the memory store uses: one formula, one set of messages.

Key layout under `key_prefix` (default "kvplan:"):

    plans                 ZSET  plan_id -> insertion number (oldest dropped first)
    plans-seq             STRING counter behind those numbers
    plans-bytes           STRING bytes held by plans: heads and distinct bodies
    plan:{plan_id}        HASH  engine_id, head, body (the body's digest); a plan
                                written before bodies were shared: engine_id, plan
    plan-body:{digest}    HASH  body, holders (plans holding it; see store/bodies.py)
    engine-plan:{engine}  STRING plan_id of the engine's newest plan
    rdv:open              ZSET  engine_id -> created (rule 1 forgets by it)
    rdv:open:{engine}     HASH  world_size, template, created, ttl_s,
                                claimed_at (absent: unclaimed), rank:{r} -> WorkerSpec
    rdv:done              ZSET  engine_id -> finished
    rdv:done:{engine}     HASH  template_digest, plan, finished, rank:{r} -> worker digest
    lease-engines         SET   engines with a lease hash
    lease:{engine}        HASH  rank -> JSON [device_uuid, bytes, allocated_bytes,
                                granted_at, expires_at]
    lease-version         STRING bumped by every ledger write: the key a grant watches
    rendezvous-finished   pub/sub channel of finished rendezvous

Liveness is `expires_at` against the caller's `now` (the contract); Redis
expiry is only the janitor: a lease hash lives `expiry_grace_s` past its
engine's latest expiry (rendezvous hashes past their TTL), measured from the
write, so an engine or a whole deployment that vanished leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import struct
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import redis.asyncio
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError, ResponseError, WatchError

from kvplan.core.ledger import DeviceState, Lease, LeaseRequest, grant_leases
from kvplan.server.errors import ServiceError
from kvplan.server.store.base import (
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    Arrival,
    FinishedCallback,
    RendezvousResult,
    StoreUnavailable,
)
from kvplan.server.store.bodies import PlanParts, plan_parts
from kvplan.server.store.memory import (
    check_compatible,
    check_finished,
    digest,
    renew_leases,
    same_ranks,
    too_many_pending,
)
from kvplan.server.tasks import cancel_and_wait

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ATTEMPTS = 200  # optimistic transactions retried on a conflict before giving up
LISTENER_BACKOFF_S = (0.05, 1.0)  # pub/sub reconnect delay: first, longest

# A message: origin replica, ok flag, engine id length, engine id, payload.
_HEADER = struct.Struct(">16sBI")

# Lua: every lease hash at once, atomically (grant reads it under WATCH).
_SNAPSHOT_LEASES = """
local out = {}
for _, engine in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    out[#out + 1] = engine
    out[#out + 1] = redis.call('HGETALL', ARGV[1] .. engine)
end
return out
"""

# Lua, shared by the plan scripts: a plan's bytes and letting go of its body.
# A plan hash holds head + body digest, or (written before bodies were shared)
# the whole plan.
_PLAN_HELPERS = """
local function plan_bytes(plan_key, body_prefix)
    local fields = redis.call('HMGET', plan_key, 'head', 'body', 'plan')
    if fields[3] then
        return fields[3]
    end
    if not fields[2] then
        return false
    end
    return fields[1] .. redis.call('HGET', body_prefix .. fields[2], 'body')
end

-- Delete a plan's hash; the bytes that frees (its head, its body if unheld now).
local function drop_plan(plan_key, body_prefix)
    local fields = redis.call('HMGET', plan_key, 'head', 'body', 'plan')
    redis.call('DEL', plan_key)
    if fields[3] then
        return string.len(fields[3])
    end
    if not fields[2] then
        return 0
    end
    local freed = string.len(fields[1])
    local body_key = body_prefix .. fields[2]
    if redis.call('HINCRBY', body_key, 'holders', -1) <= 0 then
        freed = freed + redis.call('HSTRLEN', body_key, 'body')
        redis.call('DEL', body_key)
    end
    return freed
end
"""

# Lua: keep a plan, point its engine at it, drop the oldest beyond the bound.
# KEYS: plans (zset by seq), plans-seq, plans-bytes (heads and distinct bodies).
# ARGV: plan_id, engine_id, head, body digest, body, plan key prefix, engine-plan
# key prefix, body key prefix, max plans, max plan bytes. Oldest first; the
# newest plan always stays.
_PUT_PLAN = (
    _PLAN_HELPERS
    + """
local plan_key = ARGV[6] .. ARGV[1]
local body_key = ARGV[8] .. ARGV[4]
-- Held before the replaced plan lets go of an equal body.
local added = string.len(ARGV[3])
if redis.call('HINCRBY', body_key, 'holders', 1) == 1 then
    redis.call('HSET', body_key, 'body', ARGV[5])
    added = added + string.len(ARGV[5])
end
local freed = drop_plan(plan_key, ARGV[8])
local seq = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], seq, ARGV[1])
redis.call('HSET', plan_key, 'engine_id', ARGV[2], 'head', ARGV[3], 'body', ARGV[4])
local size = redis.call('INCRBY', KEYS[3], added - freed)
if ARGV[2] ~= '' then
    redis.call('SET', ARGV[7] .. ARGV[2], ARGV[1])
end
local max_plans = tonumber(ARGV[9])
local max_bytes = tonumber(ARGV[10])
local count = redis.call('ZCARD', KEYS[1])
while count > 1 and (count > max_plans or size > max_bytes) do
    local evicted = redis.call('ZPOPMIN', KEYS[1])[1]
    local evicted_key = ARGV[6] .. evicted
    local engine = redis.call('HGET', evicted_key, 'engine_id')
    if engine and engine ~= '' and redis.call('GET', ARGV[7] .. engine) == evicted then
        redis.call('DEL', ARGV[7] .. engine)
    end
    size = redis.call('INCRBY', KEYS[3], -drop_plan(evicted_key, ARGV[8]))
    count = count - 1
end
return seq
"""
)

# Lua: a plan's bytes by plan id (ARGV[1] empty) or by engine (KEYS[1]: its
# engine-plan key). ARGV: plan id, plan key prefix, body key prefix.
_GET_PLAN = (
    _PLAN_HELPERS
    + """
local plan_id = ARGV[1]
if plan_id == '' then
    plan_id = redis.call('GET', KEYS[1])
    if not plan_id then
        return false
    end
end
return plan_bytes(ARGV[2] .. plan_id, ARGV[3])
"""
)

# Lua: the engine's owner; set (or its expiry pushed) when free or already the caller's.
_CLAIM_ENGINE = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then
    return owner
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""


def _expiry_ms(seconds: float) -> int | None:
    """A Redis relative expiry for `seconds` from now; None: keep forever."""
    if not math.isfinite(seconds):
        return None
    return max(1, math.ceil(seconds * 1000))


def _encode_lease(lease: Lease) -> bytes:
    fields = [
        lease.device_uuid,
        lease.bytes,
        lease.allocated_bytes,
        lease.granted_at,
        lease.expires_at,
    ]
    return json.dumps(fields, separators=(",", ":")).encode()


def _decode_lease(engine_id: str, rank: bytes, value: bytes) -> Lease:
    device_uuid, size, allocated, granted_at, expires_at = json.loads(value)
    return Lease(
        engine_id=engine_id,
        rank=int(rank),
        device_uuid=device_uuid,
        bytes=size,
        allocated_bytes=allocated,
        granted_at=float(granted_at),
        expires_at=float(expires_at),
    )


def _decode_hash(engine_id: str, raw: Mapping[bytes, bytes]) -> list[Lease]:
    return sorted(
        (_decode_lease(engine_id, rank, value) for rank, value in raw.items()),
        key=lambda lease: lease.rank,
    )


def _rank_fields(raw: Mapping[bytes, bytes]) -> dict[int, bytes]:
    """The per-rank fields of a rendezvous hash."""
    return {
        int(key.removeprefix(b"rank:")): value
        for key, value in raw.items()
        if key.startswith(b"rank:")
    }


def _begin(pipe: Pipeline) -> None:
    """MULTI: what the pipeline queues from here runs at EXEC, all or nothing."""
    pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped


async def _read_hash(pipe: Pipeline, key: str) -> dict[bytes, bytes]:
    return cast(dict[bytes, bytes], await pipe.hgetall(key))


class RedisStore:
    kind = "redis"

    def __init__(
        self,
        url: str,
        max_plans: int = DEFAULT_MAX_PLANS,
        key_prefix: str = "kvplan:",
        *,
        max_plan_bytes: int = DEFAULT_MAX_PLAN_BYTES,
        expiry_grace_s: float = 60.0,
        require_persistence: bool = False,
    ) -> None:
        self._url = url
        self._require_persistence = require_persistence
        self._max_plans = max_plans
        self._max_plan_bytes = max_plan_bytes
        self._prefix = key_prefix
        self._expiry_grace_s = expiry_grace_s
        self._channel = key_prefix + "rendezvous-finished"
        self._origin = uuid.uuid4().bytes  # tells this replica's messages from the others'
        self._client: redis.asyncio.Redis | None = None
        self._scripts: dict[str, AsyncScript] = {}
        self._listener: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._closing = False
        self._subscribers: list[FinishedCallback] = []
        self.transaction_retries = 0  # conflicts seen (tests, diagnostics)

    # --- keys ---------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _lease_key(self, engine_id: str) -> str:
        return self._prefix + "lease:" + engine_id

    def _open_key(self, engine_id: str) -> str:
        return self._prefix + "rdv:open:" + engine_id

    def _done_key(self, engine_id: str) -> str:
        return self._prefix + "rdv:done:" + engine_id

    # --- connection ---------------------------------------------------------------

    def _redis(self) -> redis.asyncio.Redis:
        if self._client is None:
            raise StoreUnavailable(f"Redis store {self._url} is not started")
        return self._client

    def _unavailable(self, error: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"Redis store {self._url}: {type(error).__name__}: {error}")

    async def _call(self, operation: Awaitable[T]) -> T:
        """One command or script; a Redis failure becomes StoreUnavailable."""
        try:
            return await operation
        except (RedisError, OSError) as error:
            raise self._unavailable(error) from error

    async def _transact(self, attempt: Callable[[Pipeline], Awaitable[T]]) -> T:
        """Run `attempt` (WATCH, read, decide, MULTI, EXEC) until no watched key
        changed under it. A connection lost while watching also surfaces as a
        WatchError; the next attempt then fails to connect, or succeeds."""
        for _ in range(MAX_ATTEMPTS):
            try:
                async with self._redis().pipeline(transaction=True) as pipe:
                    return await attempt(pipe)
            except WatchError:
                self.transaction_retries += 1
            except (RedisError, OSError) as error:
                raise self._unavailable(error) from error
        raise StoreUnavailable(
            f"Redis store {self._url}: {MAX_ATTEMPTS} conflicting attempts in a row; retry"
        )

    async def start(self) -> None:
        if self._client is not None:
            return
        # Few, short retries: a dead pooled connection after a Redis restart is
        # replaced transparently, an outage answers UNAVAILABLE quickly.
        self._client = redis.asyncio.Redis.from_url(
            self._url,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
            socket_connect_timeout=2.0,
            socket_timeout=5.0,
            health_check_interval=10,
        )
        self._scripts = {
            "snapshot": self._client.register_script(_SNAPSHOT_LEASES),
            "put_plan": self._client.register_script(_PUT_PLAN),
            "get_plan": self._client.register_script(_GET_PLAN),
            "claim_engine": self._client.register_script(_CLAIM_ENGINE),
        }
        try:
            await self.ping()
            if self._require_persistence:
                await self._check_persistence()
        except (StoreUnavailable, ValueError):
            await self.close()
            raise
        self._closing = False
        self._subscribed = asyncio.Event()
        self._listener = asyncio.create_task(self._listen(), name="kvplan-redis-listener")
        # Serve only once other replicas' news reaches this one: a rendezvous
        # finished before the subscription would leave local ranks waiting.
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout=5.0)
        except TimeoutError:
            await self.close()
            raise StoreUnavailable(f"cannot subscribe to {self._channel} on {self._url}") from None

    async def _check_persistence(self) -> None:
        """Leases kept only in memory are lost when Redis restarts, and the ledger
        then grants the same device memory again: refuse such a Redis."""
        client = self._redis()
        info = await self._call(client.info("persistence"))
        if int(info.get("aof_enabled", 0)) == 1:
            return
        try:
            save = (await client.config_get("save")).get("save", "")
        except ResponseError:  # CONFIG disabled (managed Redis): cannot tell
            save = ""
        except (RedisError, OSError) as error:
            raise self._unavailable(error) from error
        if str(save).strip():
            return
        raise ValueError(
            f"Redis store {self._url} keeps no data across a restart (appendonly no, no save "
            "points): a restart would lose every lease and grant the same memory twice. "
            "Enable AOF (appendonly yes), or start with --redis-allow-no-persistence"
        )

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            # The flag ends the loop where a cancellation is lost inside redis-py.
            self._closing = True
            await cancel_and_wait(listener)
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()

    async def ping(self) -> None:
        await self._call(self._redis().ping())

    # --- plans --------------------------------------------------------------------

    async def put_plan(
        self, plan_id: str, engine_id: str, plan: bytes | PlanParts, now: float
    ) -> None:
        parts = plan_parts(plan_id, engine_id, plan)
        self._redis()
        await self._call(
            self._scripts["put_plan"](
                keys=[self._key("plans"), self._key("plans-seq"), self._key("plans-bytes")],
                args=[
                    plan_id,
                    engine_id,
                    parts.head,
                    parts.digest.hex(),
                    parts.body,
                    self._key("plan:"),
                    self._key("engine-plan:"),
                    self._key("plan-body:"),
                    self._max_plans,
                    self._max_plan_bytes,
                ],
            )
        )

    async def _get_plan(self, plan_id: str, engine_id: str) -> bytes | None:
        self._redis()
        plan = await self._call(
            self._scripts["get_plan"](
                keys=[self._key("engine-plan:" + engine_id)],
                args=[plan_id, self._key("plan:"), self._key("plan-body:")],
            )
        )
        return bytes(plan) if plan else None

    async def get_plan(self, plan_id: str) -> bytes | None:
        return await self._get_plan(plan_id, "") if plan_id else None

    async def plan_for_engine(self, engine_id: str) -> bytes | None:
        return await self._get_plan("", engine_id) if engine_id else None

    async def distinct_plan_bodies(self) -> int:
        """Bodies stored (tests: plans of equal content share one)."""
        count = 0
        async for _ in self._redis().scan_iter(match=self._key("plan-body:*"), count=1000):
            count += 1
        return count

    # --- rendezvous ---------------------------------------------------------------

    async def rendezvous_join(
        self,
        *,
        engine_id: str,
        world_size: int,
        template: bytes,
        rank: int,
        worker: bytes,
        now: float,
        ttl_s: float,
        max_pending: int,
        claim_timeout_s: float,
    ) -> Arrival:
        open_index, done_index = self._key("rdv:open"), self._key("rdv:done")
        open_key, done_key = self._open_key(engine_id), self._done_key(engine_id)

        async def stale(pipe: Pipeline, index: str) -> list[str]:
            # Candidates by score, then the memory store's exact comparison.
            candidates = cast(
                list[tuple[bytes, float]],
                await pipe.zrangebyscore(index, "-inf", now - ttl_s + 1, withscores=True),
            )
            return [member.decode() for member, since in candidates if now - since > ttl_s]

        async def attempt(pipe: Pipeline) -> Arrival:
            await pipe.watch(open_index, done_index, open_key, done_key)
            stale_open = await stale(pipe, open_index)
            stale_done = await stale(pipe, done_index)
            done = {} if engine_id in stale_done else await _read_hash(pipe, done_key)
            entry = {} if engine_id in stale_open else await _read_hash(pipe, open_key)
            pending = await pipe.zcard(open_index) - len(stale_open)

            def forget_stale() -> None:
                """Rule 1's writes, part of whatever this join writes."""
                if stale_open:
                    pipe.zrem(open_index, *stale_open)
                    pipe.delete(*(self._open_key(e) for e in stale_open))
                if stale_done:
                    pipe.zrem(done_index, *stale_done)
                    pipe.delete(*(self._done_key(e) for e in stale_done))

            async def refuse(error: ServiceError) -> ServiceError:
                if stale_open or stale_done:
                    _begin(pipe)
                    forget_stale()
                    await pipe.execute()
                return error

            drop_failed = bool(done) and done.get(b"ok") == b"0"
            if drop_failed:
                if same_ranks(
                    done[b"template_digest"],
                    done.get(f"rank:{rank}".encode()),
                    template=template,
                    worker=worker,
                ):
                    arrival = Arrival("finished", result=RendezvousResult(False, done[b"plan"]))
                    if stale_open or stale_done:
                        _begin(pipe)
                        forget_stale()
                        await pipe.execute()
                    return arrival
                done = {}  # a changed rank: the failure is forgotten below
            if done:
                try:
                    check_finished(
                        engine_id,
                        done[b"template_digest"],
                        done.get(f"rank:{rank}".encode()),
                        template=template,
                        rank=rank,
                        worker=worker,
                    )
                except ServiceError as error:
                    raise await refuse(error) from None
                arrival = Arrival("finished", result=RendezvousResult(True, done[b"plan"]))
                if stale_open or stale_done:
                    _begin(pipe)
                    forget_stale()
                    await pipe.execute()
                return arrival

            created = not entry
            if created:
                if pending >= max_pending:
                    raise await refuse(too_many_pending(pending, max_pending))
                open_world_size, open_template, claimed_at = world_size, template, None
                workers: dict[int, bytes] = {}
            else:
                open_world_size = int(entry[b"world_size"])
                open_template = entry[b"template"]
                claimed = entry.get(b"claimed_at")
                claimed_at = float(claimed) if claimed is not None else None
                workers = _rank_fields(entry)
            try:
                check_compatible(
                    engine_id,
                    open_world_size,
                    open_template,
                    workers.get(rank),
                    world_size=world_size,
                    template=template,
                    rank=rank,
                    worker=worker,
                )
            except ServiceError as error:
                raise await refuse(error) from None
            workers[rank] = worker
            fields: dict[str, bytes | str | float | int] = {f"rank:{rank}": worker}
            incomplete = len(workers) < open_world_size
            claim_alive = claimed_at is not None and now - claimed_at <= claim_timeout_s
            if incomplete or claim_alive:
                arrival = Arrival("waiting")
            else:
                fields["claimed_at"] = repr(now)
                arrival = Arrival("plan", workers=tuple(workers[r] for r in sorted(workers)))

            _begin(pipe)
            forget_stale()
            if drop_failed and engine_id not in stale_done:
                pipe.delete(done_key)
                pipe.zrem(done_index, engine_id)
            if created:
                fields.update(
                    world_size=world_size,
                    template=template,
                    created=repr(now),
                    ttl_s=repr(ttl_s),
                )
                pipe.zadd(open_index, {engine_id: now})
            pipe.hset(open_key, mapping=fields)  # type: ignore[arg-type]
            expiry = _expiry_ms(ttl_s + self._expiry_grace_s)
            if created and expiry is not None:
                pipe.pexpire(open_key, expiry)
            await pipe.execute()
            return arrival

        return await self._transact(attempt)

    async def rendezvous_leave(self, engine_id: str, rank: int) -> None:
        open_key = self._open_key(engine_id)

        async def attempt(pipe: Pipeline) -> None:
            await pipe.watch(open_key)
            entry = await _read_hash(pipe, open_key)
            if not entry or b"claimed_at" in entry:
                return
            workers = _rank_fields(entry)
            if rank not in workers:
                return
            _begin(pipe)
            if len(workers) == 1:
                pipe.delete(open_key)
                pipe.zrem(self._key("rdv:open"), engine_id)
            else:
                pipe.hdel(open_key, f"rank:{rank}")
            await pipe.execute()

        await self._transact(attempt)

    async def rendezvous_finish(
        self,
        engine_id: str,
        result: RendezvousResult,
        now: float,
        *,
        remember_failure: bool = False,
    ) -> None:
        open_key, done_key = self._open_key(engine_id), self._done_key(engine_id)
        engine = engine_id.encode()
        message = _HEADER.pack(self._origin, result.ok, len(engine)) + engine + result.payload

        async def attempt(pipe: Pipeline) -> None:
            await pipe.watch(open_key)
            entry = await _read_hash(pipe, open_key)
            _begin(pipe)
            pipe.delete(open_key)
            pipe.zrem(self._key("rdv:open"), engine_id)
            if (result.ok or remember_failure) and entry:
                fields: dict[str, bytes | str] = {
                    "template_digest": digest(entry[b"template"]),
                    "plan": result.payload,
                    "finished": repr(now),
                    "ok": "1" if result.ok else "0",
                }
                for rank, spec in _rank_fields(entry).items():
                    fields[f"rank:{rank}"] = digest(spec)
                pipe.delete(done_key)
                pipe.hset(done_key, mapping=fields)  # type: ignore[arg-type]
                pipe.zadd(self._key("rdv:done"), {engine_id: now})
                expiry = _expiry_ms(float(entry[b"ttl_s"]) + self._expiry_grace_s)
                if expiry is not None:
                    pipe.pexpire(done_key, expiry)
            pipe.publish(self._channel, message)
            await pipe.execute()

        await self._transact(attempt)
        # The listener skips this replica's own messages: delivered here, once.
        self._deliver(engine_id, result)

    def subscribe(self, callback: FinishedCallback) -> None:
        self._subscribers.append(callback)

    async def claim_engine(self, engine_id: str, identity: str, now: float, ttl_s: float) -> str:
        self._redis()
        owner = await self._call(
            self._scripts["claim_engine"](
                keys=[self._key("owner:" + engine_id)],
                args=[identity, max(int(ttl_s * 1000), 1)],
            )
        )
        return owner.decode() if isinstance(owner, bytes) else str(owner)

    async def engine_owner(self, engine_id: str, now: float) -> str | None:
        owner = await self._call(self._redis().get(self._key("owner:" + engine_id)))
        return owner.decode() if isinstance(owner, bytes) else None

    async def rendezvous_ranks(self, engine_id: str) -> tuple[int, ...]:
        keys = await self._call(self._redis().hkeys(self._open_key(engine_id)))
        return tuple(sorted(_rank_fields({key: b"" for key in keys if isinstance(key, bytes)})))

    async def pending_engines(self) -> int:
        return int(await self._call(self._redis().zcard(self._key("rdv:open"))))

    def _deliver(self, engine_id: str, result: RendezvousResult) -> None:
        for callback in list(self._subscribers):
            try:
                callback(engine_id, result)
            except Exception:  # one broken waiter must not hide the outcome from the rest
                log.exception("rendezvous subscriber failed", extra={"engine_id": engine_id})

    def _on_message(self, data: bytes) -> None:
        try:
            origin, ok, length = _HEADER.unpack_from(data)
            start = _HEADER.size
            engine_id = data[start : start + length].decode()
        except (struct.error, UnicodeDecodeError):
            log.warning("Redis store %s: ignored a malformed message", self._url)
            return
        if origin == self._origin:
            return
        self._deliver(engine_id, RendezvousResult(bool(ok), data[start + length :]))

    async def _listen(self) -> None:
        """Other replicas' finished rendezvous, for as long as the store is open;
        reconnects after Redis goes away (what is published meanwhile is missed:
        those waiters time out and their retry finds the finished engine)."""
        delay, failing = LISTENER_BACKOFF_S[0], False
        while not self._closing:
            pubsub = self._redis().pubsub()
            try:
                await pubsub.subscribe(self._channel)
                self._subscribed.set()
                if failing:
                    log.info("Redis store %s: rendezvous listener reconnected", self._url)
                delay, failing = LISTENER_BACKOFF_S[0], False
                while not self._closing:
                    # A timeout, not a blocking read: the connection's health
                    # check (PING) runs on each call, so a dead link is noticed.
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message["type"] == "message":
                        self._on_message(message["data"])
            except (RedisError, OSError) as error:
                if not failing:
                    log.warning(
                        "Redis store %s: rendezvous listener lost Redis (%s); reconnecting",
                        self._url,
                        error,
                    )
                failing = True
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            if self._closing:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, LISTENER_BACKOFF_S[1])

    # --- ledger -------------------------------------------------------------------

    async def _lease_hashes(self) -> dict[str, list[Lease]]:
        """Every engine's leases, live or not, read atomically (empty list: an
        engine whose hash Redis expired)."""
        raw: list[Any] = await self._scripts["snapshot"](
            keys=[self._key("lease-engines")], args=[self._key("lease:")]
        )
        hashes: dict[str, list[Lease]] = {}
        for index in range(0, len(raw), 2):
            engine_id = raw[index].decode()
            flat = raw[index + 1]
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            hashes[engine_id] = _decode_hash(engine_id, fields)
        return hashes

    def _expire_lease_hash(
        self, pipe: Pipeline, engine_id: str, leases: Sequence[Lease], now: float
    ) -> None:
        expiry = _expiry_ms(max(lease.expires_at for lease in leases) - now + self._expiry_grace_s)
        if expiry is not None:
            pipe.pexpire(self._lease_key(engine_id), expiry)

    async def grant(
        self,
        engine_id: str,
        requests: Sequence[LeaseRequest],
        devices: Mapping[str, DeviceState],
        now: float,
        ttl_s: float,
    ) -> tuple[Lease, ...]:
        engines_key, version_key = self._key("lease-engines"), self._key("lease-version")
        lease_key = self._lease_key(engine_id)

        async def attempt(pipe: Pipeline) -> tuple[Lease, ...]:
            # Every ledger write bumps the version: watching it and reading after
            # the WATCH makes read-check-write one atomic step.
            await pipe.watch(version_key)
            hashes = await self._lease_hashes()
            everyone = tuple(lease for leases in hashes.values() for lease in leases)
            granted = grant_leases(engine_id, requests, devices, everyone, now, ttl_s)
            vanished = [e for e, leases in hashes.items() if not leases and e != engine_id]
            _begin(pipe)
            pipe.delete(lease_key)
            if granted:
                pipe.hset(
                    lease_key,
                    mapping={str(lease.rank): _encode_lease(lease) for lease in granted},
                )
                self._expire_lease_hash(pipe, engine_id, granted, now)
                pipe.sadd(engines_key, engine_id)
            else:
                vanished.append(engine_id)
            if vanished:
                pipe.srem(engines_key, *vanished)
            pipe.incr(version_key)
            await pipe.execute()
            return granted

        return await self._transact(attempt)

    async def renew(
        self, engine_id: str, allocations: Mapping[int, int], now: float, ttl_s: float
    ) -> tuple[Lease, ...]:
        lease_key = self._lease_key(engine_id)

        async def attempt(pipe: Pipeline) -> tuple[Lease, ...]:
            # Only this engine's hash is read; the version bump below still
            # makes a concurrent grant start over.
            await pipe.watch(lease_key)
            mine = _decode_hash(engine_id, await _read_hash(pipe, lease_key))
            renewed = renew_leases(engine_id, mine, allocations, now, ttl_s)
            _begin(pipe)
            pipe.hset(
                lease_key, mapping={str(lease.rank): _encode_lease(lease) for lease in renewed}
            )
            self._expire_lease_hash(pipe, engine_id, renewed, now)
            pipe.incr(self._key("lease-version"))
            await pipe.execute()
            return renewed

        return await self._transact(attempt)

    async def release(self, engine_id: str, rank: int | None, now: float) -> tuple[Lease, ...]:
        lease_key = self._lease_key(engine_id)

        async def attempt(pipe: Pipeline) -> tuple[Lease, ...]:
            await pipe.watch(lease_key)
            mine = _decode_hash(engine_id, await _read_hash(pipe, lease_key))
            released = [lease for lease in mine if rank is None or lease.rank == rank]
            if not released:
                return ()
            _begin(pipe)
            if len(released) == len(mine):
                pipe.delete(lease_key)
                pipe.srem(self._key("lease-engines"), engine_id)
            else:
                pipe.hdel(lease_key, *(str(lease.rank) for lease in released))
            pipe.incr(self._key("lease-version"))
            await pipe.execute()
            return tuple(lease for lease in released if lease.live(now))

        return await self._transact(attempt)

    async def leases(self, now: float) -> tuple[Lease, ...]:
        self._redis()
        hashes = await self._call(self._lease_hashes())
        return tuple(
            lease for engine_id in sorted(hashes) for lease in hashes[engine_id] if lease.live(now)
        )

    async def sweep_expired(self, now: float) -> tuple[Lease, ...]:
        engines_key, version_key = self._key("lease-engines"), self._key("lease-version")

        async def attempt(pipe: Pipeline) -> tuple[Lease, ...]:
            await pipe.watch(version_key)
            hashes = await self._lease_hashes()
            expired = {
                engine_id: [lease for lease in leases if not lease.live(now)]
                for engine_id, leases in hashes.items()
            }
            vanished = [engine_id for engine_id, leases in hashes.items() if not leases]
            if not vanished and not any(expired.values()):
                return ()
            _begin(pipe)
            for engine_id, dead in expired.items():
                if not dead:
                    continue
                if len(dead) == len(hashes[engine_id]):
                    pipe.delete(self._lease_key(engine_id))
                    vanished.append(engine_id)
                else:
                    pipe.hdel(self._lease_key(engine_id), *(str(lease.rank) for lease in dead))
            if vanished:
                pipe.srem(engines_key, *vanished)
            pipe.incr(version_key)
            await pipe.execute()
            return tuple(lease for engine_id in sorted(expired) for lease in expired[engine_id])

        return await self._transact(attempt)
