"""``thinkgate redis migrate-placement`` on a real 3-master Redis Cluster: each API key's own data moved between
``redis.cluster_placement: shared`` and ``tenant`` (``gateway/state/placement_migration.py``).

What must hold, each checked against the real cluster: every moved value byte-equal under its new name and gone from
its old one, every other key untouched; the new placement's own code paths (key store lookups and listing, counters,
cubes, a replayed event, ``thinkgate serve``'s ``/usage``) read what the old one did; a dry run writes nothing; a
run stopped midway is finished by a rerun with every counter as it was; both directions; and the refusals (a live
gateway, the wrong ``--to``, gateways of either placement while a migration is unfinished)."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.auth.redis_store import RedisKeyStore
from gateway.ledger.aggregate import DAY_S, day_start
from gateway.ledger.event import UsageEvent
from gateway.state import placement_migration
from gateway.state.breaker import Breaker
from gateway.state.keys import PER_KEY_NAMES, RedisKeys, key_tenant
from gateway.state.placement import placement_conflict
from gateway.state.placement_migration import Migration, live_writers
from gateway.state.redis import cluster_prefix
from tests.fixtures.gateway import ADMIN_SECRET
from tests.fixtures.gateway_process import REPO, serve, serve_config
from tests.fixtures.redis_cluster import ClusterSet
from tests.fixtures.redis_stack import Stack, snapshot, stack
from tests.fixtures.upstream import SimProcess
from tests.fixtures.usage_events import usage_event

STORED = ("alice", "bob", "carol")  # made in the key store; carol revoked
CONFIG_KEY = "cfgkey"  # a key of the config file: counters, no record
REFUSED_ONLY = "dora"  # only refused requests: a cube, no counters (listed only in the day's cube key set)
IDS = (*STORED, CONFIG_KEY, REFUSED_ONLY)


def _event(key: str, i: int, ts: float, *, audit: bool = False) -> UsageEvent:
    return usage_event(key, i, ts=ts, tags={"team": "a"} if key == "alice" else {}, audit=audit)


@dataclass
class Fleet:
    """What :func:`_populate` wrote: the secrets, the events, and the parameters of the per-key names."""

    secrets: dict[str, str]
    events: list[UsageEvent]
    windows: list[int]
    digests: list[str] = field(default_factory=list)

    @property
    def days(self) -> list[str]:
        return sorted({e.day for e in self.events})

    @property
    def months(self) -> list[str]:
        return sorted({e.month for e in self.events})


def _prefix() -> str:
    return f"tgpm{uuid.uuid4().hex[:6]}:"


@asynccontextmanager
async def _stack(cluster: ClusterSet, prefix: str, placement: str, tmp: Path) -> AsyncIterator[Stack]:
    async with stack(cluster.url, prefix, tmp / f"spool-{placement}-{uuid.uuid4().hex[:4]}.jsonl",
                     socket_timeout_s=5.0, placement=placement) as st:
        yield st


async def _populate(cluster: ClusterSet, prefix: str, placement: str, tmp: Path) -> Fleet:
    """Keys in the key store (one revoked), spend on three days over two months, a config key's, a refused-only
    key's cube, an open reservation and RPM/TPM windows — under ``placement``."""
    now = time.time()
    async with _stack(cluster, prefix, placement, tmp) as st:
        store = RedisKeyStore(st.handle, Breaker(1.0), cache_s=0)
        secrets = {k: await store.create(k, budget_usd_day=Decimal(5), rpm=100) for k in STORED}
        await store.revoke("carol")
        events = [_event("alice", 0, now), _event("alice", 1, now), _event("alice", 2, now - DAY_S),
                  _event("alice", 3, now - 40 * DAY_S), _event("bob", 4, now), _event("carol", 5, now - DAY_S),
                  _event(CONFIG_KEY, 6, now), _event(REFUSED_ONLY, 7, now, audit=True)]
        for ev in events:
            assert (await st.meter.record(ev)).counted
        k, r, minute = st.meter.keys, st.handle.client, int(now * 1000) // 60_000
        await r.hset(k.reservations("alice"), "r-open", f"9000|50|{int(now * 1000) + 600_000}")
        await r.pexpire(k.reservations("alice"), 600_000)
        for w in (minute - 1, minute):
            await r.set(k.rpm("alice", w), 3, px=120_000)
            await r.set(k.tpm("alice", w), 700, px=120_000)
        digests = [hashlib.sha256(s.encode()).hexdigest() for s in secrets.values()]
    return Fleet(secrets, events, [minute - 1, minute], digests)


async def _snap(cluster: ClusterSet, prefix: str) -> dict[str, tuple[str, Any, bool]]:
    """Every key of the test's prefix on every master — the shared slot's and every tenant's — with its type, its
    content (bytes: a byte-equal comparison) and whether it has a TTL."""
    async with _stack(cluster, prefix, "shared", Path("/tmp")) as st:
        return {k.decode(): v for k, v in (await snapshot(st, match="{" + prefix + "*")).items()}


def _renames(prefix: str, source: str, fleet: Fleet) -> dict[str, tuple[str, str]]:
    """old name → (new name, kind) of every per-key name the fleet can have (most do not exist)."""
    old, new = RedisKeys(cluster_prefix(prefix), source), RedisKeys(cluster_prefix(prefix),
                                                                    "tenant" if source == "shared" else "shared")
    params = {"": [""], "day": fleet.days, "month": fleet.months, "window": [str(w) for w in fleet.windows],
              "secret": fleet.digests}
    out: dict[str, tuple[str, str]] = {}
    for spec in PER_KEY_NAMES:
        if spec.shared_when_shared:
            continue  # the keys' own seen-sets: seeded / merged, checked apart
        for key_id, param in itertools.product(IDS, params[spec.param]):
            out[old.per_key_name(spec, key_id, param)] = (new.per_key_name(spec, key_id, param), spec.builder)
    return out


def _assert_moved(before: dict[str, Any], after: dict[str, Any], prefix: str, source: str,
                  fleet: Fleet) -> dict[str, tuple[str, str]]:
    """Every per-key name of ``before`` byte-equal under its new name and gone under its old; every other name of
    ``before`` unchanged. Returns the renames that applied."""
    moved = {o: nk for o, nk in _renames(prefix, source, fleet).items() if o in before}
    # every kind the fleet has was there to move (a kind dropped from PER_KEY_NAMES is caught below too)
    assert {kind for _, kind in moved.values()} == {"key_record", "key_by_hash", "key_total", "reservations",
                                                     "key_day", "key_month", "agg_cube", "rpm", "tpm"}
    for o, (n, kind) in moved.items():
        assert o not in after, (kind, o)
        assert after.get(n) == before[o], (kind, o, n)
    for name in before.keys() - moved.keys():
        if source == "tenant" and name in _key_seen_sets(prefix, "tenant", fleet):
            continue  # merged into the shared ones, then deleted (checked by the caller)
        assert after.get(name) == before[name], name
    return moved


def _key_seen_sets(prefix: str, placement: str, fleet: Fleet) -> set[str]:
    k = RedisKeys(cluster_prefix(prefix), placement)
    return {k.key_seen(i, d) for i in IDS for d in fleet.days}


def _no_key_data_left_in(after: Iterable[str], prefix: str, source: str) -> None:
    """An independent look (not through PER_KEY_NAMES): no name of the old placement's per-key forms is left."""
    old = RedisKeys(cluster_prefix(prefix), source)
    if source == "shared":  # the shared slot names no key id, and holds no lookup copy
        shared = [n for n in after if n.startswith(old.prefix)]
        assert not [n for n in shared if any(f":{i}" in n for i in IDS) or ":keys:h:" in n or "}keys:h:" in n]
    else:  # no tenant slot of a key holds anything (this test writes no cache entries), no secret slot either
        tags = {old.tenant(key_tenant(i)) for i in IDS}
        assert not [n for n in after if any(n.startswith(t) for t in tags) or ("keys:h:" in n and
                    not n.startswith(old.prefix))]


async def _reads(cluster: ClusterSet, prefix: str, placement: str, fleet: Fleet, tmp: Path) -> dict[str, Any]:
    """What ``placement``'s own code reads: key lookups, the key list, every key's counters, the grouped cubes."""
    async with _stack(cluster, prefix, placement, tmp) as st:
        store = RedisKeyStore(st.handle, Breaker(1.0), cache_s=0)
        looked = {}
        for key_id, secret in fleet.secrets.items():
            info = await store.lookup(hashlib.sha256(secret.encode()).hexdigest())
            looked[key_id] = info.id if info is not None else None
        counters = {(i, p): await st.meter.key_counters(i, **({} if p is None else {p[0]: p[1]}))
                    for i in IDS for p in [None, *(("day", d) for d in fleet.days),
                                           *(("month", m) for m in fleet.months)]}
        start = day_start(fleet.days[0])
        grouped = await st.meter.grouped(["key", "day"], start, start + DAY_S * (len(fleet.days) + 45))
        return {"lookup": looked, "list": sorted((r.id, r.revoked is not None) for r in await store.list()),
                "counters": counters, "grouped": sorted(map(str, grouped.rows)),
                "conflict": await placement_conflict(st.handle)}


async def _migrate(cluster: ClusterSet, prefix: str, target: str, tmp: Path, **kw: Any) -> Any:
    async with _stack(cluster, prefix, target, tmp) as st:
        return await Migration(st.handle, st.metering_cfg, extra_ids=[CONFIG_KEY], **kw).run()


def test_every_name_that_moves_with_the_placement_is_listed() -> None:
    """Every RedisKeys name that differs between the placements is in PER_KEY_NAMES (or is a budget-level builder
    that returns one of them): a new per-key name added without it fails here, before a migration leaves it behind.
    And the parametrised names end ``…:{param}``, which the migration's SCAN attribution relies on."""
    shared, tenant = RedisKeys(cluster_prefix("tg:")), RedisKeys(cluster_prefix("tg:"), "tenant")
    differing = set()
    for name, fn in inspect.getmembers(RedisKeys, inspect.isfunction):
        if name.startswith("_") or name == "per_key_name":
            continue
        n = len(inspect.signature(fn).parameters) - 1
        for args in itertools.product(["key", "alice", "7", "2026-01-02"], repeat=n):
            if getattr(shared, name)(*args) != getattr(tenant, name)(*args):
                differing.add(name)
    listed = {s.builder for s in PER_KEY_NAMES}
    assert differing == listed | {"level_day", "level_month", "level_reservations"}
    for spec, keys in itertools.product(PER_KEY_NAMES, (shared, tenant)):
        if spec.param in ("day", "month", "window"):
            head = keys.per_key_name(spec, "a:b", "")
            assert head.endswith(":") and keys.per_key_name(spec, "a:b", "2026-01-02") == head + "2026-01-02"


async def test_shared_to_tenant_moves_every_value_byte_equal(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    """The move itself, and the tenant code paths reading the moved data as the shared ones did; a spooled event
    replayed after the move is not counted again in its key (the key's own seen-set seeded from the stream)."""
    prefix = _prefix()
    fleet = await _populate(redis_cluster, prefix, "shared", tmp_path)
    # the reads first: a grouped read marks complete days in the cube index (a write)
    reads = await _reads(redis_cluster, prefix, "shared", fleet, tmp_path)
    before = await _snap(redis_cluster, prefix)
    assert reads["lookup"] == {"alice": "alice", "bob": "bob", "carol": None}
    assert (await _reads(redis_cluster, prefix, "tenant", fleet, tmp_path))["conflict"] is not None

    report = await _migrate(redis_cluster, prefix, "tenant", tmp_path)
    after = await _snap(redis_cluster, prefix)
    moved = _assert_moved(before, after, prefix, "shared", fleet)
    _no_key_data_left_in(after, prefix, "shared")
    assert sum(report.moved.values()) - report.moved["key_seen"] == len(moved) and not report.conflicts
    assert not report.left  # every per-key name had a known id (dora's from the cube index, cfgkey's given)
    # per destination master: every name written counted where it went
    assert sum(report.by_master.values()) == sum(report.moved.values())
    assert report.by_master == Counter(f"127.0.0.1:{redis_cluster.master_of(n)}" for n, _ in moved.values()) + \
        Counter(f"127.0.0.1:{redis_cluster.master_of(n)}" for n in _key_seen_sets(prefix, "tenant", fleet)
                if n in after)
    # the only new names besides the moved ones: each key's own seen-set of each day, holding its events' ids
    seeded = after.keys() - before.keys() - {n for n, _ in moved.values()}
    want: dict[str, set[bytes]] = {}
    t = RedisKeys(cluster_prefix(prefix), "tenant")
    for ev in fleet.events:
        want.setdefault(t.key_seen(ev.key_id, ev.day), set()).add(ev.event_id.encode())
    assert {n: set(after[n][1]) for n in seeded} == want and all(after[n][2] for n in seeded)
    # the tenant code paths read what the shared ones did
    assert await _reads(redis_cluster, prefix, "tenant", fleet, tmp_path) == {**reads, "conflict": None}
    async with _stack(redis_cluster, prefix, "tenant", tmp_path) as st:
        today = fleet.events[0]
        total = await st.meter.key_counters("alice")
        await st.spool.append([today])  # counted before the move, its reply lost: a replay must not count it again
        await st.meter.replay()
        assert await st.meter.key_counters("alice") == total
        assert (await st.meter.record(_event("alice", 9, time.time()))).counted  # new spend adds on the old
        assert (await st.meter.key_counters("alice"))["requests"] == total["requests"] + 1


async def test_a_dry_run_writes_nothing_and_counts_what_moves(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    prefix = _prefix()
    await _populate(redis_cluster, prefix, "shared", tmp_path)
    before = await _snap(redis_cluster, prefix)
    dry = await _migrate(redis_cluster, prefix, "tenant", tmp_path, dry_run=True)
    assert await _snap(redis_cluster, prefix) == before
    assert dry.moved["key_record"] == 3 and dry.moved["key_by_hash"] == 2  # carol's copy went with her revoke
    real = await _migrate(redis_cluster, prefix, "tenant", tmp_path)
    assert (dry.moved, dry.by_master, dry.seeded) == (real.moved, real.by_master, real.seeded)
    assert "would move" in dry.summary() and "moved" in real.summary()


async def test_a_run_stopped_midway_is_finished_by_a_rerun(redis_cluster: ClusterSet, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs interrupted (in the per-id phase, then in the scan), and names copied but not deleted (a crash
    between a batch's RESTOREs and its DELs): gateways of both placements refuse meanwhile, and a rerun leaves every
    value as the original, none counted twice, none lost."""
    prefix = _prefix()
    fleet = await _populate(redis_cluster, prefix, "shared", tmp_path)
    # the reads first: a grouped read marks complete days in the cube index (a write)
    reads = await _reads(redis_cluster, prefix, "shared", fleet, tmp_path)
    before = await _snap(redis_cluster, prefix)
    monkeypatch.setattr(placement_migration, "BATCH", 4)
    monkeypatch.setattr(placement_migration, "SCAN_COUNT", 5)

    class Stop(Exception):
        pass

    def stop_in(phase: str) -> Any:
        def progress(name: str, done: int, total: int | None) -> None:
            if name.startswith(phase):
                raise Stop(name)
        return progress

    with pytest.raises(Stop):
        await _migrate(redis_cluster, prefix, "tenant", tmp_path, progress=stop_in("key records"))
    for placement in ("shared", "tenant"):
        async with _stack(redis_cluster, prefix, placement, tmp_path) as st:
            assert "stopped before its end" in (await placement_conflict(st.handle) or "")
    # a crash between RESTORE and DEL: some names copied, their old copy still there
    renames = _renames(prefix, "shared", fleet)
    async with _stack(redis_cluster, prefix, "shared", tmp_path) as st:
        r, copied = st.handle.client, 0
        for old, (new, kind) in renames.items():
            if kind in ("key_day", "agg_cube") and await r.exists(old) and not await r.exists(new):
                await r.restore(new, max(int(await r.pttl(old)), 0), await r.dump(old))
                copied += 1
    assert copied >= 4
    with pytest.raises(Stop):
        await _migrate(redis_cluster, prefix, "tenant", tmp_path, progress=stop_in("day, month"))
    report = await _migrate(redis_cluster, prefix, "tenant", tmp_path)
    assert report.finished >= 1 and not report.conflicts
    after = await _snap(redis_cluster, prefix)
    _assert_moved(before, after, prefix, "shared", fleet)
    _no_key_data_left_in(after, prefix, "shared")
    assert await _reads(redis_cluster, prefix, "tenant", fleet, tmp_path) == {**reads, "conflict": None}
    again = await _migrate(redis_cluster, prefix, "tenant", tmp_path)  # a rerun after the end: nothing to do
    assert sum(again.moved.values()) == again.moved["key_seen"] and again.finished == 0
    assert await _snap(redis_cluster, prefix) == after


async def test_tenant_to_shared_and_back(redis_cluster: ClusterSet, tmp_path: Path) -> None:
    """The reverse direction: byte-equal again, the keys' own seen-sets merged into the shared ones and deleted, the
    shared code paths reading what the tenant ones did; and back to tenant, every key as it first was."""
    prefix = _prefix()
    fleet = await _populate(redis_cluster, prefix, "tenant", tmp_path)
    reads = await _reads(redis_cluster, prefix, "tenant", fleet, tmp_path)
    before = await _snap(redis_cluster, prefix)
    own_seen = _key_seen_sets(prefix, "tenant", fleet) & before.keys()
    assert own_seen
    report = await _migrate(redis_cluster, prefix, "shared", tmp_path)
    assert report.moved["key_seen"] == len(own_seen) and not report.conflicts
    after = await _snap(redis_cluster, prefix)
    _assert_moved(before, after, prefix, "tenant", fleet)
    _no_key_data_left_in(after, prefix, "tenant")
    assert not own_seen & after.keys()
    assert await _reads(redis_cluster, prefix, "shared", fleet, tmp_path) == {**reads, "conflict": None}
    await _migrate(redis_cluster, prefix, "tenant", tmp_path)
    assert await _snap(redis_cluster, prefix) == before


async def test_tenant_to_shared_completes_a_pending_key_part_first(redis_cluster: ClusterSet,
                                                                   tmp_path: Path) -> None:
    """A writer that died between an event's shared part and its key part left the key part pending, naming the
    tenant keys: the migration completes it before moving them, so the key's counters hold the event once."""
    prefix = _prefix()
    async with _stack(redis_cluster, prefix, "tenant", tmp_path) as st:
        k, r = st.meter.keys, st.handle.client
        ev = _event("dave", 1, time.time())
        await r.set(k.key_total("dave"), "not a hash")  # the key part refused: the event stays pending
        assert (await st.meter.record(ev)).stored == "dead_letter"
        st.meter.dead.path.unlink()  # the writer and its files are gone: only Redis knows of the event
        await r.delete(k.key_total("dave"))
        assert await r.hlen(k.pending) == 1
    report = await _migrate(redis_cluster, prefix, "shared", tmp_path)
    assert report.pending == 1
    async with _stack(redis_cluster, prefix, "shared", tmp_path) as st:
        assert await st.handle.client.hlen(st.meter.keys.pending) == 0
        assert (await st.meter.key_counters("dave"))["cost_micro_usd"] == ev.cost_micro_usd
        assert (await st.meter.key_counters("dave", day=ev.day))["requests"] == 1
        assert not (await st.meter.record(ev)).counted


async def test_a_pending_key_part_redis_still_refuses_stops_the_run_with_what_to_do(redis_cluster: ClusterSet,
                                                                                      tmp_path: Path) -> None:
    """A pending key part Redis still refuses (its key's counter is of the wrong type): the run stops before moving
    anything with the refusal the command prints (exit 2), naming the name to fix and saying that the marker stays
    (it was a raw ``ResponseError`` after the marker was set); once the name is fixed, a rerun completes the part."""
    prefix = _prefix()
    async with _stack(redis_cluster, prefix, "tenant", tmp_path) as st:
        k, r = st.meter.keys, st.handle.client
        ev = _event("dave", 1, time.time())
        await r.set(k.key_total("dave"), "not a hash")
        assert (await st.meter.record(ev)).stored == "dead_letter"
        st.meter.dead.path.unlink()
        before = await _snap(redis_cluster, prefix)
    with pytest.raises(placement_migration.MigrationRefused) as refused:
        await _migrate(redis_cluster, prefix, "shared", tmp_path)
    assert k.key_total("dave") in str(refused.value) and "run this again" in str(refused.value), refused.value
    after = await _snap(redis_cluster, prefix)
    marker = RedisKeys(cluster_prefix(prefix), "shared").placement_migration
    assert marker in after and {n: v for n, v in after.items() if n != marker} == before  # nothing else written
    async with _stack(redis_cluster, prefix, "tenant", tmp_path) as st:
        await st.handle.client.delete(k.key_total("dave"))
    report = await _migrate(redis_cluster, prefix, "shared", tmp_path)
    assert report.pending == 1 and not report.conflicts
    async with _stack(redis_cluster, prefix, "shared", tmp_path) as st:
        assert (await st.meter.key_counters("dave"))["cost_micro_usd"] == ev.cost_micro_usd
        assert not await st.handle.client.exists(marker)


def _cli(args: list[str], config: Path, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args, "--config", str(config)], cwd=REPO,
                          env={**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": url},
                          capture_output=True, text=True, timeout=120)


def test_the_command_then_serve_with_the_new_placement(redis_cluster: ClusterSet, upstream_sim: SimProcess,
                                                       tmp_path: Path) -> None:
    """``thinkgate redis migrate-placement``: refused with the wrong ``--to`` and while a gateway looks alive (a
    recent event, a heartbeat), a dry run that prints and writes nothing, the run; then ``thinkgate keys list`` and
    ``thinkgate serve`` with ``tenant`` authenticate the old keys and read their spend and budgets as before."""
    prefix = _prefix()
    fleet = asyncio.run(_populate(redis_cluster, prefix, "shared", tmp_path))
    reads = asyncio.run(_reads(redis_cluster, prefix, "shared", fleet, tmp_path))
    auth = {"keys": [], "admin_key_sha256": hashlib.sha256(ADMIN_SECRET.encode()).hexdigest()}
    cfg = serve_config(upstream_sim.base_url, tmp_path, prefix, auth=auth,
                       redis={"cluster_placement": "tenant", "start_if_missing": False})
    path = tmp_path / "tenant.yaml"
    path.write_text(yaml.safe_dump(cfg))
    url = redis_cluster.url
    before = asyncio.run(_snap(redis_cluster, prefix))

    wrong = _cli(["redis", "migrate-placement", "--to", "shared"], path, url)
    assert wrong.returncode == 2 and "redis.cluster_placement: shared" in wrong.stderr, wrong.stderr
    busy = _cli(["redis", "migrate-placement", "--to", "tenant"], path, url)  # the events were written just now
    assert busy.returncode == 2 and "usage event was written" in busy.stderr, busy.stderr
    dry = _cli(["redis", "migrate-placement", "--to", "tenant", "--dry-run"], path, url)
    assert dry.returncode == 0 and "would move" in dry.stdout and "key_record" in dry.stdout, dry.stderr
    assert asyncio.run(_snap(redis_cluster, prefix)) == before

    async def beat(on: bool) -> bool:
        async with _stack(redis_cluster, prefix, "tenant", tmp_path) as st:
            name = st.meter.keys.heartbeat("some-gateway")
            await (st.handle.client.set(name, b"1", px=60_000) if on else st.handle.client.delete(name))
            return await live_writers(st.handle, 0) is not None

    assert asyncio.run(beat(True))
    alive = _cli(["redis", "migrate-placement", "--to", "tenant", "--quiet-s", "0"], path, url)
    assert alive.returncode == 2 and "heartbeat" in alive.stderr, alive.stderr
    assert not asyncio.run(beat(False))
    run = _cli(["redis", "migrate-placement", "--to", "tenant", "--quiet-s", "0"], path, url)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().count("\n") == 0 and run.stdout.startswith("placement shared -> tenant:"), run.stdout
    listed = _cli(["keys", "list"], path, url)
    assert listed.returncode == 0 and "alice" in listed.stdout and "carol" in listed.stdout, listed.stderr

    with serve(cfg, tmp_path, {"THINKGATE_REDIS__URL": url}, wait="/ready") as sp:
        mine = httpx.get(sp.base_url + "/usage", headers={"authorization": f"Bearer {fleet.secrets['alice']}"},
                         timeout=30)
        assert mine.status_code == 200, mine.text
        today = time.strftime("%Y-%m-%d", time.gmtime())
        spent = reads["counters"][("alice", ("day", today))]["cost_micro_usd"]
        assert mine.json()["counters"]["day"]["requests"] == reads["counters"][("alice", ("day", today))]["requests"]
        assert mine.json()["counters"]["total"]["requests"] == reads["counters"][("alice", None)]["requests"]
        budget = next(b for b in mine.json()["budgets"] if b["level"] == "key" and b["period"] == "day")
        assert Decimal(budget["spent_usd"]) == Decimal(spent) / 1_000_000 and Decimal(budget["budget_usd"]) == 5
        revoked = httpx.get(sp.base_url + "/usage", headers={"authorization": f"Bearer {fleet.secrets['carol']}"},
                            timeout=30)
        assert revoked.status_code == 401


@pytest.mark.parametrize("url", ["redis://127.0.0.1:{port}/0", "redis+cluster://127.0.0.1:{port}"])
def test_the_command_off_a_cluster_or_unreachable(url: str, monkeypatch: pytest.MonkeyPatch,
                                                  port_lease: Callable[[], int]) -> None:
    """One server: nothing to move (the names are the same under both placements), exit 2 saying so. A cluster that
    does not answer: one line, exit 3, as every offline command."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    monkeypatch.setenv("THINKGATE_REDIS__URL", url.format(port=port_lease()))
    monkeypatch.setenv("THINKGATE_REDIS__CLUSTER_PLACEMENT", "tenant")
    monkeypatch.setenv("THINKGATE_REDIS__START_IF_MISSING", "false")
    r = CliRunner().invoke(app, ["redis", "migrate-placement", "--to", "tenant"])
    if url.startswith("redis://"):
        assert r.exit_code == 2 and "only matters on a Redis Cluster" in r.output, r.output
    else:
        assert r.exit_code == 3 and "Redis unreachable" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


async def test_a_name_the_scan_returns_twice_in_one_batch_is_moved_once_not_a_conflict(redis_cluster: ClusterSet,
                                                                                      tmp_path: Path) -> None:
    """SCAN returns a name twice when the table is rehashed during the scan (the run's own DELs shrink it): both in one
    batch, the second RESTORE met the first's copy (BUSYKEY) and the run ended in a conflict, exit 1, the marker left
    (a fresh-clone CI run hit it on 2,000 keys). Now the pair is moved once, and a new name that appeared meanwhile
    with the same data is taken as copied."""
    prefix = _prefix()
    fleet = await _populate(redis_cluster, prefix, "shared", tmp_path)
    old, new = RedisKeys(cluster_prefix(prefix), "shared"), RedisKeys(cluster_prefix(prefix), "tenant")
    day = next(s for s in PER_KEY_NAMES if s.builder == "key_day")
    pair = (day, old.per_key_name(day, "alice", fleet.days[0]), new.per_key_name(day, "alice", fleet.days[0]))
    async with _stack(redis_cluster, prefix, "tenant", tmp_path) as st:
        before = await st.handle.client.dump(pair[1])
        assert before is not None
        migration = Migration(st.handle, st.meter.cfg)
        await migration._move([pair, pair])
        assert migration.report.conflicts == [], migration.report.conflicts
        assert migration.report.moved["key_day"] == 1
        r = st.handle.client
        assert await r.exists(pair[1]) == 0 and await r.dump(pair[2]) == before
