"""Session-sticky routing: the turns of one conversation stay on the tier its first routed turn got.

An agent loop routed turn by turn flips between tiers, and every flip pays again for the upstream's prefix
cache of the whole conversation (vllm-project/semantic-router #1439, #1751). A conversation is identified
(:func:`session_of`) by the API key plus, first match wins:

1. ``metadata.session_id`` (chat and Responses);
2. ``/v1/responses`` with ``previous_response_id``: the session of the stored conversation it continues (a
   chain of responses is one session, whatever each turn's ``instructions``);
3. ``user`` (chat and Responses; Anthropic ``metadata.user_id`` is mapped to it);
4. else the SHA-256 of the first system message and the first user message — the part of a conversation that
   every later turn repeats.

Only ``predicted`` routes are sticky: a forced tier (header or model name), ``reasoning_effort`` / a thinking
budget (reason ``effort``) and the router-unavailable ``fallback`` are explicit or exceptional and are
served as decided, without touching the session. The first predicted turn pins its tier
(``p sess:{digest}`` → tier name, ``routing.session_ttl_s`` seconds, renewed by each turn; ``SET NX`` so
concurrent first turns agree); later turns take the pinned tier (response header ``x-thinkgate-session:
sticky``, else ``new``). A turn that escalated re-pins the session to the tier that answered. Redis down:
routed as if there were no session (no header). ``routing.session_ttl_s: 0`` turns sessions off.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from gateway.config import Settings, TierConfig
from gateway.observability.metrics import Metrics
from gateway.pipeline.routing import RouteDecision
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys, key_tenant
from gateway.state.redis import RedisHandle
from gateway.upstream.balancer import key_text

log = logging.getLogger("thinkgate.sessions")



def session_of(key_id: str, body: dict[str, Any]) -> str | None:
    """The session digest (hex, 32 chars) of a chat ``body`` sent with key ``key_id``; None when the body has
    no ``messages`` with a user turn and nothing names a session."""
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("session_id"), str) and meta["session_id"]:
        raw = "s:" + meta["session_id"]
    elif isinstance(body.get("user"), str) and body["user"]:
        raw = "u:" + body["user"]
    else:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        dicts = [m for m in msgs if isinstance(m, dict)]
        system = next((key_text(m.get("content")) for m in dicts if m.get("role") == "system"), "")
        user = next((key_text(m.get("content")) for m in dicts if m.get("role") == "user"), None)
        if user is None:
            return None
        raw = "h:" + system + "\x00" + user
    return hashlib.sha256(f"{key_id}\x00{raw}".encode()).hexdigest()[:32]


@dataclass(slots=True)
class Sticky:
    """A request's session: its digest, ``state`` (``new`` | ``sticky``) and the route it is served on."""

    digest: str
    state: str
    route: RouteDecision
    key_id: str = ""  # whose session: its key's tenant tag is the session key's Cluster slot


class Sessions:
    """The session store (Redis, through the shared breaker) and its Prometheus counter."""

    def __init__(self, settings: Settings, handle: RedisHandle, breaker: Breaker, metrics: Metrics) -> None:
        self.ttl_s = settings.routing.session_ttl_s
        self.tiers = {t.name: t for t in settings.tiers}
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.metrics = metrics

    def key(self, digest: str, key_id: str = "") -> str:
        """The session's Redis key, in the tenant slot of ``key_id`` (``gateway/state/keys.py``)."""
        return self.keys.session(digest, key_tenant(key_id) if key_id else "")

    async def stick(self, key_id: str, body: dict[str, Any], route: RouteDecision,
                    digest: str | None = None) -> Sticky | None:
        """The session of this request (``digest``: given by the API layer, else :func:`session_of`) and the
        route to serve it on (None: no session applies)."""
        if self.ttl_s <= 0 or route.reason != "predicted":
            return None
        digest = digest or session_of(key_id, body)
        if digest is None:
            return None
        k = self.key(digest, key_id)
        try:
            # first turn: pin the routed tier; a later turn reads the pin (and renews it)
            created = await self.breaker.call(lambda: self.redis.set(k, route.tier.name, ex=self.ttl_s, nx=True))
            pinned = None if created else await self.breaker.call(lambda: self.redis.getex(k, ex=self.ttl_s))
        except RedisDown as exc:
            log.debug("session routing skipped (redis down: %s)", exc)
            return None
        name = pinned.decode() if isinstance(pinned, bytes) else pinned
        tier: TierConfig | None = self.tiers.get(name) if name else None
        if created or tier is None:
            if not created:  # the pinned tier no longer exists (config changed) or expired in between
                await self._pin(digest, route.tier, key_id)
            self.metrics.session("new")
            return Sticky(digest, "new", route, key_id)
        self.metrics.session("sticky")
        if tier.name != route.tier.name:
            self.metrics.session("flip_avoided")
        return Sticky(digest, "sticky", RouteDecision(tier, "predicted", route.difficulty, window=route.window),
                      key_id)

    async def repin(self, sticky: Sticky, tier_name: str) -> None:
        """Move the session to ``tier_name`` (the tier an escalated turn was answered on)."""
        tier = self.tiers.get(tier_name)
        if tier is not None and tier.name != sticky.route.tier.name:
            await self._pin(sticky.digest, tier, sticky.key_id)
            self.metrics.session("repinned")

    async def _pin(self, digest: str, tier: TierConfig, key_id: str) -> None:
        try:
            await self.breaker.call(lambda: self.redis.set(self.key(digest, key_id), tier.name, ex=self.ttl_s))
        except RedisDown as exc:
            log.debug("session not pinned (redis down: %s)", exc)
