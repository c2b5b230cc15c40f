"""The response caches (``cache:``): exact (``gateway/state/cache.py``) and semantic (``gateway/semantic/``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.base import _Strict


class SemanticCacheConfig(_Strict):
    """The semantic cache (``gateway/semantic/cache.py``): a request the exact cache would look up may
    also be answered by a stored answer to a *similar* last user turn, same tenant and same everything else.
    ``threshold``: minimum similarity in [0, 1] (MinHash Jaccard for ``lexical``, cosine for ``openai:<tier>``,
    which calls that tier's ``/v1/embeddings``). At most ``max_entries_per_tenant`` entries per tenant scope
    (the soonest to expire are evicted first); last user turns longer than ``max_chars`` characters are not
    cached semantically (a one-word edit in a long text barely moves the similarity)."""

    enabled: bool = False
    threshold: float = Field(0.8, ge=0, le=1)
    embedder: str = Field("lexical", pattern=r"^(lexical|openai:[A-Za-z0-9_.-]+)$")
    max_entries_per_tenant: int = Field(10_000, ge=1)
    max_chars: int = Field(2000, ge=1)
    max_candidates: int = Field(16, ge=1, le=256)
    embed_timeout_s: float = Field(2.0, gt=0)


class CacheConfig(_Strict):
    """The exact response cache. ``mode``: ``deterministic`` caches only temperature-0 or seeded requests,
    ``always`` every request, ``off`` none. ``ttl_s`` is the default entry lifetime; a request may ask for
    another with the ``x-thinkgate-cache-ttl`` header, clamped to ``max_ttl_s``. Entries larger than
    ``max_entry_bytes`` (stored bytes) are not stored. Concurrent identical misses wait up to
    ``single_flight_wait_s`` seconds for the first one (0 disables single-flight). ``semantic``: the similar-question
    cache on top (:class:`SemanticCacheConfig`, off by default)."""

    mode: Literal["deterministic", "always", "off"] = "deterministic"
    ttl_s: int = Field(3600, ge=1)
    max_ttl_s: int = Field(7 * 86400, ge=1)
    max_entry_bytes: int = Field(1_000_000, ge=1)
    single_flight_wait_s: float = Field(30.0, ge=0)
    replay_chunk_chars: int = Field(16, ge=1)
    semantic: SemanticCacheConfig = Field(default_factory=SemanticCacheConfig)

