"""Escalation (``tier.escalate_on``): whether a finished answer must be retried on the next tier, and the
peek that decides it for a stream before any byte of the weaker answer reaches the client.

Reasons: ``empty_answer`` (no answer text) and ``length_in_thought`` (stopped by ``length`` before the thought
closed). The proxy meters both calls: the first as its own usage record, the retry with route reason
``escalated``.
"""

from __future__ import annotations

from typing import Any

from gateway.config import TierConfig
from gateway.ledger.event import WireEndpoint
from gateway.openai.sse import Chunk
from gateway.thinking.forcing import end_marker
from gateway.upstream.response import SyntheticResponse, UpstreamResponse, chunk_batches


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


async def peek_stream(
    resp: UpstreamResponse, tier: TierConfig, endpoint: WireEndpoint, *, whole: bool = False
) -> tuple[SyntheticResponse, dict[str, Any]]:
    """Read an SSE response until its answer starts (a non-empty ``content``/``text`` delta) or it ends —
    with ``whole``, always to its end (checks on the answer's content need all of it).

    Returns (a response replaying everything read and then the rest, a summary for
    :func:`escalation_reason`: ``{"choices": [{"message"|"text": …, "finish_reason", "logprobs"?}], "usage"}``,
    ``logprobs.content`` gathered from the deltas when the upstream sent any). The thought (with ``whole``,
    the answer too) is buffered meanwhile, which is the price of escalating a streamed request before any
    byte of the weaker tier's answer reached the client.
    """
    head: list[list[Chunk]] = []
    rest = chunk_batches(resp)
    text = ""
    finish: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: list[Any] = []
    calls = False  # a tool-call delta: the answer has started
    marker = end_marker(tier)
    async for batch in rest:
        head.append(batch)
        for item in batch:
            data = item.data
            if data is None:
                continue
            usage = data.get("usage") or usage
            for c in data.get("choices") or ():
                part = c.get("text") if endpoint == "completions" else (c.get("delta") or {}).get("content")
                text += str(part or "")
                calls = calls or (endpoint == "chat" and bool((c.get("delta") or {}).get("tool_calls")))
                finish = c.get("finish_reason") or finish
                lp = c.get("logprobs")
                if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                    logprobs += lp["content"]
        # completions carry the thought in ``text`` too: the answer is what follows the end marker
        answer = text if endpoint == "chat" else (text.rsplit(marker, 1)[1] if marker in text else "")
        if (answer.strip() or calls) and not whole:
            break
    if endpoint == "chat":
        choice: dict[str, Any] = {"message": {"content": text}, "finish_reason": finish}
        if calls:
            choice["message"]["tool_calls"] = [{}]  # present; escalation_reason only asks whether there are any
    else:
        choice = {"text": text, "finish_reason": finish}
    if logprobs:
        choice["logprobs"] = {"content": logprobs}
    return SyntheticResponse(chunks=rest, head=head, closer=resp.aclose), {"choices": [choice], "usage": usage}
