"""Budgets that cannot be blown through, through a real gateway over the upstream simulator and a real Redis:
hard mode over every request shape, tag budgets shared by concurrent keys (hard and soft), the escalation's
own reservation, non-streamed disconnects, audit events of refused requests, key policy and validation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml

from gateway.ledger.event import micro_to_usd
from gateway.state.limits import estimate
from tests.fixtures.gateway import ADMIN_SECRET, accounting_gateway, cleanup, create_key, usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess, hang_up_once_upstream, sim_tiers

REPO = Path(__file__).resolve().parents[2]
ADMIN = {"authorization": f"Bearer {ADMIN_SECRET}"}
PROMPT = [{"role": "user", "content": "spend some budget please"}]


def _tiers(base_url: str, short_max_tokens: int = 64) -> list[dict[str, Any]]:
    tiers = sim_tiers(base_url)
    # short: a thought cut by the tier's max_tokens escalates to long (not one cut by the client's own max_tokens:
    # the next tier would be held to the same bound)
    tiers[1].update({"escalate_on": ["length_in_thought"], "max_tokens": short_max_tokens})
    return tiers


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"tgtest:{uuid.uuid4().hex[:12]}:"


def _gateway(sim: SimProcess, redis_url: str, tmp: Path, prefix: str, mode: str, short_max_tokens: int = 64) -> Any:
    # a 2 s Redis socket timeout (default 0.25 s): 64 concurrent requests on a loaded 2-core box can wait longer
    # than 0.25 s for the event loop, and these tests are about budgets, not about Redis timeouts
    return accounting_gateway(sim.base_url, redis_url, tmp, prefix, tiers=_tiers(sim.base_url, short_max_tokens),
                              limits={"budget_mode": mode, "budget_refresh_s": 0},
                              redis={"socket_timeout_s": 2.0})


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory,
       prefix: str) -> Iterator[GatewayServer]:
    try:
        with _gateway(upstream_sim, redis_url, tmp_path_factory.mktemp("budgw"), prefix, "hard") as g:
            yield g
    finally:
        cleanup(redis_url, prefix)


def _post(gw: GatewayServer, secret: str, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
    headers = {"authorization": f"Bearer {secret}", "cache-control": "no-store"}
    if body.get("stream"):
        with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, headers=headers,
                          timeout=timeout) as r:
            r.read()
            return r
    return httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=timeout)


def _estimate(gw: GatewayServer, body: dict[str, Any], tier: str) -> int:
    """The admission estimate of the first call of ``body`` on ``tier`` (the tier and its fallbacks)."""
    names = [t.name for t in gw.settings.tiers]
    return estimate(body, gw.settings.tiers[names.index(tier):]).micro_usd


def _summary(gw: GatewayServer, kid: str) -> dict[str, Any]:
    return httpx.get(gw.base_url + "/usage", params={"key_id": kid}, headers=ADMIN, timeout=10).json()


def _spend_until_closed(gw: GatewayServer, secrets: list[str], body: dict[str, Any], max_requests: int = 80
                        ) -> tuple[list[str], list[httpx.Response]]:
    """Send ``body`` one at a time (round robin over ``secrets``) until the budget refuses for the rest of the
    period (429 with Retry-After > 1); returns the request ids sent upstream and the refusals."""
    served: list[str] = []
    refused: list[httpx.Response] = []
    for i in range(max_requests):
        r = _post(gw, secrets[i % len(secrets)], {**body, "sim": {"tag": uuid.uuid4().hex}})
        if r.status_code == 200:
            served.append(r.headers["x-request-id"])
            continue
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "budget_exceeded"
        refused.append(r)
        if int(r.headers["retry-after"]) > 1:
            return served, refused
        time.sleep(0.05)  # blocked by a reservation not yet settled: it settles within milliseconds
    pytest.fail(f"the budget never closed after {max_requests} requests")


SHAPES = [
    pytest.param({"model": "long", "max_tokens": 5}, "long", id="long-n1-max5"),
    pytest.param({"model": "long", "n": 4, "max_tokens": 5, "stream": True}, "long", id="long-n4-max5-stream"),
    pytest.param({"model": "long", "n": 8}, "long", id="long-n8-uncapped"),
    pytest.param({"model": "short", "n": 2, "max_tokens": 1_000_000}, "short", id="short-n2-huge-max"),
    # cut by the client's own max_tokens: not escalated, but admitted on the bound that would cover it
    pytest.param({"model": "short", "max_tokens": 4}, "short", id="short-cut-max4"),
    pytest.param({"model": "short", "n": 3, "max_tokens": 4, "stream": True}, "short", id="short-cut-max4-stream"),
    pytest.param({"model": "auto", "stream": True, "stream_options": {"include_usage": True}}, "long",
                 id="auto-stream"),
]


@pytest.mark.parametrize(("shape", "tier"), SHAPES)
def test_hard_mode_no_request_shape_spends_past_the_budget(gw: GatewayServer, redis_url: str, prefix: str,
                                                          shape: dict[str, Any], tier: str) -> None:
    body = {"messages": PROMPT, **shape}
    est = _estimate(gw, body, tier)
    budget = est + est // 10  # one request's bound fits; the real costs (far below it) take it to the edge
    kid = f"shape-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(budget))
    served, refused = _spend_until_closed(gw, [secret], body)
    assert served and refused
    usage_events(gw, served)
    spent = int(_summary(gw, kid)["counters"]["day"]["cost_micro_usd"])
    assert 0 < spent <= budget, (spent, budget)
    last = refused[-1].json()["error"]
    assert "up to $" in last["message"] and "remaining $" in last["message"]


def test_one_request_worth_hundreds_of_budgets_is_refused(gw: GatewayServer, redis_url: str, prefix: str,
                                                          upstream_sim: SimProcess) -> None:
    kid = f"tiny-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(20))
    t = uuid.uuid4().hex
    r = _post(gw, secret, {"model": "long", "n": 8, "messages": PROMPT, "sim": {"tag": t}})
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["code"] == "budget_exceeded" and err["type"] == "rate_limit_error"
    assert f"key {kid!r}: daily budget" in err["message"] and "remaining $0.000020" in err["message"]
    # nothing spent: the budget is not "exhausted", this request is too big for it
    assert f"key {kid!r}: daily budget would be exceeded by this request" in err["message"]
    assert "exhausted" not in err["message"]
    est = _estimate(gw, {"model": "long", "n": 8, "messages": PROMPT}, "long")
    assert f"up to ${micro_to_usd(est)}" in err["message"] and est > 100 * 20
    # waiting cannot let in a request dearer than the whole budget: no Retry-After, and the message says what would
    assert r.headers["x-thinkgate-budget-level"] == "key" and "retry-after" not in r.headers
    assert "more than the whole daily budget: lower max_tokens" in err["message"]
    assert upstream_sim.tag(t) is None  # nothing was sent upstream
    # ... and the SDKs do not retry it (they retry a 429 without Retry-After unless told not to): one call, one try
    assert r.headers["x-should-retry"] == "false"
    sent: list[httpx.Request] = []
    http = httpx.Client(event_hooks={"request": [sent.append]})
    sdk = openai.OpenAI(base_url=gw.base_url, api_key=secret, max_retries=2, timeout=30, http_client=http)
    with pytest.raises(openai.RateLimitError):
        sdk.chat.completions.create(model="long", n=8, messages=PROMPT)  # type: ignore[arg-type]
    assert len(sent) == 1  # max_retries=2, and one request on the wire
    http.close()
    r = _post(gw, secret, {"model": "long", "n": 9, "messages": PROMPT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


async def _burst(gw: GatewayServer, secrets: list[str], per_key: int, body: dict[str, Any]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=len(secrets) * per_key)) as http:
        return await asyncio.gather(*(
            http.post(gw.base_url + "/chat/completions", json=body,
                      headers={"authorization": f"Bearer {s}", "cache-control": "no-store"})
            for s in secrets for _ in range(per_key)))


def _cli(*args: str, prefix: str, redis_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": redis_url,
           "THINKGATE_REDIS__KEY_PREFIX": prefix, "THINKGATE_REDIS__START_IF_MISSING": "false"}
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_64_concurrent_requests_of_4_keys_share_a_tag_budget(upstream_sim: SimProcess, redis_url: str, prefix: str,
                                                             tmp_path: Path, mode: str) -> None:
    team = f"t{uuid.uuid4().hex[:8]}"
    with _gateway(upstream_sim, redis_url, tmp_path, prefix, mode) as g:
        body = {"model": "long", "max_tokens": 5, "messages": PROMPT}
        est = _estimate(g, body, "long")
        budget = est * 5 + est // 2
        r = _cli("budgets", "set", "--tag", f"team={team}", "--usd-day", str(micro_to_usd(budget)), prefix=prefix,
                 redis_url=redis_url)
        assert r.returncode == 0, r.stderr
        kids = [f"{team}-k{i}" for i in range(4)]
        secrets = [create_key(redis_url, prefix, k, tags={"team": team}) for k in kids]  # no key budgets
        responses = asyncio.run(_burst(g, secrets, 16, {**body, "sim": {"delay_ms": 300}}))
        ok = [r for r in responses if r.status_code == 200]
        assert len(ok) + sum(r.status_code == 429 for r in responses) == 64 and ok
        for r in responses:
            if r.status_code == 429:
                assert r.headers["x-thinkgate-budget-level"] == f"tag:team={team}"
                assert f"tag team={team}: daily budget" in r.json()["error"]["message"]
        served, _ = _spend_until_closed(g, secrets, body)
        usage_events(g, [r.headers["x-request-id"] for r in ok] + served)
        time.sleep(0.2)
        view = _summary(g, kids[0])["budgets"]
        tag = next(v for v in view if v["level"] == f"tag:team={team}" and v["period"] == "day")
        spent = round(float(tag["spent_usd"]) * 1_000_000)
        counters = sum(int(_summary(g, k)["counters"]["day"]["cost_micro_usd"]) for k in kids)
        assert spent == counters  # the tag level counts exactly what its keys spent
        assert tag["budget_usd"] == str(micro_to_usd(budget)) and tag["reserved_usd"] == "0.000000"
        if mode == "hard":
            assert spent <= budget, (spent, budget)
        else:  # soft: over by at most one capped request (its estimate bounds its cost)
            assert budget <= spent <= budget + est, (spent, budget, est)


@pytest.fixture(scope="module")
def cutting(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory,
            prefix: str) -> Iterator[GatewayServer]:
    """The same gateway with ``short`` capped at 4 tokens: its thought is cut by the tier, so it escalates."""
    with _gateway(upstream_sim, redis_url, tmp_path_factory.mktemp("budcut"), prefix, "hard", 4) as g:
        yield g


def test_escalation_has_its_own_reservation_while_in_flight(cutting: GatewayServer, upstream_sim: SimProcess,
                                                            redis_url: str, prefix: str) -> None:
    gw = cutting
    kid = f"esc-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(1_000_000))
    t = uuid.uuid4().hex
    body = {"model": "short", "messages": PROMPT, "sim": {"tag": t, "delay_ms": 1200}}
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", _post(gw, secret, body)))
    worker.start()
    client = redis.Redis.from_url(redis_url)
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and worker.is_alive():
            rec = upstream_sim.tag(t)
            if rec is not None and rec["attempts"] == 2 and rec["status"] == "running":
                seen |= {f.decode() for f in client.hkeys(f"{prefix}lim:{kid}:resv")}
            time.sleep(0.05)
    finally:
        worker.join(timeout=30)
        client.close()
    r = result["r"]
    assert r.status_code == 200 and r.headers["x-thinkgate-route-reason"] == "escalated"
    assert r.headers["x-request-id"] in seen  # the escalated call's own reservation, before it was sent


def test_what_remains_of_a_keys_budget_is_one_figure_while_a_request_is_in_flight(
        gw: GatewayServer, upstream_sim: SimProcess, redis_url: str, prefix: str) -> None:
    """``limits.remaining_usd_day`` said budget − spent while ``budgets[]``'s key entry said budget − spent −
    reserved: two different "remaining" in one summary, the first above what admission lets the key spend while a
    request is in flight."""
    kid = f"rem-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(1_000_000))
    t = uuid.uuid4().hex
    worker = threading.Thread(target=_post, args=(gw, secret, {"model": "long", "messages": PROMPT,
                                                               "sim": {"tag": t, "delay_ms": 1500}}))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while (rec := upstream_sim.tag(t)) is None or rec["status"] != "running":
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.05)
        s = _summary(gw, kid)
    finally:
        worker.join(timeout=30)
    day = next(b for b in s["budgets"] if b["level"] == "key" and b["period"] == "day")
    assert Decimal(day["reserved_usd"]) > 0, day  # the request in flight holds its reservation
    assert s["limits"]["remaining_usd_day"] == day["remaining_usd"], (s["limits"], day)
    assert Decimal(day["remaining_usd"]) == Decimal(day["budget_usd"]) - Decimal(day["spent_usd"]) - Decimal(
        day["reserved_usd"])


def test_refused_escalation_returns_the_first_answer_saying_why(cutting: GatewayServer, redis_url: str,
                                                                prefix: str) -> None:
    gw = cutting
    body = {"model": "short", "messages": PROMPT}
    est = _estimate(gw, body, "short")
    kid = f"noesc-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(est + est // 2))
    r = _post(gw, secret, body)
    assert r.status_code == 200
    assert r.headers["x-thinkgate-tier"] == "short" and r.headers["x-thinkgate-route-reason"] == "forced"
    assert r.headers["x-thinkgate-escalation"] == "skipped; tier=long; reason=budget_exceeded"
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_refused_escalations_first_answer_is_not_cached(cutting: GatewayServer, redis_url: str,
                                                          prefix: str) -> None:
    # the answer the tier's escalate_on judged too weak (cut in its thought) was stored and replayed to the same
    # request later, which then never escalated, whatever the budget by then
    gw = cutting
    body = {"model": "short", "messages": [{"role": "user", "content": f"cacheable {uuid.uuid4().hex}"}],
            "temperature": 0}
    est = _estimate(gw, body, "short")
    kid = f"nocache-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(est + est // 2))
    headers = {"authorization": f"Bearer {secret}"}  # the cache allowed (no no-store)
    first = httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
    assert first.status_code == 200, first.text
    assert first.headers["x-thinkgate-escalation"] == "skipped; tier=long; reason=budget_exceeded"
    again = httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
    assert again.status_code == 200, again.text
    assert again.headers["x-thinkgate-cache"] != "hit"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_non_streamed_disconnect_cancels_upstream_and_meters_partial(gw: GatewayServer, upstream_sim: SimProcess,
                                                                     redis_url: str, prefix: str, api: str) -> None:
    kid = f"gone-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(1_000_000))
    t = uuid.uuid4().hex
    sim = {"tag": t, "delay_ms": 4000}
    headers = {"authorization": f"Bearer {secret}"}
    if api == "chat":  # as _post sends it
        path, body = "/chat/completions", {"model": "long", "messages": PROMPT, "sim": sim}
        headers["cache-control"] = "no-store"
    else:
        path, body = "/responses", {"model": "long", "input": "spend", "sim": sim}
    hang_up_once_upstream(gw, path, body, headers, upstream_sim, t, after_s=0.8)
    rec = upstream_sim.wait_tag_status(t, {"cancelled", "completed"}, timeout_s=10)
    assert rec is not None and rec["status"] == "cancelled", rec
    deadline = time.monotonic() + 10
    mine: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not mine:
        rows = httpx.get(gw.base_url + "/usage", params={"key_id": kid, "since": "0"}, headers=ADMIN,
                         timeout=10).json()["data"]
        mine = [row for row in rows if row["key_id"] == kid]
        time.sleep(0.05)
    assert len(mine) == 1
    assert mine[0]["status"] == 499 and mine[0]["partial"] is True and mine[0]["error_code"] == "client_disconnected"
    # the upstream had the prompt and worked on it for 0.8 s: billed (it was $0 — hang up, compute for free)
    assert mine[0]["usage_source"] == "counted" and mine[0]["prompt_tokens"] > 0 and int(mine[0]["cost_micro_usd"]) > 0
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.hlen(f"{prefix}lim:{kid}:resv") == 0  # settled, not left to expire
    finally:
        client.close()


def test_refused_requests_are_audit_events_in_the_export_not_spend(gw: GatewayServer, redis_url: str, prefix: str,
                                                                   upstream_sim: SimProcess) -> None:
    kid = f"aud-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(10), allowed_tiers=["none", "short"])
    refused = {
        400: _post(gw, secret, {"model": "short", "n": 0, "messages": PROMPT}),
        403: _post(gw, secret, {"model": "long", "messages": PROMPT}),
        429: _post(gw, secret, {"model": "short", "n": 8, "messages": PROMPT}),
        401: _post(gw, "tg-not-a-key", {"model": "short", "messages": PROMPT}),
    }
    for status, r in refused.items():
        assert r.status_code == status, r.text
    ids = {status: r.headers["x-request-id"] for status, r in refused.items()}
    since = datetime.now(UTC).strftime("%Y-%m-%d")
    deadline = time.monotonic() + 10
    rows: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        out = _cli("usage", "export", "--format", "jsonl", "--since", since, prefix=prefix, redis_url=redis_url)
        assert out.returncode == 0, out.stderr
        rows = {row["request_id"]: row for row in map(json.loads, out.stdout.splitlines())}
        if all(i in rows for i in ids.values()):
            break
        time.sleep(0.2)
    for status, rid in ids.items():
        row = rows[rid]
        assert row["audit"] is True and row["status"] == status and row["cost_micro_usd"] == 0
        assert row["key_id"] == (kid if status != 401 else "")
    assert rows[ids[400]]["error_code"] == "invalid_request"
    assert rows[ids[403]]["error_code"] == "tier_not_allowed" and rows[ids[403]]["tier"] == "long"
    assert rows[ids[429]]["error_code"] == "budget_exceeded" and rows[ids[429]]["tier"] == "short"
    # not spend: no counter moved, grouped exports count them apart
    assert _summary(gw, kid)["counters"]["day"]["requests"] == 0
    grouped = _cli("usage", "export", "--format", "jsonl", "--group-by", "key", "--since", since, prefix=prefix,
                   redis_url=redis_url)
    row = next(r for r in map(json.loads, grouped.stdout.splitlines()) if r["key"] == kid)
    assert row["requests"] == 0 and row["cost_micro_usd"] == 0 and row["refused"] == 3
    metrics = httpx.get(gw.url + "/metrics", headers=ADMIN, timeout=10).text
    assert 'thinkgate_refused_requests_total{code="tier_not_allowed",status="403"}' in metrics


def test_unauthenticated_refusals_are_bounded_in_redis(gw: GatewayServer, redis_url: str, prefix: str) -> None:
    """Anyone can send requests without a key; each 401 wrote an audit event and a 40-day dedup entry (~810 bytes)
    — a way to fill Redis without a key (a security review). Past a token bucket (20/s, bursts of 100) they are
    counted, not written. A valid key's refusal keeps its audit event, its client-chosen model string cut to 256."""
    from gateway.pipeline.accounting import ANON_AUDIT_BURST, ANON_AUDIT_PER_S

    client = redis.Redis.from_url(redis_url)
    try:
        def anon_audits() -> int:
            n = 0
            for _, f in client.xrange(prefix + "usage:events"):
                ev = json.loads(f[b"e"])
                n += ev.get("audit") is True and ev.get("key_id") == ""
            return n

        before = anon_audits()
        t0 = time.monotonic()
        with httpx.Client(timeout=10) as http:
            for _ in range(300):
                r = http.post(gw.base_url + "/chat/completions", json={"model": "short", "messages": PROMPT},
                              headers={"authorization": "Bearer tg-not-a-key"})
                assert r.status_code == 401
        elapsed = time.monotonic() - t0
        time.sleep(1.0)  # the metering writer's last batch
        written = anon_audits() - before
        assert 1 <= written <= ANON_AUDIT_BURST + ANON_AUDIT_PER_S * (elapsed + 1.0) + 1, (written, elapsed)
        assert written < 300
    finally:
        client.close()
    kid = f"long-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, prefix, kid)
    r = _post(gw, secret, {"model": "m" * 50_000, "messages": PROMPT})
    assert r.status_code == 404, r.text
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while not rows and time.monotonic() < deadline:
        rows = [row for row in httpx.get(gw.base_url + "/usage", params={"key_id": kid, "since": "0"}, headers=ADMIN,
                                         timeout=10).json()["data"] if row["key_id"] == kid]
        time.sleep(0.05)
    assert rows and rows[0]["audit"] is True and len(rows[0]["requested_model"]) == 256


def test_key_policy_allowed_tiers_downgrade_and_thinking_cap(gw: GatewayServer, upstream_sim: SimProcess,
                                                             redis_url: str, prefix: str) -> None:
    n = uuid.uuid4().hex[:8]
    strict = create_key(redis_url, prefix, f"strict-{n}", allowed_tiers=["none", "short"])
    r = _post(gw, strict, {"model": "long", "messages": PROMPT})
    assert r.status_code == 403
    # /v1/models lists what the key may ask for (as LiteLLM lists a key's models); retrieve agrees
    listed = httpx.get(gw.base_url + "/models", headers={"authorization": f"Bearer {strict}"}, timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["auto", "none", "short"]
    got = httpx.get(gw.base_url + "/models/long", headers={"authorization": f"Bearer {strict}"}, timeout=10)
    assert got.status_code == 404 and got.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["code"] == "tier_not_allowed" and "['none', 'short']" in r.json()["error"]["message"]
    down = create_key(redis_url, prefix, f"down-{n}", allowed_tiers=["none", "short"], on_disallowed_tier="downgrade")
    t = uuid.uuid4().hex
    r = _post(gw, down, {"model": "long", "messages": PROMPT, "sim": {"tag": t}})
    assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
    listed = httpx.get(gw.base_url + "/models", headers={"authorization": f"Bearer {down}"}, timeout=10).json()
    assert "long" in [m["id"] for m in listed["data"]]  # a downgrading key is answered on every tier it names
    assert r.headers["x-thinkgate-downgraded-from"] == "long"
    capped = create_key(redis_url, prefix, f"cap-{n}", max_thinking_budget=3)
    for asked, sent in ((None, 3), (100, 3), (2, 2)):
        t = uuid.uuid4().hex
        extra = {} if asked is None else {"thinking_token_budget": asked}
        r = _post(gw, capped, {"model": "long", "messages": PROMPT, "sim": {"tag": t}, **extra})
        assert r.status_code == 200
        assert upstream_sim.tag(t)["body"]["thinking_token_budget"] == sent  # type: ignore[index]
        assert r.headers["x-thinkgate-thinking-budget"] == str(sent)  # what was served, after the key's cap
    refuse = create_key(redis_url, prefix, f"refuse-{n}", max_thinking_budget=3, over_cap="refuse")
    r = _post(gw, refuse, {"model": "long", "messages": PROMPT, "thinking_token_budget": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    r = _post(gw, refuse, {"model": "short", "messages": PROMPT, "max_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(("patch", "param"), [
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"n": 2.5}, "n"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": 1.5}, "thinking_token_budget"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content"),
    ({"top_logprobs": 99}, "top_logprobs"),
])
def test_invalid_requests_never_reach_an_upstream(gw: GatewayServer, upstream_sim: SimProcess, redis_url: str,
                                                  prefix: str, patch: dict[str, Any], param: str) -> None:
    secret = create_key(redis_url, prefix, f"val-{uuid.uuid4().hex[:8]}")
    t = uuid.uuid4().hex
    r = _post(gw, secret, {"model": "short", "messages": PROMPT, "sim": {"tag": t}, **patch})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert upstream_sim.tag(t) is None


def test_budgets_cli_set_list_remove(redis_url: str, prefix: str, tmp_path: Path) -> None:
    team = f"t{uuid.uuid4().hex[:8]}"
    assert _cli("budgets", "set", "--tag", f"team={team}", "--usd-day", "50", prefix=prefix,
                redis_url=redis_url).returncode == 0
    assert _cli("budgets", "set", "--global", "--usd-month", "1000.5", prefix=prefix,
                redis_url=redis_url).returncode == 0
    listed = _cli("budgets", "list", "--json", prefix=prefix, redis_url=redis_url)
    rows = {r["level"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert rows[f"tag:team={team}"]["usd_day"] == "50.000000" and rows[f"tag:team={team}"]["usd_month"] is None
    assert rows["global"]["usd_month"] == "1000.500000" and rows["global"]["source"] == "redis"
    assert _cli("budgets", "remove", "--global", prefix=prefix, redis_url=redis_url).returncode == 0
    assert _cli("budgets", "remove", "--global", prefix=prefix, redis_url=redis_url).returncode == 1
    assert _cli("budgets", "set", "--tag", "nope", "--usd-day", "1", prefix=prefix, redis_url=redis_url).returncode == 2
    assert _cli("budgets", "set", "--global", prefix=prefix, redis_url=redis_url).returncode == 2
    assert _cli("keys", "create", "--id", f"k{team}", "--allowed-tier", "lng", prefix=prefix,
                redis_url=redis_url).returncode == 2  # a typo'd tier would lock the key out of every tier
    # the config's levels are listed too
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"limits": {"tag_budgets": {"team=cfg": {"usd_month": "7"}}}}))
    listed = _cli("budgets", "list", "--json", "--config", str(cfg), prefix=prefix, redis_url=redis_url)
    rows = {r["level"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert rows["tag:team=cfg"]["source"] == "config" and "global" not in rows
    # removing a level whose budget is in the config says where it is (it said only "no budget set")
    out = _cli("budgets", "remove", "--tag", "team=cfg", "--config", str(cfg), prefix=prefix, redis_url=redis_url)
    assert out.returncode == 1 and "in the config (limits.tag_budgets['team=cfg'])" in out.stderr
    # a budget finer than a micro-USD would be rounded (to $0 here: every request refused): refused up front
    for cmd in (("budgets", "set", "--global", "--usd-day", "0.0000001"),
                ("keys", "create", "--id", f"m{team}", "--budget-usd-day", "1e-7"),
                ("keys", "create", "--id", f"m{team}", "--budget-usd-month", "0.0000015")):
        out = _cli(*cmd, prefix=prefix, redis_url=redis_url)
        assert out.returncode == 2 and "more than 6 decimal places" in out.stderr, out.stderr
    # not a number, or not finite: a one-line error (NaN raised InvalidOperation: a traceback, exit 1)
    for cmd in (("budgets", "set", "--tag", "team=a", "--usd-day", "NaN"),
                ("keys", "create", "--id", f"n{team}", "--budget-usd-day", "nan"),
                ("keys", "create", "--id", f"n{team}", "--budget-usd-month", "snan"),
                ("budgets", "set", "--global", "--usd-month", "inf")):
        out = _cli(*cmd, prefix=prefix, redis_url=redis_url)
        assert out.returncode == 2 and "must be a finite amount >= 0" in out.stderr, out.stderr
    for cmd in (("keys", "create", "--id", f"h{team}", "--budget-usd-day", "1e400"),
                ("budgets", "set", "--tag", "team=q", "--usd-month", "1E+30")):  # InvalidOperation in quantize()
        out = _cli(*cmd, prefix=prefix, redis_url=redis_url)
        assert out.returncode == 2 and "above the largest budget" in out.stderr, out.stderr
    assert _cli("keys", "create", "--id", f"m{team}", "--budget-usd-day", "1e-6", prefix=prefix,
                redis_url=redis_url).returncode == 0
    # an id the gateway or the config already uses: refused (the new key read the other's usage, cached answers,
    # stored responses and feedback — a security review's finding)
    for kid in ("admin", "dev", "anonymous", "_shadow"):
        out = _cli("keys", "create", "--id", kid, prefix=prefix, redis_url=redis_url)
        assert out.returncode == 2 and "reserved" in out.stderr, (kid, out.stderr)
    conf = tmp_path / "keys.yaml"
    conf.write_text(yaml.safe_dump({"auth": {"keys": [{"id": "team-b", "secret": "tg-team-b-secret-0000000000"}]}}))
    out = _cli("keys", "create", "--id", "team-b", "--config", str(conf), prefix=prefix, redis_url=redis_url)
    assert out.returncode == 2 and "a key of the config file" in out.stderr, out.stderr


def test_keys_update_changes_a_live_keys_limits_in_place(gw: GatewayServer, redis_url: str, prefix: str,
                                                         tmp_path: Path) -> None:
    """An operator raises a key's RPM, sets a budget and retags it without a new secret or id (they had to revoke
    and re-create, splitting the key's usage across two ids); running gateways apply it within key_cache_s."""
    kid = f"upd-{uuid.uuid4().hex[:8]}"
    made = _cli("keys", "create", "--id", kid, "--rpm", "1", prefix=prefix, redis_url=redis_url)
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    body = {"model": "short", "messages": PROMPT}
    assert _post(gw, secret, body).headers["x-ratelimit-limit-requests"] == "1"
    up = _cli("keys", "update", "--id", kid, "--rpm", "50", "--budget-usd-day", "1.5", "--tag", "team=q",
              prefix=prefix, redis_url=redis_url)
    assert up.returncode == 0 and '"rpm":50' in up.stderr, up.stderr

    def served_limit() -> str | None:
        deadline = time.monotonic() + 8  # auth.key_cache_s (5 s) and a margin
        while True:
            r = _post(gw, secret, body)  # the same secret throughout
            if r.status_code == 200 and (r.headers.get("x-ratelimit-limit-requests") != "1" or
                                         time.monotonic() > deadline):
                return r.headers.get("x-ratelimit-limit-requests")
            assert time.monotonic() < deadline, r.text
            time.sleep(0.25)

    assert served_limit() == "50"
    rec = next(json.loads(x) for x in _cli("keys", "list", "--json", prefix=prefix,
                                           redis_url=redis_url).stdout.splitlines() if json.loads(x)["id"] == kid)
    assert (rec["rpm"], rec["budget_usd_day"], rec["tags"]) == (50, "1.5", {"team": "q"})
    assert _cli("keys", "update", "--id", kid, "--unset", "rpm", prefix=prefix, redis_url=redis_url).returncode == 0
    # /v1/usage shows the key as it is now, before any request of it reached this gateway again (it showed the
    # limits of the last request this process had seen)
    limits = _summary(gw, kid)["limits"]
    assert limits["rpm"] is None and limits["budget_usd_day"] == "1.500000", limits
    deadline = time.monotonic() + 8
    while "x-ratelimit-limit-requests" in _post(gw, secret, body).headers:
        assert time.monotonic() < deadline
        time.sleep(0.25)
    for args, code in ((("--id", "nope-" + kid, "--rpm", "2"), 1), (("--id", kid), 2),
                       (("--id", kid, "--unset", "secret_sha256"), 2),
                       (("--id", kid, "--rpm", "2", "--unset", "rpm"), 2),
                       (("--id", kid, "--budget-usd-day", "1e-9"), 2)):
        assert _cli("keys", "update", *args, prefix=prefix, redis_url=redis_url).returncode == code, args
    cfg = tmp_path / "c.yaml"  # a key of the config file is changed there: the message says so
    cfg.write_text(yaml.safe_dump({"auth": {"keys": [{"id": "from-config", "secret": "tg-from-config-secret"}]}}))
    out = _cli("keys", "update", "--id", "from-config", "--rpm", "2", "--config", str(cfg), prefix=prefix,
               redis_url=redis_url)
    assert out.returncode == 1 and "a key of the config file" in out.stderr, out.stderr
    assert _cli("keys", "revoke", kid, prefix=prefix, redis_url=redis_url).returncode == 0
    out = _cli("keys", "update", "--id", kid, "--rpm", "2", prefix=prefix, redis_url=redis_url)
    assert out.returncode == 1 and "revoked" in out.stderr  # a revoked key is not brought back


@contextlib.contextmanager
def _alerting(sim: SimProcess, redis_url: str, prefix: str, tmp: Path, fractions: list[float], tag_key: str
              ) -> Iterator[tuple[GatewayServer, str, str, list[dict[str, Any]]]]:
    """A gateway whose budget alerts go to a loopback webhook (204 to every POST), with a new key tagged with a new
    team: yields (gateway, team, key secret, the alert bodies received — complete once the block has ended)."""
    import http.server

    received: list[dict[str, Any]] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    team = f"t{uuid.uuid4().hex[:8]}"
    limits = {"budget_refresh_s": 0, "alert_fractions": fractions,
              "alert_webhook_url": f"http://127.0.0.1:{server.server_port}/h"}
    try:
        with accounting_gateway(sim.base_url, redis_url, tmp, prefix, tiers=_tiers(sim.base_url), limits=limits) as g:
            secret = create_key(redis_url, prefix, f"{team}-{tag_key}", tags={"team": team})  # no key budget
            yield g, team, secret, received
            deadline = time.monotonic() + 5
            while len(received) < len(fractions) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
    finally:
        server.shutdown()
        server.server_close()


def test_alerts_fire_per_level(upstream_sim: SimProcess, redis_url: str, prefix: str, tmp_path: Path) -> None:
    body = {"model": "long", "max_tokens": 5, "messages": PROMPT}
    with _alerting(upstream_sim, redis_url, prefix, tmp_path, [0.5], "alert") as (g, team, secret, received):
        r = _post(g, secret, body)
        assert r.status_code == 200
        cost = usage_events(g, [r.headers["x-request-id"]])[r.headers["x-request-id"]].cost_micro_usd
        # a tag budget the next request takes past 50 %, and enough room left for its estimate
        budget = _estimate(g, body, "long") * 4
        assert _cli("budgets", "set", "--tag", f"team={team}", "--usd-day", str(micro_to_usd(budget)),
                    prefix=prefix, redis_url=redis_url).returncode == 0
        spent = cost
        while spent < budget // 2:
            r = _post(g, secret, body)
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            spent += usage_events(g, [rid])[rid].cost_micro_usd
    assert [(a["level"], a["period"], a["fraction"]) for a in received] == [(f"tag:team={team}", "day", 0.5)]
    assert received[0]["key_id"] == f"{team}-alert" and received[0]["budget_usd"] == str(micro_to_usd(budget))


def test_a_budget_lowered_below_the_spend_alerts_on_the_first_refusal(upstream_sim: SimProcess, redis_url: str,
                                                                      prefix: str, tmp_path: Path) -> None:
    """An operator lowers a tag's budget below what the tag has spent today: every request is refused, none is
    metered, and the alerts were checked only after a metered request — so the 100% alert never fired. It fires on
    the first refusal now, once (a burst of refusals fires nothing more)."""
    body = {"model": "long", "max_tokens": 5, "messages": PROMPT}
    with _alerting(upstream_sim, redis_url, prefix, tmp_path, [0.5, 1.0], "low") as (g, team, secret, received):
        spent = 0
        for _ in range(3):  # spend under no budget
            r = _post(g, secret, body)
            assert r.status_code == 200, r.text
            spent += usage_events(g, [r.headers["x-request-id"]])[r.headers["x-request-id"]].cost_micro_usd
        low = max(1, spent // 2)
        assert _cli("budgets", "set", "--tag", f"team={team}", "--usd-day", str(micro_to_usd(low)),
                    prefix=prefix, redis_url=redis_url).returncode == 0
        for _ in range(4):
            r = _post(g, secret, body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
    assert sorted((a["level"], a["period"], a["fraction"]) for a in received) == [
        (f"tag:team={team}", "day", 0.5), (f"tag:team={team}", "day", 1.0)]
    assert {a["budget_usd"] for a in received} == {str(micro_to_usd(low))}
    assert {a["spent_usd"] for a in received} == {str(micro_to_usd(spent))}


def test_agent_apis_audit_their_refusals_too(gw: GatewayServer, redis_url: str, prefix: str) -> None:
    secret = create_key(redis_url, prefix, f"agent-{uuid.uuid4().hex[:8]}")
    refused = {
        "messages": httpx.post(gw.base_url + "/messages", headers={"x-api-key": "tg-not-a-key"}, timeout=10,
                               json={"model": "short", "max_tokens": 16, "messages": PROMPT}),
        "responses": httpx.post(gw.base_url + "/responses", headers={"authorization": f"Bearer {secret}"},
                                content=b"{not json", timeout=10),
    }
    assert refused["messages"].status_code == 401 and refused["responses"].status_code == 400
    ids = {api: r.headers["x-request-id"] for api, r in refused.items()}
    deadline = time.monotonic() + 10
    rows: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline and not all(i in rows for i in ids.values()):
        data = httpx.get(gw.base_url + "/usage", params={"since": "0", "limit": "10000"}, headers=ADMIN,
                         timeout=10).json()["data"]
        rows = {row["request_id"]: row for row in data}
        time.sleep(0.05)
    for api, rid in ids.items():
        assert rows[rid]["audit"] is True and rows[rid]["endpoint"] == api and rows[rid]["cost_micro_usd"] == 0
    assert rows[ids["messages"]]["status"] == 401 and rows[ids["responses"]]["error_code"] == "invalid_json"
