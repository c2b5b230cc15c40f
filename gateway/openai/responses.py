"""The OpenAI Responses API (``POST /v1/responses``) translated onto chat completions, and back. Pure: no I/O.

Shapes follow the OpenAI API reference ("Responses", "Streaming events") and the openai-python types
(``openai.types.responses``); the translation is the one vLLM's and LiteLLM's Responses bridges make:

- :func:`to_chat` — a Responses request body → a chat-completions body (raises
  :class:`~gateway.errors.InvalidRequest` for fields the gateway refuses, see :data:`REFUSED`);
- :func:`response_object` — a ``chat.completion`` → a ``response`` object (``output`` items ``reasoning``,
  ``message`` / ``output_text``, ``function_call``; ``usage`` in Responses names);
- :class:`EventStream` — ``chat.completion.chunk`` objects → the typed SSE events (``response.created``,
  ``response.in_progress``, ``response.output_item.added``, ``response.reasoning_text.delta``,
  ``response.content_part.added``, ``response.output_text.delta``, ``response.function_call_arguments.delta``,
  their ``.done`` events, then ``response.completed`` / ``response.incomplete`` with ``usage``, or
  ``response.failed`` on an in-stream error, with the usage the failed call was metered).

Usage: ``input_tokens`` = ``prompt_tokens``, ``output_tokens`` = ``completion_tokens``,
``input_tokens_details.cached_tokens`` = ``prompt_tokens_details.cached_tokens``,
``output_tokens_details.reasoning_tokens`` = ``completion_tokens_details.reasoning_tokens`` (tokens; the same
numbers the usage event is metered with).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config.routing import OPENAI_REASONING_EFFORTS
from gateway.errors import InvalidRequest
from gateway.stream_index import stream_index

#: Responses fields with no meaning on a chat upstream that the gateway refuses rather than ignore silently.
REFUSED = ("background", "conversation", "prompt")
#: Chat's several-answers fields: a response has one answer, so passed through they billed every choice and showed
#: one (``n: 8`` cost eight); refused unless 1 (OpenAI's Responses API has neither: "Unknown parameter")
ONE_ANSWER = ("n", "best_of")
#: Responses fields accepted and not acted on (documented in docs/gateway.md).
IGNORED = ("include", "truncation", "service_tier", "top_logprobs", "safety_identifier", "prompt_cache_key",
           "prompt_cache_retention", "max_tool_calls", "stream_options", "context_management")
#: Fields the translation reads; everything else is passed to the upstream unchanged (vLLM extras).
TRANSLATED = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
              "reasoning", "max_output_tokens", "temperature", "top_p", "metadata", "user", "stream", "store",
              "previous_response_id")

#: ``reasoning`` as the OpenAI API defines it (openai-python ``types.shared.Reasoning``): each field's allowed
#: values (None: any string). ``effort`` → ``reasoning_effort``; the others are accepted and not acted on.
REASONING_FIELDS: dict[str, tuple[str, ...] | None] = {
    "effort": OPENAI_REASONING_EFFORTS,
    "summary": ("auto", "concise", "detailed"),
    "generate_summary": ("auto", "concise", "detailed"),  # deprecated alias of summary
    "context": ("auto", "current_turn", "all_turns"),
    "mode": None,
}
#: ``max_output_tokens`` >= this. OpenAI's own floor is 16; 1 here, because the local tiers answer in a few
#: tokens and a cap below 16 is how a client (and the tests) asks for a short, ``incomplete`` answer.
MIN_OUTPUT_TOKENS = 1

#: ``response.error.code`` values an in-stream failure can take (openai-python ``ResponseError.code``; the others
#: are about images and vector stores). Anything else — a gateway code (``upstream_timeout``), an upstream's status
#: (``500``) — is ``server_error``: the SDK types the code as that enum, and clients branch on it.
ERROR_CODES = ("server_error", "rate_limit_exceeded", "invalid_prompt")

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def new_id(prefix: str) -> str:
    """``<prefix>_<32 hex>`` (``resp``, ``msg``, ``rs``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text_part(part: Any, where: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        if not isinstance(part.get("text"), str):  # OpenAI's 400: an input_text with no text
            raise InvalidRequest(f"Missing required parameter: '{where}.text'.", param=f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise InvalidRequest(f"{where}: only input_image with an image_url is supported", param=where)
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "refusal":
        return {"type": "text", "text": str(part.get("refusal") or "")}
    raise InvalidRequest(f"{where}: content part type {kind!r} is not supported", param=where,
                         code="unsupported_parameter")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or an array of content parts", param=where)
    parts = [_text_part(p, f"{where}.{i}") for i, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # plain text: what every chat template renders
    return parts


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(str(p.get("text") or "") for p in output if isinstance(p, dict))
    return orjson.dumps(output).decode()


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages for a Responses ``input`` (a string, or an array of input items).

    ``function_call`` items become the ``tool_calls`` of an assistant message (consecutive calls share one);
    ``function_call_output`` items become ``tool`` messages; ``reasoning`` items are dropped (the upstream
    re-thinks); ``developer`` is sent as ``system``. Raises InvalidRequest for other item types.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("'input' must be a string or a non-empty array of input items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise InvalidRequest(f"{where}.role must be user, assistant, system or developer", param=where)
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where}: a function_call needs 'name' and 'call_id'", param=where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": str(item.get("arguments") or "")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last.get("content") == "":
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where}: a function_call_output needs 'call_id'", param=where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _output_text(item.get("output"))})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest(f"{where}: input item type {kind!r} is not supported", param=where,
                                 code="unsupported_parameter")
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequest(f"tools.{i}: only function tools are supported (got {kind!r})", param=f"tools.{i}",
                                 code="unsupported_parameter")
        fn: dict[str, Any] = {"name": t["name"]}
        for k in ("description", "parameters", "strict"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest("'tool_choice' must be auto, none, required or {type: function, name}", param="tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        raise InvalidRequest("'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict) or not isinstance(fmt.get("name"), str):
            raise InvalidRequest("text.format json_schema needs 'name' and 'schema'", param="text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequest("text.format.type must be text, json_object or json_schema", param="text.format")


def _json_type(v: Any) -> str:
    """The JSON type name of ``v`` with its article, as OpenAI's messages say it ("a string", "an integer")."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _quoted(values: tuple[str, ...], last: str) -> str:
    """``'a', 'b', and 'c'`` (``last`` = "and") — OpenAI's way of listing allowed values."""
    q = [f"'{v}'" for v in values]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + f", {last} " + q[-1]


def _reasoning(reasoning: Any) -> str | None:
    """Check a ``reasoning`` object as OpenAI does; its ``effort`` (None when not given). Raises InvalidRequest
    (400): ``invalid_type`` (not an object, or a field of the wrong type), ``unknown_parameter`` (a field
    OpenAI does not define, ``param: reasoning.<field>``), ``invalid_value`` (a value outside the enum)."""
    if not isinstance(reasoning, dict):
        raise InvalidRequest(f"Invalid type for 'reasoning': expected an object, but got {_json_type(reasoning)} "
                             "instead.", param="reasoning", code="invalid_type")
    for name, value in reasoning.items():
        where = f"reasoning.{name}"
        if name not in REASONING_FIELDS:
            raise InvalidRequest(f"Unknown parameter: '{where}'.", param=where, code="unknown_parameter")
        allowed = REASONING_FIELDS[name]
        if value is None:
            continue
        if not isinstance(value, str):
            expected = "a string" if allowed is None else f"one of {_quoted(allowed, 'or')}"
            raise InvalidRequest(f"Invalid type for '{where}': expected {expected}, but got {_json_type(value)} "
                                 "instead.", param=where, code="invalid_type")
        if allowed is not None and value not in allowed:
            raise InvalidRequest(f"Invalid value: '{value}'. Supported values are: {_quoted(allowed, 'and')}.",
                                 param=where, code="invalid_value")
    effort = reasoning.get("effort")
    return effort if isinstance(effort, str) else None


def _max_output_tokens(v: Any) -> int:
    """``max_output_tokens`` checked as OpenAI does (``invalid_type``, ``integer_below_min_value``), with the floor
    :data:`MIN_OUTPUT_TOKENS`."""
    if not _is_int(v):
        raise InvalidRequest(f"Invalid type for 'max_output_tokens': expected an integer, but got {_json_type(v)} "
                             "instead.", param="max_output_tokens", code="invalid_type")
    if v < MIN_OUTPUT_TOKENS:
        raise InvalidRequest(f"Invalid 'max_output_tokens': integer below minimum value. Expected a value >= "
                             f"{MIN_OUTPUT_TOKENS}, but got {v} instead.", param="max_output_tokens",
                             code="integer_below_min_value")
    return int(v)


def _refuse(body: dict[str, Any]) -> None:
    """Raise InvalidRequest for a field of :data:`REFUSED` that is set, or of :data:`ONE_ANSWER` other than 1."""
    for name in REFUSED:
        if body.get(name) not in (None, False):
            raise InvalidRequest(f"'{name}' is not supported by this gateway", param=name, code="unsupported_parameter")
    for name in ONE_ANSWER:
        if body.get(name) not in (None, 1):
            raise InvalidRequest(f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")


def to_chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat-completions body for a Responses request ``body``; ``history``: the stored conversation of
    ``previous_response_id`` (chat messages), placed before this turn's input.

    ``instructions`` becomes the first (system) message; ``reasoning.effort`` → ``reasoning_effort`` (which
    picks the tier under ``model: auto``); ``max_output_tokens`` → ``max_tokens``; ``text.format`` →
    ``response_format``; ``stream`` adds ``stream_options.include_usage`` (``response.completed`` carries
    usage). Fields not in :data:`TRANSLATED`, :data:`IGNORED` or :data:`REFUSED` pass through unchanged;
    ``reasoning`` and ``max_output_tokens`` are checked as OpenAI checks them (:data:`REASONING_FIELDS`,
    :data:`MIN_OUTPUT_TOKENS`; OpenAI's messages and codes). Raises InvalidRequest (400, ``param`` names the field).
    """
    _refuse(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required", param="model")
    if "input" not in body:
        raise InvalidRequest("'input' is required", param="input")
    out: dict[str, Any] = {k: v for k, v in body.items()
                           if k not in TRANSLATED and k not in IGNORED and k not in REFUSED and k not in ONE_ANSWER}
    out["model"] = model
    out["messages"] = _chat_messages(body, history)
    _tool_fields(body, out)
    if body.get("text") is not None and (fmt := _response_format(body["text"])) is not None:
        out["response_format"] = fmt
    if body.get("reasoning") is not None and (effort := _reasoning(body["reasoning"])) is not None:
        out["reasoning_effort"] = effort
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = _max_output_tokens(body["max_output_tokens"])
    for k in ("temperature", "top_p", "user"):
        if body.get(k) is not None:
            out[k] = body[k]
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise InvalidRequest("'metadata' must be an object", param="metadata")
    if body.get("stream") is not None:
        if not isinstance(body["stream"], bool):
            raise InvalidRequest("'stream' must be a boolean", param="stream")
        out["stream"] = body["stream"]
        if body["stream"]:
            out["stream_options"] = {"include_usage": True}
    return out


def _chat_messages(body: dict[str, Any], history: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``instructions`` (as the system message), then ``history``, then this turn's ``input`` (raises
    InvalidRequest)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages += history or []
    messages += input_messages(body["input"])
    return messages


def _tool_fields(body: dict[str, Any], out: dict[str, Any]) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in chat form, into ``out`` (raises InvalidRequest)."""
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise InvalidRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
        out["parallel_tool_calls"] = body["parallel_tool_calls"]


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Responses ``usage`` from a chat ``usage`` (None when there is none)."""
    if not chat_usage:
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = int((chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def _envelope(req: dict[str, Any], response_id: str, created: float, model: str) -> dict[str, Any]:
    """The ``response`` object's fields that echo the request."""
    text: dict[str, Any] = req["text"] if isinstance(req.get("text"), dict) else {}
    reasoning: dict[str, Any] = req["reasoning"] if isinstance(req.get("reasoning"), dict) else {}
    tools = req.get("tools") if isinstance(req.get("tools"), list) else []
    return {
        "id": response_id, "object": "response", "created_at": int(created), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
        "metadata": req.get("metadata") or {}, "model": model, "output": [],
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "previous_response_id": req.get("previous_response_id"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "store": req.get("store", True) is not False,
        "temperature": req.get("temperature"), "top_p": req.get("top_p"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": req.get("tool_choice", "auto"), "tools": tools, "truncation": "disabled",
        "usage": None, "user": req.get("user"),
    }


def _finish(resp: dict[str, Any], finish_reason: str | None) -> None:
    if finish_reason == "length":
        resp["status"] = "incomplete"
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"
    resp["completed_at"] = int(time.time())


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


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict[str, Any], fn: dict[str, Any], item_id: str | None = None,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": _text(call.get("id")) or new_id("call"),
            "name": _text(fn.get("name")), "arguments": _text(fn.get("arguments")), "status": status}


def response_object(chat: dict[str, Any], req: dict[str, Any], response_id: str) -> dict[str, Any]:
    """The ``response`` object for a non-streamed ``chat.completion`` answering Responses request ``req``
    (first choice only: the Responses API has no ``n``)."""
    resp = _envelope(req, response_id, chat.get("created") or time.time(), str(chat.get("model") or ""))
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    reasoning = _text(msg.get("reasoning")) or _text(msg.get("reasoning_content"))
    if reasoning:
        resp["output"].append(_reasoning_item(reasoning))
    if _text(msg.get("content")):
        resp["output"].append(_message_item(msg["content"]))
    for call, fn in _calls(msg):
        resp["output"].append(_call_item(call, fn))
    _finish(resp, choice.get("finish_reason"))
    if resp["status"] == "incomplete" and resp["output"]:
        resp["output"][-1]["status"] = "incomplete"  # the item the cap cut, as OpenAI marks it
    resp["usage"] = usage_of(chat.get("usage"))
    return resp


def assistant_messages(resp: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a finished ``response`` adds to its conversation (stored for
    ``previous_response_id``): one assistant message with its text and tool calls; reasoning is not kept."""
    text = "".join(p.get("text", "") for it in resp.get("output") or () if it.get("type") == "message"
                   for p in it.get("content") or ())
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in resp.get("output") or () if it.get("type") == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


# ---------------------------------------------------------------- streaming


def sse_event(obj: dict[str, Any]) -> bytes:
    """One typed SSE event: ``event: <type>`` + ``data: <json>``."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


@dataclass
class _Open:
    kind: str  # reasoning | message | call
    index: int  # output_index
    item: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    call_index: int | None = None


class EventStream:
    """Folds ``chat.completion.chunk`` objects (choice 0) into the Responses event stream.

    :meth:`start` gives ``response.created`` + ``response.in_progress`` (once, before anything else);
    :meth:`feed` the events of one chunk
    (a usage-only chunk is remembered); :meth:`finish` closes the open item and gives ``response.completed``
    (``response.incomplete`` when the answer hit its token cap) with ``usage``; :meth:`fail` closes with
    ``response.failed``. ``response`` is the final ``response`` object once finished.
    """

    def __init__(self, req: dict[str, Any], response_id: str, model: str) -> None:
        self.req = req
        self.response = _envelope(req, response_id, time.time(), model)
        self.seq = 0
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self._open: _Open | None = None
        self.started = False

    def _ev(self, obj: dict[str, Any]) -> bytes:
        obj["sequence_number"] = self.seq
        self.seq += 1
        return sse_event(obj)

    def _snapshot(self) -> dict[str, Any]:
        return orjson.loads(orjson.dumps(self.response))

    def start(self) -> bytes:
        """``response.created`` + ``response.in_progress`` (once; :meth:`feed`, :meth:`finish` and :meth:`fail`
        call it first, so the model name comes from the first chunk)."""
        if self.started:
            return b""
        self.started = True
        return (self._ev({"type": "response.created", "response": self._snapshot()})
                + self._ev({"type": "response.in_progress", "response": self._snapshot()}))

    def _close(self, status: str = "completed") -> list[bytes]:
        """The open item's ``.done`` events, the item marked ``status``: ``incomplete`` when the token cap or a
        failure cut it (OpenAI's item statuses: ``in_progress``, ``completed``, ``incomplete``)."""
        op, self._open = self._open, None
        if op is None:
            return []
        text = "".join(op.parts)
        out: list[bytes] = []
        item_id = op.item["id"]
        if op.kind == "reasoning":
            op.item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self._ev({"type": "response.reasoning_text.done", "item_id": item_id,
                                 "output_index": op.index, "content_index": 0, "text": text}))
        elif op.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            op.item["content"] = [part]
            out.append(self._ev({"type": "response.output_text.done", "item_id": item_id, "output_index": op.index,
                                 "content_index": 0, "text": text, "logprobs": []}))
            out.append(self._ev({"type": "response.content_part.done", "item_id": item_id, "output_index": op.index,
                                 "content_index": 0, "part": part}))
        else:
            op.item["arguments"] = text
            out.append(self._ev({"type": "response.function_call_arguments.done", "item_id": item_id,
                                 "output_index": op.index, "name": op.item["name"], "arguments": text}))
        op.item["status"] = status
        out.append(self._ev({"type": "response.output_item.done", "output_index": op.index, "item": op.item}))
        return out

    def _begin(self, kind: str, item: dict[str, Any], call_index: int | None = None) -> list[bytes]:
        out = self._close()
        index = len(self.response["output"])
        self.response["output"].append(item)
        self._open = _Open(kind, index, item, call_index=call_index)
        added = dict(item)
        if kind in ("reasoning", "message"):
            added["content"] = []
        out.append(self._ev({"type": "response.output_item.added", "output_index": index, "item": added}))
        if kind == "message":
            out.append(self._ev({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                                 "content_index": 0,
                                 "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        return out

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """The events for one chat chunk (bytes, possibly empty)."""
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = chunk["usage"]
            return b""
        if chunk.get("model") and not self.response["model"]:
            self.response["model"] = chunk["model"]
        out: list[bytes] = [self.start()]
        for c in chunk.get("choices") or ():
            if stream_index(c, "choice") != 0:
                continue
            delta = c.get("delta") or {}
            r = _text(delta.get("reasoning")) or _text(delta.get("reasoning_content"))
            if r:
                if self._open is None or self._open.kind != "reasoning":
                    out += self._begin("reasoning", {"type": "reasoning", "id": new_id("rs"), "summary": [],
                                                     "content": [], "status": "in_progress"})
                assert self._open is not None
                self._open.parts.append(r)
                out.append(self._ev({"type": "response.reasoning_text.delta", "item_id": self._open.item["id"],
                                     "output_index": self._open.index, "content_index": 0, "delta": r}))
            if text := _text(delta.get("content")):
                if self._open is None or self._open.kind != "message":
                    out += self._begin("message", _message_item("", status="in_progress"))
                assert self._open is not None
                self._open.parts.append(text)
                out.append(self._ev({"type": "response.output_text.delta", "item_id": self._open.item["id"],
                                     "output_index": self._open.index, "content_index": 0,
                                     "delta": text, "logprobs": []}))
            for call, fn in _calls(delta):
                out += self._tool_delta(call, fn)
            if c.get("finish_reason") is not None:
                self.finish_reason = c["finish_reason"]
        return b"".join(out)

    def _tool_delta(self, call: dict[str, Any], fn: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        ci = stream_index(call, "tool call")
        if self._open is None or self._open.kind != "call" or self._open.call_index != ci:
            item = _call_item(call, {"name": fn.get("name")}, new_id("fc"), "in_progress")
            out += self._begin("call", item, call_index=ci)
        op = self._open
        assert op is not None
        if _text(fn.get("name")) and not op.item["name"]:
            op.item["name"] = fn["name"]
        args = _text(fn.get("arguments"))
        if args:
            op.parts.append(args)
            out.append(self._ev({"type": "response.function_call_arguments.delta", "item_id": op.item["id"],
                                 "output_index": op.index, "delta": args}))
        return out

    def finish(self) -> bytes:
        """Close the stream: the last item's ``.done`` events and ``response.completed`` (or ``.incomplete``)."""
        cut = "incomplete" if self.finish_reason == "length" else "completed"
        out = [self.start(), *self._close(cut)]
        _finish(self.response, self.finish_reason)
        self.response["usage"] = usage_of(self.usage)
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        out.append(self._ev({"type": kind, "response": self._snapshot()}))
        return b"".join(out)

    def fail(self, error: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
        """Close the stream with ``response.failed`` carrying ``error`` (``{"code", "message"}``) and, in Responses
        names, ``usage`` (a chat ``usage``: what the failed call was metered; None: the usage chunk the stream sent,
        if any) — as OpenAI's ``response.failed`` carries the usage it knows."""
        out = [self.start(), *self._close("incomplete")]
        self.response["status"] = "failed"
        code = error.get("code")
        self.response["error"] = {"code": code if code in ERROR_CODES else "server_error",
                                  "message": str(error.get("message") or "upstream error")}
        self.response["usage"] = usage_of(usage if usage is not None else self.usage)
        out.append(self._ev({"type": "response.failed", "response": self._snapshot()}))
        return b"".join(out)
