"""The semantic cache: answer a question similar to one already answered, for the same tenant and context.

Use per request, next to the exact cache (``gateway/cache.py``), for requests whose exact decision allows a
lookup (and a store)::

    probe = await semantic.prepare(scope, endpoint, tier, upstream_body)   # None: not a text question,
    if probe and decision.lookup:                                          # embedder down, or disabled
        found = await semantic.lookup(probe, decision.max_age_s)           # hit | guard_rejected |
        if found.outcome == "hit": serve found.entry                       # below_threshold | miss | bypass
    ... after an exact-cache store of the answer under ``digest``:
        await semantic.store(probe, digest, request_id, decision.ttl_s)

A **hit** needs, in this order: the same tenant scope and context (the index is partitioned by both,
``gateway/semantic/policy.py``), a similarity ≥ ``cache.semantic.threshold`` between the last user
turns, the guard (``gateway/semantic/guard.py``: numbers and operators in order, units, relation
words and what stands on each side of them, ordinals, quoted strings, names and their order, negation,
comparison words, language; with the ``lexical`` embedder also the content words), the stored answer still
in the exact cache and within ``max-age``, and a ``max_tokens`` it fits
(:func:`~gateway.semantic.policy.servable`). Candidates are tried best-first. The outcome says why a
lookup did not hit: ``guard_rejected`` (a candidate was similar enough but the guard refused it),
``below_threshold`` (candidates, none similar enough), ``miss`` (no candidate at all).

The index buckets are partitioned by the question's numbers in order as well (:attr:`Probe.bucket`), so a
question with other numbers, or its numbers in another order, is not even a candidate (outcome ``miss``); the
guard still checks them. ``guard_rejected`` therefore counts the other refusals: names, quoted strings,
negation, operators, relations, units, ordinals, comparatives, role order, words, language.

Costs: a lookup is one Redis round trip (``gateway/semantic/index.py``), a hit one more (the answer's
``GET``); a store one. Redis unreachable or the embedder failing → ``bypass``, never an error.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import SemanticCacheConfig
from gateway.semantic.embed import Embedder, EmbedError, Sketch
from gateway.semantic.guard import Features, features, mismatch
from gateway.semantic.index import SemanticIndex
from gateway.semantic.policy import Question, question, servable, tenant_tag
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.cache import CacheEntry
from gateway.state.keys import RedisKeys
from gateway.state.redis import RedisHandle

log = logging.getLogger("thinkgate.semantic_cache")

Outcome = Literal["hit", "guard_rejected", "below_threshold", "miss", "bypass"]
OUTCOMES: tuple[str, ...] = ("hit", "guard_rejected", "below_threshold", "miss", "bypass")
MAX_FETCHES = 3  # answers fetched at most per lookup (candidates that passed similarity and guard)


@dataclass(frozen=True, slots=True)
class Probe:
    """A request prepared for the semantic cache: tenant tag, question/context, sketch, guard features."""

    tenant: str
    question: Question
    sketch: Sketch
    features: Features

    @property
    def bucket(self) -> str:
        """Where its LSH bands live: the context, and the question's numbers *in order* — two questions with
        other numbers, or the same numbers in another order (``3 from 10`` / ``10 from 3``), never share an
        answer (the guard), so they need not share buckets either, and a tenant asking one template with many
        numbers does not push an entry out of its buckets. (A sorted multiset here would put swapped operands
        in one bucket and leave them to the guard alone.)"""
        ordered = self.features.ordered_numbers
        numbers = hashlib.blake2b("\x1f".join(ordered).encode(), digest_size=4).hexdigest()
        return f"{self.question.context[:16]}.{numbers}"


@dataclass(frozen=True, slots=True)
class SemanticResult:
    """``outcome`` (see the module doc); on a hit ``entry`` (the stored answer), ``entry_id`` (its exact
    cache digest) and ``matched_request_id`` (the request that produced it); ``similarity`` of the best
    candidate considered; ``guard_reason`` of the best guard-rejected one."""

    outcome: Outcome
    similarity: float | None = None
    entry: CacheEntry | None = None
    entry_id: str | None = None
    matched_request_id: str | None = None
    guard_reason: str | None = None


class SemanticCache:
    """Redis-backed semantic cache; one per process. ``embedder``: see ``gateway/semantic/embed.py``."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, cfg: SemanticCacheConfig, embedder: Embedder) -> None:
        self.cfg = cfg
        self.embedder = embedder
        self.breaker = breaker
        self.handle = handle
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.index = SemanticIndex(handle, breaker, cfg.max_entries_per_tenant, cfg.max_candidates)
        self.outcomes: Counter[str] = Counter()
        self.embed_failures = 0

    async def prepare(self, scope: str, endpoint: str, tier: str, upstream_body: Mapping[str, Any]) -> Probe | None:
        """The probe of a request, or None when it has no text question or the embedder failed (logged)."""
        q = question(scope, endpoint, tier, upstream_body, self.embedder.name, self.cfg.max_chars)
        if q is None:
            return None
        try:
            sketch = await self.embedder.sketch(q.text)
        except EmbedError as exc:
            self.embed_failures += 1
            log.warning("semantic cache bypassed: %s", exc)
            return None
        return Probe(tenant_tag(scope), q, sketch, features(q.text))

    async def lookup(self, probe: Probe, max_age_s: int | None = None) -> SemanticResult:
        """Find a stored answer for ``probe`` (see the module doc). Never raises for Redis outages."""
        result = await self._lookup(probe, max_age_s)
        self.outcomes[result.outcome] += 1
        return result

    async def _lookup(self, probe: Probe, max_age_s: int | None) -> SemanticResult:
        try:
            found = await self.index.lookup(probe.tenant, probe.question.context, probe.bucket, probe.sketch.bands)
        except RedisDown:
            return SemanticResult("bypass")
        if not found:
            return SemanticResult("miss")
        sims = probe.sketch.similarities([(str(c.meta.get("k")), c.payload) for c in found])
        scored = sorted(zip(sims, found, strict=True), key=lambda sc: sc[0], reverse=True)
        best = scored[0][0]
        threshold = self.cfg.threshold
        guard_reason: str | None = None
        fetched = 0
        for sim, cand in scored:
            if sim < threshold or fetched >= MAX_FETCHES:
                break
            g = cand.meta.get("g")
            why = mismatch(probe.features, Features.from_json(g), self.embedder.exact_words) if isinstance(g, dict) \
                else "unreadable"
            if why is not None:
                guard_reason = guard_reason or why
                continue
            fetched += 1
            try:
                entry = await self._entry(probe.tenant, cand.entry_id, max_age_s)
            except RedisDown:
                return SemanticResult("bypass", sim)
            mt = cand.meta.get("mt")
            if entry is None or not servable(entry.body, mt if isinstance(mt, int) else None,
                                             probe.question.max_tokens):
                continue
            rid = cand.meta.get("rid")
            return SemanticResult("hit", sim, entry, cand.entry_id, str(rid) if rid else None)
        if guard_reason is not None:
            return SemanticResult("guard_rejected", best, guard_reason=guard_reason)
        return SemanticResult("below_threshold", best)

    async def _entry(self, tenant: str, entry_id: str, max_age_s: int | None) -> CacheEntry | None:
        # the exact-cache entry of the same tenant (same tag: same Cluster slot as the index)
        raw = await self.breaker.call(lambda: self.redis.get(self.keys.cache_entry(entry_id, tenant)))
        if raw is None:
            return None
        entry = CacheEntry.from_bytes(raw if isinstance(raw, bytes) else raw.encode())
        if entry is None or (max_age_s is not None and time.time() - entry.created > max_age_s):
            return None
        return entry

    @staticmethod
    def meta(probe: Probe, request_id: str) -> dict[str, Any]:
        """The record JSON of an entry for ``probe`` made by request ``request_id``."""
        return {"k": probe.sketch.kind, "g": probe.features.to_json(), "rid": request_id,
                "mt": probe.question.max_tokens, "t": round(time.time(), 3)}

    async def store(self, probe: Probe, entry_id: str, request_id: str, ttl_s: int) -> bool:
        """Index the answer stored in the exact cache under ``entry_id`` (its digest) for ``ttl_s`` seconds.
        True when stored; False when Redis is unreachable (never raises for outages)."""
        meta = self.meta(probe, request_id)
        try:
            await self.index.insert(probe.tenant, probe.question.context, probe.bucket, entry_id, probe.sketch.bands,
                                    meta, probe.sketch.payload, ttl_s)
        except RedisDown:
            return False
        return True
