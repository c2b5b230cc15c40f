"""One request of a load loop: the benches' way to POST a JSON body and read the whole answer."""

from __future__ import annotations

from collections.abc import Mapping

import httpx


async def send(client: httpx.AsyncClient, url: str, body: bytes, headers: Mapping[str, str],
               stream: bool) -> httpx.Response:
    """POST ``body`` to ``url``; with ``stream``, read the SSE body to its end (latency = last byte). The
    response (headers and status still readable). Raises ``httpx.HTTPError`` as httpx does."""
    if stream:
        async with client.stream("POST", url, content=body, headers=headers) as r:
            async for _ in r.aiter_raw():
                pass
        return r
    return await client.post(url, content=body, headers=headers)
