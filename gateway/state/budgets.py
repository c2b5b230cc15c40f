"""Budget levels above the key: tag budgets (every key tagged ``team=a`` shares one) and a global budget.

A request is under the budgets of several **levels**: its key (``budget_usd_day`` / ``budget_usd_month`` of the
key), every tag ``k=v`` of the key that has a budget, and the global level when it has one. Admission
(``gateway/state/limits.py``) checks and reserves all of them in one Lua script; metering adds each event's
cost to the key's, each of its tags' and the global day/month counters in its own script.

Where level budgets come from: ``limits.tag_budgets`` / ``limits.global_budget`` in the config, and Redis,
written by ``thinkgate budgets set|remove``: the listing hash ``budgets:defs`` (level id → JSON
``{"usd_day": "50", "usd_month": null}``, USD as decimal strings) and, for admission, one definition hash per
level next to the level's own keys (``budget:tag:{k=v}:def`` / ``budget:global:def``: ``day``, ``month`` in
integer micro-USD, ``-1`` = none for that period). A level set in Redis overrides the config's for that level.

**In force for the next request.** The admission script reads each level's definition hash itself, in the
same atomic step as the spend and the reservations (``gateway/state/limits.py``), so a budget set, raised or
lowered holds for the next request on every replica — no window in which a replica has not seen it yet.
:class:`BudgetLevels` keeps a per-process copy (re-read at most every ``limits.budget_refresh_s`` seconds) that
serves only while Redis is down (``fail_open``), and for views (``/v1/usage``, alerts). Definitions stored by
an older version (``budgets:defs`` only) get their definition hash on a gateway's start
(:meth:`BudgetStore.sync`: one script, which never writes over a budget set or removed meanwhile).

Level ids: ``key:{id}`` (internal only), ``tag:{k=v}``, ``global``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

import orjson
from redis.exceptions import ResponseError

from gateway.config import LevelBudget, LimitsConfig
from gateway.ledger.event import usd_to_micro
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys
from gateway.state.log_throttle import LogThrottle, held_back
from gateway.state.redis import FastScript, RedisHandle
from gateway.state.undo import UNDO_LUA, all_or_nothing

log = logging.getLogger("thinkgate.limits")

LevelKind = Literal["key", "tag", "global"]
GLOBAL = "global"

# ``thinkgate budgets set``: the level's definition hash (KEYS[1]: ``day`` ARGV[1], ``month`` ARGV[2], integer
# micro-USD, -1 = none) and its listing (KEYS[2] ``budgets:defs``: field ARGV[3], the level id → ARGV[4], its JSON),
# in one script, all or nothing (``gateway/state/undo.py``). Two writes used to make it: a listing of the wrong type
# (a string SET at ``budgets:defs``) refused the second after the first, and the budget was in force (admission reads
# the definition) but listed nowhere: not in ``budgets list`` or ``/v1/usage``, nor in the replicas' own copies (what
# ``fail_open`` decides on). Now the definition is put back as it was and the error reply names the key. Both keys
# are shared (one slot on a Cluster, ``gateway/state/keys.py``).
SET_LUA = UNDO_LUA + all_or_nothing("""function()
  hset(KEYS[1], 'day', ARGV[1])
  hset(KEYS[1], 'month', ARGV[2])
  hset(KEYS[2], ARGV[3], ARGV[4])
  return 1
end""", what="budgets set")

# ``thinkgate budgets remove``: the listing's field first (HDEL ARGV[1] of KEYS[2] — the one command that can fail, on
# a listing of the wrong type, before anything is written), then the definition hash (DEL, which no key's type
# fails): all or nothing without an undo log, in one script. Returns whether the level was listed.
REMOVE_LUA = """
local n = redis.pcall('HDEL', KEYS[2], ARGV[1])
if type(n) == 'table' and n.err then  -- name the key, as the all-or-nothing scripts' errors do
  return redis.error_reply(n.err .. ' (HDEL ' .. KEYS[2] .. ')')
end
redis.call('DEL', KEYS[1])
return n
"""

# :meth:`BudgetStore.sync` (a gateway's start): a definition hash for each listed level that has none (definitions
# stored by an older version: ``budgets:defs`` only). KEYS[1] ``budgets:defs``, then per level i (0-based) its
# definition hash KEYS[2+i]; ARGV per level: 1+4i its listing field (the level id), 2+4i the listing's JSON as sync
# read it, 3+4i ``day``, 4+4i ``month`` (integer micro-USD, -1 = none). A level is written only while its listing still
# holds that JSON and it still has no definition, in the same atomic step: a ``budgets set`` or ``remove`` between
# sync's read and its write wins. Sync used to check and write level by level with commands of their own: a level
# ``budgets remove`` took away in between got its definition back (in force, listed nowhere), and a ``budgets set``
# between the check and the write had its new amounts overwritten by the old. All or nothing
# (``gateway/state/undo.py``), like SET; its keys are shared (one slot on a Cluster, ``gateway/state/keys.py``).
# Returns how many levels it wrote.
SYNC_LUA = UNDO_LUA + all_or_nothing("""function()
  local n = 0
  for i = 2, #KEYS do
    local a = 4 * (i - 2)
    at_cmd, at_key = 'HGET', KEYS[1]
    if redis.call('HGET', KEYS[1], ARGV[a + 1]) == ARGV[a + 2] and redis.call('EXISTS', KEYS[i]) == 0 then
      hset(KEYS[i], 'day', ARGV[a + 3])
      hset(KEYS[i], 'month', ARGV[a + 4])
      n = n + 1
    end
  end
  return n
end""", what="budgets sync")


@dataclass(frozen=True, slots=True)
class Level:
    """One budget level: budgets in integer micro-USD (``None`` = none for that period)."""

    kind: LevelKind
    name: str  # key id, "k=v", or "global"
    day_micro: int | None = None
    month_micro: int | None = None

    @property
    def id(self) -> str:
        """``key:{id}``, ``tag:{k=v}`` or ``global``."""
        return GLOBAL if self.kind == "global" else f"{self.kind}:{self.name}"

    @property
    def label(self) -> str:
        """How messages and ``/v1/usage`` name the level: ``key alice``, ``tag team=a``, ``global``."""
        return GLOBAL if self.kind == "global" else f"{self.kind} {self.name}"

    @property
    def budgeted(self) -> bool:
        return self.day_micro is not None or self.month_micro is not None


def parse_level(spec: str) -> tuple[LevelKind, str]:
    """``"tag:team=a"`` / ``"global"`` → (kind, name); raises ValueError otherwise."""
    if spec == GLOBAL:
        return "global", GLOBAL
    kind, _, name = spec.partition(":")
    k, sep, _ = name.partition("=")
    if kind != "tag" or not sep or not k or "|" in name:
        raise ValueError(f"a budget level is 'global' or 'tag:name=value', got {spec!r}")
    return "tag", name


def event_level_ids(key_id: str, tags: Mapping[str, str]) -> list[str]:
    """Every level id an event of ``key_id`` with ``tags`` counts in (key, each tag, global)."""
    return [f"key:{key_id}", *(f"tag:{k}={v}" for k, v in sorted(tags.items())), GLOBAL]


def _micro(v: Any) -> int | None:
    if v is None:
        return None
    try:
        d = Decimal(str(v))
    except InvalidOperation:
        return None
    return usd_to_micro(d) if d.is_finite() and d >= 0 else None


def _def_amount(micro: int | None) -> int:
    """A definition hash's amount: integer micro-USD, -1 = none."""
    return -1 if micro is None else micro


def _from_config(b: LevelBudget | None) -> tuple[int | None, int | None]:
    if b is None:
        return None, None
    return (usd_to_micro(b.usd_day) if b.usd_day is not None else None,
            usd_to_micro(b.usd_month) if b.usd_month is not None else None)


class BudgetLevels:
    """The level budgets in force (config + Redis overrides), cached for ``limits.budget_refresh_s``."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, cfg: LimitsConfig,
                 clock: Any = time.monotonic) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.cfg = cfg
        self._clock = clock
        self._config: dict[str, tuple[int | None, int | None]] = {
            f"tag:{t}": _from_config(b) for t, b in cfg.tag_budgets.items()}
        if cfg.global_budget is not None:
            self._config[GLOBAL] = _from_config(cfg.global_budget)
        self._stored: dict[str, tuple[int | None, int | None]] = {}
        self._read_at: float | None = None
        self._refused_log = LogThrottle()  # a refused listing is read (and refused) before every admission
        #: the key and error of the last read of the listing Redis refused (None: the last read was taken)
        self.refused: str | None = None
        #: the definitions have been read from Redis at least once since this process started (a pod that never
        #: reached Redis knows none of the budgets set with ``thinkgate budgets set``: ``/ready`` says so)
        self.synced = False

    async def refresh(self, force: bool = False) -> None:
        """Re-read ``budgets:defs`` when the copy is older than ``budget_refresh_s`` (or ``force``)."""
        now = self._clock()
        if not force and self._read_at is not None and now - self._read_at < self.cfg.budget_refresh_s:
            return
        self._read_at = now
        try:
            raw = await self.breaker.call(lambda: self.redis.hgetall(self.keys.budget_defs))
        except RedisDown:
            return  # keep the last copy
        except ResponseError as exc:  # the listing is not a hash (a key of the wrong type): keep the last copy
            # too — this read runs before every admission, and raising it answered every request 500 (admission
            # itself reads each level's definition, so a budget set there still holds)
            self.refused = f"{self.keys.budget_defs}: {exc}"
            if (held := self._refused_log.due(now=now)) is not None:
                log.error("budgets: Redis refused reading %s (%s); the budgets as last read are kept — fix or "
                          "delete that key%s", self.keys.budget_defs, exc, held_back(held))
            return
        stored: dict[str, tuple[int | None, int | None]] = {}
        for field, value in raw.items():
            try:
                d = orjson.loads(value)
            except orjson.JSONDecodeError:
                continue
            stored[field.decode() if isinstance(field, bytes) else field] = (_micro(d.get("usd_day")),
                                                                              _micro(d.get("usd_month")))
        self._stored = stored
        self.synced = True
        self.refused = None

    def learn(self, levels: Iterable[Level]) -> None:
        """Take the budgets an admission script applied (``Admission.levels``: the definitions in Redis at that
        moment) into the copy. A request decided on the copy (its admission call failed: Redis down, or a
        timeout on a starved host) right after ``thinkgate budgets set`` then knows the budget at once, not
        ``budget_refresh_s`` later. Key levels are skipped (the key's own budget travels with the key)."""
        for lvl in levels:
            if lvl.kind == "key":
                continue
            seen = (lvl.day_micro, lvl.month_micro)
            if seen == (self._budget(lvl.id) or (None, None)):
                continue
            if seen == self._config.get(lvl.id, (None, None)):
                self._stored.pop(lvl.id, None)  # no definition in Redis: the config's budget (or none) applies
            else:
                self._stored[lvl.id] = seen

    def _budget(self, level_id: str) -> tuple[int | None, int | None] | None:
        return self._stored.get(level_id) or self._config.get(level_id)

    def candidates(self, tags: Mapping[str, str]) -> list[Level]:
        """Every level above a key with ``tags`` — each tag (sorted), then global — with the *config's* budgets
        (``None`` when none): what admission passes to its script, which applies the level's Redis definition
        instead when there is one."""
        out = [Level("tag", f"{k}={v}", *self._config.get(f"tag:{k}={v}", (None, None)))
               for k, v in sorted(tags.items())]
        out.append(Level("global", GLOBAL, *self._config.get(GLOBAL, (None, None))))
        return out

    def above_key(self, tags: Mapping[str, str]) -> list[Level]:
        """The budgeted levels above a key with ``tags``: its tags' (sorted), then global."""
        out: list[Level] = []
        for k, v in sorted(tags.items()):
            b = self._budget(f"tag:{k}={v}")
            if b is not None and (b[0] is not None or b[1] is not None):
                out.append(Level("tag", f"{k}={v}", *b))
        b = self._budget(GLOBAL)
        if b is not None and (b[0] is not None or b[1] is not None):
            out.append(Level("global", GLOBAL, *b))
        return out

    def configured(self) -> dict[str, tuple[int | None, int | None, str]]:
        """Every level with a budget: id → (day micro, month micro, source ``config`` | ``redis``)."""
        out = {i: (*b, "config") for i, b in self._config.items()}
        out.update({i: (*b, "redis") for i, b in self._stored.items()})
        return out


class BudgetStore:
    """``budgets:defs`` read and written by ``thinkgate budgets set|list|remove``."""

    def __init__(self, handle: RedisHandle, breaker: Breaker) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self._set = FastScript(handle, SET_LUA)
        self._remove = FastScript(handle, REMOVE_LUA)
        self._sync = FastScript(handle, SYNC_LUA)

    async def set(self, level_id: str, usd_day: Decimal | None, usd_month: Decimal | None) -> None:
        """Set (replace) the budgets of ``level_id`` (``tag:k=v`` or ``global``); at least one amount. The definition
        (what admission applies) and the listing are written all or nothing (:data:`SET_LUA`): raises the
        ``ResponseError`` of a write Redis refused (a key of the wrong type, named in it), nothing written."""
        kind, name = parse_level(level_id)
        if usd_day is None and usd_month is None:
            raise ValueError("give a daily and/or a monthly amount")
        for v in (usd_day, usd_month):
            if v is not None and (not v.is_finite() or v < 0):
                raise ValueError("budgets must be >= 0")
        value = orjson.dumps({"usd_day": str(usd_day) if usd_day is not None else None,
                              "usd_month": str(usd_month) if usd_month is not None else None})
        day = usd_to_micro(usd_day) if usd_day is not None else -1
        month = usd_to_micro(usd_month) if usd_month is not None else -1
        keys = [self.keys.level_budget(kind, name), self.keys.budget_defs]
        await self.breaker.call(lambda: self._set(keys=keys, args=[day, month, level_id, value]))

    async def remove(self, level_id: str) -> bool:
        """Delete the stored budgets of ``level_id``; False when there were none. All or nothing
        (:data:`REMOVE_LUA`): raises the ``ResponseError`` of a listing Redis refused, nothing deleted."""
        kind, name = parse_level(level_id)
        keys = [self.keys.level_budget(kind, name), self.keys.budget_defs]
        return bool(await self.breaker.call(lambda: self._remove(keys=keys, args=[level_id])))

    async def sync(self) -> int:
        """Give every level listed in ``budgets:defs`` without a definition hash one (definitions stored before
        admission read them in Redis); returns how many were written. One read of the listing, then one script
        (:data:`SYNC_LUA`) that writes a level only while its listing is still what was read and it still has no
        definition — a ``budgets set`` or ``remove`` in between wins —, all or nothing. Raises RedisDown, or the
        ``ResponseError`` of a listing Redis refused (a key of the wrong type, named in it; nothing written)."""
        raw = await self.breaker.call(lambda: self.redis.hgetall(self.keys.budget_defs))
        keys: list[str] = [self.keys.budget_defs]
        args: list[str | bytes | int] = []
        for field, value in raw.items():
            level = self._listed(field, value)
            if level is not None:
                keys.append(self.keys.level_budget(level.kind, level.name))
                args += [field, value, _def_amount(level.day_micro), _def_amount(level.month_micro)]
        if len(keys) == 1:
            return 0
        return int(await self.breaker.call(lambda: self._sync(keys=keys, args=args)))

    @staticmethod
    def _listed(field: bytes | str, value: bytes | str) -> Level | None:
        """The level of one ``budgets:defs`` entry with its amounts (integer micro-USD); None for a field that is no
        level id or a value that is no JSON object (``budgets set`` writes neither: left alone)."""
        try:
            kind, name = parse_level(field.decode() if isinstance(field, bytes) else field)
            d = orjson.loads(value)
        except (ValueError, orjson.JSONDecodeError):
            return None
        if not isinstance(d, dict):
            return None
        return Level(kind, name, _micro(d.get("usd_day")), _micro(d.get("usd_month")))

    async def list(self) -> dict[str, dict[str, str | None]]:
        """Stored budgets: level id → ``{"usd_day", "usd_month"}`` (decimal strings or None)."""
        raw = await self.breaker.call(lambda: self.redis.hgetall(self.keys.budget_defs))
        out: dict[str, dict[str, str | None]] = {}
        for field, value in sorted(raw.items()):
            name = field.decode() if isinstance(field, bytes) else field
            out[name] = orjson.loads(value)
        return out
