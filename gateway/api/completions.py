"""``POST /v1/chat/completions`` and ``POST /v1/completions`` → :class:`gateway.pipeline.proxy.Proxy`."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from gateway.pipeline.proxy import Proxy


def attach(app: FastAPI, proxy: Proxy) -> None:
    """Add the two generation routes to ``app``."""

    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "completions")

    # Plain Starlette routes on the hot path: the body is parsed and validated by the proxy itself, so
    # FastAPI's per-request dependency and response-model machinery would be pure overhead.
    app.router.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.router.add_route("/v1/completions", completions, methods=["POST"])
