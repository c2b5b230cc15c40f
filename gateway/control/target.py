"""The cost-target controller: moves the top routing threshold online so that the realized share of routed
``auto`` requests sent to the top routed tier (or the spend) tracks ``routing.target``.

Rule (a streaming quantile with a bounded step): the last ``window`` routed decisions — score, the routed tier
index and the time — sit in one Redis list shared by every replica (``p rt:win``). Each update (one Lua call,
atomic across replicas) appends a replica's pending decisions, trims the list, takes the ``1 - aim``
quantile ``q`` of the window's scores (the midpoint of the two order statistics around it) and moves the
threshold ``t`` toward it by at most ``max_step``: ``t ← t + clip(q − t, −max_step, +max_step)``. ``aim =
share + gain × (share − realized)`` clipped to [0, 1], where ``realized`` is the top share of the last
``error_window`` decisions: a proportional term on the realized share. Why: the quantile alone only promises
the share in expectation — the next requests are a fresh sample, so even the exact quantile of the traffic
leaves a 500-request block off by its binomial noise (± ~2 points sd at 35–65 %, 3.4–3.6 points worst block on
the closed-loop bench); the feedback term makes later decisions compensate a run of over- or under-routing,
so block shares stay closer to the target than that noise (1.2–2.4 points worst block there). Gain 0 is the
plain quantile. On a stationary score stream ``t`` reaches ``q`` in ``|q − t₀| / max_step`` updates; when
traffic drifts the threshold follows the new distribution at that speed. Only the top cut point moves; lower
ones (three or more routed tiers) keep their calibrated values, clipped to stay at or below it.

Spend targets are turned into a share each update: ``usd_per_1k_requests`` → a mean cost per request ``c*``;
``usd_per_day`` → ``c* = usd_per_day / (recent requests per day)``, the rate measured over the window's time
span. With ``c_top`` the mean cost per request of the top tier and ``c_low`` that of the others (metered on
this traffic: the usage events of ``predicted`` routes, summed in ``p rt:state``), ``share = (c* − c_low) /
(c_top − c_low)`` clipped to [0, 1]. Until both are known the threshold holds.

State in Redis (``p rt:state`` hash): ``thr`` (the current top threshold), ``share`` (realized top share of
the window), ``n``, and ``cost:{i}`` / ``cnt:{i}`` per routed tier index (micro-USD, requests). Redis down:
the last known threshold applies, decisions wait in a bounded local buffer (the newest ``window``), and the
first update after recovery sends them. A batch whose reply was lost (a timeout: Redis may have applied it) is
sent again as it was, numbered: the script applies each replica's batch number once (``p rt:seq:<replica>``),
so its decisions and costs are not counted twice. Each replica also reads the shared state every ``interval_s`` so
that all of them apply the same threshold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from decimal import Decimal

from gateway.config import RoutingConfig
from gateway.state.batches import FRESH_BATCH_LUA, NumberedBatches, new_token
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys
from gateway.state.redis import RedisHandle, as_text

log = logging.getLogger("thinkgate.routing_target")

# KEYS: window list, state hash, this replica's last applied batch number.
# ARGV: window, max_step, target share ('' = none), initial threshold, min_samples, top index, gain,
#       error window, n_costs, batch number (applied once: a resent batch only reads the state),
#       then n_costs × (tier index, micro-USD, requests), then the decisions "score,index,t_ms".
# Returns: {thr, share, n, first_t_ms, last_t_ms, moved(0|1), cost fields...}.
UPDATE_LUA = FRESH_BATCH_LUA + """
local win, st = KEYS[1], KEYS[2]
local size = tonumber(ARGV[1])
local max_step = tonumber(ARGV[2])
local target = tonumber(ARGV[3])
local thr0 = tonumber(ARGV[4])
local min_n = tonumber(ARGV[5])
local top = tonumber(ARGV[6])
local gain = tonumber(ARGV[7])
local ewin = tonumber(ARGV[8])
local ncost = tonumber(ARGV[9])
local fresh = fresh_batch(KEYS[3], tonumber(ARGV[10]))
local a = 11
for _ = 1, ncost do
  if fresh then
    redis.call('HINCRBY', st, 'cost:' .. ARGV[a], ARGV[a + 1])
    redis.call('HINCRBY', st, 'cnt:' .. ARGV[a], ARGV[a + 2])
  end
  a = a + 3
end
local added = #ARGV - a + 1
if not fresh then added = 0 end
if added > 0 then
  for i = a, #ARGV, 200 do
    redis.call('RPUSH', win, unpack(ARGV, i, math.min(i + 199, #ARGV)))
  end
  redis.call('LTRIM', win, -size, -1)
end
local thr = tonumber(redis.call('HGET', st, 'thr') or '') or thr0
local entries = redis.call('LRANGE', win, 0, -1)
local n = #entries
local scores, long, counts = {}, 0, {}
local recent, recent_long = 0, 0
local first_t, last_t = 0, 0
for i, e in ipairs(entries) do
  local s, k, t = string.match(e, '([^,]+),([^,]+),([^,]+)')
  scores[i] = tonumber(s)
  if tonumber(k) == top then long = long + 1 end
  if i > n - ewin then
    recent = recent + 1
    if tonumber(k) == top then recent_long = recent_long + 1 end
  end
  counts[k] = (counts[k] or 0) + 1
  if i == 1 then first_t = t end
  last_t = t
end
local moved = 0
if added > 0 and target and n >= min_n then
  table.sort(scores)
  -- aim the quantile past the target by gain x the recent realized error (P term on the realized share)
  local aim = target + gain * (target - recent_long / recent)
  if aim < 0 then aim = 0 elseif aim > 1 then aim = 1 end
  local below = math.floor((1 - aim) * n + 0.5)
  local q
  if below <= 0 then q = scores[1]
  elseif below >= n then q = 1.0
  else q = (scores[below] + scores[below + 1]) / 2 end
  local step = q - thr
  if step > max_step then step = max_step elseif step < -max_step then step = -max_step end
  thr = math.min(1.0, math.max(0.0, thr + step))
  moved = 1
end
local share = 0
if n > 0 then share = long / n end
redis.call('HSET', st, 'thr', string.format('%.17g', thr), 'share', string.format('%.17g', share), 'n', n)
local out = {string.format('%.17g', thr), string.format('%.17g', share), tostring(n), tostring(first_t),
             tostring(last_t), tostring(moved)}
for k, c in pairs(counts) do
  out[#out + 1] = 'win:' .. k
  out[#out + 1] = tostring(c)
end
local h = redis.call('HGETALL', st)
for i = 1, #h, 2 do
  if string.sub(h[i], 1, 5) == 'cost:' or string.sub(h[i], 1, 4) == 'cnt:' then
    out[#out + 1] = h[i]
    out[#out + 1] = h[i + 1]
  end
end
return out
"""


@dataclass(slots=True)
class ControllerState:
    """What the last update (or read) returned: the top ``threshold``, the window's realized top ``share``, its
    size ``n``, the ``target`` share in force (None: not known yet), the window's share per routed tier index,
    the per-tier cost sums and how many updates this replica made that moved the threshold."""

    threshold: float | None = None
    share: float | None = None
    n: int = 0
    target: float | None = None
    span_s: float = 0.0
    costs: dict[int, tuple[int, int]] = field(default_factory=dict)  # tier index -> (micro-USD, requests)
    tier_shares: dict[int, float] = field(default_factory=dict)  # routed tier index -> share of the window
    updates: int = 0


def share_for_spend(cost_per_request_micro: float, costs: dict[int, tuple[int, int]], top: int) -> float | None:
    """The top-tier share whose expected mean cost per request is ``cost_per_request_micro`` micro-USD, from the
    measured per-tier ``costs`` (index → (micro-USD, requests)); None while the top or the other tiers are
    unmeasured or cost the same."""
    top_c, top_n = costs.get(top, (0, 0))
    low_c = sum(c for i, (c, _) in costs.items() if i != top)
    low_n = sum(n for i, (_, n) in costs.items() if i != top)
    if top_n <= 0 or low_n <= 0:
        return None
    c_top, c_low = top_c / top_n, low_c / low_n
    if c_top <= c_low:
        return None
    return min(1.0, max(0.0, (cost_per_request_micro - c_low) / (c_top - c_low)))


class TargetController:
    """One replica's handle on the shared controller. ``record`` (sync, from the routing decision) and
    ``record_cost`` (from usage events) buffer locally; :meth:`update` sends them and moves the threshold;
    :meth:`run` is the background loop (call it inside the serving event loop)."""

    def __init__(self, cfg: RoutingConfig, handle: RedisHandle, breaker: Breaker, initial: list[float]) -> None:
        self.cfg = cfg.target
        self.n_tiers = len(cfg.routed_tiers)
        self.top = self.n_tiers - 1
        self.initial = list(initial)
        self.redis = handle.client
        keys = RedisKeys.of(handle)
        # this replica's batch numbers: a resent batch is applied once (module doc)
        self.batches: NumberedBatches[tuple[list[str], dict[int, list[int]]]] = NumberedBatches(
            keys.routing_seq(new_token()))
        self.keys = [keys.routing_window(), keys.routing_state(), self.batches.key]
        self.breaker = breaker
        self._script = self.redis.register_script(UPDATE_LUA)
        self._pending: deque[str] = deque(maxlen=self.cfg.window)
        self._costs: dict[int, list[int]] = {}
        self._busy = False
        self._tasks: set[asyncio.Task[ControllerState]] = set()
        self.state = ControllerState(target=self.cfg.long_share)

    # --- inputs -------------------------------------------------------------------------------------------
    def record(self, score: float, tier_index: int) -> None:
        """Buffer one routed decision (score in [0, 1], routed tier index); every ``update_every`` of them an
        update is scheduled on the running event loop."""
        self._pending.append(f"{score:.6f},{tier_index},{int(time.time() * 1000)}")
        if len(self._pending) >= self.cfg.update_every and not self._busy:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            task = loop.create_task(self.update())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def record_cost(self, tier_index: int, cost_micro_usd: int) -> None:
        """Add one metered request of routed tier ``tier_index`` (its cost in micro-USD) to the cost sums."""
        c = self._costs.setdefault(tier_index, [0, 0])
        c[0] += int(cost_micro_usd)
        c[1] += 1

    # --- the threshold ------------------------------------------------------------------------------------
    def thresholds(self, base: list[float]) -> list[float]:
        """``base`` (the calibrated/configured cut points) with the top one replaced by the controller's, lower
        ones clipped to it; ``base`` unchanged before the first update."""
        thr = self.state.threshold
        if thr is None or not base:
            return base
        return [min(t, thr) for t in base[:-1]] + [thr]

    def target_share(self) -> float | None:
        """The top-tier share to aim at now (None: a spend target whose costs are not measured yet)."""
        cfg = self.cfg
        if cfg.long_share is not None:
            return cfg.long_share
        if cfg.usd_per_1k_requests is not None:
            per_req = float(cfg.usd_per_1k_requests * Decimal(1_000_000) / 1000)
            return share_for_spend(per_req, self.state.costs, self.top)
        if cfg.usd_per_day is not None and self.state.span_s > 0 and self.state.n > 1:
            per_day = (self.state.n - 1) / self.state.span_s * 86_400
            per_req = float(cfg.usd_per_day * Decimal(1_000_000)) / per_day
            return share_for_spend(per_req, self.state.costs, self.top)
        return None

    async def update(self) -> ControllerState:
        """Send the pending decisions and costs, move the threshold (bounded step), read the shared state.
        Redis down: the batch is kept, as it was, and sent first at the next update (numbered: applied once
        however many times it is sent); decisions made meanwhile wait in the bounded buffer (newest ``window``);
        the last state stays in force."""
        if self._busy:
            return self.state
        self._busy = True
        try:
            while True:
                seq, (entries, costs), resend = self.batches.current(self._take)
                target = self.target_share()
                args: list[str | int | float] = [
                    self.cfg.window, repr(self.cfg.max_step), "" if target is None else repr(target),
                    repr(self.initial[-1] if self.initial else 0.5), self.cfg.min_samples, self.top,
                    repr(self.cfg.gain), min(self.cfg.error_window, self.cfg.window), len(costs), seq]
                for i, (c, n) in costs.items():
                    args += [i, c, n]
                args += entries
                try:
                    reply = await self.breaker.call(lambda a=args: self._script(keys=self.keys, args=a))  # type: ignore[misc]
                except (RedisDown, Exception) as exc:  # keep the batch for the next try
                    if not isinstance(exc, RedisDown):
                        log.warning("routing target update failed: %r", exc)
                    return self.state
                self.batches.sent()
                self._apply([as_text(x) for x in reply], target)
                if not resend or not self._pending:
                    return self.state
        finally:
            self._busy = False

    def _take(self) -> tuple[list[str], dict[int, list[int]]]:
        """The decisions and costs buffered since the last batch, moved out of the buffer."""
        entries, costs = list(self._pending), self._costs
        self._pending.clear()
        self._costs = {}
        return entries, costs

    def _apply(self, r: list[str], target: float | None) -> None:
        st = self.state
        st.threshold, st.share, st.n = float(r[0]), float(r[1]), int(r[2])
        st.span_s = max(0.0, (int(r[4]) - int(r[3])) / 1000) if st.n > 1 else 0.0
        if r[5] == "1":
            st.updates += 1
        costs: dict[int, list[int]] = {}
        window: dict[int, int] = {}
        for name, value in zip(r[6::2], r[7::2], strict=True):
            kind, _, idx = name.partition(":")
            if kind == "win":
                window[int(idx)] = int(value)
            else:
                costs.setdefault(int(idx), [0, 0])[0 if kind == "cost" else 1] = int(value)
        st.tier_shares = {i: window.get(i, 0) / st.n if st.n else 0.0 for i in range(self.n_tiers)}
        st.costs = {i: (c[0], c[1]) for i, c in costs.items()}
        st.target = target if target is not None else self.target_share()

    async def run(self) -> None:
        """Background loop: every ``interval_s``, an update (pending decisions, else a read of the shared
        state so that every replica applies the same threshold)."""
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            with contextlib.suppress(Exception):
                await self.update()

    async def close(self) -> None:
        """Wait for scheduled updates (one last update sends what is pending)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._pending:
            await self.update()
