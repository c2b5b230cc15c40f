"""Turn a complete response into Server-Sent Events, and a stream of chunks back into a complete response.

Both directions work on OpenAI's shapes (chat: ``chat.completion`` ↔ ``chat.completion.chunk``; completions:
``text_completion`` both ways), so a cached entry serves a streamed request and a non-streamed one alike:

- :func:`replay` yields ``data: {chunk}\\n\\n`` frames (:func:`replay_chunks`: the chunks): per choice a role chunk, the
  reasoning text
  (``reasoning_content`` / ``reasoning``, whichever names the upstream used; both in one delta where they carry the
  same thought), the content, tool calls, a
  finish chunk; then the usage chunk (``choices: []``) when the client asked for it; then ``data: [DONE]``.
  Concatenating the deltas gives back exactly the stored strings.
- :class:`StreamAssembler` folds parsed chunks into the non-stream body, tracks the last ``usage`` seen,
  counts content-bearing deltas (a fallback token count when a stream is cut before its usage chunk), and
  says whether the stream completed (every choice finished and ``[DONE]`` arrived).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.openai.sse import DONE_CHUNK, Chunk
from gateway.openai.usage import REASONING_FIELDS


def _pieces(text: str, size: int) -> Iterator[str]:
    for i in range(0, len(text), size):
        yield text[i : i + size]


def fresh_identity(body: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of the complete response ``body`` with a new ``id`` (``chatcmpl-`` or ``cmpl-`` and 32 hex
    digits, vLLM's shape) and ``created`` (Unix seconds, now): what a cached answer is served as, so that no two
    responses share an id (SDKs, tracing tools and logs key completions by it)."""
    prefix = "cmpl-" if body.get("object") == "text_completion" else "chatcmpl-"
    return {**body, "id": prefix + uuid.uuid4().hex, "created": int(time.time())}


def replay(body: dict[str, Any], include_usage: bool, chunk_chars: int = 16) -> Iterator[bytes]:
    """SSE frames replaying the complete response ``body`` (chat or text completion), ending with [DONE].

    ``chunk_chars``: characters per content delta (≥ 1). Raises ``KeyError`` if ``body`` has no ``choices``.
    """
    for c in replay_chunks(body, include_usage, chunk_chars):
        yield b"data: " + c.raw + b"\n\n"


class _Once:
    """A value handed out once, then None."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def take(self) -> Any:
        value, self.value = self.value, None
        return value


def replay_chunks(body: dict[str, Any], include_usage: bool, chunk_chars: int = 16) -> Iterator[Chunk]:
    """The chunks of :func:`replay` (the last one :data:`~gateway.openai.sse.DONE_CHUNK`)."""
    chat = body.get("object") != "text_completion"
    head: dict[str, Any] = {
        "id": body.get("id", ""),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body.get("created", 0),
        "model": body.get("model", ""),
    }
    if body.get("system_fingerprint") is not None:
        head["system_fingerprint"] = body["system_fingerprint"]
    extra = {"usage": None} if include_usage else {}

    def chunk(choice: dict[str, Any]) -> Chunk:
        return Chunk({**head, "choices": [choice], **extra})

    for choice in body["choices"]:
        idx = choice.get("index", 0)
        # the stored logprobs (if any) ride whole on the first content chunk (or the finish chunk): a client
        # concatenates the chunks' lists, so it gets back exactly the stored ones
        lp = _Once(choice.get("logprobs"))
        if chat:
            msg = choice.get("message") or {}
            yield chunk({"index": idx, "delta": {"role": msg.get("role", "assistant"), "content": ""},
                         "logprobs": None, "finish_reason": None})
            # the names that carry the same thought (vLLM sends one thought under both) replay together in each
            # delta, as they came: one chunk per name made the thought twice for a reader of either name
            # (/v1/messages and /v1/responses showed a cached answer's thinking twice)
            same: dict[str, list[str]] = {}
            for name in REASONING_FIELDS:
                if isinstance(text := msg.get(name), str) and text:
                    same.setdefault(text, []).append(name)
            for text, names in same.items():
                for piece in _pieces(text, chunk_chars):
                    yield chunk({"index": idx, "delta": dict.fromkeys(names, piece), "logprobs": None,
                                 "finish_reason": None})
            for piece in _pieces(msg.get("content") or "", chunk_chars):
                yield chunk({"index": idx, "delta": {"content": piece}, "logprobs": lp.take(), "finish_reason": None})
            for n, call in enumerate(msg.get("tool_calls") or []):
                yield chunk({"index": idx, "delta": {"tool_calls": [{"index": n, **call}]}, "logprobs": None,
                             "finish_reason": None})
            yield chunk({"index": idx, "delta": {}, "logprobs": lp.take(),
                         "finish_reason": choice.get("finish_reason")})
        else:
            for piece in _pieces(choice.get("text") or "", chunk_chars):
                yield chunk({"index": idx, "text": piece, "logprobs": lp.take(), "finish_reason": None})
            yield chunk({"index": idx, "text": "", "logprobs": lp.take(),
                         "finish_reason": choice.get("finish_reason")})
    if include_usage and body.get("usage") is not None:
        yield Chunk({**head, "choices": [], "usage": body["usage"]})
    yield DONE_CHUNK


#: Characters a delta of :func:`answer_chunks` carries: ~one token (the gateway's estimate, 4 characters a token), as
#: vLLM streams one token a delta — so a relay that counts the deltas of an answer sent with no usage it can meter
#: (``gateway/pipeline/relay.py``'s ``count_deltas``) counts about the answer's tokens, not a quarter of them.
ANSWER_DELTA_CHARS = 4


def answer_chunks(body: dict[str, Any]) -> Iterator[Chunk]:
    """The stream a complete answer ``body`` (chat or text completion) would have been: :func:`replay_chunks`, one
    token's worth of text a delta (:data:`ANSWER_DELTA_CHARS`), then the usage chunk (``choices: []``) whenever
    ``body`` has a usage — a relay holds it back, meters it and forwards it only when the client asked — then
    [DONE]. For an upstream that answered a stream request with the whole answer as one JSON document. Raises
    ``KeyError`` if ``body`` has no ``choices``, ``TypeError`` / ``AttributeError`` for parts not of their types."""
    usage = body.get("usage")
    head: dict[str, Any] = {}
    for c in replay_chunks(body, False, ANSWER_DELTA_CHARS):
        if c.data is None and usage is not None:
            yield Chunk({**head, "choices": [], "usage": usage})
        elif c.data is not None:
            head = {k: v for k, v in c.data.items() if k != "choices"}
        yield c


@dataclass
class _Choice:
    index: int
    role: str = "assistant"
    content: list[str] = field(default_factory=list)
    reasoning: dict[str, list[str]] = field(default_factory=dict)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    #: the chunks' logprobs folded: chat ``{"content": [...], "refusal": [...]}``, completions ``{"tokens": [...],
    #: "token_logprobs", "top_logprobs", "text_offset"}`` (lists concatenated); None when no chunk had any
    logprobs: dict[str, list[Any]] | None = None

    def fold_logprobs(self, lp: Any) -> None:
        if not isinstance(lp, dict):
            return
        if self.logprobs is None:
            self.logprobs = {}
        for k, v in lp.items():
            if isinstance(v, list):
                self.logprobs.setdefault(k, []).extend(v)


class StreamAssembler:
    """Folds streamed chunks (parsed JSON objects) into the equivalent non-stream response body."""

    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}
        self._head: dict[str, Any] = {}
        self.chat = True
        self.usage: dict[str, Any] | None = None
        self.deltas = 0  # content/reasoning/text deltas seen: ≈ completion tokens when usage never came
        self.done = False
        #: a part was not of its type (a choice or tool-call ``index`` that is no integer, a text that is no string):
        #: skipped, and the answer never :attr:`complete` (not cached) — folded, it raised mid-stream or in
        #: :meth:`result` as the relay closed the call, which then went unmetered
        self.malformed = False

    def feed_payload(self, payload: bytes) -> dict[str, Any] | None:
        """Feed one SSE ``data:`` payload; returns the parsed chunk (None for ``[DONE]``)."""
        if payload.strip() == b"[DONE]":
            self.done = True
            return None
        obj = orjson.loads(payload)
        self.feed(obj)
        return obj if isinstance(obj, dict) else None

    def feed_payloads(self, payloads: list[bytes]) -> None:
        """Feed raw ``data:`` payloads as a relay sees them; unparsable ones are skipped."""
        for payload in payloads:
            try:
                self.feed_payload(payload)
            except orjson.JSONDecodeError:
                continue

    def feed(self, chunk: dict[str, Any]) -> None:
        """Feed one parsed chunk (non-dict payloads are ignored)."""
        if not isinstance(chunk, dict):
            return
        if not self._head:
            self.chat = chunk.get("object") != "text_completion"
            self._head = {k: chunk[k] for k in ("id", "created", "model", "system_fingerprint") if k in chunk}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            index = c.get("index")
            index = 0 if index is None else index  # absent or null: choice 0, as the relay's tally reads it
            if type(index) is not int:
                self.malformed = True
                continue
            st = self._choices.get(index)
            if st is None:
                st = self._choices[index] = _Choice(index)
            st.fold_logprobs(c.get("logprobs"))
            if self.chat:
                self._fold_delta(st, c.get("delta") or {})
            elif c.get("text"):
                if self._is_text(c["text"]):
                    st.content.append(c["text"])
                self.deltas += 1
            if c.get("finish_reason") is not None:
                st.finish_reason = c["finish_reason"]

    def _fold_delta(self, st: _Choice, delta: dict[str, Any]) -> None:
        if delta.get("role"):
            st.role = delta["role"]
        bearing = False
        if delta.get("content"):
            if self._is_text(delta["content"]):
                st.content.append(delta["content"])
            bearing = True
        for name in REASONING_FIELDS:
            if delta.get(name):
                if self._is_text(delta[name]):
                    st.reasoning.setdefault(name, []).append(delta[name])
                bearing = True
        calls = delta.get("tool_calls") or []
        for call in calls if isinstance(calls, list) else ():
            fn = (call.get("function") or {}) if isinstance(call, dict) else None
            index = (call.get("index") or 0) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or type(index) is not int:
                self.malformed = True
                continue
            slot = st.tool_calls.setdefault(index, {"function": {"arguments": ""}})
            for k in ("id", "type"):
                if call.get(k):
                    slot[k] = call[k]
            if fn.get("name"):
                slot["function"]["name"] = fn["name"]
            if self._is_text(args := fn.get("arguments") or ""):
                slot["function"]["arguments"] += args
            bearing = True
        if not isinstance(calls, list):
            self.malformed = True
        self.deltas += int(bearing)

    def _is_text(self, value: Any) -> bool:
        """Whether ``value`` is a string (text a delta may carry); else the answer is :attr:`malformed`."""
        if isinstance(value, str):
            return True
        self.malformed = True
        return False

    @property
    def complete(self) -> bool:
        """True when ``[DONE]`` arrived, every choice has a finish reason and no part was :attr:`malformed` (worth
        caching)."""
        return (self.done and not self.malformed and bool(self._choices)
                and all(c.finish_reason for c in self._choices.values()))

    def text_chars(self) -> int:
        """Characters of content + reasoning received (for counting when usage is missing)."""
        return sum(len("".join(c.content)) + sum(len("".join(v)) for v in c.reasoning.values())
                   for c in self._choices.values())

    def result(self) -> dict[str, Any]:
        """The non-stream body: ``chat.completion`` or ``text_completion``, with ``usage`` when one was seen."""
        choices: list[dict[str, Any]] = []
        for idx in sorted(self._choices):
            st = self._choices[idx]
            if self.chat:
                # OpenAI's (and vLLM's) answer that only calls tools has ``"content": null``, not "": a cached
                # stream served as JSON said "" where the live answer said null
                content = "".join(st.content)
                msg: dict[str, Any] = {"role": st.role, "content": content if content or not st.tool_calls else None}
                for name, parts in st.reasoning.items():
                    msg[name] = "".join(parts)
                if st.tool_calls:
                    msg["tool_calls"] = [st.tool_calls[i] for i in sorted(st.tool_calls)]
                choices.append({"index": idx, "message": msg, "logprobs": st.logprobs,
                                "finish_reason": st.finish_reason})
            else:
                choices.append({"index": idx, "text": "".join(st.content), "logprobs": st.logprobs,
                                "finish_reason": st.finish_reason})
        body: dict[str, Any] = {
            "id": self._head.get("id", ""),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self._head.get("created", 0),
            "model": self._head.get("model", ""),
            "choices": choices,
        }
        if "system_fingerprint" in self._head:
            body["system_fingerprint"] = self._head["system_fingerprint"]
        if self.usage is not None:
            body["usage"] = self.usage
        return body
