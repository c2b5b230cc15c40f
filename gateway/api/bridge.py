"""Serving another wire API through the chat pipeline: the parts ``/v1/responses`` and ``/v1/messages`` share.

The translated body runs through :meth:`gateway.pipeline.proxy.Proxy.serve` unchanged — routed, limited,
cached, metered — and its :class:`~gateway.pipeline.answer.Answer` is translated back: the chat completion dict,
or its stream of chunk dicts, fed to a translator that writes the other API's events (:func:`translate_stream`).
The stream is always read to its end, so the chat pipeline meters the request exactly as for chat (one usage
event, after the last byte), and closed when the client goes away (the upstream call is cancelled and metered
as 499).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

import anyio
from starlette.responses import Response

from gateway.api.http import RelayResponse, as_bytes, headers_of
from gateway.ledger.record import UsageRecord
from gateway.openai.sse import Chunk
from gateway.pipeline.answer import Answer
from gateway.pipeline.relay import usage_of


class StreamTranslator(Protocol):
    """Turns chat chunks into another API's SSE events (bytes)."""

    def feed(self, chunk: dict[str, Any]) -> bytes: ...

    def finish(self) -> bytes: ...

    def fail(self, error: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes: ...


async def translate_stream(
    stream: AsyncGenerator[list[Chunk], None],
    translator: StreamTranslator,
    before_finish: Callable[[], Awaitable[None]] | None = None,
    record: UsageRecord | None = None,
) -> AsyncGenerator[bytes, None]:
    """Translate the chat chunk ``stream`` with ``translator`` (which writes its own opening events):
    ``translator.finish()`` at ``[DONE]``, sent after ``before_finish`` ran (e.g. storing the conversation and
    the final response object, so they exist before the client sees the end), ``translator.fail(error, usage)`` on
    an in-stream ``{"error": …}`` — once the stream has ended, so that ``usage`` is what ``record`` (the stream's
    usage record, :attr:`Answer.record`; None: the translator's own) was metered: the relay meters a failed stream
    after its error chunk."""
    ended = False
    failed: dict[str, Any] | None = None  # said once the stream ended (its usage metered)
    try:
        async for batch in stream:
            out: list[bytes] = []
            for item in batch:
                chunk = item.data
                if ended:
                    continue
                if chunk is None:
                    end = translator.finish()  # the final object complete before anything is stored
                    if before_finish is not None:
                        await before_finish()
                    out.append(end)
                    ended = True
                elif "error" in chunk and not chunk.get("choices"):
                    ended = True
                    failed = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                else:
                    out.append(translator.feed(chunk))
            data = b"".join(out)
            if data:
                yield data
        if failed is not None:
            yield translator.fail(failed, usage_of(record) if record is not None else None)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()


def streamed(answer: Answer, translator: StreamTranslator,
             before_finish: Callable[[], Awaitable[None]] | None = None) -> Response:
    """An SSE response carrying ``answer``'s stream translated by ``translator``, with the answer's gateway
    headers."""
    assert answer.stream is not None
    return RelayResponse(translate_stream(answer.stream, translator, before_finish, answer.record), headers_of(answer),
                         as_bytes)
