"""HTTP client for the tiers' upstreams (vLLM's OpenAI-compatible server or any OpenAI-compatible API).

One ``aiohttp.ClientSession`` (one connection pool, keep-alive) per pool, created on first use inside the event
loop; no client is ever created per request. aiohttp rather than httpx: on this request path httpx + httpcore
cost ~0.6 ms of CPU per request more than aiohttp for the same forward (``bench/gateway_overhead.py --floors
floor floor-aiohttp``; httpcore's pool also does bookkeeping over all its connections on every request, which the
old code worked around with eight client shards). Each call uses the tier's connect/read timeouts.
Retries (``tier.max_retries``, exponential backoff with jitter) happen only before the response is handed to
the caller, i.e. before any byte reached the client, and only when repeating is safe:

- connection errors (refused, reset, connect timeout, a pooled connection the server had closed) before a 2xx
  answer — a non-streamed 2xx whose body then breaks is an :class:`UpstreamError` (the generation ran: vLLM sends
  that 200 once it is done; a retry or a fallback would pay for it twice), and
- HTTP 502/503 from the upstream — but a 503 whose ``Retry-After`` / ``retry-after-ms`` asks for more than the
  longest backoff (:data:`BACKOFF_MAX_S`) is not sent to the same replica again in this call (a shorter wait is
  waited out before the retry): LiteLLM and OpenAI's SDK also wait what the upstream asks; a gateway that held the
  client that long, under the client's own retries, would only multiply the load on an upstream that said it has
  too much.

Errors raised (all :class:`gateway.errors.GatewayError`):

- :class:`UpstreamUnavailable` (502): no connection after the retries, or still 502/503 — the proxy may
  fall back to another tier;
- :class:`UpstreamTimeout` (504): connect or read timeout (:func:`read_timeout`; not retried: the upstream may
  still be generating and a retry would pay twice);
- :class:`UpstreamError` (502): other 5xx or an unusable answer;
- :class:`UpstreamRejected` (400/429): the upstream refused the request itself (4xx).

An upstream's 429 or 503 that says when to come back (``Retry-After``, OpenAI's ``retry-after-ms``) passes that on
in the error's headers (:func:`retry_after_headers`), so the client's SDK waits as the upstream asked. Each error
carries the headers of its own answer: after retries and fallbacks the client gets those of the failure it sees
(the last), never an earlier attempt's.

A streamed :class:`AioResponse` raises the same errors from ``aiter_raw()`` when the upstream stalls
(:class:`UpstreamTimeout`) or breaks the stream (:class:`UpstreamError`) mid-body.

A tier with several ``base_urls`` is a pool (:mod:`gateway.upstream.balancer`): each attempt asks the balancer
for a replica (least outstanding, conversation affinity, ejected replicas skipped), a retry goes to a replica
not tried yet when there is one (without the backoff: it is a fresh upstream), and each call's outcome feeds
the replica's passive ejection. One URL: the same single upstream as before.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
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
from gateway.observability.telemetry import traceparent
from gateway.openai.usage import estimate_tokens
from gateway.upstream.balancer import Balancer, Replica, TierPool, current_affinity, label_url

log = logging.getLogger("thinkgate.upstream")

#: The upstream path of each generation endpoint the gateway serves.
ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}

RETRY_STATUSES = frozenset({502, 503})
#: The upstream statuses whose ``Retry-After`` / ``retry-after-ms`` reach the client (RFC 9110 gives the header
#: its meaning on these two; OpenAI's SDK reads it on any status it retries).
RETRY_AFTER_STATUSES = frozenset({429, 503})
#: The longest wait passed on, seconds: a day covers a provider's daily quota; more (a date years ahead) is an
#: upstream's bug, not a wait to hold a client to.
RETRY_AFTER_MAX_S = 86_400
BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 1.0
TOKENIZE_TIMEOUT_S = 5.0
#: Connections in the pool (all upstreams together) and how long an idle one is kept (s).
POOL_CONNECTIONS = 1024
KEEPALIVE_S = 30.0
# A pooled connection the server closed, a reset, a refused connect: safe to repeat (nothing was answered).
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError,
)


def root_url(base_url: str) -> str:
    """``http://h:p/v1`` → ``http://h:p`` (vLLM serves /health and /tokenize at the root)."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _upstream_message(body: bytes, reason: str | None) -> str:
    try:
        data = orjson.loads(body)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(data, dict) and data.get("message"):
            return str(data["message"])
    except orjson.JSONDecodeError:
        pass
    return body[:300].decode("utf-8", "replace") or (reason or "")


def error_for_status(tier: TierConfig, status: int, body: bytes, reason: str | None = None,
                     headers: Mapping[str, str] | None = None) -> GatewayError:
    """Map a non-2xx upstream answer (status, body, response ``headers``) to the gateway error the client should
    see; a 429's or 503's wait (:func:`retry_after_headers`) goes into the error's headers."""
    msg = f"upstream of tier {tier.name!r} answered {status}: {_upstream_message(body, reason)}"
    wait = retry_after_headers(headers) if headers is not None and status in RETRY_AFTER_STATUSES else {}
    if status in RETRY_STATUSES:
        return UpstreamUnavailable(msg, headers=wait)
    if status in (401, 403):
        # The gateway's credentials for the upstream are wrong: the client cannot fix that.
        return UpstreamError(msg, code="upstream_auth_failed")
    if 400 <= status < 500:
        return UpstreamRejected(msg, status=status, param=_upstream_param(body), headers=wait)
    return UpstreamError(msg)


def retry_after_headers(headers: Mapping[str, str], now: float | None = None) -> dict[str, str]:
    """An upstream answer's ``retry-after`` and ``retry-after-ms`` as the gateway sends them on: whole seconds
    (rounded up: waiting less than asked meets the same refusal) and whole milliseconds, each capped at
    :data:`RETRY_AFTER_MAX_S`. An HTTP-date becomes the seconds from ``now`` (default: the clock) until it, 0 once
    past — one form for every client, and no upstream text copied into the gateway's headers. A value that is
    neither (negative, not a number, not a date) is dropped: no header beats a wrong one."""
    out: dict[str, str] = {}
    if (secs := _retry_after_s(headers.get("retry-after"), time.time() if now is None else now)) is not None:
        out["retry-after"] = str(secs)
    if (ms := _bounded_ceil(headers.get("retry-after-ms"), RETRY_AFTER_MAX_S * 1000)) is not None:
        out["retry-after-ms"] = str(ms)
    return out


def asked_wait_s(headers: Mapping[str, str] | None) -> float | None:
    """The wait an error's headers ask for (:func:`retry_after_headers`' ``retry-after-ms``, else ``retry-after``),
    in seconds; None when they ask for none."""
    if not headers:
        return None
    if (ms := headers.get("retry-after-ms")) is not None:
        return int(ms) / 1000
    if (secs := headers.get("retry-after")) is not None:
        return float(secs)
    return None


def _bounded_ceil(value: str | None, cap: int) -> int | None:
    """``value`` as a number rounded up to an integer in [0, ``cap``]; None when absent, not a finite number or
    negative."""
    try:
        number = float(value) if value is not None else math.nan
    except ValueError:
        return None
    if not math.isfinite(number) or number < 0:
        return None
    return min(cap, math.ceil(number))


def _retry_after_s(value: str | None, now: float) -> int | None:
    """A ``Retry-After`` (delay-seconds or an HTTP-date, RFC 9110 §10.2.3) as seconds from ``now``; None when it is
    neither."""
    if value is None:
        return None
    if (secs := _bounded_ceil(value, RETRY_AFTER_MAX_S)) is not None:
        return secs
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000" (no zone said): HTTP-dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(0, min(RETRY_AFTER_MAX_S, math.ceil(when.timestamp() - now)))


def _upstream_param(body: bytes) -> str | None:
    """The field an upstream's 4xx names (OpenAI's and vLLM's ``error.param``), so the client's SDK sees it."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    return param if isinstance(param, str) and param else None


class AioResponse:
    """A 2xx upstream answer (:class:`gateway.upstream.response.UpstreamResponse`): ``status_code``, ``headers``,
    ``content`` (the body of a non-streamed call, read before it was returned), ``aiter_raw()`` (the bytes of a
    streamed one as they arrive) and ``aclose()`` (always call it: returns the connection to the pool when the
    body was read to its end, else closes it, which cancels a generation still running upstream)."""

    def __init__(self, resp: aiohttp.ClientResponse, tier: TierConfig, content: bytes = b"",
                 on_close: Callable[[bool | None], None] | None = None) -> None:
        self._resp = resp
        self._tier = tier
        self._content = content
        self.status_code = resp.status
        self.headers = resp.headers
        #: called once by aclose(): True (read to its end), False (broke mid-body), None (closed early)
        self._on_close = on_close
        self._broken = False

    @property
    def content(self) -> bytes:
        return self._content

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes in the chunks they arrived in. Raises UpstreamTimeout (no byte within the tier's read
        timeout) or UpstreamError (the connection broke) mid-stream."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ServerTimeoutError):
            self._broken = True
            raise UpstreamTimeout(f"upstream of tier {self._tier.name!r} stalled mid-stream") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            self._broken = True
            log.warning("upstream %s broke a stream: %s: %s", self._tier.name, type(exc).__name__, exc)
            raise UpstreamError(f"{type(exc).__name__}") from None  # the detail may name an internal address

    async def aclose(self) -> None:
        done = self._resp.content.at_eof()
        if done:
            self._resp.release()
        else:
            self._resp.close()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close(False if self._broken else True if done else None)


def read_timeout(tier: TierConfig, stream: bool) -> float:
    """Seconds the upstream may stay silent: between a stream's chunks (and before its head) ``read_timeout_s``;
    for a non-streamed answer, which comes whole at the end of the generation, ``response_timeout_s``."""
    return tier.read_timeout_s if stream else tier.response_timeout_s


def longest_opening(tier: TierConfig) -> float:
    """Seconds the opening of one streamed call on ``tier`` may last before the upstream's own timeouts end it: each
    attempt's connect and wait for the response head (``connect_timeout_s`` + ``read_timeout_s``), and the backoff
    before each retry (at most 1.5 × ``BACKOFF_MAX_S``: the pool's jitter is 0.5–1.5 × the capped backoff)."""
    return (tier.max_retries + 1) * (tier.connect_timeout_s + tier.read_timeout_s) + \
        tier.max_retries * 1.5 * BACKOFF_MAX_S


class UpstreamPool:
    """Pooled connections for every upstream in ``tiers``; close with :meth:`aclose`."""

    def __init__(self, tiers: list[TierConfig]) -> None:
        self._session: aiohttp.ClientSession | None = None
        #: the replicas of every tier (one per tier without ``base_urls``)
        self.balancer = Balancer(tiers, self._probe)
        self._headers: dict[str, dict[str, str]] = {}
        self._timeouts: dict[tuple[str, bool], aiohttp.ClientTimeout] = {}
        self._urls: dict[tuple[str, str], str] = {}
        self._tiers = list(tiers)
        for t in tiers:
            self._headers[t.name] = self._headers_for(t)
            for stream in (True, False):
                self._timeouts[t.name, stream] = self._timeout_for(t, stream)

    @staticmethod
    def _headers_for(t: TierConfig) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if t.api_key:
            h["authorization"] = f"Bearer {t.api_key}"
        return h

    @staticmethod
    def _timeout_for(t: TierConfig, stream: bool) -> aiohttp.ClientTimeout:
        # sock_read: the longest wait for the next bytes (httpx's read timeout); no total cap (long generations).
        # A non-streamed answer sends nothing until the generation is done (vLLM): it gets response_timeout_s.
        return aiohttp.ClientTimeout(total=None, connect=t.connect_timeout_s, sock_connect=t.connect_timeout_s,
                                     sock_read=read_timeout(t, stream))

    @property
    def session(self) -> aiohttp.ClientSession:
        """The shared session, created on first use (it binds to the running event loop)."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=POOL_CONNECTIONS, limit_per_host=0, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=True,
                                                  timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    def start(self) -> None:
        """Start the pools' active health checks (inside the event loop; also done by the first call)."""
        self.balancer.start()

    async def aclose(self) -> None:
        await self.balancer.aclose()
        if self._session is not None:
            await self._session.close()

    def _url(self, base_url: str, path: str) -> str:
        url = self._urls.get((base_url, path))
        if url is None:
            url = self._urls[(base_url, path)] = base_url.rstrip("/") + path
        return url

    def pool(self, tier: TierConfig) -> TierPool:
        """The replicas of ``tier`` (:class:`gateway.upstream.balancer.TierPool`)."""
        return self.balancer.tier(tier)

    async def open(self, tier: TierConfig, path: str, body: bytes, *, stream: bool,
                   affinity: bytes | None = None) -> AioResponse:
        """POST ``body`` to ``base_url + path`` of one of the tier's replicas and return the 2xx response, headers
        read. ``affinity``: the conversation's key (default: :func:`gateway.upstream.balancer.current_affinity`).

        With ``stream=True`` the body is not read yet: the caller iterates it and must ``aclose()`` it.
        With ``stream=False`` the whole body has been read (``resp.content``).
        Retries connection errors and 502/503 with backoff; raises the errors listed in the module doc.
        """
        headers = self._headers.get(tier.name) or self._headers_for(tier)
        if (parent := traceparent()) is not None:  # telemetry on: W3C trace context to the upstream
            headers = {**headers, "traceparent": parent}
        timeout = self._timeouts.get((tier.name, stream)) or self._timeout_for(tier, stream)
        session = self.session
        if not self.balancer.started:
            self.balancer.start()
        pool = self.balancer.tier(tier)
        key = affinity if affinity is not None else current_affinity()
        tried: list[Replica] = []
        asked: dict[str, float] = {}  # replica URL → the wait its 503 asked for (Retry-After), seconds
        last: GatewayError | None = None
        for attempt in range(tier.max_retries + 1):
            replica = pool.pick(key, tried)
            if attempt and replica in tried:  # the same upstream again: give it time
                wait = asked.get(replica.url, 0.0)
                if wait > BACKOFF_MAX_S:
                    # it said when to come back, and that is not within this call: asking again sooner would meet
                    # the same refusal and add load where there is too much (the client's error carries the wait;
                    # the proxy may still fall back to another tier)
                    break
                backoff = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (attempt - 1)) * (0.5 + random.random())
                await asyncio.sleep(max(backoff, wait))
            tried.append(replica)
            got = await self._attempt(session, pool, replica, tier, path, body, headers, timeout, stream, attempt)
            if isinstance(got, AioResponse):
                return got
            last = got
            if (wait_s := asked_wait_s(got.headers)) is not None:
                asked[replica.url] = wait_s
        assert last is not None
        raise last

    async def _attempt(self, session: aiohttp.ClientSession, pool: TierPool, replica: Replica, tier: TierConfig,
                       path: str, body: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout,
                       stream: bool, attempt: int) -> AioResponse | GatewayError:
        """One POST to ``replica`` (:meth:`open`'s loop): the 2xx response, or the error worth a retry
        (connection refused or timed out, 502/503); raises the errors that end the call."""
        url = self._url(replica.url, path)
        resp: aiohttp.ClientResponse | None = None
        ok: bool | None = False  # the call's outcome for the replica (None: cancelled, no verdict)
        owned = True  # this attempt ends the replica's call (a returned stream ends it when closed)
        answered = False  # a 2xx's body is being read: the generation ran, and repeating it would pay twice
        try:
            # no redirects: an upstream's 3xx would send the prompt (and the tier's key, to the same origin) to
            # wherever it points; a 3xx is an upstream error
            resp = await session.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
            if 200 <= resp.status < 300:
                if stream:
                    owned = False
                    return AioResponse(resp, tier, on_close=functools.partial(pool.end, replica))
                answered = True
                content = await _read_bounded(resp, tier)
                resp.release()
                ok = True
                return AioResponse(resp, tier, content)
            err_body = await resp.read()
            resp.release()
            ok = resp.status < 500
        except aiohttp.ConnectionTimeoutError:
            return UpstreamConnectTimeout(f"upstream of tier {tier.name!r} did not accept a connection in time")
        except (TimeoutError, aiohttp.ServerTimeoutError):
            if resp is not None:
                resp.close()
            raise UpstreamTimeout(
                f"upstream of tier {tier.name!r} did not answer within {read_timeout(tier, stream)} s"
            ) from None
        except _CONNECTION_ERRORS as exc:
            if resp is not None:
                resp.close()
            # the client's message names the tier and the kind of failure; the log has the detail, whose address
            # (host and port of an internal replica) is not the client's business
            log.warning("upstream %s (%s): %s: %s (attempt %d)", tier.name, label_url(url), type(exc).__name__, exc,
                        attempt + 1)
            if answered:  # vLLM answers a non-streamed 200 once the generation is done: not retried, no fallback
                raise UpstreamError(f"upstream of tier {tier.name!r} answered {resp.status if resp else 200} and "
                                    f"broke its body ({type(exc).__name__})") from None
            return UpstreamUnavailable(f"upstream of tier {tier.name!r} unreachable ({type(exc).__name__})")
        except aiohttp.ClientError as exc:
            if resp is not None:
                resp.close()
            log.warning("upstream %s (%s): %s: %s (attempt %d)", tier.name, label_url(url), type(exc).__name__, exc,
                        attempt + 1)
            raise UpstreamError(f"upstream of tier {tier.name!r} failed ({type(exc).__name__})") from None
        except BaseException:  # cancelled (the client went away): do not leave the connection half-read
            ok = None
            if resp is not None:
                resp.close()
            raise
        finally:
            if owned:
                pool.end(replica, ok)
        err = error_for_status(tier, resp.status, err_body, resp.reason, resp.headers)
        if resp.status not in RETRY_STATUSES:
            raise err
        log.info("upstream %s (%s) answered %s (attempt %d)", tier.name, label_url(url), resp.status, attempt + 1)
        return err

    async def _get_or_post(self, method: str, url: str, tier: TierConfig | None, timeout: aiohttp.ClientTimeout,
                           payload: bytes | None = None) -> tuple[int, bytes]:
        headers = self._headers.get(tier.name) if tier is not None else None
        async with self.session.request(method, url, data=payload, headers=headers, timeout=timeout,
                                        allow_redirects=False) as resp:
            return resp.status, await resp.read()

    async def _tokenize(self, tier: TierConfig, doc: dict[str, Any]) -> int | None:
        timeout = aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S, sock_connect=tier.connect_timeout_s)
        try:
            base = self.balancer.tier(tier).peek().url
            status, body = await self._get_or_post("POST", root_url(base) + "/tokenize", tier, timeout,
                                                   orjson.dumps(doc))
            if 200 <= status < 300:
                count = orjson.loads(body).get("count")
                if isinstance(count, int):
                    return count
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError, AttributeError):
            pass
        return None

    async def count_tokens(self, tier: TierConfig, text: str) -> int | None:
        """Exact token count of ``text`` for ``tier.model`` from vLLM's ``POST /tokenize``; None on failure.

        Request ``{"model", "prompt", "add_special_tokens": false}`` → response ``{"count", "tokens", ...}``
        (vLLM OpenAI server, ``vllm/entrypoints/openai/api_server.py``).
        """
        return await self._tokenize(tier, {"model": tier.model, "prompt": text, "add_special_tokens": False})

    async def tokens(self, tier: TierConfig, text: str) -> int:
        """Tokens of ``text`` for ``tier.model``: exact (:meth:`count_tokens`), else estimated
        (:func:`gateway.openai.usage.estimate_tokens`, ~4 characters a token)."""
        counted = await self.count_tokens(tier, text)
        return counted if counted is not None else estimate_tokens(text)

    async def count_chat_tokens(self, tier: TierConfig, messages: list[dict[str, Any]],
                                tools: list[dict[str, Any]] | None = None) -> int | None:
        """Prompt tokens of a chat request (``messages``, ``tools``) rendered by ``tier``'s chat template, from
        vLLM's ``POST /tokenize`` (``{"model", "messages", "tools"}`` → ``{"count", …}``); None on failure."""
        doc: dict[str, Any] = {"model": tier.model, "messages": messages}
        if tools:
            doc["tools"] = tools
        return await self._tokenize(tier, doc)

    async def ready(self, tier: TierConfig, timeout_s: float = 2.0) -> bool:
        """True when the tier's upstream answers (a pool: any of its replicas): ``GET /health`` (vLLM), else
        ``GET /v1/models`` < 500."""
        urls = tier.upstream_urls
        if len(urls) == 1:
            return await self._answers(tier, urls[0], timeout_s)
        return any(await asyncio.gather(*(self._answers(tier, u, timeout_s) for u in urls)))

    async def _answers(self, tier: TierConfig | None, base_url: str, timeout_s: float) -> bool:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            status, _ = await self._get_or_post("GET", root_url(base_url) + "/health", tier, timeout)
            if 200 <= status < 300:
                return True
            if status == 404:
                status, _ = await self._get_or_post("GET", base_url.rstrip("/") + "/models", tier, timeout)
                return status < 500
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
        return False

    async def _probe(self, replica: Replica, timeout_s: float) -> bool:
        """The balancer's health check of one replica (with the credentials of the first tier that lists it)."""
        tier = next((t for t in self._tiers if replica.url in t.upstream_urls), None)
        return await self._answers(tier, replica.url, timeout_s)


#: The largest non-streamed answer an upstream may send (decompressed): a chat completion is kilobytes; an
#: embeddings batch a few megabytes. A 300 MB answer, or a 306 KB gzip body that inflates to it, took the gateway to
#: 1 GB of memory (a pod's limit in the shipped chart is 512 MiB).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024


async def _read_bounded(resp: aiohttp.ClientResponse, tier: TierConfig) -> bytes:
    """The whole body of a 2xx answer, at most :data:`MAX_RESPONSE_BYTES` after decompression; beyond it,
    :class:`UpstreamError` (502). A plain body whose declared length fits is read in one call."""
    if resp.content_length is not None and resp.content_length <= MAX_RESPONSE_BYTES and \
            not resp.headers.get("content-encoding"):
        return await resp.read()
    return await join_bounded(resp.content.iter_chunked(1 << 16), f"upstream of tier {tier.name!r}")


async def join_bounded(pieces: AsyncIterator[bytes], who: str) -> bytes:
    """The bytes of ``pieces`` (a body as it arrives) joined, at most :data:`MAX_RESPONSE_BYTES`; past it,
    :class:`UpstreamError` (502) saying ``who`` sent an answer larger than that — read no further. Errors of
    ``pieces`` itself pass through."""
    parts: list[bytes] = []
    size = 0
    async for piece in pieces:
        size += len(piece)
        if size > MAX_RESPONSE_BYTES:
            raise UpstreamError(f"{who} sent an answer larger than {MAX_RESPONSE_BYTES} bytes")
        parts.append(piece)
    return b"".join(parts)
