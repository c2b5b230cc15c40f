"""Thinking-budget enforcement in the gateway: two-phase budget forcing and its loop guard.

**Budget forcing** (``budget_mode: forced``, for upstreams without a native per-request budget). Following
the "budget forcing" of s1 (Muennighoff et al., arXiv 2501.19393), the thought is generated with at most
``thinking_budget`` tokens and stopped at the end-of-thinking marker; when the budget cut it, the tier's
``end_of_thinking`` text (default ``"\\n</think>\\n\\n"``) is appended and the *same* assistant message is
continued for the answer:

- chat: phase 2 sends the conversation plus a final assistant message ``"<think>\\n" + thought + close``
  with ``continue_final_message: true, add_generation_prompt: false`` (vLLM's chat extension; the chat
  template renders the message, and transformers cuts the rendering right after its content);
- completions: phase 2 sends ``prompt + thought + close`` as the prompt.

The client sees one response (streaming included): the thought as ``reasoning`` (chat) and the answer as
``content``; completions return ``thought + close + answer`` as ``text``. Usage is the sum of what the
upstream processed in both phases — ``prompt_tokens`` = p1 + p2 prompt tokens (phase 2's prompt holds the
thought again; an engine with prefix caching reports it in ``prompt_tokens_details.cached_tokens``),
``completion_tokens`` = p1 + p2, ``completion_tokens_details.reasoning_tokens`` = phase-1 completion tokens
(≤ the budget). Units are tokens throughout.

**What a phase's upstream sends** is read as the relay reads a stream (:func:`gateway.upstream.response.chunk_batches`):
a phase answered with one JSON document instead of SSE is the stream it would have been (its usage as reported); an
error document — an in-stream ``{"error": …}`` event, or such a body — ends the forced answer there: streamed, that
chunk is the relay's in-stream error (no answer phase after a failed thought; metered as a failed stream: 502
``upstream_error``, the deltas relayed and the prompt counted), not streamed a 502; a phase that ends without
``[DONE]`` is a broken stream (``upstream_stream_broken``).

**A call that fails in phase 1** once it was answered 200 (its error document, a broken or stalled stream) is billed
as the relay bills any failed stream, streamed or not: before phase 1's usage chunk came, the prompt counted
(``gateway.pipeline.relay.count_prompt``) and one completion token a delta read
(:meth:`gateway.openai.sse.StreamTally.counted`; a chat thought's as reasoning), ``partial``, ``usage_source:
counted``; once it came, that usage as the upstream reported it (its completion as reasoning), ``partial``,
``usage_source: upstream`` — as the relay bills a plain stream that fails after its usage chunk
(:meth:`ForcedBudget.spent`) — streamed by the relay and the escalation peek, not streamed by
:meth:`ForcedBudget._assemble`. The client's error is the same either way.

**A call that fails in phase 2** (its error document, a broken or stalled stream, an answer phase refused) is billed
what the upstream is known to have processed, streamed or not (:meth:`ForcedBudget._spent`): phase 1 as it reported
it, plus phase 2's prompt when phase 2 was answered 200 (the upstream read it before its first event — the rule the
relay applies to any failed stream — and reported nothing) and the answer deltas it sent. The client's error stays
what it was; the usage event says ``partial`` and ``usage_source: counted``. Streamed, the bill is a usage-only chunk
before the error, metered so by the relay and by the escalation's peek (``Proxy._peek``) alike. A stream closed in
phase 2 before its end (the client gone, or cut at ``limits.max_stream_s``) is billed the same, as had it failed
there: the relay and the peek ask the closed stream (:meth:`ForcedBudget.spent`) instead of counting the client's
prompt, which left phase 2's out.

**Loop guard** (``loop_guard`` on a forced tier): an n-gram of whitespace words seen ``max_repeats`` times in
the streamed thought ends phase 1 early, as if the budget were hit.

Escalation (retrying a weak answer on the next tier) is a pipeline decision: :mod:`gateway.pipeline.escalation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config import TierConfig
from gateway.errors import GatewayError, InvalidRequest, UpstreamError, UpstreamStreamError
from gateway.ledger.event import UsageSource, WireEndpoint
from gateway.openai.sse import DONE_CHUNK, Chunk, StreamTally
from gateway.openai.usage import generated_text, merge_usage, token_count, usage_counts
from gateway.thinking.loop_guard import LoopDetector
from gateway.upstream.pool import ENDPOINT_PATHS, UpstreamPool
from gateway.upstream.response import Spent, SyntheticResponse, UpstreamResponse, chunk_batches

THINK_OPEN = "<think>\n"


Piece = tuple[str, str | None, dict[str, Any] | None, list[dict[str, Any]] | None]


class PhaseError(Exception):
    """A phase's upstream stream carried an error document (``{"error": …}``, in-stream or as the JSON body of a
    stream request): ``chunk`` is that chunk, passed on to a streaming client as the relay passes one on."""

    def __init__(self, chunk: Chunk) -> None:
        error = (chunk.data or {}).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        super().__init__(str(message or "the upstream sent an error"))
        self.chunk = chunk


class ForcedCallFailed(Exception):
    """A non-streamed forced call that failed after some of it is known to have run (its phase 1 answered 200, its
    phase 2, or one of its ``n`` generations'): ``error`` is the error the client gets (the same as without this),
    ``usage`` (OpenAI's shape, tokens) what the upstream is known to have processed (:meth:`ForcedBudget._spent`, or
    counted by :meth:`ForcedBudget._assemble`; summed over the choices), ``source`` whose count that is
    (``upstream``: every failed generation's is its thought phase's report, :meth:`ForcedBudget.spent`). The proxy
    meters ``usage`` (``partial``, ``usage_source``: ``source``) and raises ``error``."""

    def __init__(self, error: GatewayError, usage: dict[str, Any], source: UsageSource = "counted") -> None:
        super().__init__(error.message)
        self.error = error
        self.usage = usage
        self.source = source


async def _pieces(resp: Any, endpoint: WireEndpoint) -> AsyncIterator[Piece]:
    """(generated text, finish_reason, usage, tool-call deltas) per event of a phase's upstream response, until
    ``[DONE]``. Tool-call deltas (chat) are passed on as the upstream sent them. Read as the relay reads a stream
    (:func:`gateway.upstream.response.chunk_batches`: SSE, or the stream a JSON answer would have been). Raises
    :class:`PhaseError` at an error document and :class:`~gateway.errors.UpstreamStreamError` when the stream
    ended without ``[DONE]`` (a broken stream, or a JSON body that is no answer): a phase cut short is no
    thought to answer from, nor an answer to send as complete."""
    async for batch in chunk_batches(resp):
        for item in batch:
            data = item.data
            if data is None:
                return
            if "error" in data and not data.get("choices"):
                raise PhaseError(item)
            if data.get("usage") and not data.get("choices"):
                yield "", None, data["usage"], None
            for c in data.get("choices") or ():
                calls = (c.get("delta") or {}).get("tool_calls") if endpoint == "chat" else None
                yield generated_text(c, endpoint, delta=True), c.get("finish_reason"), None, calls or None
    raise UpstreamStreamError("the stream ended without [DONE]")


def end_marker(tier: TierConfig) -> str:
    """The end-of-thinking marker the thought phase stops at (``end_of_thinking`` stripped: ``</think>``)."""
    return tier.end_of_thinking.strip() or "</think>"


def thought_request(body: dict[str, Any], tier: TierConfig) -> dict[str, Any]:
    """Phase-1 body from the tier's upstream body: at most ``thinking_budget`` tokens (or the body's smaller
    ``thinking_token_budget``: the request's, or its key's ``max_thinking_budget``; clamped into the tier's
    ``thinking_budget_range`` when it declares one), stop at the marker.

    The client's ``stop`` strings apply to the answer (phase 2), not to the thought.
    """
    out = dict(body)
    asked = out.pop("thinking_token_budget", None)
    budget = tier.thinking_budget
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0 and (budget is None or asked < budget):
        budget = asked  # the request's (or its key's cap's, gateway/pipeline/policy.py) smaller budget, as native
    budget = tier.applied_budget(budget)  # in the tier's thinking_budget_range, when it declares one
    out["max_tokens"] = max(1, min(budget if budget is not None else out["max_tokens"], out["max_tokens"]))
    out["stop"] = [end_marker(tier)]
    out["n"] = 1
    return out


def answer_request(
    body: dict[str, Any], tier: TierConfig, endpoint: WireEndpoint, thought: str, closed_naturally: bool, used: int
) -> dict[str, Any]:
    """Phase-2 body: continue the same assistant turn after the closed thought, with the tokens left."""
    out = dict(body)
    out.pop("thinking_token_budget", None)
    out["n"] = 1
    out["max_tokens"] = max(1, out["max_tokens"] - used)
    close = end_marker(tier) + "\n\n" if closed_naturally else tier.end_of_thinking
    if endpoint == "chat":
        prefix = THINK_OPEN + thought + close
        out["messages"] = [*body["messages"], {"role": "assistant", "content": prefix}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        # The thought is closed: engines whose reasoning parser honours the switch (vLLM's qwen3) then report
        # everything generated as the answer (content) instead of as an unfinished thought.
        kwargs = out.get("chat_template_kwargs")
        out["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": False}
    else:
        out["prompt"] = body["prompt"] + thought + close
    return out


@dataclass(slots=True)
class _Phase:
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    #: its completion count is the gateway's (the loop guard cut it, or its usage had none): not the upstream's
    counted: bool = False


#: sends one phase's upstream body (a dict) to the tier's upstream, streamed: the response
Opener = Callable[[dict[str, Any]], Awaitable[UpstreamResponse]]
#: the tokens of a text for the tier's model (exact, else estimated)
Counter = Callable[[str], Awaitable[int]]
#: the prompt tokens of a request body (its messages and tools, or its prompt) on the tier, as the relay counts a
#: failed stream's (``gateway.pipeline.relay.count_prompt``, bound by the proxy: one rule for both paths)
PromptCounter = Callable[[dict[str, Any]], Awaitable[int]]


class ForcedBudget:
    """Runs two-phase budget forcing for one request on one forced tier: ``open_phase`` sends a phase to the tier's
    upstream, ``count`` counts a cut thought's tokens (:func:`open_forced` binds both to the pooled upstreams),
    ``count_prompt`` a request's prompt (the bill of a non-streamed call that failed in its thought phase).
    It reads the phases' chunk dicts and yields chunk dicts."""

    def __init__(self, tier: TierConfig, endpoint: WireEndpoint, open_phase: Opener, count: Counter,
                 count_prompt: PromptCounter) -> None:
        if endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"unknown endpoint {endpoint!r}")
        self.tier = tier
        self.endpoint = endpoint
        self.open_phase = open_phase
        self.count = count
        self.count_prompt = count_prompt
        # the bill of the stream as it stands were it closed now (:meth:`spent`): its thought phase's report once it
        # came, then its answer phase's; one ForcedBudget runs one stream (n = 1): streamed, the relay and the peek
        # ask it; not streamed, each of the n generations has its own (:meth:`complete`), asked by :meth:`_assemble`
        # when its stream fails.
        self._closed_bill: Callable[[], Awaitable[Spent | None]] | None = None

    def check(self, body: dict[str, Any]) -> None:
        """Refuse what forcing cannot serve: a list of prompts (completions); ``n > 1`` with streaming."""
        if self.endpoint == "completions" and not isinstance(body.get("prompt"), str):
            raise InvalidRequest(
                f"tier {self.tier.name!r} enforces its thinking budget by forcing: 'prompt' must be one string",
                param="prompt",
            )
        if body.get("stream") is True and int(body.get("n") or 1) > 1:
            raise InvalidRequest(
                f"tier {self.tier.name!r} enforces its thinking budget by forcing: n > 1 cannot be streamed",
                param="n",
            )

    # -- non-streamed -------------------------------------------------------------------------------

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One combined non-streamed response (OpenAI JSON). ``body`` is the tier's upstream body; ``n``
        choices are ``n`` independent forced generations. Built from :meth:`stream` (the upstream calls are
        streamed either way), so the loop guard applies to both.

        A generation that fails fails the call with its error, once all ``n`` ended (each one's usage is known then,
        not lost with the first error): :class:`ForcedCallFailed` with the usage of what ran — the complete choices'
        and the failed ones' bills (:meth:`_spent`) — when there is any, else the error itself (nothing known ran:
        the proxy may still fall back to another tier)."""
        n = int(body.get("n") or 1)
        one = {**body, "n": 1, "stream": True}
        # every generation runs to its end, so that one's failure does not lose the others' usage; each on its own
        # ForcedBudget, whose bill (spent) is that generation's
        gens = [ForcedBudget(self.tier, self.endpoint, self.open_phase, self.count, self.count_prompt)
                for _ in range(n)]
        outcomes = await asyncio.gather(*(g._assemble(g.stream(one), one) for g in gens), return_exceptions=True)
        usage: dict[str, Any] = {}
        reasoning = 0
        for out in outcomes:
            u = out.usage if isinstance(out, ForcedCallFailed) else None if isinstance(out, BaseException) else out[1]
            if u:
                reasoning += token_count((u.get("completion_tokens_details") or {}).get("reasoning_tokens"), None) or 0
                usage = merge_usage(usage, u, reasoning)
        failed = next((out for out in outcomes if isinstance(out, BaseException)), None)
        if failed is not None:
            error = failed.error if isinstance(failed, ForcedCallFailed) else failed
            if usage and isinstance(error, GatewayError):
                # the complete generations' usage is their upstream's report; the failed ones' may be counted
                counted = any(isinstance(out, ForcedCallFailed) and out.source != "upstream" for out in outcomes)
                raise ForcedCallFailed(error, usage, "counted" if counted else "upstream")
            raise error
        results = [out for out in outcomes if not isinstance(out, BaseException)]
        choices = [{**choice, "index": i} for i, (choice, _, _) in enumerate(results)]
        obj = "chat.completion" if self.endpoint == "chat" else "text_completion"
        return {**results[0][2], "object": obj, "choices": choices, "usage": usage}

    async def _assemble(
        self, chunks: AsyncIterator[Chunk], body: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(choice, usage, response metadata) from the chunks of one forced stream (its dicts, as built; ``body``
        its request). Raises :class:`~gateway.errors.UpstreamError` for a stream that ended in an upstream's error,
        and the stream's own errors — as :class:`ForcedCallFailed` with what the call is known to have used: the
        usage the stream sent before it failed (its phase-2 bill), else, once phase 1 was answered (the stream's
        first chunk), phase 1's usage as the upstream reported it once it came (:meth:`spent`, ``upstream``: as the
        relay bills a stream that fails after its usage chunk), else what the relay bills a failed stream —
        ``body``'s prompt counted and one token a delta read."""
        reasoning: list[str] = []
        text: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish: str | None = None
        usage: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        read = StreamTally()  # the deltas read, counted as the relay counts them
        answered = False  # phase 1 was answered: the stream's first chunk came
        try:
            async for item in chunks:
                answered = True
                read.feed([item])
                data = item.data
                if data is None:
                    break
                if "error" in data and not data.get("choices"):  # a phase's error: the call failed (502)
                    raise UpstreamError(f"upstream of tier {self.tier.name!r} sent an error: {PhaseError(item)}")
                meta = meta or {k: data[k] for k in ("id", "created", "model") if k in data}
                usage = data.get("usage") or usage
                # what the upstream sent in the wrong shape is skipped, as the plain stream assembler skips it
                # (gateway.openai.chunks): int() of an index "x" raised here — a 500 after the upstream was paid
                for c in _dicts(data.get("choices")):
                    finish = c.get("finish_reason") or finish
                    if self.endpoint == "completions":
                        text.append(_text(c.get("text")))
                        continue
                    delta: dict[str, Any] = d if isinstance(d := c.get("delta"), dict) else {}
                    reasoning.append(_text(delta.get("reasoning")))
                    text.append(_text(delta.get("content")))
                    for call in _dicts(delta.get("tool_calls")):
                        index, fn = call.get("index") or 0, call.get("function") or {}
                        if type(index) is not int or not isinstance(fn, dict):
                            continue
                        slot = calls.setdefault(index, {
                            "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                        slot["id"] = call.get("id") or slot["id"]
                        slot["function"]["name"] = _text(fn.get("name")) or slot["function"]["name"]
                        slot["function"]["arguments"] += _text(fn.get("arguments"))
        except GatewayError as exc:
            source: UsageSource = "counted"
            if not usage and (reported := await self.spent()) is not None:
                usage, source = reported  # phase 1 failed once its usage came: that report
            elif not usage and answered:
                # phase 1 was answered 200 (its upstream read the prompt) and failed before any usage came, or
                # phase 2 failed after a phase 1 that reported no prompt count (:meth:`_spent`): billed as the
                # relay bills the stream had it been streamed, not nothing
                completion, thought = read.counted()
                usage = merge_usage({"prompt_tokens": await self.count_prompt(body)},
                                    {"completion_tokens": completion}, thought)
            if usage:  # sent before the failure: what the call is known to have used (phase 1, phase 2 begun)
                raise ForcedCallFailed(exc, usage, source) from exc
            raise
        if self.endpoint == "chat":
            content = "".join(text)
            message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else ""),
                                       "reasoning": "".join(reasoning)}
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
            # logprobs: null, as every OpenAI choice carries it (a forced answer has none to give)
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}, usage, meta
        return {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": finish}, usage, meta

    # -- streamed -----------------------------------------------------------------------------------

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[Chunk, None]:
        """The chunks of one seamless stream (chat or completion chunk dicts), ending with a usage chunk and
        :data:`~gateway.openai.sse.DONE_CHUNK`. Closing the iterator closes the upstream response in flight
        (cancelling it)."""
        rid = f"chatcmpl-{uuid.uuid4().hex}" if self.endpoint == "chat" else f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        guard = LoopDetector(self.tier.loop_guard) if self.tier.loop_guard else None
        opts = body.get("stream_options")
        body = {**body, "stream": True, "stream_options": {**(opts if isinstance(opts, dict) else {}),
                                                           "include_usage": True}}

        head = {"id": rid, "object": obj, "created": created, "model": self.tier.model}

        def chunk(piece: str | None, kind: str, finish: str | None = None) -> Chunk:
            if self.endpoint == "chat":
                delta: dict[str, Any] = {kind: piece} if piece is not None else {}
                c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                c = {"index": 0, "text": piece or "", "finish_reason": finish}
            return Chunk({**head, "choices": [c]})

        p1 = _Phase()
        looped = False
        # Opened before the first yield: a caller that primes the generator sees connection errors (and can
        # fall back to another tier) before any byte went to the client.
        resp = await self.open_phase(thought_request(body, self.tier))
        # closed from here until the answer phase is answered, the stream is billed phase 1's usage once it came:
        # the upstream said what it processed (:meth:`spent`)
        self._closed_bill = functools.partial(self._thought_spent, p1)
        try:
            # the first chunk comes once phase 1 was answered, before it is read (completions: an empty text, as an
            # upstream may send to keep a stream alive): a caller that primes the stream (open_forced) or reads it
            # (_assemble) then holds a call that ran, whose failure is a failed stream's, billed what it read — a
            # completion's phase 1 broken before its first delta failed the priming and was billed nothing
            if self.endpoint == "chat":
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield Chunk({**head, "choices": [role]})
            else:
                yield chunk("", "text")
            async for piece, finish, usage, _ in _pieces(resp, self.endpoint):
                p1.usage = usage or p1.usage
                p1.finish_reason = finish or p1.finish_reason
                if piece:
                    p1.text += piece
                    yield chunk(piece, "reasoning")
                    if guard is not None and guard.feed(piece):
                        looped = True
                        break
        except PhaseError as exc:
            # the upstream's error ends the stream there, as on a tier without forcing: the relay passes it on and
            # meters the call as a failed stream (no answer is forced from a thought the engine gave up on) — billed
            # phase 1's usage when it came before (the bill stays: spent), as the relay bills a usage chunk it read
            yield exc.chunk
            return
        finally:
            await resp.aclose()
        used = token_count((p1.usage or {}).get("completion_tokens")) or 0  # no count (negative, a string): counted
        if looped or not used:
            used = await self.count(p1.text)
            p1.usage = {**(p1.usage or {}), "completion_tokens": used}
            p1.counted = True
        natural = p1.finish_reason == "stop" and not looped
        close = end_marker(self.tier) + "\n\n" if natural else self.tier.end_of_thinking
        if self.endpoint == "completions":
            yield chunk(close, "text")
        p2 = _Phase()
        req2 = answer_request(body, self.tier, self.endpoint, p1.text, natural, used)
        async with contextlib.aclosing(self._answer(req2, head, chunk, p1, used, p2)) as answer:
            async for item in answer:  # closed with this stream: its upstream response with it
                yield item
        if p2.failed:  # its error (and the bill before it) was the stream's end
            return
        usage = merge_usage(p1.usage, p2.usage, used)
        yield Chunk({**head, "choices": [], "usage": usage})
        yield DONE_CHUNK

    async def _answer(self, req2: dict[str, Any], head: dict[str, Any], chunk: Callable[..., Chunk], p1: _Phase,
                      used: int, p2: _Phase) -> AsyncGenerator[Chunk, None]:
        """Phase 2 (``req2``): its answer chunks, its usage into ``p2``. When it fails, the bill of what ran
        (:meth:`_spent`) comes first, then its error chunk (``p2.failed``) or its error raised (a broken, stalled
        or refused phase: the relay's error)."""
        sent = 0  # answer deltas passed on (≈ tokens on vLLM)
        answer: UpstreamResponse | None = None
        # a stream closed in this phase (the client gone, cut at max_stream_s) is billed what a failure here is
        # billed: the closure reads ``answer`` and ``sent`` as they are when asked (:meth:`spent`)
        self._closed_bill = lambda: self._answer_spent(head, p1, used, p2, req2 if answer is not None else None, sent)
        try:
            answer = await self.open_phase(req2)
            async for piece, finish, usage, calls in _pieces(answer, self.endpoint):
                p2.usage = usage or p2.usage
                if calls:  # the answer calls tools: relayed intact
                    delta = {"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}
                    sent += 1
                    yield Chunk({**head, "choices": [delta]})
                if piece or finish:
                    sent += bool(piece)
                    yield chunk(piece or None, "content" if self.endpoint == "chat" else "text", finish)
        except PhaseError as exc:
            if (bill := await self._spent(head, p1, used, p2, req2 if answer is not None else None, sent)):
                yield bill
            p2.failed = True
            yield exc.chunk
        except GatewayError:
            if (bill := await self._spent(head, p1, used, p2, req2 if answer is not None else None, sent)):
                yield bill
            raise
        finally:
            if answer is not None:
                await answer.aclose()

    async def spent(self) -> Spent | None:
        """(usage, its source) of a stream closed before its end — the client gone, or cut at ``limits.max_stream_s``;
        asked by the relay and the escalation peek once they closed it — by what the upstream is known to have run:

        - in its thought phase before phase 1's usage came: None, counted as any stream (the client's prompt and the
          deltas read), as a failure there is;
        - once phase 1's usage came (its usage chunk read: closed before phase 1's ``[DONE]``, between the phases, or
          while phase 2 is still opening): phase 1 as the upstream reported it, ``upstream`` — the counted estimate
          of the client's prompt and the deltas was no better than what the upstream had said;
        - phase 2 is billed from its answer (the 200 read, :meth:`_spent`): one still opening adds nothing. The 200
          is the gateway's only sign that the upstream read phase 2's prompt — before it, the request may be unsent,
          queued (a proxy, the engine's waiting queue) or refused, and vLLM answers 200 only once it has tokenized
          and accepted the prompt, and aborts a request whose connection closes before it is scheduled — so the
          gateway bills no call before its 200 (a phase 2 refused is billed nothing of it either);
        - once phase 2 was answered: what the same call is billed had it failed there (:meth:`_spent`: phase 1 as
          reported, phase 2's prompt, the answer deltas sent), ``counted`` — counting the client's prompt and the
          deltas, as for any stream, left phase 2's prompt (the thought re-read) out; ``upstream`` when phase 2's
          usage came too.

        ``upstream`` needs phase 1's completion count to be its report (not counted: the loop guard cut it, or its
        usage had none). None too when phase 1 reported no prompt count (:meth:`_spent`'s None).

        A stream that *failed* in its thought phase (broken, stalled, an error event) once phase 1's usage came is
        billed the same report, ``upstream`` — by the relay and the peek (which ask this when no usage chunk came
        before the failure) and, not streamed, by :meth:`_assemble` — as the relay bills any stream that fails after
        its usage chunk; before it came, None: counted as any failed stream."""
        return await self._closed_bill() if self._closed_bill is not None else None

    async def _thought_spent(self, p1: _Phase) -> Spent | None:
        """:meth:`spent` before phase 2 was answered: phase 1's usage as the upstream reported it (its completion as
        reasoning), once it came; None before."""
        if p1.counted or usage_counts(p1.usage) is None:
            return None
        assert p1.usage is not None
        return merge_usage(p1.usage, None, token_count(p1.usage.get("completion_tokens")) or 0), "upstream"

    async def _answer_spent(self, head: dict[str, Any], p1: _Phase, used: int, p2: _Phase,
                            req2: dict[str, Any] | None, sent: int) -> Spent | None:
        """:meth:`spent` in the answer phase (``req2`` None until phase 2 was answered): :meth:`_spent`'s bill,
        ``upstream`` when nothing of it is counted (phase 1 reported, and phase 2 reported or not answered)."""
        bill = await self._spent(head, p1, used, p2, req2, sent)
        if bill is None or bill.data is None:
            return None
        # nothing of it counted: phase 1 as reported, and phase 2 as reported or not answered (nothing of it billed)
        reported = not p1.counted and (usage_counts(p2.usage) is not None or (req2 is None and not sent))
        return bill.data["usage"], "upstream" if reported else "counted"

    async def _spent(self, head: dict[str, Any], p1: _Phase, used: int, p2: _Phase, req2: dict[str, Any] | None,
                     sent: int) -> Chunk | None:
        """The usage-only chunk of a call that failed in phase 2: what the upstream is known to have processed, in
        tokens, summed as a complete call's usage is (``reasoning_tokens`` = ``used``, phase 1's completion):

        - phase 1 as the upstream reported it (prompt, cached prompt, completion);
        - phase 2 as reported, when its usage came before the failure; else its prompt (``req2``, the phase-2 body)
          — completions: its prompt text tokenized; chat: phase 1's reported prompt plus the tokens of the
          assistant turn phase 2 adds (``"<think>\\n" + thought + close``: vLLM renders phase 2's prompt with
          ``continue_final_message`` as phase 1's followed by that text), tokenized by the tier's upstream, else
          estimated — and one completion token per answer delta sent (``sent``, as the relay counts a failed
          stream). The prompt is billed because the upstream answered phase 2 with 200, so it had read it (the
          relay's rule for any failed stream), and reported no usage; its cached part is unknown, so it is billed
          at the input rate. ``req2`` None: phase 2 was never answered (refused, no connection): nothing of it is
          known to have run, and nothing of it is billed.

        None when phase 1 reported no prompt count: nothing is known well enough to sum, and the call is counted as
        any failed stream (the relay; not streamed, :meth:`_assemble`): its first prompt and the deltas read."""
        prompt1 = token_count((p1.usage or {}).get("prompt_tokens"))
        if prompt1 is None:
            return None
        if usage_counts(p2.usage) is not None:
            phase2 = p2.usage
        else:
            prompt2 = 0
            if req2 is not None and self.endpoint == "completions":
                prompt2 = await self.count(req2["prompt"])
            elif req2 is not None:
                prompt2 = prompt1 + await self.count(req2["messages"][-1]["content"])
            phase2 = {"prompt_tokens": prompt2, "completion_tokens": sent}
        return Chunk({**head, "choices": [], "usage": merge_usage(p1.usage, phase2, used)})


async def open_forced(
    pool: UpstreamPool, tier: TierConfig, endpoint: WireEndpoint, body: dict[str, Any], count_prompt: PromptCounter
) -> SyntheticResponse:
    """Run budget forcing for ``body`` (the tier's upstream body) and return it as one upstream response.
    ``count_prompt``: the tokens of a request's prompt on ``tier`` (:class:`ForcedBudget`).

    Streams are primed up to the first chunk, so connection failures of the thought phase raise here
    (UpstreamUnavailable & co.) and the proxy can still fall back. Raises InvalidRequest for what forcing
    cannot serve (see :meth:`ForcedBudget.check`), and :class:`ForcedCallFailed` for a non-streamed call that
    failed once some of it had run. A stream's bill of a failed phase 2 is a usage-only chunk before its error
    (:meth:`ForcedBudget._spent`): the response says so (``counted_on_failure``), for the relay; the bill of one
    closed in phase 2 (the client gone, cut at its bound) is its ``spent`` (:meth:`ForcedBudget.spent`).
    """
    path = ENDPOINT_PATHS[endpoint]
    forced = ForcedBudget(tier, endpoint,
                          lambda phase: pool.open(tier, path, orjson.dumps(phase), stream=True),
                          functools.partial(pool.tokens, tier), count_prompt)
    forced.check(body)
    if body.get("stream") is not True:
        data = await forced.complete(body)
        return SyntheticResponse(data=data)
    chunks = forced.stream(body)
    first = await chunks.__anext__()
    return SyntheticResponse(events=chunks, head=[[first]], counted_on_failure=True, spent=forced.spent)


def _dicts(items: Any) -> list[dict[str, Any]]:
    """The objects of a JSON array an upstream sent (``choices``, ``tool_calls``); anything else in it, or an
    ``items`` that is no array, is nothing."""
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def _text(value: Any) -> str:
    """``value`` when it is text, else ``""`` (a malformed part an upstream sent is skipped)."""
    return value if isinstance(value, str) else ""
