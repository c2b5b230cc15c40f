"""``thinkgate usage backfill`` rebuilds a day all or nothing, whatever the day's keys hold, on a real Redis.

A day's rebuild is one ``BACKFILL`` script call (``gateway/state/metering.py``): it cannot fail after its first write.
Its first command reads the cube index (a key of the wrong type there fails it before anything is written), and every
other key it writes — the day's cubes, old and new, and the day's key set — it deletes first (``DEL`` takes a key of
any type), so no command after its first write can meet a key of the wrong type. These tests pin that: a string or a
sorted set at any of those keys is rebuilt from the stream; a string at the index leaves Redis as it was. Across days
the backfill is re-runnable: a rebuilt day is complete and skipped, the others are rebuilt by the next run. A day key
set of the wrong type used to stop the whole backfill at the read before the first day (``SMEMBERS``), though that
day's script rebuilds it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

from gateway.ledger.aggregate import DAY_S, day_of, day_start
from gateway.state.metering import Meter
from tests.fixtures.redis_stack import snapshot, stack
from tests.gateway.test_usage_aggregate import random_events, truth


async def _before_cubes(m: Meter, days: list[str]) -> None:
    """What a deployment that counted these days with the script before the cubes holds: no cube, no count."""
    k = m.keys
    for d in days:
        ids = [i.decode() for i in await m.redis.smembers(k.agg_day_keys(d))]
        await m.redis.delete(k.agg_day_keys(d), *(k.agg_cube(i, d) for i in ids))
        await m.redis.hdel(k.agg_index, f"n:{d}", f"ok:{d}")


@pytest.mark.parametrize("case", ["cube", "stale_cube", "day_keys"])
async def test_a_day_is_rebuilt_whatever_its_keys_hold(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                        case: str) -> None:
    """``cube``: a string at a key's cube of the day; ``stale_cube``: a sorted set at the cube of a key the day's key
    set lists but the stream has no event of; ``day_keys``: a string at the day's key set. Each day is rebuilt, the
    grouped usage equals the events'."""
    rng = random.Random(11)
    now = time.time()
    first = day_start(day_of(now)) - 3 * DAY_S
    events = random_events(rng, 200, first, 2)
    days = [day_of(first), day_of(first + DAY_S)]
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", socket_timeout_s=5.0) as st:
        m, r, k = st.meter, st.handle.client, st.meter.keys
        await m.record_many(events)
        await _before_cubes(m, days)
        d = days[0]
        if case == "cube":
            await r.set(k.agg_cube("alice", d), "not a hash")
        elif case == "stale_cube":
            await r.sadd(k.agg_day_keys(d), "zed")
            await r.zadd(k.agg_cube("zed", d), {"not": 1})
        else:
            await r.set(k.agg_day_keys(d), "not a set")
        assert await m.backfill(None, now) == {"days": 2, "rebuilt": 2, "skipped": 0, "complete": 0}
        for group_by in (["key", "tier"], ["day", "tag"], ["key", "model", "day"]):
            got = await m.grouped(group_by, first, first + 2 * DAY_S, None, now)
            assert got.cube_days == days and got.events_scanned == 0
            assert got.rows == truth(events, group_by, first, first + 2 * DAY_S, None)
        if case == "stale_cube":
            assert not await r.exists(k.agg_cube("zed", d))
        assert await m.backfill(None, now) == {"days": 2, "rebuilt": 0, "skipped": 0, "complete": 2}


async def test_a_refused_backfill_writes_nothing(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A string at the cube index: refused before the first write — no day half built; once the key is deleted the
    backfill rebuilds every day."""
    rng = random.Random(12)
    now = time.time()
    first = day_start(day_of(now)) - 3 * DAY_S
    events = random_events(rng, 100, first, 2)
    days = [day_of(first), day_of(first + DAY_S)]
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", socket_timeout_s=5.0) as st:
        m, r, k = st.meter, st.handle.client, st.meter.keys
        await m.record_many(events)
        await _before_cubes(m, days)
        await r.delete(k.agg_index)
        await r.set(k.agg_index, "not a hash")
        before = await snapshot(st)
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await m.backfill(None, now)
        assert await snapshot(st) == before
        await r.delete(k.agg_index)
        assert (await m.backfill(None, now))["rebuilt"] == 2
        got = await m.grouped(["key", "day"], first, first + 2 * DAY_S, None, now)
        assert got.rows == truth(events, ["key", "day"], first, first + 2 * DAY_S, None)
