"""The semantic cache's index in Redis: LSH band buckets as Redis keys, one round trip per lookup.

Keys (``p`` = prefix, ``t`` = 16-hex tenant tag of the cache scope, ``c`` = the bucket: 16 hex of the
context key and 8 hex of the question's numbers in order, see ``gateway/semantic/cache.py``):

==========================================  ======  =====================================================
key                                          type    contents
==========================================  ======  =====================================================
``p sem:{t}:e``                              hash    entry id → record; ``b:<id>`` → its bucket and bands
``p sem:{t}:x``                              zset    entry id → expiry (epoch ms): TTL and the entry cap
``p sem:{t}:b:{c}:{band}:{hash}``            list    entry ids whose sketch has this band (newest first,
                                                     at most :data:`BUCKET_MAX`)
==========================================  ======  =====================================================

An entry id is the exact cache digest of the stored answer (``p cache:{id}`` holds the body), so storing the
same request twice replaces one entry. A **record** is ``JSON + "\\n" + payload``: the JSON carries the
context key, the expiry, the guard features, the stored request id, its ``max_tokens`` and the sketch kind;
the payload is the sketch's bytes.

**Lookup** (``LOOKUP_LUA``, one round trip): read the query's 16 band lists, count how many bands each id
shares, and return the records of the :attr:`max_candidates` ids with most shared bands. Scoring
(similarity, guard, threshold) happens in the caller.

**Insert** (``INSERT_LUA``, one round trip): drop up to 64 expired entries of the tenant, write the record,
push the id onto its band lists (trimmed), then evict the soonest-expiring entries above the tenant's cap.
Every key gets the entry's TTL when it has less, so an idle tenant's index disappears on its own. The scripts
touch band keys of evicted entries that are not in ``KEYS``: fine on one server; in Cluster mode every key
of one tenant's index carries that tenant's hash tag (``gateway/state/keys.py``), so they share its slot and
still run.

Redis's own vector search (RediSearch, ``FT.*``) is detected (:meth:`SemanticIndex.detect`) and reported,
but not used yet: the LSH index works on every Redis ≥ 6.2.

Failures: every call goes through the shared breaker; :class:`~gateway.breaker.RedisDown` propagates and
the caller bypasses the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.state.breaker import Breaker
from gateway.state.keys import RedisKeys
from gateway.state.redis import RedisHandle

BUCKET_MAX = 64
EXPIRED_PER_INSERT = 64

# KEYS: 1 entries hash, 2.. band lists; ARGV: 1 max candidates.
# Returns a flat list: id, shared bands, record (nil when gone), ... best first.
LOOKUP_LUA = """
local counts, order = {}, {}
for i = 2, #KEYS do
  local ids = redis.call('LRANGE', KEYS[i], 0, -1)
  for _, id in ipairs(ids) do
    local c = counts[id]
    if c then counts[id] = c + 1 else counts[id] = 1; order[#order + 1] = id end
  end
end
if #order == 0 then return {} end
local rank = {}
for i, id in ipairs(order) do rank[id] = i end
table.sort(order, function(a, b)
  if counts[a] ~= counts[b] then return counts[a] > counts[b] end
  return rank[a] < rank[b]
end)
local n = math.min(#order, tonumber(ARGV[1]))
local pick = {}
for i = 1, n do pick[i] = order[i] end
local recs = redis.call('HMGET', KEYS[1], unpack(pick))
local out = {}
for i = 1, n do
  out[#out + 1] = pick[i]; out[#out + 1] = counts[pick[i]]; out[#out + 1] = recs[i]
end
return out
"""

# KEYS: 1 entries hash, 2 expiry zset, 3.. band lists of the new entry.
# ARGV: 1 id, 2 record, 3 bands ("<bucket> <hash0> … <hash15>"), 4 now ms, 5 expiry ms, 6 cap, 7 ttl s,
#       8 bucket max, 9 expired entries to drop at most, 10 band key base ("<p>sem:<t>:b:").
# Returns the number of entries evicted by the cap. An entry's band keys are rebuilt from its "b:" field
# (base .. bucket .. ':' .. band index .. ':' .. hash), a quarter of the bytes of the keys themselves.
INSERT_LUA = """
local function drop(id)
  local bands = redis.call('HGET', KEYS[1], 'b:' .. id)
  if bands then
    local ctx, i = nil, 0
    for h in string.gmatch(bands, '%S+') do
      if ctx == nil then ctx = h else
        redis.call('LREM', ARGV[10] .. ctx .. ':' .. i .. ':' .. h, 0, id); i = i + 1
      end
    end
  end
  redis.call('HDEL', KEYS[1], id, 'b:' .. id)
  redis.call('ZREM', KEYS[2], id)
end
local ttl = tonumber(ARGV[7])
local function keep(key)
  if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl) end
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[4], 'LIMIT', 0, tonumber(ARGV[9]))) do
  drop(id)
end
if redis.call('HEXISTS', KEYS[1], 'b:' .. ARGV[1]) == 1 then drop(ARGV[1]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], 'b:' .. ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
local bucket = tonumber(ARGV[8])
for i = 3, #KEYS do
  redis.call('LPUSH', KEYS[i], ARGV[1])
  redis.call('LTRIM', KEYS[i], 0, bucket - 1)
  keep(KEYS[i])
end
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[6])
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, over - 1)) do drop(id) end
else
  over = 0
end
keep(KEYS[1]); keep(KEYS[2])
return over
"""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A stored entry returned by a lookup: ``shared_bands`` of 16, ``meta`` the record's JSON, ``payload``
    the sketch bytes."""

    entry_id: str
    shared_bands: int
    meta: dict[str, Any]
    payload: bytes


def encode_record(meta: dict[str, Any], payload: bytes) -> bytes:
    """``meta`` as compact JSON (never contains a raw newline), a newline, the payload bytes."""
    return orjson.dumps(meta) + b"\n" + payload


def decode_record(raw: bytes) -> tuple[dict[str, Any], bytes] | None:
    """Inverse of :func:`encode_record`; None when unreadable."""
    head, sep, payload = raw.partition(b"\n")
    if not sep:
        return None
    try:
        meta = orjson.loads(head)
    except orjson.JSONDecodeError:
        return None
    return (meta, payload) if isinstance(meta, dict) else None


class SemanticIndex:
    """LSH index of one Redis (see the module doc); one per process."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, max_entries_per_tenant: int,
                 max_candidates: int = 16) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.cap = max_entries_per_tenant
        self.max_candidates = max_candidates
        self._lookup = self.redis.register_script(LOOKUP_LUA)
        self.insert_script = self.redis.register_script(INSERT_LUA)
        self.vector_search: bool | None = None  # None until detect() ran
        self.evicted = 0

    # --- keys ---------------------------------------------------------------------------------------
    def entries_key(self, tenant: str) -> str:
        return self.keys.semantic_entries(tenant)

    def expiry_key(self, tenant: str) -> str:
        return self.keys.semantic_expiry(tenant)

    def band_base(self, tenant: str) -> str:
        return self.keys.semantic_band_base(tenant)

    def band_keys(self, tenant: str, bucket: str, bands: tuple[str, ...]) -> list[str]:
        base = self.band_base(tenant)
        return [f"{base}{bucket}:{i}:{h}" for i, h in enumerate(bands)]

    # --- operations ---------------------------------------------------------------------------------
    async def detect(self) -> bool:
        """Whether the server has a search module (``MODULE LIST`` names ``search``/``ft``); cached."""
        if self.vector_search is None:
            try:
                modules = await self.breaker.call(lambda: self.redis.execute_command("MODULE", "LIST"))
            except Exception:  # older servers, ACLs without MODULE: no vector search
                modules = []
            names: set[str] = set()
            for m in modules or []:
                if isinstance(m, dict):
                    raw = m.get(b"name") or m.get("name") or b""
                elif isinstance(m, list | tuple):
                    raw = m[1] if len(m) > 1 else b""
                else:
                    raw = b""
                names.add((raw.decode() if isinstance(raw, bytes) else str(raw)).lower())
            self.vector_search = bool(names & {"search", "ft", "searchlight"})
        return self.vector_search

    async def lookup(self, tenant: str, context: str, bucket: str, bands: tuple[str, ...]) -> list[Candidate]:
        """The best candidates for a sketch with ``bands`` in ``tenant``/``context`` (unexpired, readable,
        same context). Raises RedisDown."""
        keys = [self.entries_key(tenant), *self.band_keys(tenant, bucket, bands)]
        flat = await self.breaker.call(lambda: self._lookup(keys=keys, args=[self.max_candidates]))
        now_ms = time.time() * 1000
        out: list[Candidate] = []
        for i in range(0, len(flat or []), 3):
            raw = flat[i + 2]
            if not raw:
                continue
            rec = decode_record(raw)
            if rec is None:
                continue
            meta, payload = rec
            if meta.get("ctx") != context or float(meta.get("exp", 0)) <= now_ms:
                continue
            entry_id = flat[i].decode() if isinstance(flat[i], bytes) else str(flat[i])
            out.append(Candidate(entry_id, int(flat[i + 1]), meta, payload))
        return out

    def insert_call(self, tenant: str, context: str, bucket: str, entry_id: str, bands: tuple[str, ...],
                    meta: dict[str, Any], payload: bytes, ttl_s: int) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the insert script for one entry (for :meth:`insert`, or a pipeline of
        ``self.insert_script(keys=…, args=…, client=pipe)`` calls when filling in bulk)."""
        now_ms = int(time.time() * 1000)
        exp_ms = now_ms + ttl_s * 1000
        record = encode_record({**meta, "ctx": context, "exp": exp_ms}, payload)
        band_keys = self.band_keys(tenant, bucket, bands)
        keys = [self.entries_key(tenant), self.expiry_key(tenant), *band_keys]
        args = [entry_id, record, " ".join((bucket, *bands)), now_ms, exp_ms, self.cap, ttl_s, BUCKET_MAX,
                EXPIRED_PER_INSERT, self.band_base(tenant)]
        return keys, args

    async def insert(self, tenant: str, context: str, bucket: str, entry_id: str, bands: tuple[str, ...],
                     meta: dict[str, Any], payload: bytes, ttl_s: int) -> int:
        """Store an entry for ``ttl_s`` seconds; returns how many entries the cap evicted. Raises RedisDown.

        ``meta`` gets ``ctx`` and ``exp`` (epoch ms) added."""
        keys, args = self.insert_call(tenant, context, bucket, entry_id, bands, meta, payload, ttl_s)
        evicted = int(await self.breaker.call(lambda: self.insert_script(keys=keys, args=args)))
        self.evicted += evicted
        return evicted

    async def size(self, tenant: str) -> int:
        """Entries stored for ``tenant`` (expired ones not yet dropped included). Raises RedisDown."""
        return int(await self.breaker.call(lambda: self.redis.zcard(self.expiry_key(tenant))))
