"""Server-sent events, the way OpenAI-compatible servers stream: ``data: <json>\\n\\n`` … ``data: [DONE]\\n\\n``.

:func:`data_payloads` splits an upstream byte stream into the payloads of its ``data:`` lines (bytes, no
decoding or copying beyond the split); :class:`RelayResponse` sends a relay generator to the client and
closes it deterministically — also when the client disconnects, so the upstream request is cancelled at once
instead of whenever the generator happens to be garbage-collected.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(payload: bytes) -> bytes:
    """One SSE event carrying ``payload`` (a JSON document)."""
    return b"data: " + payload + b"\n\n"


def error_event(exc: GatewayError) -> bytes:
    """An in-stream error in OpenAI's shape; the official SDKs raise ``openai.APIError`` on it."""
    return event(exc.to_json())


async def data_payloads(resp: httpx.Response) -> AsyncIterator[bytes]:
    """Yield the payload of every ``data:`` line of ``resp`` (comments, ``event:`` and blank lines skipped)."""
    buf = b""
    async for chunk in resp.aiter_raw():
        buf = buf + chunk if buf else chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl], buf[nl + 1 :]
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if buf.startswith(b"data:"):
        yield buf[5:].strip()


class RelayResponse(Response):
    """A streaming response that watches for the client's disconnect and always closes its generator."""

    media_type = "text/event-stream"

    def __init__(self, relay: AsyncGenerator[bytes, None], headers: Mapping[str, str]) -> None:
        self.relay = relay
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
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.relay:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                with anyio.CancelScope(shield=True):
                    await self.relay.aclose()
                tg.cancel_scope.cancel()
