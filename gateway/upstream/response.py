"""What the request path reads from an upstream call: :class:`UpstreamResponse`, implemented by
:class:`gateway.upstream.pool.AioResponse` (a real call) and :class:`SyntheticResponse` (an answer the gateway
composed itself — budget forcing — or already read part of — the escalation peek).

The pipeline reads a streamed answer as batches of :class:`gateway.openai.sse.Chunk` (:func:`chunk_batches`) and a
non-streamed one as its JSON document (:func:`json_body`): a real response is decoded once, a synthetic one
hands over the dicts it was built from (nothing is encoded to be parsed again). A streamed call answered with one
JSON document instead of SSE is read as the stream it would have been (:func:`json_answer_batches`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from gateway.ledger.event import UsageSource
from gateway.openai import sse
from gateway.openai.chunks import answer_chunks
from gateway.openai.sse import Chunk
from gateway.upstream.pool import join_bounded

#: what a stream closed before its end is known to have used (:meth:`SyntheticResponse.spent`): its usage (OpenAI's
#: shape, tokens) and whose count that is — ``upstream`` when every part of it is an upstream's report, else
#: ``counted``
Spent = tuple[dict[str, Any], UsageSource]


class UpstreamResponse(Protocol):
    """The part of an HTTP response the pipeline uses: ``content`` (a non-streamed body), ``aiter_raw()``
    (SSE bytes of a streamed one) and ``aclose()`` (always called; cancels a request still in flight)."""

    @property
    def content(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class SyntheticResponse:
    """An :class:`UpstreamResponse` the gateway produced: ``data`` for a non-streamed answer (its JSON document),
    or chunk batches from ``head`` (batches already read), then ``chunks`` (the rest, in batches) or ``events``
    (the rest, one chunk a batch: a composed stream, one event per write). Gateway errors raised by them
    propagate as they are: the relay turns :class:`gateway.errors.GatewayError` into one in-stream error event.
    ``closer``: called by :meth:`aclose` (the wrapped response's). ``counted_on_failure``: a usage-only chunk the
    stream sends before it fails is the gateway's count of what ran, not an upstream's report (budget forcing's
    bill of a failed answer phase, :meth:`gateway.thinking.forcing.ForcedBudget._spent`): the relay meters it as
    ``usage_source: counted``. ``spent``: what a stream closed before its end is known to have used (:meth:`spent`)."""

    def __init__(
        self,
        data: dict[str, Any] | None = None,
        chunks: AsyncIterator[list[Chunk]] | None = None,
        head: list[list[Chunk]] | None = None,
        closer: Callable[[], Awaitable[None]] | None = None,
        events: AsyncIterator[Chunk] | None = None,
        counted_on_failure: bool = False,
        spent: Callable[[], Awaitable[Spent | None]] | None = None,
    ) -> None:
        self.data = data
        self.counted_on_failure = counted_on_failure
        self._spent = spent
        self._chunks = chunks
        self._events = events
        self._head = head or []
        self._closer = closer

    @property
    def content(self) -> bytes:
        """The non-streamed body, encoded (empty for a streamed answer)."""
        return orjson.dumps(self.data) if self.data is not None else b""

    async def chunk_batches(self) -> AsyncIterator[list[Chunk]]:
        """The head batches, then the rest."""
        for batch in self._head:
            yield batch
        if self._chunks is not None:
            async for batch in self._chunks:
                yield batch
        if self._events is not None:
            async for c in self._events:
                yield [c]

    def take_head(self) -> list[list[Chunk]]:
        """The batches already read (``head``), handed over once: :meth:`chunk_batches` then yields only the rest.
        For the relay, which passes them on without waiting (they are in memory) however little time is left."""
        head, self._head = self._head, []
        return head

    async def spent(self) -> Spent | None:
        """(usage in OpenAI's shape, whose count it is) of a stream closed before its end — the client gone, or cut
        at its bound — as the gateway knows it ran (a forced stream once its thought phase reported its usage:
        :meth:`gateway.thinking.forcing.ForcedBudget.spent`); None when it knows nothing (counted as any stream)."""
        return await self._spent() if self._spent is not None else None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """SSE bytes of :meth:`chunk_batches`."""
        async for batch in self.chunk_batches():
            yield sse.frame(batch)

    async def aclose(self) -> None:
        """Close the chunk generator (cancelling forced upstream calls) and the wrapped response."""
        for gen in (self._chunks, self._events):
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                await aclose()
        if self._closer is not None:
            await self._closer()


def chunk_batches(resp: UpstreamResponse) -> AsyncIterator[list[Chunk]]:
    """The chunk batches of a streamed answer: a synthetic response's own; an upstream's JSON answer as the stream it
    would have been (:func:`json_answer_batches`); else decoded from the bytes (one batch per network read,
    :func:`gateway.openai.sse.chunk_batches`)."""
    if isinstance(resp, SyntheticResponse):
        return resp.chunk_batches()
    if is_json(resp):
        return json_answer_batches(resp)
    return sse.chunk_batches(resp)


def is_json(resp: UpstreamResponse) -> bool:
    """Whether ``resp`` says its body is one JSON document (``content-type`` ``application/json`` or ``…+json``)
    rather than SSE: an upstream, or a proxy before it, that does not stream answers a stream request so."""
    headers = getattr(resp, "headers", None)  # a real call's (AioResponse); a synthetic response streams
    media = str(headers.get("content-type") or "") if headers is not None else ""
    media = media.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def json_answer_batches(resp: UpstreamResponse) -> AsyncIterator[list[Chunk]]:
    """One batch: the stream a streamed call's JSON body would have been. An answer (``choices``) as its chunks,
    its usage chunk and ``[DONE]`` (:func:`gateway.openai.chunks.answer_chunks`) — the upstream said what the call
    used, and the relay meters that as it meters any stream's usage (bounded by the call's usage limit); an error
    document (``{"error": …}``) as the in-stream error it is. Nothing for a body that is neither (no JSON, parts not
    of their types): the relay reads a stream that ended without ``[DONE]``, a broken one. The body is read whole,
    at most :data:`~gateway.upstream.pool.MAX_RESPONSE_BYTES` (a non-streamed answer's bound), else
    :class:`~gateway.errors.UpstreamError`."""
    raw = await join_bounded(resp.aiter_raw(), "upstream")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return
    if not isinstance(doc, dict) or not sse.well_formed(doc):
        return
    if "error" in doc and not doc.get("choices"):
        yield [Chunk(doc, raw)]
        return
    try:
        chunks = list(answer_chunks(doc))
    except (KeyError, TypeError, AttributeError):  # no choices, or text that is no text: not an answer
        return
    yield chunks


def json_body(resp: UpstreamResponse) -> Any:
    """The JSON document of a non-streamed answer (a synthetic response's dict as it is); raises
    ``orjson.JSONDecodeError`` for a body that is not JSON."""
    if isinstance(resp, SyntheticResponse) and resp.data is not None:
        return resp.data
    return orjson.loads(resp.content)
