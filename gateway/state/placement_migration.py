"""Move each API key's own data between ``redis.cluster_placement: shared`` and ``tenant`` on a Redis Cluster
(``thinkgate redis migrate-placement``, ``gateway/cli/redis_ops.py``).

**What moves.** For every API key id — the key store's id set and ``usage:keys`` (both shared), every id in a day's
cube key set ``usage:agg:d:{day}:keys`` (a key that only had refused requests has a cube and no counters), and the
ids the caller adds (the config's ``auth.keys``, the gateway's own ids) — every name of
:data:`~gateway.state.keys.PER_KEY_NAMES`, each from its name under the old placement to its name under the new one
(:meth:`RedisKeys.per_key_name`: the list is ``RedisKeys``'s own, so a new per-key name cannot be forgotten here):

- the names without a parameter (record, all-time counters, reservations) by name, per id; the lookup copy by the
  digest its record holds (a revoked key has none);
- the per-day, per-month and per-window names (counters, cubes, RPM/TPM windows) by **SCAN** with a MATCH on the old
  prefix, on the masters that hold the old names (under ``shared`` only the master of the ``{tg:}`` slot). SCAN
  rather than building each day's name: a key's day and month counters are indexed by day nowhere (the cube index
  ``usage:agg:d:{day}:keys`` covers only cubes, and only from the day cubes existed or were backfilled), their TTL
  (400 / 800 days) has changed before, and RPM/TPM windows are minute numbers; a SCAN finds exactly the names that
  exist, once per master, filtered server-side. Each name found is attributed by its head (the name less its
  parameter, which never holds a ``:``) to a known id; a name of a per-key form whose id is unknown is counted in
  :attr:`MigrationReport.left` and left where it is.
- The key's own seen-set (``key_seen``) is the one exception: under ``shared`` that name *is* the day's shared
  seen-set (every event's id, the shared part's idempotency), so it is never moved. ``shared`` → ``tenant``: each
  key's own seen-set is *seeded* with the ids of its events still in the dedup window, read from the stream — a
  spooled event replayed after the move (its reply lost before it, say) then finds its id in the key's set and is not
  counted in the key's counters again (``gateway/state/metering.py``, ``_run_split``'s ``replay``). ``tenant`` →
  ``shared``: each key's set is merged into the day's shared one (a subset of it already: the shared part is counted
  first), then deleted.

**How a name moves: copy, then delete.** ``PTTL`` and ``DUMP`` of the old name, ``RESTORE`` of the new one with the
remaining TTL (no ``REPLACE``: a new name that exists is never overwritten), then ``DEL`` of the old one. A run that
stops anywhere (a crash, Ctrl-C, an outage) is finished by running it again: a name already moved has no old copy
(nothing to do), one copied but not deleted has two equal copies (the old one is deleted: ``DUMP`` payloads
compared), one not copied yet is copied. Values are copied, never added, so no counter is counted twice or lost. A new
name that holds *other* data than the old one (a gateway of the new placement wrote there: not the offline
migration this is) is left with its old name as it is and reported in :attr:`MigrationReport.conflicts`. A TTL'd
window that expires meanwhile is simply gone. Before any move, under ``tenant``, the key parts left pending by a
writer that died (``usage:pending``) are completed under the old names (:meth:`Meter.finish_pending`): their stored
calls name the old keys. Likewise, under ``tenant``, the key creates that never committed (``keys:pending``: a
``thinkgate keys create`` that crashed between its steps, ``gateway/auth/redis_store.py``) are rolled back first
(``repair_creates``, the key store's own repair with no grace period: the migration is offline, and a create still
running would find its commit refused and clean up after itself): ``shared`` has no pending entries, so a
half-written record moved there would be listed as an active key nobody holds the secret of, and its id could never
be rolled back. The migration refuses while any is left.

**Offline.** A gateway writing meanwhile would write under its own placement's names, behind the move: every gateway
must be stopped (every replica drained) and no other CLI command run. :func:`live_writers` refuses when the cluster
shows one (a gateway's named connection, a live process's heartbeat, or a usage event written within ``quiet_s``).
While a migration runs, and after one that stopped before its end, :data:`RedisKeys.placement_migration` is set and
every gateway and CLI command of either placement refuses to start (``gateway/state/placement.py``); a complete
run deletes it.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ResponseError

from gateway.config import MeteringConfig
from gateway.ledger.aggregate import day_start
from gateway.ledger.event import UsageEvent
from gateway.state.breaker import Breaker
from gateway.state.keys import PER_KEY_NAMES, PerKeyName, RedisKeys, key_tenant, secret_tag
from gateway.state.metering import Meter
from gateway.state.redis import RedisHandle, as_bytes, as_text, writer_name
from gateway.state.spool import Spool

#: names moved per pipelined batch (each batch: one pipeline of PTTL/DUMP reads, one of RESTOREs, one of DELs)
BATCH = 500
SCAN_COUNT = 1000
#: extra stream history read to seed the keys' own seen-sets, beyond metering.dedup_ttl_s (s): an event's stream id is
#: its write time, up to a day after its ts for a late replay, and the seen-sets of a day live from that day
SEED_MARGIN_S = 2 * 86400
PARAM_FORMS = {"day": r"\d{4}-\d{2}-\d{2}", "month": r"\d{4}-\d{2}", "window": r"\d+", "secret": r"[0-9a-f]{64}"}
_ID, _PARAM = "\x01", "\x02"  # sentinels a real id or parameter never holds (for the name forms)

#: progress callback: (phase, done, total or None when unknown) — cumulative for the phase
Progress = Callable[[str, int, int | None], None]
#: rolls back the half-written key creates of the ``tenant`` handle given (``thinkgate keys repair --apply`` with no
#: grace period: ``gateway/cli/redis_ops.py`` gives the key store's); returns how many it rolled back
RepairCreates = Callable[[RedisHandle], Awaitable[int]]


class MigrationRefused(RuntimeError):
    """The migration cannot run now (a live writer, a cluster without placements, a pending key part refused)."""


@dataclass
class MigrationReport:
    """What a migration moved (or, :attr:`dry_run`, would move). Counts are Redis keys unless said otherwise."""

    source: str
    target: str
    dry_run: bool
    ids: int = 0  #: API key ids looked at
    moved: Counter[str] = field(default_factory=Counter)  #: per kind (:attr:`PerKeyName.builder`): names moved
    by_master: Counter[str] = field(default_factory=Counter)  #: per destination master ``host:port``: names written
    finished: int = 0  #: names an interrupted run had copied: only their old copy deleted now
    seeded: int = 0  #: event ids added to the keys' own seen-sets (``shared`` → ``tenant``)
    pending: int = 0  #: pending key parts completed first (``tenant`` → ``shared``)
    creates: int = 0  #: half-written key creates rolled back first (``tenant`` → ``shared``)
    conflicts: list[str] = field(default_factory=list)  #: old names left: the new name holds other data
    left: Counter[str] = field(default_factory=Counter)  #: per kind: old names of no known key id, left as they are

    def summary(self) -> str:
        """One line: what moved, where, and what was left."""
        verb = "would move" if self.dry_run else "moved"
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.moved.items())) or "nothing"
        masters = ", ".join(f"{m} {n}" for m, n in sorted(self.by_master.items()))
        # the ids are more than `keys list` shows (a new user asked what the others were): say which they are
        out = (f"placement {self.source} -> {self.target}: {self.ids} key ids looked at (stored keys, config keys, "
               f"ids in the spend history, the gateway's reserved ids); {verb} {sum(self.moved.values())} "
               f"keys ({kinds})" + (f" to masters {masters}" if masters else ""))
        if self.finished:
            out += f"; {self.finished} copied by an earlier run, their old names deleted"
        if self.seeded:
            out += f"; {'would seed' if self.dry_run else 'seeded'} {self.seeded} event ids into keys' seen-sets"
        if self.pending:
            out += f"; {'would complete' if self.dry_run else 'completed'} {self.pending} pending key parts first"
        if self.creates:
            out += f"; {'would roll back' if self.dry_run else 'rolled back'} {self.creates} half-written key creates"
        if self.left:
            out += f"; left {sum(self.left.values())} keys of unknown key ids ({dict(sorted(self.left.items()))})"
        if self.conflicts:
            out += f"; {len(self.conflicts)} CONFLICTS (old and new name hold different data, both kept)"
        return out


def other_placement(placement: str) -> str:
    """The other value of ``redis.cluster_placement`` (``shared`` ↔ ``tenant``)."""
    return "shared" if placement == "tenant" else "tenant"


async def _scan(r: RedisCluster, node: ClusterNode, pattern: str) -> AsyncIterator[str]:
    """The names on ``node`` matching ``pattern`` (SCAN, :data:`SCAN_COUNT` a page; a name may come twice)."""
    cursor: Any = 0
    while True:
        cursor, names = await r.scan(cursor=cursor, match=pattern, count=SCAN_COUNT, target_nodes=node)
        cursor = cursor[node.name] if isinstance(cursor, dict) else cursor
        for name in (names[node.name] if isinstance(names, dict) else names):
            yield as_text(name)
        if not int(cursor):
            return


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis MATCH pattern (glob: ``* ? [ ] \\`` are special)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _stream_ms(entry_id: bytes | str | None) -> int:
    """The time part (ms) of a stream entry id ``<ms>-<seq>``."""
    return int(as_text(entry_id or b"0-0").split("-")[0])


def _after(entry_id: bytes | str | None) -> str:
    """The stream entry id right after ``entry_id`` (``<ms>-<seq + 1>``): where the next XRANGE page starts."""
    ms, _, seq = as_text(entry_id or b"0-0").partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _master(r: RedisCluster, name: str) -> ClusterNode:
    return r.nodes_manager.get_node_from_slot(r.keyslot(name))


async def live_writers(handle: RedisHandle, quiet_s: float) -> str | None:
    """A one-line reason when the cluster shows a gateway still writing, else None: a live process's heartbeat
    (``wal:hb:{owner}``: every gateway process with ``metering.write_ahead``, the default, renews one every third of
    ``metering.heartbeat_ttl_s``; a stopped one's lapses within that TTL), or a usage event written to the stream
    less than ``quiet_s`` seconds ago by the clock of the stream's master (a gateway without write-ahead; a CLI
    command like ``usage quarantine --settle``), or a gateway's connection to the shared slot's master (every
    serving gateway names its connections :func:`~gateway.state.redis.writer_name`, and keeps them open while it
    runs: found with or without write-ahead, however long it has been idle). Raises what the client raises."""
    keys, r = RedisKeys.of(handle), handle.client
    if not isinstance(r, RedisCluster):
        return None
    await r.initialize()  # the slot map, for the shared slot's master
    node = _master(r, keys.prefix)
    name = writer_name(keys.prefix)
    clients = await r.client_list(target_nodes=node)
    for client in (clients[node.name] if isinstance(clients, dict) else clients):
        if as_text(client.get("name") or "") == name:
            return (f"a gateway process is running: a connection named {name} from {client.get('addr')} is open on "
                    f"{node.name} (stop every gateway; a dead machine's connection closes within Redis's "
                    "tcp-keepalive, or use --force when you know every gateway is stopped)")
    async for beat in _scan(r, node, _glob_escape(keys.heartbeat("")) + "*"):
        return (f"a gateway process is running: its heartbeat {beat} is live (stop every gateway, or wait "
                "metering.heartbeat_ttl_s after the last one stopped)")
    newest = await r.xrevrange(keys.events, "+", "-", count=1)
    if newest:
        seconds, micros = await r.time(target_nodes=node)
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        age_s = (now_ms - _stream_ms(newest[0][0])) / 1000
        if age_s < quiet_s:
            return (f"a usage event was written {age_s:.0f} s ago (less than {quiet_s:g} s): a gateway or command is "
                    "still writing; stop it, or wait")
    return None


class _Forms:
    """The name forms of one placement: exact names and heads per known key id, and regexes of every per-key form
    (to tell a name of an unknown id)."""

    def __init__(self, keys: RedisKeys, ids: Sequence[str], specs: Sequence[PerKeyName], known: set[str]) -> None:
        self.keys = keys
        #: the old names of the known ids' kinds without a parameter (moved by id, not by the scan)
        self.known = known
        #: head (a name less its parameter) → (kind, key id), for the kinds with a day/month/window parameter
        self.heads: dict[str, list[tuple[PerKeyName, str]]] = {}
        self.regexes: list[tuple[PerKeyName, re.Pattern[str]]] = []
        for spec in specs:
            if spec.param in ("day", "month", "window"):
                for key_id in ids:
                    self.heads.setdefault(keys.per_key_name(spec, key_id), []).append((spec, key_id))
            form = re.escape(keys.per_key_name(spec, _ID, _PARAM))
            for tag in (key_tenant(_ID), secret_tag(_PARAM)):
                form = form.replace(re.escape(tag), "[0-9a-f]{16}")
            form = form.replace(re.escape(_ID), ".+").replace(re.escape(_PARAM), PARAM_FORMS.get(spec.param, ""))
            self.regexes.append((spec, re.compile(form)))

    def attribute(self, name: str) -> tuple[PerKeyName, str, str] | None:
        """``(kind, key id, parameter)`` of a scanned name of a known id's parametrised kind, else None."""
        cut = name.rfind(":") + 1
        param = name[cut:]
        for spec, key_id in self.heads.get(name[:cut], ()):
            if re.fullmatch(PARAM_FORMS[spec.param], param):
                return spec, key_id, param
        return None

    def unknown_kind(self, name: str) -> str | None:
        """The kind of a per-key name no known id owns (None: no per-key form at all, or a known id's)."""
        if name in self.known:
            return None
        for spec, form in self.regexes:
            if form.fullmatch(name):
                return spec.builder
        return None


class Migration:
    """One run of the migration from the placement ``handle`` does not use to the one it uses (``handle.placement``:
    the target). ``extra_ids``: key ids to look at besides the ones Redis lists (module doc). ``metering``: for the
    dedup window (seeding) and for completing pending key parts. ``progress``: called as the run goes.
    ``repair_creates``: rolls back the half-written key creates of ``tenant`` (module doc); without it a ``tenant`` →
    ``shared`` run refuses while there are any."""

    def __init__(self, handle: RedisHandle, metering: MeteringConfig, *, extra_ids: Iterable[str] = (),
                 dry_run: bool = False, progress: Progress | None = None,
                 repair_creates: RepairCreates | None = None, force: bool = False) -> None:
        self.handle = handle
        self.new = RedisKeys.of(handle)
        if not self.new.sharded or not isinstance(handle.client, RedisCluster):
            raise MigrationRefused("redis.cluster_placement only matters on a Redis Cluster (a redis+cluster:// URL "
                                   "and a key_prefix without a hash tag of its own): here the names are the same "
                                   "under both, nothing to move")
        self.r: RedisCluster = handle.client
        self.source = other_placement(handle.placement)
        self.old = RedisKeys(self.new.prefix, self.source)
        self.metering = metering
        self.extra_ids = list(extra_ids)
        self.dry_run = dry_run
        self.force = force
        self.progress = progress or (lambda phase, done, total: None)
        self.repair_creates = repair_creates
        self.report = MigrationReport(self.source, handle.placement, dry_run)
        #: the kinds moved by name: under shared, key_seen is the shared seen-set (seeded or merged instead)
        self.specs = [s for s in PER_KEY_NAMES if not s.shared_when_shared]
        self.seen_spec = next(s for s in PER_KEY_NAMES if s.shared_when_shared)
        self._known: set[str] = set()  # old names moved by id (_by_id): the scan does not count them as left
        self._seeded: set[str] = set()  # keys' seen-sets seeded (each counted once)

    async def run(self) -> MigrationReport:
        """Move everything (module doc); the report. Raises :class:`MigrationRefused`, or what the client raises (a
        rerun finishes a run stopped by it)."""
        await self.r.initialize()  # the slot map: which master holds which name
        if self.source == "tenant":
            await self._roll_back_creates()  # before the ids are read: a rolled-back create's id is no key's
        elif not self.force and (why := await self._unseedable()) is not None:
            raise MigrationRefused(why)  # before anything is written
        ids = await self.key_ids()
        self.report.ids = len(ids)
        if not self.dry_run:
            await self.r.set(self.new.placement_migration, orjson.dumps(
                {"from": self.source, "to": self.new.placement, "started": time.time()}))
        if self.source == "tenant":
            await self._complete_pending()
        await self._by_id(ids)
        await self._scanned(ids)
        if self.source == "shared":
            await self._seed_seen(set(ids))
        if not self.dry_run and not self.report.conflicts:
            await self.r.delete(self.new.placement_migration)
        return self.report

    async def key_ids(self) -> list[str]:
        """Every key id to look at (module doc), sorted."""
        ids: set[str] = set(self.extra_ids)
        for name in (self.new.key_ids, self.new.usage_keys):
            ids.update(as_text(m) for m in await self.r.smembers(name))
        node = _master(self.r, self.new.prefix)
        pattern = _glob_escape(self.new.agg_day_keys(_PARAM)).replace(_PARAM, "*")
        async for name in _scan(self.r, node, pattern):
            ids.update(as_text(m) for m in await self.r.smembers(name))
        return sorted(ids)

    async def _roll_back_creates(self) -> None:
        """Roll back the key creates left half-written under ``tenant`` (module doc); refuse while any is left."""
        n = int(await self.r.hlen(self.new.key_pending))
        if not n:
            return
        if self.dry_run:
            self.report.creates = n
            return
        if self.repair_creates is not None:
            self.report.creates += await self.repair_creates(
                dataclasses.replace(self.handle, placement=self.source, lane=None))
        left = int(await self.r.hlen(self.new.key_pending))
        if left:
            raise MigrationRefused(
                f"{left} key creates never finished ({self.new.key_pending}): roll them back first (thinkgate keys "
                "repair --apply --grace-s 0, with redis.cluster_placement: tenant), or shared would list them as "
                "keys")

    async def _complete_pending(self) -> None:
        """Complete the key parts a dead writer left in ``usage:pending`` under the old (tenant) names."""
        n = int(await self.r.hlen(self.new.pending))
        if not n:
            return
        self.report.pending = n
        if self.dry_run:
            return
        source = dataclasses.replace(self.handle, placement=self.source, lane=None)
        meter = Meter(source, Breaker(1.0), Spool(self.metering.spool_path), self.metering)
        far = time.time() + 86400 * 365  # every pending part, however recent: no writer is left to finish it
        while int(await self.r.hlen(self.new.pending)):
            try:
                done = await meter.finish_pending(now=far)
            except ResponseError as exc:  # a key part Redis refuses (a name of the wrong type): nothing of it written
                raise MigrationRefused(
                    f"a key part pending in {self.new.pending} was refused by Redis ({' '.join(str(exc).split())}): "
                    f"fix or delete the name its error gives, then run this again; until a run finishes, gateways "
                    f"and CLI commands of both placements refuse to start ({self.new.placement_migration} is set)"
                ) from exc
            if not done:
                raise MigrationRefused(f"{n} key parts pending in {self.new.pending} could not be completed")

    async def _by_id(self, ids: Sequence[str]) -> None:
        """The names without a parameter, and the lookup copy by its record's digest, of every id."""
        secret = next(s for s in self.specs if s.param == "secret")
        plain = [s for s in self.specs if not s.param]
        for start in range(0, len(ids), BATCH // len(plain)):
            chunk = ids[start:start + BATCH // len(plain)]
            batch = [(s, self.old.per_key_name(s, i), self.new.per_key_name(s, i)) for i in chunk for s in plain]
            # the digest from the record wherever it is now (a rerun finds it moved); a revoked key has no copy
            pipe = self.r.pipeline(transaction=False)
            for i in chunk:
                pipe.get(self.old.key_record(i))
                pipe.get(self.new.key_record(i))
            raws = await pipe.execute()
            for j in range(len(chunk)):
                raw = raws[2 * j] or raws[2 * j + 1]
                digest = orjson.loads(raw).get("secret_sha256") if raw else None
                if isinstance(digest, str) and digest:
                    batch.append((secret, self.old.per_key_name(secret, "", digest),
                                  self.new.per_key_name(secret, "", digest)))
            self._known.update(old for _, old, _ in batch)
            await self._move(batch)
            self.progress("key records, totals, reservations", start + len(chunk), len(ids))

    async def _scanned(self, ids: Sequence[str]) -> None:
        """The per-day, per-month and per-window names, found by SCAN on the masters holding the old names."""
        # the parametrised kinds first: a shared-placement day name also has the form of a total (its id holding
        # ":d:…"), and an unknown one is best called by the parametrised kind
        specs = sorted(self.specs, key=lambda s: not s.param or s.param == "secret")
        if self.source == "tenant":
            specs.insert(0, self.seen_spec)  # the keys' own seen-sets, merged into the shared ones (_move_seen)
        forms = _Forms(self.old, ids, specs, self._known)
        if self.source == "shared":
            nodes = [_master(self.r, self.old.prefix)]
            pattern = _glob_escape(self.old.prefix) + "*"
        else:  # "{tg:" then anything: every tenant slot (the shared one's names match no tenant form)
            nodes = self.r.get_primaries()
            pattern = _glob_escape(self.old.prefix[:-1]) + "*"
        total = 0
        for node in nodes:
            total += int(await self.r.dbsize(target_nodes=node))
        scanned, batch, seen_batch = 0, [], []
        for node in nodes:
            async for name in _scan(self.r, node, pattern):
                scanned += 1
                got = forms.attribute(name)
                if got is None:
                    if kind := forms.unknown_kind(name):
                        self.report.left[kind] += 1
                elif got[0] is self.seen_spec:
                    seen_batch.append((got[0], name, self.new.per_key_name(*got)))
                else:
                    batch.append((got[0], name, self.new.per_key_name(*got)))
                if len(batch) >= BATCH:
                    await self._move(batch)
                    batch = []
                if len(seen_batch) >= BATCH:
                    await self._move_seen(seen_batch)
                    seen_batch = []
                if scanned % SCAN_COUNT == 0:
                    self.progress("day, month and window keys (names scanned)", scanned, total)
        await self._move(batch)
        await self._move_seen(seen_batch)
        self.progress("day, month and window keys (names scanned)", scanned, total)

    async def _move(self, batch: Sequence[tuple[PerKeyName, str, str]]) -> None:
        """Copy each ``(kind, old, new)`` (``DUMP``/``RESTORE`` with the remaining TTL), then delete the old name
        (module doc: copy first, so a rerun after a crash anywhere finishes the job)."""
        # a SCAN returns a name twice when the table is rehashed meanwhile (this run's DELs shrink it): twice in one
        # batch, the second RESTORE would meet the first's copy (BUSYKEY) and read as a conflict
        batch = list(dict.fromkeys(batch))
        if not batch:
            return
        restore, delete = await self._plan(batch)
        for spec, _, new, _, _ in restore:
            self.report.moved[spec.builder] += 1
            self.report.by_master[_master(self.r, new).name] += 1
        if self.dry_run:
            return
        if restore:
            pipe = self.r.pipeline(transaction=False)
            for _, _, new, ttl, payload in restore:
                pipe.restore(new, ttl, payload)  # no REPLACE: a new name that appeared meanwhile is never overwritten
            results = await pipe.execute(raise_on_error=False)
            busy: list[tuple[PerKeyName, str, str, bytes]] = []
            for (spec, old, new, _, payload), res in zip(restore, results, strict=True):
                if isinstance(res, ResponseError) and "BUSYKEY" in str(res):
                    busy.append((spec, old, new, payload))
                elif isinstance(res, Exception):
                    raise res
                else:
                    delete.append(old)
            if busy:  # the new name appeared since _plan read it: the same data (a copy of this one) or a conflict
                pipe = self.r.pipeline(transaction=False)
                for _, _, new, _ in busy:
                    pipe.dump(new)
                for (spec, old, _, payload), there in zip(busy, await pipe.execute(), strict=True):
                    self.report.moved[spec.builder] -= 1
                    if there is not None and as_bytes(there) == payload:
                        self.report.finished += 1
                        delete.append(old)
                    else:
                        self.report.conflicts.append(old)
        if delete:  # one DEL per name: a multi-key DEL would span slots
            pipe = self.r.pipeline(transaction=False)
            for old in delete:
                pipe.delete(old)
            await pipe.execute()

    async def _plan(self, batch: Sequence[tuple[PerKeyName, str, str]]
                    ) -> tuple[list[tuple[PerKeyName, str, str, int, bytes]], list[str]]:
        """Read each old name (its TTL and payload) and its new one: ``(to copy: kind, old, new, TTL ms or 0,
        payload), (old names to delete only: an earlier run copied them)``; conflicts go to the report."""
        pipe = self.r.pipeline(transaction=False)
        for _, old, new in batch:
            pipe.pttl(old)
            pipe.dump(old)
            pipe.dump(new)
        got = await pipe.execute()
        restore: list[tuple[PerKeyName, str, str, int, bytes]] = []
        delete: list[str] = []
        for j, (spec, old, new) in enumerate(batch):
            ttl, payload, there = int(got[3 * j]), got[3 * j + 1], got[3 * j + 2]
            if ttl == -2 or payload is None:  # moved by an earlier run, or expired: nothing here
                continue
            if there is not None:
                if as_bytes(there) == as_bytes(payload):  # copied by an interrupted run: its old name only
                    self.report.finished += 1
                    delete.append(old)
                else:
                    self.report.conflicts.append(old)
                continue
            restore.append((spec, old, new, max(ttl, 0), as_bytes(payload)))
        return restore, delete

    async def _move_seen(self, batch: Sequence[tuple[PerKeyName, str, str]]) -> None:
        """``tenant`` → ``shared``: each key's own seen-set merged into the day's shared one (``SADD``: already a
        subset of it; idempotent), then deleted. Where the shared one is gone, the first key's set of that day is
        copied there (:meth:`_move`, its TTL kept) instead: a set made by SADD alone would never expire; the other
        keys' sets of the day are merged into that copy (copied too, they would find the name taken: conflicts)."""
        copy: list[tuple[PerKeyName, str, str]] = []
        merge: list[tuple[PerKeyName, str, str]] = []
        copied: set[str] = set()
        for spec, old, new in batch:
            if new in copied:
                merge.append((spec, old, new))
            elif not await self.r.exists(new):
                copied.add(new)
                copy.append((spec, old, new))
            else:
                merge.append((spec, old, new))
        await self._move(copy)
        for spec, old, new in merge:
            members = await self.r.smembers(old)
            self.report.moved[spec.builder] += 1
            self.report.by_master[_master(self.r, new).name] += 1
            if not self.dry_run:
                if members:
                    await self.r.sadd(new, *members)
                await self.r.delete(old)

    def _seed_start_ms(self) -> int:
        """Where the stream is read from to seed the keys' seen-sets (ms): the dedup window and a margin."""
        return max(int((time.time() - self.metering.dedup_ttl_s - SEED_MARGIN_S) * 1000), 0)

    async def _unseedable(self) -> str | None:
        """``shared`` → ``tenant``: a one-line reason to refuse when a day's shared seen-set counts events the stream
        no longer holds (``metering.stream_maxlen`` trimmed them within the dedup window), else None. Their keys
        cannot be read, so their ids cannot be seeded into their keys' own seen-sets (:meth:`_seed_seen`): one
        still in a gateway's spool files and replayed after the move would count twice in its key. Every counted
        event (usage, audit, ``:unsent``) is one stream entry and one member of its day's seen-set, so a day whose
        set has more members than the stream has entries of that day lost some; only days that began inside the
        window read are compared (an older day's entries may precede it)."""
        start_ms = self._seed_start_ms()
        per_day: Counter[str] = Counter()
        cursor = f"{start_ms}-0"
        while entries := await self.r.xrange(self.new.events, cursor, "+", count=SCAN_COUNT):
            for _, fields in entries:
                raw = (fields or {}).get(b"e")
                if raw is not None:
                    per_day[UsageEvent.from_json(raw).day] += 1
            self.progress("stream read to check the seen-sets (events)", sum(per_day.values()), None)
            cursor = _after(entries[-1][0])
        missing: dict[str, int] = {}
        pattern = _glob_escape(self.new.seen(_PARAM)).replace(_PARAM, "*")
        async for name in _scan(self.r, _master(self.r, self.new.prefix), pattern):
            day = name.rsplit(":", 1)[-1]
            if not re.fullmatch(PARAM_FORMS["day"], day) or day_start(day) * 1000 < start_ms:
                continue
            n = int(await self.r.scard(name)) - per_day[day]
            if n > 0:
                missing[day] = n
        if not missing:
            return None
        return (f"{sum(missing.values())} counted usage events of {len(missing)} day(s) ({', '.join(sorted(missing))}) "
                "are no longer in the stream (metering.stream_maxlen trimmed them within the dedup window): their "
                "keys cannot be read, so a replay of one from a gateway's spool files after the move would count "
                "twice in its key. Let every gateway replay its spool (usage, unacknowledged, dead-letter files) "
                "until they are empty, stop them, then run again with --force")

    async def _seed_seen(self, ids: set[str]) -> None:
        """``shared`` → ``tenant``: the ids of each key's events still in the dedup window (read from the stream)
        added to the key's own seen-set of the event's day, with the remaining TTL of the day's shared seen-set (a
        day whose shared set is gone is past the window: a replay of its events is quarantined, never sent)."""
        start_ms = self._seed_start_ms()
        day_ttl: dict[str, int] = {}
        cursor, read = f"{start_ms}-0", 0
        while True:
            entries = await self.r.xrange(self.new.events, cursor, "+", count=SCAN_COUNT)
            if not entries:
                break
            groups: dict[tuple[str, str], list[str]] = {}
            for _, fields in entries:
                raw = (fields or {}).get(b"e")
                if raw is None:
                    continue
                ev = UsageEvent.from_json(raw)
                if ev.key_id in ids:
                    groups.setdefault((ev.key_id, ev.day), []).append(ev.event_id)
            for day in {d for _, d in groups} - set(day_ttl):
                day_ttl[day] = int(await self.r.pttl(self.new.seen(day)))
            pipe = self.r.pipeline(transaction=False)
            for (key_id, day), event_ids in groups.items():
                ttl = day_ttl[day]
                if ttl == -2:
                    continue
                name = self.new.key_seen(key_id, day)
                self.report.seeded += len(event_ids)
                if name not in self._seeded:
                    self._seeded.add(name)
                    self.report.moved[self.seen_spec.builder] += 1
                    self.report.by_master[_master(self.r, name).name] += 1
                pipe.sadd(name, *event_ids)
                pipe.pexpire(name, ttl if ttl > 0 else self.metering.dedup_ttl_s * 1000)
            if not self.dry_run:
                await pipe.execute()
            read += len(entries)
            self.progress("seen-sets seeded from the stream (events read)", read, None)
            last = entries[-1][0]
            cursor = _after(last)
