"""Usage metering: one Lua script appends the event to a Redis Stream and bumps every counter atomically.

Write path (:meth:`Meter.record`): the script ``RECORD`` runs with the event's ``event_id``; if that id was
already counted (``SADD`` on the day's seen-set returns 0) it does nothing, so replaying the same event —
after a timeout whose reply was lost, or from the spool — never counts twice. Otherwise, in one atomic
step: ``XADD`` to ``usage:events``, ``HINCRBY`` on the key's all-time / day / month hashes and the tier's
all-time / day hashes. In the same step the cost is added to the day/month counters of the global level
and of each of the event's tags (``gateway/state/budgets.py``), the request's budget reservations (made at
admission under the same id at every level, ``gateway/state/reservations.py``) are released and its TPM
window corrected by the real token count.
In the same step it deletes the request's write-ahead record (``gateway/state/write_ahead.py``): the record
an upstream call leaves before its first byte is settled by exactly its usage event; :meth:`Meter.settle_orphan`
counts the record of a dead process instead (an atomic claim), and :meth:`Meter.release_orphan` releases the
record of a dead process's request that was waiting, never sent upstream (same claim; no counter, an audit event).
Audit events (refused requests, ``UsageEvent.audit``) go through ``AUDIT`` instead: the stream and the cube's
``refused`` count only. A refused request was never sent upstream, so its audit event also settles whatever an
admission under its id may have left — its reservations at every level and its write-ahead record (an admission whose
reply was lost to a timeout ran, or not: ``gateway/state/limits.py``, "Outcome unknown"); with nothing left, nothing
changes. Counters are integers only (micro-USD, tokens, counts).

Usage cubes (``gateway/ledger/aggregate.py``): in the same step, ``RECORD`` and ``AUDIT`` add the event to its key's
cube of the day (one hash field per counter and cell: tier, model, tags) and count it in the cube index, so a
counted event is in the cubes exactly once whichever path counted it (the writer, a spool replay, the orphan
reconciler). :meth:`Meter.grouped` answers grouped usage from them; :meth:`Meter.backfill` builds them for days
counted before they existed.

When Redis is unreachable (or the breaker is open) the event goes to the fsync'd local :class:`Spool`;
:meth:`Meter.replay` (run every ``metering.replay_interval_s`` by :meth:`Meter.run_replayer`) sends the
spool back through the same script once Redis answers. Nothing is lost, nothing is counted twice — within
``metering.dedup_ttl_s`` (the seen-sets' lifetime).

When Redis answers but refuses an event — a command of the script fails: a ThinkGate key of the wrong type (a string
SET at the stream, a counter hash, a cube, a level's hash), a counter field holding text — nothing of it is written:
each script is all or nothing (``UNDO_LUA``: it undoes its own earlier writes and answers an error reply naming the
command and the key that failed). The event goes to a second fsync'd spool, the dead letters
(``<spool stem>.dead.jsonl``, :func:`dead_letter_path`), is counted in ``thinkgate_usage_dead_lettered_events_total``
and logged at ERROR once; :meth:`Meter.run_dead_letters` sends the dead letters again after
``metering.dead_letter_interval_s`` (doubled while none counts, up to an hour) — once the key is fixed they are counted,
once (by ``event_id``). The other events
of the same pipelined batch are counted as usual; the spool replay dead-letters a refused event and goes on (it used to
keep the whole spool forever). A refusal that only means Redis cannot write *now* (``READONLY`` after a failover,
``OOM``, ``BUSY``, ``NOREPLICAS``: :func:`transient`) spools the event like an outage instead.

Every replay (the usage spool, the unacked file, the dead letters) first sets aside the events whose id may have left
its seen-set (:func:`past_dedup_window`: ``ts`` older than ``metering.dedup_ttl_s`` less
:data:`~gateway.ledger.aggregate.SEEN_MARGIN_S`): counted already, such an event would be counted again, and whether
it was cannot be told any more. They go to the quarantine file (``<spool stem>.quarantine.jsonl``,
:func:`quarantine_path`), which is never sent: an operator decides (``docs/metering.md``). So do dead letters whose
write cannot even be built (:meth:`Meter._malformed`) and spool lines no event can be read from. The dead-letter
retry backs off (:meth:`Meter.run_dead_letters`) while it counts none.

Redis Cluster: a script may only touch keys of one hash slot. Under ``redis.cluster_placement: shared`` (the
default) every key of these scripts shares the one slot of the prefix's hash tag (``gateway/state/redis.py``) —
the cubes too, although they are per key. Under ``tenant`` a key's own counters, cube, reservation and TPM window
are in its tenant slot (``RedisKeys.per_key_slots``) and each event is written in three calls, each all or nothing:
the shared part, the key part, the finish (``RECORD_SHARED_LUA`` says how a crash between them is completed, once).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import NoScriptError, OutOfMemoryError, ReadOnlyError, ResponseError

from gateway.config import MeteringConfig
from gateway.ledger.aggregate import (
    DAY_S,
    SEEN_MARGIN_S,
    GroupedUsage,
    PeriodParts,
    ScanTooLarge,
    cell_of,
    day_of,
    day_start,
    day_verdict,
    merge_windows,
    parse_cube,
    plan_period,
)
from gateway.ledger.event import (
    COUNTER_FIELDS,
    CUBE_ONLY_FIELDS,
    UsageEvent,
    counter_increments,
    cube_only_increments,
)
from gateway.ledger.export import Groupable, group_sums, increments
from gateway.state.breaker import Breaker, RedisDown, is_outage
from gateway.state.keys import RedisKeys
from gateway.state.log_throttle import LogThrottle, held_back
from gateway.state.redis import FastScript, RedisHandle, as_bytes, as_text
from gateway.state.reservations import LUA_FUNCTIONS, SETTLE_LUA
from gateway.state.spool import Quarantine, Spool, quarantined
from gateway.state.undo import UNDO_LUA, all_or_nothing

log = logging.getLogger("thinkgate.metering")

DAY_TTL_S = 400 * 86400
MONTH_TTL_S = 800 * 86400
TPM_TTL_MS = 120_000
#: refusals whose audit event is not yet in Redis with what their lost admission may have left (:class:`Leftovers`,
#: ``Meter.leftovers``); beyond it the oldest are forgotten: their lock and RPM count are left to their TTL and window
LEFTOVERS_MAX = 4096
UNROUTED = "_unrouted"  # tier label of requests refused before routing
REPLAY_PIPELINE = 50  # events per pipeline when the spool is replayed
CLUSTER_WRITERS = 16  # events of a batch written at once on a Redis Cluster (Meter.record_many)
PROBE_TTL_MS = 60_000  # the replica-acknowledgement probe key (Meter.replica_acks): rewritten on every check
PROBE_SEARCH = 10_000  # tenant tags tried for a probe key on each master (Meter._probes): a few per master suffice
ACK_BACKOFF_S = 1.0  # after too few replica acknowledgements, batches skip the WAIT this long (Meter._acked)
DEAD_LETTER_PROBE = 50  # dead letters sent first on a retry: all refused, the rest waits for the next one
#: the longest wait between two dead-letter retries (seconds): each pass that counts none doubles the wait from
#: metering.dead_letter_interval_s up to this — a key broken for days, or an event Redis refuses for ever, was retried
#: (and logged) every minute
DEAD_LETTER_MAX_INTERVAL_S = 3600.0
POISON_MEMORY = 10_000  # event ids remembered as having logged their traceback (Meter._poison_logged)
#: error replies of a Redis that cannot write *now* (a replica after a failover, a script running, memory full):
#: the event goes to the usage spool like on an outage, not to the dead letters
TRANSIENT_REPLIES = ("BUSY ", "NOREPLICAS ", "MISCONF ")  # MISCONF: writes stopped after a failed RDB save
# How far a stream id (the write time, Redis's clock) may lie before its event's ts (the request's start, the
# replica's clock) for Meter.recent to find it: clock skew between hosts. (After it: metering.late_after_s.)
EARLY_SLACK_S = 60.0

# Reads of the stream by id range (Meter.events) stop late_after_s past the period's end: an event written later
# than that after its ts (a spool replay, a reconciled orphan) is indexed in the late set (score: its ts in ms) so
# they still find it. late:from in the cube index is the id time of the first event this script wrote: events
# written before it (an older script) were never indexed, so a read reaching back before it cannot stop early.
NOTE_LATE = UNDO_LUA + """
-- the event's JSON appended to the stream (trimmed to maxlen when not '0'); its stream id
local function append_event(stream, maxlen, json)
  at_cmd, at_key = 'XADD', stream
  local id
  if maxlen ~= '0' then
    id = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'e', json)
  else
    id = redis.call('XADD', stream, '*', 'e', json)
  end
  U[nu + 1], U[nu + 2], U[nu + 3] = 'x', stream, id
  nu = nu + 4
  return id
end
local function note_late(index, late, id, ts_ms, late_ms, ttl)
  local ms = tonumber(string.sub(id, 1, string.find(id, '-', 1, true) - 1))
  at_cmd, at_key = 'HSETNX', index
  if redis.call('HSETNX', index, 'late:from', ms) == 1 then
    U[nu + 1], U[nu + 2], U[nu + 3] = 'f', index, 'late:from'
    nu = nu + 4
  end
  if ms > tonumber(ts_ms) + tonumber(late_ms) then
    at_cmd, at_key = 'ZADD', late
    if redis.call('ZADD', late, ts_ms, id) == 1 then
      U[nu + 1], U[nu + 2], U[nu + 3] = 'z', late, id
      nu = nu + 4
    end
    redis.call('EXPIRE', late, ttl)
    -- each add renews the set's TTL, so without a trim it only grew: entries whose ts is older than the cubes'
    -- lifetime (ttl) serve no read any more (a trim is not undone: what it removed was past its use)
    redis.call('ZREMRANGEBYSCORE', late, '-inf', '(' .. (ms - tonumber(ttl) * 1000))
  end
end
"""

# An event's counters, shared by RECORD and RECORD_KEY (after UNDO_LUA): ARGV[from..] are field / increment pairs;
# count_counters adds each non-zero increment to KEYS[lo..hi] (unless ``all`` is false or the field is CUBE_ONLY: the
# cube's only) and, as "<field> <cell>", to the cube KEYS[cube] — counted in na, not logged; counter_writes lists the
# same writes for the failure path (which takes back the first na).
COUNTERS_LUA = """
local CUBE_ONLY = {""" + ", ".join(f"{f} = true" for f in CUBE_ONLY_FIELDS) + """}
local function count_counters(from, lo, hi, cube, cell, all)
  for i = from, #ARGV, 2 do
    local n = ARGV[i + 1]
    if n ~= '0' then
      local f = ARGV[i]
      if all and not CUBE_ONLY[f] then
        for k = lo, hi do
          redis.call('HINCRBY', KEYS[k], f, n)
          na = na + 1
        end
      end
      redis.call('HINCRBY', KEYS[cube], f .. cell, n)
      na = na + 1
    end
  end
end
local function counter_writes(from, lo, hi, cube, cell, all)
  local a = {}
  for i = from, #ARGV, 2 do
    if ARGV[i + 1] ~= '0' then
      if all and not CUBE_ONLY[ARGV[i]] then
        for k = lo, hi do a[#a + 1] = {KEYS[k], ARGV[i], ARGV[i + 1]} end
      end
      a[#a + 1] = {KEYS[cube], ARGV[i] .. cell, ARGV[i + 1]}
    end
  end
  return a
end
"""

# The levels above the key (global, then each tag) of a counted event, shared by RECORD and RECORD_SHARED:
# levels(first, tag0, ntags): the KEYS index of each level's day counter (its month counter follows it);
# count_levels: cost and one request added to each level's day and month, TTLs renewed — counted in nb, not logged
# (the failure path lists the same writes with level_writes and takes back the first nb).
LEVELS_LUA = """
local function levels(first, tag0, ntags)
  local lv = {first}
  for j = 0, ntags - 1 do lv[#lv + 1] = tag0 + 3 * j end
  return lv
end
local function count_levels(lv, cost, day_ttl, month_ttl)
  for _, d in ipairs(lv) do
    redis.call('HINCRBY', KEYS[d], 'cost_micro_usd', cost)
    nb = nb + 1
    redis.call('HINCRBY', KEYS[d], 'requests', 1)
    nb = nb + 1
    redis.call('HINCRBY', KEYS[d + 1], 'cost_micro_usd', cost)
    nb = nb + 1
    redis.call('HINCRBY', KEYS[d + 1], 'requests', 1)
    nb = nb + 1
    redis.call('EXPIRE', KEYS[d], day_ttl)
    redis.call('EXPIRE', KEYS[d + 1], month_ttl)
  end
end
local function level_writes(lv, cost)
  local b = {}
  for _, d in ipairs(lv) do
    b[#b + 1] = {KEYS[d], 'cost_micro_usd', cost}
    b[#b + 1] = {KEYS[d], 'requests', 1}
    b[#b + 1] = {KEYS[d + 1], 'cost_micro_usd', cost}
    b[#b + 1] = {KEYS[d + 1], 'requests', 1}
  end
  return b
end
"""

# KEYS: 1 seen-set, 2 stream, 3 key total, 4 key day, 5 key month, 6 tier total, 7 tier day, 8 usage:keys,
#       9 the key's reservation hash, 10 the key's TPM counter of the event's minute, 11 global day,
#       12 global month, 13 global reservations, 14 the key's usage cube of the day, 15 the cube index,
#       16 the day's cube key set, then per tag j (0-based): 17+3j day, 18+3j month, 19+3j resv
# ARGV: 1 event_id, 2 event JSON, 3 seen TTL s, 4 day TTL s, 5 month TTL s, 6 stream maxlen (0 = none),
#       7 key id, 8 upstream tokens of the event, 9 TPM TTL ms, 10 cost micro-USD, 11 number of tags,
#       12 UTC day, 13 the event's cube cell (gateway/ledger/aggregate.py), 14 the event's ts (ms),
#       15 metering.late_after_s (ms), 16.. counter field/increment pairs (a field of CUBE_ONLY: the cube's only,
#       not the key's and tier's counter hashes — gateway/ledger/event.py CUBE_ONLY_FIELDS)
# The reservations made at admission under event_id (gateway/state/reservations.py) are released at every
# level (once: HDEL) and the TPM window corrected by (actual - reserved) tokens (deleted when that brings it to 0,
# ``del_zero`` in gateway/state/reservations.py). Levels above the key
# (global, tags) count cost_micro_usd and requests per UTC day and month.
# The cube (gateway/ledger/aggregate.py) is added to in the same step that counts the event, so a counted event
# is in it exactly once whichever path counted it (the writer, the spool replay, the orphan reconciler); n:{day}
# of the index counts the events aggregated, which the query compares with the day's seen-set.
# KEYS 17+3n (n = tags): the late index (NOTE_LATE).
# Write-ahead (gateway/state/write_ahead.py), optional trailing KEYS: 18+3n the write-ahead hash: the
# request's record is deleted (settled) with the event; 19+3n an owner's heartbeat: the event is a dead process's
# orphan being reconciled, counted only if its record is still there and the heartbeat still absent (the atomic
# claim: a record settled normally, or claimed by another replica first, is left alone; reply {0, 0, …}).
# Returns {counted (1/0), key day cost, key month cost, global day, global month, tag day, tag month, …}.
RECORD_LUA = LUA_FUNCTIONS + NOTE_LATE + SETTLE_LUA + LEVELS_LUA + COUNTERS_LUA + """
local function record()
  local ntags = tonumber(ARGV[11])
  local late, wal, owner_hb = KEYS[17 + 3 * ntags], KEYS[18 + 3 * ntags], KEYS[19 + 3 * ntags]
  if owner_hb then
    at_cmd, at_key = 'HEXISTS', wal
    if redis.call('HEXISTS', wal, ARGV[1]) == 0 or redis.call('EXISTS', owner_hb) == 1 then
      local none = {0, 0, 0, 0, 0}
      for j = 1, 2 * ntags do none[#none + 1] = 0 end
      return none
    end
  end
  local reserved = settle(KEYS[9], ARGV[1])
  local tpm_zero = false  -- the TPM window brought to 0: deleted last (below)
  if reserved then
    local delta = tonumber(ARGV[8]) - reserved
    if reserved > 0 and delta ~= 0 and redis.call('EXISTS', KEYS[10]) == 1 then
      tpm_zero = incrby(KEYS[10], delta) == 0
      redis.call('PEXPIRE', KEYS[10], ARGV[9])
    end
  end
  settle(KEYS[13], ARGV[1])
  for j = 0, ntags - 1 do settle(KEYS[19 + 3 * j], ARGV[1]) end
  local counted = 0
  if sadd(KEYS[1], ARGV[1]) == 1 then
    counted = 1
    redis.call('EXPIRE', KEYS[1], ARGV[3])
    local id = append_event(KEYS[2], ARGV[6], ARGV[2])
    note_late(KEYS[15], late, id, ARGV[14], ARGV[15], ARGV[4])
    -- counted, not logged (most of the writes): the failure path (below) lists them in this order
    at_cmd = 'A'
    local cell = ' ' .. ARGV[13]
    count_counters(16, 3, 7, 14, cell, true)
    redis.call('EXPIRE', KEYS[14], ARGV[4])
    hincr(KEYS[15], 'n:' .. ARGV[12], 1)
    if sadd(KEYS[16], ARGV[7]) == 1 then redis.call('EXPIRE', KEYS[16], ARGV[4]) end
    redis.call('EXPIRE', KEYS[4], ARGV[4])
    redis.call('EXPIRE', KEYS[5], ARGV[5])
    redis.call('EXPIRE', KEYS[7], ARGV[4])
    sadd(KEYS[8], ARGV[7])
    at_cmd = 'B'
    count_levels(levels(11, 17, ntags), ARGV[10], ARGV[4], ARGV[5])
  end
  local out = {counted}
  local function cost(k)
    at_cmd, at_key = 'HGET', KEYS[k]
    return tonumber(redis.call('HGET', KEYS[k], 'cost_micro_usd') or '0')
  end
  out[2], out[3], out[4], out[5] = cost(4), cost(5), cost(11), cost(12)
  for j = 0, ntags - 1 do
    out[#out + 1] = cost(17 + 3 * j)
    out[#out + 1] = cost(18 + 3 * j)
  end
  -- the write-ahead record last: nothing can fail after its HDEL, which so needs no undo
  if wal then
    at_cmd, at_key = 'HDEL', wal
    redis.call('HDEL', wal, ARGV[1])
  end
  del_zero(tpm_zero, KEYS[10])
  return out
end
""" + all_or_nothing("record", """
-- the counter HINCRBYs of record() (its loops 'A' and 'B'), in its order, {key, field, n} each: the first na / nb
-- were done; a failure in a loop was at the write after them
local a, b, cell = {}, {}, ' ' .. ARGV[13]
a = counter_writes(16, 3, 7, 14, cell, true)
b = level_writes(levels(11, 17, tonumber(ARGV[11])), ARGV[10])
if at_cmd == 'A' then at_cmd, at_key = 'HINCRBY', (a[na + 1] or {'?'})[1] end
if at_cmd == 'B' then at_cmd, at_key = 'HINCRBY', (b[nb + 1] or {'?'})[1] end
for i = 1, na do unincr(a[i][1], a[i][2], a[i][3]) end
for i = 1, nb do unincr(b[i][1], b[i][2], b[i][3]) end
""")

# The record of a refused request (UsageEvent.audit): once by event_id, into the stream and the cube's ``refused``
# count only — no counter, no level, no reservation (it never had one).
# KEYS: 1 seen-set, 2 stream, 3 the key's cube of the day, 4 the cube index, 5 the day's cube key set, 6 the late
#       index; ARGV: 1 event_id, 2 event JSON, 3 seen TTL s, 4 stream maxlen (0 = none), 5 UTC day, 6 cube cell,
#       7 key id, 8 day TTL s, 9 the event's ts (ms), 10 metering.late_after_s (ms).
# write_audit(): the audit event of KEYS[1..6] / ARGV[1..10] (AUDIT's layout, above) once by its id — the stream,
# the late index, the cube's ``refused`` count, the day's aggregated count and key set; 1 written, 0 a duplicate.
# AUDIT and RELEASE both record one through it.
WRITE_AUDIT = NOTE_LATE + """
local function write_audit()
  if sadd(KEYS[1], ARGV[1]) == 0 then return 0 end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  local id = append_event(KEYS[2], ARGV[4], ARGV[2])
  note_late(KEYS[4], KEYS[6], id, ARGV[9], ARGV[10], ARGV[8])
  hincr(KEYS[3], 'refused ' .. ARGV[6], 1)
  redis.call('EXPIRE', KEYS[3], ARGV[8])
  hincr(KEYS[4], 'n:' .. ARGV[5], 1)
  if sadd(KEYS[5], ARGV[7]) == 1 then redis.call('EXPIRE', KEYS[5], ARGV[8]) end
  return 1
end
"""
# settle_unsent(w, k, lv, rid, tpm_ttl, rpm, lock, token) (after WRITE_AUDIT and SETTLE_LUA): request ``rid``, never
# sent upstream, settled as no request: its reservation at the key (KEYS[k]) released and its reserved tokens taken back
# out of the key's TPM window KEYS[k + 1] (it used none), its reservations at the levels KEYS[lv ..] released, its audit
# event written (write_audit), then its write-ahead record in the hash KEYS[w] deleted — last: nothing can fail after
# that HDEL, which so needs no undo. Optional (AUDIT; nil for none): ``rpm``, the key's RPM window counter its admission
# counted it in — one request taken back, only with its key's reservation there (the proof that its admission ran and
# admitted, so counted it; once: the reservation goes with it); ``lock`` and ``token``, the exact cache's single-flight
# lock its admission may have taken — deleted only while it holds ``token`` (read before the HDEL, deleted after it:
# DEL cannot fail). A window brought to 0 is deleted, as RECORD's. What is not there (an admission that never ran, or
# settled already) is skipped: the same call twice changes nothing more. Returns write_audit's 1 or 0.
UNSENT_LUA = """
local function settle_unsent(w, k, lv, rid, tpm_ttl, rpm, lock, token)
  local reserved = settle(KEYS[k], rid)
  local zero = {}  -- windows brought to 0: deleted last (below)
  if reserved and reserved > 0 and redis.call('EXISTS', KEYS[k + 1]) == 1 then
    if incrby(KEYS[k + 1], -reserved) == 0 then zero[#zero + 1] = KEYS[k + 1] end
    redis.call('PEXPIRE', KEYS[k + 1], tpm_ttl)
  end
  if rpm and reserved then
    at_cmd, at_key = 'EXISTS', rpm
    if redis.call('EXISTS', rpm) == 1 and incrby(rpm, -1) == 0 then zero[#zero + 1] = rpm end
  end
  for j = lv, #KEYS do settle(KEYS[j], rid) end
  local written = write_audit()
  -- pcall: a lock key of another type is no lock of this request's, and must not hold its audit event back
  local locked = lock and redis.pcall('GET', lock) == token
  at_cmd, at_key = 'HDEL', KEYS[w]
  redis.call('HDEL', KEYS[w], rid)
  if locked then redis.call('DEL', lock) end
  for _, z in ipairs(zero) do redis.call('DEL', z) end
  return written
end
"""
# AUDIT of a refused request of a known key also settles what an admission under its id (the event id) may have left
# (settle_unsent: its reservations, its write-ahead record, its RPM count, its single-flight lock). Optional trailing
# KEYS: 7 the write-ahead hash, 8 the key's reservation hash, 9 the key's TPM counter of the event's minute, 10 its RPM
# counter of that minute, 11 the single-flight lock (KEYS[10] when none), 12 global reservations, 13.. each tag's
# reservations; ARGV 11 TPM TTL ms, 12 '1' to take the request back out of the RPM window (its admission counted it had
# it run: the key has an RPM limit), 13 the lock's token ('' = no lock). Why every such audit event: a refusal's
# admission may have run in Redis with its reply lost (a timeout), and the refusal cannot tell — left, its write-ahead
# record stayed open for the reconciler to settle as a lost call once this process is gone, its reservations held the
# budgets until their TTL, its RPM count stayed in the window for up to a minute and identical prompts waited on its
# lock for cache.single_flight_wait_s. ARGV 12 and 13 are what the refusing process knows (``Meter.leftovers``); an
# event replayed by another process passes '0' and '': those two are left to their window and TTL.
AUDIT_LUA = LUA_FUNCTIONS + WRITE_AUDIT + SETTLE_LUA + UNSENT_LUA + all_or_nothing("""function()
  if #KEYS > 6 then
    local rpm = ARGV[12] == '1' and KEYS[10] or nil
    local lock = ARGV[13] ~= '' and KEYS[11] or nil
    return {settle_unsent(7, 8, 12, ARGV[1], ARGV[11], rpm, lock, ARGV[13]), 0, 0}
  end
  if write_audit() == 0 then return {0, 0, 0} end
  return {1, 0, 0}
end""")

# The write-ahead record of a dead process's request that was waiting and never sent upstream
# (gateway/state/write_ahead.py): if the record is still open and the owner's heartbeat still absent (the claim, as
# in RECORD), delete it, release the request's reservations at every level, take its reserved tokens back out of the
# TPM window (it used none; a window brought to 0 is deleted, as RECORD's) and record its audit event as AUDIT does
# (stream, the cube's ``refused``, the index).
# The audit event has an id of its own (``{request id}:unsent``, in the seen-set like any audit event, so the cube
# index still equals the seen-set); the request id itself is not added: nothing was counted, so should the owner
# have been alive after all (its heartbeat lapsed while Redis was away) and send the call, that call's own event
# still counts once.
# Such an event is written long after its ``ts`` (a heartbeat TTL and more): it goes into the late index (NOTE_LATE)
# like any audit event written late, or reads of its period by id range would not find it.
# KEYS: 1-6 as AUDIT's (seen-set, stream, the key's cube of the day, cube index, the day's cube key set, the late
#       index), 7 write-ahead hash, 8 owner heartbeat, 9 the key's reservation hash, 10 the key's TPM counter of the
#       event's minute, 11 global reservations, 12.. each tag's reservations
# ARGV: 1-10 as AUDIT's (1 the audit event's id), 11 request id, 12 TPM TTL ms. Returns 1 (released) or 0.
RELEASE_LUA = LUA_FUNCTIONS + WRITE_AUDIT + SETTLE_LUA + UNSENT_LUA + all_or_nothing("""function()
  at_cmd, at_key = 'HEXISTS', KEYS[7]
  if redis.call('HEXISTS', KEYS[7], ARGV[11]) == 0 or redis.call('EXISTS', KEYS[8]) == 1 then return 0 end
  settle_unsent(7, 9, 11, ARGV[11], ARGV[12])
  return 1
end""")

# --- Redis Cluster with each key's own levels in its tenant slot (``RedisKeys.per_key_slots``) -----------------------
# RECORD, AUDIT and RELEASE each touch a key's own keys (its counters, cube, reservations and TPM window: the key's
# tenant slot) and the shared ones (the stream, the seen-set, the tier, tag and global levels, the write-ahead record:
# the shared slot); a script cannot span slots, so there each runs as three calls (Meter._run_split), each all or
# nothing on its own:
#   1. SHARED (the shared slot): the write-ahead claim of an orphan; the levels above the key settled; once by event id
#      (the shared seen-set): the stream, the tier and level counters, the cube index and day key set — and the key
#      part's call (its KEYS and ARGV, JSON) stored under the event id in ``usage:pending``. Answers that pending call
#      whoever stored it: a retry, a replay or a second reconciler completes the *first* writer's key part, so the key's
#      counters always count the amounts the stream holds.
#   2. KEY (the tenant slot): the key's reservation settled and its TPM window corrected; once by event id (the key's
#      own seen-set, ``RedisKeys.key_seen``): the key's counters and cube.
#   3. FINISH (the shared slot): the write-ahead record deleted, then the pending call.
# A crash (or an outage) between 1 and 3 leaves the pending call and, for an upstream call, the write-ahead record: the
# event's spool replay, the orphan reconciler, or the sweep of pending calls older than PENDING_SWEEP_S
# (Meter.finish_pending, run by the replayer) completes it; 2 counts once whoever runs it. Meanwhile the key's counters
# lag the stream by that one event (its budget reads a few ms behind; after a crash, until the sweep), never ahead.

# KEYS: 1 the key's seen-set of the day, 2 key total, 3 key day, 4 key month, 5 the key's reservation hash, 6 the key's
#       TPM counter of the event's minute, 7 the key's cube of the day
# ARGV: 1 event id, 2 reservation id ('' none), 3 TPM: 'd' correct by (tokens - reserved), 'b' take the reserved
#       tokens back (a call never sent), '' none; 4 upstream tokens, 5 TPM TTL ms, 6 seen TTL s, 7 day TTL s,
#       8 month TTL s, 9 the cube cell, 10 'k' (counters and cube) or 'c' (cube only: an audit event), 11.. field /
#       increment pairs (a field of CUBE_ONLY: the cube's only). Returns {counted (1/0), key day cost, key month cost}.
RECORD_KEY_LUA = LUA_FUNCTIONS + UNDO_LUA + SETTLE_LUA + COUNTERS_LUA + """
local function record_key()
  local tpm_zero = false  -- the TPM window brought to 0: deleted last (below)
  if ARGV[2] ~= '' then
    local reserved = settle(KEYS[5], ARGV[2])
    if reserved and reserved > 0 and ARGV[3] ~= '' and redis.call('EXISTS', KEYS[6]) == 1 then
      local delta = -reserved
      if ARGV[3] == 'd' then delta = tonumber(ARGV[4]) - reserved end
      if delta ~= 0 then
        tpm_zero = incrby(KEYS[6], delta) == 0
        redis.call('PEXPIRE', KEYS[6], ARGV[5])
      end
    end
  end
  local counted = 0
  if sadd(KEYS[1], ARGV[1]) == 1 then
    counted = 1
    redis.call('EXPIRE', KEYS[1], ARGV[6])
    at_cmd = 'A'
    local all = ARGV[10] == 'k'
    count_counters(11, 2, 4, 7, ' ' .. ARGV[9], all)
    redis.call('EXPIRE', KEYS[7], ARGV[7])
    if all then
      redis.call('EXPIRE', KEYS[3], ARGV[7])
      redis.call('EXPIRE', KEYS[4], ARGV[8])
    end
  end
  at_cmd, at_key = 'HGET', KEYS[3]
  local d = tonumber(redis.call('HGET', KEYS[3], 'cost_micro_usd') or '0')
  at_key = KEYS[4]
  local m = tonumber(redis.call('HGET', KEYS[4], 'cost_micro_usd') or '0')
  del_zero(tpm_zero, KEYS[6])
  return {counted, d, m}
end
""" + all_or_nothing("record_key", """
local a = counter_writes(11, 2, 4, 7, ' ' .. ARGV[9], ARGV[10] == 'k')
if at_cmd == 'A' then at_cmd, at_key = 'HINCRBY', (a[na + 1] or {'?'})[1] end
for i = 1, na do unincr(a[i][1], a[i][2], a[i][3]) end
""")

# KEYS: 1 seen-set, 2 stream, 3 tier total, 4 tier day, 5 usage:keys, 6 global day, 7 global month, 8 global
#       reservations, 9 the cube index, 10 the day's cube key set, 11 the late index, 12 usage:pending, then per tag
#       j (0-based): 13+3j day, 14+3j month, 15+3j reservations; then, optional: 13+3n the write-ahead hash (its
#       record claimed: an orphan), 14+3n the owner's heartbeat
# ARGV: 1 event id, 2 event JSON, 3 seen TTL s, 4 day TTL s, 5 month TTL s, 6 stream maxlen (0 = none), 7 key id,
#       8 cost micro-USD, 9 number of tags, 10 UTC day, 11 the event's ts (ms), 12 metering.late_after_s (ms),
#       13 the key part's call (JSON, stored in usage:pending), 14 'r' (a usage event), 'a' (an audit event: no
#       counter, no level) or 'x' (a call never sent upstream released — a dead process's unsent call, or a refused
#       request of a key, ``Meter._run``: its levels' reservations, an audit event),
#       15 the request id (reservations, the write-ahead record), 16.. counter field / increment pairs ('r')
# Returns {-1} when the claim fails (the record settled, or its owner alive), else {counted (1/0), the pending key
# part ('' when none is pending: done, or never split), global day cost, global month cost, tag day, tag month, …}.
RECORD_SHARED_LUA = LUA_FUNCTIONS + NOTE_LATE + SETTLE_LUA + LEVELS_LUA + COUNTERS_LUA + """
local function shared()
  local ntags, mode, rid = tonumber(ARGV[9]), ARGV[14], ARGV[15]
  local wal, owner_hb = KEYS[13 + 3 * ntags], KEYS[14 + 3 * ntags]
  if owner_hb then
    at_cmd, at_key = 'HEXISTS', wal
    if redis.call('HEXISTS', wal, rid) == 0 or redis.call('EXISTS', owner_hb) == 1 then return {-1} end
  end
  if mode ~= 'a' then
    settle(KEYS[8], rid)
    for j = 0, ntags - 1 do settle(KEYS[15 + 3 * j], rid) end
  end
  local counted = 0
  if sadd(KEYS[1], ARGV[1]) == 1 then
    counted = 1
    redis.call('EXPIRE', KEYS[1], ARGV[3])
    local id = append_event(KEYS[2], ARGV[6], ARGV[2])
    note_late(KEYS[9], KEYS[11], id, ARGV[11], ARGV[12], ARGV[4])
    if mode == 'r' then
      at_cmd = 'A'
      for i = 16, #ARGV, 2 do
        local n = ARGV[i + 1]
        if n ~= '0' and not CUBE_ONLY[ARGV[i]] then
          for k = 3, 4 do
            redis.call('HINCRBY', KEYS[k], ARGV[i], n)
            na = na + 1
          end
        end
      end
      redis.call('EXPIRE', KEYS[4], ARGV[4])
      sadd(KEYS[5], ARGV[7])
      at_cmd = 'B'
      count_levels(levels(6, 13, ntags), ARGV[8], ARGV[4], ARGV[5])
    end
    hincr(KEYS[9], 'n:' .. ARGV[10], 1)
    if sadd(KEYS[10], ARGV[7]) == 1 then redis.call('EXPIRE', KEYS[10], ARGV[4]) end
    hset(KEYS[12], ARGV[1], ARGV[13])
  end
  at_cmd, at_key = 'HGET', KEYS[12]
  local out = {counted, redis.call('HGET', KEYS[12], ARGV[1]) or ''}
  if mode == 'r' then
    local function cost(k)
      at_cmd, at_key = 'HGET', KEYS[k]
      return tonumber(redis.call('HGET', KEYS[k], 'cost_micro_usd') or '0')
    end
    out[3], out[4] = cost(6), cost(7)
    for j = 0, ntags - 1 do
      out[#out + 1] = cost(13 + 3 * j)
      out[#out + 1] = cost(14 + 3 * j)
    end
  end
  return out
end
""" + all_or_nothing("shared", """
local a, b = {}, {}
for i = 16, #ARGV, 2 do
  if ARGV[i + 1] ~= '0' and not CUBE_ONLY[ARGV[i]] then
    for k = 3, 4 do a[#a + 1] = {KEYS[k], ARGV[i], ARGV[i + 1]} end
  end
end
b = level_writes(levels(6, 13, tonumber(ARGV[9])), ARGV[8])
if at_cmd == 'A' then at_cmd, at_key = 'HINCRBY', (a[na + 1] or {'?'})[1] end
if at_cmd == 'B' then at_cmd, at_key = 'HINCRBY', (b[nb + 1] or {'?'})[1] end
for i = 1, na do unincr(a[i][1], a[i][2], a[i][3]) end
for i = 1, nb do unincr(b[i][1], b[i][2], b[i][3]) end
""")

# KEYS: 1 usage:pending, 2 (optional) the write-ahead hash; ARGV: 1 event id, 2 request id. The write-ahead record
# first (a failure there leaves both, and the next try does both), then the pending call. Returns 1.
FINISH_LUA = """
if KEYS[2] then redis.call('HDEL', KEYS[2], ARGV[2]) end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""
#: a pending key part older than this (seconds) is completed by Meter.finish_pending: its writer died, or lost Redis,
#: between the shared part and the end
PENDING_SWEEP_S = 30.0
PENDING_SWEEP_MAX = 500  # pending calls one sweep completes at most

# A day's cubes rebuilt from the stream (``thinkgate usage backfill``), only if the script aggregated no event of
# that day since the rebuild read the index (n:{day} unchanged): else it is left for the next run.
# All or nothing without an undo log (``gateway/state/undo.py``): no command after its first write can fail. Its first
# command reads the index (a key of the wrong type there fails it before any write); every other key it writes — the
# day's cubes, old and new, and the day's key set — it deletes first (DEL takes a key of any type), so a key of the
# wrong type there is rebuilt, not met. Keep it so: a write before those DELs would need the undo log.
# KEYS: 1 the cube index, 2 the day's cube key set, 3.. every cube key of the day (the old ones and the new);
# ARGV: 1 day, 2 n:{day} read before the stream was, 3 events of the day in the stream, 4 day TTL s,
#       5 "1" to mark the day ok (it is over), 6 number of key ids that follow, then the key ids (their cubes are
#       KEYS 3.. in order, then the old cubes to delete), then (cube number 1-based, field, value) triples.
BACKFILL_LUA = """
local n0 = redis.call('HGET', KEYS[1], 'n:' .. ARGV[1]) or '0'
if n0 ~= ARGV[2] then return 0 end
for i = 3, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('DEL', KEYS[2])
local nk = tonumber(ARGV[6])
for i = 1, nk do redis.call('SADD', KEYS[2], ARGV[6 + i]) end
for i = 7 + nk, #ARGV, 3 do
  local key = KEYS[2 + tonumber(ARGV[i])]
  redis.call('HSET', key, ARGV[i + 1], ARGV[i + 2])
  redis.call('EXPIRE', key, ARGV[4])
end
if nk > 0 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
redis.call('HSET', KEYS[1], 'n:' .. ARGV[1], ARGV[3])
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'ok:' .. ARGV[1], '1') end
return 1
"""

# Backfill where the cubes are in their keys' tenant slots (Meter._backfill_split): one cube rewritten (KEYS: 1 the
# cube; ARGV: 1 day TTL s, then field / value pairs; DEL first, so a key of the wrong type there is rebuilt) …
CUBE_REWRITE_LUA = """
redis.call('DEL', KEYS[1])
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if #ARGV > 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return 1
"""
# … and, last, the day's index and key set, only if n:{day} is what it was when the rebuild read it (as BACKFILL_LUA):
# KEYS: 1 the cube index, 2 the day's cube key set; ARGV: 1 day, 2 n:{day} read before the stream was, 3 events of
# the day in the stream, 4 day TTL s, 5 "1" to mark the day ok, 6.. the key ids with a cube that day.
INDEX_REWRITE_LUA = """
local n0 = redis.call('HGET', KEYS[1], 'n:' .. ARGV[1]) or '0'
if n0 ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[2])
for i = 6, #ARGV do redis.call('SADD', KEYS[2], ARGV[i]) end
if #ARGV >= 6 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
redis.call('HSET', KEYS[1], 'n:' .. ARGV[1], ARGV[3])
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'ok:' .. ARGV[1], '1') end
return 1
"""


@dataclass(slots=True)
class ReadTally:
    """Stream entries a read went through (:meth:`Meter.events`' ``tally``), whatever its filter kept."""

    entries: int = 0


@dataclass(frozen=True, slots=True)
class Leftovers:
    """What a refused request's admission call may have left in Redis besides its reservations and write-ahead record,
    when its reply was lost (``gateway/state/limits.py``, "Outcome unknown"), for its audit event (``AUDIT``) to take
    back: ``rpm`` — the call counted the request in its key's RPM window of the request's minute, had it run (the key
    has an RPM limit); ``lock`` — the exact cache's single-flight lock key it may have taken, with its ``token`` ("":
    no lookup in the call). Both are taken back only if the call did run: the count with the key's reservation (the
    proof), the lock while it holds the token."""

    rpm: bool = False
    lock: str = ""
    token: str = ""


@dataclass(frozen=True, slots=True)
class RecordResult:
    """Where the event went, and (when it reached Redis) the key's spend so far this day/month (micro-USD)."""

    stored: Literal["redis", "spool", "dead_letter"]  # dead_letter: Redis refused it (Meter.dead), kept to retry
    counted: bool = False  # False for a duplicate event_id (already counted) or a spooled event
    day_cost_micro_usd: int | None = None
    month_cost_micro_usd: int | None = None
    levels: dict[str, tuple[int, int]] = field(default_factory=dict)  # "global" / "tag:k=v" → (day, month)

    @classmethod
    def of_reply(cls, event: UsageEvent, reply: list[int]) -> RecordResult:
        """From the script's reply (see ``RECORD_LUA``)."""
        if event.audit:
            return cls("redis", bool(reply[0]))
        levels = {"global": (int(reply[3]), int(reply[4]))}
        for j, (k, v) in enumerate(sorted(event.tags.items())):
            levels[f"tag:{k}={v}"] = (int(reply[5 + 2 * j]), int(reply[6 + 2 * j]))
        # None: a key part another writer completed (Redis Cluster, Meter._run_split): the key's spend not read
        day, month = (None, None) if reply[1] is None else (int(reply[1]), int(reply[2]))
        return cls("redis", bool(reply[0]), day, month, levels)


class Meter:
    """Writes usage events; reads counters and the event stream. One per process, shared by all requests."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, spool: Spool[UsageEvent], cfg: MeteringConfig) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.spool = spool
        self.cfg = cfg
        self._script = FastScript(handle, RECORD_LUA)
        self._audit = FastScript(handle, AUDIT_LUA)
        self._release = FastScript(handle, RELEASE_LUA)
        #: Redis Cluster with each key's own levels in its tenant slot: RECORD, AUDIT and RELEASE as three calls
        #: (``RECORD_SHARED_LUA``, ``RECORD_KEY_LUA``, ``FINISH_LUA``; see there)
        self.split = self.keys.per_key_slots
        self._shared = FastScript(handle, RECORD_SHARED_LUA)
        self._key_part = FastScript(handle, RECORD_KEY_LUA)
        self._finish = FastScript(handle, FINISH_LUA)
        self._cube_rewrite = FastScript(handle, CUBE_REWRITE_LUA)
        self._index_rewrite = FastScript(handle, INDEX_REWRITE_LUA)
        self._lane = handle.lane
        self.spooled = 0  # events written to the spool by this process (for metrics)
        #: what a replay must neither count nor drop (:meth:`_fresh`, :meth:`write_error`, a line no event can be read
        #: from): never sent, an operator decides
        self.quarantine = Quarantine(quarantine_path(spool.path))
        if spool.quarantine is None:  # its unreadable lines: kept there, not dropped by the drain's truncate
            spool.quarantine = self.quarantine
        #: events Redis refused with an error reply (the script undid itself: nothing of them written), kept
        #: beside the usage spool until a retry counts them (:meth:`retry_dead_letters`)
        self.dead = Spool(dead_letter_path(spool.path), spool.decode, self.quarantine)
        #: seconds until the next dead-letter retry (:meth:`run_dead_letters`): ``metering.dead_letter_interval_s``,
        #: doubled after each pass that counted none, up to :data:`DEAD_LETTER_MAX_INTERVAL_S`
        self.dead_retry_s = cfg.dead_letter_interval_s
        self._poison_logged: set[str] = set()  # event ids whose send raised, traceback logged (once each)
        self.dead_lettered = 0  # events this process put into the dead-letter spool (for metrics)
        self.unreplicated = 0  # counted events spooled as well: too few replicas acknowledged them (for metrics)
        #: counted events too few replicas acknowledged (``metering.replica_acks``, :meth:`_acked`), beside the usage
        #: spool: replayed only once the replicas answer again, so a shortfall neither holds back nor re-reads the
        #: events an outage spooled
        self.unacked = Spool(unacked_path(spool.path), spool.decode, self.quarantine)
        self._unreplicated_log = LogThrottle()  # a replica down would log every batch
        self._pending_refused_log = LogThrottle()  # the sweep runs every pass
        self._acks_short_until = float("-inf")  # after a shortfall, batches skip the WAIT until then (ACK_BACKOFF_S)
        # every event settles its request's write-ahead record (gateway/state/write_ahead.py) in the same script
        self._wal_key = self.keys.write_ahead if cfg.write_ahead else None
        #: request id → what its refused admission may have left (:meth:`left`), until its audit event's script
        #: answers; only this process knows it: an event another process replays (a restart) leaves them to their TTL
        self.leftovers: OrderedDict[str, Leftovers] = OrderedDict()

    # --- write path -------------------------------------------------------------------------------------
    def left(self, request_id: str, leftovers: Leftovers) -> None:
        """Note what the admission of ``request_id`` — refused, its reply lost — may have left (:class:`Leftovers`),
        for its audit event's write to take back (``AUDIT``'s ARGV 12 and 13). Kept until that write is answered, at
        most :data:`LEFTOVERS_MAX` (the oldest then go: left to their window and TTL)."""
        self.leftovers[request_id] = leftovers
        while len(self.leftovers) > LEFTOVERS_MAX:
            self.leftovers.popitem(last=False)

    async def record(self, event: UsageEvent) -> RecordResult:
        """Count ``event`` once in Redis (and settle its reservation), or spool it durably when Redis is down, or
        keep it in the dead-letter spool when Redis refuses it (an error reply: nothing of it was written).

        A write that fails any other way (neither an outage nor an error reply: a Redis Cluster client giving up
        on a slot in flux) is kept in the usage spool too (:meth:`_unexpected`). With ``metering.replica_acks``,
        a counted event that fewer replicas acknowledge is also kept in the spool (:meth:`_acked`). Raises
        ``OSError`` only when the event could not be written to Redis *and* the spool cannot be written (disk full).
        """
        return (await self._acked([event], [await self._record_one(event)]))[0]

    async def _record_one(self, event: UsageEvent) -> RecordResult:
        try:
            reply = await self.breaker.call(lambda: self._run(event))
        except RedisDown:
            return (await self._keep([event]))[0]
        except ResponseError as exc:
            return (await self._refused([(event, exc)]))[0]
        except Exception:  # neither an outage nor an error reply: see _unexpected
            return (await self._unexpected([event]))[0]
        return RecordResult.of_reply(event, reply)

    async def record_many(self, events: list[UsageEvent]) -> list[RecordResult]:
        """:meth:`record` for several events in one Redis round trip (a pipeline of ``RECORD`` scripts).

        All or nothing on an outage: if the pipeline fails, every event of the batch is spooled (with one
        fsync); events whose script did run before the failure are dropped by ``event_id`` on replay. An event
        whose script answered an error reply (and so wrote nothing, see ``UNDO_LUA``) goes to the dead-letter spool
        (or the usage spool, for a Redis that cannot write now: :data:`TRANSIENT_REPLIES`); the other events of the
        batch stay counted. Raises like :meth:`record`.
        """
        if len(events) <= 1:
            results = [await self._record_one(e) for e in events]
        elif not isinstance(self.redis, Redis):
            # Redis Cluster: no pipeline of scripts across slots — each event's calls on their own, CLUSTER_WRITERS
            # events at a time (independent: each is counted once by its id whatever the order)
            results = []
            for i in range(0, len(events), CLUSTER_WRITERS):
                results += await asyncio.gather(*(self._record_one(e) for e in events[i:i + CLUSTER_WRITERS]))
        else:
            results = await self._record_many(events)
        return await self._acked(events, results)

    async def _record_many(self, events: list[UsageEvent]) -> list[RecordResult]:
        try:
            replies = await self.breaker.call(lambda: self._run_many(events))
        except RedisDown:
            return await self._keep(events)
        except Exception:  # neither an outage nor an error reply: see _unexpected
            return await self._unexpected(events)
        refused = [(e, r) for e, r in zip(events, replies, strict=True) if isinstance(r, ResponseError)]
        if not refused:
            return [RecordResult.of_reply(e, r) for e, r in zip(events, replies, strict=True)]
        kept = iter(await self._refused(refused))
        return [next(kept) if isinstance(r, ResponseError) else RecordResult.of_reply(e, r)
                for e, r in zip(events, replies, strict=True)]

    async def _acked(self, events: list[UsageEvent], results: list[RecordResult]) -> list[RecordResult]:
        """With ``metering.replica_acks`` = N > 0: the events counted in Redis are also kept in the usage spool
        unless N replicas acknowledge them within ``replica_ack_timeout_ms`` (:meth:`replica_acks`).

        Why: Redis replicates asynchronously. A master that crashes (SIGKILL, a lost host) before its replicas
        have a write loses it in the failover, though it answered "counted" — and the writer had let the event
        go. Kept in the spool, it is replayed: dropped by ``event_id`` where it survived, counted where the
        failover lost it; the replay itself is let go only once N replicas have it. The results are unchanged
        (the events were counted; budgets and alerts read them as such)."""
        want = self.cfg.replica_acks
        counted = [e for e, r in zip(events, results, strict=True) if r.stored == "redis"] if want else []
        if not counted:
            return results
        now = time.monotonic()
        # After a shortfall the next batches go straight to the spool for ACK_BACKOFF_S: a replica that is down
        # would otherwise hold every batch for the whole WAIT and cap the writer at batch / timeout events a second.
        if now >= self._acks_short_until:
            if await self.replica_acks() >= want:
                return results
            self._acks_short_until = time.monotonic() + ACK_BACKOFF_S
        await self.unacked.append(counted)
        self.unreplicated += len(counted)
        if (held := self._unreplicated_log.due()) is not None:
            log.warning("usage events not acknowledged by %d Redis replica(s) within %d ms (metering.replica_acks): "
                        "%d kept in %s as well, %d so far; replayed once the replicas have them%s",
                        want, self.cfg.replica_ack_timeout_ms, len(counted), self.unacked.path, self.unreplicated,
                        held_back(held))
        return results

    async def replica_acks(self) -> int:
        """How many replicas hold every metering write made so far (the usage keys share one slot, so one master;
        under ``tenant`` placement every master, :meth:`_probes`, and the fewest of them counts): a probe write
        (``p usage:replica:probe``), then ``WAIT replica_acks replica_ack_timeout_ms`` on the same connection. WAIT
        counts the replicas past *its connection's* last write; the probe makes that write later than every event
        this process had counted (on the lane or another connection), and the master's replication stream is one
        ordered log. 0 when it cannot tell (an outage, a refusal, a slot in flux, a
        WAIT longer than ``redis.socket_timeout_s``).

        Not through the breaker: a replica that is slow to acknowledge says nothing about the master, and a read
        timeout here opened the breaker — the whole gateway in its Redis-down mode because of one lagging replica.
        An open breaker still answers 0 without asking."""
        probe, n, t = self.keys.replica_probe, self.cfg.replica_acks, self.cfg.replica_ack_timeout_ms
        if self.breaker.is_open:
            return 0
        try:
            if isinstance(self.redis, Redis):
                async with self.redis.pipeline(transaction=False) as pipe:  # one connection to the master
                    pipe.set(probe, b"1", px=PROBE_TTL_MS)
                    pipe.execute_command("WAIT", n, t)
                    replies = await pipe.execute()
            else:
                await self.redis.initialize()  # a no-op once done; the slot map is read at the first command
                probes = self._probes(self.redis, probe)
                async with self.redis.pipeline() as cpipe:  # a cluster pipeline: one connection per node, in order
                    for key, node in probes:
                        # both to that node: were the slot map to change between the lookup and the send, a SET
                        # routed by key would leave the WAIT on a connection without a write, which answers at once
                        cpipe.execute_command("SET", key, b"1", "PX", PROBE_TTL_MS, target_nodes=node)
                        cpipe.execute_command("WAIT", n, t, target_nodes=node)  # not where redis-py sends it
                    replies = await cpipe.execute()
                return min(int(r) for r in replies[1::2])  # the nodes' WAITs run at once: one timeout at most
            return int(replies[1])
        except Exception as exc:  # any failure means "not known to be replicated": keep the events
            log.debug("replica acknowledgement unknown: %r", exc)
            return 0

    def _probes(self, cluster: RedisCluster, probe: str) -> list[tuple[str, ClusterNode]]:
        """The replica probes of a Redis Cluster: ``(key, node)``. The shared slot's master alone — unless each key's
        own levels are in its tenant slot (:attr:`split`): a key part is then written on whichever master serves the
        key's slot, so one probe on every master (a key of a tenant slot it serves: ``RedisKeys.replica_probe_at``).
        A master that lost a key part in a failover while the shared part survived would otherwise have answered
        "acknowledged" for it, and nothing would have kept the event for a replay."""
        node = cluster.get_node_from_key(probe)
        assert node is not None  # the slot map is read (initialize)
        if not self.split:
            return [(probe, node)]
        out, want = [(probe, node)], {n.name for n in cluster.get_primaries()} - {node.name}
        for i in range(PROBE_SEARCH):
            if not want:
                break
            key = self.keys.replica_probe_at(f"probe{i}")
            node = cluster.get_node_from_key(key)
            if node is not None and node.name in want:
                want.discard(node.name)
                out.append((key, node))
        return out

    async def _keep(self, events: list[UsageEvent]) -> list[RecordResult]:
        """``events`` into the usage spool (one fsync), replayed once Redis takes writes again."""
        await self.spool.append(events)
        self.spooled += len(events)
        return [RecordResult("spool") for _ in events]

    async def _unexpected(self, events: list[UsageEvent]) -> list[RecordResult]:
        """Keep ``events`` whose write raised neither an outage error nor an error reply — e.g. a Redis Cluster
        client error while the slot map changes under a failover. The caller used to log such an exception and
        drop the batch ("the events are in Redis or a spool" did not hold), and on a Cluster, where a batch is
        written event by event, the rest of the batch with it. They go to the usage spool: whatever part of them
        reached Redis is dropped by ``event_id`` on replay, and the replayer retries a write that fails again."""
        log.exception("usage write failed for events %s; kept in the usage spool %s",
                      ", ".join(e.event_id for e in events), self.spool.path)
        return await self._keep(events)

    async def _refused(self, refused: list[tuple[UsageEvent, ResponseError]]) -> list[RecordResult]:
        """Keep events Redis answered with an error reply: in the usage spool when the error is transient
        (:func:`transient`), else in the dead-letter spool (one ERROR line per error, naming the key)."""
        later = [e for e, exc in refused if transient(exc)]
        dead = [(e, exc) for e, exc in refused if not transient(exc)]
        if later:
            await self._keep(later)
        if dead:
            await self._dead_letter(dead)
        return [RecordResult("spool" if transient(exc) else "dead_letter") for _, exc in refused]

    async def _dead_letter(self, dead: Sequence[tuple[UsageEvent, Exception]]) -> None:
        await self.dead.append([e for e, _ in dead])
        self.dead_lettered += len(dead)
        by_error: dict[str, list[str]] = {}
        for event, exc in dead:
            by_error.setdefault(str(exc), []).append(event.event_id)
        for error, ids in by_error.items():
            log.error("usage events %s refused by Redis, kept in the dead-letter spool %s and sent again from "
                      "every %.0f s, backing off to every %.0f s while refused (fix or delete the key it names; they "
                      "count once then): %s", ", ".join(ids), self.dead.path, self.cfg.dead_letter_interval_s,
                      DEAD_LETTER_MAX_INTERVAL_S, error)

    async def _run_many(self, events: list[UsageEvent]) -> list[Any]:
        """The batch's replies in order: an error reply as its ``ResponseError``. Raises an outage error (or any
        exception that is no error reply) for the breaker."""
        for attempt in range(2):
            replies = await self._lane_many(events) if self._lane is not None else None
            if replies is None:  # Sentinel/standalone with the lane busy: redis-py's pipeline
                async with self.redis.pipeline(transaction=False) as pipe:
                    for event in events:
                        keys, args = self._keys_args(event)
                        sha = self._audit.sha if event.audit else self._script.sha
                        pipe.evalsha(sha, len(keys), *keys, *args)
                    replies = await pipe.execute(raise_on_error=False)
            missing = any(isinstance(r, NoScriptError) for r in replies)
            if missing and attempt == 0:  # script cache flushed (restart, SCRIPT FLUSH): load it, send again
                await self.redis.script_load(RECORD_LUA)
                await self.redis.script_load(AUDIT_LUA)
                continue  # safe: events already counted are dropped by event_id
            for r in replies:  # an outage (CLUSTERDOWN, MASTERDOWN…), or anything not an error reply, is raised
                if isinstance(r, Exception) and (is_outage(r) or not isinstance(r, ResponseError)):
                    raise r
            for event, r in zip(events, replies, strict=True):
                if event.audit and not isinstance(r, Exception):
                    self.leftovers.pop(event.event_id, None)  # taken back (or never there): written
            return list(replies)
        raise AssertionError("unreachable")

    async def _lane_many(self, events: list[UsageEvent]) -> list[Any] | None:
        """The batch's ``RECORD``/``AUDIT`` calls as one packed buffer on the lane (a pipeline without redis-py's
        per-command packing); None when the lane is busy."""
        assert self._lane is not None
        parts = []
        for event in events:
            keys, args = self._keys_args(event)
            parts.append((self._audit if event.audit else self._script).packed(keys, args))
        return await self._lane.exchange(b"".join(parts), len(events), coalesce="background")

    async def _run(self, event: UsageEvent, replay: bool = False) -> list[Any]:
        if self.split:
            # a refused request of a key settles what an admission under its id may have left (AUDIT_LUA's why): the
            # calls of a dead process's unsent one ('x'), without its claim — not its RPM count (Leftovers)
            release = event.event_id if event.audit and event.key_id else None
            reply = await self._run_split(event, release=release, replay=replay)
        else:
            keys, args = self._keys_args(event)  # off the request path: with the cache's stores of the same pass
            reply = await (self._audit if event.audit else self._script)(keys=keys, args=args, coalesce="background")
        if event.audit:
            self.leftovers.pop(event.event_id, None)  # taken back (or never there): written
        return reply

    async def _run_split(self, event: UsageEvent, owner_heartbeat: str | None = None,
                         release: str | None = None, replay: bool = False) -> list[Any]:
        """RECORD (AUDIT for an audit event; RELEASE with ``release``, the request id of an unsent call — a dead
        process's, or a refused request of a key, :meth:`_run`) as its three calls on a Cluster whose keys' own
        levels are in their tenant slots (``RECORD_SHARED_LUA``, above). Answers RECORD's reply (the key's costs
        None when another writer completed its key part), or ``[-1]`` when the claim of ``owner_heartbeat``'s record
        failed. Raises what a call raises: the calls before it stay done and the next try (a replay, the reconciler,
        :meth:`finish_pending`) completes the rest.

        ``replay`` (a spooled, unacknowledged or dead-lettered event sent again): when the shared part is counted
        and nothing is pending, the key part is sent anyway — once by id in the key's own seen-set, so it counts
        only where a failover lost it while the shared part and the finish survived (the key's master died before
        its replicas had it: ``metering.replica_acks`` keeps such an event, :meth:`_probes`). A replayed event is
        within the dedup window (:meth:`_fresh`), which the key's seen-set lives at least as long as."""
        k = self.keys
        day, rid = event.day, release or event.event_id
        mode = "x" if release else ("a" if event.audit else "r")
        tags = [] if event.audit and not release else sorted(event.tags.items())
        settles_wal = self._wal_key is not None or owner_heartbeat is not None or mode == "x"
        wal = k.write_ahead if settles_wal and mode != "a" else None
        ts_ms, late_ms = int(event.ts * 1000), int(self.cfg.late_after_s * 1000)
        # the key part's call: stored as it is sent (the sweep and a second writer send exactly this)
        part_keys = [k.key_seen(event.key_id, day), k.key_total(event.key_id), k.key_day(event.key_id, day),
                     k.key_month(event.key_id, event.month), k.reservations(event.key_id),
                     k.tpm(event.key_id, event.minute), k.agg_cube(event.key_id, day)]
        pairs: list[str | int] = _increment_pairs(event) if mode == "r" else ["refused", 1]
        part_args: list[str | int] = [event.event_id, "" if mode == "a" else rid,
                                      {"r": "d", "x": "b"}.get(mode, ""), event.upstream_tokens, TPM_TTL_MS,
                                      self.cfg.dedup_ttl_s, DAY_TTL_S, MONTH_TTL_S, cell_of(event),
                                      "k" if mode == "r" else "c", *pairs]
        pending = orjson.dumps({"k": part_keys, "a": part_args, "t": int(time.time() * 1000), "r": rid,
                                "w": wal or "", "d": day})
        keys = [k.seen(day), k.events, k.tier_total(event.tier or UNROUTED), k.tier_day(event.tier or UNROUTED, day),
                k.usage_keys, k.level_day("global", "global", day), k.level_month("global", "global", event.month),
                k.level_reservations("global", "global"), k.agg_index, k.agg_day_keys(day), k.late_events, k.pending]
        for tag_name, tag_value in tags:
            tag = f"{tag_name}={tag_value}"
            keys += [k.level_day("tag", tag, day), k.level_month("tag", tag, event.month),
                     k.level_reservations("tag", tag)]
        if owner_heartbeat is not None:
            keys += [k.write_ahead, owner_heartbeat]
        args: list[str | bytes | int] = [
            event.event_id, event.to_json(), self.cfg.dedup_ttl_s, DAY_TTL_S, MONTH_TTL_S,
            self.cfg.stream_maxlen or 0, event.key_id, 0 if mode != "r" else event.cost_micro_usd, len(tags), day,
            ts_ms, late_ms, pending, mode, rid]
        if mode == "r":  # the same pairs: the shared part skips the cube-only ones
            args += pairs
        reply = list(await self._shared(keys=keys, args=args, coalesce="background"))
        if int(reply[0]) == -1:
            return [-1]
        key_costs: list[Any] = [None, None]
        stored = as_bytes(reply[1]) if reply[1] else b""
        if stored:
            key_costs = (await self._complete(stored))[1:]
        elif replay and not int(reply[0]):
            key_costs = (await self._complete(pending))[1:]
        elif owner_heartbeat is not None and not int(reply[0]):
            # the claim held, but the request was counted already and nothing is pending: its record is a stale copy.
            # Deleted here (one server's RECORD deletes it in its script), or every reconcile pass claimed it again
            await self._finish(keys=[k.pending, k.write_ahead], args=[event.event_id, rid], coalesce="background")
        return [int(reply[0]), *key_costs, *reply[2:]]

    async def _complete(self, stored: bytes) -> list[int]:
        """Run a pending key part (``stored``: its JSON in ``usage:pending``) and finish it: its write-ahead record and
        the pending entry deleted. Answers the key part's reply ``[counted, key day cost, key month cost]``."""
        call = orjson.loads(stored)
        reply = list(await self._key_part(keys=call["k"], args=call["a"], coalesce="background"))
        finish_keys = [self.keys.pending, *([call["w"]] if call["w"] else [])]
        await self._finish(keys=finish_keys, args=[call["a"][0], call["r"]], coalesce="background")
        return [int(x) for x in reply]

    async def finish_pending(self, now: float | None = None) -> int:
        """Complete the key parts left pending longer than :data:`PENDING_SWEEP_S` (their writer died or lost Redis
        between the calls of :meth:`_run_split`; at most :data:`PENDING_SWEEP_MAX` a pass). Only where
        :attr:`split`; run by :meth:`run_replayer`. Returns how many it completed. Raises :class:`RedisDown`, or the
        ``ResponseError`` of a key part Redis refused (the others of the pass are done first)."""
        if not self.split:
            return 0
        now_ms = int((time.time() if now is None else now) * 1000)
        cursor, done, refused = 0, 0, None
        while done < PENDING_SWEEP_MAX:
            cursor, entries = await self.breaker.call(
                functools.partial(self.redis.hscan, self.keys.pending, cursor, count=200))
            for raw in (entries.values() if isinstance(entries, dict) else entries[1::2]):
                if done >= PENDING_SWEEP_MAX:
                    break
                if int(orjson.loads(raw).get("t", 0)) > now_ms - PENDING_SWEEP_S * 1000:
                    continue
                try:
                    await self.breaker.call(functools.partial(self._complete, as_bytes(raw)))
                    done += 1
                except ResponseError as exc:
                    refused = refused or exc
            if not cursor:
                break
        if refused is not None:
            raise refused
        return done

    async def record_direct(self, event: UsageEvent) -> RecordResult:
        """Count ``event`` once through the metering script (``RECORD``; ``AUDIT`` for an audit event) — the writer's
        own step: stream, counters, cube, budget levels — and nothing else: never spooled, never dead-lettered. For
        ``thinkgate usage quarantine --settle`` (``gateway/state/quarantine.py``), which keeps the quarantine line
        itself when this raises. ``counted`` False: its id was in its day's seen-set (counted already). Raises
        :class:`RedisDown`, or ``ResponseError`` (Redis refused it; the script wrote nothing)."""
        reply = await self.breaker.call(lambda: self._run(event))
        return RecordResult.of_reply(event, reply)

    async def settle_orphan(self, event: UsageEvent, owner_heartbeat: str) -> RecordResult:
        """Count ``event`` — built from the write-ahead record of a process that died — only if that record is still
        open and its owner's heartbeat key ``owner_heartbeat`` still absent, atomically with deleting the record
        (the claim: two replicas reconciling at once count it once; a request settled normally is never counted
        again). Never spooled: the record stays in Redis for the next pass. Raises :class:`RedisDown`."""
        if self.split:
            reply = await self.breaker.call(functools.partial(self._run_split, event, owner_heartbeat))
            if reply == [-1]:  # not claimed: as RECORD's {0, 0, …}
                reply = [0, 0, 0, 0, 0, *([0, 0] * len(event.tags))]
            return RecordResult.of_reply(event, reply)
        keys, args = self._keys_args(event)
        if self._wal_key is None:  # write-ahead off here: the record may still be one another replica wrote
            keys.append(self.keys.write_ahead)
        keys.append(owner_heartbeat)
        reply = await self.breaker.call(lambda: self._script(keys=keys, args=args))
        return RecordResult.of_reply(event, reply)

    async def release_orphan(self, event: UsageEvent, owner_heartbeat: str) -> bool:
        """Settle the write-ahead record of a dead process's request that was never sent upstream, under the same
        claim as :meth:`settle_orphan`: its reservations released at every level and ``event`` — its audit event
        (``audit``; ``request_id`` the request's, ``event_id`` its own) — in the stream and the cube like any audit
        event, nothing counted (``RELEASE_LUA``). True when this call released it. Raises :class:`RedisDown`."""
        assert event.audit and event.event_id != event.request_id  # the request's own id must stay free
        if self.split:
            reply = await self.breaker.call(functools.partial(self._run_split, event, owner_heartbeat,
                                                              event.request_id))
            return reply != [-1]
        k = self.keys
        audit_keys, audit_args = self._audit_keys_args(event)
        # RELEASE_LUA numbers its KEYS and ARGV after AUDIT's: a change of that layout must change it too
        assert len(audit_keys) == 6 and len(audit_args) == 10, "RELEASE_LUA's KEYS/ARGV follow AUDIT's layout"
        keys = [*audit_keys, k.write_ahead, owner_heartbeat, k.reservations(event.key_id),
                k.tpm(event.key_id, event.minute), k.level_reservations("global", "global"),
                *(k.level_reservations("tag", f"{n}={v}") for n, v in sorted(event.tags.items()))]
        args = [*audit_args, event.request_id, TPM_TTL_MS]
        return bool(await self.breaker.call(lambda: self._release(keys=keys, args=args)))

    def _audit_keys_args(self, event: UsageEvent) -> tuple[list[str], list[str | bytes | int]]:
        """``AUDIT``'s KEYS and ARGV for ``event`` (an audit event) alone: the stream, the cube, the index."""
        k = self.keys
        day = event.day
        ts_ms, late_ms = int(event.ts * 1000), int(self.cfg.late_after_s * 1000)
        return ([k.seen(day), k.events, k.agg_cube(event.key_id, day), k.agg_index, k.agg_day_keys(day),
                 k.late_events],
                [event.event_id, event.to_json(), self.cfg.dedup_ttl_s, self.cfg.stream_maxlen or 0, day,
                 cell_of(event), event.key_id, DAY_TTL_S, ts_ms, late_ms])

    def _keys_args(self, event: UsageEvent) -> tuple[list[str], list[str | bytes | int]]:
        k = self.keys
        day = event.day
        cube = [k.agg_cube(event.key_id, day), k.agg_index, k.agg_day_keys(day)]
        ts_ms, late_ms = int(event.ts * 1000), int(self.cfg.late_after_s * 1000)
        if event.audit:
            audit_keys, audit_args = self._audit_keys_args(event)
            if not event.key_id:  # no key (401): never admitted, nothing to settle
                return audit_keys, audit_args
            # a refused request of a key: what an admission under its id may have left is settled with it
            # (AUDIT_LUA's trailing KEYS; its write-ahead record whatever this process's metering.write_ahead says:
            # the record may be one another replica wrote, as for settle_orphan)
            # and, known to the process that refused it (Meter.left), the RPM count and single-flight lock of an
            # admission whose reply was lost
            rpm = k.rpm(event.key_id, event.minute)
            left = self.leftovers.get(event.event_id) or Leftovers()
            locked = bool(left.lock and left.token)
            audit_keys += [k.write_ahead, k.reservations(event.key_id), k.tpm(event.key_id, event.minute), rpm,
                           left.lock if locked else rpm,  # the lock, else any key of the call's slot
                           k.level_reservations("global", "global"),
                           *(k.level_reservations("tag", f"{n}={v}") for n, v in sorted(event.tags.items()))]
            return audit_keys, [*audit_args, TPM_TTL_MS, 1 if left.rpm else 0, left.token if locked else ""]
        tier = event.tier or UNROUTED
        keys = [
            k.seen(day),
            k.events,
            k.key_total(event.key_id),
            k.key_day(event.key_id, day),
            k.key_month(event.key_id, event.month),
            k.tier_total(tier),
            k.tier_day(tier, day),
            k.usage_keys,
            k.reservations(event.key_id),
            k.tpm(event.key_id, event.minute),
            k.level_day("global", "global", day),
            k.level_month("global", "global", event.month),
            k.level_reservations("global", "global"),
            *cube,
        ]
        tags = sorted(event.tags.items())
        for tag_name, tag_value in tags:
            tag = f"{tag_name}={tag_value}"
            keys += [k.level_day("tag", tag, day), k.level_month("tag", tag, event.month),
                     k.level_reservations("tag", tag)]
        keys.append(k.late_events)
        if self._wal_key is not None:
            keys.append(self._wal_key)
        args: list[str | bytes | int] = [
            event.event_id,
            event.to_json(),
            self.cfg.dedup_ttl_s,
            DAY_TTL_S,
            MONTH_TTL_S,
            self.cfg.stream_maxlen or 0,
            event.key_id,
            event.upstream_tokens,
            TPM_TTL_MS,
            event.cost_micro_usd,
            len(tags),
            day,
            cell_of(event),
            ts_ms,
            late_ms,
        ]
        return keys, [*args, *_increment_pairs(event)]

    async def _record_batch(self, events: list[UsageEvent]) -> None:
        """The usage spool replay's sink: an event Redis refuses goes to the dead-letter spool, so one bad event
        never holds the spool back; a transient refusal (:func:`transient`) raises (the spool is kept for the next
        try). With ``metering.replica_acks``, the events it counted that too few replicas acknowledge move to
        :attr:`unacked` (see :meth:`_acked`): the usage spool is let go once its spend is in Redis — admission
        waits for that (``Accounting._replay_before_admitting``), and a spool kept for the replicas held every
        request for the wait. Events past the dedup window are set aside first (:meth:`_fresh`)."""
        await self._keep_unreplicated(await self._send_replayed(await self._fresh(events, self.spool.path)))

    async def _keep_unreplicated(self, counted: list[UsageEvent]) -> bool:
        """With ``metering.replica_acks``: ``counted`` (events a replay just counted in Redis, before its file lets
        them go) kept in :attr:`unacked` too when too few replicas acknowledge them — a failover that lost them would
        otherwise lose them for good. Used by the usage spool's replay and the dead-letter retry. Returns whether
        they were kept."""
        if counted and self.cfg.replica_acks and await self.replica_acks() < self.cfg.replica_acks:
            await self.unacked.append(counted)
            self.unreplicated += len(counted)
            return True
        return False

    async def _record_unacked(self, events: list[UsageEvent]) -> None:
        """The sink of :attr:`unacked`'s replay: sent again (dropped by ``event_id`` where they survived), and the
        file let go only once the replicas hold what it counted; raises :class:`RedisDown` (the file kept) when they
        do not. Events past the dedup window are set aside first (:meth:`_fresh`)."""
        await self._send_replayed(await self._fresh(events, self.unacked.path))
        if await self.replica_acks() < self.cfg.replica_acks:
            raise RedisDown(f"fewer than {self.cfg.replica_acks} Redis replica(s) acknowledged the replayed usage "
                            "events (metering.replica_acks): kept")

    async def _fresh(self, events: list[UsageEvent], source: Path) -> list[UsageEvent]:
        """``events`` less those past the dedup window (:func:`past_dedup_window`), which go to the quarantine file
        (:attr:`quarantine`, reason ``past_dedup_window``) with one WARNING line per batch. Why: the seen-set that
        drops a replayed event already counted lives ``metering.dedup_ttl_s`` after the day's last event; an event
        kept longer than that (a spool, the unacked file, a dead letter whose key was fixed late) may have been
        counted and forgotten, and would be counted twice — or lost by a failover and never counted: which, only
        the stream can tell, so neither is done for it. Raises ``OSError`` when the quarantine cannot be written
        (the events stay where they were: the caller's file is kept)."""
        now = time.time()
        stale = {id(e) for e in events if past_dedup_window(e, self.cfg.dedup_ttl_s, now)}
        if not stale:
            return events
        old = [e for e in events if id(e) in stale]
        detail = (f"ts older than metering.dedup_ttl_s ({self.cfg.dedup_ttl_s} s) less {SEEN_MARGIN_S} s: its "
                  "event_id may have left the seen-set, so a replay could count it twice; not sent")
        if await self.quarantine.append([quarantined("past_dedup_window", detail, source, e.to_dict()) for e in old]):
            log.warning("usage events %s in %s are older than metering.dedup_ttl_s (%d s) less %d s: not sent (their "
                        "ids may have left the seen-sets, a replay could count them twice), kept in %s: settle them "
                        "with thinkgate usage quarantine (counts the ones absent from the stream, once)",
                        ", ".join(e.event_id for e in old), source, self.cfg.dedup_ttl_s, SEEN_MARGIN_S,
                        self.quarantine.path)
        return [e for e in events if id(e) not in stale]

    async def _send_replayed(self, events: list[UsageEvent]) -> list[UsageEvent]:
        """Send replayed ``events``; the refused ones go to the dead-letter spool (a transient refusal raises: the
        spool is kept). Returns the others (counted now, or already). Raises :class:`RedisDown`."""
        refused: Sequence[tuple[UsageEvent, Exception]]
        try:
            refused = await self._send(events)
        except (RedisDown, ResponseError):
            raise
        except Exception:  # neither an outage nor an error reply: find the events that raise it (_one_by_one)
            refused = await self._one_by_one(events)
        for _, exc in refused:
            if transient(exc):
                raise exc
        if refused:
            await self._dead_letter(refused)
        out = {id(e) for e, _ in refused}
        return [e for e in events if id(e) not in out]

    async def _one_by_one(self, events: list[UsageEvent]) -> list[tuple[UsageEvent, Exception]]:
        """A replayed batch that raised neither an outage nor an error reply, sent again one event at a time: the
        events that raise again are returned with the exception, for the dead-letter spool. Before, one such event
        (a client-side encoding error, a bug building its keys) raised on every pass and the drain kept the whole
        spool — nothing an outage had spooled was ever counted. A Cluster error that passes (a slot settled) just
        sends the rest. Raises :class:`RedisDown`."""
        stuck: list[tuple[UsageEvent, Exception]] = []
        for event in events:
            try:
                stuck.extend(await self._send([event]))
            except (RedisDown, ResponseError):
                raise
            except Exception as exc:
                stuck.append((event, exc))
        return stuck

    async def _send(self, events: list[UsageEvent]) -> list[tuple[UsageEvent, ResponseError]]:
        """Send ``events`` (pipelines of :data:`REPLAY_PIPELINE`); the ones Redis refused, with its error reply.
        Raises :class:`RedisDown`."""
        refused: list[tuple[UsageEvent, ResponseError]] = []
        if not isinstance(self.redis, Redis):
            for event in events:
                try:
                    await self.breaker.call(functools.partial(self._run, event, replay=True))
                except ResponseError as exc:
                    refused.append((event, exc))
            return refused
        for i in range(0, len(events), REPLAY_PIPELINE):  # a few round trips instead of one per event
            chunk = events[i : i + REPLAY_PIPELINE]
            replies = await self.breaker.call(functools.partial(self._run_many, chunk))
            refused += [(e, r) for e, r in zip(chunk, replies, strict=True) if isinstance(r, ResponseError)]
        return refused

    async def replay(self) -> int:
        """Send the spool to Redis; returns the number of records sent (0 when empty or Redis is down). With
        ``metering.replica_acks``, the events it counted that too few replicas acknowledge move to :attr:`unacked`;
        then that file is sent — only when the replicas answer now: while they do not, it is neither read nor
        sent."""
        sent = await self.spool.replay(self._record_batch, "usage")
        if self.split:
            try:
                if n := await self.finish_pending():
                    log.warning("completed %d usage event(s) whose writer stopped between the shared and the key "
                                "part (Redis Cluster, usage:pending)", n)
            except RedisDown:
                return sent
            except ResponseError as exc:
                if (held := self._pending_refused_log.due()) is not None:
                    log.error("a pending key part was refused by Redis (kept in usage:pending, tried again every "
                              "pass; fix or delete the key it names)%s: %s", held_back(held), exc)
        if (self.cfg.replica_acks and self.unacked.pending_bytes()
                and await self.replica_acks() >= self.cfg.replica_acks):
            sent += await self.unacked.replay(self._record_unacked, "unreplicated usage")
        return sent

    async def run_replayer(self, stop: asyncio.Event) -> None:
        """Replay the spool every ``replay_interval_s`` seconds until ``stop`` is set (a background task)."""
        await self.spool.run_replayer(self.replay, stop, self.cfg.replay_interval_s, "usage")

    async def retry_dead_letters(self) -> tuple[int, int]:
        """Send the dead-letter spool to Redis again: the events it now takes are counted (once: by ``event_id``),
        the ones it still refuses stay. The oldest :data:`DEAD_LETTER_PROBE` go first: when Redis refuses every
        one of them the rest is not sent (nor parsed, nor the file rewritten) — a key still broken under an hour of
        traffic held hundreds of thousands, all sent again every pass while the spool's lock held back the
        writer's own dead letters.

        Set aside in the quarantine file, never sent: events past the dedup window (:meth:`_fresh`), events whose
        write cannot be built (:meth:`_malformed`: sent again they only raised again, with a traceback every pass)
        and lines no event can be read from. An event whose send raises anything but an error reply stays, its
        traceback logged once (:meth:`_send_dead`). Sets :attr:`dead_retry_s` (doubled when none was counted).
        Returns ``(sent, still kept)`` (a refused probe: its size, twice); ``(0, 0)`` when empty or Redis is down.
        Raises ``OSError`` when the file (or the quarantine) cannot be read or written."""
        errors: list[str] = []
        unreplicated: set[str] = set()  # kept in the unacked file this pass (the probe's events are sent twice)

        async def sink(events: list[UsageEvent]) -> list[UsageEvent]:
            events = await self._malformed(await self._fresh(events, self.dead.path))
            kept = await self._send_dead(events)
            errors.extend(str(exc) for _, exc in kept[:1])
            still = {id(e) for e, _ in kept}
            counted = [e for e in events if id(e) not in still and e.event_id not in unreplicated]
            if await self._keep_unreplicated(counted):
                unreplicated.update(e.event_id for e in counted)
            return [e for e, _ in kept]

        if self.dead.pending_bytes() == 0:
            self.dead_retry_s = self.cfg.dead_letter_interval_s
            return 0, 0
        try:
            probe = await asyncio.to_thread(self.dead.head, DEAD_LETTER_PROBE)
            # one set aside (past the dedup window, malformed) is no refusal: the whole pass below goes on
            if probe and len(await sink(probe)) == len(probe):
                self._backoff(stuck=True)
                log.warning("dead-letter spool: still refused by Redis (the oldest %d usage events tried, the rest "
                            "kept), next try in %.0f s: %s", len(probe), self.dead_retry_s,
                            errors[0] if errors else "?")
                return len(probe), len(probe)
            sent, kept = await self.dead.drain_keeping(sink)  # the probe's counted ones are dropped by event_id
        except RedisDown:
            self._backoff(stuck=False)  # tried again as soon as it answers
            return 0, 0
        self._backoff(stuck=bool(kept) and kept >= sent)
        if sent > kept:
            log.info("dead-letter spool: %d usage events counted (or already counted, or set aside)", sent - kept)
        if kept:
            log.warning("dead-letter spool: %d usage events still not counted, next try in %.0f s: %s", kept,
                        self.dead_retry_s, errors[-1] if errors else "?")
        return sent, kept

    def _backoff(self, stuck: bool) -> None:
        """The next dead-letter wait (:attr:`dead_retry_s`): doubled after a pass that counted none of what it kept
        (``stuck``), up to :data:`DEAD_LETTER_MAX_INTERVAL_S`; back to ``metering.dead_letter_interval_s`` once
        one was counted or the file is empty — a fixed key is then drained at once."""
        base = self.cfg.dead_letter_interval_s
        self.dead_retry_s = min(max(self.dead_retry_s, base) * 2, max(base, DEAD_LETTER_MAX_INTERVAL_S)) if stuck \
            else base

    async def _malformed(self, events: list[UsageEvent]) -> list[UsageEvent]:
        """``events`` less those whose write cannot be built (:meth:`write_error`), which go to the quarantine file
        (reason ``malformed``) with one ERROR line per batch, the first one's traceback with it. Beyond repair: the
        keys and arguments come from the event alone (a ``ts`` that is no number names no day), so a retry raises
        the same way for ever — the event is kept for a person, never dropped. Raises ``OSError`` (quarantine)."""
        bad = [(e, exc) for e in events if (exc := self.write_error(e)) is not None]
        if not bad:
            return events
        detail = "its write cannot be built (sent again it would only raise again): {}"
        if await self.quarantine.append([quarantined("malformed", detail.format(repr(exc)), self.dead.path,
                                                     e.to_dict()) for e, exc in bad]):
            log.error("usage events %s in %s cannot be written at all (%r): kept in %s, not sent again",
                      ", ".join(e.event_id for e, _ in bad), self.dead.path, bad[0][1], self.quarantine.path,
                      exc_info=bad[0][1])
        out = {id(e) for e, _ in bad}
        return [e for e in events if id(e) not in out]

    def write_error(self, event: UsageEvent) -> Exception | None:
        """The exception building ``event``'s script call raises (its keys, arguments and the packed command: local
        work, the same every time), or None when it can be sent. Also asked by ``thinkgate usage quarantine``
        (``gateway/state/quarantine.py``): such an event cannot be settled either."""
        try:
            keys, args = self._keys_args(event)
            (self._audit if event.audit else self._script).packed(keys, args)
        except Exception as exc:
            return exc
        return None

    async def _send_dead(self, events: list[UsageEvent]) -> list[tuple[UsageEvent, Exception]]:
        """Send dead letters; the ones still not counted, with why: Redis's error reply, or the exception their send
        raised (sent one by one, :meth:`_one_by_one`) — its traceback logged the first time each event raises
        (:attr:`_poison_logged`), a retry's only in the pass's one WARNING line. Raises :class:`RedisDown`."""
        try:
            return list(await self._send(events))
        except (RedisDown, ResponseError):
            raise
        except Exception:  # neither an outage nor an error reply: find the events that raise it
            stuck = await self._one_by_one(events)
        for event, exc in stuck:
            if isinstance(exc, ResponseError) or event.event_id in self._poison_logged:
                continue
            if len(self._poison_logged) >= POISON_MEMORY:
                self._poison_logged.clear()
            self._poison_logged.add(event.event_id)
            log.error("dead-letter spool: sending usage event %s raised (kept, retried with backoff; logged once)",
                      event.event_id, exc_info=exc)
        return stuck

    async def run_dead_letters(self, stop: asyncio.Event) -> None:
        """Retry the dead-letter spool until ``stop`` is set: every ``dead_letter_interval_s`` seconds while it
        counts, backing off to :data:`DEAD_LETTER_MAX_INTERVAL_S` while it does not (:attr:`dead_retry_s`). A pass
        that raises (an unreadable file, a full disk) is logged with its traceback the first time, one line after
        while it keeps failing, and backs off the same way."""
        failing = False
        while not stop.is_set():
            try:
                await self.retry_dead_letters()
                failing = False
            except Exception as exc:  # never fatal: the file stays as it was (drain_keeping), tried again later
                self._backoff(stuck=True)
                if failing:
                    log.error("usage dead-letter retry failed again, next try in %.0f s: %r", self.dead_retry_s, exc)
                else:
                    log.exception("usage dead-letter retry failed, next try in %.0f s", self.dead_retry_s)
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.dead_retry_s)

    # --- read path --------------------------------------------------------------------------------------
    async def key_counters(self, key_id: str, day: str | None = None, month: str | None = None) -> dict[str, int]:
        """A key's counters: all-time, or for one UTC ``day`` (YYYY-MM-DD) or ``month`` (YYYY-MM)."""
        if day is not None:
            name = self.keys.key_day(key_id, day)
        elif month is not None:
            name = self.keys.key_month(key_id, month)
        else:
            name = self.keys.key_total(key_id)
        return _ints(await self.breaker.call(lambda: self.redis.hgetall(name)))

    async def tier_counters(self, tier: str, day: str | None = None) -> dict[str, int]:
        """A tier's counters, all-time or for one UTC ``day``."""
        name = self.keys.tier_day(tier, day) if day else self.keys.tier_total(tier)
        return _ints(await self.breaker.call(lambda: self.redis.hgetall(name)))

    async def key_ids(self) -> list[str]:
        """Every key id that has counters."""
        raw = await self.breaker.call(lambda: self.redis.smembers(self.keys.usage_keys))
        return sorted(as_text(m) for m in raw)

    async def events(self, since_ts: float | None = None, until_ts: float | None = None,
                     page: int = 1000, tally: ReadTally | None = None) -> AsyncIterator[UsageEvent]:
        """Every event with ``since_ts <= ts < until_ts`` (epoch seconds), in stream order (events written late
        last).

        Reads by stream id (the *write* time, Redis's clock: after the event's ``ts`` on the replica's, but for clock
        skew between them): from ``since_ts`` less :data:`EARLY_SLACK_S`, and — when
        ``until_ts`` is given and every event that could fall in it was written by a script that indexes late
        events (``late:from``, see ``NOTE_LATE``) — only up to ``until_ts`` + ``metering.late_after_s``, plus the
        late index's entries of the period; otherwise to the stream's end. ``tally`` (optional) counts the stream
        entries read. Raises :class:`RedisDown`."""
        # an event of a replica whose clock runs ahead has a stream id before its ts (a cache hit is written within
        # ms of it): read from since, it was missed — by raw exports, sub-day edges, the backfill, the quarantine check
        start = f"{max(0, int((since_ts - EARLY_SLACK_S) * 1000))}-0" if since_ts is not None else "-"
        end, late_ids = "+", list[str]()
        if until_ts is not None:
            hi_ms, late_ids = await self._period_end(since_ts, until_ts)
            end = "+" if hi_ms is None else str(hi_ms)
        while True:
            batch = await self.breaker.call(
                functools.partial(self.redis.xrange, self.keys.events, min=start, max=end, count=page)) or []
            if tally is not None:
                tally.entries += len(batch)
            for _stream_id, fields in batch:
                event = UsageEvent.from_json(as_bytes((fields or {})[b"e"]))
                if (since_ts is None or event.ts >= since_ts) and (until_ts is None or event.ts < until_ts):
                    yield event
            if len(batch) < page:
                break
            start = "(" + as_text(batch[-1][0] or b"")
        for i in range(0, len(late_ids), page):  # written after the range read: fetched one by one, pipelined
            entries = await self._pipelined([("xrange", i_) for i_ in late_ids[i:i + page]], args=True)
            for found in entries:
                if tally is not None:
                    tally.entries += len(found)
                for _stream_id, fields in found or []:
                    event = UsageEvent.from_json(as_bytes((fields or {})[b"e"]))
                    if (since_ts is None or event.ts >= since_ts) and event.ts < until_ts:  # type: ignore[operator]
                        yield event

    async def grouped(self, group_by: list[str], since: float, until: float | None = None,
                      key_id: str | None = None, now: float | None = None,
                      max_scan_s: float | None = None) -> GroupedUsage:
        """Usage of ``[since, until)`` (epoch seconds; ``until`` None = open) grouped by ``group_by`` (non-empty;
        see :func:`gateway.ledger.export.parse_group_by`), of one ``key_id`` or every key: the same rows as
        :func:`gateway.ledger.export.group` over :meth:`events` — integers (tokens, micro-USD, counts) plus exact
        USD strings — read from the per-day cubes (``gateway/ledger/aggregate.py``) for every whole UTC day they
        can answer, and from the stream only for the sub-day edges of the period and the days they cannot (not
        yet aggregated, or expired), each by its id range. ``max_scan_s``: see :meth:`grouped_parts` (raises
        :class:`~gateway.ledger.aggregate.ScanTooLarge`). Raises :class:`RedisDown`."""
        usage = await self.grouped_parts(since, until, key_id, now, max_scan_s)
        return GroupedUsage(group_sums(usage.parts, group_by), usage.cube_days, usage.scan_windows,
                            usage.events_scanned)

    async def grouped_parts(self, since: float, until: float | None = None, key_id: str | None = None,
                            now: float | None = None, max_scan_s: float | None = None) -> PeriodParts:
        """What :meth:`grouped` groups, read once: ``parts`` — ``(attributes, sums)`` pairs (cube cells with their
        counters, stream events with their :func:`~gateway.ledger.export.increments`) for
        :func:`gateway.ledger.export.group_sums` — so a caller that needs several groupings of one period (the
        dashboard: by day, key, tier, tag and the total) reads the cubes once.

        ``since`` is first raised to the UTC midnight of the oldest thing retained (the oldest day in the cube
        index, the stream's first entry less ``metering.late_after_s``, the late index's oldest ``ts``): before it
        there is nothing to read, so ``since=0`` costs what the retained period costs. Each stretch the cubes cannot
        answer is read from the stream by id range (:meth:`events`). ``max_scan_s`` (a key's own query): raises
        :class:`~gateway.ledger.aggregate.ScanTooLarge` *before reading the stream* when those stretches add up to
        more than that many seconds, or one of them cannot be read by id range (events written before the late
        index existed). Raises :class:`RedisDown`."""
        now = time.time() if now is None else now
        k = self.keys
        index = {as_text(f): as_text(v)
                 for f, v in (await self.breaker.call(lambda: self.redis.hgetall(k.agg_index))).items()}
        known = [f[2:] for f in index if f.startswith("n:")]
        since = max(since, await self._retained_from(known, index.get("late:from"), now))
        days, windows = plan_period(since, until, now, known)
        # days whose cube may have expired are scanned without asking their seen-set (a since of 1970 names
        # twenty thousand days)
        live = [d for d in days if day_start(d) + DAY_TTL_S - DAY_S > now]
        seen = await self._pipelined([("scard", k.seen(d)) for d in live])
        sizes = dict(zip(live, (int(n) for n in seen), strict=True))
        cube_days: list[str] = []
        newly_ok: list[str] = []
        for d in days:
            n = int(index.get(f"n:{d}", 0))
            verdict = day_verdict(d, n, sizes.get(d, 0), index.get(f"ok:{d}") == "1", now, self.cfg.dedup_ttl_s,
                                  DAY_TTL_S) if d in sizes else "scan"
            if verdict == "cube":
                cube_days.append(d)
                if sizes[d] and index.get(f"ok:{d}") != "1" and day_start(d) + DAY_S < now:
                    newly_ok.append(d)  # complete and over: trusted once its seen-set expires
            elif verdict == "scan":
                windows.append((day_start(d), day_start(d) + DAY_S))
        if max_scan_s is not None:
            self._check_scan(merge_windows(windows), index.get("late:from"), now, max_scan_s)
        if newly_ok:
            await self.breaker.call(lambda: self.redis.hset(k.agg_index, mapping={f"ok:{d}": "1" for d in newly_ok}))
        parts: list[tuple[Groupable, Mapping[str, int]]] = []
        if key_id is None:
            members = await self._pipelined([("smembers", k.agg_day_keys(d)) for d in cube_days])
            cubes = [(as_text(m), d) for d, ms in zip(cube_days, members, strict=True) for m in sorted(ms)]
        else:
            cubes = [(key_id, d) for d in cube_days]
        raws = await self._pipelined([("hgetall", k.agg_cube(i, d)) for i, d in cubes])
        for (i, d), raw in zip(cubes, raws, strict=True):
            parts.extend(parse_cube(i, d, raw))
        windows = merge_windows(windows)
        tally = ReadTally()
        # each stretch by its own id range: a sub-day edge at the start of the month no longer reads the month
        for lo, hi in windows:
            async for event in self.events(lo, hi, tally=tally):
                if key_id is None or event.key_id == key_id:
                    parts.append((event, increments(event)))
        return PeriodParts(parts, cube_days, windows, tally.entries)

    def _check_scan(self, windows: list[tuple[float, float | None]], late_from: str | None, now: float,
                    max_scan_s: float) -> None:
        """Raise :class:`ScanTooLarge` when ``windows`` need more than ``max_scan_s`` seconds of the stream read, or
        a read that cannot stop at the window's end (see :meth:`events`)."""
        span = 0.0
        for lo, hi in windows:
            if hi is None:  # the open end past every known day: nothing is written there yet
                span += max(0.0, now - lo)
                continue
            span += max(0.0, min(hi, now) - lo)  # nothing is written past now (an until far ahead reads nothing more)
            if late_from is None or int(late_from) > int(hi * 1000) + int(self.cfg.late_after_s * 1000):
                raise ScanTooLarge("this period reaches back before the metering script indexed late events: "
                                   "only the admin key may read it from the event stream")
        if span > max_scan_s:
            raise ScanTooLarge(f"this period needs {span / 3600:.1f} h of the event stream read (sub-day edges of "
                               "since/until, or days the usage cubes cannot answer); a key may have at most "
                               f"{max_scan_s / 3600:.0f} h read per query: give since/until as UTC days "
                               "(YYYY-MM-DD), or ask the admin")

    async def _retained_from(self, known: list[str], late_from: str | None, now: float) -> float:
        """UTC midnight of the oldest ``ts`` anything retained may hold (see :meth:`grouped_parts`); ``now``'s
        midnight when nothing is retained; 0 when the stream still holds entries written before ``late_from`` (an
        older script: one written late says nothing about how old its ``ts`` is)."""
        first = await self.breaker.call(functools.partial(self.redis.xrange, self.keys.events, count=1)) or []
        if first and (late_from is None or int(as_text(first[0][0] or b"0").split("-")[0]) < int(late_from)):
            return 0.0
        late = await self.breaker.call(functools.partial(self.redis.zrange, self.keys.late_events, 0, 0,
                                                         withscores=True)) or []
        floor = [day_start(min(known))] if known else []
        if first:
            floor.append(int(as_text(first[0][0] or b"0").split("-")[0]) / 1000 - self.cfg.late_after_s)
        if late:
            floor.append(float(late[0][1]) / 1000)
        return day_start(day_of(min(floor, default=now)))

    async def _period_end(self, since: float | None, until: float) -> tuple[int | None, list[str]]:
        """Where a read by stream id of the events with ``since <= ts < until`` may stop, for :meth:`events` and
        :meth:`recent` alike: ``(until + metering.late_after_s in ms, the late index's ids of the period written
        after that)`` when every event that could fall in the period was written by a script that indexes late
        events (``late:from`` at or before that end, ``NOTE_LATE``); else ``(None, [])``: the read goes on to the
        stream's end (an event written late before the upgrade is in no index). Raises :class:`RedisDown`."""
        hi_ms = int(until * 1000) + int(self.cfg.late_after_s * 1000)
        late_from = await self.breaker.call(lambda: self.redis.hget(self.keys.agg_index, "late:from"))
        if late_from is None or int(late_from) > hi_ms:
            return None, []
        return hi_ms, await self._late_ids(since, until, hi_ms)

    async def _late_ids(self, since: float | None, until: float, hi_ms: int) -> list[str]:
        """Stream ids (text) of the late index's events with ``since <= ts < until`` (epoch s; ``since`` None =
        open) that were written after ``hi_ms`` (the end of a read by id range, ms): the ones that read misses.
        Raises :class:`RedisDown`."""
        lo = "-inf" if since is None else str(int(since * 1000))
        # scores are whole ms (floored): ts < until allows the score floor(until ms) itself
        ids = await self.breaker.call(functools.partial(
            self.redis.zrangebyscore, self.keys.late_events, lo, str(int(until * 1000))))
        return [t for t in (as_text(i) for i in ids or () if isinstance(i, bytes | str))
                if int(t.split("-")[0]) > hi_ms]

    async def recent(self, limit: int, since: float | None = None,
                     until: float | None = None) -> tuple[list[UsageEvent], int]:
        """The most recent events (by stream id, newest last) with ``since <= ts < until`` (epoch seconds, None =
        open), reading at most ``limit`` stream entries: one ``XREVRANGE … COUNT limit`` from the newest entry
        (``until`` None) or — as :meth:`events` reads a period — from ``until`` plus ``metering.late_after_s`` (an
        event is written when its request ends, after its ``ts``), with the late index's entries of the period
        written after that (a spool replay, a reconciled orphan: the newest of all), down to ``since`` less
        :data:`EARLY_SLACK_S`. As :meth:`events`, the read stops past ``until`` only when every event that could
        fall in the period was written by a script that indexes late events (``late:from``, see ``NOTE_LATE``): a
        period reaching back before it is read from the newest entry, since an event of it written late before the
        upgrade is in no index (the window is then mostly later events, and says it is incomplete unless the whole
        stream down to ``since`` fits in ``limit``). Returns ``(events, entries read)``; entries read < ``limit``
        means every event of the period that :meth:`events` finds is there. Raises :class:`RedisDown`."""
        lo = "-" if since is None else f"{max(0, int((since - EARLY_SLACK_S) * 1000))}"
        hi, late_ids = "+", list[str]()
        if until is not None:
            hi_ms, late = await self._period_end(since, until)
            hi = "+" if hi_ms is None else str(hi_ms)
            # written after the id range (NOTE_LATE): the newest entries of the period, read first
            late_ids = sorted(late, key=lambda t: tuple(int(p) for p in t.split("-")))[-limit:] if limit > 0 else []
        found: list[Any] = []
        for entries in await self._pipelined([("xrange", i) for i in late_ids], args=True) if late_ids else []:
            found.extend(entries or [])
        rest = limit - len(late_ids)
        batch: list[Any] = []
        if rest > 0:
            newest = await self.breaker.call(
                functools.partial(self.redis.xrevrange, self.keys.events, max=hi, min=lo, count=rest))
            batch = list(newest or [])
        out = []
        for _stream_id, fields in [*reversed(batch), *found]:
            event = UsageEvent.from_json(as_bytes((fields or {})[b"e"]))
            if (since is None or event.ts >= since) and (until is None or event.ts < until):
                out.append(event)
        return out, len(late_ids) + len(batch)

    async def backfill(self, since: float | None = None, now: float | None = None) -> dict[str, int]:
        """Rebuild from the stream the cubes of every day (from ``since``'s UTC day on; None: the whole stream)
        that :meth:`grouped` would have to scan — days counted before the cubes existed (an upgrade), or by a
        replica still running the old script —, each day in one atomic step that is skipped when the metering
        script aggregated an event of that day meanwhile (run again). Idempotent: a rebuilt day is the stream's.
        A day is rebuilt whole or not at all (``BACKFILL_LUA``), whatever its cubes and key set hold (a key of the
        wrong type there is deleted and written anew); a run stopped between days (Redis down, a refused index) is
        run again: the days it rebuilt are complete and skipped.
        Returns ``{"days": days with events, "rebuilt": …, "skipped": …, "complete": already complete}``.
        Reads the whole stream from ``since``: a one-time operation. Raises :class:`RedisDown`."""
        now = time.time() if now is None else now
        k = self.keys
        index = {as_text(f): as_text(v)
                 for f, v in (await self.breaker.call(lambda: self.redis.hgetall(k.agg_index))).items()}
        start = None if since is None else day_start(day_of(since))
        by_day: dict[str, list[UsageEvent]] = {}
        async for event in self.events(start, None):
            by_day.setdefault(event.day, []).append(event)
        days = sorted(d for d in by_day if day_start(d) + DAY_TTL_S - DAY_S > now)
        sizes = dict(zip(days, (int(n) for n in await self._pipelined([("scard", k.seen(d)) for d in days])),
                         strict=True))
        # a day's key set of the wrong type is no reason to stop: the day's script deletes it and writes it anew
        olds = await self._pipelined([("smembers", k.agg_day_keys(d)) for d in days], raise_on_error=False)
        out = {"days": len(days), "rebuilt": 0, "skipped": 0, "complete": 0}
        script = self.redis.register_script(BACKFILL_LUA)
        for d, old in zip(days, olds, strict=True):
            if isinstance(old, ResponseError):
                log.warning("usage backfill: the key set of %s is unreadable (%s), rebuilt from the stream", d, old)
                old = set()
            n0 = index.get(f"n:{d}", "0")
            if day_verdict(d, int(n0), sizes[d], index.get(f"ok:{d}") == "1", now, self.cfg.dedup_ttl_s,
                           DAY_TTL_S) == "cube":
                out["complete"] += 1
                continue
            cubes: dict[str, dict[str, int]] = {}
            for event in by_day[d]:
                cube, cell = cubes.setdefault(event.key_id, {}), " " + cell_of(event)
                for name, value in increments(event).items():
                    if value:
                        cube[name + cell] = cube.get(name + cell, 0) + value
            ids = sorted(cubes)
            stale = sorted({as_text(m) for m in old} - set(ids))
            keys = [k.agg_index, k.agg_day_keys(d), *(k.agg_cube(i, d) for i in ids),
                    *(k.agg_cube(i, d) for i in stale)]
            args: list[str | int] = [d, n0, len(by_day[d]), DAY_TTL_S, int(day_start(d) + DAY_S < now), len(ids), *ids]
            for j, i in enumerate(ids, start=1):
                for field_name, value in cubes[i].items():
                    args += [j, field_name, value]
            if self.split:
                done = await self._backfill_split(d, n0, len(by_day[d]), ids, stale, cubes, day_start(d) + DAY_S < now)
            else:
                done = await self.breaker.call(functools.partial(script, keys=keys, args=args))
            out["rebuilt" if done else "skipped"] += 1
        return out

    async def _backfill_split(self, day: str, n0: str, n_events: int, ids: list[str], stale: list[str],
                              cubes: dict[str, dict[str, int]], over: bool) -> bool:
        """:meth:`backfill`'s step for one day where the cubes are in their keys' tenant slots (:attr:`split`): no
        script spans them, so each cube is rewritten on its own (``CUBE_REWRITE_LUA``), then the index and the day's
        key set in one step that, like ``BACKFILL_LUA``, takes effect only if no event of the day was aggregated since
        ``n0`` was read (``INDEX_REWRITE_LUA``); else the day stays answered from the stream until the next run. A day
        with a key part still pending is skipped before any write: that event is in the stream read, and its key part
        would add it to the rewritten cube a second time."""
        k = self.keys
        pending = await self.breaker.call(lambda: self.redis.hgetall(k.pending))
        if any(orjson.loads(v).get("d") == day for v in pending.values()):
            return False
        for key_id in [*ids, *stale]:
            flat: list[str | int] = [DAY_TTL_S]
            for field_name, value in cubes.get(key_id, {}).items():
                flat += [field_name, value]
            await self.breaker.call(functools.partial(self._cube_rewrite, keys=[k.agg_cube(key_id, day)], args=flat))
        return bool(await self.breaker.call(functools.partial(
            self._index_rewrite, keys=[k.agg_index, k.agg_day_keys(day)],
            args=[day, n0, n_events, DAY_TTL_S, int(over), *ids])))

    async def _pipelined(self, calls: list[tuple[str, str]], args: bool = False,
                         raise_on_error: bool = True) -> list[Any]:
        """One reply per ``(command method, key)`` call, sent as pipelines of at most 1000 (one round trip each).
        ``args``: the calls are ``("xrange", stream id)`` — that one entry of the stream. ``raise_on_error`` False:
        an error reply is returned in place (its ``ResponseError``) instead of raised."""
        out: list[Any] = []
        for i in range(0, len(calls), 1000):
            chunk = calls[i:i + 1000]

            async def run(chunk: list[tuple[str, str]] = chunk) -> list[Any]:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for method, key in chunk:
                        if args:
                            getattr(pipe, method)(self.keys.events, min=key, max=key)
                        else:
                            getattr(pipe, method)(key)
                    return list(await pipe.execute(raise_on_error=raise_on_error))

            out.extend(await self.breaker.call(run))
        return out


def _increment_pairs(event: UsageEvent) -> list[str | int]:
    """The metering scripts' field / increment pairs of ``event``: its counters, then the cube's own counts
    (``CUBE_ONLY_FIELDS``, last: the scripts add them to the cube only); a 0 writes nothing."""
    pairs: list[str | int] = []
    for name, value in (*counter_increments(event).items(), *cube_only_increments(event).items()):
        pairs += [name, value]
    return pairs


def unacked_path(usage_spool: Path) -> Path:
    """Where counted events too few replicas acknowledged wait (``metering.replica_acks``): beside the usage spool,
    ``<stem>.unacked.jsonl``."""
    return usage_spool.with_name(usage_spool.stem + ".unacked.jsonl")


def quarantine_path(usage_spool: Path) -> Path:
    """Where replays set aside what they must neither count nor drop (:meth:`Meter._fresh`): beside the usage spool,
    ``<stem>.quarantine.jsonl``."""
    return usage_spool.with_name(usage_spool.stem + ".quarantine.jsonl")


class _Stamped(Protocol):
    """A usage event, or a write-ahead record (``gateway/state/write_ahead.py``): its ``ts``, epoch s."""

    @property
    def ts(self) -> Any: ...


def past_dedup_window(event: _Stamped, dedup_ttl_s: int, now: float) -> bool:
    """Whether ``event``'s id may have left the seen-set that makes its replay a no-op once counted: its ``ts``
    (epoch s) is ``dedup_ttl_s`` less :data:`~gateway.ledger.aggregate.SEEN_MARGIN_S` old at ``now`` (epoch s).
    ``event``: a usage event, or a write-ahead record (its request's event has the record's ``ts`` and id).

    Why ``ts`` bounds it: an event is counted at or after its ``ts``, and counting it (``SADD``, then ``EXPIRE
    dedup_ttl_s``) renews its day's seen-set, so had it been counted, its id stays there at least ``dedup_ttl_s``
    after ``ts`` (every replica on the same ``metering.dedup_ttl_s``); the margin covers clock skew between the
    replica that stamped ``ts`` and Redis. False for a ``ts`` that is no finite number: such an event cannot be
    written at all (its day cannot be named), the dead-letter spool keeps it."""
    ts = event.ts
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        return False
    return ts + dedup_ttl_s - SEEN_MARGIN_S <= now


def dead_letter_path(usage_spool: Path) -> Path:
    """Where events Redis refused wait: beside the usage spool, ``<stem>.dead.jsonl``."""
    return usage_spool.with_name(usage_spool.stem + ".dead.jsonl")


def transient(exc: Exception) -> bool:
    """Whether an error reply means Redis cannot write now (a replica, memory full, a script running) rather than
    that it refuses this event (a key of the wrong type): the event is spooled, not dead-lettered."""
    return isinstance(exc, ReadOnlyError | OutOfMemoryError) or (isinstance(exc, ResponseError)
                                                                  and str(exc).startswith(TRANSIENT_REPLIES))


def _ints(raw: Mapping[bytes | str, bytes | str]) -> dict[str, int]:
    out = dict.fromkeys(COUNTER_FIELDS, 0)
    out.update({as_text(k): int(v) for k, v in raw.items()})
    return out
