"""What the request path reads from an upstream call: :class:`UpstreamResponse`, implemented by
``httpx.Response`` (a real call) and :class:`SyntheticResponse` (an answer the gateway composed itself — budget
forcing — or already read part of — the escalation peek)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from gateway.openai import sse


class UpstreamResponse(Protocol):
    """The part of ``httpx.Response`` the pipeline uses: ``content`` (a non-streamed body), ``aiter_raw()``
    (SSE bytes of a streamed one) and ``aclose()`` (always called; cancels a request still in flight)."""

    @property
    def content(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class SyntheticResponse:
    """An :class:`UpstreamResponse` the gateway produced: ``content`` for a non-streamed answer, or SSE bytes
    from ``head`` (frames already read), then ``payloads`` (JSON chunk payloads, framed here) and ``raw`` (the
    rest of a real response's bytes). Gateway errors raised by ``payloads`` propagate as they are: the relay
    turns :class:`gateway.errors.GatewayError` into one in-stream error event."""

    def __init__(
        self,
        content: bytes = b"",
        payloads: AsyncIterator[bytes] | None = None,
        head: list[bytes] | None = None,
        raw: AsyncIterator[bytes] | None = None,
        closer: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._content = content
        self._payloads = payloads
        self._head = head or []
        self._raw = raw
        self._closer = closer

    @property
    def content(self) -> bytes:
        """The non-streamed body (empty for a streamed answer)."""
        return self._content

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """SSE bytes: the head frames, then the framed payloads, then the raw rest."""
        for frame in self._head:
            yield frame
        if self._payloads is not None:
            async for payload in self._payloads:
                yield sse.event(payload)
        if self._raw is not None:
            async for chunk in self._raw:
                yield chunk

    async def aclose(self) -> None:
        """Close the payload generator (cancelling forced upstream calls) and the wrapped response."""
        aclose = getattr(self._payloads, "aclose", None)
        if aclose is not None:
            await aclose()
        if self._closer is not None:
            await self._closer()
