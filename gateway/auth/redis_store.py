"""API keys stored in Redis, hashed at rest: create, list, update, revoke, look up by the secret's SHA-256.

A secret is ``tg-`` + 32 random bytes (URL-safe base64, ``secrets.token_urlsafe``): high-entropy, so an
unsalted SHA-256 is the right at-rest form (as for GitHub tokens) and lookups are one ``GET`` by digest. The
plain secret exists only in the return value of :meth:`RedisKeyStore.create` (the CLI prints it once).

Records (JSON): ``keys:rec:{id}`` (authoritative, kept after revocation for audit) and a copy at
``keys:h:{sha256}`` (the lookup path, deleted on revocation); ``keys:ids`` lists the ids. On one server or
Sentinel, and on a Cluster with ``redis.cluster_placement: shared`` (the default), create, update and revoke are
single Lua scripts, so a key is never half-created, half-updated or half-revoked; ids are never reused.

**On a Cluster with ``redis.cluster_placement: tenant``** (``RedisKeys.per_key_slots``) the three keys are in three
slots, so that 100 keys spread over the
masters instead of sitting on the master of ``{tg:}``: the record in the key's tenant slot
(``{tg:<key_tenant(id)>}keys:rec:{id}``, with the key's cache and sessions), the lookup copy in a slot of the
secret's own (``{tg:<tenant_tag("secret:" + sha256)>}keys:h:{sha256}``: a lookup is still one ``GET`` by digest
and needs no id) and ``keys:ids`` in the shared slot. No script can span them, so each operation is ordered
single-slot steps, each of which leaves a state the others read correctly when the process dies right after it
(or a later step fails: Redis unreachable mid-way leaves the same states, and the caller gets :class:`RedisDown`):

- **create**: the claim — ``SADD ids`` and ``HSET pending id {sha256, started_ms}`` in one script on the shared
  slot (:meth:`RedisKeyStore.claim`; the id taken → :class:`KeyExists`; ids are never reused, so two creates of
  one id cannot both pass it; ``started_ms`` is that master's ``TIME``) → ``SET h`` (:meth:`~RedisKeyStore.
  write_copy`) → ``SET rec`` (:meth:`~RedisKeyStore.write_record`) → the commit, ``HDEL pending id`` if the entry is
  still the claim's (:meth:`~RedisKeyStore.commit`). Only a committed create returns its secret. A create that
  crashed before its commit is **half-written**: its secret was never returned, let alone printed (32 random
  bytes), so nobody can present it and its lookup copy, if written, authenticates no one; ``list`` leaves out a
  record whose id is pending (:meth:`~RedisKeyStore.incomplete` names them; ``thinkgate keys list`` says so), ``get``
  skips an id with no record, ``revoke``/``update`` say unknown, and the id stays taken — until :meth:`~RedisKeyStore.
  repair` (``thinkgate keys repair``) rolls it back: the pending entry and the id in one script, only once the
  claim is older than a grace period (``started_ms`` by the same master's clock: no skew between machines) and
  unchanged since it was read, then the lookup copy and the record. A create still running past the grace period
  (its Redis stalled) finds its commit gone: it deletes what it wrote and raises :class:`KeyCreateRolledBack`,
  never returning a secret for a key that was rolled back. Ids claimed by a store from before the pending entries
  (no entry, no record) are adopted — given an entry stamped now — by an applied repair, and rolled back by one
  after the grace period.
- **revoke**: ``DEL h`` first — from then on the key no longer authenticates (after ``auth.key_cache_s``) —
  then the record is rewritten as revoked (:data:`SET_ACTIVE_LUA`, on the record's slot). A crash between
  leaves a key that no longer authenticates but is listed as active; ``update`` refuses it (no lookup copy:
  revoked) and a rerun of ``revoke`` finishes it (the record is active, ``DEL h`` is a no-op, the revoked
  record is written, True) — under either placement: moved to ``shared`` in that state, :data:`REVOKE_LUA`
  decides on the record too. Never the other way round: a record marked revoked whose secret still works.
- **update**: the lookup copy is rewritten only if it exists (``SET … XX``; none → the key is revoked, or
  being revoked → ``ValueError`` as on one server), then the record only if it is not revoked
  (:data:`SET_ACTIVE_LUA`; a revoke that came between → ``ValueError``, the copy it wrote is already deleted
  or about to be). ``XX`` means an update never recreates the copy a revoke deleted. A crash between leaves
  the new limits in force (the lookup copy is what requests authenticate with) and the old ones listed; a
  rerun of the same ``update`` converges. The conditional record write is a one-key Lua script rather than
  ``WATCH``/``MULTI``: it runs in one round trip on the record's slot, needs no retry loop under contention,
  and works the same on redis-py's asyncio ``RedisCluster`` and on one server.

Lookups are cached in-process for ``auth.key_cache_s`` seconds (revocation takes effect within that); a key
seen before keeps working for ``auth.key_stale_s`` seconds while Redis is unreachable. Unknown digests are
cached too (bounded LRU), so a flood of bad keys does not become a flood of Redis reads.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal
from typing import Any

import orjson

from gateway.auth.keys import KeyInfo
from gateway.errors import KeyStoreUnavailable
from gateway.state.breaker import Breaker, RedisDown, RedisStalled
from gateway.state.keys import RedisKeys
from gateway.state.redis import RedisHandle, as_text
from router.errors import ThinkGateError

SECRET_PREFIX = "tg-"
LOOKUP_CACHE_MAX = 10_000

# KEYS: 1 rec:{id}, 2 h:{sha}, 3 ids; ARGV: 1 record JSON, 2 id. Returns 1, or 0 when the id exists.
CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""
# KEYS: 1 rec:{id}, 2 h:{sha}; ARGV: 1 the revoked record JSON.
# Returns 1, 0 (already revoked: the record says so), -1 (unknown id). Decided on the record, not on the lookup
# copy: a record still active without its copy (a tenant-placement revoke that stopped between its two steps, then
# the cluster moved to shared) is listed active and must still be revocable.
REVOKE_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return -1 end
local revoked = cjson.decode(raw)['revoked']
if revoked ~= nil and revoked ~= cjson.null then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""


# KEYS: 1 rec:{id}, 2 h:{sha}; ARGV: 1 the updated record JSON. Returns 1, or 0 when the key is revoked (or unknown).
UPDATE_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""

# Sharded prefix only. KEYS: 1 ids, 2 pending (one slot); ARGV: 1 id, 2 digest. Claims the id: 1, or 0 when taken.
CLAIM_LUA = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode({sha256 = ARGV[2], started_ms = ms}))
return 1
"""
# Sharded prefix only. KEYS: 1 pending; ARGV: 1 id, 2 the claim's digest. Commits the create: 1, or 0 when its entry
# is gone or not its own (a repair rolled it back).
COMMIT_LUA = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw or cjson.decode(raw)['sha256'] ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""
# Sharded prefix only. KEYS: 1 pending, 2 ids; ARGV: 1 id, 2 the entry as read, 3 grace (ms), 4 "1" to apply.
# Returns {state, age_ms}: state -1 the entry changed since it was read (committed, or another repair: nothing done),
# 0 younger than the grace period (nothing done), 1 old enough (with "1": the entry and the id removed).
ROLLBACK_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return {-1, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local age = now - tonumber(cjson.decode(ARGV[2])['started_ms'])
if age < tonumber(ARGV[3]) then return {0, age} end
if ARGV[4] == '1' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('SREM', KEYS[2], ARGV[1])
end
return {1, age}
"""
# Sharded prefix only. KEYS: 1 pending, 2 ids; ARGV: 1 id (the caller found no record: another slot). Adopts an id
# claimed without an entry (a store from before them): an entry with no digest, started now. 1, or 0 (none to adopt).
ADOPT_LUA = """
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 then return 0 end
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('HSETNX', KEYS[1], ARGV[1], cjson.encode({sha256 = '', started_ms = ms}))
"""

#: ``thinkgate keys repair``'s default grace period (seconds): a claim younger than this may be a create still
#: running — four round trips, under a second; tens of seconds with Redis timing out — and is never rolled back
REPAIR_GRACE_S = 600.0

# Sharded prefix (a Cluster) only. KEYS: 1 rec:{id}; ARGV: 1 the new record JSON. Writes it only while the stored
# record is active. Returns 1 (written), 0 (the stored record is revoked), -1 (no record).
SET_ACTIVE_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return -1 end
local revoked = cjson.decode(raw)['revoked']
if revoked ~= nil and revoked ~= cjson.null then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""

#: the fields ``keys update`` may change (the rest — id, secret, creation — are the key's identity)
UPDATABLE = ("tags", "budget_usd_day", "budget_usd_month", "rpm", "tpm", "max_thinking_budget")


class KeyExists(ThinkGateError, ValueError):
    """``keys create``: a key with this id exists (or existed: ids are never reused)."""


class KeyCreateRolledBack(ThinkGateError, RuntimeError):
    """``keys create`` on a Cluster under tenant placement: a repair rolled this create back before it committed
    (it ran longer than the repair's grace period); what it wrote is deleted and no secret is returned. The id is
    free again: create it anew."""


@dataclass(frozen=True, slots=True)
class HalfWritten:
    """A create that claimed ``id`` and has not committed (module doc): ``sha256`` its secret's digest ("" for an
    id adopted from a store without pending entries), ``age_s`` since its claim by the shared slot's clock,
    ``record``/``copy`` whether those steps were written, ``state``: ``young`` (within the grace period: left
    alone), ``rolled_back`` (removed by this repair), ``would_roll_back`` (a dry run's), ``adopted`` (an id
    claimed without an entry: given one now, rolled back by a repair after the grace period; ``would_adopt`` in a
    dry run) or ``changed`` (committed or repaired meanwhile: left alone)."""

    id: str
    sha256: str
    age_s: float
    record: bool
    copy: bool
    state: str




@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A stored key. Budgets are decimal strings (USD); times epoch seconds; ``revoked`` None while active."""

    id: str
    secret_sha256: str
    tags: dict[str, str] = field(default_factory=dict)
    budget_usd_day: str | None = None
    budget_usd_month: str | None = None
    rpm: int | None = None
    tpm: int | None = None
    cache_namespace: str | None = None
    created: float = 0.0
    revoked: float | None = None
    allowed_tiers: list[str] | None = None
    on_disallowed_tier: str = "refuse"
    max_thinking_budget: int | None = None
    over_cap: str = "clamp"

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> KeyRecord:
        d = orjson.loads(raw)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def public(self) -> dict[str, Any]:
        """The record without the digest (what ``keys list`` shows)."""
        d = asdict(self)
        d.pop("secret_sha256")
        return d


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


class RedisKeyStore:
    """The Redis key store; one per process (or per CLI call)."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, cache_s: float = 5.0, stale_s: float = 3600.0,
                 clock: Any = time.monotonic) -> None:
        self.redis = handle.client
        self.prefix = handle.prefix
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.cache_s = cache_s
        self.stale_s = stale_s
        self._clock = clock
        self._cache: OrderedDict[str, tuple[KeyInfo | None, float]] = OrderedDict()
        self._create = self.redis.register_script(CREATE_LUA)
        self._revoke = self.redis.register_script(REVOKE_LUA)
        self._update = self.redis.register_script(UPDATE_LUA)
        self._set_active = self.redis.register_script(SET_ACTIVE_LUA)
        self._claim = self.redis.register_script(CLAIM_LUA)
        self._commit = self.redis.register_script(COMMIT_LUA)
        self._rollback = self.redis.register_script(ROLLBACK_LUA)
        self._adopt = self.redis.register_script(ADOPT_LUA)

    async def create(self, key_id: str, *, tags: dict[str, str] | None = None,
                     budget_usd_day: Decimal | None = None, budget_usd_month: Decimal | None = None,
                     rpm: int | None = None, tpm: int | None = None, cache_namespace: str | None = None,
                     allowed_tiers: list[str] | None = None, on_disallowed_tier: str = "refuse",
                     max_thinking_budget: int | None = None, over_cap: str = "clamp") -> str:
        """Create key ``key_id``; returns the plain secret (shown once, never stored). Policy fields as in
        :class:`gateway.config.KeyConfig`.

        Raises :class:`KeyExists`, ``ValueError`` for invalid limits, :class:`RedisDown` when unreachable.
        """
        for name, v in (("budget_usd_day", budget_usd_day), ("budget_usd_month", budget_usd_month)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0")
        for name, n in (("rpm", rpm), ("tpm", tpm)):
            if n is not None and n < 1:
                raise ValueError(f"{name} must be >= 1")
        if on_disallowed_tier not in ("refuse", "downgrade"):
            raise ValueError("on_disallowed_tier must be refuse or downgrade")
        if over_cap not in ("clamp", "refuse"):
            raise ValueError("over_cap must be clamp or refuse")
        if max_thinking_budget is not None and max_thinking_budget < 0:
            raise ValueError("max_thinking_budget must be >= 0")
        secret = new_secret()
        digest = hashlib.sha256(secret.encode()).hexdigest()
        rec = KeyRecord(key_id, digest, dict(tags or {}),
                        str(budget_usd_day) if budget_usd_day is not None else None,
                        str(budget_usd_month) if budget_usd_month is not None else None,
                        rpm, tpm, cache_namespace, time.time(), None,
                        list(allowed_tiers) if allowed_tiers is not None else None, on_disallowed_tier,
                        max_thinking_budget, over_cap)
        k = self.keys
        if k.per_key_slots:
            await self._create_sharded(rec)
            return secret
        ok = await self.breaker.call(lambda: self._create(
            keys=[k.key_record(key_id), k.key_by_hash(digest), k.key_ids], args=[rec.to_json(), key_id]))
        if not ok:
            raise KeyExists(f"key id {key_id!r} exists (ids are never reused)")
        return secret

    async def _create_sharded(self, rec: KeyRecord) -> None:
        """Create on a sharded prefix: claim, lookup copy, record, commit (module doc)."""
        await self.claim(rec)
        await self.finish(rec)

    async def finish(self, rec: KeyRecord) -> None:
        """Create's steps after :meth:`claim`: the lookup copy, the record, the commit. Raises
        :class:`KeyCreateRolledBack` (what it wrote deleted) when a repair rolled the claim back meanwhile,
        :class:`RedisDown`."""
        await self.write_copy(rec)
        await self.write_record(rec)
        if not await self.commit(rec):
            # rolled back by a repair while this create ran past its grace period: what this create wrote after
            # the repair's deletes goes too, and the secret is never returned
            k = self.keys
            await self.breaker.call(lambda: self.redis.delete(k.key_by_hash(rec.secret_sha256)))
            await self.breaker.call(lambda: self.redis.delete(k.key_record(rec.id)))
            raise KeyCreateRolledBack(f"the create of key {rec.id!r} was rolled back by `thinkgate keys repair` "
                                      "before it finished; create it again")

    async def claim(self, rec: KeyRecord) -> None:
        """Create's first step on a sharded prefix: take ``rec.id`` in the id set and record the claim (its digest,
        the shared slot's time) in the pending hash, in one script. Raises :class:`KeyExists`, :class:`RedisDown`."""
        k = self.keys
        ok = await self.breaker.call(lambda: self._claim(keys=[k.key_ids, k.key_pending],
                                                         args=[rec.id, rec.secret_sha256]))
        if not int(ok):
            raise KeyExists(f"key id {rec.id!r} exists (ids are never reused)")

    async def write_copy(self, rec: KeyRecord) -> None:
        """Create's second step: the lookup copy, in the digest's slot. Raises :class:`RedisDown`."""
        await self.breaker.call(lambda: self.redis.set(self.keys.key_by_hash(rec.secret_sha256), rec.to_json()))

    async def write_record(self, rec: KeyRecord) -> None:
        """Create's third step: the record, in the key's tenant slot. Raises :class:`RedisDown`."""
        await self.breaker.call(lambda: self.redis.set(self.keys.key_record(rec.id), rec.to_json()))

    async def commit(self, rec: KeyRecord) -> bool:
        """Create's last step: remove the claim's pending entry if it is still this create's. False when a repair
        rolled the create back first. Raises :class:`RedisDown`."""
        k = self.keys
        return bool(int(await self.breaker.call(lambda: self._commit(keys=[k.key_pending],
                                                                     args=[rec.id, rec.secret_sha256]))))

    async def _pending(self) -> dict[str, str]:
        """The pending hash: id → its claim (JSON). Empty where create is one script."""
        if not self.keys.per_key_slots:
            return {}
        raw = await self.breaker.call(lambda: self.redis.hgetall(self.keys.key_pending))
        return {as_text(i): as_text(v) for i, v in raw.items()}

    async def incomplete(self) -> list[str]:
        """The ids of creates not committed (running, or crashed: :meth:`repair`'s to roll back), sorted; always
        empty on one server and under shared placement (create is one script there). Raises :class:`RedisDown`."""
        return sorted(await self._pending())

    async def repair(self, *, grace_s: float = REPAIR_GRACE_S, apply: bool = False) -> list[HalfWritten]:
        """Find the half-written creates of a sharded prefix (module doc) and, with ``apply``, roll back those whose
        claim is at least ``grace_s`` seconds old by the shared slot's clock: the pending entry and the id (one
        script, only if the entry is unchanged since read and still old enough), then the lookup copy and the record.
        Ids claimed with no entry and no record (a store from before the entries) are adopted with ``apply``. A
        claim younger than ``grace_s`` is never touched: it may be a create still running; one that runs past it
        finds its commit refused and cleans up after itself (:class:`KeyCreateRolledBack`). Returns one
        :class:`HalfWritten` per finding, by id; empty where create is one script. Raises ``ValueError`` for a
        negative ``grace_s``, :class:`RedisDown`."""
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        k = self.keys
        if not k.per_key_slots:
            return []
        pending = await self._pending()
        ids = sorted(as_text(m) for m in await self.breaker.call(lambda: self.redis.smembers(k.key_ids)))


        async def exists() -> list[Any]:  # records in many slots: one EXISTS each, pipelined (as list's GETs)
            pipe = self.redis.pipeline(transaction=False)
            for i in ids:
                pipe.exists(k.key_record(i))
            return list(await pipe.execute())

        records = await self.breaker.call(exists) if ids else []
        out: list[HalfWritten] = []
        for key_id, found in zip(ids, records, strict=True):
            has_record = bool(found)
            entry = pending.pop(key_id, None)
            if entry is None:
                if has_record:
                    continue  # a committed key
                out.append(HalfWritten(key_id, "", 0.0, False, False, await self._adopted(key_id, apply)))
                continue
            out.append(await self._roll_back(key_id, entry, has_record, grace_s, apply))
        for key_id, entry in sorted(pending.items()):  # an entry whose id is gone (a repair between its steps)
            out.append(await self._roll_back(key_id, entry, False, grace_s, apply))
        return out

    async def _adopted(self, key_id: str, apply: bool) -> str:
        """An id claimed with no pending entry and no record: adopted with ``apply`` (:data:`ADOPT_LUA`)."""
        if not apply:
            return "would_adopt"
        k = self.keys
        done = await self.breaker.call(lambda: self._adopt(keys=[k.key_pending, k.key_ids], args=[key_id]))
        return "adopted" if int(done) else "changed"

    async def _roll_back(self, key_id: str, entry: str, has_record: bool, grace_s: float,
                         apply: bool) -> HalfWritten:
        """One pending entry: decided and (with ``apply``) removed by :data:`ROLLBACK_LUA`, then its copy and
        record deleted."""
        k = self.keys
        try:
            sha = str(orjson.loads(entry).get("sha256") or "")
        except (orjson.JSONDecodeError, AttributeError):
            sha = ""
        copy = bool(sha) and bool(await self.breaker.call(lambda: self.redis.exists(k.key_by_hash(sha))))
        state, age_ms = await self.breaker.call(lambda: self._rollback(
            keys=[k.key_pending, k.key_ids], args=[key_id, entry, int(grace_s * 1000), "1" if apply else "0"]))
        verdict = {-1: "changed", 0: "young"}.get(int(state), "rolled_back" if apply else "would_roll_back")
        if verdict == "rolled_back":
            # the claim is gone, so no create commits it now: its copy and record are nobody's
            if sha:
                await self.breaker.call(lambda: self.redis.delete(k.key_by_hash(sha)))
            await self.breaker.call(lambda: self.redis.delete(k.key_record(key_id)))
        return HalfWritten(key_id, sha, int(age_ms) / 1000, has_record, copy, verdict)

    async def list(self) -> list[KeyRecord]:
        """Every key (revoked ones included), by id — not the records of creates that have not committed
        (:meth:`incomplete`). Raises :class:`RedisDown`."""
        ids = sorted(as_text(m) for m in await self.breaker.call(lambda: self.redis.smembers(self.keys.key_ids)))
        if not ids:
            return []
        if self.keys.per_key_slots:  # records in many slots: MGET would span slots, so one GET each, pipelined
            async def gets() -> list[Any]:
                pipe = self.redis.pipeline(transaction=False)
                for i in ids:
                    pipe.get(self.keys.key_record(i))
                return list(await pipe.execute())
            raws = await self.breaker.call(gets)
        else:
            raws = await self.breaker.call(lambda: self.redis.mget([self.keys.key_record(i) for i in ids]))
        pending = await self._pending()  # a record whose create never committed is no key (module doc)
        return [rec for r in raws if r is not None and (rec := KeyRecord.from_json(r)).id not in pending]

    async def get(self, key_id: str) -> KeyRecord | None:
        """The record of ``key_id`` (revoked or not), or None. Raises :class:`RedisDown`."""
        raw = await self.breaker.call(lambda: self.redis.get(self.keys.key_record(key_id)))
        return KeyRecord.from_json(raw) if raw is not None else None

    async def revoke(self, key_id: str) -> bool:
        """Revoke ``key_id``: True if it was active, False if already revoked; ``KeyError`` if unknown."""
        k = self.keys
        raw = await self.breaker.call(lambda: self.redis.get(k.key_record(key_id)))
        if raw is None:
            raise KeyError(key_id)
        rec = KeyRecord.from_json(raw)
        if rec.revoked is not None:
            return False
        revoked = replace(rec, revoked=time.time())
        if k.per_key_slots:  # the lookup copy first (the key stops authenticating), then the record (module doc)
            await self.breaker.call(lambda: self.redis.delete(k.key_by_hash(rec.secret_sha256)))
            res = await self.breaker.call(lambda: self._set_active(keys=[k.key_record(key_id)],
                                                                   args=[revoked.to_json()]))
            if int(res) == -1:
                raise KeyError(key_id)
            self._cache.clear()
            return int(res) == 1
        res = await self.breaker.call(lambda: self._revoke(
            keys=[k.key_record(key_id), k.key_by_hash(rec.secret_sha256)], args=[revoked.to_json()]))
        if int(res) == -1:
            raise KeyError(key_id)
        self._cache.clear()
        return int(res) == 1

    async def update(self, key_id: str, **changes: Any) -> KeyRecord:
        """Change the limits of an active key in place (``changes``: fields of :data:`UPDATABLE`, None clears a
        limit; budgets as ``Decimal``): same secret, same id, so its usage history stays one key's. Running
        gateways see it within ``auth.key_cache_s``. Returns the new record. Raises ``KeyError`` (unknown id),
        ``ValueError`` (a revoked key, an unknown field or an invalid limit), :class:`RedisDown`. The last of two
        concurrent updates of one key wins whole (an operator's command, not a hot path)."""
        unknown = set(changes) - set(UPDATABLE)
        if unknown:
            raise ValueError(f"cannot update {sorted(unknown)} (updatable: {list(UPDATABLE)})")
        for name in ("budget_usd_day", "budget_usd_month"):
            if changes.get(name) is not None and changes[name] < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("rpm", "tpm"):
            if changes.get(name) is not None and changes[name] < 1:
                raise ValueError(f"{name} must be >= 1")
        if changes.get("max_thinking_budget") is not None and changes["max_thinking_budget"] < 0:
            raise ValueError("max_thinking_budget must be >= 0")
        rec = await self.get(key_id)
        if rec is None:
            raise KeyError(key_id)
        if rec.revoked is not None:
            raise ValueError(f"key {key_id!r} is revoked")
        fields: dict[str, Any] = {k: (str(v) if k.startswith("budget_") and v is not None else v)
                                  for k, v in changes.items()}
        new = replace(rec, **fields)
        k = self.keys
        if k.per_key_slots:  # the lookup copy if it still exists, then the record if still active (module doc)
            raw = new.to_json()
            copied = await self.breaker.call(lambda: self.redis.set(k.key_by_hash(rec.secret_sha256), raw, xx=True))
            if not copied:
                raise ValueError(f"key {key_id!r} is revoked")
            res = await self.breaker.call(lambda: self._set_active(keys=[k.key_record(key_id)], args=[raw]))
            self._cache.clear()
            if int(res) == -1:
                raise KeyError(key_id)
            if int(res) == 0:  # revoked since it was read: that revoke deleted the copy just written
                raise ValueError(f"key {key_id!r} is revoked")
            return new
        ok = await self.breaker.call(lambda: self._update(
            keys=[k.key_record(key_id), k.key_by_hash(rec.secret_sha256)], args=[new.to_json()]))
        if not int(ok):
            raise ValueError(f"key {key_id!r} is revoked")
        self._cache.clear()
        return new

    async def lookup(self, sha256_hex: str) -> KeyInfo | None:
        """The active key whose secret hashes to ``sha256_hex``, or None.

        Raises :class:`KeyStoreUnavailable` (503) when Redis is unreachable and the digest was not seen
        within ``stale_s``. A read that timed out because this process's event loop stalled
        (:class:`RedisStalled`) is tried once more first.
        """
        now = self._clock()
        cached = self._cache.get(sha256_hex)
        if cached is not None and now - cached[1] < self.cache_s:
            return cached[0]
        name = self.keys.key_by_hash(sha256_hex)
        try:
            try:
                raw = await self.breaker.call(lambda: self.redis.get(name))
            except RedisStalled:  # this process's loop stalled, not Redis: a read, safe to repeat — once (a
                # healthy Redis answered a key's first request 503 key_store_unavailable)
                raw = await self.breaker.call(lambda: self.redis.get(name))
        except RedisDown:
            if cached is not None and cached[0] is not None and now - cached[1] < self.stale_s:
                return cached[0]
            raise KeyStoreUnavailable("the key store is unreachable; retry later",
                                      headers={"retry-after": str(max(1, int(self.breaker.cooldown_s)))}) from None
        info = KeyInfo.of(KeyRecord.from_json(raw)) if raw is not None else None
        self._cache[sha256_hex] = (info, now)
        self._cache.move_to_end(sha256_hex)
        while len(self._cache) > LOOKUP_CACHE_MAX:
            self._cache.popitem(last=False)
        return info
