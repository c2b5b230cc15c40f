"""The Anthropic Messages API (``POST /v1/messages``) translated onto chat completions, and back. Pure: no I/O.

Shapes follow Anthropic's API reference ("Messages", "Streaming Messages", "Errors") and the anthropic-python
types; the mapping is the one LiteLLM's Anthropic adapter makes:

- :func:`to_chat` — a Messages body → a chat-completions body, plus the requested :class:`Thinking`
  (raises :class:`~gateway.errors.InvalidRequest`);
- :func:`message_object` — a ``chat.completion`` → a ``message`` (content blocks ``thinking`` — only when the
  request turned thinking on, as Anthropic's API —, ``text``, ``tool_use``; ``stop_reason``; ``usage``);
- :class:`MessageStream` — ``chat.completion.chunk`` objects → Anthropic's events (``message_start``,
  ``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``,
  ``input_json_delta``) / ``content_block_stop``, ``message_delta`` with ``stop_reason`` and usage,
  ``message_stop``; an in-stream failure is an ``error`` event);
- :func:`error_body` — a :class:`~gateway.errors.GatewayError` in Anthropic's error shape.

Validation parity with Anthropic's API: ``thinking: {type: enabled}`` needs ``budget_tokens`` below
``max_tokens`` (thinking tokens count toward ``max_tokens``; 400 ``invalid_request_error`` with Anthropic's
message), except under the ``interleaved-thinking-*`` beta, where the budget spans all the turn's thinking
blocks and may exceed it. Relaxed on purpose: Anthropic's ``budget_tokens >= 1024`` is ``>= 1`` here — the
local tiers think in tens of tokens (``thinking_budget: 8`` / ``48`` in the shipped config), so 1024 would
refuse every budget they can honour; and the sampling limits Anthropic sets while thinking (``temperature``
1 only, no ``top_k``) are not applied, since a local upstream samples fine with them.

Usage (tokens): ``input_tokens`` = ``prompt_tokens`` − cached, ``cache_read_input_tokens`` = the upstream's
``prompt_tokens_details.cached_tokens`` (Anthropic counts cache reads apart from ``input_tokens``),
``cache_creation_input_tokens`` = 0, ``output_tokens`` = ``completion_tokens`` (thinking included, as
Anthropic bills it), ``output_tokens_details.thinking_tokens`` = ``reasoning_tokens``. The chat upstream reports
usage only at the end of a stream, so ``message_start`` carries zeros and ``message_delta`` the final counts
(the SDK's accumulator takes ``input_tokens`` and the cache counts from ``message_delta``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.errors import GatewayError, InvalidRequest
from gateway.stream_index import stream_index

TRANSLATED = ("model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "metadata",
              "stream", "tools", "tool_choice", "thinking")
#: accepted and not acted on
IGNORED = ("service_tier", "container", "context_management", "inference_geo", "output_config")
#: refused with a 400 (no meaning on a chat upstream)
REFUSED = ("mcp_servers",)
#: chat's several-answers fields: a message has one answer, so passed through they billed every choice and showed
#: one (``n: 8`` cost eight); refused unless 1, as Anthropic refuses fields it does not define
ONE_ANSWER = ("n", "best_of")

#: the ``anthropic-beta`` flag (prefix; dated versions) under which ``budget_tokens`` may exceed ``max_tokens``
INTERLEAVED_BETA = "interleaved-thinking-"

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}


@dataclass(frozen=True, slots=True)
class Thinking:
    """The request's ``thinking``: ``enabled`` with ``budget_tokens``, ``disabled``, or None (not given)."""

    enabled: bool
    budget_tokens: int | None = None


def new_id(prefix: str = "msg") -> str:
    """``<prefix>_<32 hex>`` (``msg``, ``toolu``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _block_text(block: dict[str, Any]) -> str:
    """A text block's ``text`` (raises InvalidRequest without one: Anthropic's 400, where it was sent on as an
    empty prompt and billed)."""
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest("text content blocks must have a string 'text'", param="text")
    return text


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    src: dict[str, Any] = block["source"] if isinstance(block.get("source"), dict) else {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        url = f"data:{src.get('media_type') or 'image/png'};base64,{src['data']}"
    elif src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise InvalidRequest(f"{where}: image source must be base64 or url", param=where)
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") != "text":
                raise InvalidRequest(f"{where}.{i}: tool_result content must be text blocks", param=f"{where}.{i}")
            parts.append(_block_text(b))
        return "".join(parts)
    raise InvalidRequest(f"{where} must be a string or an array of text blocks", param=where)


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _user_turn(content: Any, where: str) -> list[dict[str, Any]]:
    """A user message: its ``tool_result`` blocks as ``tool`` messages (first, in order), then the rest."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or an array of content blocks", param=where)
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, b in enumerate(content):
        at = f"{where}.{i}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _block_text(b)})
        elif kind == "image":
            parts.append(_image(b, at))
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise InvalidRequest(f"{at}: tool_result needs 'tool_use_id'", param=at)
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                          "content": _tool_result_text(b.get("content"), f"{at}.content")})
        else:
            raise InvalidRequest(f"{at}: content block type {kind!r} is not supported in a user message", param=at)
    out = list(tools)
    if parts:
        out.append({"role": "user", "content": _joined(parts)})
    return out


def _assistant_turn(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or an array of content blocks", param=where)
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, b in enumerate(content):
        at = f"{where}.{i}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(_block_text(b))
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise InvalidRequest(f"{at}: tool_use needs 'id' and 'name'", param=at)
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": orjson.dumps(b.get("input") or {}).decode()}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the upstream thinks again; a chat template drops earlier thoughts anyway
        else:
            raise InvalidRequest(f"{at}: content block type {kind!r} is not supported in an assistant message",
                                 param=at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _system(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in system):
        return "".join(_block_text(b) for b in system)
    raise InvalidRequest("'system' must be a string or an array of text blocks", param="system")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequest(f"tools.{i}: only client tools (name, input_schema) are supported, got {kind!r}",
                                 param=f"tools.{i}")
        fn: dict[str, Any] = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, out: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise InvalidRequest("'tool_choice.type' must be auto, any, tool (with name) or none", param="tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False


def thinking_of(body: dict[str, Any]) -> Thinking | None:
    """The request's ``thinking`` (raises InvalidRequest for a malformed one). ``adaptive`` counts as
    enabled without a budget."""
    t = body.get("thinking")
    if t is None:
        return None
    kind = t.get("type") if isinstance(t, dict) else None
    if kind == "disabled":
        return Thinking(False)
    if kind == "adaptive":
        return Thinking(True)
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise InvalidRequest("'thinking.budget_tokens' must be an integer >= 1", param="thinking.budget_tokens")
        return Thinking(True, budget)
    raise InvalidRequest("'thinking.type' must be enabled, disabled or adaptive", param="thinking.type")


def interleaved(beta_header: str | None) -> bool:
    """True when an ``anthropic-beta`` header (comma-separated flags) turns on interleaved thinking."""
    return any(f.strip().startswith(INTERLEAVED_BETA) for f in (beta_header or "").split(","))


def check_budget(thinking: Thinking | None, max_tokens: int, *, interleaved: bool = False) -> None:
    """Anthropic's rule ``thinking.budget_tokens < max_tokens`` (waived under interleaved thinking). Raises
    InvalidRequest (400, ``param: thinking.budget_tokens``) with Anthropic's message."""
    if interleaved or thinking is None or thinking.budget_tokens is None:
        return
    if thinking.budget_tokens >= max_tokens:
        raise InvalidRequest(
            f"`max_tokens` must be greater than `thinking.budget_tokens` (got max_tokens {max_tokens}, "
            f"budget_tokens {thinking.budget_tokens}): thinking tokens count toward max_tokens",
            param="thinking.budget_tokens")


def _refuse(body: dict[str, Any]) -> None:
    """Raise InvalidRequest for a field of :data:`REFUSED` that is set, or of :data:`ONE_ANSWER` other than 1."""
    for name in REFUSED:
        if body.get(name):
            raise InvalidRequest(f"'{name}' is not supported by this gateway", param=name)
    for name in ONE_ANSWER:
        if body.get(name) not in (None, 1):
            raise InvalidRequest(f"{name}: Extra inputs are not permitted", param=name)


def to_chat(body: dict[str, Any], *, interleaved: bool = False, budget_rule: bool = True) -> dict[str, Any]:
    """The chat-completions body for a Messages request (see the module doc; ``thinking``: ``disabled`` →
    ``chat_template_kwargs.enable_thinking: false``, ``enabled`` → vLLM's ``thinking_token_budget``, which
    the tier's own budget caps). Fields not in :data:`TRANSLATED`, :data:`IGNORED` or :data:`REFUSED` pass
    through (``top_k`` and other vLLM extras). ``interleaved``: the interleaved-thinking beta is on (the budget
    may exceed ``max_tokens``); ``budget_rule=False`` skips :func:`check_budget` (``count_tokens``, which has
    no ``max_tokens``). Raises InvalidRequest (400, ``param`` names the field)."""
    _refuse(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required", param="model")
    mt = body.get("max_tokens")
    if mt is None:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise InvalidRequest(f"max_tokens: must be an integer >= 1, got {str(mt)[:40]!r}", param="max_tokens")
    out: dict[str, Any] = {k: v for k, v in body.items()
                           if k not in TRANSLATED and k not in IGNORED and k not in REFUSED and k not in ONE_ANSWER}
    out.update(model=model, messages=_chat_messages(body), max_tokens=mt)
    _sampling(body, out)
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], out)
    thinking = thinking_of(body)
    if budget_rule:
        check_budget(thinking, mt, interleaved=interleaved)
    if thinking is not None and not thinking.enabled:
        given = out.get("chat_template_kwargs")
        kwargs: dict[str, Any] = given if isinstance(given, dict) else {}
        out["chat_template_kwargs"] = {**kwargs, "enable_thinking": False}
    elif thinking is not None and thinking.budget_tokens is not None:
        out["thinking_token_budget"] = thinking.budget_tokens
    if body.get("stream") is not None:
        if not isinstance(body["stream"], bool):
            raise InvalidRequest("'stream' must be a boolean", param="stream")
        out["stream"] = body["stream"]
        if body["stream"]:
            out["stream_options"] = {"include_usage": True}
    return out


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Messages request: ``system`` first, then each turn (raises InvalidRequest)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _system(body["system"])})
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            messages += _user_turn(m.get("content"), f"{where}.content")
        elif role == "assistant":
            messages.append(_assistant_turn(m.get("content"), f"{where}.content"))
        else:
            raise InvalidRequest(f"{where}.role must be user or assistant", param=f"{where}.role")
    return messages


def _sampling(body: dict[str, Any], out: dict[str, Any]) -> None:
    """``stop_sequences`` → ``stop``, ``temperature`` / ``top_p`` as they are, ``metadata.user_id`` → ``user``
    (into ``out``; raises InvalidRequest)."""
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise InvalidRequest("'stop_sequences' must be an array of strings", param="stop_sequences")
        out["stop"] = stops
    for k in ("temperature", "top_p"):  # Anthropic's ranges: both in [0, 1] (OpenAI's temperature goes to 2)
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
            raise InvalidRequest(f"{k}: must be a number in [0, 1], got {str(v)[:40]!r}", param=k)
        out[k] = v
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise InvalidRequest("'metadata' must be an object", param="metadata")
        uid = meta.get("user_id")
        if uid is not None and not isinstance(uid, str):
            raise InvalidRequest("metadata.user_id: must be a string", param="metadata.user_id")
        if isinstance(uid, str):
            out["user"] = uid


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic ``usage`` from a chat ``usage`` (zeros when there is none)."""
    u = chat_usage or {}
    prompt = int(u.get("prompt_tokens") or 0)
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt - cached, "output_tokens": int(u.get("completion_tokens") or 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens_details": {
                "thinking_tokens": int((u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)}}


def stop_of(finish_reason: str | None, stop_reason: Any, stops: list[str]) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) for a chat finish reason (and vLLM's ``stop_reason``: the matched
    stop string, when one matched)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "content_filter":  # the upstream declined: Anthropic's refusal, not a normal end_turn
        return "refusal", None
    if isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _text(v: Any) -> str:
    """``v`` when it is a string, else "": an upstream's part of the wrong type (``content: 5``) is skipped — read as
    text, it raised after the call was billed (a 500, or a stream cut and metered as the client's disconnect)."""
    return v if isinstance(v, str) else ""


def _calls(part: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(call, its ``function``) for each tool call of a chat ``message`` or ``delta`` that is an object (a
    ``function`` that is none counts as empty); malformed ones skipped, as :func:`_text` skips text."""
    calls = part.get("tool_calls")
    return [(c, f if isinstance(f := c.get("function"), dict) else {})
            for c in (calls if isinstance(calls, list) else ()) if isinstance(c, dict)]


def _input_of(arguments: str) -> dict[str, Any]:
    """A tool call's ``arguments`` (the JSON text an upstream generated) as a ``tool_use`` block's ``input``: the object
    they encode; {} for anything else — not JSON, not an object, or nested too deep to be written back inside the
    ``message`` (orjson reads 1,024 levels and writes 254; the input sits 3 levels down: ``message.content[i].input``):
    such an input made the answer, generated and billed, a 500 that the SDKs retry, billing it again."""
    try:
        value = orjson.loads(arguments or "{}")
        if isinstance(value, dict):
            orjson.dumps([[[value]]])  # as deep as in the message
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        return {}
    return value if isinstance(value, dict) else {}


def shows_thinking(req: dict[str, Any]) -> bool:
    """Whether the answer to Messages request ``req`` carries ``thinking`` blocks: only when the request turned
    thinking on (``enabled`` or ``adaptive``), as Anthropic's API does. The tier may still think (under
    ``model: auto`` the router picks a reasoning tier); its thought is then left out of the content, and its
    tokens stay in ``usage.output_tokens`` (billed, as Anthropic bills thinking)."""
    t = req.get("thinking")
    return isinstance(t, dict) and t.get("type") in ("enabled", "adaptive")


def message_object(chat: dict[str, Any], req: dict[str, Any], message_id: str) -> dict[str, Any]:
    """The ``message`` for a non-streamed ``chat.completion`` answering ``req`` (first choice); ``thinking``
    blocks only when ``req`` asked for them (:func:`shows_thinking`)."""
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    thought = (_text(msg.get("reasoning")) or _text(msg.get("reasoning_content"))) if shows_thinking(req) else None
    if thought:
        content.append({"type": "thinking", "thinking": thought, "signature": ""})
    if _text(msg.get("content")):
        content.append({"type": "text", "text": msg["content"]})
    for call, fn in _calls(msg):
        content.append({"type": "tool_use", "id": _text(call.get("id")) or new_id("toolu"),
                        "name": _text(fn.get("name")), "input": _input_of(_text(fn.get("arguments")))})
    stop, seq = stop_of(choice.get("finish_reason"), choice.get("stop_reason"), req.get("stop_sequences") or [])
    return {"id": message_id, "type": "message", "role": "assistant", "model": chat.get("model") or "",
            "content": content, "stop_reason": stop, "stop_sequence": seq, "usage": usage_of(chat.get("usage"))}


def sse_event(obj: dict[str, Any]) -> bytes:
    """One Anthropic SSE event: ``event: <type>`` + ``data: <json>``."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class MessageStream:
    """Folds ``chat.completion.chunk`` objects (choice 0) into Anthropic's stream events; ``message`` is the
    assembled message (content blocks, stop reason, usage) once finished."""

    def __init__(self, req: dict[str, Any], message_id: str) -> None:
        self.req = req
        self.message: dict[str, Any] = {"id": message_id, "type": "message", "role": "assistant", "model": "",
                                        "content": [], "stop_reason": None, "stop_sequence": None,
                                        "usage": usage_of(None)}
        self.started = False
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self._kind: str | None = None  # thinking | text | tool_use
        self._call_index: int | None = None
        self._args: list[str] = []
        self._thinking = shows_thinking(req)

    def start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        head = {**self.message, "content": [], "usage": {"input_tokens": 0, "output_tokens": 0,
                                                          "cache_creation_input_tokens": 0,
                                                          "cache_read_input_tokens": 0}}
        return sse_event({"type": "message_start", "message": head})

    def _stop_block(self) -> list[bytes]:
        if self._kind is None:
            return []
        index = len(self.message["content"]) - 1
        out = []
        if self._kind == "tool_use":
            self.message["content"][index]["input"] = _input_of("".join(self._args))
        elif self._kind == "thinking":
            # Anthropic ends a thinking block with its signature_delta; clients that assemble blocks wait for it.
            # The upstream (vLLM, an OpenAI-compatible server) signs nothing: the signature is empty, as in the
            # non-streamed answer
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self._kind = None
        out.append(sse_event({"type": "content_block_stop", "index": index}))
        return out

    def _start_block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._stop_block()
        self._kind = kind
        self.message["content"].append(block)
        shown = {**block, "input": {}} if kind == "tool_use" else dict(block)
        out.append(sse_event({"type": "content_block_start", "index": len(self.message["content"]) - 1,
                              "content_block": shown}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event({"type": "content_block_delta", "index": len(self.message["content"]) - 1, "delta": delta})

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """The events for one chat chunk (bytes, possibly empty)."""
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = chunk["usage"]
            return b""
        if chunk.get("model") and not self.message["model"]:
            self.message["model"] = chunk["model"]
        out: list[bytes] = [self.start()]
        for c in chunk.get("choices") or ():
            if stream_index(c, "choice") != 0:
                continue
            delta = c.get("delta") or {}
            thought = (_text(delta.get("reasoning")) or _text(delta.get("reasoning_content"))) if self._thinking \
                else None
            if thought:
                if self._kind != "thinking":
                    out += self._start_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.message["content"][-1]["thinking"] += thought
                out.append(self._delta({"type": "thinking_delta", "thinking": thought}))
            if text := _text(delta.get("content")):
                if self._kind != "text":
                    out += self._start_block("text", {"type": "text", "text": ""})
                self.message["content"][-1]["text"] += text
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call, fn in _calls(delta):
                ci = stream_index(call, "tool call")
                if self._kind != "tool_use" or self._call_index != ci:
                    out += self._start_block("tool_use", {"type": "tool_use",
                                                          "id": _text(call.get("id")) or new_id("toolu"),
                                                          "name": _text(fn.get("name")), "input": {}})
                    self._call_index = ci
                    self._args = []
                if args := _text(fn.get("arguments")):
                    self._args.append(args)
                    out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
            if c.get("finish_reason") is not None:
                self.finish_reason = c["finish_reason"]
                self.stop_reason = c.get("stop_reason")
        return b"".join(out)

    def finish(self) -> bytes:
        """``content_block_stop`` of the open block, ``message_delta`` (stop reason, usage), ``message_stop``."""
        out = [self.start(), *self._stop_block()]
        stop, seq = stop_of(self.finish_reason, self.stop_reason, self.req.get("stop_sequences") or [])
        usage = usage_of(self.usage)
        self.message.update(stop_reason=stop, stop_sequence=seq, usage=usage)
        out.append(sse_event({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": seq},
                              "usage": usage}))
        out.append(sse_event({"type": "message_stop"}))
        return b"".join(out)

    def fail(self, error: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
        """An ``error`` event (the SDK raises on it) after whatever was sent. ``usage`` (what the failed call was
        metered) is not sent: Anthropic's ``error`` event is ``{"type", "error": {"type", "message"}}``, no usage."""
        kind = "timeout_error" if error.get("code") == "upstream_timeout" else "api_error"
        return self.start() + sse_event({"type": "error", "error": {"type": kind,
                                                                    "message": str(error.get("message") or "")}})


def ratelimit_headers(openai_headers: Mapping[str, str], now: float) -> dict[str, str]:
    """Anthropic's ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` from the gateway's OpenAI-named
    ``x-ratelimit-*`` (``reset`` as an RFC 3339 UTC time, ``now`` + the window's reset, epoch s); {} without them."""
    out: dict[str, str] = {}
    for unit in ("requests", "tokens"):
        limit = openai_headers.get(f"x-ratelimit-limit-{unit}")
        if limit is None:
            continue
        out[f"anthropic-ratelimit-{unit}-limit"] = limit
        out[f"anthropic-ratelimit-{unit}-remaining"] = openai_headers.get(f"x-ratelimit-remaining-{unit}", "0")
        m = re.fullmatch(r"(?:(\d+)m)?(\d+)s", openai_headers.get(f"x-ratelimit-reset-{unit}", "0s"))
        secs = (int(m.group(1) or 0) * 60 + int(m.group(2))) if m else 0
        out[f"anthropic-ratelimit-{unit}-reset"] = datetime.fromtimestamp(int(now) + secs, UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
    return out


def error_body(exc: GatewayError) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}`` for ``exc`` (type from its HTTP status; another 4xx —
    405, 408 — is the client's ``invalid_request_error``, another 5xx ``api_error``)."""
    status = exc.status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": exc.message}})
