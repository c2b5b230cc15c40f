"""Three real gateway processes (``thinkgate serve``) behind a real HAProxy on loopback, sharing one Redis key
prefix: a cached answer from one replica is a hit through another, a key budget created once holds across all
three under a concurrent burst, a per-key rate limit is one limit for the fleet, the routing controller's
threshold is one threshold, and stopping a replica under load leaves the others serving through HAProxy
(health checks on ``/ready``) with a usage record for every completed request. A Redis outage (fail-open, the
default) leaves every replica in HAProxy's backend, serving, and the usage of what they served meanwhile lands in
Redis once it is back."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.config import TierConfig
from gateway.state.limits import estimate
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, cleanup, create_key, keys_config
from tests.fixtures.haproxy import HAPROXY, Fleet
from tests.fixtures.redis_stack import persistent_redis
from tests.fixtures.upstream import SimProcess, sim_tiers

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install -y haproxy)")

# the upstream holds each answer 3 s: the whole burst is admitted or refused while the first one is in flight
# (once it settles at its real cost, far below the estimate, the budget has room for another)
BUDGET_BODY = {"model": "short", "messages": [{"role": "user", "content": "fleet budget race"}],
               "sim": {"delay_ms": 3000}}
ROUTING = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5], "default_tier": "long",
           "target": {"long_share": 0.2, "window": 200, "min_samples": 10, "max_step": 0.25, "update_every": 8,
                      "interval_s": 0.1}}


@pytest.fixture(scope="module")
def fleet(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    config = {
        "engine": {"enabled": False},
        "redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False},
        "metering": {"replay_interval_s": 0.2},
        "tiers": [{**t, "prices": {k: str(v) for k, v in t["prices"].items()}}
                  for t in sim_tiers(upstream_sim.base_url)],
        "routing": ROUTING,
        "auth": keys_config(),
    }
    fl = Fleet(3, tmp, config)
    fl.prefix = prefix  # type: ignore[attr-defined]
    try:
        yield fl
    finally:
        fl.stop()
        cleanup(redis_url, prefix)


def headers(secret: str, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}", **extra}


def usage_ids(fleet: Fleet, key_id: str) -> set[str]:
    r = httpx.get(fleet.base_url + "/usage", params={"since": "0", "limit": "10000", "key_id": key_id},
                  headers=headers(ADMIN_SECRET), timeout=10)
    r.raise_for_status()
    return {row["request_id"] for row in r.json()["data"]}


def test_a_cached_answer_from_one_replica_is_a_hit_through_another(fleet: Fleet, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    body = {"model": "short", "temperature": 0, "messages": [{"role": "user", "content": "fleet cache " + tag}],
            "sim": {"tag": tag}}
    seen = []
    with httpx.Client(timeout=30) as c:
        for _ in range(3):  # round robin: three requests, three replicas
            r = c.post(fleet.base_url + "/chat/completions", json=body, headers=headers(SECRETS["bob"]))
            assert r.status_code == 200
            seen.append((r.headers["x-served-by"], r.headers["x-thinkgate-cache"]))
    assert len({s for s, _ in seen}) == 3, seen
    assert [c for _, c in seen] == ["miss", "hit", "hit"], seen
    rec = upstream_sim.tag(tag)
    assert rec is not None and rec["attempts"] == 1


# settle_s 0: the burst right after the key is created (admission reads the budget in Redis, so it is in force
# on every replica at once); 5 s later as well.
@pytest.mark.parametrize("settle_s", [pytest.param(0.0, id="at-once"),
                                      pytest.param(5.0, id="after-5s")])
def test_a_key_budget_set_once_holds_across_the_fleet(fleet: Fleet, upstream_sim: SimProcess, redis_url: str,
                                                      settle_s: float) -> None:
    # one request's admission estimate fits the budget, two do not; created once in the shared key store
    one = estimate(BUDGET_BODY, [TierConfig(**t) for t in sim_tiers(upstream_sim.base_url)[1:]]).micro_usd
    kid = f"burst-{uuid.uuid4().hex[:6]}"
    secret = create_key(redis_url, fleet.prefix, kid,  # type: ignore[attr-defined]
                        budget_usd_day=Decimal(one * 3 // 2) / 1_000_000)
    time.sleep(settle_s)  # > auth.key_cache_s and limits.budget_refresh_s

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*(http.post(fleet.base_url + "/chat/completions", json=BUDGET_BODY,
                                                    headers=headers(secret, **{"cache-control": "no-store"}))
                                          for _ in range(30)))

    responses = asyncio.run(burst())
    assert len({r.headers.get("x-served-by") for r in responses}) == 3  # the burst reached every replica
    codes = [r.status_code for r in responses]
    assert codes.count(200) == 1 and codes.count(429) == 29, codes
    assert all(r.json()["error"]["code"] == "budget_exceeded" for r in responses if r.status_code == 429)


def test_a_rate_limit_is_one_limit_for_the_fleet(fleet: Fleet, redis_url: str) -> None:
    kid = f"rpm-{uuid.uuid4().hex[:6]}"
    secret = create_key(redis_url, fleet.prefix, kid, rpm=5)  # type: ignore[attr-defined]
    codes, served = [], set()
    with httpx.Client(timeout=30) as c:
        for i in range(12):
            r = c.post(fleet.base_url + "/chat/completions", headers=headers(secret), json={
                "model": "none", "messages": [{"role": "user", "content": f"rpm {i}"}]})
            codes.append(r.status_code)
            served.add(r.headers.get("x-served-by"))
    assert len(served) == 3
    assert codes.count(200) == 5 and codes.count(429) == 7, codes  # per replica it would be 5 each: 12 pass


def _threshold(replica: str) -> float | None:
    text = httpx.get(replica + "/metrics", headers=headers(ADMIN_SECRET), timeout=10).text
    m = re.search(r'^thinkgate_routing_threshold\{tier="long"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def test_the_routing_controller_is_shared(fleet: Fleet, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    state_key = f"{fleet.prefix}rt:state"  # type: ignore[attr-defined]
    held: set[str | None] = set()  # the shared threshold as the requests go
    with httpx.Client(timeout=30) as c:
        for i in range(72):  # short prompts: scored under 0.5, so the 20 % long target pulls the cut down
            resp = c.post(fleet.base_url + "/chat/completions", headers=headers(SECRETS["alice"]), json={
                "model": "auto", "max_tokens": 4,
                "messages": [{"role": "user", "content": "q" * (20 + (i * 37) % 380)}]})
            assert resp.status_code == 200, resp.text
            held.add(r.hget(state_key, "thr"))

    # Where the threshold ends depends on when each replica pushed its decisions (the feedback term reacts to the
    # realized share of the moment), so the test checks what is shared, not one trajectory: all 72 decisions of
    # the three replicas sit in one window, the threshold moved off its start (at some point: with steps of
    # max_step = 0.25 it can come back to exactly 0.5 — a fast box ended there), and every replica serves the one
    # threshold the shared state holds.
    def agreed() -> bool:
        cuts = [_threshold(u) for u in fleet.replicas]
        st = r.hgetall(state_key)
        moved = cuts[0] != 0.5 or any(t is not None and float(t) != 0.5 for t in held)
        return (st.get("n") == "72" and cuts[0] is not None and abs(cuts[0] - float(st["thr"])) < 1e-9
                and moved and len(set(cuts)) == 1)

    deadline = time.monotonic() + 30
    while not agreed() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agreed(), ([_threshold(u) for u in fleet.replicas], r.hgetall(state_key))


def test_stopping_a_replica_under_load_keeps_serving_and_loses_no_usage(fleet: Fleet) -> None:
    results: list[tuple[float, int, str | None, str | None]] = []  # (time, status, request id, served by)
    lock = threading.Lock()
    stop = threading.Event()
    victim = 1

    def client(n: int) -> None:
        with httpx.Client(timeout=30) as c:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    r = c.post(fleet.base_url + "/chat/completions",
                               headers=headers(SECRETS["bob"], **{"cache-control": "no-store"}),
                               json={"model": "none", "messages": [{"role": "user", "content": f"load {n} {i}"}],
                                     "sim": {"delay_ms": 50}})
                    row = (time.monotonic(), r.status_code, r.headers.get("x-request-id"),
                           r.headers.get("x-served-by"))
                except httpx.HTTPError:
                    row = (time.monotonic(), 0, None, None)
                with lock:
                    results.append(row)

    before = usage_ids(fleet, "bob")
    threads = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    def until(done: Any, timeout_s: float = 60.0) -> None:  # wait on progress, not on the clock (loaded box)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with lock:
                if done():
                    return
            time.sleep(0.05)

    try:
        until(lambda: {r[3] for r in results} >= {"gw0", "gw1", "gw2"} and len(results) >= 30)
        killed_at = time.monotonic()
        fleet.kill(victim)  # SIGTERM, as Kubernetes stops a pod: in-flight requests finish, metering drains
        gone_at = time.monotonic()  # the process has exited
        fleet.wait_up({0, 2})
        until(lambda: sum(1 for r in results if r[0] > gone_at) >= 40)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    try:
        after_kill = [r for r in results if r[0] > gone_at]
        assert len(after_kill) >= 20 and all(r[1] == 200 for r in after_kill), \
            [r for r in after_kill if r[1] != 200][:5]
        assert {r[3] for r in after_kill} == {"gw0", "gw2"}
        assert {r[3] for r in results if r[0] < killed_at} == {"gw0", "gw1", "gw2"}
        failed = [r for r in results if r[1] != 200]
        assert len(failed) <= 6, failed  # at most the requests in flight at the stop (HAProxy retries the rest)
        completed = {r[2] for r in results if r[1] == 200}
        assert None not in completed
        deadline = time.monotonic() + 15
        missing = completed - (usage_ids(fleet, "bob") - before)
        while missing and time.monotonic() < deadline:
            time.sleep(0.2)
            missing = completed - (usage_ids(fleet, "bob") - before)
        assert not missing, f"{len(missing)} of {len(completed)} completed requests have no usage record"
    finally:
        fleet.restart(victim)
        fleet.wait_up({0, 1, 2})


def test_a_redis_outage_keeps_every_replica_serving_and_loses_no_usage(upstream_sim: SimProcess,
                                                                      tmp_path: Path) -> None:
    """Redis is shared by every replica: were ``/ready`` to fail on it, HAProxy would take all of them out at once
    and answer 503 itself — the fail-open the operator chose turned into a full outage. With ``/ready`` 200
    (``degraded``) while Redis is gone, every replica stays UP and answers; their usage, spooled meanwhile, is
    replayed into Redis when it returns."""
    (tmp_path / "redis").mkdir()
    with persistent_redis(tmp_path / "redis") as server:
        config = {
            "engine": {"enabled": False},
            "redis": {"url": server.url, "start_if_missing": False, "breaker_cooldown_s": 0.5},
            "metering": {"replay_interval_s": 0.2},
            "tiers": [{**t, "prices": {k: str(v) for k, v in t["prices"].items()}}
                      for t in sim_tiers(upstream_sim.base_url)],
            "auth": keys_config(),
        }
        fl = Fleet(2, tmp_path, config)
        try:
            def ask(i: int) -> httpx.Response:
                return httpx.post(fl.base_url + "/chat/completions", timeout=30,
                                  headers=headers(SECRETS["bob"], **{"cache-control": "no-store"}),
                                  json={"model": "short", "messages": [{"role": "user", "content": f"outage {i}"}]})

            assert ask(0).status_code == 200  # the key is known to both replicas' auth (config keys)
            server.stop()
            deadline = time.monotonic() + 3.0  # > HAProxy's fall (2 checks × 300 ms) + a /ready Redis ping
            served: list[httpx.Response] = []
            while time.monotonic() < deadline or len(served) < 10:
                served.append(ask(len(served) + 1))
                time.sleep(0.1)
            ready = [httpx.get(url + "/ready", timeout=10) for url in fl.replicas]
            assert [r.status_code for r in ready] == [200, 200], [r.text for r in ready]
            assert {r.json()["status"] for r in ready} == {"degraded"}
            assert fl.up() == {0, 1}, fl.status()
            assert [r.status_code for r in served] == [200] * len(served), [r.text[:200] for r in served
                                                                          if r.status_code != 200][:3]
            assert {r.headers["x-served-by"] for r in served} == {"gw0", "gw1"}
            server.start()  # same port, same data
            want = {r.headers["x-request-id"] for r in served}
            deadline = time.monotonic() + 20
            missing = want
            while missing and time.monotonic() < deadline:
                time.sleep(0.2)
                with contextlib.suppress(httpx.HTTPError):
                    missing = want - usage_ids(fl, "bob")
            assert not missing, f"{len(missing)} of {len(want)} requests served during the outage have no usage"
            fl.wait_up({0, 1})
        finally:
            fl.stop()
