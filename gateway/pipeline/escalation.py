"""Escalation (``tier.escalate_on``): whether a finished answer must be retried on the next tier, and the
peek that decides it for a stream before any byte of the weaker answer reaches the client.

Reasons: ``empty_answer`` (no answer text) and ``length_in_thought`` (stopped by ``length`` before the thought
closed); ``learned`` (:func:`learned_reason`): the tier's answer-aware model (``tier.escalation_model``, from the
router file's ``metadata.serving.cascade.models``) gives P(wrong) ≥ its threshold, on the features
:func:`router.escalation.answer_features` computes from what the gateway has — answer, thought, usage, finish
reason, the routed question and its router score (:func:`serving_features`; the fit computes the same function on
the recorded answers). The proxy meters both calls: the first as its own usage record, the retry with route
reason ``escalated``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio

from gateway.config import TierConfig
from gateway.errors import UpstreamError, UpstreamStreamError
from gateway.ledger.event import WireEndpoint
from gateway.openai.chunks import StreamAssembler
from gateway.openai.sse import Chunk, StreamTally
from gateway.thinking.forcing import end_marker
from gateway.upstream.response import SyntheticResponse, UpstreamResponse, chunk_batches
from router.escalation import answer_features, should_escalate


def escalation_reason(tier: TierConfig, data: dict[str, Any], endpoint: WireEndpoint) -> str | None:
    """Why a finished non-streamed answer should be retried on the next tier, per ``tier.escalate_on``.

    ``length_in_thought``: the first choice stopped by ``length`` with no answer text (cut in its thought);
    ``empty_answer``: no answer text at all (a chat answer that calls tools has one: never escalated). Returns
    the reason, or None. For completions the answer is the text after the last ``</think>`` (all of it when
    there is no marker).
    """
    if not tier.escalate_on:
        return None
    choices = data.get("choices") or []
    if not choices:
        return "empty_answer" if "empty_answer" in tier.escalate_on else None
    c = choices[0]
    if endpoint == "chat" and (c.get("message") or {}).get("tool_calls"):
        return None  # a tool call is the answer (its content is empty by design)
    if endpoint == "chat":
        answer = str((c.get("message") or {}).get("content") or "")
    else:
        text = str(c.get("text") or "")
        marker = end_marker(tier)
        answer = text.rsplit(marker, 1)[1] if marker in text else ("" if c.get("finish_reason") == "length" else text)
    if answer.strip():
        return None
    if "length_in_thought" in tier.escalate_on and c.get("finish_reason") == "length":
        return "length_in_thought"
    if "empty_answer" in tier.escalate_on:
        return "empty_answer"
    return None


def cut_by_client(summary: dict[str, Any], asked: Any, tier: TierConfig) -> bool:
    """True when the answer in ``summary`` stopped on ``length`` at the client's own bound: ``asked`` (its
    ``max_completion_tokens``/``max_tokens``) is at most the tier's ``max_tokens``. The next tier would be held to
    the same bound, so escalating pays a second call for the same cut answer — the client asked for that."""
    if not isinstance(asked, int) or isinstance(asked, bool) or asked <= 0 or asked > tier.max_tokens:
        return False
    choices = summary.get("choices") or []
    return bool(choices) and isinstance(choices[0], dict) and choices[0].get("finish_reason") == "length"


def serving_features(data: dict[str, Any], endpoint: WireEndpoint, tier: TierConfig, question: str | None,
                     score: float | None) -> list[float] | None:
    """:func:`router.escalation.answer_features` of the first choice of ``data`` (an OpenAI response, or the
    stream summary of :func:`peek_stream`): chat ``message.content`` / completions text after the end marker as
    the answer, ``message.reasoning`` (or ``reasoning_content``) / the text before the marker as the thought,
    ``usage.completion_tokens`` and ``usage.completion_tokens_details.reasoning_tokens``, ``finish_reason``.
    None when there is no choice."""
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    if endpoint == "chat":
        msg = c.get("message") or {}
        answer = str(msg.get("content") or "")
        thought = str(msg.get("reasoning") or msg.get("reasoning_content") or "")
    else:
        text, marker = str(c.get("text") or ""), end_marker(tier)
        thought, _, answer = text.rpartition(marker) if marker in text else ("", "", text)
    u = data.get("usage")
    usage: dict[str, Any] = u if isinstance(u, dict) else {}
    d = usage.get("completion_tokens_details")
    details: dict[str, Any] = d if isinstance(d, dict) else {}
    ct, rt = usage.get("completion_tokens"), details.get("reasoning_tokens")
    return answer_features(answer, thought, completion_tokens=float(ct) if isinstance(ct, int | float) else None,
                           reasoning_tokens=float(rt) if isinstance(rt, int | float) else None,
                           finish_reason=c.get("finish_reason"), question=question, score=score,
                           phrases=tier.abstain_phrases)


def learned_reason(tier: TierConfig, data: dict[str, Any], endpoint: WireEndpoint, question: str | None,
                   score: float | None) -> str | None:
    """``"learned"`` when ``learned`` is in ``tier.escalate_on`` and the tier's escalation model says the answer
    in ``data`` is likely wrong (:func:`router.escalation.should_escalate` on :func:`serving_features`; a tool-call
    answer is never escalated); else None. ``question``: the routed text (``RouteDecision.window``), ``score``:
    its router score (``RouteDecision.difficulty``)."""
    model = tier.escalation_model
    if "learned" not in tier.escalate_on or model is None:
        return None
    choices = data.get("choices") or []
    if endpoint == "chat" and choices and isinstance(choices[0], dict) and \
            (choices[0].get("message") or {}).get("tool_calls"):
        return None
    x = serving_features(data, endpoint, tier, question, score)
    return "learned" if x is not None and should_escalate(model, x) else None


class PeekBroken(Exception):
    """A stream that failed while :func:`peek_stream` read it: ``cause`` (the error: the transport's, or with
    ``reported`` an :class:`~gateway.errors.UpstreamError` ``upstream_error`` for the upstream's own in-stream error
    event), ``counted`` (the deltas read before it, as in a summary's ``counted``) — the attempt is billed those,
    unless ``usage`` (the usage the upstream sent before failing: its usage chunk, or continuous usage stats'
    running totals; None when none) says what ran."""

    def __init__(self, cause: BaseException, counted: dict[str, int], *, reported: bool = False,
                 usage: dict[str, Any] | None = None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.counted = counted
        self.reported = reported
        self.usage = usage


def counted(tally: StreamTally) -> dict[str, int]:
    """``{"completion_tokens", "reasoning_tokens"}``: the deltas ``tally`` read (one token each)."""
    completion, reasoning = tally.counted()
    return {"completion_tokens": completion, "reasoning_tokens": reasoning}


#: how many chunks that carry something other than content :func:`peek_stream` reads, at most, for the start of an
#: escalation's stream (``start``) before relaying it: parts the gateway does not read as content (a ``refusal``
#: delta, a newer field) may be what the client waits for. Counted in chunks, not network reads, so that the same
#: bytes are handled alike however the network split them.
START_CHUNKS = 8

#: how many content-less chunks (:func:`contentless`: a role-only first chunk, empty deltas, a usage-only chunk)
#: :func:`peek_stream` holds, at most, for the start of an escalation's stream: they show the client nothing, so
#: holding them until the first content (or the stream's end) costs it nothing, and a stream that ends after them
#: without ``[DONE]`` is still a failed call before the 200. Bounded only so that an upstream that sends nothing
#: else cannot grow the buffer without end (a few hundred kB); past it the stream is relayed as it comes.
START_IDLE_CHUNKS = 1024


async def peek_stream(
    resp: UpstreamResponse, tier: TierConfig, endpoint: WireEndpoint, *, tally: StreamTally, whole: bool = False,
    start: bool = False, deadline: float = math.inf, patience: float = 0.0,
) -> tuple[SyntheticResponse, dict[str, Any]]:
    """Read an SSE response until its answer starts (a non-empty ``content``/``text`` delta) or it ends —
    with ``whole``, always to its end (checks on the answer's content need all of it); with ``start`` (an
    escalation's call that is not peeked for escalation: the last tier of a cascade), only until its first chunk
    that carries content — a reasoning, content or tool-call delta — or :data:`START_CHUNKS` chunks that carry
    something else, whichever comes first (content-less chunks, :func:`contentless`, are held on: they show the
    client nothing; at most :data:`START_IDLE_CHUNKS`): nothing is buffered beyond what the client would wait for
    anyway, and a stream that fails before it (at its very start) fails here, while the held answer can still be
    served. What decides is the order in the stream, never how the network split it into reads: a stream that
    ends (or breaks) before its first content is a failed call before the 200; one whose first content came first
    is relayed from there — then its break is the relay's, an in-stream error — even when its end arrived in the
    same read.

    Returns (a response replaying everything read and then the rest, a summary for
    :func:`escalation_reason`: ``{"choices": [{"message"|"text": …, "finish_reason", "logprobs"?}], "usage"}``,
    plus ``"counted": {"completion_tokens", "reasoning_tokens"}`` — the deltas read — when no usage came,
    ``logprobs.content`` gathered from the deltas when the upstream sent any). The thought (with ``whole``,
    the answer too) is buffered meanwhile, which is the price of escalating a streamed request before any
    byte of the weaker tier's answer reached the client.

    A stream that fails before the answer is decided raises :class:`PeekBroken` (``resp`` closed): one that broke
    or stalled, one that sent an in-stream error event (``{"error": …}``, as vLLM and OpenAI send when the
    generation fails after the 200 headers), and one that ended while read — its connection closed normally —
    without ``[DONE]`` (an :class:`~gateway.errors.UpstreamStreamError`, the break the relay reads in a stream that
    ends so after its 200) — a failed call, not an answer with no finish reason.

    Cancelled while it reads (the client went away: ``Proxy._unless_disconnected``), it closes ``resp`` — the
    upstream call: a generation nobody will read would run on to its end otherwise (vLLM aborts a request whose
    connection closed) — and re-raises; ``tally`` (the caller's, new: the deltas are counted into it as they are
    read, see :func:`counted`) then says what the call had generated.

    ``deadline`` (``time.monotonic()``; none by default): the stream's ``limits.max_stream_s``. Reached — after a batch,
    or while waiting for one (a wait is bounded by the time left only once that is shorter than ``patience``, the
    longest a wait lasts before the upstream's own timeouts end it: no timer per batch before) — the read stops
    there, the answer undecided: the summary says ``"cut": True`` (else False) and the response replays what was
    read, for the relay to pass on and cut (``resp`` is closed by it; its reader may have been ended by the wait's
    cancellation)."""
    whole = not start and (whole or "learned" in tier.escalate_on)  # the answer-aware model reads the whole answer
    head: list[list[Chunk]] = []
    rest = chunk_batches(resp)
    assembler = StreamAssembler()  # the one stream assembler (the cache's), read as far as needed
    logprobs: list[Any] = []
    marker = end_marker(tier)
    ended = cut = False
    held = _StartRead()
    try:
        while True:
            left = deadline - time.monotonic()
            if left > patience:  # no timer while the upstream's timeouts end a stall before the bound
                batch = await anext(rest, None)
            elif left <= 0:
                cut = True
                break
            else:
                with anyio.move_on_after(left) as waited:
                    batch = await anext(rest, None)
                if waited.cancelled_caught:
                    cut = True
                    break
            if batch is None:
                ended = True  # read to its end: not stopped at the answer (its start, an error event) first
                break
            head.append(batch)
            tally.feed(batch)
            _assemble(batch, assembler, logprobs)
            if tally.upstream_error:  # the upstream's error event: nothing follows it
                break
            if start:
                if held.enough(batch, tally):
                    break
            elif not whole and _answer_started(assembler.result(), endpoint, marker):
                break
    except Exception as exc:  # the stream broke or stalled while read: what it had sent is billed all the same
        await resp.aclose()
        # with the usage it sent before breaking, as the relay meters a break: a forced stream's bill of a failed
        # answer phase (phase 2's prompt in it) comes so, and counting the deltas left that prompt out
        raise PeekBroken(exc, counted(tally), usage=_reported(tally)) from exc
    except BaseException:  # cancelled (see the docstring): the call is closed now, shielded from the cancellation
        with anyio.CancelScope(shield=True):
            await resp.aclose()
        raise
    if ended and not tally.done and not tally.upstream_error:
        # it ended without [DONE] (nor an error event) before anything reached the client: cut short, not an
        # answer — a broken stream, as the relay reads one after its 200
        await resp.aclose()
        raise PeekBroken(UpstreamStreamError("the stream ended without [DONE]"), counted(tally),
                         usage=_reported(tally))
    if tally.upstream_error:  # the call failed after its headers, as the relay meters an error event it passes on
        await resp.aclose()
        error = UpstreamError(f"upstream of tier {tier.name!r} sent an error mid-stream: {_error_message(head)}")
        raise PeekBroken(error, counted(tally), reported=True, usage=_reported(tally))
    summary = _summary(assembler, endpoint, logprobs)
    summary["cut"] = cut  # stopped at the deadline, undecided
    if summary["usage"] is None:  # none came: the running totals, or the deltas read
        summary["usage"] = tally.last_usage
        summary["counted"] = counted(tally)
    forced = resp if isinstance(resp, SyntheticResponse) else None  # a forced stream's ways to bill, kept
    return SyntheticResponse(chunks=rest, head=head, closer=resp.aclose,
                             counted_on_failure=forced is not None and forced.counted_on_failure,
                             spent=forced.spent if forced is not None else None), summary


def _assemble(batch: list[Chunk], assembler: StreamAssembler, logprobs: list[Any]) -> None:
    """Feed ``batch`` to ``assembler``; the ``logprobs.content`` entries of its choices onto ``logprobs``."""
    for item in batch:
        if item.data is None:
            continue
        assembler.feed(item.data)
        for c in item.data.get("choices") or ():
            lp = c.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                logprobs += lp["content"]


def _reported(tally: StreamTally) -> dict[str, Any] | None:
    """The usage a stream sent before it failed (:class:`PeekBroken`'s ``usage``): its usage-only chunk (on a forced
    stream, the gateway's bill of a failed answer phase), else continuous usage stats' running totals; None."""
    usage = tally.usage_chunk["usage"] if tally.usage_chunk is not None else tally.last_usage
    return usage if isinstance(usage, dict) else None


class _StartRead:
    """Where :func:`peek_stream`'s ``start`` read stops: its first content, or its bounds (:data:`START_CHUNKS`,
    :data:`START_IDLE_CHUNKS`), counted in chunks."""

    def __init__(self) -> None:
        self.idle = 0  # content-less chunks read
        self.other = 0  # chunks that carry something the tally does not count as content

    def enough(self, batch: list[Chunk], tally: StreamTally) -> bool:
        """Whether to stop after ``batch`` (already fed to ``tally``) and relay from there."""
        if tally.saw_text:
            # its first content is the client's to have now; an end in this same read is then the relay's to report,
            # as it would be had the end come in a read of its own (the network's split decides nothing)
            return True
        for item in batch:
            if item.data is not None:
                if contentless(item.data):
                    self.idle += 1
                else:
                    self.other += 1
        return self.other >= START_CHUNKS or self.idle >= START_IDLE_CHUNKS


def contentless(chunk: dict[str, Any]) -> bool:
    """Whether a stream chunk (one decoded ``data:`` event) shows the client nothing: no choices (a usage-only
    chunk), or choices whose chat ``delta`` holds nothing but ``role`` and empty values (vLLM's role-only first chunk,
    an empty keep-alive delta, a bare finish) and whose completions ``text`` is empty. An error event is not."""
    if "error" in chunk and not chunk.get("choices"):
        return False
    choices = chunk.get("choices")
    if not choices:
        return True
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            return False
        delta = c.get("delta")
        if delta is None:
            if c.get("text"):
                return False
        elif not isinstance(delta, dict) or any(v for k, v in delta.items() if k != "role"):
            return False
    return True


def _error_message(head: list[list[Chunk]]) -> str:
    """The message of the in-stream error event among the batches read (the last one's), at most 300 characters."""
    for batch in reversed(head):
        for item in reversed(batch):
            if item.data is not None and "error" in item.data and not item.data.get("choices"):
                error = item.data["error"]
                message = error.get("message") if isinstance(error, dict) else error
                return str(message or "no message")[:300]
    return "no message"


def _joined(body: dict[str, Any], endpoint: WireEndpoint) -> tuple[str, str, bool, str | None]:
    """(answer text, thought, any tool call, last finish reason) over the choices of an assembled body."""
    text = thought = ""
    calls, finish = False, None
    for c in body["choices"]:
        if endpoint == "completions":
            text += c.get("text") or ""
        else:
            msg = c.get("message") or {}
            text += msg.get("content") or ""
            thought += msg.get("reasoning") or msg.get("reasoning_content") or ""
            calls = calls or bool(msg.get("tool_calls"))
        finish = c.get("finish_reason") or finish
    return text, thought, calls, finish


def _answer_started(body: dict[str, Any], endpoint: WireEndpoint, marker: str) -> bool:
    """Whether the answer has begun: content (or a tool call) on chat; on completions, text after the thought's
    end marker (completions carry the thought in ``text`` too)."""
    text, _, calls, _ = _joined(body, endpoint)
    answer = text if endpoint == "chat" else (text.rsplit(marker, 1)[1] if marker in text else "")
    return bool(answer.strip()) or calls


def _summary(assembler: StreamAssembler, endpoint: WireEndpoint, logprobs: list[Any]) -> dict[str, Any]:
    """The summary :func:`escalation_reason` reads (see :func:`peek_stream`)."""
    text, thought, calls, finish = _joined(assembler.result(), endpoint)
    if endpoint == "chat":
        choice: dict[str, Any] = {"message": {"content": text}, "finish_reason": finish}
        if thought:
            choice["message"]["reasoning"] = thought
        if calls:
            choice["message"]["tool_calls"] = [{}]  # present; escalation_reason only asks whether there are any
    else:
        choice = {"text": text, "finish_reason": finish}
    if logprobs:
        choice["logprobs"] = {"content": logprobs}
    return {"choices": [choice], "usage": assembler.usage}
