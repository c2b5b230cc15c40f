"""Grouped usage from the per-day cubes equals the stream scan, exactly, on a real Redis.

A random event set (keys, the unknown key ``""``, tiers and models with and without, 0–2 tags, cache hits, errors,
client disconnects, events held to their admitted bound, refused requests) over four UTC days, counted through every
path that counts in production — the batched writer (``record_many``), single writes, duplicates (a lost reply
resent), the spool replay and the orphan reconciler's claim (``settle_orphan``) — then every group-by field and
combinations, per key and for all keys, over whole days and periods with sub-day edges: :meth:`Meter.grouped` must
give the rows :func:`gateway.ledger.export.group` gives over :meth:`Meter.events`, which must equal the rows of the
events as generated. Then an upgrade: days counted without cubes are answered from the stream until the backfill
rebuilds them.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from gateway.ledger.aggregate import DAY_S, day_of, day_start
from gateway.ledger.event import UsageEvent
from gateway.ledger.export import group
from gateway.state.metering import Meter
from tests.fixtures.redis_stack import stack

KEYS = ("alice", "bob", "carol", "")  # "": refusals of an unknown key
TIERS = ("short", "long", None)
MODELS = ("m-small", "m-big", None)
TAGS = ({}, {"team": "a"}, {"team": "b"}, {"team": "a", "project": "x"}, {"project": "y"})
GROUPINGS = (["key"], ["tier"], ["model"], ["day"], ["tag"], ["tag:team"], ["tag:project"], ["tag:none"],
             ["key", "tier"], ["day", "key", "model"], ["tag", "tier"], ["key", "tier", "model", "day", "tag"],
             ["tag:team", "tag:project", "day"])


def random_events(rng: random.Random, n: int, first_day: float, n_days: int) -> list[UsageEvent]:
    out = []
    for i in range(n):
        key = rng.choice(KEYS)
        audit = key == "" or rng.random() < 0.08
        tier, model = rng.choice(TIERS), rng.choice(MODELS)
        ts = first_day + rng.uniform(0, n_days * DAY_S)
        if i % 50 == 0:  # some events right at a midnight: the day edge belongs to the later day
            ts = first_day + DAY_S * rng.randrange(n_days)
        ev = UsageEvent(key_id=key, requested_model="auto", ts=ts, tags=dict(rng.choice(TAGS)), tier=tier,
                        upstream_model=model, route_reason="predicted", audit=audit)
        if audit:
            ev.status, ev.error_code = rng.choice([(429, "budget_exceeded"), (401, "invalid_key"), (400, "bad")])
        else:
            ev.prompt_tokens = rng.randrange(0, 5000)
            ev.cached_tokens = rng.randrange(0, ev.prompt_tokens + 1) if rng.random() < 0.3 else 0
            ev.completion_tokens = rng.randrange(0, 3000)
            ev.reasoning_tokens = rng.randrange(0, ev.completion_tokens + 1)
            ev.cached = rng.random() < 0.15
            if ev.cached:
                ev.saved_micro_usd = rng.randrange(1, 10**7)
            else:
                ev.cost_micro_usd = rng.randrange(0, 10**7)
            ev.status = rng.choice([200, 200, 200, 200, 499, 500, 502])
            ev.partial = ev.status == 499 or rng.random() < 0.05
            ev.over_bound = rng.random() < 0.1  # held to its admitted bound: over_bound_events
        out.append(ev)
    return out


async def count_every_way(meter: Meter, events: list[UsageEvent]) -> None:
    """Count ``events`` through the writer's batches, single writes, the spool replay and the orphan claim, and
    send a fifth of them twice (each must count once)."""
    for i in range(0, len(events) * 6 // 10, 40):
        await meter.record_many(events[i:i + 40][: len(events) * 6 // 10 - i])
    singles = events[len(events) * 6 // 10: len(events) * 7 // 10]
    for ev in singles:
        await meter.record(ev)
    spooled = events[len(events) * 7 // 10: len(events) * 9 // 10]
    await meter.spool.append(spooled)
    assert await meter.replay() == len(spooled)
    orphans = [e for e in events[len(events) * 9 // 10:] if not e.audit]
    rest = [e for e in events[len(events) * 9 // 10:] if e.audit]
    for ev in orphans:  # a dead process's write-ahead record, claimed by the reconciler
        await meter.redis.hset(meter.keys.write_ahead, ev.event_id, "{}")
        assert (await meter.settle_orphan(ev, meter.keys.heartbeat("dead-owner"))).counted
    await meter.record_many(rest)
    again = await meter.record_many(events[::5])
    assert not any(r.counted for r in again)


async def scan_rows(meter: Meter, group_by: list[str], since: float, until: float | None,
                    key: str | None) -> list[dict[str, Any]]:
    return group([e async for e in meter.events(since, until) if key is None or e.key_id == key], group_by)


def truth(events: list[UsageEvent], group_by: list[str], since: float, until: float | None,
          key: str | None) -> list[dict[str, Any]]:
    return group([e for e in events if since <= e.ts and (until is None or e.ts < until)
                  and (key is None or e.key_id == key)], group_by)


async def test_grouped_usage_from_the_cubes_equals_the_scan(redis_url: str, redis_prefix: str,
                                                             tmp_path: Path) -> None:
    rng = random.Random(20261206)
    now = time.time()
    first = day_start(day_of(now)) - 3 * DAY_S  # four days: three whole ones and today
    events = random_events(rng, 700, first, 4)
    events = [e for e in events if e.ts < now]
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", socket_timeout_s=5.0) as st:
        await count_every_way(st.meter, events)
        periods: list[tuple[float, float | None]] = [
            (first, None),  # the dashboard's and GET /v1/usage's default: whole days to now
            (first, first + 2 * DAY_S),  # whole days, closed
            (first + 5 * 3600.5, first + 2 * DAY_S + 7 * 3600),  # sub-day edges at both ends
            (first + DAY_S + 100, first + DAY_S + 50_000),  # inside one day
            (first + 2 * DAY_S, first + 3 * DAY_S - 1),  # a day less one second
        ]
        for since, until in periods:
            for key in (None, "alice", "", "nobody"):
                for group_by in GROUPINGS:
                    got = await st.meter.grouped(group_by, since, until, key, now)
                    want = await scan_rows(st.meter, group_by, since, until, key)
                    assert got.rows == want, (since, until, key, group_by)
                    assert want == truth(events, group_by, since, until, key), (since, until, key, group_by)
        # whole days came from the cubes: nothing of them was scanned
        whole = await st.meter.grouped(["key"], first, first + 3 * DAY_S, None, now)
        assert whole.cube_days == [day_of(first + i * DAY_S) for i in range(3)]
        assert (whole.scan_windows, whole.events_scanned) == ([], 0)
        default = await st.meter.grouped(["day"], first, None, None, now)
        assert day_of(now) in default.cube_days and default.events_scanned == 0
        edges = await st.meter.grouped(["day"], first + 3600, first + 2 * DAY_S + 3600, None, now)
        assert edges.cube_days == [day_of(first + DAY_S)]
        assert edges.scan_windows == [(first + 3600, first + DAY_S), (first + 2 * DAY_S, first + 2 * DAY_S + 3600)]


async def test_days_counted_without_cubes_are_scanned_until_the_backfill(redis_url: str, redis_prefix: str,
                                                                        tmp_path: Path) -> None:
    rng = random.Random(7)
    now = time.time()
    first = day_start(day_of(now)) - 3 * DAY_S
    events = [e for e in random_events(rng, 300, first, 3)]
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", socket_timeout_s=5.0) as st:
        m, k = st.meter, st.meter.keys
        old = [e for e in events if e.ts < first + DAY_S + DAY_S / 2]  # counted before the upgrade
        new = [e for e in events if e.ts >= first + DAY_S + DAY_S / 2]
        await m.record_many(old)
        # what a deployment that counted these with the previous script holds: stream, seen-sets, counters — and
        # no cube, no aggregated count
        for d in (day_of(first), day_of(first + DAY_S)):
            ids = [m.decode() if isinstance(m, bytes) else m for m in await m.redis.smembers(k.agg_day_keys(d))]
            await m.redis.delete(k.agg_day_keys(d), *(k.agg_cube(i, d) for i in ids))
            await m.redis.hdel(k.agg_index, f"n:{d}", f"ok:{d}")
        await m.record_many(new)  # after the upgrade: the second day is half aggregated
        for group_by in (["key", "tier"], ["day", "tag"]):
            got = await m.grouped(group_by, first, None, None, now)
            assert got.rows == await scan_rows(m, group_by, first, None, None) == truth(events, group_by, first,
                                                                                        None, None)
        before = await m.grouped(["day"], first, first + 3 * DAY_S, None, now)
        assert before.cube_days == [day_of(first + 2 * DAY_S)]  # the first two days are scanned
        assert before.scan_windows == [(first, first + 2 * DAY_S)]
        assert await m.backfill(None, now) == {"days": 3, "rebuilt": 2, "skipped": 0, "complete": 1}
        after = await m.grouped(["day"], first, first + 3 * DAY_S, None, now)
        assert (after.cube_days, after.scan_windows, after.events_scanned) == (
            [day_of(first + i * DAY_S) for i in range(3)], [], 0)
        for group_by in GROUPINGS:
            for key in (None, "bob"):
                assert (await m.grouped(group_by, first, None, key, now)).rows == truth(events, group_by, first,
                                                                                        None, key)
        # again: nothing to do; and an event counted after the backfill is aggregated by the script itself
        assert await m.backfill(None, now) == {"days": 3, "rebuilt": 0, "skipped": 0, "complete": 3}
        late = random_events(rng, 1, first + DAY_S, 1)
        await m.record(late[0])
        events += late
        assert (await m.grouped(["key", "day"], first, None, None, now)).rows == truth(events, ["key", "day"],
                                                                                      first, None, None)
