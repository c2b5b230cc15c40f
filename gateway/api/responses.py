"""``POST /v1/responses``: the OpenAI Responses API, served by translation onto the tier's chat upstream.

auth (``Authorization: Bearer``) → body → ``previous_response_id``: the stored conversation (Redis, per key,
``responses.store_ttl_s``; unknown → 400 ``previous_response_not_found``) → :func:`gateway.openai.responses.to_chat`
→ the chat pipeline (:meth:`gateway.pipeline.proxy.Proxy.serve`, usage event ``endpoint: responses``) →
the ``response`` object, or the typed event stream. With ``store`` not false the conversation including this
answer is stored under the new response id before the client sees the answer's end, with the final
``response`` object (a write Redis fails or refuses is skipped, counted and logged by
:meth:`ConversationStore.put`: the answer was already billed, the client gets it whole):
``GET /v1/responses/{id}`` returns it, ``DELETE /v1/responses/{id}`` removes it
(``{"id", "object": "response", "deleted": true}``); another key's, expired or ``store: false`` → 404.
Errors are OpenAI-shaped (the app's handlers).
"""

from __future__ import annotations

from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.api import bridge
from gateway.api.asgi import Gateway
from gateway.api.http import disconnected, json_response, read_body, tracing
from gateway.errors import InvalidRequest, NotFound, RateLimited
from gateway.ledger.record import UsageRecord
from gateway.openai import responses as wire
from gateway.pipeline import request as schemas
from gateway.pipeline.answer import Caller
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.sessions import session_of
from gateway.state.cache_policy import tenant_scope
from gateway.state.conversations import ConversationStore

LABEL: Final = "responses"


class ResponsesAPI:
    """The handler; ``store``: the conversation store (``previous_response_id``)."""

    def __init__(self, proxy: Proxy, store: ConversationStore) -> None:
        self.proxy = proxy
        self.store = store

    async def previous(self, scope: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The stored conversation ``previous_response_id`` names (None without one); raises InvalidRequest."""
        prev = body.get("previous_response_id")
        if prev is None:
            return None
        if not isinstance(prev, str) or not prev:
            raise InvalidRequest("'previous_response_id' must be a string", param="previous_response_id")
        doc = await self.store.get(scope, prev)
        if doc is None:
            raise InvalidRequest(
                f"previous response {prev!r} not found: unknown, expired, stored with store: false, or another key's",
                param="previous_response_id", code="previous_response_not_found")
        return doc

    @staticmethod
    def session(key_id: str, body: dict[str, Any], chat: dict[str, Any], prev: dict[str, Any] | None) -> str | None:
        """The conversation's session digest (sticky routing): ``metadata.session_id``, else the session of the
        conversation ``previous_response_id`` continues, else the chat body's own (``user`` or first turns)."""
        meta = body.get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("session_id"), str) and meta["session_id"]:
            return session_of(key_id, {"metadata": meta})
        if prev is not None and isinstance(prev.get("session"), str):
            return str(prev["session"])
        return session_of(key_id, chat)

    async def handle(self, request: Request) -> Response:
        proxy = self.proxy
        with proxy.auditing(UsageRecord(endpoint=LABEL)) as refused:  # refused before any upstream call
            key = await proxy.keys.authenticate(request.headers.get("authorization"))
            refused.key_id, refused.tags = key.id, key.tags
            body = schemas.parse_json_object(await read_body(request, proxy.max_body))
            refused.requested_model, refused.stream = body.get("model"), body.get("stream") is True
            scope = tenant_scope(key.id)
            prev = await self.previous(scope, body)
            history = list(prev["messages"]) if prev is not None else None
            chat = wire.to_chat(body, history)
            schemas.validate_chat(chat)
        turn = [*(history or []), *wire.input_messages(body["input"])]
        store = body.get("store") is not False
        response_id = wire.new_id("resp")
        session = self.session(key.id, body, chat, prev)
        caller = Caller.of(key, chat, "chat", request.headers, label=LABEL)
        with tracing(proxy.telemetry, LABEL, request.headers):
            try:
                answer = await proxy.serve(caller, chat, session=session, disconnect=lambda: disconnected(request))
            except RateLimited as exc:  # a budget refusal names this API's cap, not chat's max_tokens
                exc.naming("max_output_tokens")
                raise
        tier = answer.route.tier.name
        if answer.body is not None:
            out = wire.response_object(answer.body, body, response_id)
            if store:
                await self.store.put(scope, response_id, [*turn, *wire.assistant_messages(out)], tier, session, out)
            return json_response(answer, orjson.dumps(out))
        events = wire.EventStream(body, response_id, "")

        async def save() -> None:
            if store:
                await self.store.put(scope, response_id, [*turn, *wire.assistant_messages(events.response)], tier,
                                     session, events.response)

        return bridge.streamed(answer, events, save)


    async def _stored(self, request: Request) -> tuple[str, str]:
        """(scope, response id) of a ``/v1/responses/{response_id}`` request, the key authenticated."""
        key = await self.proxy.keys.authenticate(request.headers.get("authorization"))
        return tenant_scope(key.id), str(request.path_params["response_id"])

    @staticmethod
    def _not_found(response_id: str) -> NotFound:
        return NotFound(f"no stored response {response_id!r}: unknown, expired, stored with store: false, or "
                        "another key's", param="response_id")

    async def retrieve(self, request: Request) -> Response:
        """``GET /v1/responses/{response_id}``: the stored ``response`` object (the caller's key only)."""
        scope, response_id = await self._stored(request)
        doc = await self.store.get(scope, response_id)
        if doc is None or not isinstance(doc.get("response"), dict):
            raise self._not_found(response_id)
        return Response(orjson.dumps(doc["response"]), media_type="application/json")

    async def delete(self, request: Request) -> Response:
        """``DELETE /v1/responses/{response_id}``: remove it (it can no longer be continued or retrieved)."""
        scope, response_id = await self._stored(request)
        if not await self.store.delete(scope, response_id):
            raise self._not_found(response_id)
        return Response(orjson.dumps({"id": response_id, "object": "response", "deleted": True}),
                        media_type="application/json")


def attach(app: Gateway, proxy: Proxy, store: ConversationStore) -> ResponsesAPI:
    """Add ``POST /v1/responses`` and ``GET`` / ``DELETE /v1/responses/{response_id}`` to ``app``."""
    api = ResponsesAPI(proxy, store)
    app.add_hot_route("/v1/responses", api.handle, ["POST"])
    app.router.add_route("/v1/responses/{response_id}", api.retrieve, methods=["GET"])
    app.router.add_route("/v1/responses/{response_id}", api.delete, methods=["DELETE"])
    return api
