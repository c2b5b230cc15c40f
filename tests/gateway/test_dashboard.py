"""``/dashboard`` over HTTP against a real gateway with a seeded ledger (real Redis, the simulator): the login
contract, the cookie, the JSON's figures against ``GET /v1/usage``, ``thinkgate usage export`` and
``thinkgate usage report``, and Redis down → "unreachable", never zeros. The browser test is in tests/e2e."""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.api.dashboard import dev_key_is_admin
from gateway.api.dashboard.data import percentile, target_shares
from gateway.api.dashboard.session import Sessions
from gateway.auth.keys import KeyInfo
from gateway.config import Settings
from gateway.ledger import report as rp
from gateway.ledger.event import UsageEvent, micro_to_usd
from gateway.state.keys import RedisKeys
from tests.fixtures.dashboard import Seeded, cli, export_rows, seeded_gateway, usage_rows
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, cleanup, keys_config
from tests.fixtures.redis_stack import PersistentRedis
from tests.fixtures.upstream import GatewayServer, SimProcess


@pytest.fixture(scope="module")
def seeded(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    with seeded_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("dash")) as s:
        yield s


def login(url: str, key: str) -> httpx.Response:
    return httpx.post(url + "/dashboard/login", data={"key": key}, timeout=10, follow_redirects=False)


def test_login_contract_cookie_and_refusals(seeded: Seeded, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # the gateway runs in this process: every log record of the logins lands here
    url = seeded.gw.url
    page = httpx.get(url + "/dashboard", timeout=10)
    assert page.status_code == 200 and 'name="key"' in page.text and 'method="post"' in page.text
    assert httpx.get(url + "/dashboard/data", timeout=10).status_code == 401
    assert login(url, SECRETS["alice"]).status_code == 403  # a valid key, not an admin one
    assert login(url, "tg-not-a-key").status_code == 401
    # a key in a URL is refused even when it is the admin key
    r = httpx.post(url + "/dashboard/login", params={"key": ADMIN_SECRET}, timeout=10)
    assert r.status_code == 400 and "set-cookie" not in r.headers
    assert httpx.get(url + "/dashboard/login", params={"key": ADMIN_SECRET}, timeout=10).status_code == 405
    ok = login(url, ADMIN_SECRET)
    assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/dashboard" in cookie
    assert ADMIN_SECRET not in cookie and hashlib.sha256(ADMIN_SECRET.encode()).hexdigest() not in cookie
    jar = ok.cookies
    assert httpx.get(url + "/dashboard/data", cookies=jar, timeout=10).status_code == 200
    page = httpx.get(url + "/dashboard", cookies=jar, timeout=10)
    assert "/dashboard/static/dashboard.js" in page.text and "cdn" not in page.text.lower()
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(url + "/dashboard/static/dashboard.js", timeout=10).status_code == 200
    # an altered cookie is no session
    name, value = next(iter(jar.items()))
    body, sig = value.split(".")
    forged = body[:-2] + ("AA" if body[-2:] != "AA" else "BB") + "." + sig
    assert httpx.get(url + "/dashboard/data", cookies={name: forged}, timeout=10).status_code == 401
    other = login(url, ADMIN_SECRET).cookies  # a second session of the same key
    out = httpx.post(url + "/dashboard/logout", cookies=jar, timeout=10)
    assert "Max-Age=0" in out.headers["set-cookie"]
    # the logged-out cookie is no session any more (it read the data for its 8 hours), the other session still is
    assert httpx.get(url + "/dashboard/data", cookies=jar, timeout=10).status_code == 401
    assert httpx.get(url + "/dashboard/data", cookies=other, timeout=10).status_code == 200
    # the server side's records (the test's own client logs the URLs it was told to send)
    served = "\n".join(f"{r.name} {r.getMessage()}" for r in caplog.records
                       if not r.name.startswith(("httpx", "httpcore")))
    assert ADMIN_SECRET not in served and SECRETS["alice"] not in served


def _data(seeded: Seeded) -> dict:
    jar = login(seeded.gw.url, ADMIN_SECRET).cookies
    r = httpx.get(seeded.gw.url + "/dashboard/data", cookies=jar, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_period_that_does_not_parse_or_is_empty_is_a_400(seeded: Seeded) -> None:
    """``since`` not before ``until`` is refused, as ``GET /v1/usage`` and the CLI refuse it — it drew a dashboard of
    zeros, as if nothing had been spent."""
    jar = login(seeded.gw.url, ADMIN_SECRET).cookies
    for params in ({"since": "2026-12-02", "until": "2026-12-01"}, {"since": "2026-12-01", "until": "2026-12-01"},
                   {"since": "yesterday"}):
        r = httpx.get(seeded.gw.url + "/dashboard/data", params=params, cookies=jar, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (params, r.text)


def test_figures_equal_usage_api_export_and_report(seeded: Seeded) -> None:
    d = _data(seeded)
    since = d["since"]
    for group in ("day", "key", "tier", "tag"):
        assert d["spend"][group] == usage_rows(seeded.gw, group, since), group
    assert d["spend"]["key"] == export_rows(seeded.config, "key", since)
    assert d["spend"]["tier"] == export_rows(seeded.config, "tier", since)
    assert {r["key"] for r in d["spend"]["key"]} >= {"alice", "bob"}
    assert d["total"]["requests"] == sum(r["requests"] for r in d["spend"]["key"]) >= len(seeded.request_ids)
    assert d["total"]["cost_micro_usd"] == sum(r["cost_micro_usd"] for r in d["spend"]["tier"]) > 0
    # savings: the usage report's counterfactual over the same period
    out = seeded.config.with_name("report.json")
    r = cli("usage", "report", "--since", str(since), "--json", str(out), config=seeded.config)
    assert r.returncode == 0, r.stderr
    summary = json.loads(out.read_text())["summary"]
    # sums over the period, from the cubes
    for field in ("cache_saved_micro_usd", "spend_micro_usd", "shadow_spend_micro_usd"):
        assert d["savings"][field] == summary[field], field
    # the per-event figures, over the window of recent events: here it holds the whole period, so they are the
    # report's
    assert d["window"]["complete"] and d["window"]["read"] < d["window"]["limit"] == 5000
    for field in ("always_long_micro_usd", "savings_micro_usd", "cache_saved_micro_usd", "spend_micro_usd",
                  "shadow_spend_micro_usd", "net_savings_micro_usd", "requests"):
        assert d["window"]["savings"][field] == summary[field], field
    assert d["savings"]["cache_saved_micro_usd"] > 0  # the seeded cache hit
    # budgets: alice's key level, the team=a tag level, the global level — with what remains
    levels = {(b["level"], b["period"], b.get("key_id")) for b in d["budgets"]}
    assert {("key", "day", "alice"), ("tag:team=a", "day", None), ("global", "month", None)} <= levels
    alice = next(b for b in d["budgets"] if b.get("key_id") == "alice")
    spent_alice = sum(r["cost_micro_usd"] for r in d["spend"]["key"] if r["key"] == "alice")
    assert Decimal(alice["spent_usd"]) == micro_to_usd(spent_alice) > 0
    assert Decimal(alice["remaining_usd"]) == Decimal(alice["budget_usd"]) - micro_to_usd(spent_alice) - Decimal(
        alice["reserved_usd"])
    # alerts: alice crossed 1 % of her day budget
    assert any(a["key_id"] == "alice" and a["fraction"] == 0.01 and a["level"] == "key" for a in d["alerts"])
    # latency and routing per tier
    lat = {x["tier"]: x for x in d["latency"]}
    assert lat["long"]["events"] > 0 and lat["long"]["p50_ms"] <= lat["long"]["p99_ms"]
    routing = {x["tier"]: x for x in d["routing"]["tiers"]}
    assert sum(x["requests"] for x in routing.values()) == summary["requests"]
    assert d["routing"]["predicted_requests"] == sum(x["predicted"] for x in routing.values()) >= 3


def test_redis_down_says_unreachable_not_zeros(upstream_sim: SimProcess, tmp_path: Path) -> None:
    server = PersistentRedis(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    try:
        with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, f"tgtest:{uuid.uuid4().hex[:8]}:",
                                dashboard={"secret_file": str(tmp_path / "secret")}) as gw:
            jar = login(gw.url, ADMIN_SECRET).cookies
            assert httpx.get(gw.url + "/dashboard/data", cookies=jar, timeout=10).status_code == 200
            server.stop()
            t0 = time.monotonic()
            r = httpx.get(gw.url + "/dashboard/data", cookies=jar, timeout=10)
            assert r.status_code == 503 and r.json()["redis"] == "unreachable" and "spend" not in r.json()
            assert time.monotonic() - t0 < 5
    finally:
        server.stop()


def test_dev_key_opens_the_dashboard_only_on_embedded_defaults(tmp_path: Path) -> None:
    secret = "tg-dev-" + uuid.uuid4().hex
    (tmp_path / "dev-key").write_text(secret + "\n")
    digest = hashlib.sha256(secret.encode()).hexdigest()
    dev = KeyInfo(id="dev")
    base = {"engine": {"enabled": False}, "routing": {"router_path": None}}
    embedded = Settings.load(None, **base, auth={"dev_key_file": str(tmp_path / "dev-key"),
                                                 "keys": [{"id": "dev", "secret_sha256": digest}]})
    assert dev_key_is_admin(embedded, dev)
    assert not dev_key_is_admin(embedded, KeyInfo(id="alice"))
    with_admin = Settings.load(None, **base, auth={"dev_key_file": str(tmp_path / "dev-key"),
                                                   "admin_key_sha256": "0" * 64,
                                                   "keys": [{"id": "dev", "secret_sha256": digest}]})
    assert not dev_key_is_admin(with_admin, dev)
    other = Settings.load(None, **base, auth={"dev_key_file": str(tmp_path / "dev-key"),
                                              "keys": [{"id": "dev", "secret_sha256": "1" * 64}]})
    assert not dev_key_is_admin(other, dev)  # a key named "dev" that is not the dev-key file's


def test_sessions_expire_and_helpers() -> None:
    s = Sessions(b"k" * 32, ttl_s=60)
    digest = hashlib.sha256(b"tg-some-key").digest()
    v = s.issue("admin", digest, now=1000.0)
    assert s.check(v, now=1059.0) == "admin" and s.check(v, now=1060.0) is None
    assert Sessions(b"x" * 32, 60).check(v, now=1000.0) is None
    parsed = s.parse(v, now=1000.0)
    assert parsed is not None and s.bound_to(parsed, digest)
    assert not s.bound_to(parsed, hashlib.sha256(b"tg-other-key").digest()) and not s.bound_to(parsed, None)
    assert digest.hex() not in v and s.credential_tag(digest) != Sessions(b"x" * 32, 60).credential_tag(digest)
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0 and percentile([1.0, 2.0], 99) == 2.0
    assert percentile([], 50) is None
    assert target_shares(["short", "long"], {"achieved_frac_at_or_above": [0.7192]}) == {"short": 0.2808,
                                                                                         "long": 0.7192}
    assert target_shares(["short", "long"], None) is None


def test_routing_target_is_the_share_shown(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    routing = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5], "default_tier": "long",
               "target": {"long_share": 0.3}}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, f"tgtest:{uuid.uuid4().hex[:8]}:",
                            routing=routing, dashboard={"secret_file": str(tmp_path / "secret")}) as gw:
        jar = login(gw.url, ADMIN_SECRET).cookies
        r = httpx.post(gw.base_url + "/chat/completions", timeout=30,
                       headers={"authorization": f"Bearer {SECRETS['bob']}"},
                       json={"model": "auto", "messages": [{"role": "user", "content": "hi " + uuid.uuid4().hex}]})
        assert r.status_code == 200
        d = httpx.get(gw.url + "/dashboard/data", cookies=jar, timeout=10).json()
    assert d["routing"]["target_source"] == "routing.target"
    shares = {t["tier"]: t["target_share"] for t in d["routing"]["tiers"]}
    assert shares["long"] == 0.3 and abs(shares["short"] - 0.7) < 1e-9 and shares["none"] is None


def test_rotating_the_admin_key_ends_its_sessions(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    """A session names the key id, and the admin key's id (``admin``) survives its rotation: the session must be
    bound to the credential itself, or a cookie of the old key reads the dashboard for its 8 hours after the
    rotation. The gateway is restarted as a rotation deploys it (new config, same dashboard secret, same Redis)."""
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    dash = {"secret_file": str(tmp_path / "secret")}
    rotated = "tg-admin-rotated-" + uuid.uuid4().hex

    def data(gw: GatewayServer, jar: Any) -> int:
        return httpx.get(gw.url + "/dashboard/data", cookies=jar, timeout=10).status_code

    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix, dashboard=dash) as gw:
            old = login(gw.url, ADMIN_SECRET).cookies
            assert data(gw, old) == 200
        auth = {**keys_config(), "admin_key_sha256": hashlib.sha256(rotated.encode()).hexdigest()}
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix, dashboard=dash, auth=auth) as gw:
            assert data(gw, old) == 401  # the old key's session ended with the key
            assert 'name="key"' in httpx.get(gw.url + "/dashboard", cookies=old, timeout=10).text  # the login form
            assert login(gw.url, ADMIN_SECRET).status_code == 401
            new = login(gw.url, rotated).cookies
            assert data(gw, new) == 200
        # the admin key removed altogether: its sessions end too
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix, dashboard=dash,
                                auth={k: v for k, v in auth.items() if k != "admin_key_sha256"}) as gw:
            assert data(gw, new) == 401 and data(gw, old) == 401
    finally:
        cleanup(redis_url, prefix)


def test_a_rewritten_dev_key_ends_its_sessions(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    """Embedded defaults: the development key is admin for the dashboard — and for ``GET /v1/usage``, which showed it
    only its own usage (403 for another key's) while the dashboard showed it every key's — while it is the key of its
    file. Rewriting the file (the operator's way to change it) ends the sessions it opened at their next request, and
    its admin reads, live."""
    secret = "tg-dev-" + uuid.uuid4().hex
    dev_file = tmp_path / "dev-key"
    dev_file.write_text(secret + "\n")
    auth = {"dev_key_file": str(dev_file), "keys": [{"id": "dev", "secret": secret}]}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, auth=auth,
                            dashboard={"secret_file": str(tmp_path / "secret")}) as gw:
        jar = login(gw.url, secret).cookies
        assert httpx.get(gw.url + "/dashboard/data", cookies=jar, timeout=10).status_code == 200

        def others_usage() -> httpx.Response:
            return httpx.get(gw.url + "/v1/usage", params={"key_id": "someone"}, timeout=10,
                             headers={"authorization": f"Bearer {secret}"})

        # the admin's answer (no such key has usage), not a key's refusal to read another's
        assert (r := others_usage()).status_code == 404 and r.json()["error"]["code"] == "key_not_found", r.text
        dev_file.write_text("tg-dev-" + uuid.uuid4().hex + "\n")
        assert httpx.get(gw.url + "/dashboard/data", cookies=jar, timeout=10).status_code == 401
        assert others_usage().status_code == 403


def test_the_poll_reads_a_bounded_window_and_every_sum_from_the_cubes(upstream_sim: SimProcess, redis_url: str,
                                                                       tmp_path: Path) -> None:
    """The poll scanned the month's stream (seconds at 150,000 events, every few seconds). With a window of 3
    events and a ledger of more: the poll reads at most 3 stream entries, its per-event figures (latency, routing
    mix, the always-long estimate) are exactly those of the stream's last 3 events, and every sum is still the whole
    period's, equal to ``GET /v1/usage``."""
    dash = {"secret_file": str(tmp_path / "secret"), "poll_s": 1, "window_events": 3}
    with seeded_gateway(upstream_sim.base_url, redis_url, tmp_path, dashboard=dash) as seeded:
        d = _data(seeded)
        since = d["since"]
        by_key = usage_rows(seeded.gw, "key", since)
        r = redis.Redis.from_url(redis_url)
        try:
            stream = RedisKeys(seeded.prefix).events
            n_stream = r.xlen(stream)
            last = [UsageEvent.from_json(f[b"e"]) for _, f in reversed(r.xrevrange(stream, count=3))]
        finally:
            r.close()
    assert n_stream >= len(seeded.request_ids) > 3
    w = d["window"]
    assert w["limit"] == 3 and w["read"] == 3 and w["events"] == 3 and not w["complete"]
    assert (w["oldest"], w["newest"]) == (last[0].ts, last[-1].ts)
    # sums: the whole period (every seeded request), not the window
    assert d["spend"]["key"] == by_key
    assert d["total"]["requests"] == sum(x["requests"] for x in by_key) >= len(seeded.request_ids)
    assert d["savings"]["spend_micro_usd"] == sum(x["cost_micro_usd"] for x in by_key) > 0
    # per-event figures: exactly the last 3 events'
    lat = {x["tier"]: x["events"] for x in d["latency"] if x["events"]}
    want: dict[str, int] = {}
    for ev in last:
        if not ev.audit and ev.tier is not None:
            want[ev.tier] = want.get(ev.tier, 0) + 1
    assert lat == want and sum(lat.values()) <= 3
    assert sum(x["requests"] for x in d["routing"]["tiers"]) == sum(1 for ev in last if rp.counts_as_request(ev))
    report = rp.build(last, rp.long_tier_of(seeded.gw.settings), seeded.gw.settings.tier("long").prices)
    assert w["savings"]["always_long_micro_usd"] == report.always_long_micro_usd
    assert w["savings"]["spend_micro_usd"] == report.spend_micro_usd < d["savings"]["spend_micro_usd"]


def test_data_without_a_session_is_an_openai_error_that_says_how_a_script_logs_in(
        upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    """A script fetching ``/dashboard/data`` with the admin key as a Bearer header — as every other endpoint takes it
    — got ``{"error": {"message": "log in at /dashboard", …}}`` without ``param``: no hint that the data wants the
    session cookie of ``POST /dashboard/login``. The 401 is OpenAI's error shape and says how; the login it names
    works from a script."""
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, f"tgtest:{uuid.uuid4().hex[:8]}:",
                            dashboard={"secret_file": str(tmp_path / "secret")}) as gw:
        r = httpx.get(gw.url + "/dashboard/data", headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10)
        assert r.status_code == 401
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert (err["type"], err["param"], err["code"]) == ("authentication_error", None, "no_session")
        assert "POST /dashboard/login" in err["message"] and "key=<admin key>" in err["message"], err["message"]
        jar = login(gw.url, ADMIN_SECRET).cookies  # what it says to do
        assert httpx.get(gw.url + "/dashboard/data", cookies=jar, timeout=10).status_code == 200
