"""Upstream pools through a real gateway over three real simulator processes (``tier.base_urls``):
least-outstanding balancing (a slow replica gets little; idle calls rotate), conversation affinity (every turn
of a conversation on one replica, spilling over when it is overloaded), session stickiness keeping the tier and
the replica, passive ejection of a replica that answers 503 or was killed and its return after recovery,
active health checks, and the per-upstream Prometheus series."""

from __future__ import annotations

import hashlib
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import ConfigError, Settings, TierConfig
from tests.fixtures.gateway import cleanup
from tests.fixtures.sim_pool import SimPool, pool_tiers
from tests.fixtures.upstream import TEST_KEY, GatewayServer, sim_settings, wait_for

AUTH = {"authorization": f"Bearer {TEST_KEY}"}
SCRAPE_KEY = "tg-pool-scrape-0000000000000"
# /metrics is the operator's (metrics.access: admin): these gateways' scrape key reads it
METRICS = {"metrics": {"scrape_key_sha256": hashlib.sha256(SCRAPE_KEY.encode()).hexdigest()}}
SCRAPE = {"authorization": f"Bearer {SCRAPE_KEY}"}


@pytest.fixture(scope="module")
def sims() -> Iterator[SimPool]:
    pool = SimPool(3)
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def replicas(sims: SimPool) -> SimPool:
    sims.reset()
    sims.mark()
    return sims


def gateway(sims: SimPool, redis_url: str, routing: dict[str, Any] | None = None, **pool: Any) -> GatewayServer:
    extra: dict[str, Any] = {}
    if routing is not None:
        extra["routing"] = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5],
                            "default_tier": "long", **routing}
        extra["redis"] = {"url": redis_url, "start_if_missing": False,
                          "key_prefix": f"tgtest:{uuid.uuid4().hex[:12]}:"}
    return GatewayServer(sim_settings(sims.urls[0], redis_url, tiers=pool_tiers(sims.urls, **pool), **extra,
                                      **METRICS))


def chat(client: httpx.Client, gw: GatewayServer, messages: list[dict[str, Any]], tag: str | None = None,
         model: str = "short", **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "messages": messages, **extra}
    if tag is not None:
        body["sim"] = {"tag": tag}
    return client.post(gw.base_url + "/chat/completions", json=body, headers=AUTH, timeout=30)


def ask(client: httpx.Client, gw: GatewayServer, text: str | None = None) -> httpx.Response:
    return chat(client, gw, [{"role": "user", "content": text or f"question {uuid.uuid4().hex}"}])


def metric(gw: GatewayServer, name: str, url: str) -> float:
    text = httpx.get(gw.url + "/metrics", headers=SCRAPE, timeout=10).text
    m = re.search(rf'^{name}\{{upstream="{re.escape(url)}"\}} (\S+)$', text, re.M)
    assert m is not None, f"{name} for {url} not in /metrics"
    return float(m.group(1))


def run_concurrently(workers: int, per_worker: int, call: Any) -> list[int]:
    statuses: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        with httpx.Client() as c:
            for _ in range(per_worker):
                code = call(c).status_code
                with lock:
                    statuses.append(code)

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return statuses


# ---------------------------------------------------------------- config


def test_base_urls_config() -> None:
    t = TierConfig(name="x", base_urls=["http://a:1/v1", "http://b:1/v1"])
    assert t.base_url == "http://a:1/v1" and t.upstream_urls == ("http://a:1/v1", "http://b:1/v1")
    single = TierConfig(name="y", base_url="http://c:1/v1")
    assert single.upstream_urls == ("http://c:1/v1",) and single.base_urls == []
    with pytest.raises(ConfigError, match="base_url or base_urls"):
        Settings.load(None, engine={"enabled": False},
                      tiers=[{"name": "x", "base_url": "http://z:1/v1", "base_urls": ["http://a:1/v1"]}],
                      routing={"router_path": None, "routed_tiers": ["x"], "thresholds": [], "default_tier": "x"})
    with pytest.raises(ConfigError, match="each upstream once"):
        Settings.load(None, engine={"enabled": False},
                      tiers=[{"name": "x", "base_urls": ["http://a:1/v1", "http://a:1/v1/"]}],
                      routing={"router_path": None, "routed_tiers": ["x"], "thresholds": [], "default_tier": "x"})


# ---------------------------------------------------------------- balancing


def test_idle_calls_rotate_over_the_replicas(replicas: SimPool, redis_url: str) -> None:
    with gateway(replicas, redis_url, affinity="none", health_check_interval_s=0) as gw, httpx.Client() as c:
        for _ in range(30):
            assert ask(c, gw).status_code == 200
    served = replicas.served()
    assert sum(served) == 30
    assert all(8 <= n <= 12 for n in served), served  # one replica for all (no balancing) fails


def test_least_outstanding_avoids_the_slow_replica(replicas: SimPool, redis_url: str) -> None:
    replicas.sims[2].set_mode(delay_ms=1500)
    with gateway(replicas, redis_url, affinity="none", health_check_interval_s=0) as gw:
        statuses = run_concurrently(8, 8, lambda c: ask(c, gw))
    assert statuses == [200] * 64
    served = replicas.served()
    assert sum(served) == 64
    # round robin or random would give the slow replica a third (~21); least outstanding a few
    assert served[2] <= 0.2 * 64, served


def test_a_conversation_keeps_its_replica(replicas: SimPool, redis_url: str) -> None:
    homes = []
    with gateway(replicas, redis_url, health_check_interval_s=0) as gw, httpx.Client() as c:
        for conv in range(9):
            msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."},
                                          {"role": "user", "content": f"task {conv} {uuid.uuid4().hex}"}]
            seen = set()
            for turn in range(3):
                tag = f"conv-{uuid.uuid4().hex}"
                r = chat(c, gw, msgs, tag)
                assert r.status_code == 200
                seen.update(replicas.which(tag))
                msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"and then step {turn}"}]
            assert len(seen) == 1, f"conversation {conv} was served by replicas {seen}"
            homes.append(seen.pop())
    assert len(set(homes)) >= 2, homes  # the hash spreads conversations; 9 on one replica: (1/3)^8


def test_an_overloaded_home_replica_spills_over(replicas: SimPool, redis_url: str) -> None:
    for s in replicas.sims:
        s.set_mode(delay_ms=600)
    msgs = [{"role": "user", "content": f"the same long shared prompt {uuid.uuid4().hex}"}]
    with gateway(replicas, redis_url, health_check_interval_s=0, affinity_max_skew=1) as gw:
        statuses = run_concurrently(6, 1, lambda c: chat(c, gw, msgs))
    assert statuses == [200] * 6
    served = replicas.served()
    # six concurrent turns of one prefix: the home replica takes at most skew + 1 at once, the rest spill over
    assert max(served) <= 3 and sum(served) == 6, served


def test_a_session_keeps_its_tier_and_replica(replicas: SimPool, redis_url: str) -> None:
    long_turn = "now refactor the module and explain every step in detail " * 21  # routes to long alone
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": f"start task {uuid.uuid4().hex[:8]}"}]
    seen = []
    gw = gateway(replicas, redis_url, routing={"session_ttl_s": 600}, health_check_interval_s=0)
    with gw, httpx.Client() as c:
        for _ in range(4):
            tag = f"sess-{uuid.uuid4().hex}"
            r = chat(c, gw, msgs, tag, model="auto")
            assert r.status_code == 200
            seen.append((r.headers["x-thinkgate-tier"], r.headers.get("x-thinkgate-session"),
                         tuple(replicas.which(tag))))
            msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": long_turn}]
    cleanup(redis_url, gw.settings.redis.key_prefix)
    assert [s[1] for s in seen] == ["new", "sticky", "sticky", "sticky"]
    assert {s[0] for s in seen} == {"short"}
    assert len({s[2] for s in seen}) == 1 and len(seen[0][2]) == 1, seen


# ---------------------------------------------------------------- ejection and recovery


def test_a_503_replica_is_ejected_and_returns_after_recovery(replicas: SimPool, redis_url: str) -> None:
    bad = replicas.sims[2]
    bad.set_mode(fail_mode="503")
    with gateway(replicas, redis_url, affinity="none", allowed_fails=2, cooldown_s=2.0,
                 health_check_interval_s=0) as gw, httpx.Client() as c:
        for _ in range(30):
            assert ask(c, gw).status_code == 200  # a retry on another replica hides each failure
        failed = replicas.served("failed")
        assert failed[:2] == [0, 0] and sum(replicas.served()[:2]) == 30
        # without ejection the bad replica would get a third of the attempts (~10 failures); ejected after 2
        # (one more per probe readmission in between, each followed by a doubled cool-down)
        assert 2 <= failed[2] <= 4, failed
        assert metric(gw, "thinkgate_upstream_ejections_total", bad.base_url) >= 1

        bad.set_mode(fail_mode="none")
        assert wait_for(lambda: metric(gw, "thinkgate_upstream_in_rotation", bad.base_url) == 1, timeout_s=20)
        replicas.mark()
        for _ in range(30):
            assert ask(c, gw).status_code == 200
        assert replicas.served()[2] >= 6, replicas.served()  # back in rotation (a third: ~10)
        assert metric(gw, "thinkgate_upstream_outstanding_requests", bad.base_url) == 0


def test_a_killed_replica_is_avoided_and_a_conversation_comes_home_after_restart(
        replicas: SimPool, redis_url: str) -> None:
    msgs = [{"role": "user", "content": f"conversation {uuid.uuid4().hex}"}]
    with gateway(replicas, redis_url, allowed_fails=1, cooldown_s=0.5, max_cooldown_s=1.0,
                 health_check_interval_s=0) as gw, httpx.Client() as c:
        tag = f"home-{uuid.uuid4().hex}"
        assert chat(c, gw, msgs, tag).status_code == 200
        [home] = replicas.which(tag)
        replicas.kill(home)
        away = set()
        for _ in range(6):
            tag = f"away-{uuid.uuid4().hex}"
            assert chat(c, gw, msgs, tag).status_code == 200  # the refused connection is retried elsewhere
            away.update(replicas.which(tag))
        assert home not in away and len(away) == 1, away  # ties broken in rendezvous order: one fallback
        assert metric(gw, "thinkgate_upstream_ejections_total", replicas.urls[home]) >= 1

        replicas.restart(home)
        assert wait_for(lambda: metric(gw, "thinkgate_upstream_in_rotation", replicas.urls[home]) == 1,
                        timeout_s=20)
        tag = f"back-{uuid.uuid4().hex}"
        assert chat(c, gw, msgs, tag).status_code == 200
        assert replicas.which(tag) == [home]


def test_active_health_checks_take_a_failing_replica_out(replicas: SimPool, redis_url: str) -> None:
    sick = replicas.sims[1]
    sick.set_mode(health_status=503)  # its generations still work: only the health check can tell
    with gateway(replicas, redis_url, affinity="none", health_check_interval_s=0.2,
                 health_check_timeout_s=1.0) as gw, httpx.Client() as c:
        assert wait_for(lambda: metric(gw, "thinkgate_upstream_in_rotation", sick.base_url) == 0, timeout_s=10)
        replicas.mark()
        for _ in range(20):
            assert ask(c, gw).status_code == 200
        assert replicas.served()[1] == 0, replicas.served()
        assert metric(gw, "thinkgate_upstream_health_check_failures_total", sick.base_url) >= 1

        sick.set_mode(health_status=200)
        assert wait_for(lambda: metric(gw, "thinkgate_upstream_in_rotation", sick.base_url) == 1, timeout_s=10)
        replicas.mark()
        for _ in range(21):
            assert ask(c, gw).status_code == 200
        assert replicas.served()[1] >= 5, replicas.served()
        # the healthy ones are probed too; 21 requests can take less than one probe interval on a fast box
        assert wait_for(lambda: replicas.served("health")[0] >= 1, timeout_s=5), replicas.served("health")


def test_outstanding_counts_a_stream_until_it_ends(replicas: SimPool, redis_url: str) -> None:
    msgs = [{"role": "user", "content": f"stream {uuid.uuid4().hex}"}]
    with gateway(replicas, redis_url, health_check_interval_s=0) as gw, httpx.Client() as c:
        tag = f"stream-{uuid.uuid4().hex}"
        body = {"model": "short", "messages": msgs, "stream": True, "sim": {"tag": tag, "chunk_delay_ms": 150}}
        with c.stream("POST", gw.base_url + "/chat/completions", json=body, headers=AUTH, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            [i] = replicas.which(tag)
            assert metric(gw, "thinkgate_upstream_outstanding_requests", replicas.urls[i]) == 1
            assert sum(1 for _ in lines) > 0
        assert wait_for(lambda: metric(gw, "thinkgate_upstream_outstanding_requests", replicas.urls[i]) == 0)
        assert metric(gw, "thinkgate_upstream_requests_total", replicas.urls[i]) == 1
        # a fresh gateway sent nothing elsewhere
        assert sum(metric(gw, "thinkgate_upstream_requests_total", u) for u in replicas.urls) == 1


def test_settings_errors_name_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiers: [{name: t, base_url: 'http://127.0.0.1:1/v1', read_timeout_s: 5, response_timeout_s: 2}]"
                   "\nrouting: {routed_tiers: [t], default_tier: t, router_path: null}\n")
    with pytest.raises(ConfigError, match=r"response_timeout_s \(2.0\) must be >= read_timeout_s \(5.0\)"):
        Settings.load(cfg)  # it was raised to read_timeout_s without a word
    cfg.write_text("tiers: [{name: t, base_url: 'http://127.0.0.1:1/v1'}]\n"
                   "routing: {routed_tiers: [t], default_tier: t, router_path: null}\n")
    # a list in an environment variable must be JSON: a clear ConfigError (exit 2 in the CLI), not a traceback
    monkeypatch.setenv("THINKGATE_SERVER__CORS_ALLOW_ORIGINS", "https://a.example.com")
    with pytest.raises(ConfigError, match="environment variable is JSON"):
        Settings.load(cfg)
    monkeypatch.setenv("THINKGATE_SERVER__CORS_ALLOW_ORIGINS", '["https://a.example.com"]')
    assert Settings.load(cfg).server.cors_allow_origins == ["https://a.example.com"]


def test_metrics_never_show_upstream_credentials(replicas: SimPool, redis_url: str) -> None:
    """A replica URL with credentials in it (``user:token@``) is labelled without them (it leaked the token on
    five series; ``/metrics`` is the operator's by default, but ``metrics.access: any_key`` opens it to tenants)."""
    urls = [u.replace("http://", "http://tguser:S3CRETTOKEN@") for u in replicas.urls]
    settings = sim_settings(urls[0], redis_url, tiers=pool_tiers(urls), **METRICS)
    with GatewayServer(settings) as gw, httpx.Client() as c:
        assert ask(c, gw).status_code == 200
        text = httpx.get(gw.url + "/metrics", headers=SCRAPE, timeout=10).text
        assert "S3CRETTOKEN" not in text and "tguser" not in text
        assert sum(metric(gw, "thinkgate_upstream_requests_total", u) for u in replicas.urls) == 1
