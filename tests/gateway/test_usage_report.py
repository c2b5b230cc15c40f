"""``thinkgate usage report``: events written through the real metering path (Lua script into a real Redis),
read back through the ledger reader, and every figure checked by hand (micro-USD)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from gateway.config import Prices
from gateway.ledger import report as rp
from gateway.ledger.event import UsageEvent
from tests.fixtures.redis_stack import stack

REPO = Path(__file__).resolve().parents[2]
SHORT = Prices(input_usd_per_mtok=Decimal("0.10"), cached_input_usd_per_mtok=Decimal("0.05"),
               output_usd_per_mtok=Decimal("0.40"))
LONG = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
              output_usd_per_mtok=Decimal("2.00"))
T0 = 1_700_000_000.0  # 2023-11-14 22:13 UTC, a fixed past period (stream ids are write times, after ts)


def _ev(tier: str, difficulty: float | None, prompt: int, completion: int, *, key: str = "alice",
        cached: bool = False, status: int = 200, error_code: str | None = None, route: str = "predicted",
        dt: float = 0.0) -> UsageEvent:
    ev = UsageEvent(key_id=key, requested_model="auto", tier=tier, upstream_model="m", route_reason=route,
                    difficulty=difficulty, prompt_tokens=prompt, completion_tokens=completion,
                    reasoning_tokens=completion // 2, cached=cached, status=status, error_code=error_code,
                    ts=T0 + dt)
    ev.price(LONG if tier == "long" else SHORT)
    return ev


def events() -> list[UsageEvent]:
    """The hand-checked ledger (costs at LONG 0.50/0.25/2.00 and SHORT 0.10/0.05/0.40 USD per 1M)."""
    return [
        _ev("long", 0.85, 100, 300),            # 50 + 600 = 650
        _ev("long", 0.82, 60, 100),             # 30 + 200 = 230
        _ev("short", 0.05, 40, 20),             # 4 + 8 = 12
        _ev("short", 0.07, 40, 20, cached=True, route="cache"),   # cost 0, saved 12
        _ev("long", 0.55, 80, 140),             # 40 + 280 = 320
        _ev("short", 0.52, 50, 30),             # 5 + 12 = 17
        _ev("short", 0.31, 30, 64, error_code="escalated_empty_answer"),  # 3 + 25.6 -> 29 (first attempt)
        _ev("long", 0.31, 30, 90, route="escalated"),  # 15 + 180 = 195 (the retry: the request)
        _ev("short", 0.20, 0, 0, status=502, error_code="upstream_unavailable"),  # refused: no request
        _ev("short", None, 20, 10, route="forced"),  # 2 + 4 = 6, unscored
        # another key, and one event of alice's outside the period: both must stay out of the report
        _ev("long", 0.05, 10, 1000, key="bob"),
        _ev("long", 0.05, 10, 1000, dt=-86400),
    ]


def check_report(r: rp.SavingsReport) -> None:
    assert r.events == 10 and r.requests == 8
    by_tier = {t.tier: t for t in r.tiers}
    assert by_tier["long"].cost_micro_usd == 650 + 230 + 320 + 195 == 1395
    assert by_tier["short"].cost_micro_usd == 12 + 0 + 17 + 29 + 0 + 6 == 64
    assert by_tier["short"].saved_micro_usd == 12 and by_tier["short"].cache_hits == 1
    assert by_tier["short"].completion_tokens == 20 + 30 + 64 + 10  # upstream tokens: the hit is not counted
    assert r.spend_micro_usd == 1459 and r.cache_saved_micro_usd == 12
    # long means: bucket 0.8-0.9 (300+100)/2 = 200; 0.5-0.6: 140; 0.3-0.4: 90 (the escalated retry);
    # overall (300+100+140+90)/4 = 157.5 for the buckets without long-tier events
    assert r.long_mean_completion_tokens == Decimal("157.5")
    b = {x.bucket: x for x in r.buckets}
    assert [x.bucket for x in r.buckets] == ["0.0-0.1", "0.2-0.3", "0.3-0.4", "0.5-0.6", "0.8-0.9", "unscored"]
    # 0.0-0.1: 2 requests (the hit included); 2*40*0.50 + 2*157.5*2.00 = 40 + 630
    assert (b["0.0-0.1"].estimate, b["0.0-0.1"].always_long_micro_usd, b["0.0-0.1"].cost_micro_usd) == (
        "fallback", 670, 12)
    assert b["0.2-0.3"].requests == 0 and b["0.2-0.3"].always_long_micro_usd is None
    # 0.3-0.4: one request (the escalation pair); its cost includes the first attempt: 29 + 195
    assert (b["0.3-0.4"].requests, b["0.3-0.4"].cost_micro_usd, b["0.3-0.4"].always_long_micro_usd) == (1, 224, 195)
    assert b["0.3-0.4"].estimate == "measured" and b["0.3-0.4"].long_mean_completion_tokens == 90
    # 0.5-0.6: (80+50)*0.50 + 2*140*2.00 = 65 + 560
    assert (b["0.5-0.6"].always_long_micro_usd, b["0.5-0.6"].cost_micro_usd) == (625, 337)
    # 0.8-0.9: 160*0.50 + 2*200*2.00 = 80 + 800 (the long requests cost what they cost)
    assert (b["0.8-0.9"].always_long_micro_usd, b["0.8-0.9"].cost_micro_usd) == (880, 880)
    # unscored: 20*0.50 + 157.5*2.00 = 10 + 315
    assert (b["unscored"].estimate, b["unscored"].always_long_micro_usd) == ("fallback", 325)
    assert r.always_long_micro_usd == 670 + 195 + 625 + 880 + 325 == 2695
    assert r.request_spend_micro_usd == 1459 and r.savings_micro_usd == 2695 - 1459 == 1236
    assert any("0.0-0.1" in n and "unscored" in n and "157.5" in n for n in r.notes)


def test_headline_sets_the_savings_against_served_spend() -> None:
    """The headline's spend is the served requests', the one the savings are computed on: it printed the total
    (shadow calls included) beside them — "spend 0.127461 USD … always-exd0 estimate 0.122936 USD; saved 0.056587
    USD (46.0%)", more spent than always-top yet 46% saved (a new user's report). The total, the shadow spend and
    the net follow on the second line, and the parts add up to the total."""
    from gateway.cli.usage_report import render
    from router.console import console

    base = [_ev("short", 0.1, 40, 20), _ev("short", 0.1, 40, 20)]  # 2 requests served cheap: 12 µ$ each
    shadows = [_ev("long", 0.1, 40, 100, route="shadow"), _ev("long", 0.1, 40, 100, route="shadow")]  # 220 each
    failed = [_ev("short", 0.1, 40, 0, status=502, error_code="upstream_stream_broken")]  # its prompt: 4 µ$
    r = rp.build(base + shadows + failed, "long", LONG)
    assert r.spend_micro_usd == 24 + 440 + 4 > r.always_long_micro_usd == 440 > r.savings_micro_usd == 416
    con = console(width=1000)
    with con.capture() as cap:
        con.print(render(r))
    lines = cap.get().splitlines()
    first = next((x for x in lines if "on served traffic" in x), "")
    assert first.startswith("served spend 0.000024 USD over 2 requests (5 events);"), lines
    assert "always-long estimate 0.000440 USD; saved 0.000416 USD (94.5%) on served traffic" in first
    assert "0.000468" not in first  # the total is not set against always-long
    assert ("shadow calls (learning) 0.000440 USD; net of them saved -0.000024 USD; total spend 0.000468 USD "
            "(served 0.000024 + shadow 0.000440 + other calls 0.000004)") in lines
    assert r.summary()["request_spend_usd"] == "0.000024"  # the served spend, as text too (a key added)


def test_bucket_labels() -> None:
    assert rp.bucket_of(0.0) == "0.0-0.1" and rp.bucket_of(0.0999) == "0.0-0.1" and rp.bucket_of(0.1) == "0.1-0.2"
    assert rp.bucket_of(1.0) == "0.9-1.0" and rp.bucket_of(None) == "unscored"
    assert rp.bucket_of(0.26, 4) == "0.25-0.50" and rp.bucket_of(0.5, 20) == "0.50-0.55"


async def test_report_from_the_ledger_by_hand(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        for ev in events():
            assert (await st.meter.record(ev)).counted
        read = [e async for e in st.meter.events(T0 - 10, T0 + 10) if e.key_id == "alice"]
    check_report(rp.build(read, "long", LONG))


def test_shadow_calls_are_paid_but_are_not_requests() -> None:
    """A shadow call (the gateway's own call to the next tier, to learn from) is paid but no client's request:
    counting it as one priced an extra always-long request per shadow, and a loop that saved nothing read 30% saved
    (a new-user helper's walk of docs/closed-loop.md). Nor is it the served traffic's spend: counted there, an
    operator's first day (every cheap answer shadowed) read −4.5% saved with nothing to say why. Savings are the
    served traffic's; the shadow spend is its own line, and the net says what learning costs on top. It does
    measure the long tier."""
    base = [_ev("short", 0.1, 40, 20), _ev("short", 0.1, 40, 20)]  # 2 requests sent cheap: 12 µ$ each
    shadows = [_ev("long", 0.1, 40, 100, route="shadow"), _ev("long", 0.1, 40, 100, route="shadow")]  # 220 each
    r = rp.build(base + shadows, "long", LONG)
    assert r.requests == 2 and r.spend_micro_usd == 2 * 12 + 2 * 220  # what was paid is still what was paid
    b = r.buckets[0]
    assert b.requests == 2 and b.cost_micro_usd == 2 * 12 and b.shadow_micro_usd == 2 * 220
    assert b.long_samples == 2 and b.estimate == "measured"  # …and they measured the long tier on it
    assert r.always_long_micro_usd == 2 * 220  # 2 requests at 40 prompt + 100 completion on long
    assert r.request_spend_micro_usd + r.shadow_spend_micro_usd == r.spend_micro_usd
    assert r.savings_micro_usd == 440 - 24 == 416 and r.shadow_spend_micro_usd == 440  # served; learning
    assert r.net_savings_micro_usd == 416 - 440 < 0  # the shadows cost more than routing saved: said so, apart
    s = r.summary()
    assert (s["savings_usd"], s["shadow_spend_usd"], s["net_savings_usd"]) == ("0.000416", "0.000440", "-0.000024")
    assert any("shadow calls" in n and "0.000440 USD" in n for n in r.notes)
    total = next(x for x in rp.rows(r) if x["section"] == "total")
    assert (total["cost_micro_usd"], total["shadow_micro_usd"]) == (464, 440)


def test_no_long_events_means_no_estimate() -> None:
    r = rp.build([_ev("short", 0.1, 10, 10)], "long", LONG)
    assert r.always_long_micro_usd is None and r.savings_micro_usd is None and r.buckets[0].estimate == "none"
    assert "no always-long estimate" in r.notes[0]


async def test_cli_report_csv_png_json(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        for ev in events():
            await st.meter.record(ev)
    cfg: dict[str, Any] = {
        "engine": {"enabled": False},
        "redis": {"url": redis_url, "key_prefix": redis_prefix, "start_if_missing": False},
        "routing": {"router_path": None},
        "tiers": [{"name": "none"}, {"name": "short", "prices": {k: str(v) for k, v in SHORT.model_dump().items()}},
                  {"name": "long", "prices": {k: str(v) for k, v in LONG.model_dump().items()}}],
    }
    config = tmp_path / "tg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out_csv, out_png, out_json = tmp_path / "r.csv", tmp_path / "r.png", tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "usage", "report", "--since", str(T0 - 10), "--until",
         "2023-11-15", "--key", "alice", "--csv", str(out_csv), "--png", str(out_png), "--json", str(out_json),
         "--config", str(config)],
        cwd=REPO, capture_output=True, timeout=120, env={**os.environ, "THINKGATE_CONFIG": "", "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr.decode()
    assert "always-long estimate 0.002695 USD" in r.stdout.decode()
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text())))
    total = next(x for x in rows if x["section"] == "total")
    assert (total["cost_micro_usd"], total["always_long_micro_usd"], total["saved_usd"]) == ("1459", "2695",
                                                                                           "0.000012")
    assert {x["name"]: x["estimate"] for x in rows if x["section"] == "bucket"}["unscored"] == "fallback"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(out_json.read_text())["summary"]
    assert summary["savings_micro_usd"] == 1236 and summary["savings_usd"] == "0.001236"
    assert summary["shadow_spend_micro_usd"] == 0 and summary["net_savings_micro_usd"] == 1236
    assert "shadow calls (learning) 0.000000 USD; net of them saved 0.001236 USD" in r.stdout.decode()
    # piped (no terminal on any standard stream, no $COLUMNS: rich assumed 80 columns, and $COLUMNS=60 is no
    # narrower): every amount whole on one line — never cut to "0.0001…", nor folded into "0.00078" and "2"
    expected = rp.build([e for e in events() if e.key_id == "alice" and e.ts >= T0 - 10], "long", LONG)
    amounts = [rp.usd_text(t.cost_micro_usd) for t in expected.tiers] + [
        rp.usd_text(b.always_long_micro_usd) for b in expected.buckets if b.always_long_micro_usd]
    assert len(amounts) > 4 and all(len(a) == 8 for a in amounts)  # "0.001395": the widest cells of the tables
    for columns in (None, "60"):
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"THINKGATE_CONFIG": ""}
        piped = subprocess.run(
            [sys.executable, "-m", "gateway", "usage", "report", "--since", str(T0 - 10), "--until", "2023-11-15",
             "--key", "alice", "--config", str(config)], stdin=subprocess.DEVNULL,
            cwd=REPO, capture_output=True, timeout=120, env=env if columns is None else env | {"COLUMNS": columns})
        assert piped.returncode == 0, piped.stderr.decode()
        out = piped.stdout.decode()
        assert "…" not in out, out
        assert all(a in out for a in amounts), (amounts, out)
    bad = subprocess.run([sys.executable, "-m", "gateway", "usage", "report", "--long-tier", "huge",
                          "--config", str(config)], cwd=REPO, capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"no tier 'huge'" in bad.stderr


def test_cli_report_defaults_to_the_top_tier(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """A configuration without a tier named ``long`` (docs/closed-loop.md's ladder: no_think → exd0): the report's
    counterfactual is the last tier, as the dashboard's — it refused with "no tier 'long'" (exit 2)."""
    cfg: dict[str, Any] = {
        "engine": {"enabled": False},
        "redis": {"url": redis_url, "key_prefix": redis_prefix, "start_if_missing": False},
        "routing": {"router_path": None, "routed_tiers": ["no_think", "exd0"], "default_tier": "exd0",
                    "effort_tiers": {"low": "no_think", "high": "exd0"}},
        "tiers": [{"name": "no_think"}, {"name": "exd0"}],
    }
    config = tmp_path / "tg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "gateway", "usage", "report", "--since", str(T0 - 10), "--until",
                        str(T0 + 10), "--config", str(config)],
                       cwd=REPO, capture_output=True, timeout=120, env={**os.environ, "THINKGATE_CONFIG": ""})
    assert r.returncode == 0, r.stderr.decode()
    assert "no complete uncached events on tier 'exd0'" in r.stdout.decode()
    assert "embedded defaults" not in r.stdout.decode()  # its tiers came from the file


async def test_cli_report_without_config_says_it_used_the_embedded_tiers(redis_url: str, redis_prefix: str,
                                                                         tmp_path: Path) -> None:
    """docs/closed-loop.md's gateway (tiers no_think, exd0) reported without its -c: the embedded tiers have a
    'long' that no event is on, and the report said only "no complete uncached events on tier 'long'"."""
    async with stack(redis_url, redis_prefix, tmp_path / "spool.jsonl") as st:
        for tier, prompt, completion in (("no_think", 40, 20), ("exd0", 60, 300)):
            await st.meter.record(_ev(tier, 0.5, prompt, completion))
    env = {**os.environ, "THINKGATE_CONFIG": "", "REDIS_URL": redis_url, "THINKGATE_REDIS__KEY_PREFIX": redis_prefix,
           "THINKGATE_STATE_DIR": str(tmp_path / "state")}
    env.pop("THINKGATE_REDIS__URL", None)
    args = [sys.executable, "-m", "gateway", "usage", "report", "--since", str(T0 - 10), "--until", str(T0 + 10)]
    r = subprocess.run(args, cwd=REPO, capture_output=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr.decode()
    out = " ".join(r.stdout.decode().split())
    assert "no complete uncached events on tier 'long'" in out and "saved n/a" in out
    assert ("the tiers are the embedded defaults (none, short, long): no --config FILE and no THINKGATE_CONFIG was "
            "given, and these events are on tiers exd0, no_think; pass the gateway's configuration with --config "
            "FILE (--long-tier only picks one of the configuration's tiers)") in out, out
    # and --long-tier cannot name a tier the configuration lacks (what the note says)
    r = subprocess.run([*args, "--long-tier", "exd0"], cwd=REPO, capture_output=True, timeout=120, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and b"no tier 'exd0'" in r.stderr
    # named: no such note (the tier has no event here either: the same "no always-long estimate" note, no hint)
    r = subprocess.run([*args, "--long-tier", "short"], cwd=REPO, capture_output=True, timeout=120, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "embedded defaults" not in r.stdout.decode(), r.stdout.decode()
