"""What to cache and under which key: pure functions, no I/O.

**Key.** SHA-256 (hex) of the canonical JSON of ``{"v", "scope", "endpoint", "tier", "body"}`` where
``body`` is the *post-routing upstream request* — upstream model, thinking budget, capped ``max_tokens``,
sampling parameters, ``n``, every pass-through extra such as ``chat_template_kwargs`` — minus ``stream`` and
``stream_options``, which only change the framing (so a streamed and a non-streamed request share an entry).
Canonical JSON: sorted keys, no whitespace, UTF-8, floats with an integral value written as integers
(``0.0`` and ``0`` are the same temperature). ``scope`` is the tenant: ``key:<id>``, or ``ns:<name>`` when
the config gives keys a shared ``cache_namespace`` on purpose. Two tenants never share an entry otherwise
(LiteLLM keys its cache on the request alone — BerriAI/litellm#29955).

**Policy.** ``cache.mode``: ``deterministic`` (default) caches only requests with ``temperature == 0`` or a
``seed``; ``always`` every request; ``off`` none. Per request (headers):

- ``Cache-Control: no-store`` → neither look up nor store (``x-thinkgate-cache: bypass``)
- ``Cache-Control: no-cache`` → skip the lookup, store the fresh answer (``miss``)
- ``Cache-Control: max-age=N`` → accept an entry at most ``N`` seconds old
- ``x-thinkgate-cache-ttl: N`` → keep the stored entry ``N`` seconds (clamped to ``[1, cache.max_ttl_s]``)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.config import CacheConfig

KEY_VERSION = 1
FRAMING_FIELDS = frozenset({"stream", "stream_options"})
TTL_HEADER = "x-thinkgate-cache-ttl"


def tenant_scope(key_id: str, cache_namespace: str | None = None) -> str:
    """The cache scope of a key: its own id, or the namespace its config shares explicitly."""
    return f"ns:{cache_namespace}" if cache_namespace else f"key:{key_id}"


def _normalise(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalise(v) for v in value]
    return value


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes of ``obj`` (sorted keys, compact, integral floats as ints)."""
    return orjson.dumps(_normalise(obj), option=orjson.OPT_SORT_KEYS)


def cache_key(scope: str, endpoint: str, tier: str, upstream_body: Mapping[str, Any]) -> str:
    """Hex SHA-256 identifying the answer to ``upstream_body`` sent to ``tier`` for tenant ``scope``."""
    body = {k: v for k, v in upstream_body.items() if k not in FRAMING_FIELDS}
    doc = {"v": KEY_VERSION, "scope": scope, "endpoint": endpoint, "tier": tier, "body": body}
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def is_deterministic(upstream_body: Mapping[str, Any]) -> bool:
    """True for ``temperature == 0`` or a non-null ``seed`` (the default cacheable requests)."""
    temperature = upstream_body.get("temperature")
    return (isinstance(temperature, int | float) and temperature == 0) or upstream_body.get("seed") is not None


@dataclass(frozen=True, slots=True)
class CacheDecision:
    """``lookup``/``store``: what to do; ``ttl_s``: lifetime of a stored entry; ``max_age_s``: oldest entry
    accepted (None = any); ``header``: ``x-thinkgate-cache`` value unless a hit happens (miss or bypass)."""

    lookup: bool
    store: bool
    ttl_s: int
    max_age_s: int | None = None

    @property
    def header(self) -> str:
        return "miss" if self.lookup or self.store else "bypass"


def _cache_control(headers: Mapping[str, str]) -> tuple[set[str], int | None]:
    directives: set[str] = set()
    max_age: int | None = None
    for part in (headers.get("cache-control") or "").lower().split(","):
        name, _, value = part.strip().partition("=")
        if name == "max-age":
            try:
                max_age = max(0, int(value.strip().strip('"')))
            except ValueError:
                continue
        elif name:
            directives.add(name)
    return directives, max_age


def decide(cfg: CacheConfig, upstream_body: Mapping[str, Any], headers: Mapping[str, str]) -> CacheDecision:
    """The cache decision for one request. ``headers``: request headers, names lower-case (Starlette's are).

    An unparsable ``x-thinkgate-cache-ttl`` is ignored (the default TTL applies).
    """
    ttl = cfg.ttl_s
    raw_ttl = headers.get(TTL_HEADER)
    if raw_ttl:
        try:
            ttl = int(float(raw_ttl))
        except ValueError:
            ttl = cfg.ttl_s
    ttl = max(1, min(ttl, cfg.max_ttl_s))
    if cfg.mode == "off" or (cfg.mode == "deterministic" and not is_deterministic(upstream_body)):
        return CacheDecision(False, False, ttl)
    directives, max_age = _cache_control(headers)
    if "no-store" in directives:
        return CacheDecision(False, False, ttl)
    if "no-cache" in directives:
        return CacheDecision(False, True, ttl)
    return CacheDecision(True, True, ttl, max_age)
