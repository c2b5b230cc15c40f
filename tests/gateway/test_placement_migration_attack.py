"""Adversarial cases of ``thinkgate redis migrate-placement`` on a real 3-master Redis Cluster
(``gateway/state/placement_migration.py``): states a platform team's cluster is in when the migration runs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import subprocess
import sys
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.auth.redis_store import KeyRecord, RedisKeyStore
from gateway.cli.redis_ops import _repair_creates
from gateway.config import Prices
from gateway.ledger.event import UsageEvent
from gateway.state.breaker import Breaker
from gateway.state.placement import placement_conflict
from gateway.state.placement_migration import Migration, MigrationRefused, MigrationReport
from tests.fixtures.gateway import ADMIN_SECRET
from tests.fixtures.gateway_process import REPO, serve, serve_config
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.redis_stack import stack
from tests.fixtures.upstream import SimProcess


def _prefix() -> str:
    return f"tgpa{uuid.uuid4().hex[:6]}:"


async def _migrate(cluster: ClusterSet, prefix: str, target: str, tmp: Path, **kw: Any) -> MigrationReport:
    async with stack(cluster.url, prefix, tmp / f"spool-{uuid.uuid4().hex[:4]}.jsonl", socket_timeout_s=5.0,
                     placement=target) as st:
        return await Migration(st.handle, st.metering_cfg, **kw).run()


async def test_a_half_written_create_does_not_become_a_listed_key_under_shared(redis_cluster: ClusterSet,
                                                                              tmp_path: Path) -> None:
    """A tenant create that crashed before its commit (record and lookup copy written, claim pending) is no key:
    after a move to shared it must not be listed as an active key, nor authenticate."""
    prefix = _prefix()
    async with stack(redis_cluster.url, prefix, tmp_path / "s.jsonl", socket_timeout_s=5.0,
                     placement="tenant") as st:
        store = RedisKeyStore(st.handle, Breaker(1.0), cache_s=0)
        await store.create("alice", budget_usd_day=Decimal(5))
        secret = "tg-never-returned"
        rec = KeyRecord("ghost", hashlib.sha256(secret.encode()).hexdigest(), created=time.time())
        await store.claim(rec)
        await store.write_copy(rec)
        await store.write_record(rec)  # crashed here: no commit
        assert [r.id for r in await store.list()] == ["alice"] and await store.incomplete() == ["ghost"]
    with pytest.raises(MigrationRefused, match="never finished"):  # without the key store's repair: refused
        await _migrate(redis_cluster, prefix, "shared", tmp_path)
    dry = await _migrate(redis_cluster, prefix, "shared", tmp_path, dry_run=True, repair_creates=_repair_creates)
    assert dry.creates == 1 and "would roll back 1 half-written key creates" in dry.summary()
    report = await _migrate(redis_cluster, prefix, "shared", tmp_path, repair_creates=_repair_creates)
    assert report.creates == 1 and not report.conflicts
    async with stack(redis_cluster.url, prefix, tmp_path / "s.jsonl", socket_timeout_s=5.0,
                     placement="shared") as st:
        store = RedisKeyStore(st.handle, Breaker(1.0), cache_s=0)
        assert [r.id for r in await store.list()] == ["alice"]
        assert await store.lookup(rec.secret_sha256) is None
        assert await store.get("ghost") is None
        assert not await st.handle.client.exists(st.meter.keys.key_pending)
        assert not await st.handle.client.sismember(st.meter.keys.key_ids, "ghost")  # the id is free again


# --- a platform team's migration, end to end: real gateways, real requests, the CLI --------------------------------

ALICE_RPM = 6


def _cli(args: list[str], config: Path, url: str, placement: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args, "--config", str(config)], cwd=REPO,
                          env={**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": url,
                               "THINKGATE_REDIS__CLUSTER_PLACEMENT": placement},
                          capture_output=True, text=True, timeout=120)


def _chat(base: str, secret: str, text: str) -> httpx.Response:
    return httpx.post(base + "/chat/completions", headers={"authorization": f"Bearer {secret}"}, timeout=30,
                      json={"model": "auto", "temperature": 0, "max_tokens": 64,
                            "messages": [{"role": "user", "content": text}]})


def _seen(base: str, secrets: dict[str, str], month_start: str) -> dict[str, Any]:
    """Everything a user and the operator see through a gateway: each key's authentication, its /v1/usage summary
    (counters, budgets' spent), and the admin's grouped rows of the month."""
    out: dict[str, Any] = {}
    for key_id, secret in sorted(secrets.items()):
        got = httpx.get(base + "/usage", headers={"authorization": f"Bearer {secret}"}, timeout=30)
        body = got.json()
        if got.status_code == 200:
            for b in body.get("budgets", []):
                b.pop("reserved_usd", None), b.pop("remaining_usd", None)
            body = {k: body.get(k) for k in ("key_id", "counters", "budgets")}
        out[key_id] = (got.status_code, body)
    admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
    rows = httpx.get(base + "/usage", headers=admin, timeout=30,
                     params={"group_by": "key,tier,day,tag", "since": month_start})
    assert rows.status_code == 200, rows.text
    out["rows"] = sorted(map(str, rows.json()["data"]))
    return out


def _cli_view(config: Path, url: str, placement: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, args in (("keys", ["keys", "list", "--json"]), ("budgets", ["budgets", "list"]),
                       ("export", ["usage", "export", "--format", "jsonl"]),
                       ("grouped", ["usage", "export", "--format", "jsonl", "--group-by", "key,day,tag",
                                    "--since", "2000-01-01"])):
        got = _cli(args, config, url, placement)
        assert got.returncode == 0, (name, got.stderr)
        out[name] = sorted(got.stdout.splitlines())
    return out


def test_shared_to_tenant_to_shared_with_real_gateways(redis_cluster: ClusterSet, upstream_sim: SimProcess,
                                                       tmp_path: Path) -> None:
    """Keys from the store (tags, day/month budgets, RPM/TPM; one revoked) and from the config, tag and global
    budgets, real requests through ``thinkgate serve`` (the exact cache on: repeats served from it; a key rate
    limited), spend on older days: what every user and the operator see is the same after shared -> tenant and
    again after tenant -> shared, and a key's RPM window is still in force after each move."""
    prefix = f"tgpe{uuid.uuid4().hex[:6]}:"
    url = redis_cluster.url
    auth = {"keys": [{"id": "cfgkey", "secret": "tg-cfg-secret-000000000000000", "tags": {"team": "c"},
                      "budget_usd_day": "3", "rpm": 50}],
            "admin_key_sha256": hashlib.sha256(ADMIN_SECRET.encode()).hexdigest()}
    cfg = serve_config(upstream_sim.base_url, tmp_path, prefix, auth=auth,
                       redis={"cluster_placement": "shared", "start_if_missing": False},
                       cache={"mode": "deterministic"})
    paths = {}
    for placement in ("shared", "tenant"):
        paths[placement] = tmp_path / f"{placement}.yaml"
        paths[placement].write_text(yaml.safe_dump(
            {**cfg, "redis": {**cfg["redis"], "cluster_placement": placement}}))
    conf = paths["shared"]
    secrets = {"cfgkey": "tg-cfg-secret-000000000000000"}
    for key_id, extra in (("alice", ["--tag", "team=a", "--budget-usd-day", "5", "--rpm", str(ALICE_RPM)]),
                          ("bob", ["--tag", "team=b", "--budget-usd-month", "7", "--tpm", "100000"]),
                          ("carol", ["--tag", "team=a"])):
        made = _cli(["keys", "create", "--id", key_id, *extra], conf, url, "shared")
        assert made.returncode == 0, made.stderr
        secrets[key_id] = next(w for w in made.stdout.split() if w.startswith("tg-"))
    for level in (["--tag", "team=a", "--usd-day", "20"], ["--global", "--usd-month", "500"]):
        assert _cli(["budgets", "set", *level], conf, url, "shared").returncode == 0

    async def older_days() -> None:  # spend on earlier days of the month and the month before
        async with stack(url, prefix, tmp_path / "old.jsonl", socket_timeout_s=5.0) as st:
            now = time.time()
            for i, (key_id, days) in enumerate((("alice", 1), ("alice", 2), ("bob", 35), ("cfgkey", 1))):
                ev = UsageEvent(key_id=key_id, requested_model="auto", tier="short", upstream_model="m",
                                route_reason="predicted", prompt_tokens=1000 + i, completion_tokens=500,
                                tags={"team": key_id[0]}, ts=now - days * 86400)
                ev.price(Prices(input_usd_per_mtok=Decimal("0.5"), output_usd_per_mtok=Decimal("2")))
                assert (await st.meter.record(ev)).counted

    asyncio.run(older_days())
    minute = int(time.time()) // 60
    env = {"THINKGATE_REDIS__URL": url}
    with serve(yaml.safe_load(conf.read_text()), tmp_path, env, wait="/ready") as sp:
        for key_id in ("alice", "bob", "cfgkey", "carol"):
            for text in ("what is 2+2?", "what is 2+2?", f"hello from {key_id}"):  # a repeat: the exact cache
                assert _chat(sp.base_url, secrets[key_id], text).status_code == 200
        assert _cli(["keys", "revoke", "carol"], conf, url, "shared").returncode == 0
        time.sleep(0.3)
        used = 3
        while used < ALICE_RPM:
            assert _chat(sp.base_url, secrets["alice"], f"more {used}").status_code == 200
            used += 1
        assert _chat(sp.base_url, secrets["alice"], "one too many").status_code == 429
        time.sleep(6)  # auth.key_cache_s: carol's revoke in force
        month_start = time.strftime("%Y-%m-01", time.gmtime(time.time() - 40 * 86400))
        before = _seen(sp.base_url, secrets, month_start)
    assert before["carol"][0] == 401 and before["alice"][0] == 200
    view = _cli_view(conf, url, "shared")

    for target in ("tenant", "shared"):
        moved = _cli(["redis", "migrate-placement", "--to", target, "--quiet-s", "0"], paths[target], url, target)
        assert moved.returncode == 0, moved.stderr
        assert _cli_view(paths[target], url, target) == view, target
        with serve(yaml.safe_load(paths[target].read_text()), tmp_path, env, wait="/ready") as sp:
            assert _seen(sp.base_url, secrets, month_start) == before, target
            if int(time.time()) // 60 == minute:  # still alice's window: her RPM is spent
                assert _chat(sp.base_url, secrets["alice"], f"again after {target}").status_code == 429, target
            assert _chat(sp.base_url, secrets["bob"], f"bob after {target}").status_code == 200
            before = _seen(sp.base_url, secrets, month_start)  # what the next move must keep
        view = _cli_view(paths[target], url, target)


# --- kill -9 of the command at random points, on a few thousand keys ----------------------------------------------

N_KEYS = 2000


async def _many_keys(url: str, prefix: str, tmp: Path) -> None:
    """N_KEYS stored keys (every tenth revoked) with spend today and yesterday, half with an RPM window."""
    async with stack(url, prefix, tmp / "many.jsonl", socket_timeout_s=10.0) as st:
        store = RedisKeyStore(st.handle, Breaker(1.0), cache_s=0)
        ids = [f"k{i:05d}" for i in range(N_KEYS)]
        for start in range(0, N_KEYS, 100):
            await asyncio.gather(*(store.create(i, tags={"team": i[-1]}, rpm=10) for i in ids[start:start + 100]))
        await asyncio.gather(*(store.revoke(i) for i in ids[::10]))
        now = time.time()
        events = []
        for n, key_id in enumerate(ids):
            for days in (0, 1):
                ev = UsageEvent(key_id=key_id, requested_model="auto", tier="short", upstream_model="m",
                                route_reason="predicted", prompt_tokens=100 + n, completion_tokens=7,
                                tags={"team": key_id[-1]}, ts=now - days * 86400)
                ev.price(Prices(input_usd_per_mtok=Decimal("0.5"), output_usd_per_mtok=Decimal("2")))
                events.append(ev)
        for start in range(0, len(events), 500):
            assert all(r.counted for r in await st.meter.record_many(events[start:start + 500]))
        k, r, minute = st.meter.keys, st.handle.client, int(now) // 60
        for key_id in ids[::2]:
            await r.set(k.rpm(key_id, minute), 3, px=600_000)


# runs the CLI as ``python -m gateway`` does, then writes the process's own peak RSS (KiB, VmHWM: this image's, since
# its exec) as the last stderr line. Not getrusage: RUSAGE_CHILDREN is the largest child the test process ever reaped
# (an engine a test before started), and RUSAGE_SELF keeps the forking parent's peak across fork and exec (Linux)
_PEAK_RSS = ("import atexit, re, runpy, sys\n"
             "atexit.register(lambda: print('peak_rss_kib', re.search(r'VmHWM:\\s+(\\d+)', "
             "open('/proc/self/status').read()).group(1), file=sys.stderr, flush=True))\n"
             "sys.argv = ['thinkgate', *sys.argv[1:]]\n"
             "runpy.run_module('gateway', run_name='__main__')")


def _migration(config: Path, url: str, target: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _PEAK_RSS, "redis", "migrate-placement", "--to", target,
                             "--quiet-s", "0", "--config", str(config)], cwd=REPO,
                            env={**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": url,
                                 "THINKGATE_REDIS__CLUSTER_PLACEMENT": target},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_kill_9_at_random_points_then_a_rerun_loses_and_doubles_nothing(redis_cluster: ClusterSet,
                                                                        upstream_sim: SimProcess,
                                                                        tmp_path: Path) -> None:
    """The command killed (SIGKILL) at random moments of each direction, then run to its end: every value of the
    shared placement exactly as it was after shared -> tenant -> shared, the tenant reads equal in between; each
    full run of N_KEYS keys bounded in time and memory."""
    from tests.gateway.test_placement_migration import _snap

    prefix = f"tgpk{uuid.uuid4().hex[:6]}:"
    url = redis_cluster.url
    cfg = serve_config(upstream_sim.base_url, tmp_path, prefix, auth={"keys": []},
                       redis={"start_if_missing": False})
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    asyncio.run(_many_keys(url, prefix, tmp_path))
    before = asyncio.run(_snap(redis_cluster, prefix))

    async def counters(placement: str) -> dict[str, Any]:
        async with stack(url, prefix, tmp_path / "r.jsonl", socket_timeout_s=10.0, placement=placement) as st:
            store = RedisKeyStore(st.handle, Breaker(1.0), cache_s=0)
            some = [f"k{i:05d}" for i in range(0, N_KEYS, 97)]
            return {"list": [(r.id, r.revoked is not None) for r in await store.list()],
                    "totals": [await st.meter.key_counters(i) for i in some],
                    "lookup": [await store.lookup(r.secret_sha256) is not None for r in await store.list()]}

    shared_reads = asyncio.run(counters("shared"))
    rng = random.Random(int(time.time()))
    for target in ("tenant", "shared"):
        for _ in range(3):
            proc = _migration(config, url, target)
            time.sleep(rng.uniform(0.8, 2.5))
            proc.kill()
            proc.communicate(timeout=30)
        t0 = time.monotonic()
        proc = _migration(config, url, target)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]
        peak = int(err.decode().rstrip().rsplit("\n", 1)[-1].split()[-1])
        assert peak < 1_000_000, peak  # KiB: the run's own peak memory, ~1 GB at most
        took = time.monotonic() - t0
        assert took < 120, took
        assert asyncio.run(counters(target)) == shared_reads, target
    assert asyncio.run(_snap(redis_cluster, prefix)) == before


# --- a spooled event replayed after shared -> tenant, its stream entry trimmed (metering.stream_maxlen) ------------


async def _trimmed(cluster: ClusterSet, prefix: str, tmp_path: Path) -> tuple[UsageEvent, dict[str, int]]:
    """alice's event counted (its reply lost: it stays in the writer's spool), then trimmed from the stream by 1,500
    of bob's (``stream_maxlen`` 1,000), under ``shared``; (that event, alice's counters)."""
    async with stack(cluster.url, prefix, tmp_path / "s.jsonl", socket_timeout_s=5.0,
                     stream_maxlen=1000) as st:
        first = UsageEvent(key_id="alice", requested_model="auto", tier="short", upstream_model="m",
                           route_reason="predicted", prompt_tokens=100, completion_tokens=10, ts=time.time())
        first.price(Prices(input_usd_per_mtok=Decimal("0.5"), output_usd_per_mtok=Decimal("2")))
        assert (await st.meter.record(first)).counted  # counted; its reply lost: it stays in the writer's spool
        more = []
        for _ in range(1500):
            ev = UsageEvent(key_id="bob", requested_model="auto", tier="short", upstream_model="m",
                            route_reason="predicted", prompt_tokens=1, completion_tokens=1, ts=time.time())
            ev.price(Prices(input_usd_per_mtok=Decimal("0.5"), output_usd_per_mtok=Decimal("2")))
            more.append(ev)
        for start in range(0, len(more), 500):
            await st.meter.record_many(more[start:start + 500])
        stream = await st.handle.client.xrange(st.meter.keys.events, "-", "+", count=1)
        assert b"alice" not in stream[0][1][b"e"]  # trimmed
        return first, await st.meter.key_counters("alice")


async def test_shared_to_tenant_refuses_while_counted_events_are_missing_from_the_stream(redis_cluster: ClusterSet,
                                                                                         tmp_path: Path) -> None:
    """The stream no longer holds an event the day's seen-set counts: its key cannot be seeded, and its replay after
    the move would count twice in its key (below) — the migration refuses, before writing anything, saying what
    to do (was: it moved, and the replay double-counted)."""
    prefix = _prefix()
    await _trimmed(redis_cluster, prefix, tmp_path)
    with pytest.raises(MigrationRefused, match="no longer in the stream") as refused:
        await _migrate(redis_cluster, prefix, "tenant", tmp_path)
    assert "spool" in str(refused.value) and "--force" in str(refused.value)
    async with stack(redis_cluster.url, prefix, tmp_path / "c.jsonl", socket_timeout_s=5.0) as st:
        k = st.meter.keys
        assert not await st.handle.client.exists(k.placement_migration)  # nothing written, no marker
        assert (await st.meter.key_counters("alice"))["requests"] == 1  # still where shared reads it


@pytest.mark.xfail(strict=True, reason="known gap under --force: the keys' own seen-sets are seeded from the stream "
                   "only; an event trimmed from it (metering.stream_maxlen) but still in the dedup window is not "
                   "seeded, and its replay after the move counts it again in its key (placement_migration._seed_seen; "
                   "without --force the migration refuses: the test above)")
async def test_a_replay_of_an_event_trimmed_from_the_stream_counts_once(redis_cluster: ClusterSet,
                                                                      tmp_path: Path) -> None:
    prefix = _prefix()
    first, spent = await _trimmed(redis_cluster, prefix, tmp_path)
    await _migrate(redis_cluster, prefix, "tenant", tmp_path, force=True)
    async with stack(redis_cluster.url, prefix, tmp_path / "t.jsonl", socket_timeout_s=5.0, placement="tenant",
                     stream_maxlen=1000) as st:
        await st.spool.append([first])
        await st.meter.replay()
        assert await st.meter.key_counters("alice") == spent


# --- a gateway left running, without write-ahead (no heartbeat), idle past --quiet-s -------------------------------


def test_a_running_gateway_without_write_ahead_is_seen(redis_cluster: ClusterSet, upstream_sim: SimProcess,
                                                       tmp_path: Path) -> None:
    """An operator who forgot one gateway (``metering.write_ahead: false``: no heartbeat), idle for longer than
    ``--quiet-s``: the command must refuse, or that gateway's next requests are metered under the old names, where
    the new placement never reads them (spend lost from every budget)."""
    prefix = f"tgpw{uuid.uuid4().hex[:6]}:"
    url = redis_cluster.url
    auth = {"keys": [{"id": "cfgkey", "secret": "tg-cfg-secret-000000000000000"}],
            "admin_key_sha256": hashlib.sha256(ADMIN_SECRET.encode()).hexdigest()}
    cfg = serve_config(upstream_sim.base_url, tmp_path, prefix, auth=auth, metering={"write_ahead": False},
                       redis={"start_if_missing": False})
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**cfg, "redis": {**cfg["redis"], "cluster_placement": "tenant"}}))
    with serve(cfg, tmp_path, {"THINKGATE_REDIS__URL": url}, wait="/ready") as sp:
        assert _chat(sp.base_url, "tg-cfg-secret-000000000000000", "hi").status_code == 200
        time.sleep(2.5)  # idle past --quiet-s 2
        got = _cli(["redis", "migrate-placement", "--to", "tenant", "--quiet-s", "2"], config, url, "tenant")
        assert got.returncode == 2 and "gateway" in got.stderr, (got.returncode, got.stdout, got.stderr)
    # stopped: the same command runs
    got = _cli(["redis", "migrate-placement", "--to", "tenant", "--quiet-s", "2"], config, url, "tenant")
    assert got.returncode == 0, got.stderr


# --- tenant -> shared: keys' own seen-sets of a day whose shared seen-set is gone ---------------------------------


async def test_keys_seen_sets_of_a_day_without_a_shared_one_merge_without_conflict(redis_cluster: ClusterSet,
                                                                                   tmp_path: Path) -> None:
    """The shared seen-set of a day expired a moment before the keys' own (each key part renews its set after the
    shared part renewed the shared one): the first key's set is copied there, the others merged into it — not
    reported as a conflict that leaves the migration marked (exit 1)."""
    prefix = _prefix()
    async with stack(redis_cluster.url, prefix, tmp_path / "s.jsonl", socket_timeout_s=5.0,
                     placement="tenant") as st:
        evs = []
        for key_id in ("alice", "bob", "carol"):
            ev = UsageEvent(key_id=key_id, requested_model="auto", tier="short", upstream_model="m",
                            route_reason="predicted", prompt_tokens=10, completion_tokens=1, ts=time.time())
            ev.price(Prices(input_usd_per_mtok=Decimal("0.5"), output_usd_per_mtok=Decimal("2")))
            assert (await st.meter.record(ev)).counted
            evs.append(ev)
        await st.handle.client.delete(st.meter.keys.seen(evs[0].day))
    report = await _migrate(redis_cluster, prefix, "shared", tmp_path)
    assert not report.conflicts, report.conflicts
    async with stack(redis_cluster.url, prefix, tmp_path / "t.jsonl", socket_timeout_s=5.0) as st:
        seen = st.meter.keys.seen(evs[0].day)
        assert await st.handle.client.smembers(seen) == {e.event_id.encode() for e in evs}
        assert await st.handle.client.ttl(seen) > 0
        assert await placement_conflict(st.handle) is None
