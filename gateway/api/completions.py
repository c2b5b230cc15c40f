"""``POST /v1/chat/completions`` and ``POST /v1/completions``: HTTP in (:func:`gateway.api.http.accept`), the
chat pipeline (:meth:`gateway.pipeline.proxy.Proxy.serve`), HTTP out (:func:`gateway.api.http.respond`)."""

from __future__ import annotations

import functools

from starlette.requests import Request
from starlette.responses import Response

from gateway.api import http
from gateway.api.asgi import Gateway
from gateway.ledger.event import WireEndpoint
from gateway.pipeline.proxy import Proxy


async def serve(proxy: Proxy, request: Request, endpoint: WireEndpoint) -> Response:
    """Serve one ``chat`` or ``completions`` request; raises GatewayError before any byte is sent (a refusal
    before any upstream call leaves an audit event and its error carries ``x-request-id``)."""
    with http.tracing(proxy.telemetry, endpoint, request.headers, new=True):
        caller, body = await http.accept(proxy, request, endpoint)
        answer = await proxy.serve(caller, body, disconnect=lambda: http.disconnected(request))
    return http.respond(answer)


def attach(app: Gateway, proxy: Proxy) -> None:
    """Add the two generation routes to ``app``: :func:`serve` bound to the proxy and the endpoint."""
    # Dispatched before Starlette's middleware stack (gateway.api.asgi): the body is parsed and validated by the
    # API layer itself, so FastAPI's per-request dependency and response-model machinery would be pure overhead.
    app.add_hot_route("/v1/chat/completions", functools.partial(serve, proxy, endpoint="chat"), ["POST"],
                      name="chat_completions")
    app.add_hot_route("/v1/completions", functools.partial(serve, proxy, endpoint="completions"), ["POST"],
                      name="completions")
