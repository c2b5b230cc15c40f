"""Dead letters that never count: retried with backoff, a traceback logged once, the malformed kept aside — against a
real Redis.

A dead letter whose write raised (here a hand-edited or version-skewed line whose ``ts`` is no number) was sent
again every ``metering.dead_letter_interval_s`` (60 s), for ever, a full traceback in the log each time; one Redis
still refuses (a key of the wrong type) was retried — and logged — every minute for as long as the key stayed
broken. Now an event whose write cannot be built is moved to the quarantine file at once (one ERROR line with its
traceback), the retries back off (doubling up to an hour) while nothing counts, and a line no event can be read from
is kept in the quarantine file instead of vanishing with the file's rewrite. An append after a line a crash tore
ends it first, so the appended event is not glued to it and lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.config import Prices
from gateway.ledger.event import UsageEvent
from gateway.state.metering import DEAD_LETTER_MAX_INTERVAL_S
from tests.fixtures.redis_stack import Stack, stack

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))


def _event(key: str, i: int = 0) -> UsageEvent:
    ev = UsageEvent(key_id=key, requested_model="auto", tier="short", upstream_model="m", route_reason="predicted",
                    prompt_tokens=100 + i, completion_tokens=50, ts=time.time())
    ev.price(PRICES)
    return ev


def _poison_line(ev: UsageEvent) -> bytes:
    bad = json.loads(ev.to_json())
    bad["ts"] = "not a number"  # no day to count it on: building its write raises, every time
    return json.dumps(bad).encode()


async def _run_loop(st: Stack, seconds: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(st.meter.run_dead_letters(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_poison_dead_letter_is_quarantined_once_with_one_traceback(
        redis_url: str, redis_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        good, poison = _event("k1", 1), _event("k1", 2)
        with open(st.meter.dead.path, "ab") as f:
            f.write(_poison_line(poison) + b"\n" + good.to_json() + b"\n")
        with caplog.at_level(logging.INFO, logger="thinkgate.metering"):
            assert await st.meter.retry_dead_letters() == (2, 0)  # it raised TypeError here, every pass
            assert await st.meter.retry_dead_letters() == (0, 0)
        assert (await st.meter.key_counters("k1"))["requests"] == 1 and st.meter.dead.pending_bytes() == 0
        [kept] = st.meter.quarantine.read_all()
        assert kept["reason"] == "malformed" and kept["event"]["event_id"] == poison.event_id
        assert kept["event"]["ts"] == "not a number" and "TypeError" in kept["detail"]
        tracebacks = [r for r in caplog.records if r.exc_info]
        assert len(tracebacks) == 1 and tracebacks[0].levelno == logging.ERROR
        assert poison.event_id in tracebacks[0].getMessage()
        assert st.meter.quarantine.counts == {"malformed": 1}


async def test_an_unreadable_dead_letter_line_is_kept_not_dropped(redis_url: str, redis_prefix: str,
                                                                  tmp_path: Path) -> None:
    """The retry rewrites the file with the events still refused (or truncates it): a line no event could be read
    from was in neither, so it was gone."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        good = _event("k1")
        with open(st.meter.dead.path, "ab") as f:
            f.write(b'{"key_id": "k9", "cost_micro_usd": 12\xff not json\n' + good.to_json() + b"\n")
        assert await st.meter.retry_dead_letters() == (1, 0)
        assert (await st.meter.key_counters("k1"))["requests"] == 1 and st.meter.dead.pending_bytes() == 0
        [kept] = st.meter.quarantine.read_all()
        assert kept["reason"] == "unreadable" and kept["event"]["line"].startswith('{"key_id": "k9"')
        assert "\\xff" in kept["event"]["line"]  # the bytes as they were (undecodable ones escaped)


async def test_an_append_after_a_torn_line_is_not_glued_to_it(redis_url: str, redis_prefix: str,
                                                              tmp_path: Path) -> None:
    """A crash mid-write leaves a line without its newline; the next append (an acknowledged, fsync'd event) was
    written right after it — one unreadable line, skipped by the replay and truncated with the file."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        torn = _event("k2").to_json()[:40]
        st.meter.spool.path.write_bytes(torn)
        good = _event("k1")
        await st.meter.spool.append([good])
        assert await st.meter.replay() == 1
        assert (await st.meter.key_counters("k1"))["requests"] == 1
        assert [q["reason"] for q in st.meter.quarantine.read_all()] == ["unreadable"]
        assert st.meter.quarantine.read_all()[0]["event"]["line"] == torn.decode()


async def test_retries_back_off_while_refused_and_resume_once_counted(
        redis_url: str, redis_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = 0.02
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dead_letter_interval_s=base) as st:
        k = st.meter.keys
        await st.handle.client.set(k.key_total("k1"), "not a hash")  # every event of k1 refused
        await st.meter.dead.append([_event("k1")])
        with caplog.at_level(logging.WARNING, logger="thinkgate.metering"):
            await _run_loop(st, 1.0)
        tries = [r for r in caplog.records if "still refused" in r.getMessage()]
        # 0.02, 0.04, … 0.64 s: at most 6 tries in a second (there were 50, each logged)
        assert 1 <= len(tries) <= 7, [r.getMessage() for r in tries]
        assert st.meter.dead_retry_s >= base * 2 ** len(tries) - 1e-9
        for _ in range(20):  # the wait stops doubling at its cap
            await st.meter.retry_dead_letters()
        assert st.meter.dead_retry_s == DEAD_LETTER_MAX_INTERVAL_S
        await st.handle.client.delete(k.key_total("k1"))
        assert await st.meter.retry_dead_letters() == (1, 0)
        assert st.meter.dead_retry_s == base  # counted: back to the configured interval
        assert (await st.meter.key_counters("k1"))["requests"] == 1


async def test_a_failing_pass_logs_its_traceback_once_and_backs_off(
        redis_url: str, redis_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A pass that raises (here the dead-letter file cannot be read: a directory in its place) was logged and retried
    every interval for ever."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dead_letter_interval_s=0.02) as st:
        st.meter.dead.path.mkdir()
        (st.meter.dead.path / "x").write_bytes(b"x" * 10)
        with caplog.at_level(logging.WARNING, logger="thinkgate.metering"):
            await _run_loop(st, 1.0)
        failed = [r for r in caplog.records if "dead-letter" in r.getMessage() and "failed" in r.getMessage()]
        assert 1 <= len(failed) <= 7, [r.getMessage() for r in failed]
        assert sum(1 for r in failed if r.exc_info) == 1 and failed[0].exc_info
