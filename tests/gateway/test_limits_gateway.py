"""Budgets and rate limits through a real gateway: the 64-concurrent budget race (``soft`` budget mode: spend
reaches the budget, overshoot ≤ one request; ``hard`` mode is tests/gateway/test_budgets_gateway.py), RPM and
TPM as the OpenAI SDK sees them (429, OpenAI error codes, Retry-After)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal

import httpx
import openai
import pytest

from gateway.ledger.event import micro_to_usd
from tests.fixtures.gateway import SECRETS, accounting_gateway, cleanup, create_key, usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"tgtest:{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory,
       prefix: str) -> Iterator[GatewayServer]:
    try:
        # a 64-request burst on a loaded 2-core box can starve the gateway's event loop past the default 0.25 s
        # Redis timeout (the key lookup then answers 503 key_store_unavailable, seen in CI); these tests are about
        # the budget race, not timeouts (tests/gateway/test_breaker_outages.py is), as in test_budgets_gateway.py
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("limgw"), prefix,
                                limits={"budget_mode": "soft"}, redis={"socket_timeout_s": 5.0}) as g:
            yield g
    finally:
        cleanup(redis_url, prefix)


def _body(tag: str, delay_ms: int = 0) -> dict[str, object]:
    return {"model": "short", "messages": [{"role": "user", "content": "spend some budget please"}],
            "sim": {"tag": tag, "delay_ms": delay_ms}}


async def _burst(gw: GatewayServer, secret: str, n: int, body: dict[str, object]) -> list[httpx.Response]:
    headers = {"authorization": f"Bearer {secret}", "cache-control": "no-store"}
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        return await asyncio.gather(*(http.post(gw.base_url + "/chat/completions", json=body, headers=headers)
                                      for _ in range(n)))


def _one_request_cost(gw: GatewayServer) -> int:
    r = httpx.post(gw.base_url + "/chat/completions", json=_body(uuid.uuid4().hex),
                   headers={"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}, timeout=30)
    rid = r.headers["x-request-id"]
    return usage_events(gw, [rid])[rid].cost_micro_usd


@pytest.mark.parametrize("worth", [Decimal("1"), Decimal("2.5")])
def test_64_concurrent_requests_against_a_budget(gw: GatewayServer, redis_url: str, prefix: str,
                                                 worth: Decimal) -> None:
    cost = _one_request_cost(gw)
    assert cost > 0
    budget_micro = int(cost * worth)
    kid = f"race-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(budget_micro))
    responses = asyncio.run(_burst(gw, secret, 64, _body(uuid.uuid4().hex, delay_ms=300)))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    others = [(r.status_code, r.text[:300]) for r in responses if r.status_code not in (200, 429)]
    assert len(ok) + len(refused) == 64 and ok, others
    for r in refused:
        err = r.json()["error"]
        assert err["code"] == "budget_exceeded" and err["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
    # keep spending sequentially until the budget refuses for the rest of the day
    for _ in range(10):
        r = httpx.post(gw.base_url + "/chat/completions", json=_body(uuid.uuid4().hex),
                       headers={"authorization": f"Bearer {secret}", "cache-control": "no-store"}, timeout=30)
        if r.status_code == 429 and int(r.headers["retry-after"]) > 1:
            break
        assert r.status_code in (200, 429)
    else:
        pytest.fail("the budget never closed")
    admin_view = httpx.get(gw.base_url + "/usage", params={"key_id": kid},
                           headers={"authorization": f"Bearer {SECRETS['alice']}"}, timeout=10)
    assert admin_view.status_code == 403
    spent = _spent(gw, kid)
    assert budget_micro <= spent <= budget_micro + cost  # overshoot by at most one request


def _spent(gw: GatewayServer, kid: str) -> int:
    from tests.fixtures.gateway import ADMIN_SECRET

    s = httpx.get(gw.base_url + "/usage", params={"key_id": kid},
                  headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10).json()
    return int(s["counters"]["day"]["cost_micro_usd"])


def test_rpm_through_the_sdk(gw: GatewayServer, redis_url: str, prefix: str) -> None:
    secret = create_key(redis_url, prefix, f"rpm-{uuid.uuid4().hex[:8]}", rpm=2)
    c = openai.OpenAI(base_url=gw.base_url, api_key=secret, max_retries=0, timeout=30)
    msgs = [{"role": "user", "content": "rate me"}]
    first = c.chat.completions.with_raw_response.create(model="short", messages=msgs)  # type: ignore[arg-type]
    second = c.chat.completions.with_raw_response.create(model="short", messages=msgs,  # type: ignore[arg-type]
                                                         stream=True)
    # OpenAI's rate-limit headers, on JSON and SSE answers alike: the window after this request
    for r, left in ((first, "1"), (second, "0")):
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        assert r.headers["x-ratelimit-remaining-requests"] == left
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-limit-tokens" not in r.headers  # no TPM limit on this key
    list(second.parse())
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="short", messages=msgs)  # type: ignore[arg-type]
    assert info.value.code == "rate_limit_exceeded"
    h = info.value.response.headers
    assert 1 <= int(h["retry-after"]) <= 120
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("2", "0")
    assert "RPM limit reached (2 requests per minute" in info.value.message and f"in {h['retry-after']} s" in \
        info.value.message
    # a key without limits gets none of them
    plain = openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0, timeout=30)
    r = plain.chat.completions.with_raw_response.create(model="short", messages=msgs)  # type: ignore[arg-type]
    assert not [k for k in r.headers if k.startswith("x-ratelimit-")]


def test_tpm_through_the_gateway(gw: GatewayServer, redis_url: str, prefix: str) -> None:
    # each request uses ~20 tokens (7 prompt + ~13 completion on the simulator) and reserves ~116 up front
    secret = create_key(redis_url, prefix, f"tpm-{uuid.uuid4().hex[:8]}", tpm=60)
    headers = {"authorization": f"Bearer {secret}", "cache-control": "no-store"}
    codes = []
    for _ in range(10):
        r = httpx.post(gw.base_url + "/chat/completions", json=_body(uuid.uuid4().hex), headers=headers, timeout=30)
        codes.append(r.status_code)
        assert r.headers["x-ratelimit-limit-tokens"] == "60"
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "TPM" in r.json()["error"]["message"]
            assert r.headers["x-ratelimit-remaining-tokens"] == "0"
            break
        # what is left after this request's upper-bound reservation (settled below to its real tokens)
        assert 0 <= int(r.headers["x-ratelimit-remaining-tokens"]) < 60
        usage_events(gw, [r.headers["x-request-id"]])  # settled: the window holds real tokens, not the reservation
    assert codes[0] == 200 and codes[-1] == 429
    assert 3 <= len(codes) <= 5  # settled with the real token counts, not the reserved upper bounds


def test_budget_alerts_fire_once_through_the_gateway(gw: GatewayServer, upstream_sim: SimProcess, redis_url: str,
                                                     prefix: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    import http.server
    import json
    import threading
    import time

    received: list[dict[str, object]] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cost = _one_request_cost(gw)
    kid = f"alert-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(int(cost * 2.5)), tags={"team": "ml"})
    limits = {"alert_fractions": [0.5, 0.8, 1.0], "alert_webhook_url": f"http://127.0.0.1:{server.server_port}/h",
              "budget_mode": "soft"}
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("alertgw"), prefix,
                                limits=limits) as alert_gw:
            headers = {"authorization": f"Bearer {secret}", "cache-control": "no-store"}
            codes = []
            for _ in range(5):  # one at a time, each settled before the next (as a sequential client sees it)
                r = httpx.post(alert_gw.base_url + "/chat/completions", json=_body(uuid.uuid4().hex),
                               headers=headers, timeout=30)
                codes.append(r.status_code)
                if r.status_code == 200:
                    usage_events(alert_gw, [r.headers["x-request-id"]])
            deadline = time.monotonic() + 5
            while len(received) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # anything extra would show up now
    finally:
        server.shutdown()
        server.server_close()
    assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
    assert sorted((a["period"], a["fraction"]) for a in received) == [("day", 0.5), ("day", 0.8), ("day", 1.0)]
    assert all(a["key_id"] == kid and a["tags"] == {"team": "ml"} for a in received)


def test_a_long_non_streamed_call_keeps_its_reservation(upstream_sim: SimProcess, redis_url: str,
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A non-streamed answer may take up to the tier's response_timeout_s (600 s), longer than the reservation's
    TTL (limits.reservation_ttl_s, 600 s; 0.6 s here): its reservations are renewed while it runs, as a stream's
    are, so concurrent requests keep seeing its upper bound. They lapsed: a hard budget could be overspent."""
    import threading

    import redis as redis_sync

    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("renew"), prefix,
                                limits={"reservation_ttl_s": 0.6}) as gw:
            secret = create_key(redis_url, prefix, "slow", budget_usd_day=Decimal("1"))
            result: list[httpx.Response] = []
            body = {"model": "short", "messages": [{"role": "user", "content": "take your time"}],
                    "sim": {"delay_ms": 1800}}
            t = threading.Thread(target=lambda: result.append(httpx.post(
                gw.base_url + "/chat/completions", json=body, timeout=30,
                headers={"authorization": f"Bearer {secret}", "cache-control": "no-store"})))
            t.start()
            client = redis_sync.Redis.from_url(redis_url)
            try:
                time.sleep(1.3)  # past two TTLs, the call still running
                held = client.hgetall(f"{prefix}lim:slow:resv")
                now_ms = time.time() * 1000
                live = [v for v in held.values() if int(v.decode().split("|")[2]) > now_ms]
                assert len(live) == 1, held  # renewed: still counting
            finally:
                client.close()
                t.join(timeout=30)
            assert result and result[0].status_code == 200
    finally:
        cleanup(redis_url, prefix)
