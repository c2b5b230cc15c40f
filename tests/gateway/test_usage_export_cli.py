"""``thinkgate usage export --group-by`` without ``--since`` on a real Redis: the current UTC month, as
``GET /v1/usage`` answers the same query (it read the whole stream: all history, scanned event by event)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
from pathlib import Path

import yaml
from typer.testing import CliRunner

from gateway.cli.main import app
from gateway.config import MeteringConfig, RedisConfig
from gateway.ledger.event import UsageEvent
from gateway.ledger.export import month_start
from gateway.state.breaker import Breaker
from gateway.state.metering import Meter
from gateway.state.redis import connect
from gateway.state.spool import Spool


def _event(key: str, ts: float, cost: int, over_bound: bool = False) -> UsageEvent:
    return UsageEvent(key_id=key, requested_model="auto", ts=ts, tier="short", upstream_model="m",
                      prompt_tokens=10, completion_tokens=5, cost_micro_usd=cost, over_bound=over_bound)


def _record(redis_url: str, prefix: str, tmp_path: Path, events: list[UsageEvent]) -> None:
    async def go() -> None:
        handle = connect(RedisConfig(url=redis_url, key_prefix=prefix))
        meter = Meter(handle, Breaker(1.0), Spool(tmp_path / "spool.jsonl"),
                      MeteringConfig(spool_path=tmp_path / "spool.jsonl"))
        try:
            await meter.record_many(events)
        finally:
            await meter.redis.aclose()

    asyncio.run(go())


def _export(cfg: Path, out: Path, *extra: str) -> tuple[dict[str, int], str]:
    """``{key: cost_micro_usd}`` of ``usage export --group-by key`` and what it said on stderr."""
    res = CliRunner().invoke(app, ["usage", "export", "--format", "jsonl", "--group-by", "key", "--output",
                                   str(out), "--config", str(cfg), *extra])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {r["key"]: r["cost_micro_usd"] for r in rows}, res.output


def test_grouped_export_defaults_to_this_month(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    now = time.time()
    last_month = month_start(now) - 86400 - 3600  # the last day of last month
    _record(redis_url, redis_prefix, tmp_path, [_event("old", last_month, 100), _event("new", now, 7)])
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(yaml.safe_dump({"redis": {"url": redis_url, "key_prefix": redis_prefix,
                                             "start_if_missing": False},
                                   "metering": {"spool_path": str(tmp_path / "spool.jsonl")}}))
    rows, said = _export(cfg, tmp_path / "month.jsonl")
    assert rows == {"new": 7}  # the month so far: last month's event is not in it
    assert time.strftime("since %Y-%m-%d", time.gmtime(month_start(now))) in said and "--since 0" in said
    # all history is asked for by name (from the oldest retained day, through the cubes)
    assert _export(cfg, tmp_path / "all.jsonl", "--since", "0")[0] == {"old": 100, "new": 7}
    # a raw export without --since is still the whole stream
    res = CliRunner().invoke(app, ["usage", "export", "--format", "jsonl", "--output", str(tmp_path / "raw.jsonl"),
                                   "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert sorted(json.loads(line)["key_id"] for line in (tmp_path / "raw.jsonl").read_text().splitlines()) == [
        "new", "old"]
    # --until alone: everything before it (a billing run on the 1st asks for last month and before — with the
    # month default it read an empty period and exited 0)
    assert _export(cfg, tmp_path / "until.jsonl", "--until", str(month_start(now)))[0] == {"old": 100}
    # an empty period is an error, not an empty file
    res = CliRunner().invoke(app, ["usage", "export", "--group-by", "key", "--since", str(now), "--until",
                                   str(now - 60), "--config", str(cfg)])
    assert res.exit_code == 2 and "since must be before until" in res.output
    # the report too (it printed an empty report: spend 0)
    res = CliRunner().invoke(app, ["usage", "report", "--since", str(now), "--until", str(now - 60), "--config",
                                   str(cfg)])
    assert res.exit_code == 2 and "since must be before until" in res.output, res.output


#: the grouped columns scripts read by position before over_bound_events: they stay, in this order
GROUPED_BY_KEY = ["key", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
                  "cost_micro_usd", "saved_micro_usd", "cache_hits", "errors", "partial", "refused", "cost_usd",
                  "saved_usd"]


def test_grouped_export_counts_over_bound_events(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """``over_bound`` (tokens held to the call's admitted bound) was in the raw export only: a grouped export — the
    per-day cubes — could not say how many of a key's calls were capped. Now a last column, ``over_bound_events``,
    from the cubes (nothing scanned), the columns before it unchanged; the key's counters gain no field."""
    now = time.time()
    today = time.strftime("%Y-%m-%d", time.gmtime(now))
    _record(redis_url, redis_prefix, tmp_path, [_event("a", now, 5, over_bound=True), _event("a", now, 6),
                                                _event("a", now, 7, over_bound=True), _event("b", now, 8)])
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(yaml.safe_dump({"redis": {"url": redis_url, "key_prefix": redis_prefix,
                                             "start_if_missing": False},
                                   "metering": {"spool_path": str(tmp_path / "spool.jsonl")}}))
    out = tmp_path / "grouped.csv"
    res = CliRunner().invoke(app, ["usage", "export", "--format", "csv", "--group-by", "key", "--since", today,
                                   "--output", str(out), "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "1 days from the usage cubes, 0 events scanned" in res.output
    header, *rows = list(csv.reader(io.StringIO(out.read_text())))
    assert header == [*GROUPED_BY_KEY, "over_bound_events"]
    by_key = {r[0]: dict(zip(header, r, strict=True)) for r in rows}
    assert {k: (r["requests"], r["over_bound_events"]) for k, r in by_key.items()} == {"a": ("3", "2"),
                                                                                       "b": ("1", "0")}
    import redis

    client = redis.Redis.from_url(redis_url)
    try:  # the per-key counters (GET /v1/usage's today/month/all-time) are as they were
        assert b"over_bound_events" not in client.hgetall(f"{redis_prefix}usage:key:a")
    finally:
        client.close()


def test_eight_digit_times_are_dates(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """``--since 20261207`` (ISO-8601's basic date, what ``date +%Y%m%d`` prints) is that UTC day: it was read as
    epoch seconds, 1970-08-23 — a grouped export of all history, a raw one of a day in 1970 (empty), exit 0 both."""
    now = time.time()
    today = time.gmtime(now)
    _record(redis_url, redis_prefix, tmp_path, [_event("old", now - 3 * 86400, 100), _event("new", now, 7)])
    cfg = tmp_path / "cli.yaml"
    cfg.write_text(yaml.safe_dump({"redis": {"url": redis_url, "key_prefix": redis_prefix,
                                             "start_if_missing": False},
                                   "metering": {"spool_path": str(tmp_path / "spool.jsonl")}}))
    since, until = time.strftime("%Y%m%d", today), time.strftime("%Y%m%d", time.gmtime(now + 86400))
    assert _export(cfg, tmp_path / "day.jsonl", "--since", since)[0] == {"new": 7}
    out = tmp_path / "raw.jsonl"
    res = CliRunner().invoke(app, ["usage", "export", "--format", "jsonl", "--since", since, "--until", until,
                                   "--output", str(out), "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["key_id"] for line in out.read_text().splitlines()] == ["new"]
    # eight digits that are no date are an error, not a time in 1970
    res = CliRunner().invoke(app, ["usage", "export", "--since", "20261301", "--config", str(cfg)])
    assert res.exit_code == 2 and "YYYYMMDD" in res.output
