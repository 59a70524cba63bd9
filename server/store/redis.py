"""The shared store: several server replicas behind one address use one Redis.

Every change is one MULTI/EXEC transaction guarded by WATCH (optimistic: a
concurrent change to a watched key makes EXEC fail and the method starts
over), or one Lua script, so a replica that dies or loses Redis mid-call
leaves nothing half-written. Decisions (the ledger's `grant_leases`, the lease
quota, the rendezvous rules) run here in Python, between the reads and the EXEC
(or the script that writes only if `lease-version` is unchanged), with the
helpers the memory store uses: one formula, one set of messages. Two small
exceptions keep the ranks of many engines from conflicting with each other: a
join watches only its own engine's hashes, so rule 1 (forgetting old engines)
runs in the script that reads for it, and rule 4 (the pending limit) in the
script that opens a rendezvous, atomically with the count.

Key layout under `key_prefix` (default "kvplan:"):

    plans                 ZSET  plan_id -> insertion number (oldest dropped first)
    plans-seq             STRING counter behind those numbers
    plans-bytes           STRING bytes held by plans: heads and distinct bodies
    plan:{plan_id}        HASH  engine_id, head, body (the body's digest); a plan
                                written before bodies were shared: engine_id, plan
    plan-body:{digest}    HASH  body, holders (plans holding it; see store/bodies.py)
    engine-plan:{engine}  STRING plan_id of the engine's newest plan
    rdv:open              ZSET  engine_id -> created (rule 1 forgets by it)
    rdv:open-of:{identity} ZSET engine_id -> created: the identity's open ones
                                (its share; entries older than the TTL are dropped
                                when it opens another)
    rdv:open:{engine}     HASH  world_size, template, created, ttl_s, identity,
                                claimed_at (absent: unclaimed), rank:{r} -> WorkerSpec
    rdv:done              ZSET  engine_id -> finished
    rdv:done:{engine}     HASH  template_digest, plan, finished, rank:{r} -> worker digest
    rdv:done-size         HASH  engine_id -> its kept_result_bytes  } finished results
    rdv:done-bytes        STRING their sum                          } bounded by bytes
    lease:{engine}        HASH  rank -> the lease's record: JSON [engine_id, rank,
                                device_uuid, bytes, allocated_bytes, granted_at,
                                expires_at, identity, outstanding_bytes]
    lease-expiry          ZSET  every lease's record -> expires_at
    lease-device:{uuid}   ZSET  the records of the device's leases -> expires_at
                                (a refusal names the holders from it alone; a
                                lease an earlier release granted joins it when
                                renewed, within a third of its TTL)
    ledger:committed      HASH  device_uuid -> committed bytes      } the totals of the
    ledger:outstanding    HASH  device_uuid -> outstanding bytes    } counted leases
    ledger:live           HASH  device_uuid -> live leases          } (kvplan.core.ledger)
    ledger:identity       HASH  identity -> live leases             }
    ledger:expired-through STRING the latest `now` due leases were expired at
    lease-version         STRING bumped by every lease write: a grant commits only
                                if it is unchanged since the grant read the ledger
    epoch                 STRING a random token written at first use; its loss (an
                                empty or replaced Redis) pauses grants (below)
    epoch:{token}         STRING "1": the token again, for the ledger scripts' guard
    grants-paused         STRING when grants resume (PX: one lease TTL), written when
                                a replica finds the epoch gone
    owner:{engine}        STRING the engine's owning identity (PX: --ownership-ttl-s)
    owned:{identity}      ZSET  engine_id -> when its ownership expires (Redis ms):
                                the identity's live engines, counted per claim
    owners-indexed        STRING set once the owner keys of before the owned
                                indexes were indexed (at start)
    rendezvous-finished   pub/sub channel of finished rendezvous

The ledger's writes are Lua scripts (atomic): a lease counts in the totals while
its record is in lease-expiry with a score above expired-through, so every
script changes the totals exactly when it moves a record across that line. The
contributions come from the record, which the core computed (Totals.of).

Liveness is `expires_at` against the caller's `now` (the contract); Redis
expiry is only the janitor: a lease hash lives `expiry_grace_s` past its
engine's latest expiry (rendezvous hashes past their TTL), the ledger's index
and totals past the latest expiry of all, measured from the write, so an engine
or a whole deployment that vanished leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import redis.asyncio
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError, WatchError

from kvplan.core.ledger import (
    DeviceState,
    GrantRefused,
    Lease,
    LeaseRequest,
    Totals,
    excluding,
    grant_leases,
    tally,
)
from kvplan.server.store.base import (
    DEFAULT_MAX_ENGINES_PER_CONFIG,
    DEFAULT_MAX_MEASURED_CONFIGS,
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    DEFAULT_MAX_RESULT_BYTES,
    Arrival,
    FinishedCallback,
    LedgerView,
    RendezvousResult,
    StoreLostState,
    StoreNotPersistent,
    StoreUnavailable,
    TooManyEngines,
    check_lease_quota,
    kept_result_bytes,
)
from kvplan.server.store.bodies import PlanParts, plan_parts
from kvplan.server.store.rules import (
    check_compatible,
    check_finished,
    digest,
    last_per_rank,
    naming_holders,
    renew_leases,
    same_ranks,
    too_many_pending,
    too_many_pending_of,
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

# Lua, the ledger's scripts. KEYS[1..6] are the ledger's keys (lease-expiry, the
# four totals hashes, expired-through), KEYS[7] lease-version, KEYS[8] the engine's
# lease hash, KEYS[9] the prefix of the per-device indexes. Scores and times travel
# as Python's exact text of a float.
_LEDGER = """
local expiry, committed, outstanding, live, identities, through_key =
    KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local touched_devices = {}

-- A record's entry in its device's index (lease: the record decoded; sign 1 add,
-- -1 remove).
local function index_device(record, lease, sign, expires_text)
    local key = KEYS[9] .. lease[3]
    if sign > 0 then
        redis.call('ZADD', key, expires_text, record)
    else
        redis.call('ZREM', key, record)
    end
    touched_devices[key] = true
end

local function through_text()
    return redis.call('GET', through_key) or '-inf'
end

local function through()
    local text = redis.call('GET', through_key)
    if text then return tonumber(text) end
    return -math.huge
end

-- Add (sign 1) or take out (sign -1) one lease's share of the totals (lease: its
-- record decoded).
local function count(lease, sign)
    local device, identity = lease[3], lease[8]
    redis.call('HINCRBY', committed, device, string.format('%d', sign * lease[4]))
    redis.call('HINCRBY', outstanding, device, string.format('%d', sign * lease[9]))
    if redis.call('HINCRBY', live, device, sign) == 0 then
        redis.call('HDEL', committed, device)
        redis.call('HDEL', outstanding, device)
        redis.call('HDEL', live, device)
    end
    if redis.call('HINCRBY', identities, identity, sign) == 0 then
        redis.call('HDEL', identities, identity)
    end
end

-- Take the leases due at `now` out of the totals (an index range); they stay in
-- the index until the sweep deletes them. The mark moves only past due leases
-- (it keeps the index's janitor expiry).
local function expire_due(now_text)
    local now = tonumber(now_text)
    local t = through()
    if now <= t then return end
    local low = '-inf'
    if t ~= -math.huge then low = '(' .. through_text() end
    local due = redis.call('ZRANGEBYSCORE', expiry, low, now_text)
    if #due == 0 then return end
    for _, record in ipairs(due) do
        count(cjson.decode(record), -1)
    end
    redis.call('SET', through_key, now_text)
    local ttl = redis.call('PTTL', expiry)
    if ttl > 0 then redis.call('PEXPIRE', through_key, ttl) end
end

local function remove(record)
    local score = redis.call('ZSCORE', expiry, record)
    if score then
        local lease = cjson.decode(record)
        redis.call('ZREM', expiry, record)
        index_device(record, lease, -1)
        if tonumber(score) > through() then count(lease, -1) end
    end
end

local function add(record, expires_text)
    local lease = cjson.decode(record)
    redis.call('ZADD', expiry, expires_text, record)
    index_device(record, lease, 1, expires_text)
    if tonumber(expires_text) > through() then count(lease, 1) end
end

-- The janitor: the index and totals live grace_ms past the latest expiry.
-- The janitor: the index and totals live grace_ms past the latest expiry, each
-- device's index written here past its own latest.
local function janitor_ms(key, now_text, grace_ms)
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if not last[2] then return nil end
    local ms = math.ceil((tonumber(last[2]) - tonumber(now_text)) * 1000 + tonumber(grace_ms))
    if ms ~= ms or ms == math.huge then return nil end
    if ms < 1 then ms = 1 end
    return ms
end

local function touch(now_text, grace_ms)
    if tonumber(grace_ms) < 0 then return end
    for key in pairs(touched_devices) do
        local ms = janitor_ms(key, now_text, grace_ms)
        if ms then redis.call('PEXPIRE', key, ms) end
    end
    local ms = janitor_ms(expiry, now_text, grace_ms)
    if not ms then return end
    for i = 1, 6 do
        if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('PEXPIRE', KEYS[i], ms) end
    end
end
"""

# Read for a grant or a view: expire what is due, then {version, live leases, the
# identity's, per device {committed, outstanding, live}, the engine's counted
# records, expired-through}. ARGV: now, identity, device uuids...
_LEDGER_READ = (
    _LEDGER
    + """
expire_due(ARGV[1])
local t = through()
local low = '-inf'
if t ~= -math.huge then low = '(' .. through_text() end
local devices = {}
for i = 3, #ARGV do
    devices[#devices + 1] = {
        redis.call('HGET', committed, ARGV[i]) or '0',
        redis.call('HGET', outstanding, ARGV[i]) or '0',
        redis.call('HGET', live, ARGV[i]) or '0',
    }
end
local own = {}
for _, record in ipairs(redis.call('HVALS', KEYS[8])) do
    local score = redis.call('ZSCORE', expiry, record)
    if score and tonumber(score) > t then own[#own + 1] = record end
end
return {
    redis.call('GET', KEYS[7]) or '0',
    redis.call('ZCOUNT', expiry, low, '+inf'),
    redis.call('HGET', identities, ARGV[2]) or '0',
    devices,
    own,
    through_text(),
}
"""
)

# The ledger's writes run only on the Redis this replica knows: KEYS[10] is
# epoch:{token} (gone when Redis lost its data), KEYS[11] grants-paused. A grant
# is refused while grants are paused; a renewal only when the epoch is gone.
_LOST_GUARD = """
if redis.call('EXISTS', KEYS[10]) == 0 then return redis.error_reply('KVPLAN_LOST_STATE') end
"""
_PAUSE_GUARD = """
if redis.call('EXISTS', KEYS[11]) == 1 then return redis.error_reply('KVPLAN_PAUSED') end
"""

# Lua: the store's epoch. KEYS[1] epoch, KEYS[2] grants-paused, KEYS[3]
# lease-version; ARGV the epoch this replica knows ("" at start), a new token, the
# epoch:{token} prefix, the pause in ms, when grants resume (text), the highest
# lease-version this replica saw under that epoch. A missing epoch at start is
# first use. Later, a missing epoch (Redis restarted empty) or a lease-version
# below one already seen under the same epoch (an older snapshot or a lost AOF
# tail: every lease write bumps it, and only a loss takes it back) is a loss:
# a new epoch (the old one's guard key deleted, so every replica's next write
# sees it), and grants paused. Returns {epoch, when grants resume ("": not
# paused), 1 if this call found the loss, lease-version}.
_CHECK_EPOCH = """
local current = redis.call('GET', KEYS[1])
local version = tonumber(redis.call('GET', KEYS[3]) or '0')
local lost = 0
if ARGV[1] ~= '' and (not current or (current == ARGV[1] and version < tonumber(ARGV[6]))) then
    if current then redis.call('DEL', ARGV[3] .. current) end
    current = ARGV[2]
    redis.call('SET', KEYS[1], current)
    redis.call('SET', ARGV[3] .. current, '1')
    redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[4])
    lost = 1
elseif not current then
    current = ARGV[2]
    redis.call('SET', KEYS[1], current)
    redis.call('SET', ARGV[3] .. current, '1')
end
return {current, redis.call('GET', KEYS[2]) or '', lost, tostring(version)}
"""

# A grant's write, if no lease changed since its read and the mark has not passed
# a new lease's expiry since (it would never be counted): the engine's records
# replaced. ARGV: version read, now, grace ms, engine hash ms (-1: none),
# then rank, record, expires_at per new lease. Returns 0 on a conflict.
_LEDGER_GRANT = (
    _LOST_GUARD
    + _PAUSE_GUARD
    + _LEDGER
    + """
if (redis.call('GET', KEYS[7]) or '0') ~= ARGV[1] then return 0 end
for i = 7, #ARGV, 3 do
    if tonumber(ARGV[i]) <= through() then return 0 end
end
for _, record in ipairs(redis.call('HVALS', KEYS[8])) do remove(record) end
redis.call('DEL', KEYS[8])
local expires = {}
for i = 5, #ARGV, 3 do
    redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1])
    expires[ARGV[i + 1]] = ARGV[i + 2]
end
for _, record in ipairs(redis.call('HVALS', KEYS[8])) do add(record, expires[record]) end
if tonumber(ARGV[4]) >= 0 and redis.call('EXISTS', KEYS[8]) == 1 then
    redis.call('PEXPIRE', KEYS[8], ARGV[4])
end
redis.call('INCR', KEYS[7])
touch(ARGV[2], ARGV[3])
return 1
"""
)

# A renewal's write, if the engine's renewed records are unchanged since its read.
# ARGV: now, grace ms, engine hash ms, then rank, old record, new record, expires_at.
_LEDGER_RENEW = (
    _LOST_GUARD
    + _LEDGER
    + """
for i = 4, #ARGV, 4 do
    if redis.call('HGET', KEYS[8], ARGV[i]) ~= ARGV[i + 1] then return 0 end
end
-- A record the ledger already expired stays expired (its memory may be granted),
-- and a renewal stamped at or below the mark would never be counted: both are
-- decided again with the mark.
for i = 4, #ARGV, 4 do
    local score = redis.call('ZSCORE', expiry, ARGV[i + 1])
    if not score or tonumber(score) <= through() then return {through_text()} end
    if tonumber(ARGV[i + 3]) <= through() then return {through_text()} end
end
for i = 4, #ARGV, 4 do
    remove(ARGV[i + 1])
    redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 2])
    add(ARGV[i + 2], ARGV[i + 3])
end
if tonumber(ARGV[3]) >= 0 then redis.call('PEXPIRE', KEYS[8], ARGV[3]) end
redis.call('INCR', KEYS[7])
touch(ARGV[1], ARGV[2])
return 1
"""
)

# Release: the engine's records (ARGV[3]: one rank, or '' for all) deleted; returns them.
_LEDGER_RELEASE = (
    _LEDGER
    + """
local ranks = {ARGV[3]}
if ARGV[3] == '' then ranks = redis.call('HKEYS', KEYS[8]) end
local out = {}
for _, rank in ipairs(ranks) do
    local record = redis.call('HGET', KEYS[8], rank)
    if record then
        remove(record)
        redis.call('HDEL', KEYS[8], rank)
        out[#out + 1] = record
    end
end
if #out > 0 then
    redis.call('INCR', KEYS[7])
    touch(ARGV[1], ARGV[2])
end
return out
"""
)

# Sweep: expire what is due, then delete the records whose expiry passed; returns
# those still in their engine's hash. ARGV: now, grace ms, lease hash prefix.
_LEDGER_SWEEP = (
    _LEDGER
    + """
expire_due(ARGV[1])
local out = {}
for _, record in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', ARGV[1])) do
    redis.call('ZREM', expiry, record)
    local lease = cjson.decode(record)
    index_device(record, lease, -1)
    local key = ARGV[3] .. lease[1]
    local rank = tostring(lease[2])
    if redis.call('HGET', key, rank) == record then
        redis.call('HDEL', key, rank)
        out[#out + 1] = record
    end
end
touch(ARGV[1], ARGV[2])
return out
"""
)

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

# Fleet measurements: KEYS = the configuration's records (hash engine -> record),
# its order (zset engine -> seq), the configurations (zset key -> seq), the seq
# counter; ARGV = engine, record, max engines, max configurations, the records'
# and orders' key prefixes, the configuration's key. Returns the engines kept.
_PUT_MEASUREMENT = """
local seq = redis.call('INCR', KEYS[4])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], seq, ARGV[1])
redis.call('ZADD', KEYS[3], seq, ARGV[7])
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if extra > 0 then
    for _, engine in ipairs(redis.call('ZRANGE', KEYS[2], 0, extra - 1)) do
        redis.call('HDEL', KEYS[1], engine)
    end
    redis.call('ZREMRANGEBYRANK', KEYS[2], 0, extra - 1)
end
local configs = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[4])
if configs > 0 then
    for _, key in ipairs(redis.call('ZRANGE', KEYS[3], 0, configs - 1)) do
        redis.call('DEL', ARGV[5] .. key, ARGV[6] .. key)
    end
    redis.call('ZREMRANGEBYRANK', KEYS[3], 0, configs - 1)
end
return redis.call('HLEN', KEYS[1])
"""

# Lua, shared by the rendezvous scripts: forget one finished engine's result and
# take its size out of the sum (a result kept before sizes were has none).
_RESULTS = """
local function drop_result(index, sizes, total, prefix, engine)
    local size = redis.call('HGET', sizes, engine)
    if size then
        redis.call('HDEL', sizes, engine)
        redis.call('DECRBY', total, size)
    end
    redis.call('ZREM', index, engine)
    redis.call('DEL', prefix .. engine)
end

-- The sum recounted from the sizes of the results still kept, the others' sizes
-- dropped: a replica of an earlier release forgets results without their sizes.
local function recount_results(index, sizes, total)
    local kept = 0
    local entries = redis.call('HGETALL', sizes)
    for i = 1, #entries, 2 do
        if redis.call('ZSCORE', index, entries[i]) then
            kept = kept + tonumber(entries[i + 1])
        else
            redis.call('HDEL', sizes, entries[i])
        end
    end
    redis.call('SET', total, kept)
    return kept
end
"""

# Lua: a rank's join, before its decision, in one round trip (the caller WATCHes
# the engine's two hashes, not the indexes, so that joins of other engines never
# conflict with it). First rule 1: open and finished engines older than the TTL
# are forgotten (the memory store's exact test, in the same double arithmetic).
# Then the reads: the finished hash's template_digest, plan, ok and rank field,
# the open hash's world_size, template, claimed_at and rank field, and how many
# ranks it holds; never the other ranks' specs (only the rank that completes
# an engine reads those).
# KEYS: rdv:open, rdv:done, rdv:open:{engine}, rdv:done:{engine}, rdv:done-size,
# rdv:done-bytes.
# ARGV: now, ttl_s, open hash prefix, finished hash prefix, the rank's field.
_JOIN = (
    _RESULTS
    + """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local function forget(index, forget_one)
    local candidates = redis.call('ZRANGEBYSCORE', index, '-inf', now - ttl + 1, 'WITHSCORES')
    for i = 1, #candidates, 2 do
        if now - tonumber(candidates[i + 1]) > ttl then forget_one(candidates[i]) end
    end
end
forget(KEYS[1], function(engine)
    redis.call('ZREM', KEYS[1], engine)
    redis.call('DEL', ARGV[3] .. engine)
end)
forget(KEYS[2], function(engine)
    drop_result(KEYS[2], KEYS[5], KEYS[6], ARGV[4], engine)
end)
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
)

# Lua, inside a join's MULTI: forget a failed engine's result (a changed rank).
# KEYS: rdv:done, rdv:done-size, rdv:done-bytes. ARGV: finished hash prefix, engine_id.
_DROP_RESULT = (
    _RESULTS
    + """
drop_result(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
"""
)

# Lua, inside a finish's MULTI: keep an engine's result in place of any earlier
# one (unless it alone is over the bound), then forget the oldest results until
# they hold at most the bound.
# KEYS: rdv:done, rdv:done-size, rdv:done-bytes, rdv:done:{engine}.
# ARGV: engine_id, finished, size, max bytes, expiry in ms ('' for none),
# finished hash prefix, then the hash's fields and values.
_KEEP_RESULT = (
    _RESULTS
    + """
drop_result(KEYS[1], KEYS[2], KEYS[3], ARGV[6], ARGV[1])
local limit = tonumber(ARGV[4])
if tonumber(ARGV[3]) > limit then return end
-- Field-value pairs in slices: unpack() takes a few thousand values at most.
for i = 7, #ARGV, 1000 do
    redis.call('HSET', KEYS[4], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
if ARGV[5] ~= '' then redis.call('PEXPIRE', KEYS[4], ARGV[5]) end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local kept = redis.call('INCRBY', KEYS[3], ARGV[3])
if kept > limit and redis.call('HLEN', KEYS[2]) > redis.call('ZCARD', KEYS[1]) then
    kept = recount_results(KEYS[1], KEYS[2], KEYS[3])
end
-- The oldest go first, never the result just kept (its time may be the lowest
-- when this replica's clock is behind).
while kept > limit do
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 1)
    local engine = oldest[1]
    if engine == ARGV[1] then engine = oldest[2] end
    if not engine then break end
    drop_result(KEYS[1], KEYS[2], KEYS[3], ARGV[6], engine)
    kept = tonumber(redis.call('GET', KEYS[3]))
end
"""
)

# Lua, inside a join's MULTI: open a rendezvous unless `max_pending` are open,
# or `max_pending_per_identity` of the identity's (rule 4, atomic with the
# counts: no join watches the indexes). Returns -1, or when refused (nothing
# written) {0, the number open} or {1, the identity's number open}.
# KEYS: rdv:open, rdv:open:{engine}, rdv:open-of:{identity}.
# ARGV: engine_id, now, max_pending, expiry in ms ('' for none), the share (''
# for none), created before this is forgotten (now - ttl_s), then the hash's
# fields and values.
_OPEN_RENDEZVOUS = """
local pending = redis.call('ZCARD', KEYS[1])
if pending >= tonumber(ARGV[3]) then
    return {0, pending}
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[6])
if ARGV[5] ~= '' then
    local held = redis.call('ZCARD', KEYS[3])
    if held >= tonumber(ARGV[5]) then return {1, held} end
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], unpack(ARGV, 7))
if ARGV[4] ~= '' then
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
    redis.call('PEXPIRE', KEYS[3], ARGV[4])
end
return -1
"""

# Lua: the engine's owner; set (or its expiry pushed) when free or already the
# caller's, unless the engine is new to the caller and the caller already owns
# ARGV[3] live engines: then the count (a number, never an identity's name).
# KEYS[1] owner:{engine}, KEYS[2] owned:{identity}; ARGV identity, TTL ms, the
# limit, engine_id. Both expire on Redis's clock (the owner key by PX, the
# index by score), so a record stops counting when its key goes.
_CLAIM_ENGINE = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then
    return owner
end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
if not owner then
    redis.call('ZREM', KEYS[2], ARGV[4])
    local held = redis.call('ZCARD', KEYS[2])
    if held >= tonumber(ARGV[3]) then
        return held
    end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[2]), ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return ARGV[1]
"""


# Lua: an owner key written before the per-identity indexes, put in its owner's
# index with the key's own expiry (once: a claim may have indexed it already).
# KEYS[1] owner:{engine}; ARGV key prefix, engine_id.
_INDEX_OWNER = """
local owner = redis.call('GET', KEYS[1])
local left_ms = redis.call('PTTL', KEYS[1])
if not owner or left_ms < 0 then
    return 0
end
local owned = ARGV[1] .. 'owned:' .. owner
if redis.call('ZSCORE', owned, ARGV[2]) then
    return 0
end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZADD', owned, now_ms + left_ms, ARGV[2])
if redis.call('PTTL', owned) < left_ms then
    redis.call('PEXPIRE', owned, left_ms)
end
return 1
"""


def _expiry_ms(seconds: float) -> int | None:
    """A Redis relative expiry for `seconds` from now; None: keep forever."""
    if not math.isfinite(seconds):
        return None
    return max(1, math.ceil(seconds * 1000))


def _record(lease: Lease) -> str:
    """A lease as the ledger's scripts store it (its share of the totals last)."""
    fields = [
        lease.engine_id,
        lease.rank,
        lease.device_uuid,
        lease.bytes,
        lease.allocated_bytes,
        lease.granted_at,
        lease.expires_at,
        lease.identity,
        lease.outstanding_bytes,
    ]
    return json.dumps(fields, separators=(",", ":"))


def _lease(record: bytes | str) -> Lease:
    engine_id, rank, device_uuid, size, allocated, granted_at, expires_at, identity, _ = json.loads(
        record
    )
    return Lease(
        engine_id=engine_id,
        rank=int(rank),
        device_uuid=device_uuid,
        bytes=size,
        allocated_bytes=allocated,
        granted_at=float(granted_at),
        expires_at=float(expires_at),
        identity=identity,
    )


def _by_rank(records: Iterable[bytes | str]) -> list[Lease]:
    return sorted(map(_lease, records), key=lambda lease: lease.rank)


def _by_engine(leases: Sequence[Lease]) -> tuple[Lease, ...]:
    return tuple(sorted(leases, key=lambda lease: (lease.engine_id, lease.rank)))


def _identity_of(raw: Mapping[bytes, bytes]) -> str:
    """The owner of an open rendezvous (a hash written before shares had none: "")."""
    return raw.get(b"identity", b"").decode()


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
        self._persistence_refusal: str | None = None  # set by `check` (health ticks)
        self._epoch = ""  # the store's epoch as this replica first saw it
        self._version_seen = 0  # the highest lease-version seen under that epoch
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

    def _open_of_key(self, identity: str) -> str:
        return self._prefix + "rdv:open-of:" + identity

    def _result_keys(self) -> list[str]:
        """The finished results' sizes and their sum."""
        return [self._key("rdv:done-size"), self._key("rdv:done-bytes")]

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
            "ledger_read": self._client.register_script(_LEDGER_READ),
            "ledger_grant": self._client.register_script(_LEDGER_GRANT),
            "ledger_renew": self._client.register_script(_LEDGER_RENEW),
            "ledger_release": self._client.register_script(_LEDGER_RELEASE),
            "ledger_sweep": self._client.register_script(_LEDGER_SWEEP),
            "put_plan": self._client.register_script(_PUT_PLAN),
            "put_measurement": self._client.register_script(_PUT_MEASUREMENT),
            "get_plan": self._client.register_script(_GET_PLAN),
            "claim_engine": self._client.register_script(_CLAIM_ENGINE),
            "check_epoch": self._client.register_script(_CHECK_EPOCH),
            "index_owner": self._client.register_script(_INDEX_OWNER),
            "join": self._client.register_script(_JOIN),
            "open_rendezvous": self._client.register_script(_OPEN_RENDEZVOUS),
            "drop_result": self._client.register_script(_DROP_RESULT),
            "keep_result": self._client.register_script(_KEEP_RESULT),
        }
        try:
            await self.ping()
            if self._require_persistence:
                problem = await self._persistence_problem()
                if problem is not None:
                    raise ValueError(problem)
            with contextlib.suppress(StoreLostState):  # health and grants say it
                await self._check_epoch(time.time(), 0.0)
            await self._convert_old_ledger()
            await self._index_old_owners()
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

    async def _index_old_owners(self) -> None:
        """Owner keys a server before --max-engines-per-identity wrote are in no
        owned:{identity} index: each is indexed once (the marker says it was done),
        so it counts against its owner's bound until it expires."""
        marker = self._key("owners-indexed")
        client = self._redis()
        if await self._call(client.exists(marker)):
            return
        owner_prefix = self._key("owner:")
        try:
            async for key in client.scan_iter(match=owner_prefix + "*", count=1000):
                name = key.decode() if isinstance(key, bytes) else str(key)
                await self._scripts["index_owner"](
                    keys=[name], args=[self._prefix, name.removeprefix(owner_prefix)]
                )
        except (RedisError, OSError) as error:
            raise self._unavailable(error) from error
        await self._call(client.set(marker, "1"))

    async def _convert_old_ledger(self) -> None:
        """Leases a server before the ledger's totals wrote (the `lease-engines` set,
        records [device_uuid, bytes, allocated_bytes, granted_at, expires_at]) are
        converted once, in one transaction, and counted; each is held by its
        engine's owner. Stop the replicas of the old version before starting these."""
        engines_key, version_key = self._key("lease-engines"), self._key("lease-version")
        keys = self._ledger_keys("")

        async def attempt(pipe: Pipeline) -> None:
            await pipe.watch(engines_key, version_key)
            engines = cast(set[bytes], await pipe.smembers(engines_key))
            if not engines:
                return
            leases: list[Lease] = []
            for engine in sorted(engines):
                engine_id = engine.decode()
                owner = await pipe.get(self._key("owner:" + engine_id))
                identity = owner.decode() if isinstance(owner, bytes) else ""
                for rank, value in (await _read_hash(pipe, self._lease_key(engine_id))).items():
                    device_uuid, size, allocated, granted_at, expires_at = json.loads(value)
                    leases.append(
                        Lease(
                            engine_id,
                            int(rank),
                            device_uuid,
                            size,
                            allocated,
                            float(granted_at),
                            float(expires_at),
                            identity,
                        )
                    )
            _begin(pipe)
            # Every record is counted (nothing is expired through yet): the next
            # ledger call expires the ones that are due.
            for lease in leases:
                pipe.hset(self._lease_key(lease.engine_id), str(lease.rank), _record(lease))
                pipe.zadd(keys[0], {_record(lease): lease.expires_at})
                pipe.zadd(keys[8] + lease.device_uuid, {_record(lease): lease.expires_at})
            for uuid_, totals in tally(leases).items():
                pipe.hincrby(keys[1], uuid_, totals.committed_bytes)
                pipe.hincrby(keys[2], uuid_, totals.outstanding_bytes)
                pipe.hincrby(keys[3], uuid_, totals.live_leases)
            for lease in leases:
                pipe.hincrby(keys[4], lease.identity, 1)
            pipe.delete(engines_key)
            pipe.incr(version_key)
            await pipe.execute()
            log.info(
                "Redis store %s: %d leases converted to the ledger's totals", self._url, len(leases)
            )

        await self._transact(attempt)

    async def _persistence_problem(self) -> str | None:
        """Why this Redis would lose leases on a restart, or None. Only AOF keeps
        every acknowledged write: RDB snapshots lose what was written since the
        last one (a kill -9 before the first loses everything), and the ledger
        would then grant the same device memory twice."""
        client = self._redis()
        info = await self._call(client.info("persistence"))
        if int(info.get("aof_enabled", 0)) == 1:
            return None
        try:
            save = (await client.config_get("save")).get("save", "")
        except ResponseError:  # CONFIG disabled (managed Redis): cannot tell
            save = ""
        except (RedisError, OSError) as error:
            raise self._unavailable(error) from error
        kept = (
            f"only RDB snapshots (save {str(save).strip()!r}): a restart loses every lease "
            "written since the last snapshot"
            if str(save).strip()
            else "no data across a restart (appendonly no, no save points): a restart "
            "loses every lease"
        )
        return (
            f"Redis store {self._url} keeps {kept}, and the ledger would then grant the "
            "same memory twice. Enable AOF (appendonly yes; docs/deployment.md gives each "
            "appendfsync policy's loss window), or start with --redis-allow-no-persistence"
        )

    async def _check_epoch(self, now: float, ttl_s: float) -> None:
        """Raise StoreLostState when this Redis lost its data since this replica
        first saw it (its epoch key gone or replaced), or while grants stay paused
        after such a loss; the first replica to find the loss writes a new epoch
        and pauses grants for `ttl_s` (one lease TTL: by then every lease the lost
        ledger held has expired, or its holder gave its memory up)."""
        result = await self._call(
            self._scripts["check_epoch"](
                keys=[self._key("epoch"), self._key("grants-paused"), self._key("lease-version")],
                args=[
                    self._epoch,
                    uuid.uuid4().hex,
                    self._key("epoch:"),
                    max(math.ceil(ttl_s * 1000), 1),
                    repr(now + ttl_s),
                    self._version_seen,
                ],
            )
        )
        epoch, resume, _, version = (
            item.decode() if isinstance(item, bytes) else str(item) for item in result
        )
        if self._epoch and epoch != self._epoch:
            log.error(
                "Redis store lost its data: grants paused",
                extra={"store": self._url, "resume_at": resume},
            )
            self._version_seen = int(version)  # counted again from the new epoch
        self._epoch = epoch
        self._version_seen = max(self._version_seen, int(version))
        if resume:
            raise StoreLostState(self._url, float(resume))

    async def check(self, now: float, ttl_s: float) -> None:
        if self._require_persistence:
            problem = await self._persistence_problem()
            if problem is not None:
                self._persistence_refusal = problem
                raise StoreNotPersistent(problem)
        self._persistence_refusal = None
        await self._check_epoch(now, ttl_s)

    def _guard_keys(self) -> list[str]:
        return [self._key("epoch:" + self._epoch), self._key("grants-paused")]

    async def _ledger_write(
        self, name: str, engine_id: str, args: Sequence[str | int | bytes], now: float, ttl_s: float
    ) -> Any:
        """A guarded ledger script (grant, renew): on a Redis that lost its data
        or while grants are paused, StoreLostState instead of a promise."""
        try:
            return await self._scripts[name](
                keys=self._ledger_keys(engine_id) + self._guard_keys(), args=args
            )
        except ResponseError as error:
            if "KVPLAN_" not in str(error):
                raise self._unavailable(error) from error
        except (RedisError, OSError) as error:
            raise self._unavailable(error) from error
        await self._check_epoch(now, ttl_s)  # raises: the loss or the pause
        return None  # another replica wrote the new epoch and its pause is over: again

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

    async def put_measurement(
        self,
        config_key: str,
        engine_id: str,
        record: bytes,
        now: float,
        *,
        max_configs: int = DEFAULT_MAX_MEASURED_CONFIGS,
        max_engines: int = DEFAULT_MAX_ENGINES_PER_CONFIG,
    ) -> int:
        self._redis()
        records, order = self._key("fleet:rec:"), self._key("fleet:ord:")
        kept = await self._call(
            self._scripts["put_measurement"](
                keys=[
                    records + config_key,
                    order + config_key,
                    self._key("fleet:configs"),
                    self._key("fleet:seq"),
                ],
                args=[engine_id, record, max_engines, max_configs, records, order, config_key],
            )
        )
        return int(kept)

    async def measurements(self, config_key: str) -> tuple[bytes, ...]:
        client = self._redis()
        engines: list[bytes] = await self._call(
            client.zrevrange(self._key("fleet:ord:") + config_key, 0, -1)  # type: ignore[arg-type]
        )
        if not engines:
            return ()
        records: list[bytes | None] = await self._call(
            client.hmget(self._key("fleet:rec:") + config_key, engines)  # type: ignore[arg-type]
        )
        return tuple(bytes(record) for record in records if record is not None)

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
        identity: str = "",
        max_pending_per_identity: int | None = None,
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
                keys=[open_index, done_index, open_key, done_key, *self._result_keys()],
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
                await self._scripts["drop_result"](
                    keys=[done_index, *self._result_keys()],
                    args=[self._done_key(""), engine_id],
                    client=pipe,
                )
            if created:
                fields.update(
                    world_size=str(world_size),
                    template=template,
                    created=repr(now),
                    ttl_s=repr(ttl_s),
                    identity=identity,
                )
                expiry = _expiry_ms(ttl_s + self._expiry_grace_s)
                await self._scripts["open_rendezvous"](
                    keys=[open_index, open_key, self._open_of_key(identity)],
                    args=[
                        engine_id,
                        repr(now),
                        max_pending,
                        "" if expiry is None else expiry,
                        "" if max_pending_per_identity is None else max_pending_per_identity,
                        repr(now - ttl_s),
                        *(item for pair in fields.items() for item in pair),
                    ],
                    client=pipe,
                )
            else:
                pipe.hset(open_key, mapping=fields)  # type: ignore[arg-type]
            done = await pipe.execute()
            if created and isinstance(done[-1], list):
                of_identity, pending = (int(value) for value in done[-1])
                if of_identity:
                    assert max_pending_per_identity is not None
                    raise too_many_pending_of(identity, pending, max_pending_per_identity)
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
                pipe.zrem(self._open_of_key(_identity_of(entry)), engine_id)
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
        max_kept_bytes: int = DEFAULT_MAX_RESULT_BYTES,
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
            if entry:
                pipe.zrem(self._open_of_key(_identity_of(entry)), engine_id)
            if (result.ok or remember_failure) and entry:
                fields: dict[str, bytes | str] = {
                    "template_digest": digest(entry[b"template"]),
                    "plan": result.payload,
                    "finished": repr(now),
                    "ok": "1" if result.ok else "0",
                }
                ranks = _rank_fields(entry)
                for rank, spec in ranks.items():
                    fields[f"rank:{rank}"] = digest(spec)
                expiry = _expiry_ms(float(entry[b"ttl_s"]) + self._expiry_grace_s)
                await self._scripts["keep_result"](
                    keys=[self._key("rdv:done"), *self._result_keys(), done_key],
                    args=[
                        engine_id,
                        repr(now),
                        kept_result_bytes(engine_id, len(result.payload), len(ranks)),
                        max_kept_bytes,
                        "" if expiry is None else expiry,
                        self._done_key(""),
                        *(item for pair in fields.items() for item in pair),
                    ],
                    client=pipe,
                )
            pipe.publish(self._channel, message)
            await pipe.execute()

        await self._transact(attempt)
        # The listener skips this replica's own messages: delivered here, once.
        self._deliver(engine_id, result)

    def subscribe(self, callback: FinishedCallback) -> None:
        self._subscribers.append(callback)

    async def claim_engine(
        self, engine_id: str, identity: str, now: float, ttl_s: float, max_engines: int
    ) -> str:
        self._redis()
        holder = await self._unowned_holder(engine_id, now)
        if holder is not None and holder != identity:
            # Unowned live leases are never adopted (base.py). Not atomic with the
            # claim: under authentication no grant makes unowned leases, so a
            # record that appears in between only makes the claim return its owner.
            return holder
        owner = await self._call(
            self._scripts["claim_engine"](
                keys=[self._key("owner:" + engine_id), self._key("owned:" + identity)],
                args=[identity, max(int(ttl_s * 1000), 1), max_engines, engine_id],
            )
        )
        if isinstance(owner, int):
            raise TooManyEngines(owner, max_engines)
        return owner.decode() if isinstance(owner, bytes) else str(owner)

    async def engine_owner(self, engine_id: str, now: float) -> str | None:
        owner = await self._call(self._redis().get(self._key("owner:" + engine_id)))
        if isinstance(owner, bytes):
            return owner.decode()
        return await self._lease_holder(engine_id, now)

    async def _unowned_holder(self, engine_id: str, now: float) -> str | None:
        """The holder of the engine's live leases when no owner record exists."""
        if await self._call(self._redis().exists(self._key("owner:" + engine_id))):
            return None
        return await self._lease_holder(engine_id, now)

    async def _lease_holder(self, engine_id: str, now: float) -> str | None:
        """Who holds the engine's live leases (one grant: one identity), or None."""
        leases = await self.engine_leases(engine_id, now)
        return leases[0].identity if leases else None

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
                    await pubsub.aclose()
            if self._closing:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, LISTENER_BACKOFF_S[1])

    # --- ledger -------------------------------------------------------------------

    def _ledger_keys(self, engine_id: str) -> list[str]:
        return [
            self._key("lease-expiry"),
            self._key("ledger:committed"),
            self._key("ledger:outstanding"),
            self._key("ledger:live"),
            self._key("ledger:identity"),
            self._key("ledger:expired-through"),
            self._key("lease-version"),
            self._lease_key(engine_id),
            self._key("lease-device:"),
        ]

    def _grace_ms(self) -> int:
        """How long the ledger's keys outlive the latest expiry; -1: forever."""
        if not math.isfinite(self._expiry_grace_s):
            return -1
        return max(0, math.ceil(self._expiry_grace_s * 1000))

    def _hash_ms(self, leases: Sequence[Lease], now: float) -> int:
        """The janitor's expiry of an engine's lease hash; -1: none."""
        if not leases:
            return -1
        expiry = _expiry_ms(max(lease.expires_at for lease in leases) - now + self._expiry_grace_s)
        return -1 if expiry is None else expiry

    async def _read(
        self, now: float, device_uuids: Sequence[str], engine_id: str, identity: str
    ) -> tuple[bytes, LedgerView, list[Lease], float]:
        """(version, the view without the engine's leases, its counted leases, the
        time the ledger expired leases through)."""
        raw: list[Any] = await self._call(
            self._scripts["ledger_read"](
                keys=self._ledger_keys(engine_id), args=[repr(now), identity, *device_uuids]
            )
        )
        version, live, held, devices, own_records, through = raw
        own = [_lease(record) for record in own_records]
        totals = {
            uuid: Totals(int(committed), int(outstanding), int(count))
            for uuid, (committed, outstanding, count) in zip(device_uuids, devices, strict=True)
        }
        others = excluding(totals, own)
        view = LedgerView(
            devices={uuid: others[uuid] for uuid in device_uuids},
            live_leases=int(live) - len(own),
            identity_leases=int(held) - sum(lease.identity == identity for lease in own),
        )
        return bytes(version), view, own, float(through)

    async def _scan(self, low: str, index: str = "lease-expiry") -> list[Lease]:
        """The leases of `index` (every lease, or one device's: lease-device:{uuid})
        whose expiry is above `low` (reads the whole index range)."""
        records: list[Any] = await self._call(
            self._redis().zrangebyscore(self._key(index), low, "+inf")
        )
        return [_lease(record) for record in records]

    async def _retry(self, attempt: Callable[[], Awaitable[T | None]]) -> T:
        """Run `attempt` until it is not beaten by a concurrent write (None)."""
        for _ in range(MAX_ATTEMPTS):
            outcome = await attempt()
            if outcome is not None:
                return outcome
            self.transaction_retries += 1
        raise StoreUnavailable(
            f"Redis store {self._url}: {MAX_ATTEMPTS} conflicting attempts in a row; retry"
        )

    async def grant(
        self,
        engine_id: str,
        requests: Sequence[LeaseRequest],
        devices: Mapping[str, DeviceState],
        now: float,
        ttl_s: float,
        identity: str = "",
        *,
        max_identity_leases: int | None = None,
    ) -> tuple[Lease, ...]:
        self._redis()

        async def attempt() -> tuple[Lease, ...] | None:
            version, view, _, through = await self._read(now, list(devices), engine_id, identity)
            if int(version or b"0") < self._version_seen:
                # Taken back: Redis lost writes (an older snapshot, a lost AOF tail).
                await self._check_epoch(now, ttl_s)  # raises: the loss or the pause
                return None  # another replica's new epoch, its pause over: again
            # Decided on this read; the write below commits only if no lease changed
            # since (lease-version), so grants at once on any replica cannot all pass.
            check_lease_quota(
                identity,
                len(requests),
                max_identity_leases,
                identity_leases=view.identity_leases,
                live_leases=view.live_leases,
            )
            try:
                granted = grant_leases(
                    engine_id,
                    requests,
                    devices,
                    view.devices,
                    now,
                    ttl_s,
                    identity,
                    expired_through=through,
                )
            except GrantRefused as refused:
                holders = await self._scan(f"({now!r}", "lease-device:" + refused.device_uuid)
                raise naming_holders(refused, holders, engine_id, now) from None
            kept = last_per_rank(granted)
            args: list[str | int | bytes] = [
                version,
                repr(now),
                self._grace_ms(),
                self._hash_ms(kept, now),
            ]
            for lease in granted:
                args += [str(lease.rank), _record(lease), repr(lease.expires_at)]
            if self._persistence_refusal is not None:
                raise StoreNotPersistent(self._persistence_refusal)
            done = await self._ledger_write("ledger_grant", engine_id, args, now, ttl_s)
            if done:
                self._version_seen = max(self._version_seen, int(version or b"0") + 1)
            return granted if done else None

        return await self._retry(attempt)

    async def renew(
        self, engine_id: str, allocations: Mapping[int, int], now: float, ttl_s: float
    ) -> tuple[Lease, ...]:
        lease_key = self._lease_key(engine_id)
        through = -math.inf

        async def attempt() -> tuple[Lease, ...] | None:
            nonlocal through
            records = await self._call(self._redis().hvals(lease_key))
            mine = _by_rank(records)
            if not mine:
                # NOT_FOUND, unless the store lost the engine's leases: then the
                # holder retries (UNAVAILABLE) while grants are paused.
                await self._check_epoch(now, ttl_s)
            renewed = renew_leases(engine_id, mine, allocations, now, ttl_s, through)
            old = {lease.rank: lease for lease in mine}
            after = {**old, **{lease.rank: lease for lease in renewed}}
            args: list[str | int] = [
                repr(now),
                self._grace_ms(),
                self._hash_ms(list(after.values()), now),
            ]
            for lease in renewed:
                args += [
                    str(lease.rank),
                    _record(old[lease.rank]),
                    _record(lease),
                    repr(lease.expires_at),
                ]
            done = await self._ledger_write("ledger_renew", engine_id, args, now, ttl_s)
            if isinstance(done, list):  # expired meanwhile: decide again with the mark
                through = float(done[0])
                return None
            return renewed if done else None

        return await self._retry(attempt)

    async def release(self, engine_id: str, rank: int | None, now: float) -> tuple[Lease, ...]:
        self._redis()
        records = await self._call(
            self._scripts["ledger_release"](
                keys=self._ledger_keys(engine_id),
                args=[repr(now), self._grace_ms(), "" if rank is None else str(rank)],
            )
        )
        return tuple(lease for lease in _by_rank(records) if lease.live(now))

    async def ledger_view(
        self,
        now: float,
        device_uuids: Sequence[str],
        *,
        engine_id: str = "",
        identity: str = "",
    ) -> LedgerView:
        self._redis()
        _, view, _, _ = await self._read(now, device_uuids, engine_id, identity)
        return view

    async def engine_leases(self, engine_id: str, now: float) -> tuple[Lease, ...]:
        records = await self._call(self._redis().hvals(self._lease_key(engine_id)))
        return tuple(lease for lease in _by_rank(records) if lease.live(now))

    async def leases(self, now: float) -> tuple[Lease, ...]:
        self._redis()
        return _by_engine(await self._scan(f"({now!r}"))

    async def sweep_expired(self, now: float) -> tuple[Lease, ...]:
        self._redis()
        records = await self._call(
            self._scripts["ledger_sweep"](
                keys=self._ledger_keys(""),
                args=[repr(now), self._grace_ms(), self._key("lease:")],
            )
        )
        return _by_engine([_lease(record) for record in records])
