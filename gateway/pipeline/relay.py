"""The SSE relay: pass an upstream stream to the client, hold back and complete its usage, close the exchange.

The usage-only chunk is held back, its missing reasoning count filled (:func:`fill_reasoning`), and forwarded
only when the client asked (``stream_options.include_usage``). Failures after the 200 become one in-stream
error event (no ``[DONE]``): a stalled upstream (``httpx.TimeoutException`` or
:class:`gateway.errors.UpstreamTimeout` from a composed stream) → 504 ``upstream_timeout``; a broken one → 502
``upstream_stream_broken``. A client disconnect cancels the generator: the upstream response is closed (which
cancels the request) and the tokens seen so far are metered with ``partial: true``. With a cache ticket the
stream is assembled and stored once it completed successfully.

**Bounded, and counted while it runs.** A stream's budget reservations (``gateway/state/reservations.py``) are
renewed every third of ``limits.reservation_ttl_s`` while it runs, so they never expire under a live stream;
a stream that reaches ``limits.max_stream_s`` is cut: the upstream request is closed, every choice gets a
``finish_reason: "length"`` chunk, the client a ``[DONE]``, and the tokens seen so far are metered (``partial``,
``error_code: stream_max_duration``). So no reservation outlives its bound and no stream runs unbounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import orjson

from gateway.config import TierConfig
from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout
from gateway.openai import sse
from gateway.openai.chunks import StreamAssembler
from gateway.openai.usage import estimate_tokens, needs_reasoning_count
from gateway.pipeline.exchange import Exchange
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.response import UpstreamResponse

if TYPE_CHECKING:
    from gateway.pipeline.accounting import Accounting

log = logging.getLogger("thinkgate.relay")

CLIENT_CLOSED = 499  # nginx's convention for "client closed the request"


async def fill_reasoning(pool: UpstreamPool, usage: dict[str, Any], tier: TierConfig, texts: list[str]) -> None:
    """Set ``usage.completion_tokens_details.reasoning_tokens`` from the reasoning texts (one per choice):
    exact counts from the upstream's ``/tokenize``, else :func:`gateway.openai.usage.estimate_tokens`."""
    counts = await asyncio.gather(*(pool.count_tokens(tier, t) for t in texts))
    total = sum(c if c is not None else estimate_tokens(t) for c, t in zip(counts, texts, strict=True))
    details = usage.get("completion_tokens_details")
    if not isinstance(details, dict):
        details = {}
        usage["completion_tokens_details"] = details
    details["reasoning_tokens"] = total


def count_deltas(ex: Exchange, tally: sse.StreamTally) -> None:
    """No upstream usage (client gone, stream broken): vLLM sends about one token per delta."""
    ex.record.completion_tokens = tally.reasoning_deltas + tally.text_deltas
    ex.record.reasoning_tokens = tally.reasoning_deltas
    ex.record.usage_source = "counted"


def _head(last: bytes | None) -> dict[str, Any]:
    """id/object/created/model of a stream's chunk (``last``: its JSON payload; {} when unreadable)."""
    if last is None:
        return {}
    try:
        data = orjson.loads(last)
    except orjson.JSONDecodeError:
        return {}
    return {k: data[k] for k in ("id", "object", "created", "model") if k in data} if isinstance(data, dict) else {}


def cut_chunk(last: bytes | None, choices: int) -> bytes:
    """The SSE event that ends a cut stream: ``finish_reason: "length"`` for choices 0..``choices``-1, shaped
    like the stream's last chunk (``last``: its JSON payload, for id/object/created/model)."""
    head = _head(last)
    completions = head.get("object") == "text_completion"
    finish = [{"index": i, "text": "", "finish_reason": "length"} if completions
              else {"index": i, "delta": {}, "finish_reason": "length"} for i in range(max(1, choices))]
    return sse.event(orjson.dumps({**head, "choices": finish}))


async def _renew(acct: Accounting, ex: Exchange) -> None:
    """While the stream runs (cancelled when it ends): renew its reservations every third of their TTL, counted
    from its admission (``record.ts``), so they never lapse under a live stream."""
    every = acct.settings.limits.reservation_ttl_s / 3
    due = ex.record.ts + every
    while True:
        await asyncio.sleep(max(0.0, due - time.time()))
        due = time.time() + every
        try:
            await acct.renew(ex.record)
        except Exception:  # never break the stream for it; the next round tries again
            log.exception("renewing the reservations of %s failed", ex.record.request_id)


async def relay(resp: UpstreamResponse, ex: Exchange, pool: UpstreamPool, wants_usage: bool,
                cache: bool, choices: int = 1) -> AsyncGenerator[bytes, None]:
    """SSE bytes for the client from ``resp``; closes ``ex`` exactly once when it ends, however it ends.

    ``cache``: assemble the stream and offer it to the exchange's cache ticket when it completes. ``choices``:
    how many choices the stream carries (for the chunk that ends a stream cut at ``limits.max_stream_s``).
    """
    tier = ex.tier
    record = ex.record
    tally = sse.StreamTally()
    status: int | None = None
    code: str | None = None
    # the whole answer is assembled for the cache, or for a shadow comparison of this request (ex.on_answer)
    keep = (cache and ex.ticket is not None and ex.ticket.decision.store) or ex.on_answer is not None
    assembler = StreamAssembler() if keep else None
    acct = ex.accounting
    limits = acct.settings.limits if acct is not None else None
    started = time.monotonic()
    renewer = asyncio.ensure_future(_renew(acct, ex)) if acct is not None else None
    last: bytes | None = None
    cut = False
    # the tokens relayed so far go to the request's write-ahead record (rate-bounded there)
    progress = ex.accounting.stream_progress(record) if ex.accounting is not None else None
    try:
        async for batch in sse.data_batches(resp):
            if assembler is not None:
                assembler.feed_payloads(batch)
            out = tally.feed(batch)
            if progress is not None:
                progress(tally)
            if tally.saw_text:
                record.mark_first_byte()
            if out:
                yield out
            if tally.done or tally.upstream_error:
                break
            last = next((p for p in reversed(batch) if p != b"[DONE]"), last)
            if limits is not None and time.monotonic() - started >= limits.max_stream_s:
                cut = True  # its bound: no reservation may outlive it
                break
        if cut:
            record.partial = True
            if tally.last_usage is not None:  # continuous usage stats: the upstream's running totals
                record.set_usage(tally.last_usage)
            else:
                count_deltas(ex, tally)
            yield cut_chunk(last, choices)
            if wants_usage:
                usage = {"prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
                         "total_tokens": record.prompt_tokens + record.completion_tokens}
                yield sse.event(orjson.dumps({**_head(last), "choices": [], "usage": usage}))
            yield sse.DONE
            status, code = 200, "stream_max_duration"
            return
        if tally.upstream_error:
            status, code = 502, "upstream_error"
            return
        if not tally.done:
            raise httpx.RemoteProtocolError("upstream stream ended without [DONE]")
        if tally.usage_chunk is not None:
            usage = tally.usage_chunk["usage"]
            texts = tally.reasoning_texts()
            if texts and needs_reasoning_count(usage):
                await fill_reasoning(pool, usage, tier, texts)
            record.set_usage(usage)
            if assembler is not None:
                assembler.usage = usage  # with the filled reasoning count
            if wants_usage:
                yield sse.event(orjson.dumps(tally.usage_chunk))
        elif tally.last_usage is not None:
            record.set_usage(tally.last_usage)
        else:
            count_deltas(ex, tally)
        yield sse.DONE
        status = 200
    except (httpx.TimeoutException, UpstreamTimeout):
        status, code = 504, "upstream_timeout"
        yield sse.error_event(UpstreamTimeout(f"upstream of tier {tier.name!r} stalled mid-stream"))
    except (httpx.HTTPError, GatewayError) as exc:
        status, code = 502, "upstream_stream_broken"
        why = exc.message if isinstance(exc, GatewayError) else str(exc)
        yield sse.error_event(UpstreamError(f"upstream of tier {tier.name!r} broke the stream: {why}", code=code))
    finally:
        if renewer is not None:
            renewer.cancel()
        with anyio.CancelScope(shield=True):
            await resp.aclose()
            if status is None:
                status, code = CLIENT_CLOSED, "client_disconnected"
            if status != 200 or cut:
                record.partial = True
                if cut:  # counted above
                    pass
                elif tally.usage_chunk is not None:
                    record.set_usage(tally.usage_chunk["usage"])
                elif tally.last_usage is not None:
                    record.set_usage(tally.last_usage)
                else:
                    count_deltas(ex, tally)
            complete = status == 200 and not cut and assembler is not None and assembler.complete
            await ex.close(status, code, assembler.result() if complete and assembler is not None else None)
