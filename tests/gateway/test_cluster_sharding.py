"""Keys sharded by tenant on a real 3-master Redis Cluster: one tenant's keys share a slot, tenants spread over
the masters, and the keys of the multi-key admission/metering scripts stay in the one shared slot. On one
server the key names are what they always were."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

import httpx
import redis
from redis.crc import key_slot

from gateway.state.keys import RedisKeys, key_tenant, tenant_tag
from gateway.state.redis import cluster_prefix
from tests.fixtures.gateway import ADMIN_SECRET
from tests.fixtures.gateway_process import serve, serve_config
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.upstream import SimProcess

TENANTS = 100
REQUESTS_PER_TENANT = 8


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


def test_single_server_key_names_are_unchanged() -> None:
    k = RedisKeys("tg:")
    t = tenant_tag("key:alice")
    assert not k.sharded
    assert (k.cache_entry("d", t), k.cache_lock("d", t)) == ("tg:cache:d", "tg:cache:lock:d")
    assert k.conversation("key:alice", "resp_1") == "tg:resp:key:alice:resp_1"
    assert (k.session("s", t), k.request("r", t)) == ("tg:sess:s", "tg:req:r")
    assert k.semantic_entries(t) == f"tg:sem:{t}:e"
    # a prefix with its own hash tag somewhere keeps every key in that one slot (no tenant tags)
    assert not RedisKeys("{app}:tg:").sharded
    assert RedisKeys("{app}:tg:").cache_entry("d", t) == "{app}:tg:cache:d"
    # the key store's names too (its single scripts span all three)
    for p in ("tg:", "{app}:tg:"):
        kp = RedisKeys(p)
        assert (kp.key_record("alice"), kp.key_by_hash("00"), kp.key_ids) == (
            f"{p}keys:rec:alice", f"{p}keys:h:00", f"{p}keys:ids")


def test_cluster_tenant_keys_share_a_slot_and_shared_keys_another() -> None:
    k = RedisKeys(cluster_prefix("tg:"))
    assert k.sharded
    a, b = key_tenant("alice"), key_tenant("bob")
    alice = [k.cache_entry("d1", a), k.cache_lock("d1", a), k.cache_entry("d2", a), k.conversation("key:alice", "r"),
             k.session("s", a), k.request("q", a), k.semantic_entries(a), k.semantic_expiry(a),
             k.semantic_band_base(a) + "0:1:ff"]
    assert {_slot(x) for x in alice} == {_slot(k.tenant(a))}
    assert k.tenant(a) == "{tg:" + a + "}" and k.tenant(a) != k.tenant(b)
    # everything admission and metering touch in one script: one slot, the shared one
    shared = [k.events, k.seen("2026-12-01"), k.key_total("alice"), k.key_day("alice", "2026-12-01"),
              k.key_month("bob", "2026-12"), k.reservations("alice"), k.rpm("bob", 1), k.tpm("alice", 2),
              k.level_day("tag", "team=a", "2026-12-01"), k.level_month("global", "global", "2026-12"),
              k.level_reservations("global", "global"), k.tier_total("short"), k.usage_keys, k.budget_defs,
              k.key_ids, k.key_record("alice"), k.key_by_hash("00")]
    assert {_slot(x) for x in shared} == {_slot("{tg:}")}
    # with redis.cluster_placement: tenant, the key store: a record in its key's tenant slot, the lookup copy in a
    # slot of the secret's digest (a key's levels: tests/gateway/test_cluster_key_levels.py)
    t = RedisKeys(cluster_prefix("tg:"), "tenant")
    d = hashlib.sha256(b"tg-some-secret").hexdigest()
    assert t.key_record("alice") == "{tg:" + a + "}keys:rec:alice"
    assert t.key_by_hash(d) == "{tg:" + tenant_tag("secret:" + d) + "}keys:h:" + d
    assert _slot(t.key_record("alice")) == _slot(t.tenant(a)) != _slot(t.key_record("bob"))
    assert _slot(t.key_by_hash(d)) not in (_slot("{tg:}"), _slot(t.tenant(a)))
    assert t.key_ids == k.key_ids
    # 1000 tenants land on many slots (a slot per tenant, up to hash collisions)
    assert len({_slot(k.tenant(key_tenant(f"t{i}"))) for i in range(1000)}) > 950


def _secret(i: int) -> str:
    return "tg-tenant-" + hashlib.sha256(str(i).encode()).hexdigest()[:24]


def test_hundred_tenants_spread_over_the_masters(redis_cluster: ClusterSet, upstream_sim: SimProcess,
                                                 tmp_path: Path) -> None:
    redis_cluster.flush()
    auth = {"keys": [{"id": f"tenant{i:03d}", "secret": _secret(i), "tags": {"team": f"t{i % 5}"}}
                     for i in range(TENANTS)],
            "admin_key_sha256": hashlib.sha256(ADMIN_SECRET.encode()).hexdigest()}
    # the default prefix on a private, flushed cluster: key names, hence slots, are the same every run (with
    # "tg:" the 100 tenants' slots fall 27 / 36 / 37 over the three slot ranges), so the figures are reproducible
    prefix = "tg:"
    # a 1 s socket timeout: this test measures where keys go, not how the gateway degrades on a starved box
    cfg = serve_config(upstream_sim.base_url, tmp_path, prefix, auth=auth, redis={"socket_timeout_s": 1.0})
    with serve(cfg, tmp_path, {"THINKGATE_REDIS__URL": redis_cluster.url}, wait="/ready") as sp:
        # the default placement on a cluster is said at start (a new user missed deploy.md's advice)
        assert "note: redis.cluster_placement is shared" in sp.log.read_text()
        async def traffic() -> list[int]:
            sem = asyncio.Semaphore(12)

            async def one(http: httpx.AsyncClient, i: int, j: int) -> int:
                body = {"model": "none", "temperature": 0,
                        "messages": [{"role": "user", "content": f"tenant {i} question {j}"}]}
                async with sem:
                    r = await http.post(sp.base_url + "/chat/completions", json=body,
                                        headers={"authorization": f"Bearer {_secret(i)}"})
                return r.status_code

            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(*(one(http, i, j) for j in range(REQUESTS_PER_TENANT)
                                              for i in range(TENANTS)))

        codes = asyncio.run(traffic())
        assert Counter(codes) == {200: TENANTS * REQUESTS_PER_TENANT}
        admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
        want = TENANTS * REQUESTS_PER_TENANT
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # metering and the request index are written just after each answer
            r = httpx.get(sp.base_url + "/usage", params={"since": "0", "limit": "10000"}, headers=admin, timeout=30)
            if len(r.json()["data"]) >= want:
                break
            time.sleep(0.2)
        assert len(r.json()["data"]) == want
        time.sleep(1.0)  # the request index is flushed every 0.2 s
    counts = redis_cluster.key_counts()
    total = sum(counts.values())
    shares = {port: n / total for port, n in counts.items()}
    print(f"\nkeys per master after {want} requests from {TENANTS} tenants: {counts} (total {total}); "
          f"shares {', '.join(f'{s:.1%}' for s in shares.values())}")
    shared_slot = _slot(cluster_prefix(prefix))
    tenant_keys = _tenant_keys_per_master(redis_cluster, shared_slot)
    print(f"tenant-tagged keys per master: {tenant_keys}; shared-slot keys: "
          f"{_count_in_slot(redis_cluster, shared_slot)}")
    assert len(counts) == 3 and all(n > 0 for n in counts.values())
    assert max(shares.values()) <= 0.5, counts
    # the tenant keys alone spread evenly: no master has more than half of them
    assert max(tenant_keys.values()) <= 0.5 * sum(tenant_keys.values()), tenant_keys


def _count_in_slot(c: ClusterSet, slot: int) -> int:
    port = _owner(c, slot)
    return int(redis.Redis(port=port).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))


def _owner(c: ClusterSet, slot: int) -> int:
    rows = redis.Redis(port=c.live_ports()[0]).execute_command("CLUSTER", "SLOTS")
    return next(int(row[2][1]) for row in rows if int(row[0]) <= slot <= int(row[1]))


def _tenant_keys_per_master(c: ClusterSet, shared_slot: int) -> dict[int, int]:
    owner = _owner(c, shared_slot)
    shared = _count_in_slot(c, shared_slot)
    return {port: n - (shared if port == owner else 0) for port, n in c.key_counts().items()}


def test_semantic_cache_on_the_cluster_stays_in_the_tenant_slot(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    # the exact entry, the semantic index (and its eviction, which touches band keys not passed in KEYS) all
    # run in the tenant's slot on a real cluster, as the request path calls them (Accounting.cache_begin)
    from gateway.config import CacheConfig, SemanticCacheConfig
    from gateway.semantic.cache import SemanticCache
    from gateway.semantic.embed import LexicalEmbedder
    from gateway.state.cache import CacheEntry, ResponseCache
    from gateway.state.cache_policy import cache_key, decide, tenant_scope
    from tests.fixtures.redis_stack import stack

    def body(q: str) -> dict[str, object]:
        return {"model": "sim-model", "temperature": 0, "messages": [{"role": "user", "content": q}]}

    async def go() -> None:
        async with stack(redis_cluster.url, "tgsem:", tmp_path / "spool", socket_timeout_s=2.0) as st:
            assert st.handle.prefix == "{tgsem:}"
            exact = ResponseCache(st.handle, st.breaker, CacheConfig())
            sem = SemanticCache(st.handle, st.breaker, SemanticCacheConfig(enabled=True, max_entries_per_tenant=2),
                                LexicalEmbedder())
            scope = tenant_scope("alice")
            t = tenant_tag(scope)
            questions = ["What is 17 * 23?", "What is the capital city of France, in one word?",
                         "Name the largest planet of the solar system, in one word."]
            for i, q in enumerate(questions):  # three entries, cap two: the first is evicted on the third insert
                digest = cache_key(scope, "chat", "short", body(q))
                ticket = await exact.begin(digest, decide(CacheConfig(), body(q), {}), t)
                assert ticket.status == "miss"
                answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"a{i}"},
                                       "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
                assert await exact.finish(ticket, CacheEntry(answer, "chat", "short", "sim-model", time.time()))
                probe = await sem.prepare(scope, "chat", "short", body(q))
                assert probe is not None and probe.tenant == t
                assert await sem.store(probe, digest, f"req-{i}", 60)
            probe = await sem.prepare(scope, "chat", "short", body("what is the capital city of france, in one word"))
            assert probe is not None
            hit = await sem.lookup(probe)
            assert hit.outcome == "hit" and hit.matched_request_id == "req-1"
            assert await sem.index.size(t) == 2
            slots = {_slot(k.decode()) for port in redis_cluster.masters()
                     for k in redis.Redis(port=port).scan_iter(match="{tgsem:*")}
            assert slots == {_slot("{tgsem:" + t + "}")}

    asyncio.run(go())


KEY_STORE_TENANTS = 100


async def _create_keys(url: str, prefix: str, placement: str) -> list[str]:
    """``KEY_STORE_TENANTS`` keys in the Redis key store, as ``thinkgate keys create --budget-usd-day 5 --rpm 600
    --tpm 600000 --tag team=…`` makes them (the store's own code, not the CLI's 100 processes)."""
    from gateway.auth.redis_store import RedisKeyStore
    from gateway.config import RedisConfig
    from gateway.state.breaker import Breaker
    from gateway.state.redis import connect

    handle = connect(RedisConfig(url=url, key_prefix=prefix, socket_timeout_s=2.0, cluster_placement=placement))
    try:
        store = RedisKeyStore(handle, Breaker(1.0))
        return [await store.create(f"team{i:03d}", tags={"team": f"t{i % 5}"}, budget_usd_day=Decimal(5), rpm=600,
                                   tpm=600_000) for i in range(KEY_STORE_TENANTS)]
    finally:
        await handle.close()


def test_a_hundred_stored_keys_with_little_traffic_spread_with_tenant_placement(
        redis_cluster: ClusterSet, upstream_sim: SimProcess, tmp_path: Path) -> None:
    """The fleet a new user measured at 72% on one master: keys made with ``thinkgate keys create`` (budgets, RPM,
    TPM), two requests each. With ``redis.cluster_placement: tenant`` each key's record, counters, cube,
    reservations and windows sit in its own slot; the shared slot keeps the stream, the levels above the keys and
    the key ids. (With ``shared``, the default, this workload put 87% of the keys on one master: 884 of 1,020.)"""
    redis_cluster.flush()
    prefix = "tg:"
    secrets = asyncio.run(_create_keys(redis_cluster.url, prefix, "tenant"))
    auth = {"keys": [], "admin_key_sha256": hashlib.sha256(ADMIN_SECRET.encode()).hexdigest()}
    cfg = serve_config(upstream_sim.base_url, tmp_path, prefix, auth=auth,
                       redis={"socket_timeout_s": 1.0, "cluster_placement": "tenant"})
    want = 2 * KEY_STORE_TENANTS
    with serve(cfg, tmp_path, {"THINKGATE_REDIS__URL": redis_cluster.url}, wait="/ready") as sp:
        assert "cluster_placement is shared" not in sp.log.read_text()
        async def traffic() -> list[int]:
            sem = asyncio.Semaphore(12)

            async def one(http: httpx.AsyncClient, i: int, j: int) -> int:
                body = {"model": "none", "messages": [{"role": "user", "content": f"key {i} question {j}"}]}
                async with sem:
                    r = await http.post(sp.base_url + "/chat/completions", json=body,
                                        headers={"authorization": f"Bearer {secrets[i]}"})
                return r.status_code

            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(*(one(http, i, j) for j in range(2) for i in range(KEY_STORE_TENANTS)))

        codes = asyncio.run(traffic())
        assert Counter(codes) == {200: want}
        admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = httpx.get(sp.base_url + "/usage", params={"since": "0", "limit": "10000"}, headers=admin, timeout=30)
            if len(r.json()["data"]) >= want:
                break
            time.sleep(0.2)
        assert len(r.json()["data"]) == want
        # every key's own counters say 2 requests, read from its own slot through the gateway
        for i in (0, 57, 99):
            mine = httpx.get(sp.base_url + "/usage", headers={"authorization": f"Bearer {secrets[i]}"}, timeout=10)
            assert mine.status_code == 200, mine.text
            counters = mine.json()["counters"]
            assert counters["day"]["requests"] == counters["total"]["requests"] == 2, counters
            key_budget = next(b for b in mine.json()["budgets"] if b["level"] == "key" and b["period"] == "day")
            assert Decimal(key_budget["spent_usd"]) > 0, key_budget
        time.sleep(1.0)  # the request index is flushed every 0.2 s
    counts = redis_cluster.key_counts()
    total = sum(counts.values())
    shares = {port: n / total for port, n in counts.items()}
    print(f"\nkeys per master, {KEY_STORE_TENANTS} stored keys x 2 requests (tenant placement): {counts} "
          f"(total {total}); shares {', '.join(f'{s:.1%}' for s in shares.values())}; shared-slot keys "
          f"{_count_in_slot(redis_cluster, _slot(cluster_prefix(prefix)))}")
    assert max(shares.values()) <= 0.5, counts
    assert not redis.Redis(port=redis_cluster.master_of("{tg:}usage:pending")).hlen("{tg:}usage:pending")
