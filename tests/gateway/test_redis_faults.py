"""Redis outages in the middle of a bounded load, on a PRIVATE redis-server (never the shared one):
stopped (SIGTERM, data kept in its AOF) and restarted; paused (SIGSTOP) and resumed. Every request is
answered, fast; after Redis returns the spool drains and every request has exactly one usage event."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.ledger.event import UsageEvent
from gateway.state.keys import RedisKeys
from gateway.state.write_ahead import WalRecord
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, cleanup, keys_config
from tests.fixtures.redis_stack import PersistentRedis
from tests.fixtures.upstream import SimProcess

PREFIX = "tgfault:"
MAX_REQUESTS = 400
LOAD_SECONDS = 7.0
CONCURRENCY = 4


async def _load(url: str, faults: list[tuple[float, Callable[[], None]]], secrets: list[str],
                cache_control: str = "no-store") -> list[tuple[int, float, str, str, float]]:
    """Bounded load (count and time, ~40 requests/s): (status, latency s, request id, error code, start offset s)
    per request, while ``faults`` run at their offsets (seconds) in a worker thread."""
    results: list[tuple[int, float, str, str, float]] = []
    t0 = time.monotonic()
    stop_at = t0 + LOAD_SECONDS
    sent = 0

    async def worker(w: int) -> None:
        nonlocal sent
        async with httpx.AsyncClient(timeout=15) as http:
            while sent < MAX_REQUESTS and time.monotonic() < stop_at:
                sent += 1
                n = sent
                secret = secrets[n % len(secrets)]
                body = {"model": "short" if n % 3 else "long", "temperature": 0,
                        "messages": [{"role": "user", "content": f"question {n % 7}"}], "stream": n % 2 == 0}
                headers = {"authorization": f"Bearer {secret}", "cache-control": cache_control}
                t = time.monotonic()
                r = await http.post(url + "/chat/completions", json=body, headers=headers)
                body_bytes = r.content
                code = ""
                if r.status_code != 200:
                    code = r.json()["error"]["code"]
                elif b'"error"' in body_bytes and body["stream"]:
                    code = "in-stream-error"
                results.append((r.status_code, time.monotonic() - t, r.headers.get("x-request-id", ""), code,
                                t - t0))
                await asyncio.sleep(0.08)

    async def injector() -> None:
        for at, action in faults:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await asyncio.to_thread(action)

    await asyncio.gather(injector(), *(worker(w) for w in range(CONCURRENCY)))
    return results


def _stream_events(url: str, prefix: str = PREFIX) -> list[UsageEvent]:
    client = redis.Redis.from_url(url)
    try:
        return [UsageEvent.from_json(f[b"e"]) for _, f in client.xrange(prefix + "usage:events")]
    finally:
        client.close()


def _wait_drained(spool: Path, url: str, want: set[str], timeout_s: float = 20.0,
                  prefix: str = PREFIX) -> list[UsageEvent]:
    deadline = time.monotonic() + timeout_s
    events: list[UsageEvent] = []
    while time.monotonic() < deadline:
        events = _stream_events(url, prefix)
        if want <= {e.event_id for e in events} and (not spool.exists() or spool.stat().st_size == 0):
            break
        time.sleep(0.1)
    return events


def _counters(url: str, key_id: str) -> dict[str, int]:
    client = redis.Redis.from_url(url)
    try:
        return {k.decode(): int(v) for k, v in client.hgetall(f"{PREFIX}usage:key:{key_id}").items()}
    finally:
        client.close()


def _settings(tmp: Path, server: PersistentRedis, on_down: str) -> dict[str, Any]:
    return {
        "redis": {"url": server.url, "key_prefix": PREFIX, "start_if_missing": False, "socket_timeout_s": 0.25,
                  "breaker_cooldown_s": 0.5},
        "metering": {"spool_path": str(tmp / "spool.jsonl"), "replay_interval_s": 0.2},
        "limits": {"on_redis_down": on_down},
        "cache": {"single_flight_wait_s": 2.0},
        "auth": keys_config(alice={"budget_usd_day": "100", "rpm": 100_000}),
    }


@pytest.mark.slow
def test_redis_stopped_and_paused_mid_load_nothing_lost(upstream_sim: SimProcess, redis_url: str,
                                                        tmp_path: Path) -> None:
    server = PersistentRedis(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    try:
        with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, PREFIX,
                                **_settings(tmp_path, server, "fail_open")) as gw:
            faults = [(1.0, server.stop), (2.5, server.start), (4.0, server.pause), (5.5, server.resume)]
            results = asyncio.run(_load(gw.base_url, faults, [SECRETS["alice"], SECRETS["bob"]],
                                        cache_control=""))
            statuses = [r[0] for r in results]
            assert len(results) >= 50
            assert statuses.count(200) == len(results), {s for s in statuses}  # every request answered, and ok
            assert not [r[3] for r in results if r[3]]
            assert max(r[1] for r in results) < 5.0  # fail-open within the socket timeout, no hangs
            starts = [r[4] for r in results]
            for lo, hi in ((1.1, 2.4), (4.1, 5.4), (5.6, LOAD_SECONDS)):  # stopped, paused, after: load in each
                assert sum(lo <= t < hi for t in starts) >= 10, (lo, hi)
            ids = {r[2] for r in results}
            assert len(ids) == len(results)
            events = _wait_drained(tmp_path / "spool.jsonl", server.url, ids)
            acct = gw.app.state.accounting
            # the outages really hit the load: the breaker tripped and events went through the spool
            assert acct.breaker.failures >= 2 and acct.meter.spooled > 0
            print(f"\nfault load: {len(results)} requests, {acct.meter.spooled} spooled, "
                  f"{acct.breaker.failures} breaker trips, {acct.breaker.short_circuits} short-circuited calls, "
                  f"max latency {max(r[1] for r in results):.3f} s")
        streamed = [e.event_id for e in events]
        assert set(streamed) == ids  # zero events lost
        assert len(streamed) == len(set(streamed))  # nothing counted twice (replays deduplicated by event_id)
        per_key = {k: sum(1 for e in events if e.key_id == k) for k in ("alice", "bob")}
        for key_id, n in per_key.items():
            c = _counters(server.url, key_id)
            assert c["requests"] == n
            assert c["cost_micro_usd"] == sum(e.cost_micro_usd for e in events if e.key_id == key_id)
        client = redis.Redis.from_url(server.url)
        try:  # every budget reservation was settled (also those made just before the pause)
            assert client.hlen(PREFIX + "lim:alice:resv") == 0
        finally:
            client.close()
    finally:
        server.stop()


@pytest.mark.slow
def test_fail_closed_refuses_limited_keys_while_redis_is_down(upstream_sim: SimProcess, tmp_path: Path) -> None:
    server = PersistentRedis(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    try:
        with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, PREFIX,
                                **_settings(tmp_path, server, "fail_closed")) as gw:
            headers = {"cache-control": "no-store"}
            body = {"model": "short", "messages": [{"role": "user", "content": "closed " + uuid.uuid4().hex}]}

            def ask(who: str) -> httpx.Response:
                return httpx.post(gw.base_url + "/chat/completions", json=body, timeout=15,
                                  headers={**headers, "authorization": f"Bearer {SECRETS[who]}"})

            assert ask("alice").status_code == 200
            server.pause()
            try:
                t0 = time.monotonic()
                refused = ask("alice")
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "limits_unavailable"
                assert int(refused.headers["retry-after"]) >= 1
                assert ask("bob").status_code == 200  # no limits configured: nothing to check
                assert time.monotonic() - t0 < 3.0
            finally:
                server.resume()
            deadline = time.monotonic() + 10
            while ask("alice").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        server.stop()


@pytest.mark.slow
def test_a_hard_budget_holds_across_an_outage_and_its_recovery(upstream_sim: SimProcess, tmp_path: Path) -> None:
    """One gateway, hard mode: during the outage the local counters hold the budget; once Redis answers again, the
    events spooled meanwhile reach Redis before Redis decides an admission. It used to admit on Redis's counters at
    once — without the outage's spend, which waited for the replayer's next pass — and overspent (a new user saw
    1,274 µUSD spent of a 1,000 budget)."""
    from decimal import Decimal

    from gateway.state.limits import estimate
    from tests.fixtures.gateway import create_key, usage_events

    body = {"model": "short", "max_tokens": 16, "messages": [{"role": "user", "content": "budget probe"}]}
    server = PersistentRedis(tmp_path / "redis")
    server.workdir.mkdir()
    server.start()
    settings = _settings(tmp_path, server, "fail_open")
    settings["metering"]["replay_interval_s"] = 30.0  # the replayer's pass comes long after the recovery
    try:
        with accounting_gateway(upstream_sim.base_url, server.url, tmp_path, PREFIX, **settings) as gw:
            names = [t.name for t in gw.settings.tiers]
            one = estimate(body, gw.settings.tiers[names.index("short"):]).micro_usd  # the admission estimate
            probe = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=15,
                               headers={"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"})
            rid = probe.headers["x-request-id"]
            cost = usage_events(gw, [rid])[rid].cost_micro_usd  # what one request really costs
            assert 0 < cost < one
            budget = one + 8 * cost  # hard mode: about nine requests fit
            secret = create_key(server.url, PREFIX, "outage", budget_usd_day=Decimal(budget) / 1_000_000)
            headers = {"authorization": f"Bearer {secret}", "cache-control": "no-store"}

            def until_refused(limit: int = 40) -> list[int]:
                """The statuses up to the first refusal by spend. A 429 "blocked by requests in flight" (retry-after
                1) is asked again, as an SDK would: the previous answer's reservation is settled by the metering
                writer just after that answer, and a quick client may come first (a fresh-clone CI run got
                [200, 429] here, the second refused on the first's reservation alone)."""
                codes = []
                for _ in range(limit):
                    r = httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers, timeout=15)
                    if r.status_code == 429 and "blocked by requests in flight" in r.json()["error"]["message"]:
                        time.sleep(0.2)
                        continue
                    codes.append(r.status_code)
                    if r.status_code == 429:
                        break
                return codes

            first = [httpx.post(gw.base_url + "/chat/completions", json=body, headers=headers,
                                timeout=15).status_code for _ in range(2)]
            assert first == [200, 200]
            server.stop()  # refused connections: nothing reaches Redis meanwhile (a paused one runs what it queued)
            try:
                during = until_refused()  # local counters: admitted until the budget is reached, then 429
            finally:
                server.start()
            assert during.count(200) >= 3 and during[-1] == 429, during
            acct = gw.app.state.accounting
            assert acct.spool.dirty  # the outage's events wait in the spool
            time.sleep(1.0)  # past the breaker's cooldown: the next request is decided by Redis again
            after = until_refused()
            client = redis.Redis.from_url(server.url)
            try:
                deadline = time.monotonic() + 35
                while acct.spool.pending_bytes() and time.monotonic() < deadline:
                    time.sleep(0.1)
                day = time.strftime("%Y-%m-%d", time.gmtime())
                spent = int(client.hget(f"{PREFIX}usage:key:outage:d:{day}", "cost_micro_usd") or 0)
            finally:
                client.close()
            assert spent <= budget, (spent, budget, first, during, after)
            assert after == [429], (first, during, after)
    finally:
        server.stop()


def test_a_key_of_the_wrong_type_loses_no_usage_event_through_the_gateway(upstream_sim: SimProcess, redis_url: str,
                                                                        tmp_path: Path) -> None:
    """Someone SETs a string at alice's all-time counter hash: her requests are still served, their usage events wait
    in the dead-letter spool (``/metrics`` counts them), bob's — in the same writer batches — are counted at once;
    once the key is deleted the retry counts alice's, each once, and settles their reservations and records."""
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    k = RedisKeys(prefix)
    client = redis.Redis.from_url(redis_url)
    client.set(k.key_total("alice"), "not a hash")
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix,
                                metering={"spool_path": str(tmp_path / "spool.jsonl"), "replay_interval_s": 0.2,
                                          "dead_letter_interval_s": 0.3}) as gw:
            acct = gw.app.state.accounting

            async def send() -> list[tuple[str, str]]:
                async with httpx.AsyncClient(timeout=30) as http:
                    async def one(who: str, i: int) -> tuple[str, str]:
                        r = await http.post(gw.base_url + "/chat/completions",
                                            json={"model": "short", "messages": [{"role": "user",
                                                                                  "content": f"count me {i}"}]},
                                            headers={"authorization": f"Bearer {SECRETS[who]}",
                                                     "cache-control": "no-store"})
                        assert r.status_code == 200, r.text
                        return who, r.headers["x-request-id"]
                    return list(await asyncio.gather(*(one(("alice", "bob")[i % 2], i) for i in range(8))))

            sent = asyncio.run(send())
            alice = {rid for who, rid in sent if who == "alice"}
            bob = {rid for who, rid in sent if who == "bob"}
            deadline = time.monotonic() + 10
            while acct.meter.dead_lettered < len(alice) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert acct.meter.dead_lettered == len(alice) == 4
            metrics = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"},
                                timeout=10).text
            assert "thinkgate_usage_dead_lettered_events_total 4.0" in metrics
            assert {e.event_id for e in acct.meter.dead.read_all()} == alice
            events = _stream_events(redis_url, prefix)
            assert bob <= {e.event_id for e in events} and not alice & {e.event_id for e in events}
            assert client.hlen(k.write_ahead) == len(alice)  # their records stay open, undone with the rest
            # each holds its event as final: a restart meanwhile would have the reconciler count the real event
            # (it counted the record's last progress — 0 tokens for these non-streamed calls — as gateway_lost)
            def parked() -> list[WalRecord]:
                return [WalRecord.from_json(raw) for raw in client.hvals(k.write_ahead)]
            deadline = time.monotonic() + 10
            while any(rec.final is None for rec in parked()) and time.monotonic() < deadline:
                time.sleep(0.05)
            finals = {rec.request_id: rec.final for rec in parked()}
            assert set(finals) == alice and all(f is not None and f.completion_tokens > 0 for f in finals.values())

            client.delete(k.key_total("alice"))  # the operator's fix: the next retry counts them
            events = _wait_drained(tmp_path / "spool.dead.jsonl", redis_url, alice | bob, prefix=prefix)
        ids = [e.event_id for e in events]
        assert sorted(ids) == sorted(alice | bob)  # each once
        assert int(client.hget(k.key_total("alice"), "requests") or 0) == len(alice)
        assert client.hlen(k.reservations("alice")) == 0 and client.hlen(k.write_ahead) == 0
    finally:
        cleanup(redis_url, prefix)
        client.close()
