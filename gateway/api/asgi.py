"""The gateway's ASGI application: FastAPI, with the generation endpoints dispatched before Starlette's stack.

Every request to a FastAPI app walks five layers before its handler: ``ServerErrorMiddleware``,
``ExceptionMiddleware``, FastAPI's ``AsyncExitStackMiddleware``, the router's match over every route, and
``request_response``'s exception wrapper. On the generation endpoints (``POST /v1/chat/completions``, …) that is
a fixed cost per request with nothing in it the handler uses: their handlers parse and validate the body
themselves and depend on no FastAPI dependency. :class:`Gateway` looks those exact paths up in a dict first and
calls the handler directly, mapping its exceptions exactly as :func:`gateway.api.errors.install_handlers` does
(a :class:`~gateway.errors.GatewayError` to its OpenAI-shaped error; anything else logged and answered
``500 internal_error``). Every other request — other paths and methods, lifespan — takes the FastAPI stack
unchanged. An exception raised after the response has started (a stream) reaches the server, as it does through
Starlette. OpenAI's paths are also served without ``/v1`` (``/chat/completions`` …), as LiteLLM does: the path
is rewritten before anything else sees it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api.errors import error_response, internal_error_response
from gateway.api.slow_clients import guard_body
from gateway.errors import GatewayError

Endpoint = Callable[[Request], Awaitable[Response]]

#: the API's paths also served without their ``/v1`` prefix (exact, and under these prefixes)
UNVERSIONED = frozenset({"/chat/completions", "/completions", "/embeddings", "/models", "/responses", "/messages",
                         "/usage", "/feedback"})
UNVERSIONED_PREFIXES = ("/models/", "/responses/", "/messages/")


class Gateway(FastAPI):
    """FastAPI with a direct dispatch of exact-path routes (module doc); register them with :meth:`add_hot_route`."""

    def __init__(self, body_timeout_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hot: dict[tuple[str, str], Endpoint] = {}
        #: ``server.request_body_timeout_s``: every HTTP request's body reads are bounded by it (None: unbounded)
        self.body_timeout_s = body_timeout_s

    def add_hot_route(self, path: str, endpoint: Endpoint, methods: Sequence[str], name: str | None = None) -> None:
        """Serve ``methods`` on ``path`` (exact, no path parameters) by ``endpoint`` without the middleware stack.
        The route is also added to the router, so that a path's other methods still answer 405."""
        self.router.add_route(path, endpoint, methods=list(methods), name=name)
        for m in methods:
            self.hot[(m.upper(), path)] = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if self.body_timeout_s is not None and scope["type"] == "http":
            # a body sent a byte at a time would hold the request (and its connection) forever
            receive = guard_body(receive, self.body_timeout_s)
        if scope["type"] == "http" and not path.startswith("/v1/") and (
                path in UNVERSIONED or path.startswith(UNVERSIONED_PREFIXES)
                or (path.endswith("/") and path[:-1] in UNVERSIONED)):
            # OpenAI's paths without /v1 (a client whose base URL lacks it), as LiteLLM serves them
            raw = scope.get("raw_path") or scope["path"].encode()
            path = "/v1" + path
            scope = {**scope, "path": path, "raw_path": b"/v1" + raw}  # the raw path keeps its percent-encoding
        endpoint = self.hot.get((scope.get("method", ""), path)) if scope["type"] == "http" else None
        if endpoint is None and scope["type"] == "http" and path.endswith("/") and len(path) > 1:
            # ``POST /v1/chat/completions/``: served, not redirected — Starlette's 307 points at the Host the request
            # named (an internal address behind a proxy) and makes the client send the body twice
            endpoint = self.hot.get((scope.get("method", ""), path.rstrip("/")))
            if endpoint is not None:
                raw = scope.get("raw_path") or scope["path"].encode()
                scope = {**scope, "path": path.rstrip("/"), "raw_path": raw.rstrip(b"/")}
        if endpoint is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        if self.root_path:
            scope["root_path"] = self.root_path
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except GatewayError as exc:
            response = error_response(exc)
        except Exception as exc:
            response = internal_error_response(scope["method"], scope["path"], exc)
        await response(scope, receive, send)
