"""Every Redis key ThinkGate writes, in one place (``p`` = the configured prefix, e.g. ``tg:``).

**Redis Cluster: which keys are sharded by tenant.** On a cluster the prefix is one hash tag (``tg:`` →
``{tg:}``, ``gateway/state/redis.py`` ``cluster_prefix``). Keys marked *T* below are **tenant keys**: they
start with ``t`` = :meth:`RedisKeys.tenant` of the tenant's tag ``g`` (16 hex of the SHA-256 of the tenant
scope, :func:`tenant_tag`: ``key:<api key id>``, or ``ns:<name>`` for keys sharing a ``cache_namespace``),
i.e. ``{tg:<g>}`` — one slot per tenant, so one tenant's cache, conversations, sessions, request index and
semantic index co-locate and tenants spread over the masters. They are touched only by single-key commands
or by scripts whose keys all belong to that tenant (the cache's BEGIN/FINISH, the semantic index's). On one
server or Sentinel ``t`` is the plain prefix: key names there are exactly what they always were.

Every other key is **shared** and stays in the one ``{tg:}`` slot, because a script touches it together
with keys of other tenants or of levels above the key: the tier, tag and global levels, the stream and the
seen-set, the write-ahead records, the budgets hash.

**Where an API key's own data lives: ``redis.cluster_placement``.** Keys marked *L* (the key's counters and
usage cubes, its reservations and RPM/TPM windows) and *K* (the key store's record and lookup copy) start with
``l``:

- ``shared`` (the default, and the layout of every earlier version): ``l`` = ``p``, the shared slot. Admission
  (``limits.py`` ``ADMIT``) and metering (``metering.py`` ``RECORD``) are then one atomic script each, over the
  key's level and the levels above it; the key store writes its record, lookup copy and id set in one script. All
  admission and metering load, and every key's data, is on the shared slot's master (a fleet of keys with little
  cached traffic: 72% of the keys on one of three masters, ``docs/metering.md``).
- ``tenant`` (:attr:`RedisKeys.per_key_slots`): ``l`` = the key's tenant prefix ``{tg:<key_tenant(id)>}``, except the
  lookup copy, in a slot of the secret's digest (:func:`secret_tag`: a lookup knows only the digest). Admission then
  runs one script per level (``limits.py`` grouped), metering three calls per event — shared part, key part, finish
  (``metering.py`` ``RECORD_SHARED_LUA``) — and the key store ordered single-slot steps (``gateway/auth/redis_store.py``
  says why a crash between steps is harmless). The key ids' set stays shared. An existing deployment's data moves
  from one placement to the other with ``thinkgate redis migrate-placement`` (:data:`PER_KEY_NAMES`,
  ``gateway/state/placement_migration.py``).

On one server or Sentinel ``t`` and ``l`` are the plain prefix whatever the setting: key names there are exactly what
they always were.

=====================================  ==========  ====================================================
key                                     type        contents
=====================================  ==========  ====================================================
``t cache:{sha256}``  T                 string      cached response entry (JSON, see ``gateway/state/cache.py``)
``t cache:lock:{sha256}``  T            string      single-flight lock (token), PX = wait bound
``p usage:events``                      stream      usage events, field ``e`` = event JSON (append-only)
``p usage:seen:{YYYY-MM-DD}``           set         event_ids already counted (idempotency), TTL
``p usage:replica:probe``               string      written before each WAIT of ``metering.replica_acks``, PX 60 s
``l usage:key:{id}``  L                 hash        all-time counters of a key
``l usage:key:{id}:d:{YYYY-MM-DD}`` L   hash        a key's counters for one UTC day (budgets read these; the key
                                                    ``_shadow``'s is the day's shadow spend, shadow.py)
``l usage:key:{id}:m:{YYYY-MM}``  L     hash        a key's counters for one UTC month
``p usage:tier:{tier}``                 hash        all-time counters of a tier
``p usage:tier:{tier}:d:{YYYY-MM-DD}``  hash        a tier's counters for one UTC day
``p usage:keys``                        set         key ids that have counters
``l usage:agg:key:{id}:d:{day}``  L     hash        a key's usage cube for one UTC day: "<counter> <cell>" → sum,
                                                    cell = JSON [tier, model, {tags}] (ledger/aggregate.py), TTL
``l usage:seen:{YYYY-MM-DD}``  L        set         (``tenant`` only) event ids counted in the key's own keys that
                                                    day: the key part's idempotency (metering.py), TTL
``p usage:pending``                     hash        (``tenant`` only) event id → its key part's call (JSON), from the
                                                    shared part until the finish (metering.py)
``p usage:agg:d:{YYYY-MM-DD}:keys``     set         key ids with a cube that day, TTL
``p usage:agg:index``                   hash        ``n:{day}`` events aggregated that day; ``ok:{day}`` "1" once
                                                    the day was found complete (every counted event aggregated)
``p usage:tag:{k=v}:d:{YYYY-MM-DD}``    hash        a tag's spend for one UTC day (``cost_micro_usd``, ``requests``)
``p usage:tag:{k=v}:m:{YYYY-MM}``       hash        a tag's spend for one UTC month
``p usage:global:d:{YYYY-MM-DD}``       hash        the whole gateway's spend for one UTC day
``p usage:global:m:{YYYY-MM}``          hash        the whole gateway's spend for one UTC month
``l lim:{id}:resv``  L                  hash        a key's open reservations: id → "micro|tokens|exp_ms"
``p budget:tag:{k=v}:resv``             hash        a tag's open reservations (same format, reservations.py)
``p budget:global:resv``                hash        the global level's open reservations
``p budgets:defs``                      hash        budgets set by the CLI: level id → JSON {usd_day, usd_month}
``p budget:tag:{k=v}:def``              hash        a tag's budgets as admission reads them: day, month (micro-USD,
                                                    -1 = none); written with ``budgets:defs`` (budgets.py)
``p budget:global:def``                 hash        the global level's budgets (same fields)
``l lim:{id}:rpm:{window}``  L          string      requests admitted in a 60 s window
``l lim:{id}:tpm:{window}``  L          string      tokens (reserved, then settled) in a 60 s window
``p alert:{level}:{period}:{fraction}`` string      set once when an alert fired (SET NX); level = key id,
                                                    ``tag:k=v`` or ``global``
``l keys:rec:{id}``  K                  string      API key record JSON (hash of the secret only)
``l keys:h:{sha256}``  K                string      lookup copy of the record by secret hash (deleted on revoke);
                                                    under ``tenant`` in the slot of :func:`secret_tag`
``p keys:ids``                          set         all key ids in the store (shared: create claims an id here)
``p keys:pending``                      hash        (``tenant`` only) key id → JSON {sha256, started_ms}: a create
                                                    between its claim and its commit (auth/redis_store.py)
``t resp:{scope}:{response_id}``  T     string      stored /v1/responses conversation (JSON), TTL (conversations.py)
``t sess:{digest}``  T                  string      sticky-routing session → tier name, TTL (pipeline/sessions.py)
``p rt:win``                            list        cost-target controller window: "score,tier index,t_ms", newest
                                                    last, at most routing.target.window (control/target.py)
``p rt:state``                          hash        controller state: thr, share, n; cost:{i}, cnt:{i} per tier
``p outcomes``                          stream      routing outcomes, field ``o`` = outcome JSON (control/outcomes.py)
``p outcomes:seen:{YYYY-MM-DD}``        set         outcome ids already written (a replay writes nothing), TTL
``p outcomes:grades:{YYYY-MM-DD}``      hash        feedback outcome id → grade "1"/"0" (told to a duplicate), TTL
``t req:{request_id}``  T               string      request index for feedback (key id, tier, score, digest), TTL
``p drift:win``                         list        drift alarm window: "score,tier index", newest last (drift.py)
``p drift:state``                       string      last drift statistics (JSON: psi_score, psi_tier, n, ts, ...)
``p drift:ref:{version}``               string      served reference histogram of a router version without one
``t sem:{g}:e``  T                      hash        semantic cache entries of tenant tag ``g``: entry id → record,
                                                    ``b:{id}`` → its bucket and band hashes (semantic_index.py)
``t sem:{g}:x``  T                      zset        semantic cache entry id → expiry (epoch ms): TTL and the cap
``t sem:{g}:b:{bucket}:{band}:{hash}``  list        LSH band bucket: entry ids, newest first (at most 64)
``p placement:migration``               string      set while a placement migration runs or after one stopped midway
                                                    (JSON from, to, started): everything refuses to start
``p wal:open``                          hash        write-ahead records of upstream calls in flight: request id →
                                                    record JSON (state/write_ahead.py); deleted by the usage event
``p wal:hb:{owner}``                    string      heartbeat of a live gateway process (owner id), PX TTL
=====================================  ==========  ====================================================
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Protocol


def tenant_tag(scope: str) -> str:
    """A short stable tag of a tenant scope (``key:<id>`` / ``ns:<name>``) for key names and Cluster hash tags:
    16 hex chars of its SHA-256 (never contains ``{`` or ``}``, whatever the key id)."""
    return hashlib.sha256(scope.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=65536)
def key_tenant(key_id: str) -> str:
    """The tenant tag of an API key's own data (its scope ``key:<id>``; see ``cache_policy.tenant_scope``)."""
    return tenant_tag(f"key:{key_id}")


def secret_tag(sha256: str) -> str:
    """The tag of the slot of an API key's lookup copy (``keys:h:{sha256}``), from the secret's digest alone."""
    return tenant_tag(f"secret:{sha256}")


@dataclass(frozen=True)
class PerKeyName:
    """One kind of Redis key holding an API key's own data whose name (and so slot) depends on
    ``redis.cluster_placement``: :attr:`builder` is the :class:`RedisKeys` method that names it, called as
    ``builder(key_id)`` (:attr:`param` ``""``), ``builder(key_id, param)`` (``day`` ``YYYY-MM-DD``, ``month``
    ``YYYY-MM``, ``window`` a minute number: the parameter always ends the name) or ``builder(digest)`` (``secret``:
    the SHA-256 hex of the key's secret, from its record). ``shared_when_shared``: under ``shared`` the name is a
    key of every API key at once (``key_seen`` is then the day's shared seen-set), so it is never moved by name.
    :meth:`RedisKeys.per_key_name` builds one; ``gateway/state/placement_migration.py`` moves them."""

    builder: str
    param: str = ""
    shared_when_shared: bool = False


#: Every per-key name whose slot depends on the placement (``tests/gateway/test_placement_migration.py`` fails when a
#: :class:`RedisKeys` name that differs between the placements is missing here, so a new one cannot be left behind by
#: ``thinkgate redis migrate-placement``). The budget-level builders (``level_day``, ``level_month``,
#: ``level_reservations`` with kind ``key``) are not listed: they return these same names.
PER_KEY_NAMES: tuple[PerKeyName, ...] = (
    PerKeyName("key_record"),
    PerKeyName("key_by_hash", "secret"),
    PerKeyName("key_total"),
    PerKeyName("reservations"),
    PerKeyName("key_day", "day"),
    PerKeyName("key_month", "month"),
    PerKeyName("agg_cube", "day"),
    PerKeyName("rpm", "window"),
    PerKeyName("tpm", "window"),
    PerKeyName("key_seen", "day", shared_when_shared=True),
)


class _Handle(Protocol):
    @property
    def prefix(self) -> str: ...
    @property
    def placement(self) -> str: ...


@dataclass(frozen=True)
class RedisKeys:
    """Key builder bound to a prefix. A prefix that is one whole hash tag (``{tg:}``: what ``cluster_prefix``
    makes on a Cluster) turns on per-tenant hash tags for the tenant keys (see the module doc).

    ``placement``: where a key's own metering and admission keys live on such a prefix — ``shared`` (the one
    ``{tg:}`` slot, with the levels above the key) or ``tenant`` (the key's tenant slot, ``{tg:<key_tenant(id)>}``:
    ``redis.cluster_placement``); ignored on an unsharded prefix (one server, Sentinel)."""

    prefix: str
    placement: str = "shared"

    @classmethod
    def of(cls, handle: _Handle) -> RedisKeys:
        """The key builder of a connection (``gateway/state/redis.py`` ``RedisHandle``): its prefix and placement."""
        return cls(handle.prefix, handle.placement)

    @functools.cached_property
    def sharded(self) -> bool:
        """True when tenant keys get their own hash tag (a Cluster prefix ``{…}``)."""
        p = self.prefix
        return len(p) > 2 and p[0] == "{" and p[-1] == "}" and "{" not in p[1:-1] and "}" not in p[1:-1]

    @functools.cached_property
    def per_key_slots(self) -> bool:
        """True when a key's own metering and admission keys sit in its tenant slot, away from the shared one: the
        metering scripts then run per slot (``gateway/state/metering.py``, *Redis Cluster*) and admission per level
        (``gateway/state/limits.py`` grouped)."""
        return self.sharded and self.placement == "tenant"

    def per_key_name(self, spec: PerKeyName, key_id: str, param: str = "") -> str:
        """The name of ``spec``'s key of API key ``key_id`` under this placement (``param``: its day, month, window
        or, for ``secret``, the secret's digest; see :class:`PerKeyName`). For a ``day``/``month``/``window`` kind
        ``per_key_name(spec, id, "")`` is the name's head: every name of that kind and key is the head + the
        parameter. Raises ``AttributeError`` for a ``spec`` whose builder :class:`RedisKeys` lacks."""
        build = getattr(self, spec.builder)
        if spec.param == "secret":
            return str(build(param))
        return str(build(key_id, param) if spec.param else build(key_id))

    def _kp(self, key_id: str) -> str:
        """The prefix of key ``key_id``'s own metering and admission keys (see :attr:`per_key_slots`)."""
        return self.tenant(key_tenant(key_id)) if self.per_key_slots else self.prefix

    def tenant(self, tag: str) -> str:
        """The prefix of tenant ``tag``'s keys: ``{tg:<tag>}`` on a Cluster prefix ``{tg:}`` (the tenant's own
        slot), else the plain prefix (and for an empty ``tag``: the shared slot)."""
        if not tag or not self.sharded:
            return self.prefix
        return "{" + self.prefix[1:-1] + tag + "}"

    def conversation(self, scope: str, response_id: str) -> str:
        return f"{self.tenant(tenant_tag(scope))}resp:{scope}:{response_id}"

    def session(self, digest: str, tenant: str = "") -> str:
        """A sticky-routing session; ``tenant``: the key's tag (:func:`key_tenant`)."""
        return f"{self.tenant(tenant)}sess:{digest}"

    @property
    def outcomes(self) -> str:
        return f"{self.prefix}outcomes"

    def outcomes_seen(self, day: str) -> str:
        return f"{self.prefix}outcomes:seen:{day}"

    def outcomes_grades(self, day: str) -> str:
        """The grades (``sufficed``) of the day's graded outcomes, by outcome id: a duplicate's answer."""
        return f"{self.prefix}outcomes:grades:{day}"

    def request(self, request_id: str, tenant: str = "") -> str:
        """A request's feedback index entry; ``tenant``: the key's tag (:func:`key_tenant`)."""
        return f"{self.tenant(tenant)}req:{request_id}"

    def drift_window(self) -> str:
        return f"{self.prefix}drift:win"

    def drift_state(self) -> str:
        return f"{self.prefix}drift:state"

    def drift_seq(self, replica: str) -> str:
        """The last batch number of ``replica`` the drift window took (``gateway/control/drift.py``)."""
        return f"{self.prefix}drift:seq:{replica}"

    def drift_reference(self, version: str) -> str:
        return f"{self.prefix}drift:ref:{version}"

    def routing_window(self) -> str:
        return f"{self.prefix}rt:win"

    def routing_state(self) -> str:
        return f"{self.prefix}rt:state"

    def routing_seq(self, replica: str) -> str:
        """The last batch number of ``replica`` the cost-target controller applied (``gateway/control/target.py``)."""
        return f"{self.prefix}rt:seq:{replica}"

    def cache_entry(self, digest: str, tenant: str = "") -> str:
        """An exact-cache entry; ``tenant``: the tag of the cache scope (:func:`tenant_tag`)."""
        return f"{self.tenant(tenant)}cache:{digest}"

    def cache_lock(self, digest: str, tenant: str = "") -> str:
        return f"{self.tenant(tenant)}cache:lock:{digest}"

    @property
    def events(self) -> str:
        return f"{self.prefix}usage:events"

    @property
    def replica_probe(self) -> str:
        """Written before each ``WAIT`` of ``metering.replica_acks`` (``Meter.replica_acks``); in the shared slot."""
        return f"{self.prefix}usage:replica:probe"

    def replica_probe_at(self, tag: str) -> str:
        """:attr:`replica_probe` in tenant ``tag``'s slot: under :attr:`per_key_slots` one is written on each master
        (key parts are written on every master)."""
        return f"{self.tenant(tag)}usage:replica:probe"

    def seen(self, day: str) -> str:
        return f"{self.prefix}usage:seen:{day}"

    def key_seen(self, key_id: str, day: str) -> str:
        """The event ids counted in key ``key_id``'s own keys that day (:attr:`per_key_slots` only: the key part's
        idempotency, ``gateway/state/metering.py``)."""
        return f"{self._kp(key_id)}usage:seen:{day}"

    @property
    def pending(self) -> str:
        """Events whose shared part is counted and whose key part may not be yet (:attr:`per_key_slots` only): event
        id → the key part's call (JSON), ``gateway/state/metering.py``."""
        return f"{self.prefix}usage:pending"

    def key_total(self, key_id: str) -> str:
        return f"{self._kp(key_id)}usage:key:{key_id}"

    def key_day(self, key_id: str, day: str) -> str:
        return f"{self._kp(key_id)}usage:key:{key_id}:d:{day}"

    def key_month(self, key_id: str, month: str) -> str:
        return f"{self._kp(key_id)}usage:key:{key_id}:m:{month}"

    def tier_total(self, tier: str) -> str:
        return f"{self.prefix}usage:tier:{tier}"

    def tier_day(self, tier: str, day: str) -> str:
        return f"{self.prefix}usage:tier:{tier}:d:{day}"

    @property
    def usage_keys(self) -> str:
        return f"{self.prefix}usage:keys"

    def agg_cube(self, key_id: str, day: str) -> str:
        """A key's usage cube for one UTC day (``gateway/ledger/aggregate.py``): ``"<counter> <cell>"`` → sum."""
        return f"{self._kp(key_id)}usage:agg:key:{key_id}:d:{day}"

    def agg_day_keys(self, day: str) -> str:
        """The key ids with a cube on one UTC day."""
        return f"{self.prefix}usage:agg:d:{day}:keys"

    @property
    def late_events(self) -> str:
        """Sorted set of the stream ids of events written more than ``metering.late_after_s`` after their ``ts``
        (score: ``ts`` in ms): what a read of the stream by id range must add (``Meter.events``)."""
        return f"{self.prefix}usage:late"

    @property
    def agg_index(self) -> str:
        """Per UTC day: events aggregated (``n:{day}``) and whether it was found complete (``ok:{day}``)."""
        return f"{self.prefix}usage:agg:index"

    def reservations(self, key_id: str) -> str:
        return f"{self._kp(key_id)}lim:{key_id}:resv"

    def level_day(self, kind: str, name: str, day: str) -> str:
        """Spend counters of a budget level (``kind``: key | tag | global) for one UTC day."""
        if kind == "key":
            return self.key_day(name, day)
        return f"{self.prefix}usage:{kind}:{name}:d:{day}" if kind == "tag" else f"{self.prefix}usage:global:d:{day}"

    def level_month(self, kind: str, name: str, month: str) -> str:
        if kind == "key":
            return self.key_month(name, month)
        return (f"{self.prefix}usage:{kind}:{name}:m:{month}" if kind == "tag"
                else f"{self.prefix}usage:global:m:{month}")

    def level_reservations(self, kind: str, name: str) -> str:
        if kind == "key":
            return self.reservations(name)
        return f"{self.prefix}budget:tag:{name}:resv" if kind == "tag" else f"{self.prefix}budget:global:resv"

    def level_budget(self, kind: str, name: str) -> str:
        """The budget definition hash of a tag or the global level (admission reads it in its script)."""
        return f"{self.prefix}budget:tag:{name}:def" if kind == "tag" else f"{self.prefix}budget:global:def"

    @property
    def budget_defs(self) -> str:
        return f"{self.prefix}budgets:defs"

    def rpm(self, key_id: str, window: int) -> str:
        return f"{self._kp(key_id)}lim:{key_id}:rpm:{window}"

    def tpm(self, key_id: str, window: int) -> str:
        return f"{self._kp(key_id)}lim:{key_id}:tpm:{window}"

    @property
    def alerts_log(self) -> str:
        """List of the latest fired alerts (JSON, newest first; capped)."""
        return f"{self.prefix}alerts:log"

    def alert(self, key_id: str, period: str, fraction: str) -> str:
        return f"{self.prefix}alert:{key_id}:{period}:{fraction}"

    def key_record(self, key_id: str) -> str:
        """An API key's record: in the key's tenant slot (:func:`key_tenant`) where :attr:`per_key_slots`."""
        return f"{self._kp(key_id)}keys:rec:{key_id}"

    def key_by_hash(self, sha256: str) -> str:
        """The lookup copy of a key's record by the SHA-256 hex of its secret: where :attr:`per_key_slots` in a slot
        of the secret's own (:func:`secret_tag`), so a lookup needs the digest only."""
        return f"{self.tenant(secret_tag(sha256)) if self.per_key_slots else self.prefix}keys:h:{sha256}"

    @property
    def key_ids(self) -> str:
        """The set of every key id (the shared slot: ``keys create`` claims an id here)."""
        return f"{self.prefix}keys:ids"

    @property
    def key_pending(self) -> str:
        """The creates under way (or crashed) where :attr:`per_key_slots`: key id → its claim; in the shared slot,
        with :attr:`key_ids`, so that a claim and a commit are each one script."""
        return f"{self.prefix}keys:pending"

    def semantic_entries(self, tenant: str) -> str:
        return f"{self.tenant(tenant)}sem:{tenant}:e"

    def semantic_expiry(self, tenant: str) -> str:
        return f"{self.tenant(tenant)}sem:{tenant}:x"

    def semantic_band_base(self, tenant: str) -> str:
        """Prefix of a tenant's band bucket keys; a bucket key is this + ``{bucket}:{band}:{hash}``."""
        return f"{self.tenant(tenant)}sem:{tenant}:b:"

    @property
    def placement_migration(self) -> str:
        """Set while ``thinkgate redis migrate-placement`` moves the API keys' own data between placements (JSON:
        ``from``, ``to``, ``started``), and left by a run that stopped before its end: every gateway and CLI command
        refuses to start while it exists (``gateway/state/placement.py``, ``placement_migration.py``)."""
        return f"{self.prefix}placement:migration"

    @property
    def write_ahead(self) -> str:
        """Hash of the write-ahead records of upstream calls in flight (request id → record JSON)."""
        return f"{self.prefix}wal:open"

    def heartbeat(self, owner: str) -> str:
        """A live gateway process's heartbeat (its owner id; a string with a TTL)."""
        return f"{self.prefix}wal:hb:{owner}"
