"""Stored Responses conversations, so ``previous_response_id`` can continue one: Redis strings with a TTL.

A finished ``/v1/responses`` answer with ``store`` not false is written as
``p resp:{scope}:{response_id}`` → JSON ``{"messages": [chat messages], "tier", "session", "response"}``: the
whole conversation up to and including the answer, in chat form (``instructions`` excluded: the Responses API
does not carry them over to the next turn), and the ``response`` object as the client got it (what
``GET /v1/responses/{id}`` returns), for ``responses.store_ttl_s`` seconds; ``DELETE`` removes the entry.
``scope`` is the key's tenant scope (``key:<id>``), so one key can never continue another key's conversation.

Redis down: a write is skipped (logged; the answer is not lost, only its continuation), a read of a
``previous_response_id`` raises :class:`ConversationsUnavailable` (503) — answering without the history would
silently answer a different question.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from gateway.errors import ConversationsUnavailable
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys
from gateway.state.redis import RedisHandle

log = logging.getLogger("thinkgate.conversations")


class ConversationStore:
    """``get``/``put`` of stored conversations; ``ttl_s``: lifetime of an entry (seconds)."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, ttl_s: int) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.ttl_s = ttl_s

    def key(self, scope: str, response_id: str) -> str:
        return self.keys.conversation(scope, response_id)

    async def get(self, scope: str, response_id: str) -> dict[str, Any] | None:
        """The stored conversation ``{"messages", "tier", "session"}`` or None when unknown/expired; raises
        ConversationsUnavailable when Redis is down."""
        try:
            raw = await self.breaker.call(lambda: self.redis.get(self.key(scope, response_id)))
        except RedisDown as exc:
            raise ConversationsUnavailable(f"the conversation store is unreachable: {exc}") from None
        if raw is None:
            return None
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("messages"), list) else None

    async def put(self, scope: str, response_id: str, messages: list[dict[str, Any]], tier: str | None,
                  session: str | None = None, response: dict[str, Any] | None = None) -> bool:
        """Store a conversation (``session``: its sticky-routing session digest; ``response``: the answer's
        ``response`` object); False when Redis is down."""
        data = orjson.dumps({"messages": messages, "tier": tier, "session": session, "response": response})
        try:
            await self.breaker.call(lambda: self.redis.set(self.key(scope, response_id), data, ex=self.ttl_s))
        except RedisDown as exc:
            log.warning("conversation %s not stored (redis down: %s)", response_id, exc)
            return False
        return True

    async def delete(self, scope: str, response_id: str) -> bool:
        """Remove a stored conversation; False when there was none (unknown, expired or another scope's).
        Raises ConversationsUnavailable when Redis is down."""
        try:
            n = await self.breaker.call(lambda: self.redis.delete(self.key(scope, response_id)))
        except RedisDown as exc:
            raise ConversationsUnavailable(f"the conversation store is unreachable: {exc}") from None
        return bool(n)
