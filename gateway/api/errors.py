"""The HTTP side of :mod:`gateway.errors`: every exception as an OpenAI-shaped JSON error response.

:func:`install_handlers` registers the app's handlers — a :class:`~gateway.errors.GatewayError` with its status,
``type``, ``code`` and extra headers (``Retry-After``, ``x-request-id``); FastAPI's validation errors as 400;
Starlette's 404/405 (in Anthropic's shape under ``/v1/messages``); anything else as a 500 ``internal_error``
(logged with its traceback, never sent).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.anthropic.messages import error_body
from gateway.errors import GatewayError, InvalidRequest

log = logging.getLogger("thinkgate.errors")

#: the Messages API's paths (``gateway/api/messages.py``): their 404/405 answer in Anthropic's error shape
MESSAGES_PATH = "/v1/messages"


def error_response(exc: GatewayError) -> Response:
    """A JSON response carrying ``exc`` in OpenAI's shape, with its status and extra headers."""
    return Response(exc.to_json(), status_code=exc.status, media_type="application/json", headers=exc.headers)


def internal_error_response(method: str, path: str, exc: BaseException) -> Response:
    """An unexpected exception as a ``500 internal_error``: logged with its traceback for operators, never sent
    (the client only learns that it failed)."""
    log.exception("unhandled error on %s %s", method, path, exc_info=exc)
    return error_response(GatewayError("internal error", code="internal_error"))


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def install_handlers(app: FastAPI) -> None:
    """Register the handlers that map every exception to an OpenAI-shaped error (never a traceback)."""

    async def on_gateway_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _param_of(tuple(first.get("loc", ())))
        return error_response(InvalidRequest(f"{param or 'body'}: {first.get('msg')}", param=param))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            err = InvalidRequest(f"no such endpoint: {request.method} {request.url.path}", code="not_found",
                                 status=404)
        elif status == 405:
            err = InvalidRequest(f"method not allowed: {request.method} {request.url.path}",
                                 code="method_not_allowed", status=405)
        else:
            err = InvalidRequest(str(exc.detail), status=status)
        # under the Messages API's path, in Anthropic's shape: its SDK parses that one (NotFoundError, …)
        body = error_body(err) if request.url.path.startswith(MESSAGES_PATH) else err.to_json()
        # Starlette's 405 carries ``Allow`` (RFC 9110 §15.5.6: a 405 MUST name the methods the resource serves)
        return Response(body, status_code=status, media_type="application/json", headers=exc.headers)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        return internal_error_response(request.method, request.url.path, exc)

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
