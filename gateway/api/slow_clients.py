"""Bounds on slow clients (slowloris): how long a connection may take to send a request, and idle between requests.

uvicorn bounds only the idle time between two requests of a kept-alive connection (``timeout_keep_alive``, armed
when a response completes). A connection that sends nothing, or half a request head, or a body a byte at a time,
is held open forever — each held connection costs a socket and a slot in the event loop, so a few hundred of them
from one client keep the gateway busy doing nothing. Three bounds, all in ``server:``:

- ``request_head_timeout_s``: the request line and headers must be in within this of the connection opening (its
  first request) or of the request's first byte (a later request on a kept-alive connection). Enforced by
  :class:`GuardedHttpToolsProtocol` (uvicorn has no such timeout; the ASGI app never sees a head that is not
  complete): ``408`` with an OpenAI-shaped error body, then the connection is closed.
- ``request_body_timeout_s``: the whole body must be in within this of the head. Enforced where the app reads it
  (:func:`guard_body`, wrapped around ``receive`` by :class:`gateway.api.asgi.Gateway`): the read raises
  :class:`~gateway.errors.RequestTimeout`, which the endpoint answers as any refusal (``408``, OpenAI's error
  shape — Anthropic's on ``/v1/messages``), with ``connection: close``. The protocol closes a connection whose
  body is still arriving :data:`BODY_GRACE_S` after that (a body the app did not read because it answered first).
- ``keep_alive_timeout_s``: uvicorn's ``timeout_keep_alive``.
- ``limit_concurrency``: uvicorn's cap on connections plus requests in flight, with two changes
  (:meth:`GuardedHttpToolsProtocol.on_headers_complete`): the probes (``/health``, ``/ready``) are always served —
  uvicorn refused them too, so a liveness probe failed at the cap and Kubernetes restarted the busiest pods —, and
  the refusal is :class:`~gateway.errors.Overloaded` (503, OpenAI's error shape — Anthropic's under ``/v1/messages``,
  ``retry-after``) instead of
  uvicorn's plain-text "Service Unavailable".

The bound is on the whole head and the whole body, not on the gap between two packets: a client that sends a
byte every few seconds passes any per-read timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.anthropic.messages import error_body
from gateway.api.errors import error_response
from gateway.config import ServerConfig
from gateway.errors import Overloaded, RequestTimeout

#: after ``request_body_timeout_s``, the protocol's own cut of a body still arriving waits this much longer, so
#: the app's 408 (which says why) goes out first when the app is the one reading the body
BODY_GRACE_S = 1.0


def guard_body(receive: Receive, timeout_s: float) -> Receive:
    """``receive`` that raises :class:`RequestTimeout` when the request body is not complete ``timeout_s`` from
    now. Once the last body part is in, later calls (the wait for ``http.disconnect`` while an answer streams) are
    passed through unbounded."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    done = False

    async def guarded() -> Message:
        nonlocal done
        if done:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            done = True
            raise RequestTimeout(f"the request body was not received within {timeout_s:g} s "
                                 "(server.request_body_timeout_s)", headers={"connection": "close"}) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            done = True
        return message

    return guarded


#: paths served whatever the concurrency cap: the probes (an orchestrator reads a refusal as a dead or unready pod)
PROBE_PATHS = frozenset({b"/health", b"/ready"})
_OVERLOADED = Overloaded("this gateway process is at server.limit_concurrency: retry (another replica may have room)",
                         headers={"retry-after": "1", "connection": "close"})


async def overloaded(scope: Any, receive: Any, send: Any) -> None:
    """The ASGI answer past ``server.limit_concurrency``: :class:`Overloaded` in OpenAI's shape — Anthropic's under
    the Messages API's paths, whose SDK parses that one —, then close."""
    path = scope.get("path", "")
    if path.startswith(("/v1/messages", "/messages")):
        body = error_body(_OVERLOADED)
        await Response(body, status_code=_OVERLOADED.status, media_type="application/json",
                       headers=_OVERLOADED.headers)(scope, receive, send)
        return
    await error_response(_OVERLOADED)(scope, receive, send)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on reading each request (module doc). Subclassed per server
    by :func:`protocol_class` with the configured bounds."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None

    def _arm(self, delay_s: float, callback: Any) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # a connection that never sends a byte is a request head that never completes
        self._arm(self.head_timeout_s, self._head_expired)

    def data_received(self, data: bytes) -> None:
        # Between requests no timer runs (uvicorn's keep-alive timer does, and the first byte cancels it): the
        # first byte of the next request starts its head's clock. Armed before parsing, so that a request that
        # completes within this call is disarmed by on_message_complete below.
        if self._read_timer is None:
            self._arm(self.head_timeout_s, self._head_expired)
        super().data_received(data)

    def on_headers_complete(self) -> None:
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            # at the cap (uvicorn's test, which would answer its plain-text 503 to every path): a probe is served,
            # anything else gets the provider-shaped refusal; uvicorn's own check is switched off for this call
            app = self.app
            self.limit_concurrency = None
            if self.url.split(b"?", 1)[0] not in PROBE_PATHS:
                self.app = overloaded
                self.logger.warning("Exceeded concurrency limit (server.limit_concurrency = %d).", limit)
            try:
                super().on_headers_complete()
            finally:
                self.limit_concurrency, self.app = limit, app
        else:
            super().on_headers_complete()
        self._arm(self.body_timeout_s + BODY_GRACE_S, self._body_expired)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_expired(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            # nothing else is being written on this connection: say why it is closed
            err = RequestTimeout(f"the request head was not received within {self.head_timeout_s:g} s "
                                 "(server.request_head_timeout_s)")
            body = err.to_json()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
                                 + body)
        self.transport.close()

    def _body_expired(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_class(server: ServerConfig) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn's ``http=`` with ``server``'s bounds (uvicorn builds one instance per
    connection from the class alone, so the bounds are class attributes of a subclass)."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"head_timeout_s": server.request_head_timeout_s, "body_timeout_s": server.request_body_timeout_s})


def uvicorn_options(server: ServerConfig) -> dict[str, Any]:
    """The uvicorn settings of ``server:`` beyond host and port: the slow-client bounds and the concurrency cap."""
    return {"http": protocol_class(server), "timeout_keep_alive": server.keep_alive_timeout_s,
            "limit_concurrency": server.limit_concurrency}
