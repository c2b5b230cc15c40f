"""Budgets, RPM/TPM and alerts against a real Redis (and a dead one for the fail-open/closed policies)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from gateway.config import LimitsConfig, Prices, TierConfig
from gateway.errors import RateLimited
from gateway.ledger.event import UsageEvent
from gateway.state.alerts import Alerts
from gateway.state.limits import Estimate, KeyLimits, Limits, LimitsUnavailable, estimate
from gateway.state.write_ahead import WalRecord
from tests.fixtures.redis_stack import Stack, stack

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))
PROMPT, COMPLETION = 40, 100
COST = 40 * 0.5 + 100 * 2  # 220 micro-USD per request
ONE_REQUEST = 220


def _event(key_id: str, event_id: str, ts: float, prompt: int = PROMPT, completion: int = COMPLETION) -> UsageEvent:
    ev = UsageEvent(key_id=key_id, requested_model="short", event_id=event_id, ts=ts, tier="short",
                    prompt_tokens=prompt, completion_tokens=completion)
    ev.price(PRICES)
    return ev


async def _request(st: Stack, limits: Limits, lim: KeyLimits, est: Estimate, work_s: float = 0.05,
                   completion: int = COMPLETION) -> str:
    """Admit → 'upstream' → meter (which settles) → local settle. Returns 'ok' or the refusal code."""
    rid, ts = uuid.uuid4().hex, time.time()
    try:
        await limits.admit(lim, rid, est, ts)
    except RateLimited as exc:
        assert exc.code is not None
        return exc.code
    await asyncio.sleep(work_s)
    ev = _event(lim.key_id, rid, ts, completion=completion)
    limits.settled(ev, await st.meter.record(ev))
    return "ok"


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("budget_requests", [1, 2.5])
async def test_64_concurrent_requests_overshoot_by_at_most_one(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                               budget_requests: float, mode: str) -> None:
    # a socket timeout that a loaded test box does not reach: this is about Redis answering, not an outage
    async with stack(redis_url, redis_prefix, tmp_path / "s", socket_timeout_s=2.0) as st:
        limits = Limits(st.handle, st.breaker, LimitsConfig(budget_mode=mode))  # type: ignore[arg-type]
        budget = int(ONE_REQUEST * budget_requests)
        lim = KeyLimits("racer", budget_day_micro=budget)
        est = Estimate(ONE_REQUEST, PROMPT + COMPLETION)  # tight upper bound
        results = await asyncio.gather(*(_request(st, limits, lim, est) for _ in range(64)))
        admitted = results.count("ok")
        spent = (await st.meter.key_counters("racer", day=_event("x", "y", time.time()).day))["cost_micro_usd"]
        assert spent == admitted * ONE_REQUEST
        if mode == "hard":  # never past the budget: as many as fit whole
            assert spent <= budget
            assert admitted == int(budget_requests)
        else:  # soft: overshoot ≤ one request
            assert spent <= budget + ONE_REQUEST
            assert admitted == int(budget_requests) + (1 if budget_requests % 1 else 0)
        assert results.count("budget_exceeded") == 64 - admitted
        # the budget is spent: the next request is refused until the end of the UTC day
        with pytest.raises(RateLimited) as info:
            await limits.admit(lim, uuid.uuid4().hex, est, time.time())
        assert info.value.code == "budget_exceeded"
        retry = int(info.value.headers["retry-after"])
        assert 1 <= retry <= 86400
        # reservations were all settled
        assert await st.handle.client.hlen(limits.keys.reservations("racer")) == 0


async def test_reserved_in_flight_refusal_says_retry_soon(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        limits = Limits(st.handle, st.breaker, LimitsConfig(reservation_ttl_s=0.3))
        lim = KeyLimits("k", budget_month_micro=10_000)
        now = time.time()
        await limits.admit(lim, "r1", Estimate(6000, 10), now)
        with pytest.raises(RateLimited) as info:
            await limits.admit(lim, "r2", Estimate(6000, 10), now)
        assert info.value.headers["retry-after"] == "1" and "in flight" in info.value.message
        assert "remaining $0.004000" in info.value.message and "up to $0.006000" in info.value.message
        # the whole budget held by a request in flight: not "exhausted", nothing is spent yet
        await limits.admit(KeyLimits("k2", budget_month_micro=10_000), "r4", Estimate(10_000, 10), now)
        with pytest.raises(RateLimited) as full:
            await limits.admit(KeyLimits("k2", budget_month_micro=10_000), "r5", Estimate(1000, 10), now)
        assert "monthly budget fully reserved by requests in flight" in full.value.message
        assert "exhausted" not in full.value.message and full.value.headers["retry-after"] == "1"
        # a reservation never settled (crashed replica) stops counting after reservation_ttl_s
        await asyncio.sleep(0.35)
        await limits.admit(lim, "r3", Estimate(6000, 10), time.time())


async def test_rpm_limit(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        limits = Limits(st.handle, st.breaker, LimitsConfig())
        lim = KeyLimits("rpm-key", rpm=3)
        now = time.time()
        for i in range(3):
            await limits.admit(lim, f"r{i}", Estimate(1, 1), now)
        with pytest.raises(RateLimited) as info:
            await limits.admit(lim, "r3", Estimate(1, 1), now)
        assert info.value.code == "rate_limit_exceeded" and info.value.status == 429
        assert 1 <= int(info.value.headers["retry-after"]) <= 120
        # another key is not affected
        await limits.admit(KeyLimits("other", rpm=3), "o1", Estimate(1, 1), now)
        # two windows later the limit has slid away
        await limits.admit(lim, "r4", Estimate(1, 1), now + 121)


async def test_rpm_sliding_window_across_the_boundary(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        limits = Limits(st.handle, st.breaker, LimitsConfig())
        lim = KeyLimits("slide", rpm=4)
        w0 = (int(time.time()) // 60) * 60.0
        for i in range(4):
            await limits.admit(lim, f"a{i}", Estimate(1, 1), w0 + 50)  # late in window 0
        # 1 s into window 1 the previous window still weighs 4 * 59/60: refused, not a fresh burst of 4
        with pytest.raises(RateLimited) as info:
            await limits.admit(lim, "b0", Estimate(1, 1), w0 + 61)
        retry = int(info.value.headers["retry-after"])
        assert 14 <= retry <= 16  # prev weight must fall to 3: at 15 s into window 1
        await limits.admit(lim, "b1", Estimate(1, 1), w0 + 61 + retry)


async def test_tpm_limit_reserves_then_settles_real_tokens(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        limits = Limits(st.handle, st.breaker, LimitsConfig())
        lim = KeyLimits("tpm-key", tpm=100)
        now = time.time()
        est = Estimate(10, 60)  # reserves 60 tokens each
        await limits.admit(lim, "r1", est, now)
        await limits.admit(lim, "r2", est, now)  # 60 < 100 → admitted; window now holds 120
        with pytest.raises(RateLimited) as info:
            await limits.admit(lim, "r3", est, now)
        assert info.value.code == "rate_limit_exceeded" and "TPM" in info.value.message
        # both finish using 10 tokens each: the window is corrected to 20 and admits again
        for rid in ("r1", "r2"):
            ev = _event("tpm-key", rid, now, prompt=4, completion=6)
            limits.settled(ev, await st.meter.record(ev))
        w = int(now * 1000) // 60_000
        assert int(await st.handle.client.get(limits.keys.tpm("tpm-key", w))) == 20
        await limits.admit(lim, "r4", est, now)


async def test_a_tpm_window_settled_back_to_zero_is_deleted(redis_url: str, redis_prefix: str,
                                                             tmp_path: Path) -> None:
    """The window's last call settled with no upstream tokens (``RECORD``: an upstream error before any token) or
    released unsent (``RELEASE``: a dead replica's call that was waiting): its TPM window is deleted, not left as "0"
    until its TTL (``ROLLBACK`` already deleted its windows at 0); a window still holding another call's tokens is
    corrected and keeps its TTL."""
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        limits = Limits(st.handle, st.breaker, LimitsConfig())
        r, k = st.handle.client, limits.keys
        lim = KeyLimits("tpm-key", tpm=1000)
        now = time.time()
        window = k.tpm("tpm-key", int(now * 1000) // 60_000)
        for rid in ("r1", "r2"):
            await limits.admit(lim, rid, Estimate(10, 60), now)
        assert int(await r.get(window)) == 120
        await st.meter.record(_event("tpm-key", "r1", now, prompt=0, completion=0))
        assert int(await r.get(window)) == 60 and await r.pttl(window) > 0  # r2's tokens still in it
        await st.meter.record(_event("tpm-key", "r2", now, prompt=0, completion=0))
        assert await r.exists(window) == 0

        await limits.admit(lim, "r3", Estimate(10, 60), now)
        unsent = WalRecord(request_id="r3", key_id="tpm-key", owner="dead:1:x", ts=now, updated_ms=0, tags={},
                           tier="short", waiting=True)
        await r.hset(k.write_ahead, unsent.request_id, unsent.to_json())
        assert await st.meter.release_orphan(unsent.unsent_event(), k.heartbeat("dead:1:x"))
        assert await r.exists(window, k.reservations("tpm-key"), k.write_ahead) == 0


async def test_estimate_is_an_upper_bound_over_candidate_tiers() -> None:
    tiers = [TierConfig(name="short", max_tokens=64, prices=PRICES),
             TierConfig(name="long", max_tokens=512, prices=Prices(output_usd_per_mtok=Decimal("4")))]
    body = {"messages": [{"role": "user", "content": "héllo wörld"}], "max_tokens": 100, "n": 2}
    est = estimate(body, tiers)
    prompt_ub = len(b"user") + len("héllo wörld".encode()) + 8 + 16
    assert est.tokens == prompt_ub + 2 * 100
    assert est.micro_usd == max(int(prompt_ub * 0.5 + 2 * 64 * 2 + 0.5), 2 * 100 * 4)


async def test_fail_open_uses_local_counters_and_fail_closed_refuses(tmp_path: Path,
        port_lease: Callable[[], int]) -> None:
    url = f"redis://127.0.0.1:{port_lease()}/0"  # nothing listens
    async with stack(url, "tgtest:lim-down:", tmp_path / "s", cooldown_s=30) as st:
        open_limits = Limits(st.handle, st.breaker, LimitsConfig(on_redis_down="fail_open"))
        lim = KeyLimits("k", budget_day_micro=ONE_REQUEST, rpm=2)
        t0 = time.monotonic()
        assert await _request(st, open_limits, lim, Estimate(ONE_REQUEST, 140), work_s=0) == "ok"
        # the local spend (220) reached the budget: refused locally, without Redis
        assert await _request(st, open_limits, lim, Estimate(ONE_REQUEST, 140), work_s=0) == "budget_exceeded"
        rpm_only = KeyLimits("r", rpm=2)
        now = time.time()
        await open_limits.admit(rpm_only, "a", Estimate(1, 1), now)
        await open_limits.admit(rpm_only, "b", Estimate(1, 1), now)
        with pytest.raises(RateLimited):
            await open_limits.admit(rpm_only, "c", Estimate(1, 1), now)
        closed = Limits(st.handle, st.breaker, LimitsConfig(on_redis_down="fail_closed"))
        with pytest.raises(LimitsUnavailable) as info:
            await closed.admit(lim, "z", Estimate(1, 1), time.time())
        assert info.value.status == 503 and info.value.code == "limits_unavailable"
        assert int(info.value.headers["retry-after"]) >= 1
        # unlimited keys never need Redis, under either policy
        assert (await closed.admit(KeyLimits("free"), "f", Estimate(1, 1), time.time())).where == "none"
        assert time.monotonic() - t0 < 2.0
        assert len(st.spool.read_all()) == 1  # the admitted request's usage event waits in the spool


class _Hook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, object]]]]:
    received: ClassVar[list[dict[str, object]]] = []
    handler = type("Hook", (_Hook,), {"received": received})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    finally:
        server.shutdown()
        server.server_close()


async def test_alerts_fire_once_per_period_across_replicas(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                          webhook: tuple[str, list[dict[str, object]]]) -> None:
    url, received = webhook
    cfg = LimitsConfig(alert_fractions=[0.5, 0.8, 1.0], alert_webhook_url=url)
    lim = KeyLimits("alerted", budget_day_micro=1000, budget_month_micro=100_000)
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st, httpx.AsyncClient() as http:
        replica_a = Alerts(st.handle, st.breaker, cfg, http)
        replica_b = Alerts(st.handle, st.breaker, cfg, http)
        day = "2026-11-29"
        assert await replica_a.check(lim, {"team": "qa"}, day, 400, 400) == []
        fired = await replica_a.check(lim, {"team": "qa"}, day, 600, 600)
        assert [(a.period, a.fraction) for a in fired] == [("day", 0.5)]
        # both replicas see spend crossing 80 % and 100 % concurrently: each alert fires once in total
        got = await asyncio.gather(replica_a.check(lim, {}, day, 1200, 1200), replica_b.check(lim, {}, day, 1200, 1200),
                                   replica_b.check(lim, {}, day, 1300, 1300))
        fractions = sorted(a.fraction for batch in got for a in batch)
        assert fractions == [0.8, 1.0]
        assert await replica_b.check(lim, {}, day, 5000, 5000) == []
        # a new day is a new period
        assert [a.fraction for a in await replica_b.check(lim, {}, "2026-11-30", 900, 900)] == [0.5, 0.8]
        assert len(received) == 5
        first = received[0]
        assert first["key_id"] == "alerted" and first["period"] == "day" and first["fraction"] == 0.5
        assert first["budget_usd"] == "0.001000" and first["spent_usd"] == "0.000600"
        assert first["tags"] == {"team": "qa"}


def test_refusal_wording_and_retry_hints() -> None:
    from gateway.state.limits import refusal

    # the spend alone leaves no room for the estimate (retry at the period's end): not "fully reserved", and the
    # SDKs are told not to retry (they ignore a Retry-After over 60 s and would retry at once)
    r = refusal("budget_exceeded", "day", 36000, "k", None, 5000, 10000, 8000, 2000, "hard")
    assert "fully reserved" not in r.message and r.headers["retry-after"] == "36000"
    assert "lower max_tokens" not in r.message  # nothing is left: no estimate would fit
    # room is left, only not enough for the estimate, which fits the budget: the estimate is what a client lowers
    r = refusal("budget_exceeded", "day", 36000, "k", None, 5000, 10000, 6000, 0, "hard")
    assert "would be exceeded" in r.message and "a lower max_tokens (or max_completion_tokens) lowers it" in r.message
    assert r.headers["x-should-retry"] == "false"
    # only reservations block: "fully reserved", retry in 1 s, retries welcome
    r = refusal("budget_exceeded", "day", 1, "k", None, 5000, 10000, 4000, 6000, "hard")
    assert "fully reserved by requests in flight" in r.message and "x-should-retry" not in r.headers
    # an RPM refusal keeps its short Retry-After and no x-should-retry
    r = refusal("rate_limit_exceeded", "rpm", 12, "k", None, None, 5)
    assert r.headers["retry-after"] == "12" and "x-should-retry" not in r.headers
    # one past 60 s (a low RPM's sliding window: 87 s at rpm 1) is one the SDKs ignore and retry at once: told not to
    r = refusal("rate_limit_exceeded", "rpm", 87, "k", None, None, 1)
    assert r.headers["retry-after"] == "87" and r.headers["x-should-retry"] == "false"
