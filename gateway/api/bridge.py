"""Serving another wire API through the chat pipeline: the parts ``/v1/responses`` and ``/v1/messages`` share.

The translated body runs through :meth:`gateway.pipeline.proxy.Proxy.serve` unchanged — routed, limited,
cached, metered — and what it answers is translated back: a JSON chat completion (:func:`json_of`), or its
SSE relay, decoded chunk by chunk and re-encoded by a translator (:func:`translate_stream`). The relay is
always read to its end, so the chat pipeline meters the request exactly as for chat (one usage event, after
the last byte), and closed when the client goes away (the upstream call is cancelled and metered as 499).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

import anyio
import orjson
from starlette.responses import Response

from gateway.openai import sse
from gateway.openai.sse import SSEDecoder, chunk_of

FORWARDED_PREFIXES = ("x-thinkgate-", "x-request-id")


def forward_headers(resp: Response) -> dict[str, str]:
    """The gateway's own response headers (``x-thinkgate-*``, ``x-request-id``) of a chat-pipeline answer."""
    return {k: v for k, v in resp.headers.items() if k.startswith(FORWARDED_PREFIXES)}


def json_of(resp: Response) -> dict[str, Any]:
    """The JSON body of a non-streamed chat-pipeline answer."""
    data = orjson.loads(bytes(resp.body))
    assert isinstance(data, dict)
    return data


class StreamTranslator(Protocol):
    """Turns chat chunks into another API's SSE events (bytes)."""

    def feed(self, chunk: dict[str, Any]) -> bytes: ...

    def finish(self) -> bytes: ...

    def fail(self, error: dict[str, Any]) -> bytes: ...


async def translate_stream(
    relay: AsyncGenerator[bytes, None],
    translator: StreamTranslator,
    before_finish: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[bytes, None]:
    """Re-encode the chat SSE ``relay`` with ``translator`` (which writes its own opening events):
    ``translator.finish()`` at ``[DONE]``, sent after ``before_finish`` ran (e.g. storing the conversation and
    the final response object, so they exist before the client sees the end), ``translator.fail(error)`` on an
    in-stream ``{"error": …}``."""
    decoder = SSEDecoder()
    ended = False
    try:
        async for raw in relay:
            out: list[bytes] = []
            for payload in decoder.feed(raw):
                if ended:
                    continue
                if payload == b"[DONE]":
                    end = translator.finish()  # the final object complete before anything is stored
                    if before_finish is not None:
                        await before_finish()
                    out.append(end)
                    ended = True
                    continue
                chunk = chunk_of(payload)
                if chunk is None:
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    out.append(translator.fail(err))
                    ended = True
                    continue
                out.append(translator.feed(chunk))
            data = b"".join(out)
            if data:
                yield data
    finally:
        with anyio.CancelScope(shield=True):
            await relay.aclose()


def streamed(resp: Response, events: AsyncGenerator[bytes, None]) -> Response:
    """An SSE response carrying ``events`` with the chat answer's gateway headers."""
    return sse.RelayResponse(events, forward_headers(resp))
