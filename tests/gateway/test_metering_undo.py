"""A metering script that fails partway writes nothing, and its event is not lost: against a real Redis.

A ThinkGate key of the wrong type (a string SET at the stream, a counter hash, a cube, a tag level's hash) or a hash
field that is no integer makes a command of ``RECORD``/``AUDIT`` fail after earlier writes of the same call; Redis
does not roll those back. The scripts undo their own writes (``UNDO_LUA``, ``gateway/state/undo.py``) and the
event goes to the dead-letter spool, retried until the key is fixed — then counted exactly once; the other events of
the same pipelined batch are counted at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

import pytest
import redis
from redis.exceptions import ResponseError

from gateway.config import MetricsConfig
from gateway.ledger.event import UsageEvent
from gateway.observability.metrics import Metrics
from gateway.state.keys import RedisKeys
from gateway.state.write_ahead import WalRecord, WriteAhead
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.redis_stack import Stack, snapshot, stack
from tests.fixtures.usage_events import PRICES, usage_event

TAG = "team=a"
RESERVED_TOKENS = 5000
TPM_BEFORE = 7000


def _event(key: str, i: int, *, tags: dict[str, str] | None = None, audit: bool = False,
           ts: float | None = None) -> UsageEvent:
    # over_bound: its cube-only count (over_bound_events) is undone too
    return usage_event(key, i, ts=ts, tags=tags, audit=audit, over_bound=i % 2 == 1)


async def _open_request(st: Stack, ev: UsageEvent) -> None:
    """What admission and the upstream call leave for ``ev``: reservations at its key, its tags and the global level,
    the key's TPM window and the call's write-ahead record."""
    r, k = st.handle.client, st.meter.keys
    exp = int(time.time() * 1000) + 600_000
    hashes = [k.reservations(ev.key_id), k.level_reservations("global", "global"),
              *(k.level_reservations("tag", f"{n}={v}") for n, v in ev.tags.items())]
    for i, h in enumerate(hashes):
        await r.hset(h, ev.event_id, f"9000|{RESERVED_TOKENS if i == 0 else 0}|{exp}")
        await r.pexpire(h, 600_000)  # as admission's reserve() does
    await r.set(k.tpm(ev.key_id, ev.minute), TPM_BEFORE, px=120_000)
    await r.hset(k.write_ahead, ev.event_id, "record")


async def _stream_ids(st: Stack) -> list[str]:
    entries = await st.handle.client.xrange(st.meter.keys.events)
    return [json.loads(fields[b"e"])["event_id"] for _, fields in entries]


def _poison(k: RedisKeys, case: str, ev: UsageEvent) -> tuple[str, str]:
    """The key of ``case`` and what breaks it: ``"string"`` (a SET) or ``"field"`` (a counter holding text)."""
    return {
        "stream": (k.events, "string"),
        "key_total": (k.key_total(ev.key_id), "string"),
        "cube": (k.agg_cube(ev.key_id, ev.day), "string"),
        "tag_day": (k.level_day("tag", TAG, ev.day), "string"),
        "tag_month": (k.level_month("tag", TAG, ev.month), "string"),
        "not_an_integer": (k.key_month(ev.key_id, ev.month), "field"),
    }[case]


async def _break(st: Stack, key: str, how: str) -> None:
    r = st.handle.client
    if how == "string":
        await r.delete(key)
        await r.set(key, "not a hash")
    else:
        await r.hset(key, "cost_micro_usd", "not a number")


CASES = ["stream", "key_total", "cube", "tag_day", "tag_month", "not_an_integer"]


@pytest.mark.parametrize("case", CASES)
async def test_a_failing_script_writes_nothing_and_its_event_counts_once_the_key_is_fixed(
        redis_url: str, redis_prefix: str, tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        k = st.meter.keys
        # written late (a replay): the late index and its HSETNX/ZADD are part of what must be undone
        bad = _event("k1", 1, tags={"team": "a"}, ts=time.time() - 2000)
        audit = _event("k1", 2, audit=True)  # in the cube and the stream, no counter
        poisoned, how = _poison(k, case, bad)
        fails_audit = case in ("stream", "cube")
        await _open_request(st, bad)  # (an audit event has no reservation, no write-ahead record)
        await _break(st, poisoned, how)

        # 1. nothing counted yet: a batch of failing events leaves Redis exactly as it was (TTLs aside)
        batch1 = [bad, audit] if fails_audit else [bad]
        before = await snapshot(st)
        caplog.set_level(logging.ERROR, logger="thinkgate.metering")
        results = await st.meter.record_many(batch1)
        assert [r.stored for r in results] == ["dead_letter"] * len(batch1)
        assert await snapshot(st) == before
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and bad.event_id in r.getMessage()]
        assert len(errors) == 1 and poisoned in errors[0].getMessage()
        assert [e.event_id for e in st.meter.dead.read_all()] == [e.event_id for e in batch1]
        assert st.meter.dead_lettered == len(batch1)

        # 2. a batch mixing them with events that can be counted: those are, the failing ones leave no trace
        ok = _event("k2", 3)  # another key, no tag: touches none of the poisoned keys but the stream
        await _open_request(st, ok)
        bad2 = _event("k1", 4, tags={"team": "a"})
        await _open_request(st, bad2)
        seen_before = await st.handle.client.smembers(k.seen(bad.day))
        results = await st.meter.record_many([bad2, ok])
        if case == "stream":
            assert [r.stored for r in results] == ["dead_letter", "dead_letter"]
        else:
            assert [r.stored for r in results] == ["dead_letter", "redis"] and results[1].counted
            assert (await st.meter.key_counters("k2"))["requests"] == 1
        seen = await st.handle.client.smembers(k.seen(bad.day))
        assert bad2.event_id.encode() not in seen and bad.event_id.encode() not in seen
        assert seen - seen_before == (set() if case == "stream" else {ok.event_id.encode()})
        assert bad2.event_id not in (await _stream_ids(st) if case != "stream" else [])
        for ev in (bad, bad2):  # reservations and write-ahead record untouched
            assert await st.handle.client.hexists(k.reservations("k1"), ev.event_id)
            assert await st.handle.client.hexists(k.level_reservations("tag", TAG), ev.event_id)
            assert await st.handle.client.hexists(k.level_reservations("global", "global"), ev.event_id)
            assert await st.handle.client.hget(k.write_ahead, ev.event_id) == b"record"

        # 3. a retry while the key is still broken changes nothing and keeps them
        dead_ids = [e.event_id for e in st.meter.dead.read_all()]
        snap = await snapshot(st)
        sent, kept = await st.meter.retry_dead_letters()
        assert sent == kept == len(dead_ids)
        assert await snapshot(st) == snap
        assert sorted(e.event_id for e in st.meter.dead.read_all()) == sorted(dead_ids)

        # 4. the operator deletes the key: the next retry counts every one of them exactly once
        await st.handle.client.delete(poisoned)
        assert await st.meter.retry_dead_letters() == (len(dead_ids), 0)
        assert st.meter.dead.read_all() == [] and st.meter.dead.pending_bytes() == 0
        assert await st.meter.retry_dead_letters() == (0, 0)
        everything = [bad, bad2, ok, audit] if fails_audit else [bad, bad2, ok]
        ids = await _stream_ids(st)
        assert sorted(ids) == sorted(e.event_id for e in everything)  # each once in the stream
        seen = await st.handle.client.smembers(k.seen(bad.day)) | await st.handle.client.smembers(k.seen(audit.day))
        assert {e.event_id.encode() for e in everything} <= seen
        counted = [bad, bad2, ok]
        glob = await st.handle.client.hgetall(k.level_day("global", "global", bad.day))
        assert int(glob[b"requests"]) == 3
        assert int(glob[b"cost_micro_usd"]) == sum(e.cost_micro_usd for e in counted)
        tag = await st.handle.client.hgetall(k.level_month("tag", TAG, bad.month))
        assert (int(tag[b"requests"]), int(tag[b"cost_micro_usd"])) == (2, bad.cost_micro_usd + bad2.cost_micro_usd)
        if case not in ("key_total", "not_an_integer"):  # those two hashes were deleted by the fix
            assert (await st.meter.key_counters("k1"))["requests"] == 2
            assert (await st.meter.key_counters("k1", month=bad.month))["prompt_tokens"] == (
                bad.prompt_tokens + bad2.prompt_tokens)
        for ev in (bad, bad2):
            assert not await st.handle.client.hexists(k.reservations("k1"), ev.event_id)
            assert not await st.handle.client.hexists(k.write_ahead, ev.event_id)
        # the TPM window corrected once per counted event of the key (real tokens - reserved)
        tpm = sum(e.upstream_tokens - RESERVED_TOKENS for e in (bad, bad2) if e.minute == bad.minute)
        assert int(await st.handle.client.get(k.tpm("k1", bad.minute))) == TPM_BEFORE + tpm
        # sent again (a replay): nothing counted twice
        assert not any(r.counted for r in await st.meter.record_many(everything))
        assert int((await st.handle.client.hgetall(k.level_day("global", "global", bad.day)))[b"requests"]) == 3


async def test_one_refused_event_does_not_hold_the_spool_back(redis_url: str, redis_prefix: str,
                                                              tmp_path: Path) -> None:
    """The spool replay sends a batch in which Redis refuses one event: the others are counted, the file is
    emptied, the refused one waits in the dead-letter spool (a replay that raised kept the whole file forever)."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        k = st.meter.keys
        bad, ok = _event("k1", 1, tags={"team": "a"}), _event("k2", 2)
        await st.handle.client.set(k.key_total("k1"), "not a hash")
        await st.spool.append([bad, ok])
        assert await st.meter.replay() == 2
        assert st.spool.pending_bytes() == 0 and await st.meter.replay() == 0
        assert (await st.meter.key_counters("k2"))["requests"] == 1
        assert [e.event_id for e in st.meter.dead.read_all()] == [bad.event_id]
        assert not await st.handle.client.sismember(k.seen(bad.day), bad.event_id)
        await st.handle.client.delete(k.key_total("k1"))
        assert await st.meter.retry_dead_letters() == (1, 0)
        assert (await st.meter.key_counters("k1"))["requests"] == 1
        assert await _stream_ids(st) == [ok.event_id, bad.event_id]


async def test_a_single_event_is_kept_too(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """``Meter.record`` (one event, no pipeline) refused: dead-lettered, nothing written."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        k = st.meter.keys
        bad = _event("k1", 1, tags={"team": "a"})
        await _open_request(st, bad)
        await st.handle.client.set(k.level_month("global", "global", bad.month), "not a hash")
        before = await snapshot(st)
        assert (await st.meter.record(bad)).stored == "dead_letter"
        assert await snapshot(st) == before
        await st.handle.client.delete(k.level_month("global", "global", bad.month))
        assert await st.meter.retry_dead_letters() == (1, 0)
        assert await _stream_ids(st) == [bad.event_id]


async def test_orphan_settlement_is_all_or_nothing_and_one_refused_orphan_does_not_stop_the_pass(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """``settle_orphan`` (RECORD with the claim) and ``release_orphan`` (RELEASE) refused: nothing written, the
    write-ahead record stays; the reconciler goes on to the next record; after the fix both settle."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        r, k = st.handle.client, st.meter.keys
        cfg = st.metering_cfg.model_copy(update={"heartbeat_ttl_s": 0.5})
        wal = WriteAhead(st.handle, st.breaker, st.meter, cfg, {"short": PRICES}, owner="live:1:x")
        now = time.time()
        sent = WalRecord(request_id=uuid.uuid4().hex, key_id="k1", owner="dead:1:x", ts=now, updated_ms=0,
                         tags={"team": "a"}, tier="short", completion_tokens=40)
        unsent = WalRecord(request_id=uuid.uuid4().hex, key_id="k1", owner="dead:1:x", ts=now, updated_ms=0,
                           tags={"team": "a"}, tier="short", waiting=True)
        fine = WalRecord(request_id=uuid.uuid4().hex, key_id="k2", owner="dead:1:x", ts=now, updated_ms=0,
                         tags={}, tier="short", completion_tokens=5)
        exp = int(now * 1000) + 600_000
        for rec in (sent, unsent, fine):
            await r.hset(k.write_ahead, rec.request_id, rec.to_json())
            await r.hset(k.reservations(rec.key_id), rec.request_id, f"9000|{RESERVED_TOKENS}|{exp}")
            await r.hset(k.level_reservations("global", "global"), rec.request_id, f"9000|0|{exp}")
        await r.set(k.tpm("k1", sent.event(PRICES).minute), TPM_BEFORE, px=120_000)
        # RECORD fails at the tag's month hash (late in the script), RELEASE at its cube (in the audit part)
        await r.set(k.level_month("tag", TAG, sent.event(PRICES).month), "not a hash")
        await r.set(k.agg_cube("k1", unsent.unsent_event().day), "not a hash")
        before = await snapshot(st)
        hb = k.heartbeat("dead:1:x")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await st.meter.settle_orphan(sent.event(PRICES), hb)
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await st.meter.release_orphan(unsent.unsent_event(), hb)
        assert await snapshot(st) == before
        # the reconciler: the refused records stay, the other one is counted
        assert await wal.reconcile() == 0  # first sight of a dead owner: suspects only
        await asyncio.sleep(0.6)
        assert await wal.reconcile() == 1
        assert await r.hexists(k.write_ahead, sent.request_id) and await r.hexists(k.write_ahead, unsent.request_id)
        assert not await r.hexists(k.write_ahead, fine.request_id)
        assert (await st.meter.key_counters("k2"))["requests"] == 1
        await r.delete(k.level_month("tag", TAG, sent.event(PRICES).month), k.agg_cube("k1", unsent.unsent_event().day))
        assert await wal.reconcile() == 0  # suspects again (the refused ones left the list)
        await asyncio.sleep(0.6)
        assert await wal.reconcile() == 1 and wal.released == 1
        assert not await r.hexists(k.write_ahead, sent.request_id)
        assert not await r.hexists(k.write_ahead, unsent.request_id)
        assert not await r.hexists(k.reservations("k1"), unsent.request_id)
        assert (await st.meter.key_counters("k1"))["requests"] == 1
        assert sorted(await _stream_ids(st)) == sorted([fine.request_id, sent.request_id,
                                                        unsent.unsent_event().event_id])


def test_dead_letters_are_in_the_metrics() -> None:
    metrics = Metrics(MetricsConfig(), [])
    text = metrics.render(False, 0, 0, 123, 2).decode()
    assert "thinkgate_usage_dead_lettered_events_total 2.0" in text
    assert "thinkgate_usage_dead_letter_bytes 123.0" in text
    text = metrics.render(False, 0, 0, 0, 3).decode()  # the meter's running count: the counter adds what is new
    assert "thinkgate_usage_dead_lettered_events_total 3.0" in text and "thinkgate_usage_dead_letter_bytes 0.0" in text


async def test_a_zero_cost_event_is_undone_too(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A zero-cost event (a cache hit) refused at the global month hash: its level increments were ``+0``, whose undo
    was ``HINCRBY … -0`` — no integer to Redis, so it failed and left the day's global hash behind (no TTL)."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        k = st.meter.keys
        hit = _event("k1", 1)
        hit.cached, hit.cost_micro_usd = True, 0
        await st.handle.client.set(k.level_month("global", "global", hit.month), "not a hash")
        before = await snapshot(st)
        assert (await st.meter.record(hit)).stored == "dead_letter"
        assert await snapshot(st) == before


async def test_a_retry_while_still_refused_sends_only_the_oldest(redis_url: str, redis_prefix: str,
                                                                  tmp_path: Path) -> None:
    """While the key is still broken a retry sends the oldest ``DEAD_LETTER_PROBE`` dead letters and leaves the
    file as it is (it sent every one and rewrote the file each pass); once fixed, every one is counted, once."""
    from gateway.state.metering import DEAD_LETTER_PROBE

    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        k = st.meter.keys
        events = [_event("k1", i) for i in range(DEAD_LETTER_PROBE + 70)]
        await st.handle.client.set(k.key_total("k1"), "not a hash")
        await st.meter.dead.append(events)
        path = st.meter.dead.path
        before, inode = path.read_bytes(), path.stat().st_ino
        assert await st.meter.retry_dead_letters() == (DEAD_LETTER_PROBE, DEAD_LETTER_PROBE)
        assert path.read_bytes() == before and path.stat().st_ino == inode  # not rewritten
        await st.handle.client.delete(k.key_total("k1"))
        assert await st.meter.retry_dead_letters() == (len(events), 0)
        assert (await st.meter.key_counters("k1"))["requests"] == len(events)
        assert sorted(await _stream_ids(st)) == sorted(e.event_id for e in events)


async def test_on_a_cluster_a_refused_event_is_dead_lettered_and_counted_once_fixed(redis_cluster: ClusterSet,
                                                                                   tmp_path: Path) -> None:
    """Redis Cluster has no lane and no pipeline of scripts: events go one by one through redis-py's cluster client,
    which raises an error reply instead of returning it — the same all-or-nothing script, the same dead letter."""
    prefix = f"tgdl{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl") as st:
        assert st.handle.kind == "cluster" and st.handle.lane is None
        k = st.meter.keys
        bad, ok = _event("k1", 1, tags={"team": "a"}), _event("k2", 2)
        await _open_request(st, bad)
        await st.handle.client.set(k.key_total("k1"), "not a hash")
        before = await st.handle.client.hgetall(k.reservations("k1"))
        results = await st.meter.record_many([bad, ok])
        assert [r.stored for r in results] == ["dead_letter", "redis"]
        assert [e.event_id for e in st.meter.dead.read_all()] == [bad.event_id]
        assert not await st.handle.client.sismember(k.seen(bad.day), bad.event_id)
        assert await st.handle.client.hgetall(k.reservations("k1")) == before  # the release undone too
        assert (await st.meter.key_counters("k2"))["requests"] == 1
        await st.handle.client.delete(k.key_total("k1"))
        assert await st.meter.retry_dead_letters() == (1, 0)
        assert (await st.meter.key_counters("k1"))["requests"] == 1
        assert await st.handle.client.hgetall(k.reservations("k1")) == {}


async def test_on_a_cluster_a_write_failing_without_an_error_reply_is_spooled_not_lost(redis_cluster: ClusterSet,
                                                                                      tmp_path: Path) -> None:
    """A slot left half-migrated (``MIGRATING`` on its master, the target not ``IMPORTING``: a resharding that
    stopped) bounces redis-py's cluster client between ASK and MOVED until it gives up with ``ClusterError("TTL
    exhausted.")`` — neither an outage nor an error reply. The batch's events (written event by event on a Cluster)
    are kept in the usage spool and counted once each when the slot is stable again. Before, the first event's
    exception left ``record_many``, the writer only logged it, and the whole batch was gone."""
    prefix = f"tgmig{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl") as st:
        assert st.handle.kind == "cluster"
        k = st.meter.keys
        events = [_event("k1", 1), _event("k2", 2)]
        src = redis_cluster.master_of(k.key_total("k1"))
        dst = next(p for p in redis_cluster.masters() if p != src)
        admin = redis.Redis(port=src)
        slot = int(admin.execute_command("CLUSTER", "KEYSLOT", k.key_total("k1")))
        dst_id = redis.Redis(port=dst).execute_command("CLUSTER", "MYID")
        admin.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        try:
            results = await st.meter.record_many(events)
        finally:
            admin.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        assert [r.stored for r in results] == ["spool", "spool"]
        # written 16 at a time on a Cluster: in the spool in any order
        assert sorted(e.event_id for e in st.meter.spool.read_all()) == sorted(e.event_id for e in events)
        assert await st.meter.replay() == 2
        assert await st.meter.replay() == 0
        assert (await st.meter.key_counters("k1"))["requests"] == 1
        assert (await st.meter.key_counters("k2"))["requests"] == 1


async def test_one_event_that_always_raises_does_not_hold_the_usage_spool_back(redis_url: str,
                                                                              tmp_path: Path) -> None:
    """A spooled event whose write raises neither an outage nor an error reply every time (here a line whose ``ts``
    is not a number — a hand-edited or version-skewed spool): the replay used to raise it on every pass, the drain
    kept the whole file, and nothing an outage had spooled was ever counted. Now the batch is sent again one event
    at a time, the one that raises goes to the dead-letter spool, the others are counted."""
    prefix = f"tgpoison{uuid.uuid4().hex[:6]}:"
    async with stack(redis_url, prefix, tmp_path / "spool.jsonl") as st:
        good = [_event("k1", 1), _event("k1", 2)]
        bad = json.loads(_event("k1", 3).to_json())
        bad["ts"] = "not a number"
        with open(st.meter.spool.path, "ab") as f:
            f.write(good[0].to_json() + b"\n" + json.dumps(bad).encode() + b"\n" + good[1].to_json() + b"\n")
        assert await st.meter.replay() == 3
        assert st.meter.spool.pending_bytes() == 0
        assert (await st.meter.key_counters("k1"))["requests"] == 2
        assert [e.event_id for e in st.meter.dead.read_all()] == [bad["event_id"]]
