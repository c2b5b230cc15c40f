"""The dashboard's window of recent events (``Meter.recent``) is complete only when it holds every event of its
period: the events a read by id range finds (``Meter.events``) — those written late too (a spool replay, a
reconciled orphan: the late index), those written up to ``metering.late_after_s`` after their ``ts``, and those of
a period from before the late index (``late:from``), which only a read to the stream's end finds. Real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from gateway.config import MeteringConfig, RedisConfig
from gateway.ledger.event import UsageEvent
from gateway.state.breaker import Breaker
from gateway.state.metering import Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool


def _event(key: str, ts: float) -> UsageEvent:
    return UsageEvent(key_id=key, requested_model="auto", ts=ts, tier="short", upstream_model="m",
                      prompt_tokens=10, completion_tokens=5, cost_micro_usd=7)


def _meter(redis_url: str, tmp_path: Path, late_after_s: float) -> Meter:
    handle = connect(RedisConfig(url=redis_url, key_prefix=f"tgtest:{uuid.uuid4().hex[:8]}:"))
    return Meter(handle, Breaker(1.0), Spool(tmp_path / "spool.jsonl"),
                 MeteringConfig(spool_path=tmp_path / "spool.jsonl", late_after_s=late_after_s))


async def _check(meter: Meter, since: float, until: float) -> None:
    wanted = [e.event_id async for e in meter.events(since, until)]
    events, read = await meter.recent(100, since, until)
    assert wanted, "the period has an event (a read by id range finds it)"
    assert read < 100  # the window says it holds the whole period…
    assert [e.event_id for e in events] == wanted  # …so it holds what the period's reads find


def test_an_event_written_late_is_in_a_complete_window(redis_url: str, tmp_path: Path) -> None:
    """An event of a closed period written an hour after its ts (a spool replay, an orphan reconciled): in the late
    index, found by every read of its period — but the window stopped 900 s past the period and said complete."""

    async def go() -> None:
        meter = _meter(redis_url, tmp_path, late_after_s=900.0)
        now = time.time()
        await meter.record_many([_event("a", now - 3600), _event("a", now - 3500)])
        try:
            await _check(meter, now - 4000, now - 3000)
        finally:
            await meter.redis.aclose()

    asyncio.run(go())


def test_an_event_within_late_after_s_is_in_a_complete_window(redis_url: str, tmp_path: Path) -> None:
    """``metering.late_after_s`` 1 h: an event written 20 minutes after its ts is not indexed late (reads by id range
    go on an hour past the period) — and the window, which went on 900 s, missed it and said complete."""

    async def go() -> None:
        meter = _meter(redis_url, tmp_path, late_after_s=3600.0)
        now = time.time()
        await meter.record(_event("a", now - 1200))
        try:
            await _check(meter, now - 1300, now - 1100)
        finally:
            await meter.redis.aclose()

    asyncio.run(go())


def test_a_period_from_before_the_late_index_is_read_to_the_stream_end(redis_url: str, tmp_path: Path) -> None:
    """An event written an hour after its ts by the script before the late index (no ``late:from`` yet, no late
    entry: the upgrade came later). ``Meter.events`` cannot stop its read of that period early, and finds it; the
    window stopped 900 s past the period anyway — reading nothing, it said complete without the event."""

    async def go() -> None:
        meter = _meter(redis_url, tmp_path, late_after_s=900.0)
        now = time.time()
        old = _event("a", now - 3600)
        # the old script: the event appended to the stream, with no late index and no late:from
        await meter.redis.xadd(meter.keys.events, {"e": old.to_json()})
        await meter.record(_event("b", now))  # the upgrade: the first event the new script writes sets late:from
        try:
            assert await meter.redis.hget(meter.keys.agg_index, "late:from") is not None
            await _check(meter, now - 4000, now - 3000)
            events, read = await meter.recent(1, now - 4000, now - 3000)  # the newest entry alone: not the period's
            assert (events, read) == ([], 1)  # …and the window does not say it is complete (read == limit)
        finally:
            await meter.redis.aclose()

    asyncio.run(go())
