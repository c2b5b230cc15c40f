"""Grouped usage never makes the gateway read the whole event stream: a sub-day edge is read by its stream-id range
(events written late found through the late index), ``since=0`` is raised to what is retained, and a key's query
that would still need a long or unbounded read is refused (400, OpenAI-shaped). Real Redis, a real gateway."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis

from gateway.config import MeteringConfig, RedisConfig
from gateway.ledger.aggregate import DAY_S, day_of, day_start
from gateway.ledger.event import UsageEvent
from gateway.ledger.export import MAX_TIME_S, group
from gateway.state.breaker import Breaker
from gateway.state.keys import RedisKeys
from gateway.state.metering import Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, cleanup
from tests.fixtures.upstream import SimProcess


def _event(key: str, cost: int, ts: float | None = None) -> UsageEvent:
    return UsageEvent(key_id=key, requested_model="auto", ts=time.time() if ts is None else ts, tier="short",
                      upstream_model="m", prompt_tokens=10, completion_tokens=5, cost_micro_usd=cost)


def on_meter(redis_url: str, tmp_path: Path, body: Callable[[Meter], Awaitable[None]], **cfg: Any) -> None:
    """Run ``body`` with a :class:`Meter` on ``redis_url`` under a fresh key prefix (``cfg``: more
    :class:`MeteringConfig` fields), in its own event loop; the prefix's keys are deleted after."""
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"

    async def go() -> None:
        handle = connect(RedisConfig(url=redis_url, key_prefix=prefix))
        meter = Meter(handle, Breaker(1.0), Spool(tmp_path / "spool.jsonl"),
                      MeteringConfig(spool_path=tmp_path / "spool.jsonl", **cfg))
        try:
            await body(meter)
        finally:
            await handle.close()

    try:
        asyncio.run(go())
    finally:
        cleanup(redis_url, prefix)


def test_a_sub_day_window_reads_only_its_id_range(redis_url: str, tmp_path: Path) -> None:
    """Three bursts 1.3 s apart (``late_after_s`` 1 s), an event of the middle burst written after the last one, then
    an unparseable entry: a period covering the middle burst reads its entries and the late one, never the burst
    after it nor the bad entry (the scan read the stream from ``since`` to its end, and fails on it); the rows equal
    the grouping of the period's events. ``since=0`` on a key's
    query (``max_scan_s``) is raised to what is retained: no refusal, every event counted."""
    async def go(meter: Meter) -> None:
        a = [_event("a", 1 + i) for i in range(3)]
        await meter.record_many(a)
        await asyncio.sleep(1.3)
        b = [_event("b", 10 + i) for i in range(3)]
        t_lo, t_hi = b[0].ts, b[-1].ts + 0.001
        await meter.record_many(b)
        await asyncio.sleep(1.3)
        c = [_event("c", 100 + i) for i in range(3)]
        await meter.record_many(c)
        late = _event("b", 1000, ts=(t_lo + t_hi) / 2)  # its request started in the window, written 2.6 s later
        await meter.record(late)
        # past the window's id range: an entry no reader can parse. A read that goes on to the stream's end
        # (what the scan did) fails on it; one that stops at the window's end never sees it
        await meter.redis.xadd(meter.keys.events, {"e": b"not an event"})
        got = await meter.grouped(["key"], t_lo, t_hi, None, time.time())
        assert got.cube_days == [] and got.scan_windows == [(t_lo, t_hi)]
        assert got.rows == group([*b, late], ["key"])
        # the window's entries, the late one and a's (the read starts EARLY_SLACK_S before since: clock skew):
        # not c's
        assert got.events_scanned == len(a) + len(b) + 1
        every = await meter.grouped(["key"], 0.0, None, None, time.time(), 2 * DAY_S)
        assert every.rows == group([*a, *b, c[0], c[1], c[2], late], ["key"])
        assert every.events_scanned == 0  # today's whole day from its cube: no stream read at all

    on_meter(redis_url, tmp_path, go, late_after_s=1.0)


def test_a_key_cannot_force_an_unbounded_scan(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    """A day counted by the metering script of before the cubes and the late index (its event written straight to
    the stream and the seen-set, as that script did): the cubes cannot answer it and its read cannot stop at the
    day's end. alice's query over it is refused (400 ``usage_scan_too_large``, OpenAI's error shape) before any read;
    the admin's reads it and counts it; alice's query from today's midnight is answered."""
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    keys = RedisKeys(prefix)
    old_day = day_of(time.time() - 3 * DAY_S)
    old = _event("alice", 777, ts=day_start(old_day) + 3600)
    r = redis.Redis.from_url(redis_url)
    try:
        r.sadd(keys.seen(old_day), old.event_id)
        r.xadd(keys.events, {"e": old.to_json()})
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix) as gw:
            resp = httpx.post(gw.base_url + "/chat/completions", timeout=30,
                              headers={"authorization": f"Bearer {SECRETS['alice']}"},
                              json={"model": "short", "messages": [{"role": "user", "content": "hi"}]})
            assert resp.status_code == 200
            since = day_of(time.time() - 5 * DAY_S)

            def usage(secret: str, since: str) -> httpx.Response:
                return httpx.get(gw.base_url + "/usage", params={"group_by": "day", "since": since},
                                 headers={"authorization": f"Bearer {secret}"}, timeout=10)

            refused = usage(SECRETS["alice"], since)
            assert refused.status_code == 400, refused.text
            err = refused.json()["error"]
            assert err["code"] == "usage_scan_too_large" and err["type"] == "invalid_request_error"
            assert "admin" in err["message"]
            admin = usage(ADMIN_SECRET, since)
            assert admin.status_code == 200
            assert {d["day"]: d["cost_micro_usd"] for d in admin.json()["data"]}[old_day] == 777
            today = datetime.now(UTC).strftime("%Y-%m-%d")
            mine = usage(SECRETS["alice"], today)
            assert mine.status_code == 200 and [d["day"] for d in mine.json()["data"]] == [today]

            # raw events (no group_by) filter everyone's stream by key: a key may read two days of it per query
            def raw(secret: str, since: str, until: str | None = None) -> httpx.Response:
                return httpx.get(gw.base_url + "/usage", params={"since": since, **({"until": until} if until else {})},
                                 headers={"authorization": f"Bearer {secret}"}, timeout=10)

            month = raw(SECRETS["alice"], since)
            assert month.status_code == 400, month.text
            assert month.json()["error"]["code"] == "usage_scan_too_large"
            assert raw(ADMIN_SECRET, since).status_code == 200
            window = raw(SECRETS["alice"], today)
            assert window.status_code == 200 and len(window.json()["data"]) == 1  # alice's one request of today
    finally:
        r.close()
        cleanup(redis_url, prefix)


def test_the_late_index_keeps_only_what_reads_can_use(redis_url: str, tmp_path: Path) -> None:
    """Every event written late renewed the late index's expiry and nothing trimmed it: it only grew. Entries whose
    ``ts`` is older than the cubes' lifetime (400 days) serve no read: each late write drops them; younger ones
    stay."""
    async def go(meter: Meter) -> None:
        late_key = meter.keys.late_events
        now_ms = int(time.time() * 1000)
        await meter.redis.zadd(late_key, {"1-0": now_ms - 401 * DAY_S * 1000,  # past the cubes' lifetime
                                          "2-0": now_ms - 399 * DAY_S * 1000})  # still readable
        await meter.record(_event("a", 5, ts=time.time() - 3600))  # written an hour after its ts: late
        members = [m.decode() for m in await meter.redis.zrange(late_key, 0, -1)]  # type: ignore[union-attr]
        assert "1-0" not in members and "2-0" in members and len(members) == 2

    on_meter(redis_url, tmp_path, go, late_after_s=1.0)


def test_an_event_of_a_replica_whose_clock_runs_ahead_is_read(redis_url: str, tmp_path: Path) -> None:
    """A replica whose clock runs ahead of Redis's stamps ``ts`` after the stream id Redis gives its event (a cache
    hit or a refusal is written within milliseconds of its ``ts``: a few ms of skew suffice). A read by id range that
    started at ``since`` missed it: a raw export and a grouped query's sub-day edge left it out while the cubes and
    the counters had it; reads start ``EARLY_SLACK_S`` before ``since``, as :meth:`Meter.recent` does."""
    async def go(meter: Meter) -> None:
        ahead = _event("a", 42, ts=time.time() + 5.0)  # stamped by a clock 5 s ahead, written now
        before = _event("a", 7, ts=time.time() - 5.0)
        await meter.record_many([before, ahead])
        since, until = ahead.ts - 1.0, ahead.ts + 1.0  # after its stream id, around its ts
        assert [e.event_id async for e in meter.events(since, until)] == [ahead.event_id]
        assert [e.event_id async for e in meter.events(since)] == [ahead.event_id]
        got = await meter.grouped(["key"], since, until, None, time.time())
        assert got.scan_windows == [(since, until)] and got.rows == group([ahead], ["key"])

    on_meter(redis_url, tmp_path, go)


def test_an_until_far_ahead_plans_no_days_past_the_last_counted(redis_url: str, tmp_path: Path) -> None:
    """``until=9999-12-31`` (any key may send it) planned every day up to it — 2.9 million seen-set reads and verdicts,
    over a minute of Redis and event loop per query. Days past tomorrow and the last day counted hold nothing: the
    plan stops there, one edge (nothing written in it) to ``until``; a key's query is answered, not refused."""
    async def go(meter: Meter) -> None:
        now = time.time()
        events = [_event("a", 3, ts=now - DAY_S), _event("a", 5, ts=now), _event("b", 8, ts=now)]
        await meter.record_many(events)
        since, until = day_start(day_of(now - DAY_S)), MAX_TIME_S
        for key in ("a", None):
            t0 = time.monotonic()
            got = await meter.grouped(["key"], since, until, key, now, 2 * DAY_S)
            assert time.monotonic() - t0 < 2.0  # the plan alone took 15 s of event loop, unawaited
            assert got.rows == group([e for e in events if key in (None, e.key_id)], ["key"])
            assert got.cube_days == [day_of(now - DAY_S), day_of(now)] and got.events_scanned == 0
            assert got.scan_windows == [(day_start(day_of(now + 2 * DAY_S)), until)]

    on_meter(redis_url, tmp_path, go)
