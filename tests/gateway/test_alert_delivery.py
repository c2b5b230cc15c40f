"""Alerts that arrive: a loopback webhook receiver that fails the first two attempts (500, then 429), gets the
Slack-compatible body on the third, with exponential backoff between attempts; one that never answers 2xx
leaves the alert in the dead-letter log (JSON Lines) — real Redis, real HTTP, nothing mocked."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gateway.config import LimitsConfig
from gateway.state.alerts import Alerts
from gateway.state.keys import RedisKeys
from gateway.state.limits import KeyLimits
from tests.fixtures.redis_stack import PersistentRedis, stack


class Receiver:
    """A webhook on loopback answering the statuses in ``plan`` in turn (then 200); records every attempt."""

    def __init__(self, plan: list[int]) -> None:
        self.plan = list(plan)
        self.attempts: list[tuple[float, dict[str, object]]] = []
        outer = self

        class Hook(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.attempts.append((time.monotonic(), body))
                status = outer.plan.pop(0) if outer.plan else 200
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T000/B000/secretpart"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver([500, 429])
    yield r
    r.close()


async def test_webhook_retried_with_backoff_until_it_arrives(redis_url: str, redis_prefix: str, tmp_path: Path,
                                                             receiver: Receiver) -> None:
    dead = tmp_path / "dead.jsonl"
    cfg = LimitsConfig(alert_fractions=[0.5], alert_webhook_url=receiver.url, alert_webhook_attempts=4,
                       alert_webhook_backoff_s=0.2, alert_dead_letter_path=dead)
    lim = KeyLimits("retried", budget_day_micro=1000)
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st, httpx.AsyncClient() as http:
        alerts = Alerts(st.handle, st.breaker, cfg, http)
        fired = await alerts.check(lim, {"team": "qa"}, "2026-12-01", 600, 600)
        assert [a.fraction for a in fired] == [0.5]
        recent = await alerts.recent()
    assert len(receiver.attempts) == 3  # 500, 429, then delivered
    (t1, _), (t2, _), (t3, body) = receiver.attempts
    assert t2 - t1 >= 0.2 and t3 - t2 >= 0.4  # 0.2 s, then 0.4 s: exponential
    assert body["text"].startswith("ThinkGate budget alert: key retried has spent $0.000600")
    assert body["key_id"] == "retried" and body["fraction"] == 0.5 and body["period"] == "day"
    assert not dead.exists()
    assert recent[0]["key_id"] == "retried" and recent[0]["fired_at"] > 0


async def test_undeliverable_alert_is_dead_lettered(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    receiver = Receiver([503, 503, 503])
    dead = tmp_path / "state" / "dead.jsonl"
    cfg = LimitsConfig(alert_fractions=[0.5], alert_webhook_url=receiver.url, alert_webhook_attempts=3,
                       alert_webhook_backoff_s=0.05, alert_dead_letter_path=dead)
    try:
        async with stack(redis_url, redis_prefix, tmp_path / "s") as st, httpx.AsyncClient() as http:
            alerts = Alerts(st.handle, st.breaker, cfg, http)
            await alerts.check(KeyLimits("lost", budget_day_micro=1000), {}, "2026-12-01", 700, 700)
    finally:
        receiver.close()
    assert len(receiver.attempts) == 3
    lines = [json.loads(line) for line in dead.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["attempts"] == 3 and lines[0]["error"] == "HTTP 503"
    assert lines[0]["body"]["key_id"] == "lost" and lines[0]["body"]["text"]
    assert "secretpart" not in dead.read_text()  # the webhook's secret path is not written
    assert dead.stat().st_mode & 0o777 == 0o600


async def test_a_rejected_payload_is_not_retried(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    receiver = Receiver([400])
    cfg = LimitsConfig(alert_fractions=[0.5], alert_webhook_url=receiver.url, alert_webhook_attempts=5,
                       alert_webhook_backoff_s=0.05, alert_dead_letter_path=tmp_path / "dead.jsonl")
    try:
        async with stack(redis_url, redis_prefix, tmp_path / "s") as st, httpx.AsyncClient() as http:
            await Alerts(st.handle, st.breaker, cfg, http).check(KeyLimits("bad", budget_day_micro=1000), {},
                                                                  "2026-12-01", 700, 700)
    finally:
        receiver.close()
    assert len(receiver.attempts) == 1 and (tmp_path / "dead.jsonl").exists()


def test_redacted_webhook_url_shows_no_secret() -> None:
    from gateway.state.webhooks import redacted

    for url, secret in [("https://hooks.slack.com/services/T000/B000/XXXXsecret", "XXXXsecret"),
                        ("https://chat.example.com/hooks/abc123secret", "abc123secret"),
                        ("https://discord.com/api/webhooks/42/tok3nsecret", "tok3nsecret"),
                        ("https://user:pw@alerts.example.com:8443/in?token=q7secret", "q7secret")]:
        shown = redacted(url)
        assert secret not in shown and "pw" not in shown
        assert shown.startswith(url.split("://")[0] + "://") and shown.endswith("/…")
    assert redacted("http://127.0.0.1:9000") == "http://127.0.0.1:9000"
    assert redacted("https://alerts.example.com:8443/x") == "https://alerts.example.com:8443/…"


async def test_an_alert_whose_mark_reply_was_lost_still_fires(tmp_path: Path) -> None:
    """Redis stops (SIGSTOP) with the alert's ``SET NX`` in flight: the call times out, and Redis applies the SET once
    it runs again. The mark is this process's own, so the next check fires the alert; it used to read the mark as
    another replica's alert and stay quiet — the alert lost for the day. Another process (another token) stays
    quiet."""
    server = PersistentRedis(tmp_path)
    server.start()
    prefix = "tgtest:alert-lost-reply:"
    cfg = LimitsConfig(alert_fractions=[0.5])
    lim = KeyLimits("blip", budget_day_micro=1000)
    try:
        async with stack(server.url, prefix, tmp_path / "s", cooldown_s=0.1) as st:
            alerts = Alerts(st.handle, st.breaker, cfg)
            await st.handle.client.ping()  # connected before the stop
            server.pause()
            try:
                assert await alerts.check(lim, {}, "2026-12-01", 600, 600) == []  # timed out: undecided
            finally:
                server.resume()
            await asyncio.sleep(0.3)  # the breaker's cooldown
            check = redis.Redis.from_url(server.url)
            try:
                assert check.exists(RedisKeys(prefix).alert("blip", "2026-12-01", "0.5"))  # Redis applied the SET
            finally:
                check.close()
            fired = await alerts.check(lim, {}, "2026-12-01", 650, 650)
            assert [(a.key_id, a.fraction) for a in fired] == [("blip", 0.5)]
            assert await Alerts(st.handle, st.breaker, cfg).check(lim, {}, "2026-12-01", 700, 700) == []
    finally:
        server.stop()


async def test_one_process_claims_a_mark_once(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    """Two tasks of one process claim the same mark at once (two metering writes crossing the same fraction): one
    claims it, the other is told it is being decided; afterwards the mark reads as fired, for this process and for
    another. (Reading one's own token back as "my earlier claim whose reply was lost" fired it twice.)"""
    async with stack(redis_url, redis_prefix, tmp_path / "s") as st:
        alerts = Alerts(st.handle, st.breaker, LimitsConfig())
        mark = RedisKeys(redis_prefix).alert("twice", "2026-12-01", "0.5")
        got = await asyncio.gather(alerts.claim(mark, 60), alerts.claim(mark, 60))
        assert sorted(got, key=str) == sorted([True, None], key=str), got
        assert await alerts.claim(mark, 60) is False
        assert await Alerts(st.handle, st.breaker, LimitsConfig()).claim(mark, 60) is False
        assert await st.handle.client.get(mark) == b"fired"
