"""HTTP client for the tiers' upstreams (vLLM's OpenAI-compatible server or any OpenAI-compatible API).

Pooled ``httpx.AsyncClient`` instances per distinct ``base_url`` — :data:`POOL_SHARDS` of them, used in turn, because
httpcore's pool does bookkeeping over all its connections on every request (``_assign_requests_to_connections``,
a ``poll()`` per idle socket; encode/httpcore #928/#929): at 32 concurrent requests one shared pool cost ~20%
more gateway CPU per request than eight smaller ones (bench/gateway_overhead.py). No client is ever created
per request. Each call uses the tier's connect/read timeouts.
Retries (``tier.max_retries``, exponential backoff with jitter) happen only before the response is handed to
the caller, i.e. before any byte reached the client, and only when repeating is safe:

- connection errors (refused, reset, connect timeout, a pooled connection the server had closed), and
- HTTP 502/503 from the upstream.

Errors raised (all :class:`gateway.errors.GatewayError`):

- :class:`UpstreamUnavailable` (502): no connection after the retries, or still 502/503 — the proxy may
  fall back to another tier;
- :class:`UpstreamTimeout` (504): connect or read timeout (a read timeout is not retried: the upstream may
  still be generating and a retry would pay twice);
- :class:`UpstreamError` (502): other 5xx or an unusable answer;
- :class:`UpstreamRejected` (400/429): the upstream refused the request itself (4xx).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import httpx
import orjson

from gateway.config import TierConfig
from gateway.errors import (
    GatewayError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)

log = logging.getLogger("thinkgate.upstream")

#: The upstream path of each generation endpoint the gateway serves.
ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
# httpx logs every request it sends at INFO ("HTTP Request: POST … 200 OK"): with the gateway's usage line that
# is a second log line per request on the hot path, saying less. Quieted unless someone configured it.
_httpx_log = logging.getLogger("httpx")

RETRY_STATUSES = frozenset({502, 503})
BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 1.0
TOKENIZE_TIMEOUT_S = 5.0
# Per shard; connections are reused (keep-alive) across requests.
POOL_LIMITS = httpx.Limits(max_connections=128, max_keepalive_connections=32, keepalive_expiry=30.0)
POOL_SHARDS = 8




def root_url(base_url: str) -> str:
    """``http://h:p/v1`` → ``http://h:p`` (vLLM serves /health and /tokenize at the root)."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _upstream_message(resp: httpx.Response) -> str:
    try:
        data = orjson.loads(resp.content)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(data, dict) and data.get("message"):
            return str(data["message"])
    except orjson.JSONDecodeError:
        pass
    return resp.text[:300] or resp.reason_phrase


def error_for_status(tier: TierConfig, resp: httpx.Response) -> GatewayError:
    """Map a non-2xx upstream response to the gateway error the client should see."""
    msg = f"upstream of tier {tier.name!r} answered {resp.status_code}: {_upstream_message(resp)}"
    if resp.status_code in RETRY_STATUSES:
        return UpstreamUnavailable(msg)
    if resp.status_code in (401, 403):
        # The gateway's credentials for the upstream are wrong: the client cannot fix that.
        return UpstreamError(msg, code="upstream_auth_failed")
    if 400 <= resp.status_code < 500:
        return UpstreamRejected(msg, status=resp.status_code)
    return UpstreamError(msg)


class UpstreamPool:
    """Pooled clients for every upstream in ``tiers``; close with :meth:`aclose`."""

    def __init__(self, tiers: list[TierConfig]) -> None:
        if _httpx_log.level == logging.NOTSET:
            _httpx_log.setLevel(logging.WARNING)
        self._clients: dict[str, list[httpx.AsyncClient]] = {}
        self._turn = 0
        self._timeouts: dict[str, httpx.Timeout] = {}
        self._headers: dict[str, dict[str, str]] = {}
        # Per tier, built once: the request headers (the clients' defaults merged with ours, as
        # ``build_request`` would) and the timeout extension; per (tier, path) the absolute URL. Each request
        # then skips httpx's URL parsing and header merging (~2 URL parses per call otherwise).
        self._request_headers: dict[str, httpx.Headers] = {}
        self._extensions: dict[str, dict[str, Any]] = {}
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        for t in tiers:
            client = self._client_for(t.base_url)
            self._timeouts[t.name] = httpx.Timeout(
                connect=t.connect_timeout_s, read=t.read_timeout_s, write=t.read_timeout_s, pool=t.connect_timeout_s
            )
            h = {"content-type": "application/json"}
            if t.api_key:
                h["authorization"] = f"Bearer {t.api_key}"
            self._headers[t.name] = h
            merged = httpx.Headers(client.headers)
            merged.update(h)
            self._request_headers[t.name] = merged
            self._extensions[t.name] = {"timeout": self._timeouts[t.name].as_dict()}

    def _client_for(self, base_url: str) -> httpx.AsyncClient:
        key = base_url.rstrip("/")
        shards = self._clients.get(key)
        if shards is None:
            shards = [httpx.AsyncClient(base_url=key, limits=POOL_LIMITS, trust_env=False) for _ in range(POOL_SHARDS)]
            self._clients[key] = shards
        self._turn += 1
        return shards[self._turn % len(shards)]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for s in self._clients.values() for c in s), return_exceptions=True)

    async def open(self, tier: TierConfig, path: str, body: bytes, *, stream: bool) -> httpx.Response:
        """POST ``body`` to ``tier.base_url + path`` and return the 2xx response, headers read.

        With ``stream=True`` the body is not read yet: the caller iterates it and must ``aclose()`` it.
        With ``stream=False`` the whole body has been read (``resp.content``).
        Retries connection errors and 502/503 with backoff; raises the errors listed in the module doc.
        """
        client = self._client_for(tier.base_url)
        url = self._urls.get((tier.base_url, path))
        if url is None:
            url = self._urls[(tier.base_url, path)] = httpx.URL(tier.base_url.rstrip("/") + path)
        headers = self._request_headers.get(tier.name)
        extensions = self._extensions.get(tier.name)
        last: GatewayError | None = None
        for attempt in range(tier.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (attempt - 1)) * (0.5 + random.random()))
            if headers is not None and extensions is not None:
                request = httpx.Request("POST", url, content=body, headers=headers, extensions=extensions)
            else:  # a tier this pool was not built with
                timeout = httpx.Timeout(tier.read_timeout_s, connect=tier.connect_timeout_s)
                h = self._headers.get(tier.name) or {"content-type": "application/json"}
                request = client.build_request("POST", url, content=body, headers=h, timeout=timeout)
            try:
                resp = await client.send(request, stream=stream)
            except httpx.ConnectTimeout:
                last = UpstreamConnectTimeout(f"upstream of tier {tier.name!r} did not accept a connection in time")
                continue
            except httpx.TimeoutException:
                raise UpstreamTimeout(
                    f"upstream of tier {tier.name!r} did not answer within {tier.read_timeout_s} s"
                ) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                last = UpstreamUnavailable(f"upstream of tier {tier.name!r} unreachable: {type(exc).__name__}: {exc}")
                continue
            except httpx.HTTPError as exc:
                raise UpstreamError(f"upstream of tier {tier.name!r} failed: {type(exc).__name__}: {exc}") from None
            if resp.is_success:
                return resp
            if stream:
                try:
                    await resp.aread()
                except httpx.HTTPError:
                    pass
                finally:
                    await resp.aclose()
            last = error_for_status(tier, resp)
            if resp.status_code not in RETRY_STATUSES:
                raise last
            log.info("upstream %s answered %s (attempt %d)", tier.name, resp.status_code, attempt + 1)
        assert last is not None
        raise last

    async def count_tokens(self, tier: TierConfig, text: str) -> int | None:
        """Exact token count of ``text`` for ``tier.model`` from vLLM's ``POST /tokenize``; None on failure.

        Request ``{"model", "prompt", "add_special_tokens": false}`` → response ``{"count", "tokens", ...}``
        (vLLM OpenAI server, ``vllm/entrypoints/openai/api_server.py``).
        """
        client = self._client_for(tier.base_url)
        payload = orjson.dumps({"model": tier.model, "prompt": text, "add_special_tokens": False})
        try:
            resp = await client.post(
                root_url(tier.base_url) + "/tokenize",
                content=payload,
                headers=self._headers.get(tier.name),
                timeout=httpx.Timeout(TOKENIZE_TIMEOUT_S, connect=tier.connect_timeout_s),
            )
            if resp.is_success:
                count = orjson.loads(resp.content).get("count")
                if isinstance(count, int):
                    return count
        except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError):
            pass
        return None

    async def count_chat_tokens(self, tier: TierConfig, messages: list[dict[str, Any]],
                                tools: list[dict[str, Any]] | None = None) -> int | None:
        """Prompt tokens of a chat request (``messages``, ``tools``) rendered by ``tier``'s chat template, from
        vLLM's ``POST /tokenize`` (``{"model", "messages", "tools"}`` → ``{"count", …}``); None on failure."""
        client = self._client_for(tier.base_url)
        doc: dict[str, Any] = {"model": tier.model, "messages": messages}
        if tools:
            doc["tools"] = tools
        try:
            resp = await client.post(
                root_url(tier.base_url) + "/tokenize",
                content=orjson.dumps(doc),
                headers=self._headers.get(tier.name),
                timeout=httpx.Timeout(TOKENIZE_TIMEOUT_S, connect=tier.connect_timeout_s),
            )
            if resp.is_success:
                count = orjson.loads(resp.content).get("count")
                if isinstance(count, int):
                    return count
        except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError):
            pass
        return None

    async def ready(self, tier: TierConfig, timeout_s: float = 2.0) -> bool:
        """True when the tier's upstream answers: ``GET /health`` (vLLM), else ``GET /v1/models`` < 500."""
        client = self._client_for(tier.base_url)
        t = httpx.Timeout(timeout_s)
        headers = self._headers.get(tier.name)
        try:
            resp = await client.get(root_url(tier.base_url) + "/health", timeout=t, headers=headers)
            if resp.is_success:
                return True
            if resp.status_code == 404:
                resp = await client.get("/models", timeout=t, headers=headers)
                return resp.status_code < 500
        except httpx.HTTPError:
            return False
        return False
