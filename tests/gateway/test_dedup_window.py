"""An event kept past the dedup window is never replayed: against a real Redis.

A replay drops an event already counted because its ``event_id`` is in its day's seen-set, which expires
``metering.dedup_ttl_s`` after the day's last event. An event that waited longer than that — in the usage spool, the
unacked file (``metering.replica_acks``) or the dead letters — was counted twice when finally replayed. Now each replay
sets it aside in the quarantine file (a reason, one WARNING line, a metric) and counts the rest as before.

The seen-set's expiry is what forty days do to Redis: the test counts an event stamped forty days ago, then deletes
its day's seen-set, as its TTL would have.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.config import MetricsConfig, Prices
from gateway.ledger.aggregate import SEEN_MARGIN_S
from gateway.ledger.event import UsageEvent
from gateway.observability.metrics import Metrics
from gateway.state.metering import past_dedup_window
from gateway.state.write_ahead import WalRecord, WriteAhead
from tests.fixtures.redis_stack import Stack, stack

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))
DEDUP_TTL_S = 2 * 86400  # a short window (the default is 40 days): the boundary is the same arithmetic


def _event(key: str, ts: float) -> UsageEvent:
    ev = UsageEvent(key_id=key, requested_model="auto", tier="short", upstream_model="m", route_reason="predicted",
                    prompt_tokens=100, completion_tokens=50, ts=ts)
    ev.price(PRICES)
    return ev


async def _counted_then_forgotten(st: Stack, ev: UsageEvent) -> None:
    """``ev`` counted once, then its day's seen-set gone — what its TTL does ``dedup_ttl_s`` after the day's last
    event."""
    assert (await st.meter.record(ev)).counted
    assert await st.handle.client.delete(st.meter.keys.seen(ev.day)) == 1


def test_the_boundary_keeps_an_hour_of_margin() -> None:
    now = 1_700_000_000.0
    edge = now - DEDUP_TTL_S + SEEN_MARGIN_S
    assert past_dedup_window(_event("k", edge), DEDUP_TTL_S, now)
    assert not past_dedup_window(_event("k", edge + 1), DEDUP_TTL_S, now)
    bad = _event("k", now)
    bad.ts = "not a number"  # type: ignore[assignment]  # a hand-edited spool: not judged here (see the doc)
    assert not past_dedup_window(bad, DEDUP_TTL_S, now)


@pytest.mark.parametrize("where", ["spool", "unacked", "dead"])
async def test_an_event_past_the_dedup_window_is_set_aside_not_counted_twice(
        redis_url: str, redis_prefix: str, tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture) -> None:
    now = time.time()
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        old = _event("k1", now - DEDUP_TTL_S)  # stamped a window ago: its seen-set may be gone
        await _counted_then_forgotten(st, old)
        fresh = _event("k2", now - 60)
        target = {"spool": st.meter.spool, "unacked": st.meter.unacked, "dead": st.meter.dead}[where]
        await target.append([old, fresh])
        with caplog.at_level(logging.WARNING, logger="thinkgate.metering"):
            if where == "spool":
                assert await st.meter.replay() == 2
            elif where == "unacked":  # the unacked file's own replay (metering.replica_acks 0: no WAIT to pass)
                assert await st.meter.unacked.replay(st.meter._record_unacked, "unreplicated usage") == 2
            else:
                assert await st.meter.retry_dead_letters() == (2, 0)
        assert target.pending_bytes() == 0
        # counted once, where the replay used to count it again; the fresh one of the same file is counted
        assert (await st.meter.key_counters("k1"))["requests"] == 1
        assert (await st.meter.key_counters("k2"))["requests"] == 1
        [kept] = st.meter.quarantine.read_all()
        assert kept["reason"] == "past_dedup_window" and kept["event"]["event_id"] == old.event_id
        assert kept["source"] == str(target.path) and "dedup_ttl_s" in kept["detail"]
        warned = [r for r in caplog.records if "dedup_ttl_s" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING and old.event_id in warned[0].getMessage()
        assert st.meter.quarantine.counts == {"past_dedup_window": 1}

        # a pass that meets it again (another process's copy, a file kept by a failed pass) adds nothing
        await target.append([old])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="thinkgate.metering"):
            if where == "dead":
                await st.meter.retry_dead_letters()
            elif where == "spool":
                await st.meter.replay()
            else:
                await st.meter.unacked.replay(st.meter._record_unacked, "unreplicated usage")
        assert (await st.meter.key_counters("k1"))["requests"] == 1
        assert len(st.meter.quarantine.read_all()) == 1 and not caplog.records

        text = Metrics(MetricsConfig(), []).render(False, 0, 0, quarantine_bytes=st.meter.quarantine.pending_bytes(),
                                                   quarantined=st.meter.quarantine.counts).decode()
        assert 'thinkgate_usage_quarantined_events_total{reason="past_dedup_window"} 1.0' in text
        assert f"thinkgate_usage_quarantine_bytes {float(st.meter.quarantine.pending_bytes())}" in text



async def test_a_write_ahead_record_past_the_dedup_window_is_not_written_back(
        redis_url: str, redis_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The write-ahead spool (``<stem>.wal.jsonl``: records written while Redis was down) is replayed through the
    update script, which skips a request already settled by its day's seen-set. A record kept past the dedup window
    was written back for a request settled long ago — open again, and the reconciler would bill it a second time as
    lost. Now it is set aside in the quarantine file; a fresh record of the same spool is written as before."""
    now = time.time()
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        wal = WriteAhead(st.handle, st.breaker, st.meter, st.metering_cfg, {"short": PRICES}, owner="dead:1:x")
        old = WalRecord(request_id=uuid.uuid4().hex, key_id="k1", owner="dead:1:x", ts=now - DEDUP_TTL_S,
                        updated_ms=int((now - DEDUP_TTL_S) * 1000), tags={}, tier="short", completion_tokens=7)
        settled = old.event(PRICES)
        settled.partial, settled.status, settled.error_code = False, 200, None
        await _counted_then_forgotten(st, settled)
        fresh = WalRecord(request_id=uuid.uuid4().hex, key_id="k2", owner="dead:1:x", ts=now - 60,
                          updated_ms=int((now - 60) * 1000), tags={}, tier="short")
        await wal.spool.append([old, fresh])
        with caplog.at_level(logging.WARNING, logger="thinkgate.metering"):
            await wal.replay()
        assert wal.spool.pending_bytes() == 0
        r, k = st.handle.client, st.meter.keys
        assert not await r.hexists(k.write_ahead, old.request_id)  # was written back: open again
        assert await r.hexists(k.write_ahead, fresh.request_id)
        [kept] = st.meter.quarantine.read_all()
        assert kept["reason"] == "past_dedup_window" and kept["event"]["request_id"] == old.request_id
        assert kept["source"] == str(wal.spool.path)
        warned = [x for x in caplog.records if "dedup_ttl_s" in x.getMessage()]
        assert len(warned) == 1 and old.request_id in warned[0].getMessage()


async def test_every_write_ahead_record_past_the_window_is_kept_not_only_the_first(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A write-ahead record has no ``event_id``: the quarantine's memory of what it wrote keyed them all alike, so of
    the old records of one replay only one was written — and the write-ahead spool was then truncated, the others
    gone (a lost call never billed). Each record is its own line now (request id and last write), and a pass that
    meets them again still writes none twice."""
    now = time.time()
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        wal = WriteAhead(st.handle, st.breaker, st.meter, st.metering_cfg, {"short": PRICES}, owner="dead:1:x")
        olds = [WalRecord(request_id=uuid.uuid4().hex, key_id="k1", owner="dead:1:x", ts=now - DEDUP_TTL_S - i,
                          updated_ms=int((now - DEDUP_TTL_S) * 1000) + i, tags={}, tier="short", completion_tokens=i)
                for i in range(3)]
        # a later write of the first request: its own line too
        later = replace(olds[0], updated_ms=olds[0].updated_ms + 1000, completion_tokens=9)
        await wal.spool.append([*olds, later])
        await wal.replay()
        assert wal.spool.pending_bytes() == 0
        kept = st.meter.quarantine.read_all()
        assert sorted((k["event"]["request_id"], k["event"]["completion_tokens"]) for k in kept) == sorted(
            [(r.request_id, r.completion_tokens) for r in olds] + [(later.request_id, 9)])
        await wal.spool.append([*olds, later])  # met again (a pass that failed after setting them aside)
        await wal.replay()
        assert len(st.meter.quarantine.read_all()) == 4
