"""``thinkgate usage quarantine``: the usage quarantine file against the ledger, and ``--settle``, on a real Redis and
a real Redis Cluster, the command run as a user runs it (a process, a config file).

The file is made by the gateway's own code, as in production: usage events stamped past the dedup window are replayed
from the usage spool, write-ahead records of that age from the write-ahead spool, a line no event can be read from
sits in the usage spool (a hand edit), a dead letter has a ``ts`` that is no number — and each replay sets them aside.
"Counted long ago" is an event counted, then its day's seen-set deleted, as its TTL would have.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from gateway.config import Prices
from gateway.ledger.event import UsageEvent
from gateway.state import quarantine as q
from gateway.state.metering import quarantine_path
from gateway.state.spool import Quarantine, quarantined
from gateway.state.write_ahead import WalRecord, WriteAhead
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.redis_stack import Stack, stack

REPO = Path(__file__).resolve().parents[2]
PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))
DEDUP_TTL_S = 2 * 86400  # a short window (the default is 40 days): the same arithmetic


def _event(key: str, ts: float, prompt: int = 100) -> UsageEvent:
    ev = UsageEvent(key_id=key, requested_model="auto", tier="short", upstream_model="m", route_reason="predicted",
                    prompt_tokens=prompt, completion_tokens=50, ts=ts, tags={"team": "q"})
    ev.price(PRICES)
    return ev


def _wal(key: str, ts: float, **kw: Any) -> WalRecord:
    return WalRecord(request_id=uuid.uuid4().hex, key_id=key, owner="dead:1:x", ts=ts, updated_ms=int(ts * 1000) + 500,
                     tags={}, tier="short", upstream_model="m", **kw)


async def _forgotten(st: Stack, ev: UsageEvent) -> None:
    """``ev`` counted, then its day's seen-set gone (its TTL, ``dedup_ttl_s`` after the day's last event)."""
    assert (await st.meter.record(ev)).counted
    await st.handle.client.delete(st.meter.keys.seen(ev.day))


@dataclass
class Made:
    counted: UsageEvent  # counted long ago
    absent: UsageEvent  # never counted
    lost: WalRecord  # a call never settled (its record never reached Redis)
    done: WalRecord  # a call whose own event was counted long ago


async def _make(st: Stack) -> Made:
    """The quarantine file through the gateway's replays (module doc): 6 lines."""
    old = time.time() - DEDUP_TTL_S - 3600
    m = Made(_event("kc", old), _event("ka", old + 1, prompt=1234),
             _wal("kw", old + 2, prompt_tokens=1000, completion_tokens=200),
             _wal("kd", old + 3, completion_tokens=9))
    await _forgotten(st, m.counted)
    done_event = m.done.event(PRICES)
    done_event.status, done_event.error_code, done_event.partial = 200, None, False
    await _forgotten(st, done_event)
    await st.meter.spool.append([m.counted, m.absent])
    with st.meter.spool.path.open("ab") as f:  # a hand edit: a line no event can be read from
        f.write(b'{"key_id": "kx", "cost_micro_usd": \n')
    await st.meter.replay()
    bad = _event("km", time.time())
    bad.ts = "yesterday"  # type: ignore[assignment]  # no day to count it on: malformed
    await st.meter.dead.append([bad])
    await st.meter.retry_dead_letters()
    wal = WriteAhead(st.handle, st.breaker, st.meter, st.metering_cfg, {"short": PRICES}, owner="dead:1:x")
    await wal.spool.append([m.lost, m.done])
    await wal.replay()
    reasons = sorted(r["reason"] for r in st.meter.quarantine.read_all())
    assert reasons == ["malformed", *["past_dedup_window"] * 4, "unreadable"]
    return m


def _config(tmp_path: Path, st: Stack) -> Path:
    cfg = {
        "engine": {"enabled": False},
        "redis": {"url": st.redis_cfg.url, "key_prefix": st.redis_cfg.key_prefix, "start_if_missing": False},
        "tiers": [{"name": "short", "base_url": "http://127.0.0.1:9/v1", "model": "m",
                   "prices": {k: str(v) for k, v in PRICES.model_dump().items()}},
                  {"name": "long", "base_url": "http://127.0.0.1:9/v1", "model": "m"}],
        "routing": {"router_path": None, "effort_tiers": {"low": "short", "high": "long"}},
        "metering": {"spool_path": str(st.metering_cfg.spool_path), "dedup_ttl_s": DEDUP_TTL_S},
    }
    path = tmp_path / "thinkgate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cli(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # REDIS_URL (an alias of redis.url) would win over the config's Redis: the Cluster test's is not the session's
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "THINKGATE_CONFIG": str(cfg)}
    return subprocess.run([sys.executable, "-m", "gateway", "usage", "quarantine", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)


def _json(cfg: Path, *args: str) -> dict[str, Any]:
    r = _cli(cfg, "--json", *args)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


async def _stream_ids(st: Stack) -> list[str]:
    return [UsageEvent.from_json(f[b"e"]).event_id for _, f in await st.handle.client.xrange(st.meter.keys.events)]


async def _cube_sum(st: Stack, key: str, day: str, name: str) -> int:
    raw = await st.handle.client.hgetall(st.meter.keys.agg_cube(key, day))
    return sum(int(v) for f, v in raw.items() if f.decode().split(" ", 1)[0] == name)


async def _global_day_cost(st: Stack, day: str) -> int:
    return int(await st.handle.client.hget(st.meter.keys.level_day("global", "global", day), "cost_micro_usd") or 0)


def _statuses(out: dict[str, Any]) -> dict[str, str]:
    """event id (request id for a write-ahead record; the reason for an unusable line) → status."""
    return {e["reason"] if e["status"] == "unusable" else e["event_id"] or e["request_id"]: e["status"]
            for e in out["entries"]}


async def _settle_and_check(st: Stack, tmp_path: Path) -> None:
    """The whole story on ``st``'s Redis (single or Cluster): listed, settled once, settled again for nothing."""
    m = await _make(st)
    cfg = _config(tmp_path, st)
    day = m.absent.day
    before_global = await _global_day_cost(st, day)

    out = _json(cfg)
    assert _statuses(out) == {m.counted.event_id: "counted", m.absent.event_id: "absent", "unreadable": "unusable",
                              "malformed": "unusable", m.lost.request_id: "absent", m.done.request_id: "counted"}
    lost_cost = m.lost.event(PRICES).cost_micro_usd
    assert lost_cost == 1000 * 0.5 + 200 * 2  # 900 micro-USD, exact
    assert out["summary"]["absent_cost_micro_usd"] == m.absent.cost_micro_usd + lost_cost
    malformed = next(e for e in out["entries"] if e["reason"] == "malformed")
    assert "write cannot be built" in malformed["detail"] and malformed["key_id"] == "km"
    assert out["settled"] is None and len(st.meter.quarantine.read_all()) == 6  # listing changes nothing

    r = _cli(cfg, "--settle", "--yes")
    assert r.returncode == 0, r.stderr
    assert "settled: 2 events counted" in r.stderr and f"counted event {m.absent.event_id}" in r.stderr
    # counted exactly once: key counters, the stream, the day's cube and the budget level all say one event more
    ka = await st.meter.key_counters("ka")
    assert (ka["requests"], ka["cost_micro_usd"]) == (1, m.absent.cost_micro_usd)
    assert (await st.meter.key_counters("ka", day=day))["cost_micro_usd"] == m.absent.cost_micro_usd
    assert await _cube_sum(st, "ka", day, "cost_micro_usd") == m.absent.cost_micro_usd
    kw = await st.meter.key_counters("kw")
    assert (kw["requests"], kw["errors"], kw["partial"], kw["cost_micro_usd"]) == (1, 1, 1, lost_cost)
    assert await _global_day_cost(st, day) == before_global + m.absent.cost_micro_usd + lost_cost
    ids = await _stream_ids(st)
    assert ids.count(m.absent.event_id) == 1 and ids.count(m.lost.request_id) == 1
    assert ids.count(m.counted.event_id) == 1 and ids.count(m.done.request_id) == 1  # not again
    assert (await st.meter.key_counters("kc"))["requests"] == 1 and (await st.meter.key_counters("kd"))["requests"] == 1
    [lost_row] = [e async for e in st.meter.events(m.lost.ts - 1, m.lost.ts + 1) if e.event_id == m.lost.request_id]
    assert lost_row.error_code == "gateway_lost" and lost_row.partial and lost_row.status == 500
    # the file keeps the unusable lines only; the journal says what became of the others
    assert sorted(r["reason"] for r in st.meter.quarantine.read_all()) == ["malformed", "unreadable"]
    journal = [json.loads(x) for x in q.settled_path(st.meter.quarantine.path).read_text().splitlines()]
    assert sorted(j["outcome"] for j in journal) == ["already counted", "already counted", "counted", "counted"]
    assert all(j["by"] and j["at"] > 0 for j in journal)

    again = _json(cfg, "--settle", "--yes")
    assert again["settled"]["counted"] == 0 and again["settled"]["lines_removed"] == 0
    assert {e["status"] for e in again["entries"]} == {"unusable"}
    assert (await st.meter.key_counters("ka"))["requests"] == 1 and (await st.meter.key_counters("kw"))["requests"] == 1
    assert await _global_day_cost(st, day) == before_global + m.absent.cost_micro_usd + lost_cost


async def test_settle_counts_each_absent_event_once_and_a_second_settle_nothing(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        await _settle_and_check(st, tmp_path)


async def test_on_a_cluster_settle_counts_each_absent_event_once(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    prefix = f"tgq{uuid.uuid4().hex[:6]}:"
    async with stack(redis_cluster.url, prefix, tmp_path / "spool.jsonl", socket_timeout_s=2.0,
                     dedup_ttl_s=DEDUP_TTL_S) as st:
        assert st.handle.kind == "cluster"
        await _settle_and_check(st, tmp_path)


async def test_the_table_and_its_exit_code(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        m = await _make(st)
        cfg = _config(tmp_path, st)
        r = _cli(cfg)
        assert r.returncode == 0, r.stderr
        assert "6 lines: 2 counted, 2 absent" in r.stderr and "2 unusable" in r.stderr
        row = next(x for x in r.stdout.splitlines() if m.absent.event_id in x)
        assert "absent" in row and str(m.absent.cost_micro_usd) in row and "past_dedup_window" in row
        # --settle counts money: nobody at a terminal to confirm, no --yes → refused, nothing done
        r = _cli(cfg, "--settle")
        assert r.returncode == 2 and "--yes" in r.stderr
        assert (await st.meter.key_counters("ka"))["requests"] == 0
        r = _cli(cfg, "--file", str(tmp_path / "none.jsonl"))  # no file: nothing set aside, and it says so
        assert r.returncode == 0 and "none.jsonl: no such file" in r.stderr and "0 lines" not in r.stderr


def _on_terminal(cfg: Path, answer: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The command with a terminal as its stdin (a pty), ``answer`` typed there."""
    master, slave = pty.openpty()
    try:
        os.write(master, answer.encode() + b"\n")
        env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "THINKGATE_CONFIG": str(cfg)}
        return subprocess.run([sys.executable, "-m", "gateway", "usage", "quarantine", *args], cwd=REPO, stdin=slave,
                              capture_output=True, text=True, timeout=120, env=env)
    finally:
        os.close(slave)
        os.close(master)


async def test_settle_asks_first_on_a_terminal(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        m = await _make(st)
        cfg = _config(tmp_path, st)
        r = _on_terminal(cfg, "n", "--settle")
        assert r.returncode == 0, r.stderr
        assert f"Count 2 absent events ({m.absent.cost_micro_usd + 900} micro-USD)" in r.stderr
        assert "nothing settled" in r.stderr and len(st.meter.quarantine.read_all()) == 6
        assert (await st.meter.key_counters("ka"))["requests"] == 0
        r = _on_terminal(cfg, "y", "--settle")
        assert r.returncode == 0 and "settled: 2 events counted" in r.stderr, r.stderr
        assert (await st.meter.key_counters("ka"))["requests"] == 1 and len(st.meter.quarantine.read_all()) == 2


async def test_a_line_a_gateway_appends_during_a_settle_is_kept(redis_url: str, redis_prefix: str,
                                                                tmp_path: Path) -> None:
    """Between reading the file and rewriting it, a gateway sets another event aside: the rewrite keeps it (it reads
    the file again under its lock) and removes only what it settled."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        m = await _make(st)
        file = Quarantine(st.meter.quarantine.path)
        entries = q.read_entries(file, st.meter, {"short": PRICES})
        await q.classify(st.meter, entries)
        assert (await q.settle(st.meter, entries)).counted == 2
        late = _event("kl", time.time() - DEDUP_TTL_S - 60)
        await st.meter.spool.append([late])
        await st.meter.replay()  # the gateway's own pass sets it aside now
        removed, note = await q.rewrite(file, entries, st.meter)
        assert (removed, note) == (4, None)
        kept = st.meter.quarantine.read_all()
        assert sorted(r["reason"] for r in kept) == ["malformed", "past_dedup_window", "unreadable"]
        assert [r["event"]["event_id"] for r in kept if r["reason"] == "past_dedup_window"] == [late.event_id]
        assert m.absent.event_id not in {r["event"].get("event_id") for r in kept}


async def test_appends_racing_a_settle_process_are_all_kept(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """The same with real processes: a thread appends through the gateway's own writer (``Quarantine.append_sync``:
    flock, O_APPEND, fsync) for as long as the command settles 40 absent events; every appended line is there after.
    Bounded: at most 3000 appends, 60 s."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        old = time.time() - DEDUP_TTL_S - 3600
        await st.meter.spool.append([_event(f"r{i}", old + i) for i in range(40)])
        await st.meter.replay()
        path = st.meter.quarantine.path
        cfg = _config(tmp_path, st)
        stop = threading.Event()
        appended: list[str] = []

        def append() -> None:
            writer = Quarantine(path)  # another process's view: its own memory of what it wrote
            deadline = time.monotonic() + 60
            while not stop.is_set() and len(appended) < 3000 and time.monotonic() < deadline:
                text = f"appended {len(appended)}"
                writer.append_sync([quarantined("unreadable", "racing", path, {"line": text})])
                appended.append(text)

        t = threading.Thread(target=append)
        t.start()
        try:
            r = _cli(cfg, "--settle", "--yes")
        finally:
            stop.set()
            t.join(timeout=30)
        assert r.returncode == 0, r.stderr
        assert "40 events counted" in r.stderr and len(appended) > 10
        lines = {rec["event"].get("line") for rec in Quarantine(path).read_all()}
        assert [a for a in appended if a not in lines] == []
        assert all(rec["reason"] == "unreadable" for rec in Quarantine(path).read_all())  # the settled ones: gone


async def test_an_event_of_a_day_the_stream_no_longer_holds_whole_is_not_settled(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """Absent from a trimmed stream proves nothing: the cubes counted the day's events, the stream lost them (an
    ``XTRIM``, ``metering.stream_maxlen``). Such an event is ``unverifiable`` and settling keeps it — counting it
    could count it twice."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        ev = _event("kt", time.time() - DEDUP_TTL_S - 3600)
        await _forgotten(st, ev)
        await st.handle.client.xtrim(st.meter.keys.events, maxlen=0)
        await st.meter.spool.append([ev])
        await st.meter.replay()
        file = Quarantine(quarantine_path(st.meter.spool.path))
        entries = q.read_entries(file, st.meter, {"short": PRICES})
        await q.classify(st.meter, entries)
        assert [e.status for e in entries] == ["unverifiable"] and "trimmed" in entries[0].detail
        assert (await q.settle(st.meter, entries)).counted == 0
        assert await q.rewrite(file, entries, st.meter) == (0, None)
        assert (await st.meter.key_counters("kt"))["requests"] == 1 and len(file.read_all()) == 1


async def test_a_request_whose_own_event_is_set_aside_too_is_billed_at_its_real_usage(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A request's write-ahead record and its own usage event both set aside (a process that spooled both while
    Redis was away, for longer than the window): the event is counted — its real tokens — and the record only
    removed, not billed a second time, nor first as a lost call at its last progress write. A record whose tier has
    no prices in the configuration given is kept (not billed at 0)."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        old = time.time() - DEDUP_TTL_S - 3600
        rec = _wal("kr", old, completion_tokens=3)  # its last progress write: 3 tokens
        real = _event("kr", old, prompt=700)
        real.event_id = real.request_id = rec.request_id
        unpriced = _wal("ku", old, completion_tokens=5)
        unpriced.tier = "gone"
        wal = WriteAhead(st.handle, st.breaker, st.meter, st.metering_cfg, {"short": PRICES}, owner="dead:1:x")
        await wal.spool.append([rec, unpriced])  # the record first: the file's order is no billing order
        await wal.replay()
        await st.meter.spool.append([real])
        await st.meter.replay()
        file = Quarantine(st.meter.quarantine.path)
        entries = q.read_entries(file, st.meter, {"short": PRICES})
        await q.classify(st.meter, entries)
        assert [e.status for e in entries] == ["absent", "absent", "absent"]
        got = await q.settle(st.meter, entries)
        assert (got.counted, got.cost_micro_usd) == (1, real.cost_micro_usd)
        assert [e.outcome for e in entries][:2] == ["already counted", "kept: tier 'gone' has no prices in this "
                                                    "configuration (give the gateway's --config)"]
        assert entries[2].outcome == "counted"
        kr = await st.meter.key_counters("kr")
        assert (kr["requests"], kr["prompt_tokens"], kr["cost_micro_usd"]) == (1, 700, real.cost_micro_usd)
        assert await q.rewrite(file, entries, st.meter) == (2, None)
        [left] = file.read_all()
        assert left["event"]["request_id"] == unpriced.request_id
        assert (await st.meter.key_counters("ku"))["requests"] == 0


async def test_several_records_of_one_lost_request_are_billed_once_at_the_latest(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A begin and two progress writes of one streamed call, all spooled past the window: one ``gateway_lost`` event,
    at the last write's tokens; every line of it removed."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl", dedup_ttl_s=DEDUP_TTL_S) as st:
        begin = _wal("ks", time.time() - DEDUP_TTL_S - 3600, prompt_tokens=300, stream=True)
        states = [begin, replace(begin, updated_ms=begin.updated_ms + 2000, completion_tokens=40),
                  replace(begin, updated_ms=begin.updated_ms + 1000, completion_tokens=20)]
        wal = WriteAhead(st.handle, st.breaker, st.meter, st.metering_cfg, {"short": PRICES}, owner="dead:1:x")
        await wal.spool.append(states)
        await wal.replay()
        file = Quarantine(st.meter.quarantine.path)
        entries = q.read_entries(file, st.meter, {"short": PRICES})
        await q.classify(st.meter, entries)
        got = await q.settle(st.meter, entries)
        cost = 300 * 0.5 + 40 * 2  # 230 micro-USD: the last write's tokens
        assert (got.counted, got.cost_micro_usd) == (1, cost)
        assert sorted(e.outcome or "" for e in entries) == ["already counted", "already counted", "counted"]
        ks = await st.meter.key_counters("ks")
        assert (ks["requests"], ks["completion_tokens"], ks["cost_micro_usd"]) == (1, 40, cost)
        assert await q.rewrite(file, entries, st.meter) == (3, None) and file.read_all() == []
