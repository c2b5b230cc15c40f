"""Admission control: per-key budgets (USD per UTC day / month), RPM and TPM, decided atomically in Redis.

**Reserve, then settle.** Before the upstream call one Lua script (``ADMIT``) reads the key's spend so far
(the metering counters ``usage:key:{id}:d:{day}`` / ``:m:{month}``, ``cost_micro_usd``), the open
reservations of concurrent requests, and the RPM/TPM windows; it admits only when

- spend < budget **and** spend + open reservations < budget (for each of day and month), and
- RPM: requests in the sliding 60 s window + 1 ≤ ``rpm``; TPM: tokens in the window < ``tpm``,

and then, in the same atomic step, records a reservation (an upper bound of the request's cost and tokens,
see :func:`estimate`) under the request id, counts the request in the RPM window and the reserved tokens in
the TPM window. Metering settles it: the usage event's write (``gateway/state/metering.py``) deletes the reservation
and corrects the TPM window by the real token count, atomically with adding the real cost to the counters.
So concurrent requests see each other's reservations: 64 concurrent requests against a budget worth one
request admit one (the rest see ``spend + reserved ≥ budget``), and in general the overshoot is bounded by
one request's cost (the last request admitted while budget remained). Reservations of a crashed replica stop
counting after ``limits.reservation_ttl_s``. (LiteLLM checks spend after the fact and overshoots under
concurrency — BerriAI/litellm#34732.)

**Windows.** RPM/TPM use a sliding-window counter: ``used = prev·(1 − elapsed/60 s) + current`` over fixed
60 s windows (two keys per limit, no per-request entries); ``Retry-After`` is the time until the window has
slid far enough. Budget rejections say the seconds until the period ends (UTC midnight / month start), or 1 s
when only in-flight reservations block (they may settle below their estimate).

**Redis down.** ``limits.on_redis_down``: ``fail_closed`` refuses with 503 (``limits_unavailable``);
``fail_open`` applies the same rules to process-local counters: the spend last read from Redis plus this
process's own requests since, and this process's RPM/TPM windows (approximate: other replicas unseen).
Keys without budgets or limits never touch Redis here.
"""

from __future__ import annotations

import calendar
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal, Protocol

from gateway.config import LimitsConfig, TierConfig
from gateway.errors import LimitsUnavailable, RateLimited
from gateway.ledger.event import UsageEvent, cost_micro_usd, usd_to_micro
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys
from gateway.state.metering import RecordResult
from gateway.state.redis import RedisHandle

WINDOW_MS = 60_000
MESSAGE_OVERHEAD_TOKENS = 8  # chat template tokens per message, upper bound
REQUEST_OVERHEAD_TOKENS = 16

# KEYS: 1 key day usage hash, 2 key month usage hash, 3 reservations hash, 4 RPM current, 5 RPM previous,
#       6 TPM current, 7 TPM previous
# ARGV: 1 now ms, 2 day budget micro (-1 none), 3 month budget micro (-1), 4 rpm (-1), 5 tpm (-1),
#       6 estimated micro-USD, 7 estimated tokens, 8 reservation id, 9 reservation TTL ms,
#       10 seconds to the end of the day, 11 seconds to the end of the month
# Returns {1, spend day, spend month} or {0, code, what, retry_after_s, spend day, spend month}.
ADMIT_LUA = """
local now = tonumber(ARGV[1])
local W = 60000
local elapsed = now % W
local bday, bmonth = tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, tpm = tonumber(ARGV[4]), tonumber(ARGV[5])
local spent_day = tonumber(redis.call('HGET', KEYS[1], 'cost_micro_usd') or '0')
local spent_month = tonumber(redis.call('HGET', KEYS[2], 'cost_micro_usd') or '0')
local reserved = 0
if bday >= 0 or bmonth >= 0 then
  local r = redis.call('HGETALL', KEYS[3])
  for i = 1, #r, 2 do
    local m, exp = string.match(r[i + 1], '^(%d+)|%d+|(%d+)$')
    if not exp or tonumber(exp) <= now then
      redis.call('HDEL', KEYS[3], r[i])
    else
      reserved = reserved + tonumber(m)
    end
  end
end
local function over(budget, spent, period_end)
  if budget < 0 then return nil end
  if spent >= budget then return period_end end
  if spent + reserved >= budget then return 1 end
  return nil
end
local ra = over(bday, spent_day, tonumber(ARGV[10]))
if ra then return {0, 'budget_exceeded', 'day', ra, spent_day, spent_month} end
ra = over(bmonth, spent_month, tonumber(ARGV[11]))
if ra then return {0, 'budget_exceeded', 'month', ra, spent_day, spent_month} end
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
if rpm >= 0 then
  local cur = tonumber(redis.call('GET', KEYS[4]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[5]) or '0')
  if prev * frac + cur + 1 > rpm then
    return {0, 'rate_limit_exceeded', 'rpm', retry_s(rpm, cur, prev), spent_day, spent_month}
  end
end
if tpm >= 0 then
  local cur = tonumber(redis.call('GET', KEYS[6]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[7]) or '0')
  if prev * frac + cur >= tpm then
    return {0, 'rate_limit_exceeded', 'tpm', retry_s(tpm, cur, prev), spent_day, spent_month}
  end
end
if bday >= 0 or bmonth >= 0 or tpm >= 0 then
  local tokens = ARGV[7]
  if tpm < 0 then tokens = '0' end
  redis.call('HSET', KEYS[3], ARGV[8], ARGV[6] .. '|' .. tokens .. '|' .. (now + tonumber(ARGV[9])))
  redis.call('PEXPIRE', KEYS[3], ARGV[9])
end
if rpm >= 0 then
  redis.call('INCR', KEYS[4])
  redis.call('PEXPIRE', KEYS[4], 2 * W)
end
if tpm >= 0 then
  redis.call('INCRBY', KEYS[6], ARGV[7])
  redis.call('PEXPIRE', KEYS[6], 2 * W)
end
return {1, spent_day, spent_month}
"""




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


@dataclass(frozen=True, slots=True)
class Estimate:
    """Upper bounds of one request: cost (micro-USD) and tokens (prompt + completion)."""

    micro_usd: int
    tokens: int


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    return 0


def estimate(body: dict[str, Any], tiers: Iterable[TierConfig]) -> Estimate:
    """Upper bounds of cost and tokens of ``body`` on any of ``tiers`` (the tiers it may be routed to).

    Prompt: UTF-8 bytes of the messages/prompt (a byte-level BPE token covers ≥ 1 byte) plus template
    overhead; completion: ``n`` × min(requested ``max_tokens``/``max_completion_tokens``, tier cap).
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        prompt = _text_bytes(messages) + MESSAGE_OVERHEAD_TOKENS * len(messages)
    else:
        prompt = _text_bytes(body.get("prompt"))
    prompt += REQUEST_OVERHEAD_TOKENS
    n_asked = body.get("n")
    n = n_asked if isinstance(n_asked, int) and n_asked > 0 else 1
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    micro, tokens = 0, prompt
    for tier in tiers:
        completion = n * (min(asked, tier.max_tokens) if isinstance(asked, int) and asked > 0 else tier.max_tokens)
        cost = cost_micro_usd(tier.prices, prompt_tokens=prompt, cached_tokens=0, completion_tokens=completion)
        micro = max(micro, cost)
        tokens = max(tokens, prompt + completion)
    return Estimate(micro, tokens)


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request. ``where``: ``redis`` (reservation in Redis), ``local`` (fail-open, process
    counters), ``none`` (unlimited key). Spend figures are micro-USD read at admission (None if not read)."""

    key_id: str
    reservation_id: str
    where: Literal["redis", "local", "none"]
    estimate: Estimate
    spent_day_micro: int | None = None
    spent_month_micro: int | None = None


def _period_ends(now: float) -> tuple[int, int]:
    dt = datetime.fromtimestamp(now, UTC)
    day_end = datetime(dt.year, dt.month, dt.day, tzinfo=UTC).timestamp() + 86400
    last = calendar.monthrange(dt.year, dt.month)[1]
    month_end = datetime(dt.year, dt.month, last, tzinfo=UTC).timestamp() + 86400
    return max(1, math.ceil(day_end - now)), max(1, math.ceil(month_end - now))


def _day_month(now: float) -> tuple[str, str]:
    day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
    return day, day[:7]


def refusal(code: str, what: str, retry_after_s: int, key_id: str) -> RateLimited:
    """The 429 error for a refusal (OpenAI shape, ``Retry-After`` header)."""
    if code == "budget_exceeded":
        msg = f"key {key_id!r}: {'daily' if what == 'day' else 'monthly'} budget exhausted"
        if retry_after_s <= 1:
            msg += " by requests in flight; retry shortly"
    else:
        msg = f"key {key_id!r}: {what.upper()} limit reached"
    return RateLimited(msg, code=code, headers={"retry-after": str(int(retry_after_s))})


@dataclass
class _LocalKey:
    day: str = ""
    spent_day: int = 0
    month: str = ""
    spent_month: int = 0
    reserved: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (micro, tokens)
    rpm: dict[int, float] = field(default_factory=dict)  # window -> requests
    tpm: dict[int, float] = field(default_factory=dict)  # window -> tokens


class LocalCounters:
    """Process-local approximations used when Redis is down (``fail_open``); same rules as ``ADMIT_LUA``."""

    def __init__(self) -> None:
        self._keys: dict[str, _LocalKey] = {}

    def _get(self, key_id: str, now: float) -> _LocalKey:
        st = self._keys.setdefault(key_id, _LocalKey())
        day, month = _day_month(now)
        if st.day != day:
            st.day, st.spent_day = day, 0
        if st.month != month:
            st.month, st.spent_month = month, 0
        return st

    def refresh(self, key_id: str, now: float, spent_day: int, spent_month: int) -> None:
        """Take the spend read from Redis as the new baseline."""
        st = self._get(key_id, now)
        st.spent_day, st.spent_month = spent_day, spent_month

    def note(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float) -> None:
        """Count an admitted request (also those admitted by Redis, so the windows are warm for an outage)."""
        st = self._get(lim.key_id, now)
        w = int(now * 1000) // WINDOW_MS
        for windows in (st.rpm, st.tpm):
            for old in [x for x in windows if x < w - 1]:
                del windows[old]
        st.rpm[w] = st.rpm.get(w, 0) + 1
        st.tpm[w] = st.tpm.get(w, 0) + est.tokens
        st.reserved[reservation_id] = (est.micro_usd, est.tokens)

    def check(self, lim: KeyLimits, now: float) -> tuple[str, str, int] | None:
        """The refusal (code, what, retry_after_s) for one more request now, or None to admit."""
        st = self._get(lim.key_id, now)
        reserved = sum(m for m, _ in st.reserved.values())
        day_end, month_end = _period_ends(now)
        for budget, spent, what, end in ((lim.budget_day_micro, st.spent_day, "day", day_end),
                                         (lim.budget_month_micro, st.spent_month, "month", month_end)):
            if budget is not None and spent >= budget:
                return ("budget_exceeded", what, end)
            if budget is not None and spent + reserved >= budget:
                return ("budget_exceeded", what, 1)
        now_ms = int(now * 1000)
        w, elapsed = now_ms // WINDOW_MS, now_ms % WINDOW_MS
        frac = (WINDOW_MS - elapsed) / WINDOW_MS
        retry = max(1, math.ceil((WINDOW_MS - elapsed) / 1000))
        if lim.rpm is not None and st.rpm.get(w - 1, 0) * frac + st.rpm.get(w, 0) + 1 > lim.rpm:
            return ("rate_limit_exceeded", "rpm", retry)
        if lim.tpm is not None and st.tpm.get(w - 1, 0) * frac + st.tpm.get(w, 0) >= lim.tpm:
            return ("rate_limit_exceeded", "tpm", retry)
        return None

    def settle(self, event: UsageEvent) -> None:
        """Release the event's reservation; add its cost to the local spend and correct its TPM window."""
        st = self._keys.get(event.key_id)
        if st is None:
            return
        _, tokens = st.reserved.pop(event.event_id, (0, 0))
        if event.day == st.day:
            st.spent_day += event.cost_micro_usd
        if event.month == st.month:
            st.spent_month += event.cost_micro_usd
        if event.minute in st.tpm:
            st.tpm[event.minute] += event.upstream_tokens - tokens


class Limits:
    """Admission for every request; one per process."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, cfg: LimitsConfig) -> None:
        self.redis = handle.client
        self.keys = RedisKeys(handle.prefix)
        self.breaker = breaker
        self.cfg = cfg
        self.local = LocalCounters()
        self._script = self.redis.register_script(ADMIT_LUA)

    async def admit(self, lim: KeyLimits, reservation_id: str, est: Estimate, now: float) -> Admission:
        """Admit one request of key ``lim`` at ``now`` (epoch s; the request's ``ts``) or raise.

        ``reservation_id`` must be the id of the request's usage event (metering settles by it).
        Raises :class:`~gateway.errors.RateLimited` (429, ``budget_exceeded`` / ``rate_limit_exceeded``,
        ``Retry-After``) or :class:`LimitsUnavailable` (503, Redis down and ``fail_closed``).
        """
        if lim.unlimited:
            return Admission(lim.key_id, reservation_id, "none", est)
        k = self.keys
        now_ms = int(now * 1000)
        w = now_ms // WINDOW_MS
        day, month = _day_month(now)
        day_end, month_end = _period_ends(now)
        keys = [k.key_day(lim.key_id, day), k.key_month(lim.key_id, month), k.reservations(lim.key_id),
                k.rpm(lim.key_id, w), k.rpm(lim.key_id, w - 1), k.tpm(lim.key_id, w), k.tpm(lim.key_id, w - 1)]
        args: list[int | str] = [
            now_ms, _or_minus(lim.budget_day_micro), _or_minus(lim.budget_month_micro), _or_minus(lim.rpm),
            _or_minus(lim.tpm), est.micro_usd, est.tokens, reservation_id, int(self.cfg.reservation_ttl_s * 1000),
            day_end, month_end]
        try:
            res = await self.breaker.call(lambda: self._script(keys=keys, args=args))
        except RedisDown:
            if self.cfg.on_redis_down == "fail_closed":
                retry = max(1, math.ceil(self.breaker.cooldown_s))
                raise LimitsUnavailable("usage limits cannot be checked (Redis unreachable); retry later",
                                        headers={"retry-after": str(retry)}) from None
            refused = self.local.check(lim, now)
            if refused is not None:
                raise refusal(*refused, lim.key_id) from None
            self.local.note(lim, reservation_id, est, now)
            return Admission(lim.key_id, reservation_id, "local", est)
        if int(res[0]) == 0:
            _, code, what, retry, spent_day, spent_month = res
            self.local.refresh(lim.key_id, now, int(spent_day), int(spent_month))
            raise refusal(_s(code), _s(what), int(retry), lim.key_id)
        spent_day, spent_month = int(res[1]), int(res[2])
        self.local.refresh(lim.key_id, now, spent_day, spent_month)
        self.local.note(lim, reservation_id, est, now)
        return Admission(lim.key_id, reservation_id, "redis", est, spent_day, spent_month)

    def settled(self, event: UsageEvent, result: RecordResult) -> None:
        """After metering: update the local approximations (Redis settled itself inside the metering write)."""
        self.local.settle(event)
        if result.day_cost_micro_usd is not None and result.month_cost_micro_usd is not None:
            self.local.refresh(event.key_id, event.ts, result.day_cost_micro_usd, result.month_cost_micro_usd)


def _or_minus(v: int | None) -> int:
    return -1 if v is None else v


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
