"""The HTTP side of the generation endpoints: the request in, the :class:`~gateway.pipeline.answer.Answer` out.

- in: :func:`tracing` (the request's trace, from ``traceparent``), :func:`read_body` (bounded by
  ``server.max_body_bytes``), :func:`accept` (authenticate, read, validate, build the
  :class:`~gateway.pipeline.answer.Caller`; a refusal is audited), :func:`disconnected`;
- out: :func:`headers_of` (``x-thinkgate-*``, ``x-request-id``), :func:`respond` (JSON, or SSE through
  :class:`RelayResponse`, which frames chunk batches with :func:`gateway.openai.sse.frame` — an unchanged chunk
  goes out as the upstream's own bytes).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import orjson
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import BodyTooLarge
from gateway.ledger.event import Endpoint, WireEndpoint
from gateway.ledger.record import UsageRecord
from gateway.observability.telemetry import Telemetry, current
from gateway.openai import sse
from gateway.pipeline import request as schemas
from gateway.pipeline.answer import Answer, Caller
from gateway.pipeline.policy import DOWNGRADE_HEADER
from gateway.pipeline.routing import RouteDecision
from gateway.thinking import dial

if TYPE_CHECKING:
    from gateway.pipeline.proxy import Proxy

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
CACHE_HEADER = "x-thinkgate-cache"
SIMILARITY_HEADER = "x-thinkgate-cache-similarity"
ESCALATION_HEADER = "x-thinkgate-escalation"
SESSION_HEADER = "x-thinkgate-session"
VALIDATORS = {"chat": schemas.validate_chat, "completions": schemas.validate_completion}

T = TypeVar("T")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes (BodyTooLarge, 413) before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body is already read, so the next ASGI message
    is ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextlib.contextmanager
def tracing(telemetry: Telemetry | None, label: Endpoint, headers: Mapping[str, str],
            new: bool = False) -> Iterator[None]:
    """The request's trace, continuing the client's ``traceparent`` (nothing when telemetry is off, or when a
    trace was already begun in this task unless ``new``): begun here, failed with an exception raised inside the
    block; it ends with the request's usage record (``gateway.observability.telemetry.finish``)."""
    begin = telemetry is not None and (new or current() is None)
    trace = telemetry.begin(label, headers) if begin and telemetry is not None else None
    if trace is None:
        yield
        return
    try:
        yield
    except BaseException as exc:
        trace.fail(exc)
        raise


async def accept(proxy: Proxy, request: Request, endpoint: WireEndpoint) -> tuple[Caller, dict[str, Any]]:
    """Authenticate, read and validate a ``chat`` / ``completions`` request: (its caller, its body). Raises
    GatewayError; a refusal is audited first (``Proxy.auditing``) with what is known by then."""
    refused = UsageRecord(endpoint=endpoint)
    with proxy.auditing(refused):
        key = await proxy.keys.authenticate(request.headers.get("authorization"))
        refused.key_id, refused.tags = key.id, key.tags
        body = schemas.parse_json_object(await read_body(request, proxy.max_body))
        refused.requested_model, refused.stream = body.get("model"), body.get("stream") is True
        VALIDATORS[endpoint](body)
    return Caller.of(key, body, endpoint, request.headers), body


THINKING_BUDGET_HEADER = "x-thinkgate-thinking-budget"


def thinking_budget(route: RouteDecision) -> int | None:
    """The thinking budget (tokens) the route serves, for ``x-thinkgate-thinking-budget``: the request's smaller
    ``thinking_token_budget`` (after its key's ``max_thinking_budget``), else the tier's — on a ``prompted`` tier the
    one its dial instruction states (a dial router's pick on a routed request), on a ``native`` tier the one vLLM
    gets, on a ``forced`` tier the thought phase's cut (0 when the request asked for no thinking); None when the
    tier's thinking is off (``enable_thinking: false`` or ``budget_mode: off``: no budget is sent, whatever the request
    asked) or unlimited."""
    tier = route.tier
    if not dial.sends_budget(tier):  # thinking off, or no budget applied: none served, whatever was asked
        return None
    return dial.requested_budget({"thinking_token_budget": route.asked_budget}, tier)  # 0: thinking off


def route_headers(route: RouteDecision, request_id: str) -> dict[str, str]:
    """``x-thinkgate-*`` headers of a route; the difficulty only when the router scored the request, the thinking
    budget (tokens) when the served tier has one."""
    h = {
        "x-thinkgate-tier": route.tier.name,
        "x-thinkgate-route-reason": route.reason,
        "x-request-id": request_id,
    }
    if route.difficulty is not None:
        h["x-thinkgate-difficulty"] = f"{route.difficulty:.4f}"
    budget = thinking_budget(route)
    if budget is not None:
        h[THINKING_BUDGET_HEADER] = str(budget)
    if route.downgraded_from is not None:
        h[DOWNGRADE_HEADER] = route.downgraded_from
    return h


def headers_of(answer: Answer) -> dict[str, str]:
    """The gateway's response headers for ``answer``: route, request id, cache status (and similarity),
    escalation note, session state, and OpenAI's ``x-ratelimit-*`` when the key has an RPM or TPM limit."""
    h = route_headers(answer.route, answer.request_id)
    h[CACHE_HEADER] = answer.cache
    if answer.similarity is not None:
        h[SIMILARITY_HEADER] = f"{answer.similarity:.4f}"
    if answer.escalation is not None:
        h[ESCALATION_HEADER] = answer.escalation
    if answer.session is not None:
        h[SESSION_HEADER] = answer.session
    if answer.rate is not None:
        h |= answer.rate.headers()
    return h


def json_response(answer: Answer, content: bytes) -> Response:
    """A JSON answer's HTTP response: ``content`` with the answer's status and headers, and its after-response
    hook (a sampled shadow comparison) as the background task — every wire API's JSON answer goes through here,
    so none drops the hook."""
    after = BackgroundTask(answer.after) if answer.after is not None else None
    return Response(content, status_code=answer.status, media_type="application/json", headers=headers_of(answer),
                    background=after)


def respond(answer: Answer) -> Response:
    """``answer`` as HTTP: its JSON (the upstream's bytes when unchanged) or its chunk stream as SSE."""
    if answer.stream is not None:
        return RelayResponse(answer.stream, headers_of(answer), sse.frame)
    return json_response(answer, answer.raw if answer.raw is not None else orjson.dumps(answer.body))


def as_bytes(b: bytes) -> bytes:
    """The ``encode`` of a :class:`RelayResponse` whose stream yields bytes already."""
    return b


class RelayResponse(Response, Generic[T]):
    """A streaming SSE response that watches for the client's disconnect and always closes its generator.
    ``stream`` yields items that ``encode`` turns into bytes (chunk batches: :func:`gateway.openai.sse.frame`;
    bytes: :func:`as_bytes`)."""

    media_type = "text/event-stream"

    def __init__(self, stream: AsyncGenerator[T, None], headers: Mapping[str, str],
                 encode: Callable[[T], bytes]) -> None:
        self.relay = stream
        self.encode = encode
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            encode = self.encode
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for item in self.relay:
                    await send({"type": "http.response.body", "body": encode(item), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                with anyio.CancelScope(shield=True):
                    await self.relay.aclose()
                tg.cancel_scope.cancel()
