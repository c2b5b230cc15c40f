"""``POST /v1/messages``: the Anthropic Messages API, served by translation onto the tier's chat upstream.

auth (``x-api-key`` or ``Authorization: Bearer``; ``anthropic-version`` accepted, not required) → body →
:func:`gateway.anthropic.messages.to_chat` → route (:func:`route_for_thinking`) → the chat pipeline
(:meth:`gateway.pipeline.proxy.Proxy.serve`, usage event ``endpoint: messages``) → the ``message``, or
Anthropic's event stream. Every error is in Anthropic's shape (``{"type": "error", "error": {"type",
"message"}}``) with the gateway's status.
"""

from __future__ import annotations

import logging
import time
from typing import Final

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.anthropic import messages as wire
from gateway.api import bridge
from gateway.api.asgi import Gateway
from gateway.api.http import disconnected, json_response, read_body, tracing
from gateway.config import TierConfig
from gateway.errors import GatewayError, RateLimited
from gateway.ledger.event import ROUTER_DECIDED
from gateway.ledger.record import UsageRecord
from gateway.openai.usage import estimate_tokens
from gateway.pipeline import policy
from gateway.pipeline import request as schemas
from gateway.pipeline.answer import Caller
from gateway.pipeline.proxy import TIER_HEADER, Proxy
from gateway.pipeline.routing import RouteDecision
from gateway.thinking import dial

log = logging.getLogger("thinkgate.messages")

LABEL: Final = "messages"


def thinks(tier: TierConfig) -> bool:
    """True when ``tier`` lets the model think at all."""
    return tier.enable_thinking and tier.thinking_budget != 0


def served(tier: TierConfig, budget: int) -> int | None:
    """The thinking budget (tokens) ``tier`` serves for ``thinking.budget_tokens = budget``, as chat serves a
    ``thinking_token_budget``: the smaller of it and the tier's own, clamped into the tier's
    ``thinking_budget_range`` (:func:`gateway.thinking.dial.requested_budget`); None = unlimited."""
    return dial.requested_budget({"thinking_token_budget": budget}, tier)


def covers(tier: TierConfig, budget: int) -> bool:
    """True when ``tier`` may think at least ``budget`` tokens: it thinks and serves that budget at least — a tier
    whose own budget or ``thinking_budget_range`` would cut it lower does not cover it (``thinking_budget: null``
    and no range: unlimited)."""
    if not thinks(tier):
        return False
    got = served(tier, budget)
    return got is None or got >= budget


def route_for_thinking(route: RouteDecision, tiers: list[TierConfig], budget: int) -> RouteDecision:
    """The tier for ``thinking.budget_tokens = budget``: a routed (a router's decision, ``ROUTER_DECIDED``, or
    ``fallback``) tier that does not cover it (:func:`covers`) gives way to the cheapest tier (configuration order)
    that does — or, when none does, the one that serves the largest budget for it — with reason ``effort`` (the client
    said how much to think). A tier that covers it keeps the request, and the budget it serves is applied there
    (``thinking_token_budget``: the smaller one, in the tier's range). A forced tier is kept either way, its budget
    clamped as on chat."""
    if (route.reason not in ROUTER_DECIDED and route.reason != "fallback") or covers(route.tier, budget):
        return route
    fit = next((t for t in tiers if covers(t, budget)), None)
    if fit is None:
        fit = max((t for t in tiers if thinks(t)), key=lambda t: served(t, budget) or 0, default=route.tier)
    return RouteDecision(fit, "effort", route.difficulty)


def anthropic_error(exc: GatewayError) -> Response:
    """``exc`` as an Anthropic error response (status and headers such as ``Retry-After`` kept; an RPM/TPM 429's
    rate-limit headers also under Anthropic's names)."""
    headers = {**exc.headers, **wire.ratelimit_headers(exc.headers, time.time())} if exc.headers else exc.headers
    return Response(wire.error_body(exc), status_code=getattr(exc, "status_code", exc.status),
                    media_type="application/json", headers=headers)


def with_request_id(resp: Response) -> Response:
    """``resp`` with Anthropic's ``request-id`` header (the one its SDK reads: ``_request_id``, ``APIStatusError.
    request_id``) beside the gateway's ``x-request-id``, same value; none where the response has no request id."""
    rid = resp.headers.get("x-request-id")
    if rid is not None and "request-id" not in resp.headers:
        resp.headers["request-id"] = rid
    return resp


class MessagesAPI:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def handle(self, request: Request) -> Response:
        try:
            resp = await self._handle(request)
        except RateLimited as exc:  # a budget refusal names this API's cap, not chat's max_completion_tokens or n
            resp = anthropic_error(exc.naming("max_tokens"))
        except GatewayError as exc:
            resp = anthropic_error(exc)
        except Exception:
            log.exception("unhandled error on POST /v1/messages")
            resp = anthropic_error(GatewayError("internal error", code="internal_error"))
        return with_request_id(resp)

    async def _handle(self, request: Request) -> Response:
        proxy = self.proxy
        h = request.headers
        authorization = h.get("authorization") or (f"Bearer {h['x-api-key']}" if h.get("x-api-key") else None)
        with proxy.auditing(UsageRecord(endpoint=LABEL)) as refused:  # refused before any upstream call
            key = await proxy.keys.authenticate(authorization)
            refused.key_id, refused.tags = key.id, key.tags
            body = schemas.parse_json_object(await read_body(request, proxy.max_body))
            refused.requested_model, refused.stream = body.get("model"), body.get("stream") is True
            chat = wire.to_chat(body, interleaved=wire.interleaved(h.get("anthropic-beta")))
            schemas.validate_chat(chat)
            route = proxy.routing.decide(chat, h.get(TIER_HEADER))
        thinking = wire.thinking_of(body)
        if thinking is not None and thinking.enabled and thinking.budget_tokens is not None:
            # among the tiers that answer messages and that this key may use: an embeddings tier, or one the key's
            # policy refuses (a 403, or a downgrade below the tier the client's budget asked for), is no cover
            usable = [t for t in proxy.settings.tiers if not t.embeddings
                      and (key.allowed_tiers is None or t.name in key.allowed_tiers)]
            route = route_for_thinking(route, usable, thinking.budget_tokens)
        message_id = wire.new_id("msg")
        caller = Caller.of(key, chat, "chat", h, label=LABEL)
        with tracing(proxy.telemetry, LABEL, h):
            answer = await proxy.serve(caller, chat, route=route, disconnect=lambda: disconnected(request))
        if answer.body is not None:
            out = wire.message_object(answer.body, body, message_id)
            resp = json_response(answer, orjson.dumps(out))
        else:
            resp = bridge.streamed(answer, wire.MessageStream(body, message_id))
        resp.headers.update(wire.ratelimit_headers(resp.headers, time.time()))  # Anthropic's names beside OpenAI's
        return resp


    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens`` → ``{"input_tokens": N}``: the prompt tokens of the request on the
        tier it would be routed to (vLLM's ``/tokenize`` with the chat template; ~4 characters per token when
        that fails, header ``x-thinkgate-token-count: estimated``). Not metered: nothing is generated."""
        try:
            proxy = self.proxy
            h = request.headers
            authorization = h.get("authorization") or (f"Bearer {h['x-api-key']}" if h.get("x-api-key") else None)
            key = await proxy.keys.authenticate(authorization)
            body = schemas.parse_json_object(await read_body(request, proxy.max_body))
            chat = wire.to_chat({**body, "max_tokens": 1, "stream": False},  # max_tokens: not asked here
                                budget_rule=False)
            # the key's tier policy as on a message (a key held to one tier counted on any: a security review)
            route = policy.key_route(key, proxy.routing.decide(chat, h.get(TIER_HEADER)), proxy.settings.tiers)
            count = await proxy.upstreams.count_chat_tokens(route.tier, chat["messages"], chat.get("tools"))
            headers = {"x-thinkgate-tier": route.tier.name}
            if count is None:
                count = estimate_tokens(orjson.dumps([chat["messages"], chat.get("tools")]).decode())
                headers["x-thinkgate-token-count"] = "estimated"
            return Response(orjson.dumps({"input_tokens": count}), media_type="application/json", headers=headers)
        except GatewayError as exc:
            return anthropic_error(exc)


def attach(app: Gateway, proxy: Proxy) -> MessagesAPI:
    """Add ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` to ``app``."""
    api = MessagesAPI(proxy)
    app.add_hot_route("/v1/messages", api.handle, ["POST"])
    app.router.add_route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])
    return api
