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
with keys of other tenants or of levels above the key: admission (``limits.py`` ``ADMIT``: the key's spend,
reservations and RPM/TPM windows with its tags' and the global level's) and metering (``metering.py``
``RECORD``: the key's and tier's counters, the global and tag levels, the stream and the seen-set in one
atomic step). One slot is what keeps those scripts atomic on a cluster today; the budgets hash is shared
for the same reason. The per-key admission keys
(``usage:key:{id}:d|m``, ``lim:{id}:*``) move under the tenant tag once admission and metering are split
per level group (each level's keys in its own slot).

Keys marked *K* are the **key store's** (``gateway/auth/redis_store.py``): on a sharded prefix a key's record
is in its tenant's slot and the lookup copy in a slot of the secret's digest (:func:`secret_tag`), while the id
set stays shared; the store then writes them in ordered single-slot steps (its module doc says why a crash
between steps is harmless). On one server or Sentinel they are ``p keys:rec:{id}`` / ``p keys:h:{sha256}``,
written together by one script as always.

=====================================  ==========  ====================================================
key                                     type        contents
=====================================  ==========  ====================================================
``t cache:{sha256}``  T                 string      cached response entry (JSON, see ``gateway/state/cache.py``)
``t cache:lock:{sha256}``  T            string      single-flight lock (token), PX = wait bound
``p usage:events``                      stream      usage events, field ``e`` = event JSON (append-only)
``p usage:seen:{YYYY-MM-DD}``           set         event_ids already counted (idempotency), TTL
``p usage:replica:probe``               string      written before each WAIT of ``metering.replica_acks``, PX 60 s
``p usage:key:{id}``                    hash        all-time counters of a key
``p usage:key:{id}:d:{YYYY-MM-DD}``     hash        a key's counters for one UTC day (budgets read these; the key
                                                    ``_shadow``'s is the day's shadow spend, shadow.py)
``p usage:key:{id}:m:{YYYY-MM}``        hash        a key's counters for one UTC month
``p usage:tier:{tier}``                 hash        all-time counters of a tier
``p usage:tier:{tier}:d:{YYYY-MM-DD}``  hash        a tier's counters for one UTC day
``p usage:keys``                        set         key ids that have counters
``p usage:agg:key:{id}:d:{YYYY-MM-DD}`` hash        a key's usage cube for one UTC day: "<counter> <cell>" → sum,
                                                    cell = JSON [tier, model, {tags}] (ledger/aggregate.py), TTL
``p usage:agg:d:{YYYY-MM-DD}:keys``     set         key ids with a cube that day, TTL
``p usage:agg:index``                   hash        ``n:{day}`` events aggregated that day; ``ok:{day}`` "1" once
                                                    the day was found complete (every counted event aggregated)
``p usage:tag:{k=v}:d:{YYYY-MM-DD}``    hash        a tag's spend for one UTC day (``cost_micro_usd``, ``requests``)
``p usage:tag:{k=v}:m:{YYYY-MM}``       hash        a tag's spend for one UTC month
``p usage:global:d:{YYYY-MM-DD}``       hash        the whole gateway's spend for one UTC day
``p usage:global:m:{YYYY-MM}``          hash        the whole gateway's spend for one UTC month
``p lim:{id}:resv``                     hash        a key's open reservations: id → "micro|tokens|exp_ms"
``p budget:tag:{k=v}:resv``             hash        a tag's open reservations (same format, reservations.py)
``p budget:global:resv``                hash        the global level's open reservations
``p budgets:defs``                      hash        budgets set by the CLI: level id → JSON {usd_day, usd_month}
``p budget:tag:{k=v}:def``              hash        a tag's budgets as admission reads them: day, month (micro-USD,
                                                    -1 = none); written with ``budgets:defs`` (budgets.py)
``p budget:global:def``                 hash        the global level's budgets (same fields)
``p lim:{id}:rpm:{window}``             string      requests admitted in a 60 s window
``p lim:{id}:tpm:{window}``             string      tokens (reserved, then settled) in a 60 s window
``p alert:{level}:{period}:{fraction}`` string      set once when an alert fired (SET NX); level = key id,
                                                    ``tag:k=v`` or ``global``
``t keys:rec:{id}``  K                  string      API key record JSON (hash of the secret only); ``t`` of the
                                                    key's own tenant tag (:func:`key_tenant`)
``t keys:h:{sha256}``  K                string      lookup copy of the record by secret hash (deleted on revoke);
                                                    ``t`` of :func:`secret_tag` (the digest's own slot)
``p keys:ids``                          set         all key ids in the store (shared: create claims an id here)
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
``p wal:open``                          hash        write-ahead records of upstream calls in flight: request id →
                                                    record JSON (state/write_ahead.py); deleted by the usage event
``p wal:hb:{owner}``                    string      heartbeat of a live gateway process (owner id), PX TTL
=====================================  ==========  ====================================================
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def tenant_tag(scope: str) -> str:
    """A short stable tag of a tenant scope (``key:<id>`` / ``ns:<name>``) for key names and Cluster hash tags:
    16 hex chars of its SHA-256 (never contains ``{`` or ``}``, whatever the key id)."""
    return hashlib.sha256(scope.encode()).hexdigest()[:16]


def key_tenant(key_id: str) -> str:
    """The tenant tag of an API key's own data (its scope ``key:<id>``; see ``cache_policy.tenant_scope``)."""
    return tenant_tag(f"key:{key_id}")


def secret_tag(sha256: str) -> str:
    """The tag of the slot of an API key's lookup copy (``keys:h:{sha256}``), from the secret's digest alone."""
    return tenant_tag(f"secret:{sha256}")


@dataclass(frozen=True)
class RedisKeys:
    """Key builder bound to a prefix. A prefix that is one whole hash tag (``{tg:}``: what ``cluster_prefix``
    makes on a Cluster) turns on per-tenant hash tags for the tenant keys (see the module doc)."""

    prefix: str

    @property
    def sharded(self) -> bool:
        """True when tenant keys get their own hash tag (a Cluster prefix ``{…}``)."""
        p = self.prefix
        return len(p) > 2 and p[0] == "{" and p[-1] == "}" and "{" not in p[1:-1] and "}" not in p[1:-1]

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

    def seen(self, day: str) -> str:
        return f"{self.prefix}usage:seen:{day}"

    def key_total(self, key_id: str) -> str:
        return f"{self.prefix}usage:key:{key_id}"

    def key_day(self, key_id: str, day: str) -> str:
        return f"{self.prefix}usage:key:{key_id}:d:{day}"

    def key_month(self, key_id: str, month: str) -> str:
        return f"{self.prefix}usage:key:{key_id}:m:{month}"

    def tier_total(self, tier: str) -> str:
        return f"{self.prefix}usage:tier:{tier}"

    def tier_day(self, tier: str, day: str) -> str:
        return f"{self.prefix}usage:tier:{tier}:d:{day}"

    @property
    def usage_keys(self) -> str:
        return f"{self.prefix}usage:keys"

    def agg_cube(self, key_id: str, day: str) -> str:
        """A key's usage cube for one UTC day (``gateway/ledger/aggregate.py``): ``"<counter> <cell>"`` → sum."""
        return f"{self.prefix}usage:agg:key:{key_id}:d:{day}"

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
        return f"{self.prefix}lim:{key_id}:resv"

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
        return f"{self.prefix}lim:{key_id}:rpm:{window}"

    def tpm(self, key_id: str, window: int) -> str:
        return f"{self.prefix}lim:{key_id}:tpm:{window}"

    @property
    def alerts_log(self) -> str:
        """List of the latest fired alerts (JSON, newest first; capped)."""
        return f"{self.prefix}alerts:log"

    def alert(self, key_id: str, period: str, fraction: str) -> str:
        return f"{self.prefix}alert:{key_id}:{period}:{fraction}"

    def key_record(self, key_id: str) -> str:
        """An API key's record: in the key's tenant slot (:func:`key_tenant`) on a sharded prefix."""
        return f"{self.tenant(key_tenant(key_id))}keys:rec:{key_id}"

    def key_by_hash(self, sha256: str) -> str:
        """The lookup copy of a key's record by the SHA-256 hex of its secret: on a sharded prefix in a slot of
        the secret's own (:func:`secret_tag`), so a lookup needs the digest only."""
        return f"{self.tenant(secret_tag(sha256))}keys:h:{sha256}"

    @property
    def key_ids(self) -> str:
        """The set of every key id (the shared slot: ``keys create`` claims an id here)."""
        return f"{self.prefix}keys:ids"

    def semantic_entries(self, tenant: str) -> str:
        return f"{self.tenant(tenant)}sem:{tenant}:e"

    def semantic_expiry(self, tenant: str) -> str:
        return f"{self.tenant(tenant)}sem:{tenant}:x"

    def semantic_band_base(self, tenant: str) -> str:
        """Prefix of a tenant's band bucket keys; a bucket key is this + ``{bucket}:{band}:{hash}``."""
        return f"{self.tenant(tenant)}sem:{tenant}:b:"

    @property
    def write_ahead(self) -> str:
        """Hash of the write-ahead records of upstream calls in flight (request id → record JSON)."""
        return f"{self.prefix}wal:open"

    def heartbeat(self, owner: str) -> str:
        """A live gateway process's heartbeat (its owner id; a string with a TTL)."""
        return f"{self.prefix}wal:hb:{owner}"
