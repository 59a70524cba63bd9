"""The shared store: several server replicas behind one address use one Redis.

Every change is one MULTI/EXEC transaction guarded by WATCH (optimistic: a
concurrent change to a watched key makes EXEC fail and the method starts
over), or one Lua script, so a replica that dies or loses Redis mid-call
leaves nothing half-written. Decisions (the ledger's `grant_leases`, the
rendezvous rules) run here in Python, between the reads and the EXEC, with the
helpers the memory store uses: one formula, one set of messages. Two small
exceptions keep the ranks of many engines from conflicting with each other: a
join watches only its own engine's hashes, so rule 1 (forgetting old engines)
runs in the script that reads for it, and rule 4 (the pending limit) in the
script that opens a rendezvous, atomically with the count.

Key layout under `key_prefix` (default "kvplan:"):

    plans                 ZSET  plan_id -> insertion number (oldest dropped first)
    plans-seq             STRING counter behind those numbers
    plan:{plan_id}        HASH  engine_id, plan
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
from redis.exceptions import NoScriptError, RedisError, ResponseError, WatchError

from kvplan.core.ledger import DeviceState, Lease, LeaseRequest, grant_leases
from kvplan.server.store.base import (
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    Arrival,
    FinishedCallback,
    RendezvousResult,
    StoreUnavailable,
)
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
MAX_CONNECTIONS = 128  # per replica; more callers at once wait for one ...
CONNECTION_WAIT_S = 5.0  # ... this long, then UNAVAILABLE
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

# Lua: keep a plan, point its engine at it, drop the oldest beyond the bound.
# KEYS: plans (zset by seq), plans-seq, plans-bytes (sum of stored plan sizes).
# ARGV: plan_id, engine_id, plan, plan key prefix, engine-plan key prefix,
# max plans, max plan bytes. Oldest first; the newest plan always stays.
_PUT_PLAN = """
local plan_key = ARGV[4] .. ARGV[1]
local replaced = redis.call('HSTRLEN', plan_key, 'plan')
local seq = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], seq, ARGV[1])
redis.call('HSET', plan_key, 'engine_id', ARGV[2], 'plan', ARGV[3])
local size = redis.call('INCRBY', KEYS[3], string.len(ARGV[3]) - replaced)
if ARGV[2] ~= '' then
    redis.call('SET', ARGV[5] .. ARGV[2], ARGV[1])
end
local max_plans = tonumber(ARGV[6])
local max_bytes = tonumber(ARGV[7])
local count = redis.call('ZCARD', KEYS[1])
while count > 1 and (count > max_plans or size > max_bytes) do
    local evicted = redis.call('ZPOPMIN', KEYS[1])[1]
    local evicted_key = ARGV[4] .. evicted
    local engine = redis.call('HGET', evicted_key, 'engine_id')
    if engine and engine ~= '' and redis.call('GET', ARGV[5] .. engine) == evicted then
        redis.call('DEL', ARGV[5] .. engine)
    end
    size = redis.call('INCRBY', KEYS[3], -redis.call('HSTRLEN', evicted_key, 'plan'))
    redis.call('DEL', evicted_key)
    count = count - 1
end
return seq
"""

_PLAN_FOR_ENGINE = """
local plan_id = redis.call('GET', KEYS[1])
if not plan_id then
    return false
end
return redis.call('HGET', ARGV[1] .. plan_id, 'plan')
"""

# Lua: a rank's join, before its decision, in one round trip (the caller WATCHes
# the engine's two hashes, not the indexes, so that joins of other engines never
# conflict with it). First rule 1: open and finished engines older than the TTL
# are forgotten (the memory store's exact test, in the same double arithmetic).
# Then the reads: the finished hash's template_digest, plan, ok and rank field,
# the open hash's world_size, template, claimed_at and rank field, and how many
# ranks it holds; never the other ranks' specs (only the rank that completes
# an engine reads those).
# KEYS: rdv:open, rdv:done, rdv:open:{engine}, rdv:done:{engine}.
# ARGV: now, ttl_s, open hash prefix, finished hash prefix, the rank's field.
_JOIN = """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local function forget(index, prefix)
    local candidates = redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl + 1, 'WITHSCORES')
    for i = 1, #candidates, 2 do
        if now - tonumber(candidates[i + 1]) > ttl then
            redis.call('ZREM', index, candidates[i])
            redis.call('DEL', prefix .. candidates[i])
        end
    end
end
forget(KEYS[1], ARGV[3])
forget(KEYS[2], ARGV[4])
local open_ranks = 0
for _, field in ipairs(redis.call('HKEYS', KEYS[3])) do
    if string.sub(field, 1, 5) == 'rank:' then
        open_ranks = open_ranks + 1
    end
end
return {
    redis.call('HMGET', KEYS[4], 'template_digest', 'plan', 'ok', ARGV[5]),
    redis.call('HMGET', KEYS[3], 'world_size', 'template', 'claimed_at', ARGV[5]),
    open_ranks,
}
"""

# Lua, inside a join's MULTI: open a rendezvous unless `max_pending` are open
# (rule 4, atomic with the count: no join watches the index). Returns -1, or
# the number open when refused (nothing written).
# KEYS: rdv:open, rdv:open:{engine}.
# ARGV: engine_id, now, max_pending, expiry in ms ('' for none), then the
# hash's fields and values.
_OPEN_RENDEZVOUS = """
local pending = redis.call('ZCARD', KEYS[1])
if pending >= tonumber(ARGV[3]) then
    return pending
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], unpack(ARGV, 5))
if ARGV[4] ~= '' then
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return -1
"""

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

    async def _eval_watching(
        self, pipe: Pipeline, name: str, keys: Sequence[str], args: Sequence[str]
    ) -> Any:
        """A script run at once on a watching pipeline (AsyncScript would add a
        SCRIPT EXISTS round trip to the pipeline's EXEC)."""
        script = self._scripts[name]
        try:
            return await pipe.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:  # Redis restarted or flushed its scripts
            script.sha = await pipe.script_load(script.script)
            return await pipe.evalsha(script.sha, len(keys), *keys, *args)

    async def start(self) -> None:
        if self._client is not None:
            return
        # Few, short retries: a dead pooled connection after a Redis restart is
        # replaced transparently, an outage answers UNAVAILABLE quickly.
        # A blocking pool: callers beyond MAX_CONNECTIONS at once (a rendezvous of
        # thousands of ranks) queue for a connection instead of failing.
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            self._url,
            max_connections=MAX_CONNECTIONS,
            timeout=CONNECTION_WAIT_S,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
            socket_connect_timeout=2.0,
            socket_timeout=5.0,
            health_check_interval=10,
        )
        self._client = redis.asyncio.Redis.from_pool(pool)
        self._scripts = {
            "snapshot": self._client.register_script(_SNAPSHOT_LEASES),
            "put_plan": self._client.register_script(_PUT_PLAN),
            "plan_for_engine": self._client.register_script(_PLAN_FOR_ENGINE),
            "claim_engine": self._client.register_script(_CLAIM_ENGINE),
            "join": self._client.register_script(_JOIN),
            "open_rendezvous": self._client.register_script(_OPEN_RENDEZVOUS),
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

    async def put_plan(self, plan_id: str, engine_id: str, plan: bytes, now: float) -> None:
        self._redis()
        await self._call(
            self._scripts["put_plan"](
                keys=[self._key("plans"), self._key("plans-seq"), self._key("plans-bytes")],
                args=[
                    plan_id,
                    engine_id,
                    plan,
                    self._key("plan:"),
                    self._key("engine-plan:"),
                    self._max_plans,
                    self._max_plan_bytes,
                ],
            )
        )

    async def get_plan(self, plan_id: str) -> bytes | None:
        plan: bytes | None = await self._call(
            self._redis().hget(self._key("plan:" + plan_id), "plan")  # type: ignore[arg-type]
        )
        return plan

    async def plan_for_engine(self, engine_id: str) -> bytes | None:
        if not engine_id:
            return None
        self._redis()
        plan = await self._call(
            self._scripts["plan_for_engine"](
                keys=[self._key("engine-plan:" + engine_id)], args=[self._key("plan:")]
            )
        )
        return bytes(plan) if plan else None

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

        rank_field = f"rank:{rank}"

        async def attempt(pipe: Pipeline) -> Arrival:
            await pipe.watch(open_key, done_key)
            # Executed at once while watching: rule 1 and every read, one round trip.
            read = await self._eval_watching(
                pipe,
                "join",
                keys=[open_index, done_index, open_key, done_key],
                args=[repr(now), repr(ttl_s), self._open_key(""), self._done_key(""), rank_field],
            )
            done_digest, done_plan, done_ok, planned_worker = read[0]
            open_world_size, open_template, claimed, seen = read[1]
            open_ranks = int(read[2])

            # A finished hash written before the ok flag existed is a plan.
            drop_failed = done_digest is not None and done_ok == b"0"
            if drop_failed:
                if same_ranks(done_digest, planned_worker, template=template, worker=worker):
                    return Arrival("finished", result=RendezvousResult(False, done_plan))
            elif done_digest is not None:
                check_finished(
                    engine_id,
                    done_digest,
                    planned_worker,
                    template=template,
                    rank=rank,
                    worker=worker,
                )
                return Arrival("finished", result=RendezvousResult(True, done_plan))

            created = open_world_size is None
            if created:
                open_world_size, open_template, claimed_at = world_size, template, None
            else:
                open_world_size = int(open_world_size)
                claimed_at = float(claimed) if claimed is not None else None
            check_compatible(
                engine_id,
                open_world_size,
                open_template,
                seen,
                world_size=world_size,
                template=template,
                rank=rank,
                worker=worker,
            )
            fields: dict[str, bytes | str] = {rank_field: worker}
            incomplete = open_ranks + (seen is None) < open_world_size
            claim_alive = claimed_at is not None and now - claimed_at <= claim_timeout_s
            if incomplete or claim_alive:
                arrival = Arrival("waiting")
            else:
                # This rank completes the engine: only now are the others' specs read.
                workers = {} if created else _rank_fields(await _read_hash(pipe, open_key))
                workers[rank] = worker
                fields["claimed_at"] = repr(now)
                arrival = Arrival("plan", workers=tuple(workers[r] for r in sorted(workers)))

            _begin(pipe)
            if drop_failed:  # a changed rank forgets the failure, refused or not
                pipe.delete(done_key)
                pipe.zrem(done_index, engine_id)
            if created:
                fields.update(
                    world_size=str(world_size),
                    template=template,
                    created=repr(now),
                    ttl_s=repr(ttl_s),
                )
                expiry = _expiry_ms(ttl_s + self._expiry_grace_s)
                await self._scripts["open_rendezvous"](
                    keys=[open_index, open_key],
                    args=[
                        engine_id,
                        repr(now),
                        max_pending,
                        "" if expiry is None else expiry,
                        *(item for pair in fields.items() for item in pair),
                    ],
                    client=pipe,
                )
            else:
                pipe.hset(open_key, mapping=fields)  # type: ignore[arg-type]
            done = await pipe.execute()
            if created and (pending := int(done[-1])) >= 0:
                raise too_many_pending(pending, max_pending)
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
