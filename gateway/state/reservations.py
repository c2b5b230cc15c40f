"""Budget reservations: the one owner of their Redis format and of the Lua that reads, makes and settles them.

A reservation is an upper bound of one upstream call's cost and tokens, held from admission
(``gateway/state/limits.py``) until the call's usage event is metered (``gateway/state/metering.py``), so
concurrent requests see each other before any of them has spent. One reservation per budget level the call is
under (key, each budgeted tag, global), all under the same id — the request id, which is also the usage
event's ``event_id``; the key level's also carries the reserved tokens (the TPM window is corrected by the
real count when it settles).

Format: a field ``{id}`` of the level's hash (``gateway/state/keys.py``: ``lim:{key}:resv``,
``budget:tag:{k=v}:resv``, ``budget:global:resv``) whose value is ``"micro|tokens|expires_ms"`` — integer
micro-USD, integer tokens, epoch milliseconds after which it no longer counts (a crashed replica never
settles; ``limits.reservation_ttl_s``). Expired fields are deleted by the next admission that reads the hash.

Every level, budgeted or not: admission reserves at the key, at *each* of the key's tags and at the global
level whatever their budgets are at that moment, so a budget set while requests are in flight already sees
them (metering releases at the same levels). An unbudgeted level's hash is swept of expired fields (a crashed
replica's) once it holds more than 4,096, so it cannot grow without bound.

**Renewal** (``RENEW_LUA``): a stream still running rewrites the ``expires_ms`` of its fields (same id, same
``micro|tokens``) every third of the TTL, so a long stream never stops counting while it runs; the stream itself
is bounded by ``limits.max_stream_s`` (``gateway/pipeline/relay.py`` cuts it), so a renewed reservation is too.
A field that is gone (settled, or expired after a crash) is not re-created. All or nothing, like admission: a
renewal Redis refuses partway (a hash of the wrong type) renews no level. Grouped admission (Redis Cluster) renews
one level per call (``Limits.renew``): a refused level does not stop the others, which are renewed; the refusal is
raised once, after the last level. On a single Redis a refused call for every level is followed by those per-level
calls, so a broken level lapses alone there too.

**Rollback** (``ROLLBACK_LUA``): grouped admission (Redis Cluster, ``gateway/state/limits.py``) reserves one
level group at a time; when a later group refuses, the groups already reserved are released with this script
(their fields deleted, the key group's RPM/TPM counts taken back) — also when a later group's script is
refused (an error reply: a key of the wrong type). All or nothing, like the admission script itself.

The Lua fragments below are pasted at the top of the scripts that use them (Redis scripts cannot import).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.state.undo import UNDO_LUA, all_or_nothing

#: ``open_reserved(hash, now_ms)`` → the micro-USD sum of the hash's unexpired reservations (expired ones
#: are deleted on the way).
#: ``release(hash, id)`` deletes one and returns its reserved tokens (nil when it was not there) and the field's
#: value (the metering scripts keep it to put the field back should a later write of theirs fail).
LUA_FUNCTIONS = """
local function open_reserved(hash, now)
  local total = 0
  local r = redis.call('HGETALL', hash)
  for i = 1, #r, 2 do
    local m, exp = string.match(r[i + 1], '^(%d+)|%d+|(%d+)$')
    if not exp or tonumber(exp) <= now then
      redis.call('HDEL', hash, r[i])
    else
      total = total + tonumber(m)
    end
  end
  return total
end
local function release(hash, id)
  local v = redis.call('HGET', hash, id)
  if not v then return nil end
  redis.call('HDEL', hash, id)
  return tonumber(string.match(v, '^[^|]*|([^|]*)|')) or 0, v
end
"""

# After UNDO_LUA (``gateway/state/undo.py``): ``reserve(hash, id, micro, tokens, expires_ms, ttl_ms)`` writes one,
# logged (``hset``: deleted again should a later write of the admission script fail).
RESERVE_LUA = """
local function reserve(hash, id, micro, tokens, expires, ttl)
  hset(hash, id, micro .. '|' .. tokens .. '|' .. expires)
  redis.call('PEXPIRE', hash, ttl)
end
"""

# After LUA_FUNCTIONS and UNDO_LUA (``gateway/state/undo.py``): a reservation released (``release``), its old value
# logged to put it back should a later write of the script fail (the metering scripts; ROLLBACK).
# ``del_zero(zero, window)``: the TPM window a settlement brought to 0 (``zero``) deleted, as ROLLBACK deletes its
# windows at 0 — left as "0" until its TTL it was an empty key to no use: admission reads a missing window as 0, and
# metering corrects only a window that exists (at 0 it holds no other call's reserved tokens to correct). Called after
# every write of the script that can fail (DEL itself cannot): an undone correction would re-create a deleted window
# without its TTL.
SETTLE_LUA = """
local function settle(hash, id)
  at_cmd, at_key = 'HDEL', hash
  local tokens, v = release(hash, id)
  if v then
    U[nu + 1], U[nu + 2], U[nu + 3], U[nu + 4] = 'r', hash, id, v
    nu = nu + 4
  end
  return tokens
end
local function del_zero(zero, window)
  if zero then redis.call('DEL', window) end
end
"""

# Extend the reservation ``ARGV[1]`` in every hash of KEYS to expire at ``ARGV[2]`` (epoch ms; the hash's own
# TTL to ``ARGV[3]`` ms). Returns how many hashes still held it.
# All or nothing (``gateway/state/undo.py``): a hash of the wrong type after the first (a string SET at the global
# level's) used to fail the call with the levels before it renewed and the others not — a stream's reservation then
# lapsed at some levels and not at others; now each field rewritten is logged (``hset`` with the value just read: no
# extra command) and put back, and the call answers an error reply naming the key. The PEXPIREs are not undone (a
# hash's TTL renewed), except that a hash holding only that reservation gets its old expiry back with it.
RENEW_LUA = UNDO_LUA + all_or_nothing("""function()
  local n = 0
  for i = 1, #KEYS do
    at_cmd, at_key = 'HGET', KEYS[i]
    local v = redis.call('HGET', KEYS[i], ARGV[1])
    if v then
      local m, t = string.match(v, '^(%d+)|(%d+)|%d+$')
      if m then
        hset(KEYS[i], ARGV[1], m .. '|' .. t .. '|' .. ARGV[2], v)
        redis.call('PEXPIRE', KEYS[i], ARGV[3])
        n = n + 1
      end
    end
  end
  return n
end""", what="reservation renewal")

# Undo one admission group: delete the reservation ``ARGV[1]`` from the ``ARGV[2]`` reservation hashes KEYS[1..n];
# the key group also passes its RPM and TPM counters of the window it was counted in (KEYS[n+1], KEYS[n+2]): one
# request is taken back when ``ARGV[3]`` = '1', ``ARGV[4]`` tokens from the TPM count; a counter brought to 0 is
# deleted (it used to be left as "0" until its TTL: admission reads a missing window as 0, and metering corrects only a
# TPM window that exists — at 0 it holds no other call's reserved tokens to correct). Returns the fields deleted.
# All or nothing (``gateway/state/undo.py``): a counter that is no integer (or a key of the wrong type) fails the
# call with the reservations still there, so the call can be sent again in full once the key is fixed — the counts
# are taken back only with a reservation still there, so a rollback that had deleted them and then failed left the
# counts up for good.
ROLLBACK_LUA = LUA_FUNCTIONS + UNDO_LUA + SETTLE_LUA + all_or_nothing("""function()
  local nres = tonumber(ARGV[2])
  local n = 0
  for i = 1, nres do
    if settle(KEYS[i], ARGV[1]) then n = n + 1 end
  end
  -- the counts are taken back only with a reservation still there: a call sent again (its first reply was lost to
  -- a timeout, or it was kept through an outage) takes nothing back twice
  if n > 0 and #KEYS >= nres + 2 then
    local zero = {}
    if ARGV[3] == '1' and redis.call('EXISTS', KEYS[nres + 1]) == 1 and incrby(KEYS[nres + 1], -1) == 0 then
      zero[#zero + 1] = KEYS[nres + 1]
    end
    if ARGV[4] ~= '0' and redis.call('EXISTS', KEYS[nres + 2]) == 1
        and incrby(KEYS[nres + 2], '-' .. ARGV[4]) == 0 then
      zero[#zero + 1] = KEYS[nres + 2]
    end
    -- a window brought back to 0 is deleted (as the undo of the admission's own INCR does): a counter at 0 reads as
    -- none. Last, after every write that can fail: an undo of the decrement would re-create a deleted window
    -- without its TTL
    for _, k in ipairs(zero) do redis.call('DEL', k) end
  end
  return n
end""", what="admission rollback")


@dataclass(frozen=True, slots=True)
class Reservation:
    """One open reservation: upper bounds in integer micro-USD and tokens; ``expires_ms`` epoch ms."""

    micro_usd: int
    tokens: int
    expires_ms: int

    def encode(self) -> str:
        return f"{self.micro_usd}|{self.tokens}|{self.expires_ms}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Reservation | None:
        """Parse ``"micro|tokens|expires_ms"``; None when malformed (such a field never counts)."""
        text = raw.decode() if isinstance(raw, bytes) else raw
        parts = text.split("|")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            return None
        return cls(int(parts[0]), int(parts[1]), int(parts[2]))


def open_total(fields: Mapping[bytes | str, bytes | str], now_ms: int) -> int:
    """Micro-USD sum of the unexpired reservations in a level hash's fields (what admission counts)."""
    total = 0
    for raw in fields.values():
        r = Reservation.decode(raw)
        if r is not None and r.expires_ms > now_ms:
            total += r.micro_usd
    return total
