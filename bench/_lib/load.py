"""One request of a load loop: the benches' way to POST a JSON body and read the whole answer.

The load generator runs on the same cores as what it measures, so it must cost little: :class:`AioClient` (aiohttp,
one connection) costs ~0.16 ms of CPU per request on this machine against ~0.7-0.9 ms for an httpx
``AsyncClient`` (measured: 3,000 requests at concurrency 32 on the upstream simulator; direct RPS 6,300-6,600 vs
1,070-1,380) — with httpx the client, not the proxy, was the bottleneck of the proxy benches. httpx stays available
(``make_clients(..., kind="httpx")``) for comparison with earlier runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

CLIENT_KINDS = ("aiohttp", "httpx")


@dataclass(frozen=True)
class Reply:
    """What a load loop reads of a response: the status and the headers."""

    status_code: int
    headers: Mapping[str, str]


class AioClient:
    """One aiohttp session with one keep-alive connection (a load worker's own client). Errors surface as
    ``httpx.TransportError``, as the httpx client's do, so a load loop catches one type."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._session: Any = None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def _open(self) -> Any:
        if self._session is None:  # created inside the running loop
            a = self._aiohttp
            self._session = a.ClientSession(connector=a.TCPConnector(limit=1), timeout=self._timeout,
                                            trust_env=False)
        return self._session

    async def send(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        try:
            async with self._open().post(url, data=body, headers=dict(headers)) as r:
                async for _ in r.content.iter_any():  # the whole body (an SSE stream to its end)
                    pass
                return Reply(r.status, r.headers)
        except (self._aiohttp.ClientError, TimeoutError) as exc:
            raise httpx.TransportError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


Client = httpx.AsyncClient | AioClient


def make_clients(n: int, kind: str = "aiohttp") -> list[Client]:
    """``n`` single-connection clients of ``kind`` (``aiohttp`` | ``httpx``). Raises ValueError otherwise."""
    if kind == "aiohttp":
        return [AioClient() for _ in range(n)]
    if kind == "httpx":
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        return [httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) for _ in range(n)]
    raise ValueError(f"unknown client kind {kind!r} (known: {CLIENT_KINDS})")


async def send(client: Client, url: str, body: bytes, headers: Mapping[str, str],
               stream: bool) -> httpx.Response | Reply:
    """POST ``body`` to ``url``; with ``stream``, read the SSE body to its end (latency = last byte). The
    response (headers and status still readable). Raises ``httpx.HTTPError`` as httpx does."""
    if isinstance(client, AioClient):
        return await client.send(url, body, headers)
    if stream:
        async with client.stream("POST", url, content=body, headers=headers) as r:
            async for _ in r.aiter_raw():
                pass
        return r
    return await client.post(url, content=body, headers=headers)
