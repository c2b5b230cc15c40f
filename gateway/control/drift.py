"""Drift alarm: how far the realized router scores and tier mix have moved from what the router file was
calibrated on, as the Population Stability Index.

PSI over bins i: ``Σ (p_i − q_i) · ln(p_i / q_i)``, p = realized share, q = reference share, each floored at
``1e-4`` (an empty bin would be infinite). Two statistics: ``score`` (the score histogram, the reference's
bins — 20 equal bins over [0, 1] in the files ``router retrain`` writes) and ``tier`` (the routed tier mix
against the mix the reference implies at the thresholds in force). Rule of thumb (credit scoring, where PSI
comes from): < 0.1 stable, 0.1–0.25 moderate, > 0.25 significant — the default alarm threshold.

Reference: the router file's ``score_histogram`` metadata (``{"edges", "counts", "n"}``, :func:`router.fit.retrain.
score_histogram`). A file without one (the shipped and trace routers so far), or with one of fewer than
``min_samples`` scores (too few to compare with), is compared with the first
``window`` scores the gateway saw under that router version instead, stored once in Redis (``SET NX``) so
every replica compares with the same one — drift since the start of service, stated as ``reference:
"served"`` in the state.

Realized: the last ``window`` routed scores of every replica (``p drift:win``, "score,tier index,version tag"),
updated every ``interval_s``; only the entries of the router version in service count (the tag: 8 hex digits of
the version's SHA-256). A promotion or a hot reload changes the scoring function, so the old router's scores in
the window say nothing about the new one's calibration — mixing them read PSI 4–10 on unchanged traffic right
after every promotion, a page per promotion; until ``min_samples`` entries of the new version are in, no PSI is
computed. The tier index is the one the router chose (before exploration or spot checks move a request: those
change the served mix by design, not the traffic). Entries without a tag (written before tags) count for any
version; the result goes to ``p drift:state`` (``psi_score``, ``psi_tier``, ``n``, ``ts``,
``router_version``, ``reference``), the gauge ``thinkgate_routing_drift_psi{kind}`` and, once per router version
and UTC day when a PSI reaches ``threshold``, an alert through the budget alerts' path (log record, the
``alerts:log`` list, the webhook) with ``type: "drift_alert"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import orjson

from gateway.config import DriftConfig
from gateway.state.alerts import Alerts
from gateway.state.batches import FRESH_BATCH_LUA, NumberedBatches, new_token
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys
from gateway.state.redis import RedisHandle, as_text

log = logging.getLogger("thinkgate.drift")

EPS = 1e-4
DEFAULT_EDGES = [i / 20 for i in range(21)]


def _hist_n(hist: dict[str, Any]) -> int:
    """The number of scores behind a reference histogram (its ``n``, else the sum of its counts)."""
    n = hist.get("n")
    return int(n) if isinstance(n, int | float) else int(sum(hist.get("counts") or ()))


def psi(realized: Sequence[float] | np.ndarray, reference: Sequence[float] | np.ndarray) -> float:
    """PSI of two distributions over the same bins (counts or shares; each normalised, floored at 1e-4)."""
    p = np.asarray(realized, dtype=np.float64)
    q = np.asarray(reference, dtype=np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return float("nan")
    p = np.maximum(p / p.sum(), EPS)
    q = np.maximum(q / q.sum(), EPS)
    return float(np.sum((p - q) * np.log(p / q)))


def tier_mix(edges: Sequence[float], counts: Sequence[float], thresholds: Sequence[float]) -> list[float]:
    """The tier shares a score histogram implies at ``thresholds`` (a bin is split by linear interpolation)."""
    e = np.asarray(edges, dtype=np.float64)
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum() or 1.0

    def below(t: float) -> float:
        frac = np.clip((t - e[:-1]) / np.maximum(e[1:] - e[:-1], 1e-12), 0.0, 1.0)
        return float((c * frac).sum() / total)

    cum = [0.0, *(below(t) for t in thresholds), 1.0]
    return [max(0.0, b - a) for a, b in itertools.pairwise(cum)]


@dataclass(frozen=True, slots=True)
class DriftAlert:
    """A drift alarm (same delivery as budget alerts): the PSI that crossed ``threshold`` and on what."""

    kind: str  # "score" | "tier"
    psi: float
    threshold: float
    n: int
    router_version: str
    day: str
    reference: str
    type: str = "drift_alert"
    level: str = "global"

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @property
    def text(self) -> str:
        return (f"ThinkGate drift alert: router {self.router_version} {self.kind} PSI {self.psi:.3f} >= "
                f"{self.threshold:g} over the last {self.n} routed requests ({self.day})")

    def webhook_body(self) -> bytes:
        return orjson.dumps({"text": self.text, **asdict(self)})


# KEYS: the shared window list, this replica's last pushed batch number. ARGV: window size, batch number, then the
# decisions "score,index". A batch number pushed before (a resent batch whose reply was lost) is not pushed again.
# Returns the window.
PUSH_LUA = FRESH_BATCH_LUA + """
if fresh_batch(KEYS[2], tonumber(ARGV[2])) and #ARGV > 2 then
  for i = 3, #ARGV, 200 do
    redis.call('RPUSH', KEYS[1], unpack(ARGV, i, math.min(i + 199, #ARGV)))
  end
  redis.call('LTRIM', KEYS[1], -tonumber(ARGV[1]), -1)
end
return redis.call('LRANGE', KEYS[1], 0, -1)
"""


class DriftMonitor:
    """One replica's drift monitor; ``record`` from the routing decision, :meth:`run` in the event loop."""

    def __init__(self, cfg: DriftConfig, handle: RedisHandle, breaker: Breaker, alerts: Alerts | None,
                 router_meta: Callable[[], tuple[str, dict[str, Any] | None]],
                 thresholds: Callable[[], list[float]], n_tiers: int,
                 on_update: Callable[[dict[str, float]], None] | None = None) -> None:
        self.cfg = cfg
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.alerts = alerts
        self.router_meta = router_meta  # () -> (version, score_histogram metadata or None)
        self.thresholds = thresholds
        self.n_tiers = n_tiers
        self.on_update = on_update
        self._pending: deque[str] = deque(maxlen=cfg.window)
        self._push = self.redis.register_script(PUSH_LUA)
        self.batches: NumberedBatches[list[str]] = NumberedBatches(self.keys.drift_seq(new_token()))
        self.state: dict[str, Any] = {}
        self._alerted: set[tuple[str, str, str]] = set()
        self._tags: dict[str, str] = {}

    def record(self, score: float, tier_index: int) -> None:
        """Buffer one routed decision: its score and the tier index the router chose, tagged with the router
        version in service."""
        self._pending.append(f"{score:.5f},{tier_index},{self._tag(self.router_meta()[0])}")

    def _tag(self, version: str) -> str:
        tag = self._tags.get(version)
        if tag is None:
            if len(self._tags) > 64:  # versions come and go with promotions: keep the memo small
                self._tags.clear()
            tag = self._tags[version] = hashlib.sha256(version.encode()).hexdigest()[:8]
        return tag

    def _take(self) -> list[str]:
        entries = list(self._pending)
        self._pending.clear()
        return entries

    async def update(self) -> dict[str, Any]:
        """Send the pending scores, compute both PSIs on the shared window, publish; {} when Redis is down or
        the window is below ``min_samples``. A batch whose reply was lost is sent again as it was, numbered (the
        script pushes each replica's batch number once); scores recorded meanwhile go with the next update."""
        seq, entries, _ = self.batches.current(self._take)
        keys = [self.keys.drift_window(), self.batches.key]
        args: list[str | int] = [self.cfg.window, seq, *entries]
        try:
            raw = await self.breaker.call(lambda: self._push(keys=keys, args=args))
        except RedisDown:
            return {}
        self.batches.sent()
        version, hist = self.router_meta()
        tag = self._tag(version)
        rows = [r for r in (as_text(x).split(",") for x in raw) if len(r) < 3 or r[2] == tag]
        scores = np.array([float(r[0]) for r in rows])
        tiers = np.array([int(r[1]) for r in rows], dtype=np.int64)
        if scores.size < self.cfg.min_samples:
            if self.state and self.state.get("router_version") != version:
                await self._warming(version, int(scores.size))
            return {}
        reference = "file"
        if not hist or "counts" not in hist or _hist_n(hist) < self.cfg.min_samples:
            # no histogram, or one of too few scores to compare with: a histogram of n scores over b bins reads a
            # PSI of about (b − 1) / n against the same traffic (a retrained file's 36 fit scores: 0.59 — a drift
            # page minutes after its promotion, on unchanged traffic)
            hist = await self._served_reference(version, scores)
            reference = "served"
            if hist is None:
                return {}
        edges, counts = hist.get("edges") or DEFAULT_EDGES, hist["counts"]
        realized, _ = np.histogram(np.clip(scores, 0, 1), bins=np.asarray(edges, dtype=np.float64))
        ps = psi(realized, counts)
        mix_ref = tier_mix(edges, counts, self.thresholds())
        mix_real = np.bincount(tiers, minlength=self.n_tiers)[: self.n_tiers]
        pt = psi(mix_real, mix_ref)
        day = time.strftime("%Y-%m-%d", time.gmtime())
        state = {"psi_score": round(ps, 6), "psi_tier": round(pt, 6), "n": int(scores.size), "ts": time.time(),
                 "router_version": version, "reference": reference}
        with contextlib.suppress(RedisDown):
            await self.breaker.call(lambda: self.redis.set(self.keys.drift_state(), orjson.dumps(state)))
        self.state = state
        if self.on_update is not None:
            self.on_update({"score": ps, "tier": pt})
        for kind, value in (("score", ps), ("tier", pt)):
            if math.isfinite(value) and value >= self.cfg.threshold:
                await self._alert(DriftAlert(kind, round(value, 4), self.cfg.threshold, int(scores.size), version,
                                             day, reference))
        return state

    async def _warming(self, version: str, n: int) -> None:
        """A new router version with fewer than ``min_samples`` scores: the last PSIs were the old version's, so the
        state says "not computed" (``psi_*`` None) and the gauges go to NaN (no value to alert on) instead of
        showing them against the new version until its window fills."""
        state = {"psi_score": None, "psi_tier": None, "n": n, "ts": time.time(), "router_version": version,
                 "reference": None}
        with contextlib.suppress(RedisDown):
            await self.breaker.call(lambda: self.redis.set(self.keys.drift_state(), orjson.dumps(state)))
        self.state = state
        if self.on_update is not None:
            self.on_update({"score": math.nan, "tier": math.nan})

    async def _served_reference(self, version: str, scores: np.ndarray) -> dict[str, Any] | None:
        """The first full window under ``version`` as the reference (stored once; replicas share it)."""
        key = self.keys.drift_reference(version)
        try:
            raw = await self.breaker.call(lambda: self.redis.get(key))
            if raw is None and scores.size >= self.cfg.window:
                counts, _ = np.histogram(np.clip(scores, 0, 1), bins=np.asarray(DEFAULT_EDGES))
                ref = {"edges": DEFAULT_EDGES, "counts": [int(c) for c in counts], "n": int(scores.size)}
                await self.breaker.call(lambda: self.redis.set(key, orjson.dumps(ref), nx=True))
                raw = await self.breaker.call(lambda: self.redis.get(key))
        except RedisDown:
            return None
        return None if raw is None else dict(orjson.loads(raw))

    async def _alert(self, alert: DriftAlert) -> None:
        memo = (alert.router_version, alert.day, alert.kind)
        if memo in self._alerted or self.alerts is None:
            return
        mark = self.keys.alert(f"drift:{alert.kind}:{alert.router_version}", alert.day, f"{alert.threshold:g}")
        try:
            first = await self.alerts.claim(mark, 2 * 86400)
        except RedisDown:  # not decided: the next update tries again
            return
        if first is None:  # another task of this process is deciding it
            return
        self._alerted.add(memo)
        if first:
            await self.alerts.fire(alert)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.update()
            except Exception:
                log.exception("drift update failed")


async def read_state(handle: RedisHandle, breaker: Breaker) -> dict[str, Any] | None:
    """The last published drift state (None: never computed). Raises RedisDown."""
    raw = await breaker.call(lambda: handle.client.get(RedisKeys.of(handle).drift_state()))
    return None if raw is None else dict(orjson.loads(raw))
