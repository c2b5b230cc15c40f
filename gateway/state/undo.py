"""All-or-nothing Lua scripts: the undo log the metering and admission scripts write through.

Redis runs a script atomically but never rolls back the writes it made before one of its commands failed (a key of
the wrong type — a string ``SET`` at one of ThinkGate's hashes —, a hash field or counter that holds no integer): a
usage event was half counted (in the seen-set, the stream, some counters; its reservations gone) and a replay dropped
it as a duplicate; an admission was half made (some levels reserved, the RPM window counted) with nothing to release
it. So those scripts write through the helpers of :data:`UNDO_LUA`, which log the inverse of every write that changed
something, and run their body under ``pcall`` (:func:`all_or_nothing`): on the first error the log is undone in
reverse order and the script answers an error reply naming the command and the key that failed.

One module for both families (``gateway/state/metering.py``: ``RECORD``, ``AUDIT``, ``RELEASE``;
``gateway/state/limits.py``: ``ADMIT`` and the hot path's ``HOT``; ``gateway/state/reservations.py``: ``ROLLBACK`` and
``RENEW``; ``gateway/state/budgets.py``: ``SET`` and ``SYNC``),
so an undo is written once: the scripts cannot import, they are pasted together from these fragments.
"""

from __future__ import annotations

# The inverses: SADD → SREM, XADD → XDEL (and DEL of a stream it left empty with no consumer group), HINCRBY →
# HINCRBY of the opposite (then HDEL at 0: a counter at 0 reads as none), INCRBY → INCRBY of the opposite (then DEL
# at 0: a window the INCR made is gone again, and a counter at 0 reads as none), HSETNX/ZADD of a new field/member →
# HDEL/ZREM, an HSET over a field (``hset``) → HSET of its old value, the HDEL of a reservation → HSET of its old value
# (and, when that HDEL had emptied and so deleted the hash, a TTL again: the reservation's expiry). EXPIRE/PEXPIRE,
# the late index's trim and admission's sweep of expired reservations are not undone (a TTL renewed, entries past
# their use removed). A script's last write needs no undo (nothing can fail after it): the metering scripts' HDEL of
# the write-ahead record, the hot path's cache lock. RECORD's counter HINCRBYs (most of its writes) are not logged
# but counted (na, nb), and listed again only on failure; the undo code (UNDONE_LUA) is reached, and its functions
# made, only on failure: +3 to +4 µs of Redis time per RECORD call (~5%; logging every write cost +9 µs;
# bench/RESULTS.md, "All-or-nothing metering scripts").
UNDO_LUA = """
-- the undo log: 4 slots a write (op, key, a, b), made 64 slots long at once (16 logged writes: an event with 4 tags)
-- instead of grown by doubling
local U = {""" + ", ".join(["false"] * 64) + """}
local nu, at_cmd, at_key = 0, '', ''
-- RECORD's counter HINCRBYs are not logged (most of its writes): it counts them (na, then nb: the levels); its
-- failure path lists them again in the same order to take back the first na / nb
local na, nb = 0, 0
local function hincr(k, f, n)
  at_cmd, at_key = 'HINCRBY', k
  redis.call('HINCRBY', k, f, n)
  U[nu + 1], U[nu + 2], U[nu + 3], U[nu + 4] = 'h', k, f, n
  nu = nu + 4
end
local function sadd(k, m)
  at_cmd, at_key = 'SADD', k
  local r = redis.call('SADD', k, m)
  if r == 1 then
    U[nu + 1], U[nu + 2], U[nu + 3] = 's', k, m
    nu = nu + 4
  end
  return r
end
local function incrby(k, n)
  at_cmd, at_key = 'INCRBY', k
  local r = redis.call('INCRBY', k, n)
  U[nu + 1], U[nu + 2], U[nu + 4] = 'i', k, n
  nu = nu + 4
  return r
end
-- one hash field set: HSETNX (one command, as HSET) when it is new, logged as HDEL; else its old value read and
-- logged to be put back (a call sent twice under the same id). ``old``: the field's value the caller has just read
-- (RENEW): no HSETNX, no HGET — an HSET logged to put it back
local function hset(k, f, v, old)
  at_cmd, at_key = 'HSET', k
  if not old and redis.call('HSETNX', k, f, v) == 1 then
    U[nu + 1], U[nu + 2], U[nu + 3] = 'f', k, f
  else
    U[nu + 1], U[nu + 2], U[nu + 3], U[nu + 4] = 'r', k, f, old or redis.call('HGET', k, f)
    redis.call('HSET', k, f, v)
  end
  nu = nu + 4
end
"""

# The end of each such script: its body (a function) run under pcall; on an error, undone (``UNDO_LUA``) and an
# error reply. Everything after ``if ok`` runs only on that path, so its functions cost nothing on the others.
UNDONE_LUA = """
local function neg(n)
  if type(n) == 'number' then return -n end
  -- '-0' is no integer to HINCRBY (a zero-cost event's level increments): its undo failed, leaving the hash
  if n == '0' then return '0' end
  if string.sub(n, 1, 1) == '-' then return string.sub(n, 2) end
  return '-' .. n
end
local function unincr(k, f, n)
  if redis.pcall('HINCRBY', k, f, neg(n)) == 0 then redis.pcall('HDEL', k, f) end
end
"""
UNDO_LOG_LUA = """
for i = nu - 3, 1, -4 do
  local op, k, a, b = U[i], U[i + 1], U[i + 2], U[i + 3]
  if op == 'h' then unincr(k, a, b)
  elseif op == 's' then redis.pcall('SREM', k, a)
  elseif op == 'x' then
    redis.pcall('XDEL', k, a)
    -- a stream the XADD created: gone again (an empty stream with no consumer group reads as none)
    if redis.pcall('XLEN', k) == 0 and #redis.pcall('XINFO', 'GROUPS', k) == 0 then redis.pcall('DEL', k) end
  elseif op == 'z' then redis.pcall('ZREM', k, a)
  elseif op == 'f' then redis.pcall('HDEL', k, a)
  elseif op == 'r' then
    redis.pcall('HSET', k, a, b)
    -- alone in it again: the HDEL had emptied the hash, which went with its TTL; it expires with the reservation
    local exp = tonumber(string.match(b, '|(%d+)$'))
    if exp and redis.pcall('HLEN', k) == 1 then redis.pcall('PEXPIREAT', k, exp) end
  elseif op == 'i' then
    if redis.pcall('INCRBY', k, neg(b)) == 0 then redis.pcall('DEL', k) end
  end
end
local err = type(res) == 'table' and res.err or tostring(res)
local code, msg = string.match(err, '^(%u[%u_]*) (.*)$')
if not code then code, msg = 'ERR', err end
return redis.error_reply(code .. ' ThinkGate WHAT: ' .. at_cmd .. ' ' .. at_key
  .. ' failed, nothing written (undone): ' .. msg)
"""


def all_or_nothing(body: str, failed: str = "", what: str = "metering") -> str:
    """The Lua that runs ``body`` (an expression: a function) all or nothing (after :data:`UNDO_LUA`): its error
    reply reads ``<code> ThinkGate <what>: <command> <key> failed, nothing written (undone): <Redis's message>``.
    ``failed``: Lua of the script's own to run first on that path (RECORD: its counted writes taken back)."""
    return (f"local ok, res = pcall({body})\nif ok then return res end\n" + UNDONE_LUA + failed
            + UNDO_LOG_LUA.replace("ThinkGate WHAT:", f"ThinkGate {what}:"))
