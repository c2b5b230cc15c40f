"""Two gateway processes (``thinkgate serve``) on one Redis: cache hits, budgets and counters hold across them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import TierConfig
from gateway.state.limits import estimate
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, cleanup, keys_config
from tests.fixtures.ports import leased_port
from tests.fixtures.upstream import SimProcess, sim_tiers, wait_http_ok

REPO = Path(__file__).resolve().parents[2]
# in flight 1.5 s: long enough for the whole burst to reach admission on a loaded box while it holds its reservation
BUDGET_BODY = {"model": "short", "messages": [{"role": "user", "content": "budget race"}], "sim": {"delay_ms": 1500}}


def _budget_micro(sim: SimProcess) -> int:
    """alice's daily budget: one request's admission estimate and a half (fits one in flight, not two)."""
    return estimate(BUDGET_BODY, [TierConfig(**t) for t in sim_tiers(sim.base_url)[1:]]).micro_usd * 3 // 2


@pytest.fixture(scope="module")
def replicas(upstream_sim: SimProcess, redis_url: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Base URLs (``…/v1``) of two gateway processes sharing one Redis key prefix."""
    tmp = tmp_path_factory.mktemp("replicas")
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    # alice: a budget that fits one request's admission estimate (hard mode) and not two
    auth = keys_config(alice={"budget_usd_day": str(Decimal(_budget_micro(upstream_sim)) / 1_000_000)})
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    with leased_port() as port_a, leased_port() as port_b:
        yield from _run(upstream_sim, redis_url, tmp, prefix, auth, procs, urls, (port_a, port_b))


def _run(upstream_sim: SimProcess, redis_url: str, tmp: Path, prefix: str, auth: dict[str, Any],
         procs: list[subprocess.Popen[bytes]], urls: list[str], ports: tuple[int, int]) -> Iterator[tuple[str, str]]:
    """Start the two replicas on ``ports`` (leased by the caller); yield their base URLs; stop them."""
    try:
        for i in range(2):
            port = ports[i]
            cfg = {
                "engine": {"enabled": False},
                "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
                # 2 s socket timeout (default 0.25 s): 32 concurrent requests on a loaded 2-core box; not a timeout test
                "redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False, "socket_timeout_s": 2.0},
                "metering": {"spool_path": str(tmp / f"spool-{i}.jsonl")},
                "tiers": [{**t, "prices": {k: str(v) for k, v in t["prices"].items()}}
                          for t in sim_tiers(upstream_sim.base_url)],
                "routing": {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5]},
                "auth": auth,
            }
            path = tmp / f"replica-{i}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path)], cwd=REPO,
                                    env={**os.environ, "THINKGATE_CONFIG": ""}, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_http_ok(url + "/health", timeout_s=90, proc=proc)  # two cold starts on a loaded 2-core box
        yield urls[0] + "/v1", urls[1] + "/v1"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        cleanup(redis_url, prefix)


def _post(base: str, who: str, body: dict[str, object], **headers: str) -> httpx.Response:
    return httpx.post(base + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {SECRETS[who]}", **headers})


def test_cache_hit_across_replicas(replicas: tuple[str, str], upstream_sim: SimProcess) -> None:
    a, b = replicas
    tag = uuid.uuid4().hex
    body = {"model": "short", "temperature": 0, "messages": [{"role": "user", "content": "shared " + tag}],
            "sim": {"tag": tag}}
    first, second = _post(a, "bob", body), _post(b, "bob", body)
    assert (first.headers["x-thinkgate-cache"], second.headers["x-thinkgate-cache"]) == ("miss", "hit")
    assert first.json()["choices"] == second.json()["choices"]
    assert upstream_sim.tag(tag)["attempts"] == 1


def test_budget_holds_across_replicas(replicas: tuple[str, str], upstream_sim: SimProcess) -> None:
    # hard mode (the default): the first request reserves its estimate in Redis; 31 concurrent others, on either
    # process, find spend + reserved + their own estimate over the budget while it is in flight
    a, b = replicas
    body = BUDGET_BODY

    async def burst() -> list[httpx.Response]:
        headers = {"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*(http.post((a, b)[i % 2] + "/chat/completions", json=body, headers=headers)
                                          for i in range(32)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    admitted = codes.count(200)
    # one request's worth, across both processes; a second only if it reached admission after the first had
    # settled (its real cost is below the estimate), never more than the budget
    assert 1 <= admitted <= 2 and codes.count(429) == 32 - admitted, codes
    assert all(r.json()["error"]["code"] == "budget_exceeded" for r in responses if r.status_code == 429)
    admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
    day: dict[str, int] = {}
    for _ in range(100):
        day = httpx.get(a + "/usage", params={"key_id": "alice"}, headers=admin, timeout=10).json()["counters"]["day"]
        if day.get("requests", 0) >= admitted:
            break
        time.sleep(0.05)
    assert day["requests"] == admitted and 0 < int(day["cost_micro_usd"]) <= _budget_micro(upstream_sim), day


def test_counters_agree_across_replicas(replicas: tuple[str, str]) -> None:
    a, b = replicas
    admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
    before = httpx.get(a + "/usage", params={"key_id": "bob"}, headers=admin, timeout=10).json()
    n = 6
    for i in range(n):
        r = _post((a, b)[i % 2], "bob", {"model": "none", "messages": [{"role": "user", "content": f"count {i}"}]},
                  **{"cache-control": "no-store"})
        assert r.status_code == 200
    want = before["counters"]["total"]["requests"] + n
    for _ in range(100):
        views = [httpx.get(base + "/usage", params={"key_id": "bob"}, headers=admin, timeout=10).json()
                 for base in (a, b)]
        if all(v["counters"]["total"]["requests"] == want for v in views):
            break
        time.sleep(0.05)
    assert views[0]["counters"] == views[1]["counters"]
    assert views[0]["counters"]["total"]["requests"] == want


@pytest.mark.parametrize(("url", "kind", "prefix"), [
    ("redis://127.0.0.1:6379/0", "standalone", "tg:"),
    ("unix:///tmp/redis.sock", "standalone", "tg:"),
    ("redis+cluster://127.0.0.1:7000", "cluster", "{tg:}"),
    ("redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/mymaster/2", "sentinel", "tg:"),
])
def test_cluster_and_sentinel_urls_use_redis_py_clients(url: str, kind: str, prefix: str) -> None:
    from redis.asyncio import RedisCluster

    from gateway.config import RedisConfig
    from gateway.state.redis import connect

    handle = connect(RedisConfig(url=url))  # builds the client; no connection is made yet
    assert (handle.kind, handle.prefix) == (kind, prefix)
    if kind == "cluster":
        assert isinstance(handle.client, RedisCluster)
    if kind == "sentinel":
        pool = handle.client.connection_pool
        assert pool.service_name == "mymaster" and pool.connection_kwargs["db"] == 2
        assert [(s.connection_pool.connection_kwargs["port"]) for s in pool.sentinel_manager.sentinels] == \
            [26379, 26380]
    with pytest.raises(ValueError):
        connect(RedisConfig(url="redis+sentinel://127.0.0.1:26379"))
    with pytest.raises(ValueError):
        connect(RedisConfig(url="memcached://x"))
