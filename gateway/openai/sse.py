"""Server-sent events, the way OpenAI-compatible servers stream: ``data: <json>\\n\\n`` … ``data: [DONE]\\n\\n``.

:class:`SSEDecoder` (the one parser) splits a byte stream into the payloads of its ``data:`` lines (bytes, no
decoding); :func:`data_batches` groups them by network read; :class:`RelayResponse` sends a relay generator to
the client and closes it deterministically — also when the client disconnects, so the upstream request is
cancelled at once instead of whenever the generator happens to be garbage-collected.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.openai.usage import reasoning_of


class UpstreamStream(Protocol):
    """Anything with ``aiter_raw()`` yielding SSE bytes (``httpx.Response``, a synthetic response)."""

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(payload: bytes) -> bytes:
    """One SSE event carrying ``payload`` (a JSON document)."""
    return b"data: " + payload + b"\n\n"


def error_event(exc: GatewayError) -> bytes:
    """An in-stream error in OpenAI's shape; the official SDKs raise ``openai.APIError`` on it."""
    return event(exc.to_json())


class SSEDecoder:
    """The one SSE parser: :meth:`feed` raw bytes, get the payloads of the ``data:`` lines they completed.

    Payloads are bytes (``b"[DONE]"`` included), stripped, never decoded; comments, ``event:``/``id:`` fields
    and blank lines are skipped; CRLF line ends are accepted. OpenAI-compatible servers send one ``data:`` line
    per event, so a line is an event here (a multi-line ``data:`` event yields one payload per line).
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the ``data:`` lines completed by ``chunk`` (in order)."""
        buf = self._buf + chunk if self._buf else chunk
        start = 0
        out: list[bytes] = []
        while (nl := buf.find(b"\n", start)) >= 0:
            line = buf[start:nl]
            start = nl + 1
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
        self._buf = buf[start:]
        return out

    def flush(self) -> list[bytes]:
        """The payload of a last ``data:`` line that ended without a newline, if any."""
        rest, self._buf = self._buf, b""
        return [rest[5:].strip()] if rest.startswith(b"data:") else []


def chunk_of(payload: bytes) -> dict[str, Any] | None:
    """The JSON object one ``data:`` payload carries; None for ``[DONE]``, invalid JSON or a non-object (an
    upstream's stray keep-alive or a proxy's garbage is skipped, never fatal)."""
    if payload == b"[DONE]":
        return None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


async def data_batches(resp: UpstreamStream) -> AsyncIterator[list[bytes]]:
    """Yield, per network read of ``resp``, the payloads of the complete ``data:`` lines it finished
    (:class:`SSEDecoder`). Relaying a read's events together costs one write to the client instead of one per
    event, and adds no delay: they arrived together."""
    decoder = SSEDecoder()
    async for chunk in resp.aiter_raw():
        batch = decoder.feed(chunk)
        if batch:
            yield batch
    if tail := decoder.flush():
        yield tail


@dataclass(slots=True)
class StreamTally:
    """The relay's view of an upstream stream of chat or completion chunks.

    :meth:`feed` returns the bytes to pass on for one batch of payloads and records: the usage-only chunk
    (held back in ``usage_chunk``), ``[DONE]`` (``done``; the relay writes its own), an in-stream
    ``{"error": …}`` (``upstream_error``, passed on, nothing after it), reasoning text per choice index
    (for counting when usage lacks it), and delta counts (≈ tokens on vLLM, for an estimate when usage
    never comes). ``saw_text`` turns true with the first reasoning or content delta (time to first token).
    """

    reasoning: dict[int, list[str]] = field(default_factory=dict)
    reasoning_deltas: int = 0
    text_deltas: int = 0
    usage_chunk: dict[str, Any] | None = None
    last_usage: dict[str, Any] | None = None
    done: bool = False
    upstream_error: bool = False
    saw_text: bool = False

    def feed(self, batch: list[bytes]) -> bytes:
        out: list[bytes] = []
        for payload in batch:
            if payload == b"[DONE]":
                self.done = True
                break
            chunk = chunk_of(payload)
            if chunk is None:
                continue
            choices = chunk.get("choices")
            if "error" in chunk and not choices:
                self.upstream_error = True
                out.append(event(payload))
                break
            usage = chunk.get("usage")
            if usage and not choices:
                self.usage_chunk = chunk
                continue
            if usage:  # continuous usage stats: each chunk carries the running totals
                self.last_usage = usage
            if choices:
                self._count(choices)
            out.append(event(payload))
        return b"".join(out)

    def _count(self, choices: list[dict[str, Any]]) -> None:
        for c in choices:
            delta = c.get("delta")
            if delta is None:  # /v1/completions chunks carry "text"
                if c.get("text"):
                    self.text_deltas += 1
                    self.saw_text = True
                continue
            r = reasoning_of(delta)
            if r:
                self.reasoning.setdefault(int(c.get("index") or 0), []).append(r)
                self.reasoning_deltas += 1
                self.saw_text = True
            if delta.get("content"):
                self.text_deltas += 1
                self.saw_text = True

    def reasoning_texts(self) -> list[str]:
        """The reasoning text of each choice that had any."""
        return [t for parts in self.reasoning.values() if (t := "".join(parts))]


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
