"""The dashboard in a real browser: headless Chromium (Debian's package) driven by Playwright against a real
gateway (uvicorn on loopback, the upstream simulator, real Redis) with a seeded ledger.

Checks: a non-admin key is refused at the login form; the admin key logs in and the page renders; its figures
(read from the DOM) equal ``GET /v1/usage`` and ``thinkgate usage export``; no request the browser made carries
a key in its URL; a full-page screenshot is saved as a test artefact (``tmp_path/dashboard.png``; the doc script
``bench/dashboard_shot.py`` makes ``docs/dashboard.png``). Skips only when no Chromium is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.ledger.event import micro_to_usd
from tests.fixtures.browser import chromium_path, launch, log_in, wait_ready
from tests.fixtures.dashboard import Seeded, export_rows, seeded_gateway, usage_rows
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS
from tests.fixtures.upstream import SimProcess

EXECUTABLE = chromium_path()
pytestmark = pytest.mark.skipif(EXECUTABLE is None, reason="Chromium is not installed (/usr/bin/chromium; "
                                "apt-get install chromium): the dashboard's browser test cannot run")


@pytest.fixture(scope="module")
def seeded(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    with seeded_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("dash-browser")) as s:
        yield s


def _money_by_row(page: object, table: str) -> dict[str, int]:
    """``{data-row: micro-USD of the spend cell}`` of a spend table (first data-micro cell of each row)."""
    return page.eval_on_selector_all(  # type: ignore[attr-defined]
        f"#{table} tr[data-row]",
        "rows => Object.fromEntries(rows.map(r => [r.dataset.row, "
        "Number(r.querySelector('td[data-micro]').dataset.micro)]))")


def fire_drift_alert(seeded: Seeded) -> None:
    """A drift alarm through the real alert path (``Alerts.fire``: Redis log; no webhook configured here)."""
    import asyncio

    from gateway.config import LimitsConfig, RedisConfig
    from gateway.control.drift import DriftAlert
    from gateway.state.alerts import Alerts
    from gateway.state.breaker import Breaker
    from gateway.state.redis import connect

    async def go() -> None:
        handle = connect(RedisConfig(url=seeded.gw.settings.redis.url, key_prefix=seeded.prefix))
        try:
            await Alerts(handle, Breaker(1.0), LimitsConfig()).fire(
                DriftAlert("score", 0.4, 0.25, 500, "r-test", "2026-12-01", "calibration"))
        finally:
            await handle.close()

    asyncio.run(go())


def record_promotion(seeded: Seeded) -> None:
    """A promotion audit event through the retraining's own writer (``p router:history``)."""
    import asyncio

    from gateway.config import RedisConfig
    from gateway.control.retrain_trigger import write_history
    from gateway.state.breaker import Breaker
    from gateway.state.redis import connect

    async def go() -> None:
        handle = connect(RedisConfig(url=seeded.gw.settings.redis.url, key_prefix=seeded.prefix))
        try:
            await write_history(handle, Breaker(1.0), {
                "event": "promote", "ts": 1796169600.0, "version": "auto-test-002", "previous": "auto-test-001",
                "path": "/tmp/r.skops", "outcomes": 400, "reason": "new holds the floor at 31% savings"})
        finally:
            await handle.close()

    asyncio.run(go())


def test_dashboard_in_chromium(seeded: Seeded, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    assert EXECUTABLE is not None
    fire_drift_alert(seeded)
    record_promotion(seeded)
    urls: list[str] = []
    errors: list[str] = []  # console errors (a CSP violation, a script error) and page errors
    with sync_playwright() as p:
        browser = launch(p, EXECUTABLE)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("request", lambda req: urls.append(req.url))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            # a valid key that is not the admin key: refused, no session
            log_in(page, seeded.gw.url, SECRETS["alice"])
            assert "not an admin key" in page.inner_text("body")
            assert not [c for c in page.context.cookies() if c["name"] == "thinkgate_dashboard"]
            # the admin key: the page, rendered from its data poll
            log_in(page, seeded.gw.url, ADMIN_SECRET)
            wait_ready(page)
            cookie = next(c for c in page.context.cookies() if c["name"] == "thinkgate_dashboard")
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and ADMIN_SECRET not in cookie["value"]
            assert page.evaluate("document.cookie") == ""  # HttpOnly: scripts cannot read it
            since = float(page.get_attribute("body", "data-since") or "nan")
            by_key = _money_by_row(page, "spend-key")
            by_tier = _money_by_row(page, "spend-tier")
            by_tag = _money_by_row(page, "spend-tag")
            total = int(page.get_attribute("#total-spend", "data-micro") or "-1")
            cache_saved = int(page.get_attribute("#cache-saved", "data-micro") or "-1")
            days = page.eval_on_selector_all("#spend-day .bar", "bs => Object.fromEntries(bs.map(b => "
                                             "[b.dataset.row, Number(b.dataset.micro)]))")
            budget_rows = page.eval_on_selector_all("#budgets tr[data-row]", "rs => rs.map(r => r.dataset.row)")
            alerts = page.inner_text("#alerts")
            promotions = page.inner_text("#router-history")
            headline = page.inner_text("#total-requests")
            bar_px = page.eval_on_selector("#spend-day .fill", "f => f.getBoundingClientRect().height")
            window_notes = [page.inner_text(f"#{i}", timeout=2000) for i in ("latency-window", "routing-window",
                                                                            "long-tier", "savings-fraction")]
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    print(f"dashboard screenshot: {tmp_path / 'dashboard.png'}")
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    # the refused login's 403 is the only error the console may show; no CSP violation, no script error
    assert [e for e in errors if "403" not in e] == []
    assert bar_px > 20  # the day bars are drawn (sizes set through the CSSOM, which the CSP allows)
    # the per-event figures say which events they cover: here every event of the period
    assert all("events of the period" in n and n.split(" events")[0].endswith(tuple("0123456789"))
               for n in window_notes), window_notes
    # the page's numbers are the API's and the export's
    api_key = {f"key:{r['key']}": r["cost_micro_usd"] for r in usage_rows(seeded.gw, "key", since)}
    assert by_key == api_key and set(api_key) >= {"key:alice", "key:bob"}
    assert by_key == {f"key:{r['key']}": r["cost_micro_usd"] for r in export_rows(seeded.config, "key", since)}
    assert by_tier == {f"tier:{r['tier']}": r["cost_micro_usd"] for r in usage_rows(seeded.gw, "tier", since)}
    assert by_tier == {f"tier:{r['tier']}": r["cost_micro_usd"] for r in export_rows(seeded.config, "tier", since)}
    assert by_tag == {f"tag:{r['tag']}": r["cost_micro_usd"] for r in usage_rows(seeded.gw, "tag", since)}
    assert days == {f"day:{r['day']}": r["cost_micro_usd"] for r in usage_rows(seeded.gw, "day", since)}
    assert total == sum(api_key.values()) > 0
    refused = sum(r["refused"] for r in export_rows(seeded.config, "key", since))
    assert f"{refused} refused" in headline, headline
    assert cache_saved == sum(r["saved_micro_usd"] for r in usage_rows(seeded.gw, "key", since)) > 0
    assert {"budget:key alice:day", "budget:tag:team=a:day", "budget:global:month"} <= set(budget_rows)
    assert "key alice" in alerts and "1% of $0.002" in alerts
    assert "drift · router r-test score PSI 0.400" in alerts
    assert ("2026-12-02 00:00:00 · promote · now auto-test-002 (was auto-test-001) · 400 outcomes · new holds the "
            "floor at 31% savings") in promotions, promotions
    # no request carried a key in its URL (the form posts it in the body)
    assert urls and not [u for u in urls if any(s in u for s in (ADMIN_SECRET, *SECRETS.values()))]
    assert all(u.startswith(seeded.gw.url) for u in urls)  # nothing fetched from anywhere else (no CDN)


def test_redis_down_page_says_so(upstream_sim: SimProcess, tmp_path: Path) -> None:
    """Redis stops while the page is open: the next poll replaces the figures with the outage notice."""
    import uuid

    from playwright.sync_api import sync_playwright

    from tests.fixtures.gateway import accounting_gateway
    from tests.fixtures.redis_stack import PersistentRedis

    assert EXECUTABLE is not None
    server = PersistentRedis(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    try:
        with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, f"tgtest:{uuid.uuid4().hex[:8]}:",
                                dashboard={"secret_file": str(tmp_path / "secret"), "poll_s": 1}) as gw, \
                sync_playwright() as p:
            browser = launch(p, EXECUTABLE)
            try:
                page = browser.new_page()
                log_in(page, gw.url, ADMIN_SECRET)
                wait_ready(page)
                server.stop()
                page.wait_for_selector("body[data-state=unavailable]", timeout=15000)
                assert "Redis is unreachable" in page.inner_text("#status")
                assert page.inner_text("#status").count("unreachable") == 1  # said once
                assert page.inner_text("#updated").startswith("no figures")  # not left on "loading…"
                assert not page.is_visible("#total-spend")  # no figure shown, zero or stale
                page.screenshot(path=str(tmp_path / "dashboard-redis-down.png"))
            finally:
                browser.close()
    finally:
        server.stop()


def test_shadow_spend_is_its_own_line_not_negative_savings(upstream_sim: SimProcess, redis_url: str,
                                                           tmp_path: Path) -> None:
    """Every cheap answer shadowed on the top tier (a first day with ``shadow.fraction: 1``): the shadow calls were
    counted as the served traffic's spend, and "saved by routing" went negative with nothing on the page to say
    why. The page shows savings on served traffic, the shadow (learning) spend as its own card with the saving net
    of it, and the total spend still everything paid — the figures of ``GET /v1/usage`` and the usage report."""
    import json
    import time

    from playwright.sync_api import sync_playwright

    from tests.fixtures.dashboard import cli

    assert EXECUTABLE is not None
    routing = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5], "default_tier": "long",
               "shadow": {"fraction": 1.0, "max_usd_day": "5"}}
    with seeded_gateway(upstream_sim.base_url, redis_url, tmp_path, routing=routing) as seeded:
        # the shadow calls run after their answers: wait until they are metered and no more come (the page, the API
        # and the report must read the same ledger)
        deadline = time.monotonic() + 20
        seen: list[int] = []
        while time.monotonic() < deadline and not (len(seen) >= 3 and seen[-1] == seen[-3] > 0):
            seen.append(sum(r["cost_micro_usd"] for r in usage_rows(seeded.gw, "key", 0) if r["key"] == "_shadow"))
            time.sleep(0.5)
        assert seen and seen[-1] > 0, "no shadow call was metered"
        with sync_playwright() as p:
            browser = launch(p, EXECUTABLE)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                log_in(page, seeded.gw.url, ADMIN_SECRET)
                wait_ready(page)
                since = float(page.get_attribute("body", "data-since") or "nan")
                micro = {i: int(page.get_attribute(f"#{i}", "data-micro") or "-1")
                         for i in ("total-spend", "always-long", "savings", "shadow-spend", "net-savings")}
                fraction = page.inner_text("#savings-fraction")
                net_text = page.inner_text("#net-savings")
                headline = page.inner_text("#total-requests")
                # the page's own formatter on a loss (net savings go negative on a first day of learning)
                formatted = page.evaluate("[usd('-0.002554'), usd('0.5'), usd(null)]")
                page.screenshot(path=str(tmp_path / "dashboard-shadow.png"), full_page=True)
            finally:
                browser.close()
        rows = usage_rows(seeded.gw, "key", since)
        by_key = {r["key"]: r["cost_micro_usd"] for r in rows}
        out = tmp_path / "report.json"
        r = cli("usage", "report", "--since", str(since), "--json", str(out), config=seeded.config)
        assert r.returncode == 0, r.stderr
        summary = json.loads(out.read_text())["summary"]
    assert micro["shadow-spend"] == by_key["_shadow"] == summary["shadow_spend_micro_usd"] > 0
    assert micro["total-spend"] == sum(by_key.values()) == summary["spend_micro_usd"]  # everything paid, still
    served = micro["total-spend"] - micro["shadow-spend"]  # every seeded request answered 200: no other spend
    assert micro["savings"] == micro["always-long"] - served == summary["savings_micro_usd"]
    assert micro["net-savings"] == micro["savings"] - micro["shadow-spend"] == summary["net_savings_micro_usd"]
    assert "on served traffic" in fraction
    # the sign before the currency sign, as the usage report writes money (it read "$-0.002554")
    assert formatted == ["-$0.002554", "$0.5", "—"], formatted
    net_usd = str(micro_to_usd(micro["net-savings"]))
    assert net_text.startswith("net of them saved " + ("-$" + net_usd[1:] if micro["net-savings"] < 0
                                                       else "$" + net_usd)), net_text
    # the shadow calls are counted apart from the clients' requests, as the report does (they were "requests")
    asked = {r["key"]: r["requests"] for r in rows}
    shadow_calls = asked.pop("_shadow")
    assert shadow_calls > 0 and headline.startswith(
        f"{sum(asked.values())} requests + {shadow_calls} shadow calls · "), (headline, asked, shadow_calls)


def test_windowed_figures_are_labelled_as_the_last_n_events(upstream_sim: SimProcess, redis_url: str,
                                                            tmp_path: Path) -> None:
    """A ledger larger than ``dashboard.window_events`` (3 here): the page labels the always-long estimate, the
    savings, the routing mix and the latency table "last 3 events only", while the spend figures are still the whole
    period's (``GET /v1/usage``)."""
    from playwright.sync_api import sync_playwright

    assert EXECUTABLE is not None
    dash = {"secret_file": str(tmp_path / "secret"), "poll_s": 1, "window_events": 3}
    with seeded_gateway(upstream_sim.base_url, redis_url, tmp_path, dashboard=dash) as seeded, \
            sync_playwright() as p:
        browser = launch(p, EXECUTABLE)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            log_in(page, seeded.gw.url, ADMIN_SECRET)
            wait_ready(page)
            since = float(page.get_attribute("body", "data-since") or "nan")
            notes = {i: page.inner_text(f"#{i}", timeout=2000)
                     for i in ("latency-window", "routing-window", "long-tier", "savings-fraction", "net-savings")}
            complete = page.get_attribute("body", "data-window-complete")
            by_key = _money_by_row(page, "spend-key")
            total = int(page.get_attribute("#total-spend", "data-micro") or "-1")
        finally:
            browser.close()
        api_key = {f"key:{r['key']}": r["cost_micro_usd"] for r in usage_rows(seeded.gw, "key", since)}
    assert complete == "false"
    assert all("last 3 events only" in n for n in notes.values()), notes
    assert by_key == api_key and total == sum(api_key.values()) > 0
