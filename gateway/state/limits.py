"""Admission control: budgets (USD per UTC day / month) at every level, RPM and TPM, decided atomically in Redis.

**Reserve, then settle.** Before each upstream call — the request's own, an escalation's, a shadow or judge
call, the semantic cache's embedding call — one Lua script (``ADMIT``) reads, for every level the call is under
— its key, each of the key's tags, the global level (``gateway/state/budgets.py``) — the level's **budget
definition** (its ``budget:…:def`` hash, written by ``thinkgate budgets set``; else the config's budget passed
in), the spend so far (``cost_micro_usd`` of the level's day/month counters) and the open reservations of
concurrent requests (``gateway/state/reservations.py``), and the key's RPM/TPM windows. Reading the definition
inside the script is what puts a budget set, raised or lowered in force for the next request on every replica
(the per-process copy of ``BudgetLevels`` is only the fallback while Redis is down). With ``e`` = this call's
upper-bound estimate (:func:`estimate`), it admits only when, for each level and period with a budget ``B``:

- ``hard`` (``limits.budget_mode``, the default): spend + reserved + e ≤ B — no request shape can take the
  spend past the budget (as long as ``e`` is an upper bound, which the tier caps make it; forced thinking's
  two phases per choice are in it, :func:`call_bound`);
- ``soft``: spend < B and spend + reserved < B — the overshoot is bounded by one request's estimate, itself
  bounded by the caps (``max_n`` × ``max_tokens`` at the priciest reachable tier, plus the prompt). The mode is
  ``limits.budget_mode`` for the keys' calls; a call may name its own (:meth:`Limits.admit`'s ``mode``): shadow and
  judge calls are always ``hard``, their ``routing.shadow.max_usd_day`` being a cap on the gateway's own spend;

and RPM: requests in the sliding 60 s window + 1 ≤ ``rpm``; TPM: tokens in the window < ``tpm``. Then, in the
same atomic step, it records a reservation of ``e`` at *every* level (budgeted or not, so a budget set while
requests are in flight already sees them; the key's also carries the tokens, for TPM) under the request id,
counts the request in the RPM window and the reserved tokens in the TPM window. Metering settles it: the usage
event's write (``gateway/state/metering.py``) deletes the reservations and corrects the TPM window by the real
token count, atomically with adding the real cost to every level's counters. So concurrent requests see each
other's reservations at every level. A stream renews its reservations while it runs (:meth:`Limits.renew`,
``gateway/pipeline/relay.py``) and is cut at ``limits.max_stream_s``; reservations of a crashed replica stop
counting after ``limits.reservation_ttl_s``. (LiteLLM checks spend after the fact and overshoots under
concurrency — BerriAI/litellm#34732, #11083.)

**One script, or one per level group (Redis Cluster).** On a single Redis all levels go through one script
call: one atomic check-and-reserve. On Redis Cluster the levels' keys (key, each tag, global) may live in
different hash slots, and a script may only touch one slot; there (``limits.admission_script: auto`` with a
``RedisCluster`` client, or ``grouped``) admission runs the same script once per level group — the key's level
with its RPM/TPM windows first, then each tag, then global —, each an atomic check-and-reserve of its own. When
a later group refuses, the groups already reserved are rolled back (``ROLLBACK_LUA``: reservation deleted, the
RPM/TPM counts taken back) and the refusal raised. No level can be overspent (each level's check and reserve is
atomic, and a reservation is in place before the next level is asked); at worst, a concurrent request sees a
reservation that is then rolled back and is refused spuriously. A rollback that a Redis outage stops is kept and
sent once Redis answers (it is idempotent); beyond :data:`UNROLLED_MAX` kept, or when Redis fails between two
groups of an admission, the reservations expire after their TTL — they can only refuse too much, never admit too
much.
Each group's keys are built by ``gateway/state/keys.py``, which decides their slots.

**One call for the hot path (single Redis).** With a plain Redis client (standalone or Sentinel) and not
``grouped`` (:attr:`Limits.fused`), a request's first call is admitted by ``HOT_LUA``: ``ADMIT`` over every level
and, only when admitted, its write-ahead record and its exact-cache lookup (a :class:`Rider`), in one atomic
script call — the one Redis round trip before the first upstream byte. On Cluster the cache entry is in the
tenant's slot, so even ``single`` keeps the lookup and the write-ahead record as calls of their own there.

**Windows.** RPM/TPM use a sliding-window counter: ``used = prev·(1 − elapsed/60 s) + current`` over fixed
60 s windows (two keys per limit, no per-request entries); ``Retry-After`` is the time until the window has
slid far enough. Budget rejections say the seconds until the period ends (UTC midnight / month start), or 1 s
when only in-flight reservations block (they may settle below their estimate).

**Redis down.** ``limits.on_redis_down``: ``fail_closed`` refuses with 503 (``limits_unavailable``);
``fail_open`` applies the same rules to process-local counters: the spend last read from Redis plus this
process's own requests since, and this process's RPM/TPM windows (approximate: other replicas unseen).
A request under no budget or limit that this process knows of (its last copy of the definitions) is admitted
without a check while Redis is down, in either mode.

**Outcome unknown.** A hot-path call (``HOT_LUA``) that times out or loses its connection once sent may have run
in Redis all the same: reserved at every level and written the request's write-ahead record. The request is decided
as with Redis down; refused so (503 ``limits_unavailable``, or a 429 of the local counters), it is never sent
upstream, and its audit event (``Accounting.audit``) settles what that call may have left: metering's ``AUDIT``
releases the reservations under the request id and deletes its write-ahead record (``gateway/state/metering.py``);
with what only the refusing process knows (``Meter.left``, noted by ``Accounting.admit_estimate`` when the refusal
says ``outcome_unknown``: a call was sent, not refused by the open breaker) it also takes the request back out of
the key's RPM window — only with the key's reservation of the request there, the proof that the call ran and admitted
(and so counted it: the key has an RPM limit) — and deletes the exact cache's single-flight lock if it holds the
request's token. Left, the reservations held the budgets until their TTL, the RPM count stayed in the window for up
to a minute, identical prompts waited on the lock for ``cache.single_flight_wait_s``, and the record stayed open for
the reconciler to settle as a lost call once this process was gone — a request and a 500 ``gateway_lost`` (at 0
tokens) for a request the client saw refused, once its audit event's id had left the seen-set
(``metering.dedup_ttl_s``, 60 s at the least). The audit event goes through the metering writer and its spool like
any other: an outage delays it, never loses it. Ordering:
the audit event is sent on another connection, after the call's own was dropped (and, for a timeout, after the
breaker's cooldown), so the call has almost always run or died by then — but a late one can still reach Redis after
it (a TCP segment retransmitted, a proxy in between). Either order is safe: the audit event puts the request id into
its day's seen-set in the same atomic step, and ``HOT`` first checks that set (``HOT_SETTLED``): run before the audit
event, the call's writes are what the audit event settles; run after it, the call writes nothing. A process killed
with the audit event still in its spool: restarted on the same machine (the same ``metering.spool_path``), its first
reconcile pass replays the spool before it reads the open records (``WriteAhead.reconcile``), so the audit event
settles the record first (the lock and the RPM count, which only the killed process knew of, are left to their TTL and
window); a replica elsewhere whose reconciler gets there first (the owner's heartbeat gone for a heartbeat TTL) cannot
see that spool and settles the record as a lost call (``gateway/state/write_ahead.py``, "never sent" taken for
"lost": 0 tokens, never money), and the audit event replayed later is dropped as a duplicate of its id.

**Redis refuses the script.** ``ADMIT`` and ``HOT`` are all or nothing (``gateway/state/undo.py``): a command that
fails partway (a key of the wrong type, a window counter that is no integer) takes back the call's reservations, its
RPM/TPM counts and its write-ahead record, and the script answers an error naming the command and the key. Grouped
admission rolls back the groups before a refused one. :meth:`Limits.admit` then decides the request as with Redis
down (``limits.on_redis_down``: 503 ``limits_unavailable`` or the local counters — never unchecked under a budget or
limit this process knows of), logs the error at ERROR (at most once a minute per error) and leaves the breaker
closed: Redis answers, other keys and metering go on.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import functools
import json
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal, Protocol

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from gateway.config import LimitsConfig, TierConfig, prompted_hard_stop
from gateway.errors import CAP_FIELDS, CAP_FIELDS_AND_N, GatewayError, LimitsUnavailable, RateLimited
from gateway.ledger.event import UsageEvent, cost_micro_usd, micro_to_usd, usd_to_micro
from gateway.openai.usage import has_media
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.budgets import Level, event_level_ids
from gateway.state.cache import LOOKUP_LUA, Lookup
from gateway.state.keys import RedisKeys
from gateway.state.log_throttle import LogThrottle, held_back
from gateway.state.metering import RecordResult
from gateway.state.redis import FastScript, RedisHandle
from gateway.state.reservations import LUA_FUNCTIONS, RENEW_LUA, RESERVE_LUA, ROLLBACK_LUA
from gateway.state.undo import UNDO_LUA, all_or_nothing

log = logging.getLogger("thinkgate.limits")

#: ``limits.budget_mode``, or a call's own (:meth:`Limits.admit`'s ``mode``: the shadow's calls are always ``hard``)
BudgetMode = Literal["hard", "soft"]
WINDOW_MS = 60_000
#: rollbacks kept through an outage (grouped admission); beyond it the oldest are left to their reservation TTL
UNROLLED_MAX = 4096
#: an admission script Redis refuses (an error reply) is logged at ERROR at most once per this many seconds per
#: distinct error (a broken key refuses every request of its tenant: thousands of lines a second otherwise)
REFUSED_LOG_EVERY_S = 60.0
#: the ``script`` label of ``thinkgate_admission_refused_scripts_total``: ``admit`` (``ADMIT``/``HOT``: a call's
#: admission, then decided as with Redis down), ``rollback`` (a grouped admission's ``ROLLBACK``: left to the
#: reservation's TTL), ``renew`` (a stream's ``RENEW``: the reservations lapse at their TTL unless a later round works)
REFUSED_SCRIPTS = ("admit", "rollback", "renew")
#: values after the levels in an admitted ``ADMIT`` reply: the key's RPM and TPM windows (:class:`RateState`)
RATE_FIELDS = 4
MESSAGE_OVERHEAD_TOKENS = 8  # chat template tokens per message, upper bound
REQUEST_OVERHEAD_TOKENS = 16
TOOLS_OVERHEAD_TOKENS = 256  # the template's tool-calling preamble, upper bound
FORCED_THINK_OPEN = "<think>\n"  # what forced thinking's phase 2 opens the re-sent thought with (forcing.THINK_OPEN)

# One check-and-reserve over a group of budget levels (all of them on a single Redis; one level per call on
# Redis Cluster, see the module docstring).
# KEYS: per level i (0-based): 1+4i day spend hash, 2+4i month spend hash, 3+4i reservations hash, 4+4i budget
#       definition hash (``budget:…:def``; the key level passes its reservations hash here, never read); then, when
#       ARGV[3] or ARGV[4] is not -1 (the key's group), 4n+1 RPM current, 4n+2 RPM previous, 4n+3 TPM current,
#       4n+4 TPM previous.
# ARGV: 1 now ms, 2 mode (hard|soft), 3 rpm (-1 none), 4 tpm (-1), 5 estimated micro-USD, 6 estimated tokens,
#       7 reservation id, 8 reservation TTL ms, 9 seconds to the end of the day, 10 … of the month,
#       11 number of levels n, then per level i: 12+4i day budget micro (-1 none), 13+4i month budget (-1) — the
#       fallback when the level has no definition hash —, 14+4i tokens to reserve here, 15+4i read the
#       definition hash (1/0).
# Every level is reserved (budgeted or not: a budget set later sees the requests in flight).
# Returns {1, per level: day spend, month spend, reserved, day budget, month budget (-1 none), then the key's RPM
#         window: requests used (ceiling) and ms until empty, and its TPM window: tokens used and ms (-1 -1 each when
#         the limit is not set or not checked in this call)} or
#         {0, code, level index (1-based in this call; 0 for RPM/TPM), what, retry_after_s, budget, spent, reserved}.
ADMIT_CORE = """
local now = tonumber(ARGV[1])
local hard = ARGV[2] == 'hard'
local W = 60000
local elapsed = now % W
local rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
local est = tonumber(ARGV[5])
local n = tonumber(ARGV[11])
local SWEEP_AT = 4096
local seen = {}
for i = 0, n - 1 do
  local a = 12 + 4 * i
  local bday, bmonth = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  -- each read names its key first: a key of the wrong type (or a value that is no number) fails the call with an
  -- error naming it (the undo machinery's reply, ``gateway/state/undo.py``)
  if ARGV[a + 3] == '1' then
    at_cmd, at_key = 'HMGET', KEYS[4 + 4 * i]
    local d = redis.call('HMGET', KEYS[4 + 4 * i], 'day', 'month')
    if d[1] or d[2] then bday, bmonth = tonumber(d[1] or '-1'), tonumber(d[2] or '-1') end
  end
  at_cmd, at_key = 'HGET', KEYS[1 + 4 * i]
  local sd = tonumber(redis.call('HGET', KEYS[1 + 4 * i], 'cost_micro_usd') or '0')
  at_key = KEYS[2 + 4 * i]
  local sm = tonumber(redis.call('HGET', KEYS[2 + 4 * i], 'cost_micro_usd') or '0')
  local reserved = 0
  -- the sweep of expired reservations (open_reserved's HDELs) is not undone: they count nothing
  at_cmd, at_key = 'HGETALL', KEYS[3 + 4 * i]
  if bday >= 0 or bmonth >= 0 then
    reserved = open_reserved(KEYS[3 + 4 * i], now)
  elseif redis.call('HLEN', KEYS[3 + 4 * i]) > SWEEP_AT then
    open_reserved(KEYS[3 + 4 * i], now)  -- unbudgeted: only swept of a crashed replica's leftovers now and then
  end
  local checks = {{bday, sd, 'day', tonumber(ARGV[9])}, {bmonth, sm, 'month', tonumber(ARGV[10])}}
  for _, c in ipairs(checks) do
    local budget, spent = c[1], c[2]
    if budget >= 0 then
      if hard then
        if spent + est > budget then return {0, 'budget_exceeded', i + 1, c[3], c[4], budget, spent, reserved} end
        if spent + reserved + est > budget then
          return {0, 'budget_exceeded', i + 1, c[3], 1, budget, spent, reserved}
        end
      else
        if spent >= budget then return {0, 'budget_exceeded', i + 1, c[3], c[4], budget, spent, reserved} end
        if spent + reserved >= budget then return {0, 'budget_exceeded', i + 1, c[3], 1, budget, spent, reserved} end
      end
    end
  end
  seen[#seen + 1] = sd
  seen[#seen + 1] = sm
  seen[#seen + 1] = reserved
  seen[#seen + 1] = bday
  seen[#seen + 1] = bmonth
end
local R = 4 * n
local frac = (W - elapsed) / W
local function retry_s(limit, cur, prev)
  local room = limit - 1
  local t
  if cur <= room and prev > 0 then
    t = (W - elapsed) - W * (room - cur) / prev
  elseif cur <= 0 then
    t = W - elapsed
  else
    t = (W - elapsed) + W * (1 - room / cur)
  end
  return math.max(1, math.ceil(t / 1000))
end
local rcur, rprev, tcur, tprev = 0, 0, 0, 0
if rpm >= 0 then
  at_cmd, at_key = 'GET', KEYS[R + 1]
  rcur = tonumber(redis.call('GET', KEYS[R + 1]) or '0')
  at_key = KEYS[R + 2]
  rprev = tonumber(redis.call('GET', KEYS[R + 2]) or '0')
  if rprev * frac + rcur + 1 > rpm then
    return {0, 'rate_limit_exceeded', 0, 'rpm', retry_s(rpm, rcur, rprev), rpm, 0, 0}
  end
end
if tpm >= 0 then
  at_cmd, at_key = 'GET', KEYS[R + 3]
  tcur = tonumber(redis.call('GET', KEYS[R + 3]) or '0')
  at_key = KEYS[R + 4]
  tprev = tonumber(redis.call('GET', KEYS[R + 4]) or '0')
  if tprev * frac + tcur >= tpm then
    return {0, 'rate_limit_exceeded', 0, 'tpm', retry_s(tpm, tcur, tprev), tpm, 0, 0}
  end
end
-- the writes, each logged (UNDO_LUA): a later one that fails takes them all back
local ttl = tonumber(ARGV[8])
for i = 0, n - 1 do
  reserve(KEYS[3 + 4 * i], ARGV[7], ARGV[5], ARGV[14 + 4 * i], now + ttl, ttl)
end
if rpm >= 0 then
  incrby(KEYS[R + 1], 1)
  redis.call('PEXPIRE', KEYS[R + 1], 2 * W)
end
if tpm >= 0 then
  incrby(KEYS[R + 3], ARGV[6])
  redis.call('PEXPIRE', KEYS[R + 3], 2 * W)
end
local out = {1}
for _, v in ipairs(seen) do out[#out + 1] = v end
-- the key's windows after this request (x-ratelimit-* headers): used requests / tokens (ceiling), and the ms until
-- each window is empty (-1: no such limit)
local function rate_reply(limit, cur, prev)
  if limit < 0 then return -1, -1 end
  local empty = (cur > 0) and (2 * W - elapsed) or ((prev > 0) and (W - elapsed) or 0)
  return math.ceil(prev * frac + cur), empty
end
local ru, rr = rate_reply(rpm, rcur + 1, rprev)
local tu, tr = rate_reply(tpm, tcur + tonumber(ARGV[6]), tprev)
out[#out + 1] = ru
out[#out + 1] = rr
out[#out + 1] = tu
out[#out + 1] = tr
"""
# All or nothing (``gateway/state/undo.py``): a command that fails after the first reservation was written (a key of
# the wrong type, a window counter that is no integer) takes back every reservation and count of the call, which answers
# an error reply naming the command and the key (``Limits.admit`` then decides as with Redis down). The refusals and
# reads come before any write but the sweep of expired reservations, which is not undone (they count nothing).
ADMIT_PREAMBLE = LUA_FUNCTIONS + UNDO_LUA + RESERVE_LUA
ADMIT_LUA = ADMIT_PREAMBLE + all_or_nothing("function()\n" + ADMIT_CORE + "return out\nend", what="admission")

# The one-call hot path of a single Redis (``Limits.fused``): ``ADMIT`` over every level, then — only when admitted,
# in the same atomic step — the rider (:class:`Rider`): the request's write-ahead record (``HSET``,
# ``gateway/state/write_ahead.py``) and its exact-cache lookup (``cache_lookup``, ``gateway/state/cache.py``).
# KEYS: ADMIT's, then from x = 4n (+4 with the RPM/TPM keys): x+1 the write-ahead hash, x+2 the cache entry, x+3 the
#       cache lock (each may be passed as any key when unused), x+4 the usage seen-set of the request's day.
# ARGV: ADMIT's (11 + 4n), then from a = 12 + 4n: a the record JSON ('' = none), a+1 its request id, a+2 lookup
#       ('1' / '0'), a+3 lock token ('' = no single-flight), a+4 lock TTL ms.
# Returns ADMIT's refusal, or ADMIT's admitted reply followed by the lookup's reply ({} when none); the refusal
# ``settled`` (nothing written) when the seen-set holds the request id already (see "Outcome unknown" in the module
# doc: a call that reached Redis after its request's refusal was settled).
# All or nothing like ``ADMIT``: the write-ahead record is logged too; the lookup's GET (a key of the wrong type at
# the entry) can fail after every other write, its lock (SET NX, the last write) cannot.
HOT_SETTLED = """
local x0 = 4 * tonumber(ARGV[11]) + ((tonumber(ARGV[3]) >= 0 or tonumber(ARGV[4]) >= 0) and 4 or 0)
at_cmd, at_key = 'SISMEMBER', KEYS[x0 + 4]
if redis.call('SISMEMBER', KEYS[x0 + 4], ARGV[7]) == 1 then return {0, 'settled', 0, '', 1, 0, 0, 0} end
"""
HOT_LUA = ADMIT_PREAMBLE + LOOKUP_LUA + all_or_nothing("function()\n" + HOT_SETTLED + ADMIT_CORE + """
local x = R + ((rpm >= 0 or tpm >= 0) and 4 or 0)
local a = 12 + 4 * n
if ARGV[a] ~= '' then hset(KEYS[x + 1], ARGV[a + 1], ARGV[a]) end
if ARGV[a + 2] == '1' then
  at_cmd, at_key = 'GET', KEYS[x + 2]
  local c = cache_lookup(KEYS[x + 2], KEYS[x + 3], ARGV[a + 3], ARGV[a + 4])
  for _, v in ipairs(c) do out[#out + 1] = v end
end
return out
end""", what="admission")


class KeyLike(Protocol):
    """What admission needs from a key (``gateway.auth.keys.KeyInfo`` has it)."""

    @property
    def id(self) -> str: ...
    @property
    def budget_usd_day(self) -> Decimal | None: ...
    @property
    def budget_usd_month(self) -> Decimal | None: ...
    @property
    def rpm(self) -> int | None: ...
    @property
    def tpm(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's limits in admission units: budgets in integer micro-USD, ``None`` = unlimited."""

    key_id: str
    budget_day_micro: int | None = None
    budget_month_micro: int | None = None
    rpm: int | None = None
    tpm: int | None = None

    @classmethod
    def of(cls, key: KeyLike) -> KeyLimits:
        return cls(
            key.id,
            usd_to_micro(key.budget_usd_day) if key.budget_usd_day is not None else None,
            usd_to_micro(key.budget_usd_month) if key.budget_usd_month is not None else None,
            key.rpm,
            key.tpm,
        )

    @property
    def unlimited(self) -> bool:
        return (self.budget_day_micro is None and self.budget_month_micro is None and self.rpm is None
                and self.tpm is None)

    @property
    def level(self) -> Level:
        """The key as a budget level."""
        return Level("key", self.key_id, self.budget_day_micro, self.budget_month_micro)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Upper bounds of one request: cost (micro-USD), tokens (prompt + completion), completion tokens (None:
    not bounded here, e.g. an embedding) — metering holds a reported completion count to it — and prompt tokens
    (None: not given) — a dead process's write-ahead record is held to it (``WalRecord.event``). Each is a maximum
    over the tiers the call may reach, on its own: ``tokens`` is not ``prompt + completion`` when the tier with the
    largest prompt bound (a forced-thinking one) is not the one with the largest completion bound."""

    micro_usd: int
    tokens: int
    completion: int | None = None
    prompt: int | None = None


@dataclass(frozen=True, slots=True)
class Rider:
    """What rides along in a single-Redis admission call (``HOT_LUA``), done only when the call is admitted:
    the write-ahead record (``wal_key``: the hash, ``record``: its JSON; b"" = none) and the exact-cache lookup
    (``lookup``; None = none). The lookup's reply comes back in :attr:`Admission.lookup_reply`.

    ``orphan``: told, once, what the call did if its caller is cancelled while it is out (the script may still run:
    a coalesced exchange is sent whatever its callers do) — ``(admission, unknown)``: the :class:`Admission` it made
    (its reservations, the write-ahead record and the lock are then the caller's to settle), or None when it admitted
    nothing (``unknown`` False) or when that is unknown (``unknown`` True: the exchange failed once sent — the
    caller settles what it may have written, as for an admission). The caller's ``await`` stays the one it was: the
    lane's flush hands the reply over (``FastLane.exchange``)."""

    wal_key: str = ""
    record: bytes = b""
    lookup: Lookup | None = None
    orphan: Callable[[Admission | None, bool], None] | None = None


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):  # a token id of a pre-tokenised prompt
        return 1
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    return 0


def _json_bytes(value: Any) -> int:
    """UTF-8 bytes of ``value`` rendered as JSON the way chat templates render ``tools`` (Jinja's ``tojson``:
    ``", "`` and ``": "`` separators, non-ASCII as is) — keys, numbers, literals and punctuation included: a tool
    schema is mostly key names (its parameters), which :func:`_text_bytes` (values only) counted as nothing."""
    return len(json.dumps(value, ensure_ascii=False).encode())


def _arguments_bytes(args: Any) -> int:
    """UTF-8 bytes of a tool call's ``arguments`` as a chat template renders them. vLLM (and SGLang) parse a JSON
    string into an object before the template renders it with ``tojson`` (:func:`_json_bytes`), and take an object as
    it is: the rendered form is longer than the string sent — ``", "`` and ``": "`` separators, a number as Python
    prints it (``1e15`` → ``1000000000000000.0``, 4 bytes → 18) — and an object's keys are text :func:`_text_bytes`
    does not count. The larger of the two; the string as sent when it is no JSON (the upstream refuses it)."""
    sent = _text_bytes(args)
    try:
        rendered = _json_bytes(json.loads(args) if isinstance(args, str) else args)
    except (ValueError, RecursionError):
        return sent
    return max(sent, rendered)


def _messages_bytes(messages: list[Any]) -> int:
    """UTF-8 bytes of a messages list's text (:func:`_text_bytes`), each tool call's ``arguments`` counted as the
    template renders them (:func:`_arguments_bytes`)."""
    total = _text_bytes(messages)
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and fn.get("arguments") is not None:
                total += _arguments_bytes(fn["arguments"]) - _text_bytes(fn["arguments"])
    return total


def requested_choices(body: dict[str, Any]) -> int:
    """Choices ``body`` has generated: ``n`` (or ``best_of`` when larger) × prompts of a completions batch."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    best_of = body.get("best_of")
    if isinstance(best_of, int) and not isinstance(best_of, bool) and best_of > n:
        n = best_of  # generated server-side and billed, even if only n come back
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        n *= len(prompt)  # /v1/completions: n completions per prompt of a batch
    return n


def _forced_extra_prompt(tier: TierConfig) -> int:
    """Bytes phase 2 of budget forcing adds to the prompt around the thought (``gateway/thinking/forcing.py``:
    the opening ``<think>\\n``, the closing marker, either one, and the assistant message's template overhead)."""
    marker = tier.end_of_thinking.strip() or "</think>"
    return (len(FORCED_THINK_OPEN.encode()) + max(len(tier.end_of_thinking.encode()), len(marker.encode()) + 2)
            + MESSAGE_OVERHEAD_TOKENS)


def call_bound(prompt: int, choices: int, asked: Any, tier: TierConfig) -> tuple[int, int]:
    """(prompt tokens, completion tokens) one request may be billed on ``tier``, at most.

    A ``native``/``off`` tier: the prompt once, ``choices`` × min(asked, cap) completion tokens. A ``forced`` tier
    (two-phase budget forcing) runs each choice as its own two calls: phase 1 the prompt, generating a thought
    of at most min(thinking_budget, max_tokens); phase 2 the prompt again plus that thought plus the markers,
    generating at most max(1, max_tokens − thought) — so per choice 2 × prompt + thought + markers prompt tokens
    and max_tokens + 1 completion tokens. (The thought re-sent in phase 2 is the text the upstream generated;
    its tokens are bounded by the count phase 1 reported.) A ``prompted`` tier (a dial model) carries the dial
    instruction appended to the prompt; with ``hard_stop: forced`` it is served by the same forcing with
    :func:`gateway.config.prompted_hard_stop` of its budget as the thought bound, with ``hard_stop: native`` in
    one pass (the prompt once, as a ``native`` tier).
    """
    cap = tier.max_tokens
    m = min(asked, cap) if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else cap
    if tier.budget_mode not in ("forced", "prompted"):
        return prompt, choices * m
    budget = tier.thinking_budget
    if tier.budget_mode == "prompted":
        # the dial instruction appended to the prompt (a space + the filled-in text: at most the tier's budget's
        # digits, the request's own budget is smaller; on an unlimited tier with a thinking_budget_range, at most
        # the range's maximum's, which a request's budget is clamped to) and forcing's hard stop above that budget
        stated = budget if budget is not None else (tier.thinking_budget_range or (0, 0))[1]
        prompt += 1 + len(tier.budget_prompt.format(budget=stated).encode())
        if tier.hard_stop == "native":
            return prompt, choices * m
        budget = prompted_hard_stop(budget) if budget is not None else None
    thought = min(budget if budget is not None else m, m)
    return choices * (2 * prompt + thought + _forced_extra_prompt(tier)), choices * (m + 1)


def estimate(body: dict[str, Any], tiers: Iterable[TierConfig]) -> Estimate:
    """Upper bounds of cost and tokens of ``body`` on any of ``tiers`` (the tiers one upstream call may reach:
    the tier and its fallbacks).

    Prompt: UTF-8 bytes of the messages/prompt (a byte-level BPE token covers ≥ 1 byte; a token id counts 1; a
    tool call's ``arguments`` as the template renders them: :func:`_arguments_bytes`) and of ``tools``/``functions``
    as the JSON a template renders (keys included: :func:`_json_bytes`), so are vLLM's ``documents`` and
    ``chat_template_kwargs``, plus
    template overhead, priced at the dearer of the input and cached-input rates; completion: choices × min(requested
    ``max_tokens``/``max_completion_tokens``, tier cap), where choices = ``n`` (or ``best_of`` when larger) × prompts
    in a completions batch. A forced-thinking tier
    bills per choice its two phases (:func:`call_bound`). The maximum over ``tiers``.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        prompt = _messages_bytes(messages) + MESSAGE_OVERHEAD_TOKENS * len(messages)
    else:  # a completion's suffix is prompt text too (fill-in-the-middle), once per prompt of a batch
        given = body.get("prompt")
        batch = len(given) if isinstance(given, list) and given and not all(isinstance(p, int) for p in given) else 1
        prompt = _text_bytes(given) + _text_bytes(body.get("suffix")) * batch
    tools = [body.get(k) for k in ("tools", "functions") if body.get(k)]
    if tools:
        prompt += _json_bytes(tools) + TOOLS_OVERHEAD_TOKENS
    # vLLM's chat extras a template renders into the prompt: retrieved documents, and the template's own arguments
    rendered = [body.get(k) for k in ("documents", "chat_template_kwargs") if body.get(k)]
    if rendered:
        prompt += _json_bytes(rendered)
    prompt += REQUEST_OVERHEAD_TOKENS
    choices = requested_choices(body)
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    micro, tokens, generated, read = 0, prompt, 0, prompt
    for tier in tiers:
        billed_prompt, completion = call_bound(prompt, choices, asked, tier)
        p = tier.prices
        cached = billed_prompt if p.cached_input_usd_per_mtok > p.input_usd_per_mtok else 0
        micro = max(micro, cost_micro_usd(p, prompt_tokens=billed_prompt, cached_tokens=cached,
                                          completion_tokens=completion))
        tokens = max(tokens, billed_prompt + completion)
        generated = max(generated, completion)
        read = max(read, billed_prompt)
    # The prompt bound counts bytes: an image, audio or file part (by URL: a few dozen bytes) bills far more tokens
    # than that, so a request carrying one has no prompt bound (a killed call's record is billed as it claims)
    return Estimate(micro, tokens, generated, None if has_media(messages if isinstance(messages, list)
                                                                 else body.get("prompt")) else read)


def embedding_estimate(text: str, tier: TierConfig) -> Estimate:
    """Upper bounds of one embedding call of ``text`` on ``tier``: its UTF-8 bytes plus the request overhead,
    as prompt tokens at the dearer input rate; no completion."""
    prompt = len(text.encode()) + REQUEST_OVERHEAD_TOKENS
    p = tier.prices
    cached = prompt if p.cached_input_usd_per_mtok > p.input_usd_per_mtok else 0
    return Estimate(cost_micro_usd(p, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=0), prompt,
                    prompt=prompt)


@dataclass(frozen=True, slots=True)
class LevelState:
    """A level as admission saw it: spend and open reservations (micro-USD) of the day and month."""

    level: Level
    spent_day_micro: int
    spent_month_micro: int
    reserved_micro: int


@dataclass(frozen=True, slots=True)
class RateState:
    """A key's RPM and TPM windows right after an admitted call (its own request and token estimate counted), for
    OpenAI's ``x-ratelimit-*`` response headers. ``*_limit``: the key's limit (None: not set); ``*_remaining``: what
    is left of it now (≥ 0; tokens count in-flight calls at their upper-bound estimate until they settle);
    ``*_reset_ms``: ms until the sliding window holds nothing of the past (OpenAI's "resets to its initial state")."""

    requests_limit: int | None = None
    requests_remaining: int = 0
    requests_reset_ms: int = 0
    tokens_limit: int | None = None
    tokens_remaining: int = 0
    tokens_reset_ms: int = 0

    @classmethod
    def of(cls, lim: KeyLimits, tail: Sequence[Any]) -> RateState | None:
        """From the :data:`RATE_FIELDS` values of an admitted reply; None when the key has neither limit."""
        if lim.rpm is None and lim.tpm is None:
            return None
        ru, rr, tu, tr = (int(v) for v in tail[:RATE_FIELDS])
        rpm = lim.rpm if lim.rpm is not None and ru >= 0 else None
        tpm = lim.tpm if lim.tpm is not None and tu >= 0 else None
        return cls(rpm, max(0, rpm - ru) if rpm is not None else 0, rr, tpm, max(0, tpm - tu) if tpm is not None
                   else 0, tr)

    def headers(self) -> dict[str, str]:
        """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (OpenAI's names; reset as ``6m0s`` / ``20s``)
        for the limits that are set."""
        h: dict[str, str] = {}
        if self.requests_limit is not None:
            h["x-ratelimit-limit-requests"] = str(self.requests_limit)
            h["x-ratelimit-remaining-requests"] = str(self.requests_remaining)
            h["x-ratelimit-reset-requests"] = duration(self.requests_reset_ms)
        if self.tokens_limit is not None:
            h["x-ratelimit-limit-tokens"] = str(self.tokens_limit)
            h["x-ratelimit-remaining-tokens"] = str(self.tokens_remaining)
            h["x-ratelimit-reset-tokens"] = duration(self.tokens_reset_ms)
        return h


def duration(ms: int) -> str:
    """``ms`` as OpenAI writes a rate-limit reset: ``0s``, ``20s``, ``1m30s`` (whole seconds, rounded up)."""
    m, sec = divmod(max(0, math.ceil(ms / 1000)), 60)
    return f"{m}m{sec}s" if m else f"{sec}s"


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted upstream call. ``where``: ``redis`` (reservations in Redis), ``local`` (fail-open, process
    counters), ``none`` (under no budget or limit). Spend figures are micro-USD read at admission (None if not
    read); ``levels`` the budget levels seen (key first)."""

    key_id: str
    reservation_id: str
    where: Literal["redis", "local", "none"]
    estimate: Estimate
    spent_day_micro: int | None = None
    spent_month_micro: int | None = None
    levels: tuple[LevelState, ...] = ()
    #: the :class:`Rider` ran in the admission call (its write-ahead record is in Redis)
    rode: bool = False
    #: the reply of the rider's cache lookup (``cache_lookup``'s), None when there was none
    lookup_reply: list[Any] | None = None
    #: the key's RPM/TPM windows after this call (``x-ratelimit-*``); None when it has neither limit or when the
    #: call was not decided in Redis
    rate: RateState | None = None


@functools.lru_cache(maxsize=4)
def _utc_day(day_index: int) -> tuple[str, str, int, float]:
    """UTC day ``day_index`` (epoch s // 86400; POSIX days are 86,400 s): its ``YYYY-MM-DD``, its ``YYYY-MM``, the
    epoch s of its end and of its month's end. Cached: every admission asks, the answer changes once a day."""
    dt = datetime.fromtimestamp(day_index * 86400, UTC)
    last = calendar.monthrange(dt.year, dt.month)[1]
    month_end = datetime(dt.year, dt.month, last, tzinfo=UTC).timestamp() + 86400
    day = dt.strftime("%Y-%m-%d")
    return day, day[:7], (day_index + 1) * 86400, month_end


def _period_ends(now: float) -> tuple[int, int]:
    _, _, day_end, month_end = _utc_day(int(now // 86400))
    return max(1, math.ceil(day_end - now)), max(1, math.ceil(month_end - now))


def _day_month(now: float) -> tuple[str, str]:
    day, month, _, _ = _utc_day(int(now // 86400))
    return day, month


def _usd(micro: int) -> str:
    return f"${micro_to_usd(micro)}"


def refusal(code: str, what: str, retry_after_s: int, key_id: str, level: Level | None = None,
            est_micro: int | None = None, budget: int | None = None, spent: int | None = None,
            reserved: int | None = None, mode: str = "hard") -> RateLimited:
    """The 429 error for a refusal (OpenAI shape, ``Retry-After``; budget refusals also
    ``x-thinkgate-budget-level``, RPM/TPM refusals ``x-ratelimit-*`` with ``budget`` the limit). The message
    names the level, the period, the estimate and what remains."""
    headers = {"retry-after": str(int(retry_after_s))}
    if code != "budget_exceeded":
        msg = f"key {key_id!r}: {what.upper()} limit reached"
        if budget is not None and what in ("rpm", "tpm"):  # ``budget``: the limit; OpenAI's headers on its 429s too
            unit = "requests" if what == "rpm" else "tokens"
            headers |= {f"x-ratelimit-limit-{unit}": str(budget), f"x-ratelimit-remaining-{unit}": "0",
                        f"x-ratelimit-reset-{unit}": duration(int(retry_after_s) * 1000)}
            msg += (f" ({budget} {unit} per minute, sliding 60 s window); the window has room again in "
                    f"{int(retry_after_s)} s")
        if retry_after_s > 60:  # the SDKs ignore a Retry-After over 60 s and retry at once (as for budgets, below)
            headers["x-should-retry"] = "false"
        return RateLimited(msg, code=code, headers=headers)
    lvl = level or Level("key", key_id)
    who = f"key {key_id!r}" if lvl.kind == "key" else lvl.label
    period = "daily" if what == "day" else "monthly"
    msg = f"{who}: {period} budget exhausted"
    if budget is not None and spent is not None:
        left = max(0, budget - spent - (reserved or 0))
        if left > 0:  # room is left, only not enough for this request's estimate: "exhausted" would mislead
            msg = f"{who}: {period} budget would be exceeded by this request"
        elif spent < budget and retry_after_s <= 1:  # held by reservations of requests in flight, not by spend
            msg = f"{who}: {period} budget fully reserved by requests in flight"
        msg += f" ({_usd(budget)}; spent {_usd(spent)}, reserved by requests in flight {_usd(reserved or 0)}"
        msg += f", remaining {_usd(left)})"
        if mode == "hard" and est_micro is not None:
            msg += f"; this request may cost up to {_usd(est_micro)} (its estimate)"
            if est_micro <= budget and left > 0:
                # it fits the budget, not what is left: its estimate (max_tokens at the dearest tier it may be
                # served by, fallbacks included) is what the client can lower
                msg += f": a lower {CAP_FIELDS} lowers it"
            if est_micro > budget:
                # no wait lets this request in: say what would, and send no Retry-After a client would obey
                msg += f", more than the whole {period} budget: lower {CAP_FIELDS_AND_N}, or raise the budget"
                headers.pop("retry-after")
    if retry_after_s <= 1 and "retry-after" in headers:
        msg += "; blocked by requests in flight, retry shortly"
    elif "retry-after" not in headers or retry_after_s > 60:
        # no wait lets it in, or not before the period ends: the OpenAI and Anthropic SDKs would retry it at once
        # (they ignore a Retry-After over 60 s, and retry a 429 without one)
        headers["x-should-retry"] = "false"
    headers["x-thinkgate-budget-level"] = lvl.id if lvl.kind != "key" else "key"
    exc = RateLimited(msg, code=code, headers=headers)
    if budget is not None and spent is not None and spent >= budget:
        exc.exhausted = (lvl, what, spent)
    return exc


@dataclass
class _LocalLevel:
    day: str = ""
    spent_day: int = 0
    month: str = ""
    spent_month: int = 0
    reserved: dict[str, int] = field(default_factory=dict)  # reservation id -> micro


@dataclass
class _LocalRate:
    reserved_tokens: dict[str, int] = field(default_factory=dict)
    rpm: dict[int, float] = field(default_factory=dict)  # window -> requests
    tpm: dict[int, float] = field(default_factory=dict)  # window -> tokens


class LocalCounters:
    """Process-local approximations used when Redis is down (``fail_open``); same rules as ``ADMIT_LUA``."""

    def __init__(self) -> None:
        self._levels: dict[str, _LocalLevel] = {}
        self._rates: dict[str, _LocalRate] = {}

    def _get(self, level_id: str, now: float) -> _LocalLevel:
        st = self._levels.setdefault(level_id, _LocalLevel())
        day, month = _day_month(now)
        if st.day != day:
            st.day, st.spent_day = day, 0
        if st.month != month:
            st.month, st.spent_month = month, 0
        return st

    def refresh(self, key_id: str, now: float, spent_day: int, spent_month: int, level_id: str | None = None) -> None:
        """Take the spend read from Redis as the new baseline (of the key, or of ``level_id``)."""
        st = self._get(level_id or f"key:{key_id}", now)
        st.spent_day, st.spent_month = spent_day, spent_month

    def note(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float,
             levels: Sequence[Level] = ()) -> None:
        """Count an admitted request (also those admitted by Redis, so the windows are warm for an outage)."""
        rate = self._rates.setdefault(lim.key_id, _LocalRate())
        w = int(now * 1000) // WINDOW_MS
        for windows in (rate.rpm, rate.tpm):
            for old in [x for x in windows if x < w - 1]:
                del windows[old]
        rate.rpm[w] = rate.rpm.get(w, 0) + 1
        rate.tpm[w] = rate.tpm.get(w, 0) + est.tokens
        rate.reserved_tokens[reservation_id] = est.tokens
        for lvl in (lim.level, *levels):
            self._get(lvl.id, now).reserved[reservation_id] = est.micro_usd

    def check(self, lim: KeyLimits, now: float, est: Estimate | None = None, mode: str = "soft",
              levels: Sequence[Level] = ()) -> tuple[Any, ...] | None:
        """The refusal (code, what, retry_after_s, level, budget, spent, reserved) for one more request now,
        or None to admit."""
        e = est.micro_usd if est is not None else 0
        day_end, month_end = _period_ends(now)
        for lvl in (lim.level, *levels):
            st = self._get(lvl.id, now)
            reserved = sum(st.reserved.values())
            for budget, spent, what, end in ((lvl.day_micro, st.spent_day, "day", day_end),
                                             (lvl.month_micro, st.spent_month, "month", month_end)):
                if budget is None:
                    continue
                if mode == "hard":
                    if spent + e > budget:
                        return ("budget_exceeded", what, end, lvl, budget, spent, reserved)
                    if spent + reserved + e > budget:
                        return ("budget_exceeded", what, 1, lvl, budget, spent, reserved)
                else:
                    if spent >= budget:
                        return ("budget_exceeded", what, end, lvl, budget, spent, reserved)
                    if spent + reserved >= budget:
                        return ("budget_exceeded", what, 1, lvl, budget, spent, reserved)
        rate = self._rates.get(lim.key_id, _LocalRate())
        now_ms = int(now * 1000)
        w, elapsed = now_ms // WINDOW_MS, now_ms % WINDOW_MS
        frac = (WINDOW_MS - elapsed) / WINDOW_MS
        retry = max(1, math.ceil((WINDOW_MS - elapsed) / 1000))
        if lim.rpm is not None and rate.rpm.get(w - 1, 0) * frac + rate.rpm.get(w, 0) + 1 > lim.rpm:
            return ("rate_limit_exceeded", "rpm", retry, None, lim.rpm, None, None)
        if lim.tpm is not None and rate.tpm.get(w - 1, 0) * frac + rate.tpm.get(w, 0) >= lim.tpm:
            return ("rate_limit_exceeded", "tpm", retry, None, lim.tpm, None, None)
        return None

    def settle(self, event: UsageEvent) -> None:
        """Release the event's reservations; add its cost to the local spend and correct its TPM window."""
        if event.audit:
            return
        for level_id in event_level_ids(event.key_id, event.tags):
            st = self._levels.get(level_id)
            if st is None:
                continue
            st.reserved.pop(event.event_id, None)
            if event.day == st.day:
                st.spent_day += event.cost_micro_usd
            if event.month == st.month:
                st.spent_month += event.cost_micro_usd
        rate = self._rates.get(event.key_id)
        if rate is not None:
            tokens = rate.reserved_tokens.pop(event.event_id, 0)
            if event.minute in rate.tpm:
                rate.tpm[event.minute] += event.upstream_tokens - tokens


class Limits:
    """Admission for every upstream call; one per process."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, cfg: LimitsConfig) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.cfg = cfg
        self.local = LocalCounters()
        self._script = FastScript(handle, ADMIT_LUA)
        self._rollback = FastScript(handle, ROLLBACK_LUA)
        self._renew = FastScript(handle, RENEW_LUA)
        mode = cfg.admission_script
        #: one script per level group: ``grouped``, or a Cluster whose keys' own levels live in their tenant slots
        #: (``RedisKeys.per_key_slots``: the key's level in its slot, the levels above it in the shared one — a
        #: single script would span slots). A Cluster with every level in the shared slot (``cluster_placement:
        #: shared``) runs the one script, as one server does: atomic over every level, one call.
        self.grouped = mode == "grouped" or self.keys.per_key_slots
        #: one script call for the whole hot path (admission + write-ahead record + cache lookup, ``HOT_LUA``): a
        #: single Redis (standalone or Sentinel: every key on one server). On Cluster the cache entry lives in
        #: its tenant's slot, away from the shared ``{tg:}`` one: per-slot calls there (even with ``single``).
        self.fused = not self.grouped and isinstance(self.redis, Redis)
        self._hot = FastScript(handle, HOT_LUA)
        #: grouped rollbacks an outage stopped (keys, args), sent again by :meth:`_roll_back_later`
        self._unrolled: deque[tuple[list[str], list[Any]]] = deque(maxlen=UNROLLED_MAX)
        self._retry: asyncio.Task[None] | None = None
        #: one ERROR line per distinct refused admission script's error (it names the key) a minute: each recurs per
        #: request
        self._refused_log = LogThrottle(REFUSED_LOG_EVERY_S)
        #: script calls Redis refused with an error reply (each wrote nothing), by :data:`REFUSED_SCRIPTS` —
        #: ``thinkgate_admission_refused_scripts_total`` (the log line is once a minute; under ``fail_open`` such an
        #: admission is no rejection either, so nothing else counts them)
        self.refused_scripts: dict[str, int] = dict.fromkeys(REFUSED_SCRIPTS, 0)

    def _level_keys(self, lvl: Level, day: str, month: str) -> list[str]:
        k = self.keys
        resv = k.level_reservations(lvl.kind, lvl.name)
        definition = resv if lvl.kind == "key" else k.level_budget(lvl.kind, lvl.name)
        return [k.level_day(lvl.kind, lvl.name, day), k.level_month(lvl.kind, lvl.name, month), resv, definition]

    async def admit(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float,
                    levels: Sequence[Level] = (), fallback: Sequence[Level] | None = None,
                    rider: Rider | None = None, mode: BudgetMode | None = None) -> Admission:
        """Admit one upstream call of key ``lim`` at ``now`` (epoch s; the request's ``ts``) or raise.

        ``levels``: every level above the key (``BudgetLevels.candidates``: each of its tags, then global) with
        the config's budgets; the script reads each level's definition in Redis (``thinkgate budgets set``),
        which overrides them, so a budget set or changed is in force for the next request on every replica.
        ``fallback``: the levels as the process-local copy has them (``BudgetLevels.above_key``), used only
        while Redis is down (default: ``levels``). ``reservation_id`` must be the id of the call's usage event
        (metering settles by it). Raises :class:`~gateway.errors.RateLimited` (429, ``budget_exceeded`` /
        ``rate_limit_exceeded``, ``Retry-After``) or :class:`LimitsUnavailable` (503, Redis down and
        ``fail_closed``). ``rider``: the write-ahead record and cache lookup to do in the same call when
        :attr:`fused` (``Admission.rode`` says whether they were; else the caller does them on its own).
        ``mode``: the budget mode of this call at every level (default ``limits.budget_mode``); the shadow's calls
        pass ``hard`` — its ``max_usd_day`` is a cap on the gateway's own spend, whatever the keys' mode.
        """
        if lim.unlimited and not levels and not fallback:  # the key alone, under nothing: nothing to check
            return Admission(lim.key_id, reservation_id, "none", est)
        mode = mode or self.cfg.budget_mode
        local_levels = [lv for lv in (levels if fallback is None else fallback) if lv.budgeted]
        all_levels = [lim.level, *levels]
        day, month = _day_month(now)
        try:
            if self.grouped:
                states, rate = await self._admit_grouped(lim, reservation_id, est, now, all_levels, day, month, mode)
            else:
                if not self.fused:
                    rider = None
                res = await self.breaker.call(lambda: self._run(lim, reservation_id, est, now, all_levels, day,
                                                                month, rate=True, rider=rider, mode=mode))
                return self._admitted(lim, reservation_id, est, now, all_levels, mode, rider, res)
        except RedisDown as down:
            try:
                return self._admit_locally(lim, reservation_id, est, now, local_levels, mode=mode)
            except GatewayError as refused:
                # a call was sent (an outage error, not the open breaker's refusal): it may have run all the same
                refused.outcome_unknown = down.__cause__ is not None
                raise
        except ResponseError as exc:
            if isinstance(exc, NoScriptError):  # FastScript loads a flushed script itself: not a refusal
                raise
            # Redis answers but refused the script (a key of the wrong type, a counter that is no integer; or it
            # cannot write now: READONLY, OOM…): the script wrote nothing (all or nothing). Undecidable in Redis, so
            # decided as with Redis down — fail_closed refuses (503), fail_open applies the local counters — and
            # never admitted unchecked; the breaker stays closed (other keys, and metering, go on)
            self.refused_scripts["admit"] += 1
            self._log_refused(exc)
            return self._admit_locally(lim, reservation_id, est, now, local_levels, script_refused=True, mode=mode)
        return self._noted(lim, reservation_id, est, now, states, rate)

    def _noted(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float, states: list[LevelState],
               rate: RateState | None, rode: bool = False, reply: list[Any] | None = None) -> Admission:
        """The admission Redis made (``states``: its levels, key first): in the local counters, then returned."""
        for st in states:
            self.local.refresh(lim.key_id, now, st.spent_day_micro, st.spent_month_micro, st.level.id)
        self.local.note(lim, reservation_id, est, now, [st.level for st in states[1:] if st.level.budgeted])
        return Admission(lim.key_id, reservation_id, "redis", est, states[0].spent_day_micro,
                         states[0].spent_month_micro, tuple(states), rode=rode, lookup_reply=reply, rate=rate)

    def _admitted(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float, all_levels: list[Level],
                  mode: BudgetMode, rider: Rider | None, res: list[Any]) -> Admission:
        """The admission of one script call's reply ``res`` over ``all_levels`` (``HOT_LUA``'s with ``rider``), or
        raise its refusal."""
        states = self._states(lim, est, res, all_levels, mode)
        rate = RateState.of(lim, res[1 + 5 * len(all_levels):])
        reply = None
        if rider is not None and rider.lookup is not None:
            reply = list(res[1 + 5 * len(all_levels) + RATE_FIELDS:])
        return self._noted(lim, reservation_id, est, now, states, rate, rode=rider is not None, reply=reply)

    def _orphaned(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float, all_levels: list[Level],
                  mode: BudgetMode, rider: Rider, outcome: Any) -> None:
        """What the hot-path script call of a cancelled caller did (``outcome``, :data:`gateway.state.redis.Orphan`),
        told to ``rider.orphan``: the admission it made, else None, and whether what it did is unknown."""
        assert rider.orphan is not None
        admission, unknown = None, False
        if isinstance(outcome, list):
            with contextlib.suppress(RateLimited):  # refused: nothing of it was written
                admission = self._admitted(lim, reservation_id, est, now, all_levels, mode, rider, outcome)
        elif isinstance(outcome, BaseException) and not isinstance(outcome, ResponseError):
            # sent or not, unknown (a timeout, a lost connection, an interrupted exchange): the caller settles what it
            # may have written ("Outcome unknown" above: its usage event settles what is there, a late script then
            # writes nothing) — left, the record stayed open for the reconciler and the reservations held the budgets
            # until their TTL
            log.warning("admission %s: its caller was cancelled and the script's outcome is unknown (%r); settled as "
                        "a call never sent", reservation_id, outcome)
            unknown = True
        rider.orphan(admission, unknown)

    def _admit_locally(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float,
                       levels: list[Level], script_refused: bool = False, mode: BudgetMode = "hard") -> Admission:
        """Redis is down (or refused the admission script: ``script_refused``): admit under nothing, refuse
        (``fail_closed``) or decide on the local counters."""
        if lim.unlimited and not levels:  # under no budget or limit this process knows of: nothing to check
            return Admission(lim.key_id, reservation_id, "none", est)
        if self.cfg.on_redis_down == "fail_closed":
            retry = max(1, math.ceil(self.breaker.cooldown_s))
            # a refusal names a key only when one is at fault (not for OOM, BUSY…): the log line says which
            why = ("Redis refused the admission script; the gateway logged its error" if script_refused
                   else "Redis unreachable")
            raise LimitsUnavailable(f"usage limits cannot be checked ({why}); retry later",
                                    headers={"retry-after": str(retry)})
        refused = self.local.check(lim, now, est, mode, levels)
        if refused is not None:
            code, what, retry, lvl, budget, spent, reserved = refused
            raise refusal(code, what, retry, lim.key_id, lvl, est.micro_usd, budget, spent, reserved, mode)
        self.local.note(lim, reservation_id, est, now, levels)
        return Admission(lim.key_id, reservation_id, "local", est)

    def _log_refused(self, exc: ResponseError) -> None:
        """One ERROR line for an admission script Redis refused — its error names the command and the key
        (``gateway/state/undo.py``) — at most every :data:`REFUSED_LOG_EVERY_S` per distinct error, with the count of
        the ones not logged since."""
        error = str(exc)
        if (held := self._refused_log.due(error)) is None:
            return
        mode = ("refused with 503 limits_unavailable" if self.cfg.on_redis_down == "fail_closed" else
                "decided on this process's counters (fail_open)")
        log.error("admission script refused by Redis, nothing of it written; its requests are %s until the key is "
                  "fixed or deleted%s: %s", mode, held_back(held), error)

    async def _run(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float, group: Sequence[Level],
                   day: str, month: str, rate: bool, rider: Rider | None = None,
                   mode: BudgetMode | None = None) -> list[Any]:
        """One ``ADMIT`` call over ``group`` (with the key's RPM/TPM when ``rate``); ``HOT_LUA`` with ``rider``;
        ``mode``: the budget mode (default ``limits.budget_mode``)."""
        now_ms = int(now * 1000)
        day_end, month_end = _period_ends(now)
        keys: list[str] = []
        args: list[Any] = [now_ms, mode or self.cfg.budget_mode, _or_minus(lim.rpm) if rate else -1,
                           _or_minus(lim.tpm) if rate else -1, est.micro_usd, est.tokens, reservation_id,
                           int(self.cfg.reservation_ttl_s * 1000), day_end, month_end, len(group)]
        for lvl in group:
            keys += self._level_keys(lvl, day, month)
            tokens = est.tokens if lvl.kind == "key" and rate and lim.tpm is not None else 0
            args += [_or_minus(lvl.day_micro), _or_minus(lvl.month_micro), tokens, 0 if lvl.kind == "key" else 1]
        if rate and (lim.rpm is not None or lim.tpm is not None):
            w = now_ms // WINDOW_MS
            k = self.keys
            keys += [k.rpm(lim.key_id, w), k.rpm(lim.key_id, w - 1), k.tpm(lim.key_id, w), k.tpm(lim.key_id, w - 1)]
        if rider is None:
            # with the other admissions of this loop pass: one write for all (FastLane.exchange)
            return list(await self._script(keys=keys, args=args, coalesce="request"))
        orphan = None
        if rider.orphan is not None:
            orphan = functools.partial(self._orphaned, lim, reservation_id, est, now, list(group),
                                       mode or self.cfg.budget_mode, rider)
        look = rider.lookup
        wal_key = rider.wal_key or keys[0]
        # the request's day's seen-set: a call that arrives after its request was refused and settled writes nothing
        seen = self.keys.seen(day)
        if look is None:
            keys += [wal_key, wal_key, wal_key, seen]
            args += [rider.record, reservation_id, 0, "", 0]
        else:
            keys += [wal_key, look.entry_key, look.lock_key, seen]
            args += [rider.record, reservation_id, 1, look.token, look.wait_ms]
        return list(await self._hot(keys=keys, args=args, coalesce="request", orphan=orphan))

    def _states(self, lim: KeyLimits, est: Estimate, res: list[Any], group: Sequence[Level],
                mode: BudgetMode | None = None) -> list[LevelState]:
        """The level states (budgets as the script applied them) of an admitted reply, or raise its refusal."""
        if int(res[0]) == 0:
            _, code, index, what, retry, budget, spent, reserved = res
            i = int(index)
            refused_at = group[i - 1] if i >= 1 else None
            if refused_at is not None:
                refused_at = Level(refused_at.kind, refused_at.name, *_budgets(refused_at, _s(what), int(budget)))
            raise refusal(_s(code), _s(what), int(retry), lim.key_id, refused_at, est.micro_usd, int(budget),
                          int(spent), int(reserved), mode or self.cfg.budget_mode)
        out = []
        for i, lvl in enumerate(group):
            d, m = int(res[4 + 5 * i]), int(res[5 + 5 * i])
            seen = Level(lvl.kind, lvl.name, d if d >= 0 else None, m if m >= 0 else None)
            out.append(LevelState(seen, int(res[1 + 5 * i]), int(res[2 + 5 * i]), int(res[3 + 5 * i])))
        return out

    async def _admit_grouped(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float,
                             all_levels: list[Level], day: str, month: str, mode: BudgetMode | None = None
                             ) -> tuple[list[LevelState], RateState | None]:
        """One atomic check-and-reserve per level group — the key's level with its RPM/TPM first, then each level
        above it (``grouped``) or, where the key's level is in its tenant slot, every level above it in one call
        (they share the shared slot); when one refuses, the levels already reserved are rolled back
        (``ROLLBACK_LUA``) and the refusal raised. Between a group's reservation and a rollback, another request may
        see it and be refused spuriously; no level is ever overspent (each group's check is atomic). Raises
        RedisDown (the reservations made stay until their TTL: they can only refuse, never admit, too much), or the
        ``ResponseError`` of a group's script that Redis refused (it wrote nothing, ``gateway/state/undo.py``) once
        the groups before it are rolled back: Redis answers, so nothing of the admission is left behind."""
        states: list[LevelState] = []
        done: list[Level] = []
        rate_state = None
        # the key's level first (with its RPM/TPM); then each level above in a call of its own — or, where the key's
        # level is in its tenant slot and the levels above all share the shared slot, those in one call
        above = all_levels[1:]
        groups = [[all_levels[0]], *([above] if self.keys.per_key_slots and above else ([lv] for lv in above))]
        for i, group in enumerate(groups):
            rate = i == 0
            try:
                res = await self.breaker.call(functools.partial(self._run, lim, reservation_id, est, now, group, day,
                                                                month, rate, mode=mode))
            except ResponseError:
                await self._roll_back(lim, reservation_id, est, now, done)
                raise
            try:
                states += self._states(lim, est, res, group, mode)
            except RateLimited:
                await self._roll_back(lim, reservation_id, est, now, done)
                raise
            if rate:
                rate_state = RateState.of(lim, res[1 + 5 * len(group):])
            done += group
        return states, rate_state

    async def _roll_back(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float,
                         levels: Sequence[Level]) -> None:
        """Release ``reservation_id`` at ``levels`` (one call per level; the key's takes back its RPM/TPM). Calls an
        outage stops are kept (bounded: :data:`UNROLLED_MAX`) and sent once Redis answers; never raises RedisDown.
        A call Redis refuses (its script wrote nothing) is logged and left to the reservation's TTL — it can only
        refuse too much —, the others go on; nothing raised: the caller's own refusal or error is what the client
        gets."""
        w = int(now * 1000) // WINDOW_MS
        calls: list[tuple[list[str], list[Any]]] = []
        for lvl in levels:
            keys = [self.keys.level_reservations(lvl.kind, lvl.name)]
            rpm, tokens = 0, 0
            if lvl.kind == "key" and (lim.rpm is not None or lim.tpm is not None):
                keys += [self.keys.rpm(lim.key_id, w), self.keys.tpm(lim.key_id, w)]
                rpm = 1 if lim.rpm is not None else 0
                tokens = est.tokens if lim.tpm is not None else 0
            calls.append((keys, [reservation_id, 1, rpm, tokens]))
        for i, (keys, args) in enumerate(calls):
            try:
                await self.breaker.call(functools.partial(self._rollback, keys=keys, args=args))
            except RedisDown:
                # kept and sent once Redis answers: left to their TTL (``limits.reservation_ttl_s``, 10 min) they
                # would refuse this tenant's requests spuriously all that while
                self._unrolled.extend(calls[i:])
                if self._retry is None or self._retry.done():
                    self._retry = asyncio.get_running_loop().create_task(self._roll_back_later())
                return
            except ResponseError as exc:
                self.refused_scripts["rollback"] += 1
                log.error("rollback of reservation %s refused by Redis, left to its TTL (%.0f s): %s", reservation_id,
                          self.cfg.reservation_ttl_s, exc)

    async def _roll_back_later(self) -> None:
        """Send the rollbacks an outage stopped, every breaker cooldown until none is left (the script is
        idempotent: a rollback sent twice takes nothing back twice)."""
        while self._unrolled:
            await asyncio.sleep(max(self.breaker.cooldown_s, 0.05))
            while self._unrolled and not self.breaker.is_open:
                keys, args = self._unrolled.popleft()  # taken first: a full deque's eviction cannot hit another
                try:
                    await self.breaker.call(functools.partial(self._rollback, keys=keys, args=args))
                except RedisDown:
                    if len(self._unrolled) < UNROLLED_MAX:  # full: this one, the oldest, is left to its TTL
                        self._unrolled.appendleft((keys, args))
                    break
                except Exception as exc:  # not an outage: this one is left to its TTL, the loop goes on
                    if isinstance(exc, ResponseError):
                        self.refused_scripts["rollback"] += 1
                    log.exception("rollback of reservation %s failed", args[0])

    async def close(self) -> None:
        """Stop retrying kept rollbacks (the gateway is stopping: those reservations expire with their TTL)."""
        if self._retry is not None and not self._retry.done():
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry

    async def renew(self, key_id: str, tags: Mapping[str, str], reservation_id: str, now: float) -> int:
        """Extend the open reservations of ``reservation_id`` (at the key, each tag, global) by
        ``reservation_ttl_s`` from ``now`` (epoch s): a stream that is still running. Returns the number of
        levels that still held it (0 when Redis is down: the local counters keep theirs until settled). Raises the
        ``ResponseError`` of a renewal Redis refused, counted in :attr:`refused_scripts` (the caller says so and
        tries again next round). On a single Redis one call for every level, all or nothing (``RENEW_LUA``); refused,
        it renewed nothing, and the levels are then tried one call each as grouped admission always does
        (:meth:`_renew_each`: every level Redis does not refuse is renewed, the first refusal raised once the last
        was tried) — one broken level's hash must not let the stream's reservations lapse at the healthy ones,
        where concurrent requests would no longer see them."""
        ttl = int(self.cfg.reservation_ttl_s * 1000)
        k = self.keys
        hashes = [k.reservations(key_id), *(k.level_reservations("tag", f"{a}={b}") for a, b in sorted(tags.items())),
                  k.level_reservations("global", "global")]
        args: list[str | int] = [reservation_id, int(now * 1000) + ttl, ttl]
        try:
            if not self.grouped:
                try:
                    return await self._renew_call(hashes, args)
                except ResponseError:  # renewed nothing (all or nothing): each level on its own, below
                    pass
            return await self._renew_each(hashes, args)
        except RedisDown:
            return 0

    async def _renew_each(self, hashes: Sequence[str], args: Sequence[str | int]) -> int:
        """Grouped renewal (Redis Cluster: each level's hash may be in a slot of its own): one ``RENEW`` call per
        level hash in ``hashes``, each all or nothing on its own. A level Redis refuses does not stop the ones after
        it — it used to: one broken level's hash let the reservations at every later level lapse at their TTL
        under a live stream, so concurrent requests no longer saw it there. Returns the number of levels that held
        the reservation; raises the first refusal (one per round, whatever the number of refused levels) after
        the last level was tried, or RedisDown at once (an outage: the next levels would fail the same way)."""
        total, refused = 0, None
        for h in hashes:
            try:
                total += await self._renew_call([h], args)
            except ResponseError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused
        return total

    async def _renew_call(self, keys: Sequence[str], args: Sequence[str | int]) -> int:
        """One ``RENEW`` call over ``keys``: the number of them that held the reservation. A refusal (an error
        reply: it renewed nothing) is counted in :attr:`refused_scripts` and raised; raises RedisDown."""
        try:
            return int(await self.breaker.call(functools.partial(self._renew, keys=keys, args=args)))
        except ResponseError as exc:
            if not isinstance(exc, NoScriptError):
                self.refused_scripts["renew"] += 1
            raise

    def settled(self, event: UsageEvent, result: RecordResult) -> None:
        """After metering: update the local approximations (Redis settled itself inside the metering write)."""
        self.local.settle(event)
        if result.day_cost_micro_usd is not None and result.month_cost_micro_usd is not None:
            self.local.refresh(event.key_id, event.ts, result.day_cost_micro_usd, result.month_cost_micro_usd)
        for level_id, (d, m) in result.levels.items():
            self.local.refresh(event.key_id, event.ts, d, m, level_id)


def _budgets(lvl: Level, what: str, budget: int) -> tuple[int | None, int | None]:
    """The budgets of a refused level with the one the script applied (it may differ from the local copy)."""
    return (budget, lvl.month_micro) if what == "day" else (lvl.day_micro, budget)


def _or_minus(v: int | None) -> int:
    return -1 if v is None else v


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
