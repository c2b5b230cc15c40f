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

- **create**: ``SADD ids`` (the claim: 0 → :class:`KeyExists`; ids are never reused, so two creates of one id
  cannot both pass it) → ``SET h`` → ``SET rec``. A crash after the claim leaves an id with no record: ``list``
  and ``get`` skip it, ``revoke``/``update`` say unknown, and the id stays taken. A crash after ``SET h`` also
  leaves a lookup copy whose secret was never returned, let alone printed (32 random bytes): nobody can present
  it, so it authenticates no one. The record is written last, so a key that ``list`` shows always has its lookup
  copy (until revoked).
- **revoke**: ``DEL h`` first — from then on the key no longer authenticates (after ``auth.key_cache_s``) —
  then the record is rewritten as revoked (:data:`SET_ACTIVE_LUA`, on the record's slot). A crash between
  leaves a key that no longer authenticates but is listed as active; ``update`` refuses it (no lookup copy:
  revoked) and a rerun of ``revoke`` finishes it (the record is active, ``DEL h`` is a no-op, the revoked
  record is written, True). Never the other way round: a record marked revoked whose secret still works.
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
# Returns 1, 0 (already revoked: the lookup copy is gone), -1 (unknown id).
REVOKE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
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
        """Create on a sharded prefix: claim the id, then the lookup copy, then the record (module doc)."""
        k, raw = self.keys, rec.to_json()
        if not int(await self.breaker.call(lambda: self.redis.sadd(k.key_ids, rec.id))):
            raise KeyExists(f"key id {rec.id!r} exists (ids are never reused)")
        await self.breaker.call(lambda: self.redis.set(k.key_by_hash(rec.secret_sha256), raw))
        await self.breaker.call(lambda: self.redis.set(k.key_record(rec.id), raw))

    async def list(self) -> list[KeyRecord]:
        """Every key (revoked ones included), by id. Raises :class:`RedisDown`."""
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
        return [KeyRecord.from_json(r) for r in raws if r is not None]

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
