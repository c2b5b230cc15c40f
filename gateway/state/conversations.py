"""Stored Responses conversations, so ``previous_response_id`` can continue one: Redis strings with a TTL.

A finished ``/v1/responses`` answer with ``store`` not false is written as
``p resp:{scope}:{response_id}`` → JSON ``{"messages": [chat messages], "tier", "session", "response"}``: the
whole conversation up to and including the answer, in chat form (``instructions`` excluded: the Responses API
does not carry them over to the next turn), and the ``response`` object as the client got it (what
``GET /v1/responses/{id}`` returns), for ``responses.store_ttl_s`` seconds; ``DELETE`` removes the entry.
``scope`` is the key's tenant scope (``key:<id>``), so one key can never continue another key's conversation.

Redis down: a write is skipped (logged at WARNING at most once a minute, with the count held back since; the answer is
not lost, only its continuation), a read of a
``previous_response_id`` raises :class:`ConversationsUnavailable` (503) — answering without the history would
silently answer a different question.

Redis refusing the write with an error reply (``OOM command not allowed``, ``READONLY``, ``NOPERM``: the breaker
counts none of them as an outage) is skipped the same way: the write comes after the answer was generated and
metered, so raising lost a billed answer (a 500, or a stream cut before ``response.completed``). It is logged at
ERROR (at most once a minute per distinct error) and counted; its ``previous_response_id`` is then unknown, as an
expired one. Every skipped write is counted in :attr:`ConversationStore.not_stored` by :data:`NOT_STORED_REASONS`
(``thinkgate_conversations_not_stored_total{reason}``).
"""

from __future__ import annotations

import logging
from typing import Any, Final

import orjson
from redis.exceptions import RedisError

from gateway.errors import ConversationsUnavailable
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys
from gateway.state.log_throttle import LogThrottle, held_back
from gateway.state.redis import RedisHandle

log = logging.getLogger("thinkgate.conversations")

#: the ``reason`` label of ``thinkgate_conversations_not_stored_total``: ``redis_down`` (unreachable, or the breaker
#: open), ``refused`` (Redis answered the write with an error reply)
NOT_STORED_REASONS: Final = ("redis_down", "refused")


class ConversationStore:
    """``get``/``put`` of stored conversations; ``ttl_s``: lifetime of an entry (seconds)."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, ttl_s: int) -> None:
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.ttl_s = ttl_s
        #: writes skipped, by :data:`NOT_STORED_REASONS` (process counts; ``/metrics`` catches up from them)
        self.not_stored: dict[str, int] = dict.fromkeys(NOT_STORED_REASONS, 0)
        # one line a minute per distinct error: a Redis down, full or read-only fails every answer's write alike
        self._log = LogThrottle()

    def key(self, scope: str, response_id: str) -> str:
        return self.keys.conversation(scope, response_id)

    async def get(self, scope: str, response_id: str) -> dict[str, Any] | None:
        """The stored conversation ``{"messages", "tier", "session"}`` or None when unknown/expired; raises
        ConversationsUnavailable when Redis is down."""
        try:
            raw = await self.breaker.call(lambda: self.redis.get(self.key(scope, response_id)))
        except RedisDown as exc:
            raise ConversationsUnavailable(f"the conversation store is unreachable: {exc}",
                                           headers=self.breaker.retry_after()) from None
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
        ``response`` object); False when it was not stored (Redis down, or it refused the write). Never raises a
        Redis error: the answer it follows was already generated and billed."""
        data = orjson.dumps({"messages": messages, "tier": tier, "session": session, "response": response})
        try:
            await self.breaker.call(lambda: self.redis.set(self.key(scope, response_id), data, ex=self.ttl_s))
        except RedisDown as exc:
            self.not_stored["redis_down"] += 1
            if (held := self._log.due("redis_down")) is not None:
                log.warning("conversation %s not stored (redis down: %s)%s — counted in "
                            "thinkgate_conversations_not_stored_total{reason=\"redis_down\"}", response_id, exc,
                            held_back(held))
            return False
        except RedisError as exc:  # an error reply (the breaker let it through): Redis is up and said no
            self.not_stored["refused"] += 1
            self._log_refused(response_id, exc)
            return False
        return True

    def _log_refused(self, response_id: str, exc: RedisError) -> None:
        """One ERROR line for a write Redis refused, at most once a minute per distinct error, with the count of
        those not logged since (the same refusal recurs on every answer until it is fixed)."""
        error = f"{type(exc).__name__}: {exc}"
        if (held := self._log.due(error)) is None:
            return
        log.error("conversation %s not stored: Redis refused the write (the answer was delivered; continuing "
                  "it answers previous_response_not_found, as an expired one)%s — counted in "
                  "thinkgate_conversations_not_stored_total{reason=\"refused\"}: %s", response_id, held_back(held),
                  error)

    async def delete(self, scope: str, response_id: str) -> bool:
        """Remove a stored conversation; False when there was none (unknown, expired or another scope's).
        Raises ConversationsUnavailable when Redis is down."""
        try:
            n = await self.breaker.call(lambda: self.redis.delete(self.key(scope, response_id)))
        except RedisDown as exc:
            raise ConversationsUnavailable(f"the conversation store is unreachable: {exc}",
                                           headers=self.breaker.retry_after()) from None
        return bool(n)
