"""The answer's delivery: relay a stream's chunks (hold back and complete its usage), or complete a JSON answer;
either way close the exchange once.

:func:`relay` yields batches of :class:`gateway.openai.sse.Chunk` (one batch per upstream read); ``gateway/api/``
frames them as SSE — a chunk passed on unchanged with the upstream's own bytes — or translates them. An upstream
that answered the stream with one JSON document instead of SSE is relayed as the stream it would have been, its
usage metered like any stream's (``gateway/upstream/response.py`` ``json_answer_batches``).

The usage-only chunk is held back, its missing reasoning count filled (:func:`fill_reasoning`), and forwarded
only when the client asked (``stream_options.include_usage``). Failures after the 200 become one in-stream
error event (no ``[DONE]``): a stalled upstream (``httpx.TimeoutException`` or
:class:`gateway.errors.UpstreamTimeout` from a composed stream) → 504 ``upstream_timeout``; a broken one → 502
``upstream_stream_broken``. A client disconnect cancels the generator: the upstream response is closed (which
cancels the request) and the tokens seen so far are metered with ``partial: true`` (a forced stream closed in its
answer phase: its bill, :func:`meter_closed`). With a cache ticket the
stream is assembled and stored once it completed successfully.

**Bounded, and counted while it runs.** A stream's budget reservations (``gateway/state/reservations.py``) are
renewed every third of ``limits.reservation_ttl_s`` while it runs, so they never expire under a live stream;
a stream that reaches ``limits.max_stream_s`` is cut: the upstream request is closed, every choice gets a
``finish_reason: "length"`` chunk, the client a ``[DONE]``, and the tokens seen so far are metered (``partial``,
``error_code: stream_max_duration``) — a stalled one at its bound too, not at the read timeout (the wait for a batch
is bounded by the time left once that is shorter than the longest wait, :func:`longest_wait`). The bound counts from
the request's first upstream call (:meth:`~gateway.pipeline.exchange.Exchange.stream_deadline`), not from the relay's
first batch: the escalation peek that held the stream back (stopped at the same bound, its head then relayed and the
stream cut here), an escalation's calls and a forced stream's opening are in it. So no reservation outlives its bound
and no stream runs unbounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import anyio
import httpx
from redis.exceptions import ResponseError

from gateway.config import TierConfig
from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout
from gateway.ledger.record import UsageRecord
from gateway.openai import sse
from gateway.openai.chunks import StreamAssembler
from gateway.openai.sse import DONE_CHUNK, Chunk, error_chunk
from gateway.openai.usage import (
    estimate_prompt,
    estimate_tokens,
    generated_text,
    needs_reasoning_count,
    reasoning_of,
    token_count,
)
from gateway.pipeline.exchange import Exchange
from gateway.state.limits import requested_choices
from gateway.upstream.pool import TOKENIZE_TIMEOUT_S, UpstreamPool, longest_opening
from gateway.upstream.response import SyntheticResponse, UpstreamResponse, chunk_batches

if TYPE_CHECKING:
    from gateway.pipeline.accounting import Accounting

log = logging.getLogger("thinkgate.relay")

CLIENT_CLOSED = 499  # nginx's convention for "client closed the request"


#: The most ``/tokenize`` calls one count has in flight at once. An answer is counted choice by choice, and the
#: choices are the upstream's to send: unbounded, an upstream's answer with thousands of them fired thousands of
#: requests at once at its own ``/tokenize`` (and held as many connections of the gateway's pool).
TOKENIZE_CONCURRENCY = 8


async def count_texts(pool: UpstreamPool, tier: TierConfig, texts: list[str], exact: int) -> int:
    """Tokens of ``texts`` (one per choice): the first ``exact`` — the choices the request asked for — by the
    upstream's ``/tokenize`` (``UpstreamPool.tokens``), at most :data:`TOKENIZE_CONCURRENCY` at a time; any further
    ones an upstream sent are estimated (~4 characters a token) without a call: what the client did not ask for
    gets no request of its own, and the whole count is held to the call's bound where it is metered."""
    gate = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    async def one(text: str) -> int:
        async with gate:
            return await pool.tokens(tier, text)

    exact = max(0, exact)
    counted = await asyncio.gather(*(one(t) for t in texts[:exact])) if texts[:exact] else []
    return sum(counted) + sum(estimate_tokens(t) for t in texts[exact:])


async def fill_reasoning(pool: UpstreamPool, usage: dict[str, Any], tier: TierConfig, texts: list[str],
                         asked: int) -> None:
    """Set ``usage.completion_tokens_details.reasoning_tokens`` from the reasoning texts (one per choice; ``asked``:
    the choices the request asked for): exact counts from the upstream's ``/tokenize``, else estimated
    (:func:`count_texts`)."""
    total = await count_texts(pool, tier, texts, asked)
    details = usage.get("completion_tokens_details")
    if not isinstance(details, dict):
        details = {}
        usage["completion_tokens_details"] = details
    details["reasoning_tokens"] = total


def count_deltas(ex: Exchange, tally: sse.StreamTally) -> None:
    """No upstream usage (client gone, stream broken): vLLM sends about one token per delta — held to the call's
    completion bound (an upstream that ignores ``max_tokens`` and sends no usage overspent a hard budget)."""
    ex.record.set_counted(*tally.counted())


async def meter_closed(resp: UpstreamResponse, record: UsageRecord) -> bool:
    """A stream closed before its end — the client gone (the relay, the escalation peek) or cut at
    ``limits.max_stream_s`` — or failed with no usage chunk read, whose response knows what it ran
    (:meth:`SyntheticResponse.spent`: a forced stream whose thought phase reported its usage — that usage,
    ``usage_source: upstream``, until its answer phase is answered, also when the thought phase then broke, stalled
    or sent an error event — or in its answer phase, what it is billed had it failed there, phase 2's prompt in it,
    ``counted``) is metered that in place of counting: the client's prompt and the deltas left phase 2's prompt (the
    thought re-read) out, and estimated what phase 1 had reported. False when it knows nothing (any other stream):
    the caller counts it."""
    spent = await resp.spent() if isinstance(resp, SyntheticResponse) else None
    if spent is None or not record.set_usage(spent[0]):
        return False
    record.usage_source = spent[1]  # the upstream's report, or (some of it) the gateway's count
    return True


async def count_prompt(pool: UpstreamPool, tier: TierConfig, body: dict[str, Any]) -> int:
    """Prompt tokens of the client's ``body`` on ``tier``, for a stream that ended with no upstream usage (the
    client went away, the upstream broke it): the upstream had read the whole prompt by its first chunk, so it is
    billed. vLLM's ``/tokenize`` of the messages under the tier's chat template (or of a completions prompt),
    else estimated (:func:`~gateway.openai.usage.estimate_prompt`: ~4 characters a token of text, a fixed count
    per image or audio part). The first phase's prompt on a ``forced`` tier: a lower bound there."""
    messages = body.get("messages")
    if isinstance(messages, list):
        tools = body.get("tools")
        counted = await pool.count_chat_tokens(tier, messages, tools if isinstance(tools, list) else None)
        return counted if counted is not None else estimate_prompt(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)  # pre-tokenised
    if isinstance(prompt, str):
        return await pool.tokens(tier, prompt)
    return estimate_prompt(prompt)


def _head(last: dict[str, Any] | None) -> dict[str, Any]:
    """id/object/created/model of a stream's chunk (``last``; {} when there is none)."""
    if last is None:
        return {}
    return {k: last[k] for k in ("id", "object", "created", "model") if k in last}


def cut_chunk(last: dict[str, Any] | None, choices: int) -> Chunk:
    """The chunk that ends a cut stream: ``finish_reason: "length"`` for choices 0..``choices``-1, shaped like
    the stream's last chunk (``last``, for id/object/created/model)."""
    head = _head(last)
    completions = head.get("object") == "text_completion"
    finish = [{"index": i, "text": "", "finish_reason": "length"} if completions
              else {"index": i, "delta": {}, "finish_reason": "length"} for i in range(max(1, choices))]
    return Chunk({**head, "choices": finish})


async def renew(acct: Accounting, ex: Exchange) -> None:
    """While the call runs (cancelled when it ends): renew its reservations every third of their TTL, counted from
    its admission (``record.ts``), so they never lapse under a live stream — or a long non-streamed answer, whose
    renewal :meth:`gateway.pipeline.proxy.Proxy.serve` starts by a timer a third of the TTL after admission."""
    every = acct.settings.limits.reservation_ttl_s / 3
    due = ex.record.ts + every
    warned = False
    while True:
        await asyncio.sleep(max(0.0, due - time.time()))
        due = time.time() + every
        try:
            await acct.renew(ex.record)
        except ResponseError as exc:  # never break the stream for it; the next round tries again
            if not warned:
                warned = True
                _warn_refused(acct, ex, exc)
        except Exception:  # not a refusal (a bug): its traceback is what says where
            log.exception("renewing the reservations of %s failed", ex.record.request_id)


def _warn_refused(acct: Accounting, ex: Exchange, exc: ResponseError) -> None:
    """The one WARNING line of a stream whose renewal Redis refused: Redis answered, so a traceback says nothing the
    error reply does not — it names the command and the key (the level's reservation hash, ``gateway/state/undo.py``)
    —, and one every round (a third of ``limits.reservation_ttl_s``) of every stream of the tenant was noise. Each
    refused call is counted in ``thinkgate_admission_refused_scripts_total{script="renew"}`` (``Limits.renew``)."""
    log.warning("reservations of request %s (key %s) not renewed: Redis refused the renewal (%s); they lapse within "
                "%g s unless a later round works — fix or delete the key it names (said once per stream, every "
                "refusal counted in thinkgate_admission_refused_scripts_total{script=\"renew\"})",
                ex.record.request_id, ex.record.key_id or "anonymous", exc, acct.settings.limits.reservation_ttl_s)


class _Run:
    """One relay's state: the tally, the assembler (for the cache or a shadow comparison), the outcome."""

    def __init__(self, ex: Exchange, wants_usage: bool, choices: int, pool: UpstreamPool,
                 body: dict[str, Any] | None, resp: UpstreamResponse, counted_on_failure: bool = False) -> None:
        self.ex = ex
        self.resp = resp  # asked what it ran when it is closed before its end (meter_closed)
        # a usage chunk held back from a stream that then failed is the gateway's count (a forced call's bill)
        self.counted_on_failure = counted_on_failure
        self.pool = pool
        self.body = body  # the client's request, to count its prompt when no upstream usage comes
        self.record = ex.record
        self.tally = sse.StreamTally()
        self.wants_usage = wants_usage
        self.choices = choices
        self.status: int | None = None
        self.code: str | None = None
        # the whole answer is assembled for the cache, or for a shadow comparison of this request (ex.on_answer)
        keep = (ex.ticket is not None and ex.ticket.decision.store) or ex.on_answer is not None
        self.assembler = StreamAssembler() if keep else None
        self.max_s = ex.accounting.settings.limits.max_stream_s
        self.started = ex.started  # the request's first upstream call (Exchange.stream_deadline), not the relay's
        # the tokens relayed so far go to the request's write-ahead record (rate-bounded there)
        self.progress = ex.accounting.stream_progress(self.record)
        self.last: dict[str, Any] | None = None
        self.cut = False

    def feed(self, batch: list[Chunk]) -> list[Chunk]:
        """The chunks of ``batch`` to pass on."""
        if self.assembler is not None:
            for c in batch:
                if c.data is None:
                    self.assembler.done = True
                else:
                    self.assembler.feed(c.data)
        out = self.tally.feed(batch)
        if self.progress is not None:
            self.progress(self.tally)
        if self.tally.saw_text:
            self.record.mark_first_byte()
        self.last = next((c.data for c in reversed(batch) if c.data is not None), self.last)
        return out

    def stop(self) -> bool:
        """True when the relay reads no further: ``[DONE]``, an in-stream error, or ``limits.max_stream_s``."""
        if self.tally.done or self.tally.upstream_error:
            return True
        if time.monotonic() - self.started >= self.max_s:
            self.cut = True  # its bound: no reservation may outlive it
        return self.cut

    async def count(self) -> None:
        """No upstream usage: the relayed deltas (:func:`count_deltas`) and the prompt (:func:`count_prompt`)."""
        count_deltas(self.ex, self.tally)
        if self.body is not None and not self.record.prompt_tokens:
            self.record.prompt_tokens = await count_prompt(self.pool, self.ex.tier, self.body)

    async def cut_tail(self) -> list[Chunk]:
        """A cut stream's end: meter what was seen (partial), finish every choice, the usage when asked, [DONE]."""
        record = self.record
        record.partial = True
        # what the response knows it ran (a forced stream's bill), else continuous usage stats' running totals (the
        # upstream's), else counted
        if not await meter_closed(self.resp, record) and not record.set_usage(self.tally.last_usage):
            await self.count()
        out = [cut_chunk(self.last, self.choices)]
        if self.wants_usage:
            out.append(Chunk({**_head(self.last), "choices": [], "usage": usage_of(record)}))
        out.append(DONE_CHUNK)
        self.code = "stream_max_duration"
        return out

    async def end(self, pool: UpstreamPool) -> list[Chunk]:
        """A stream that ended by itself: its usage (reasoning count filled) and [DONE]; nothing after an
        in-stream error. Raises ``httpx.RemoteProtocolError`` when it ended without ``[DONE]``."""
        tally = self.tally
        if tally.upstream_error:
            self.status, self.code = 502, "upstream_error"
            return []
        if not tally.done:
            raise httpx.RemoteProtocolError("upstream stream ended without [DONE]")
        out: list[Chunk] = []
        usage = tally.usage_chunk["usage"] if tally.usage_chunk is not None else None
        if isinstance(usage, dict):
            texts = tally.reasoning_texts()
            if texts and needs_reasoning_count(usage, self.record.usage_limit):
                asked = requested_choices(self.body) if self.body is not None else self.choices
                await fill_reasoning(pool, usage, self.ex.tier, texts, asked)
        if not self.record.set_usage(usage):
            if self.record.set_usage(tally.last_usage):  # continuous usage stats: the running totals
                usage = tally.last_usage
            else:  # no usage, or none the gateway can meter (metered at 0 before): counted, and said so when asked
                await self.count()
                usage = usage_of(self.record)
        if metered_otherwise(usage, self.record):  # the client is told what was metered
            usage = usage_of(self.record)
        if usage is not None:
            if self.assembler is not None:
                self.assembler.usage = usage  # with the filled reasoning count
            if self.wants_usage:
                head = tally.usage_chunk if tally.usage_chunk is not None else {**_head(self.last), "choices": []}
                out.append(Chunk({**head, "usage": usage}))
        out.append(DONE_CHUNK)
        return out

    def failed(self, exc: Exception) -> Chunk:
        """The in-stream error for a stream that stalled (504) or broke (502)."""
        tier = self.ex.tier
        if isinstance(exc, httpx.TimeoutException | UpstreamTimeout):
            self.status, self.code = 504, "upstream_timeout"
            return error_chunk(UpstreamTimeout(f"upstream of tier {tier.name!r} stalled mid-stream"))
        self.status, self.code = 502, "upstream_stream_broken"
        why = exc.message if isinstance(exc, GatewayError) else type(exc).__name__  # no internal address
        return error_chunk(UpstreamError(f"upstream of tier {tier.name!r} broke the stream: {why}", code=self.code))

    async def settle(self) -> None:
        """Close the exchange once: the status (499 when the client went away), the usage seen so far when the
        stream did not end well, the assembled answer when it did. The close runs whatever raises before it (a
        failed count, an answer the assembler cannot build): the call is metered with what the record holds, logged,
        not cached — an exception here used to leave a delivered stream with no usage event at all."""
        status, code = (self.status, self.code) if self.status is not None else (CLIENT_CLOSED, "client_disconnected")
        answer: dict[str, Any] | None = None
        try:
            answer = await self._settled_usage(status)
        except Exception:
            log.exception("settling the stream of request %s failed; metered with the usage it holds, not cached",
                          self.record.request_id)
        await self.ex.close(status, code, answer)

    async def _settled_usage(self, status: int) -> dict[str, Any] | None:
        """:meth:`settle`'s usage (set on the record) and the complete answer to offer the cache (None: none)."""
        tally, record = self.tally, self.record
        if status != 200 and not self.cut:
            record.partial = True
            usage = tally.usage_chunk["usage"] if tally.usage_chunk is not None else None
            if record.set_usage(usage):
                # a forced stream's usage chunk not followed by [DONE] is the gateway's bill before its failure —
                # also when the client left before the error was written (no status yet); its final usage is
                # followed by [DONE] with no wait between them
                if self.counted_on_failure and not tally.done:
                    record.usage_source = "counted"
            elif not await meter_closed(self.resp, record) and not record.set_usage(tally.last_usage):
                await self.count()  # (closed: what it knows it ran — a forced stream's bill — is not counted again)
        asm = self.assembler
        complete = status == 200 and not self.cut and asm is not None and asm.complete
        return asm.result() if complete and asm is not None else None


async def complete(data: dict[str, Any], ex: Exchange, pool: UpstreamPool, body: dict[str, Any] | None = None,
                   endpoint: str = "chat") -> bool:
    """A non-streamed answer ``data`` (its JSON document): fill its reasoning count if missing, record its
    usage, close ``ex`` (offering a complete answer to the cache). An answer with no usage, or one the gateway
    cannot meter (:func:`gateway.openai.usage.usage_counts`), is counted (:func:`count_answer`; ``body``: the
    client's request, for its prompt) and carries the counted usage — it was metered at 0, and every such request
    was free. True when ``data`` was changed (encode it again), False when the upstream's bytes still say it."""
    usage = data.get("usage")
    reasoning = [r for c in data.get("choices") or () if (r := reasoning_of(c.get("message")))]
    changed = bool(reasoning) and isinstance(usage, dict) and needs_reasoning_count(usage, ex.record.usage_limit)
    if changed and isinstance(usage, dict):
        await fill_reasoning(pool, usage, ex.tier, reasoning, requested_choices(body) if body is not None else 1)
    ex.record.mark_first_byte()
    if not ex.record.set_usage(usage if isinstance(usage, dict) else None):
        data["usage"] = await count_answer(pool, ex, data, body, endpoint)
        changed = True
    elif metered_otherwise(usage, ex.record):  # the client is told what was metered
        data["usage"] = usage_of(ex.record)
        changed = True
    done = bool(data.get("choices")) and all(c.get("finish_reason") for c in data["choices"])
    await ex.close(200, None, data if done else None)
    return changed


def usage_of(rec: UsageRecord) -> dict[str, Any]:
    """The usage object (OpenAI's shape) of what ``rec`` meters."""
    usage: dict[str, Any] = {"prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.completion_tokens,
                             "total_tokens": rec.prompt_tokens + rec.completion_tokens,
                             "completion_tokens_details": {"reasoning_tokens": rec.reasoning_tokens}}
    if rec.cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": rec.cached_tokens}
    return usage


def metered_otherwise(usage: Any, rec: UsageRecord) -> bool:
    """Whether ``rec`` metered other counts than ``usage`` says: a completion count held to the call's bound, or a
    detail clipped (:meth:`UsageRecord.set_usage` — a cached count above the prompt, a reasoning count above the
    completion or a negative one — or details that are no object). The client is then told :func:`usage_of` ``rec``,
    what was metered: it was told 100,000 cached tokens of a 12-token prompt (on ``/v1/messages``,
    ``input_tokens: -99988``)."""
    if not isinstance(usage, dict):
        return False

    def same(holder: Any, name: str, metered: int) -> bool:
        if holder is not None and not isinstance(holder, dict):
            # details that are no object ("x", 7) were metered as 0 and passed on as they came: /v1/messages and
            # /v1/responses read them to translate the usage and failed (a 500, a cut stream) on an answer billed
            return False
        v = holder.get(name) if holder is not None else None
        return metered == 0 if v is None else token_count(v, rec.usage_limit) == metered

    return not (same(usage, "prompt_tokens", rec.prompt_tokens)
                and same(usage, "completion_tokens", rec.completion_tokens)
                and same(usage.get("prompt_tokens_details"), "cached_tokens", rec.cached_tokens)
                and same(usage.get("completion_tokens_details"), "reasoning_tokens", rec.reasoning_tokens))


async def count_answer(pool: UpstreamPool, ex: Exchange, data: dict[str, Any], body: dict[str, Any] | None,
                       endpoint: str) -> dict[str, Any]:
    """Count a non-streamed answer the upstream sent no usable usage with: its generated text per choice
    (thought included) and its thoughts by the upstream's ``/tokenize`` (else ~4 characters a token; the choices
    the request asked for only, a bounded number at a time: :func:`count_texts`), the prompt by :func:`count_prompt`;
    set on ``ex.record`` (``usage_source: counted``, held to its completion bound). Returns the usage object
    (OpenAI's shape) for the answer."""
    choices = [c for c in data.get("choices") or () if isinstance(c, dict)]
    tier = ex.tier
    asked = requested_choices(body) if body is not None else 1
    completion = await count_texts(pool, tier, [generated_text(c, endpoint) for c in choices], asked)
    thoughts = [r for c in choices if (r := reasoning_of(c.get("message")))]
    reasoning = await count_texts(pool, tier, thoughts, asked) if thoughts else 0
    rec = ex.record
    rec.set_counted(completion, reasoning)
    rec.prompt_tokens = await count_prompt(pool, tier, body) if body is not None else 0
    rec.cached_tokens = 0
    return usage_of(rec)


def longest_wait(tier: TierConfig) -> float:
    """Seconds one wait for a stream's next batch may last before the upstream's own timeouts end it: a read
    (``read_timeout_s``), or at a forced stream's phase boundary phase 1's last read, the count of its thought when
    the upstream gave none (a ``/tokenize`` call, ``TOKENIZE_TIMEOUT_S``), phase 2's opening with its retries
    (:func:`longest_opening`) and its first read. The relay bounds a wait by the time ``limits.max_stream_s`` leaves
    only once that is shorter (a timer per batch costs CPU on every stream)."""
    return longest_opening(tier) + 2 * tier.read_timeout_s + TOKENIZE_TIMEOUT_S


async def relay(resp: UpstreamResponse, ex: Exchange, pool: UpstreamPool, wants_usage: bool,
                choices: int = 1, body: dict[str, Any] | None = None) -> AsyncGenerator[list[Chunk], None]:
    """Chunk batches for the client from ``resp``; closes ``ex`` exactly once when it ends, however it ends.

    A complete stream is assembled and offered to the exchange's cache ticket (or its shadow comparison).
    ``choices``: how many choices the stream carries (for the chunk that ends a stream cut at
    ``limits.max_stream_s``); ``body``: the client's request, whose prompt is counted (:func:`count_prompt`) when
    the stream ends with no upstream usage.
    """
    run = _Run(ex, wants_usage, choices, pool, body, resp,
               counted_on_failure=isinstance(resp, SyntheticResponse) and resp.counted_on_failure)
    renewer = asyncio.ensure_future(renew(ex.accounting, ex))
    # what the escalation peek read is passed on whatever the time (it is read, and billed): a peek stopped at the
    # bound leaves its stream to be cut here once its head was relayed
    held = resp.take_head() if isinstance(resp, SyntheticResponse) else []
    batches = chunk_batches(resp)
    patience = longest_wait(ex.tier)
    try:
        ended = False
        for read in held:
            out = run.feed(read)
            if out:
                yield out
            if run.tally.done or run.tally.upstream_error:
                ended = True
                break
        while not ended:
            left = run.max_s - (time.monotonic() - run.started)
            if left > patience:  # a stall ends by the upstream's own timeouts before the bound: no timer (per batch)
                batch = await anext(batches, None)
            else:
                # a stall must not outlast limits.max_stream_s: waited for as long as the bound leaves, then cut —
                # at once when what ran before the relay (the peek, a forced stream's opening) spent it: a peek
                # stopped at the bound may have ended the stream's reader, which is not read again
                if left <= 0:
                    run.cut = True
                    break
                with anyio.move_on_after(left) as waited:
                    batch = await anext(batches, None)
                if waited.cancelled_caught:
                    run.cut = True
                    break
            if batch is None:
                break
            out = run.feed(batch)
            if out:
                yield out
            if run.stop():
                break
        tail = await run.cut_tail() if run.cut else await run.end(pool)
        if run.status is None:
            # set before the last batch is handed on: a client that goes away once it is written has the whole
            # answer, and the relay may never resume after this yield (it was metered 499, partial, not cached)
            run.status = 200
        if tail:
            yield tail
    except (httpx.HTTPError, GatewayError) as exc:
        yield [run.failed(exc)]
    finally:
        renewer.cancel()
        with anyio.CancelScope(shield=True):
            await resp.aclose()
            await run.settle()
