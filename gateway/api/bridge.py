"""Serving another wire API through the chat pipeline: the parts ``/v1/responses`` and ``/v1/messages`` share.

The translated body runs through :meth:`gateway.pipeline.proxy.Proxy.serve` unchanged — routed, limited,
cached, metered — and its :class:`~gateway.pipeline.answer.Answer` is translated back: the chat completion dict,
or its stream of chunk dicts, fed to a translator that writes the other API's events (:func:`translate_stream`).
The stream is always read to its end, so the chat pipeline meters the request exactly as for chat (one usage
event, after the last byte), and closed when the client goes away (the upstream call is cancelled and metered
as 499).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Final, Protocol

import anyio
from starlette.responses import Response

from gateway.api.http import RelayResponse, as_bytes, headers_of
from gateway.errors import GatewayError
from gateway.ledger.record import UsageRecord
from gateway.openai.sse import Chunk
from gateway.pipeline.answer import Answer
from gateway.pipeline.relay import usage_of

log = logging.getLogger("thinkgate.bridge")

#: the error a translated stream ends with when its translator raised a bug (an upstream chunk it cannot translate
#: raises a GatewayError, said instead): OpenAI's ``server_error`` (Anthropic's ``api_error``)
TRANSLATION_FAILED: Final = {"code": "server_error", "message": "the gateway failed to translate the answer"}


class StreamTranslator(Protocol):
    """Turns chat chunks into another API's SSE events (bytes)."""

    def feed(self, chunk: dict[str, Any]) -> bytes: ...

    def finish(self) -> bytes: ...

    def fail(self, error: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes: ...


async def _finished(translator: StreamTranslator, before_finish: Callable[[], Awaitable[None]] | None) -> bytes:
    """The closing events (``translator.finish()``), ``before_finish`` run first: one that raises is logged and the
    answer closed without it — the answer was generated and billed, and the client waits for its end."""
    end = translator.finish()  # the final object complete before anything is stored
    if before_finish is not None:
        try:
            await before_finish()
        except Exception:
            log.exception("the step before a translated stream's end failed; the stream is closed without it")
    return end


def _failure(translator: StreamTranslator, error: dict[str, Any], record: UsageRecord | None) -> bytes:
    """The failure events for ``error``, with the usage ``record`` is metered (OpenAI's chat shape; None: the
    translator's own, from the stream) — b"" when the translator cannot even say that (logged)."""
    try:
        return translator.fail(error, usage_of(record) if record is not None else None)
    except Exception:
        log.exception("a translated stream's failure events could not be written")
        return b""


async def translate_stream(
    stream: AsyncGenerator[list[Chunk], None],
    translator: StreamTranslator,
    before_finish: Callable[[], Awaitable[None]] | None = None,
    record: UsageRecord | None = None,
) -> AsyncGenerator[bytes, None]:
    """Translate the chat chunk ``stream`` with ``translator`` (which writes its own opening events):
    ``translator.finish()`` at ``[DONE]``, sent after ``before_finish`` ran (e.g. storing the conversation and
    the final response object, so they exist before the client sees the end; one that raises is logged and skipped),
    ``translator.fail(error, usage)`` on an in-stream ``{"error": …}`` — once the stream has ended, so that
    ``usage`` is what ``record`` (the stream's usage record, :attr:`Answer.record`) was metered: the relay meters a
    failed stream after its error chunk. A translator that raises a :class:`~gateway.errors.GatewayError` (an
    upstream chunk it cannot translate) ends the stream the same way with that error's code and message; one that
    raises anything else (a bug) with :data:`TRANSLATION_FAILED`. The stream is read to its end either way, so it is
    metered as the call it was (a stream closed early is metered as the client's disconnect)."""
    ended = False
    failed: dict[str, Any] | None = None  # said once the stream ended (its usage metered)
    try:
        async for batch in stream:
            out: list[bytes] = []
            for item in batch:
                chunk = item.data
                if ended:
                    continue
                try:
                    if chunk is None:
                        ended = True
                        out.append(await _finished(translator, before_finish))
                    elif "error" in chunk and not chunk.get("choices"):
                        ended = True
                        err = chunk["error"]
                        failed = err if isinstance(err, dict) else {"message": str(err)}
                    else:
                        out.append(translator.feed(chunk))
                except GatewayError as exc:
                    # the upstream's malformed chunk (a choice index that is no integer): its fault, said as such,
                    # and no traceback — nothing in the gateway is broken
                    log.warning("the stream of request %s ends with a failure event once read to its end: %s",
                                record.request_id if record is not None else "-", exc.message)
                    ended, failed = True, {"code": exc.code, "message": exc.message}
                except Exception:
                    # raised after the 200: without this the stream broke (no closing event) and, closed early, the
                    # call was metered as the client's disconnect (499, partial)
                    log.exception("translating the stream of request %s failed; it ends with a failure event once "
                                  "read to its end", record.request_id if record is not None else "-")
                    ended, failed = True, dict(TRANSLATION_FAILED)
            data = b"".join(out)
            if data:
                yield data
        if failed is not None and (last := _failure(translator, failed, record)):
            yield last
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
