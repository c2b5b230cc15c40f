"""Server-sent events, the way OpenAI-compatible servers stream: ``data: <json>\\n\\n`` … ``data: [DONE]\\n\\n``.

:class:`SSEDecoder` (the one parser) splits a byte stream into the payloads of its ``data:`` lines (bytes, no
decoding); :func:`data_batches` groups them by network read; :func:`chunk_batches` turns those into
:class:`Chunk` batches — each chunk its parsed dict *and* the bytes it came in, so a relay that passes a chunk on
unchanged frames the upstream's own bytes (``gateway/api/http.py``) instead of encoding the dict again.
No HTTP here: the wire format only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from gateway.errors import GatewayError, UpstreamStreamError
from gateway.openai.usage import reasoning_of


class UpstreamStream(Protocol):
    """Anything with ``aiter_raw()`` yielding SSE bytes (``httpx.Response``, a synthetic response)."""

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

DONE = b"data: [DONE]\n\n"


class Chunk:
    """One streamed event: ``data`` (the chunk dict; None for ``[DONE]``) and ``raw``, its JSON payload — the
    upstream's bytes when it came from one, else ``data`` encoded. A chunk is not changed once made (build a new
    one for a changed dict)."""

    __slots__ = ("data", "raw")

    def __init__(self, data: dict[str, Any] | None, raw: bytes | None = None) -> None:
        self.data = data
        self.raw: bytes = raw if raw is not None else orjson.dumps(data)

    def __repr__(self) -> str:
        return f"Chunk({self.data!r})"


#: the end of a stream that completed (``data: [DONE]`` on the wire)
DONE_CHUNK = Chunk(None, b"[DONE]")


def error_chunk(exc: GatewayError) -> Chunk:
    """An in-stream error in OpenAI's shape (``{"error": {...}}``); the official SDKs raise ``openai.APIError``."""
    raw = exc.to_json()
    return Chunk(orjson.loads(raw), raw)


def frame(batch: list[Chunk]) -> bytes:
    """The SSE bytes of a batch of chunks: ``data: <raw>\\n\\n`` each (``data: [DONE]`` for the end)."""
    if len(batch) == 1:
        return b"data: " + batch[0].raw + b"\n\n"
    return b"".join([b"data: " + c.raw + b"\n\n" for c in batch])


#: The longest ``data:`` line a stream may send (a chunk is a few hundred bytes; a tool call's arguments or a long
#: usage object a few kilobytes).
MAX_LINE_BYTES = 8 * 1024 * 1024


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
        if len(self._buf) > MAX_LINE_BYTES:
            # an event line with no end: it was buffered whole (40 MB in a test; a pod's memory is finite)
            raise UpstreamStreamError(f"an upstream stream line passed {MAX_LINE_BYTES} bytes without ending")
        return out

    def flush(self) -> list[bytes]:
        """The payload of a last ``data:`` line that ended without a newline, if any."""
        rest, self._buf = self._buf, b""
        return [rest[5:].strip()] if rest.startswith(b"data:") else []


def chunk_of(payload: bytes) -> dict[str, Any] | None:
    """The JSON object one ``data:`` payload carries; None for ``[DONE]``, invalid JSON, a non-object or a chunk
    not shaped like one (:func:`well_formed`) — an upstream's stray keep-alive or a proxy's garbage is skipped,
    never fatal (``"choices": "abc"`` crashed the relay mid-stream and was metered as the client's disconnect)."""
    if payload == b"[DONE]":
        return None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and well_formed(obj) else None


def well_formed(chunk: dict[str, Any]) -> bool:
    """Whether the parts of a chunk or answer that the gateway reads have their types: ``choices`` a list of
    objects, each one's ``delta`` / ``message`` (when present) an object."""
    choices = chunk.get("choices")
    if choices is None:
        return True
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            return False
        for part in ("delta", "message"):
            if c.get(part) is not None and not isinstance(c[part], dict):
                return False
    return True


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


def chunks_of(batch: list[bytes]) -> list[Chunk]:
    """The chunks of a batch of ``data:`` payloads: ``[DONE]`` as :data:`DONE_CHUNK`, each JSON object with its
    payload bytes; invalid JSON and non-objects are skipped (:func:`chunk_of`)."""
    out: list[Chunk] = []
    for payload in batch:
        if payload == b"[DONE]":
            out.append(DONE_CHUNK)
        elif (data := chunk_of(payload)) is not None:
            out.append(Chunk(data, payload))
    return out


async def chunk_batches(resp: UpstreamStream) -> AsyncIterator[list[Chunk]]:
    """Yield, per network read of ``resp``, the :class:`Chunk` s it completed (:func:`data_batches`,
    :func:`chunks_of`); a read that completed none yields nothing."""
    decoder = SSEDecoder()  # data_batches inlined: one generator less per network read on the hot path
    async for raw in resp.aiter_raw():
        batch = decoder.feed(raw)
        if batch and (chunks := chunks_of(batch)):
            yield chunks
    if (tail := decoder.flush()) and (chunks := chunks_of(tail)):
        yield chunks


def _tool_arguments(delta: dict[str, Any]) -> bool:
    """Whether a chat delta carries tool-call text (a name or a piece of the arguments)."""
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return False
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and (fn.get("arguments") or fn.get("name")):
            return True
    return False


@dataclass(slots=True)
class StreamTally:
    """The relay's view of an upstream stream of chat or completion chunks.

    :meth:`feed` returns the chunks to pass on for one batch and records: the usage-only chunk
    (held back in ``usage_chunk``), ``[DONE]`` (``done``; the relay writes its own), an in-stream
    ``{"error": …}`` (``upstream_error``, passed on, nothing after it), reasoning text per choice index
    (for counting when usage lacks it), and delta counts (≈ tokens on vLLM, for an estimate when usage
    never comes; tool-call deltas count as text). ``saw_text`` turns true with the first reasoning, content or
    tool-call delta (time to first token).
    """

    reasoning: dict[int, list[str]] = field(default_factory=dict)
    reasoning_deltas: int = 0
    text_deltas: int = 0
    usage_chunk: dict[str, Any] | None = None
    last_usage: dict[str, Any] | None = None
    done: bool = False
    upstream_error: bool = False
    saw_text: bool = False

    def feed(self, batch: list[Chunk]) -> list[Chunk]:
        """The chunks of ``batch`` to pass on (the usage-only chunk and ``[DONE]`` held back)."""
        out: list[Chunk] = []
        for item in batch:
            chunk = item.data
            if chunk is None:
                self.done = True
                break
            choices = chunk.get("choices")
            if "error" in chunk and not choices:
                self.upstream_error = True
                out.append(item)
                break
            usage = chunk.get("usage")
            if usage and not choices:
                self.usage_chunk = chunk
                continue
            if usage:  # continuous usage stats: each chunk carries the running totals
                self.last_usage = usage
            if choices:
                self._count(choices)
            out.append(item)
        return out

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
                # an index that is no integer ("x", 1.5) is the upstream's mistake, relayed as it came: its text is
                # kept under choice 0 — int() raised here, mid-stream, and the call was metered as the client's
                # disconnect
                index = c.get("index")
                self.reasoning.setdefault(index if type(index) is int else 0, []).append(r)
                self.reasoning_deltas += 1
                self.saw_text = True
            if delta.get("content") or _tool_arguments(delta):  # a tool call's arguments are output tokens too
                self.text_deltas += 1
                self.saw_text = True

    def counted(self) -> tuple[int, int]:
        """(completion, reasoning) tokens of the deltas read, one token a delta (≈ vLLM's): what a stream with no usage
        to trust is billed as generated — by the relay, the escalation's peek and a forced call failed in its thought
        phase alike."""
        return self.reasoning_deltas + self.text_deltas, self.reasoning_deltas

    def reasoning_texts(self) -> list[str]:
        """The reasoning text of each choice that had any."""
        return [t for parts in self.reasoning.values() if (t := "".join(parts))]
