"""Validation of the request bodies the gateway must understand; everything else passes through untouched.

The body is kept as the parsed ``dict`` (no model copy on the hot path). Only the fields the gateway reads
or that would make the upstream fail in a confusing way are type-checked, following the OpenAI API
reference for ``/v1/chat/completions`` and ``/v1/completions``. Unknown fields (vLLM extras such as
``chat_template_kwargs``, ``top_k``, ``thinking_token_budget``) are forwarded as sent.
Every failure raises :class:`gateway.errors.InvalidRequest` (400) naming the field in ``param``. The caps
that depend on the tier (``n`` ≤ ``max_n``, ``max_tokens``) and on the key are checked after routing, before
admission (``gateway/pipeline/policy.py``): nothing reaches an upstream unvalidated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from gateway.errors import InvalidRequest

Check = tuple[Callable[[Any], bool], str]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _pos_int(v: Any) -> bool:
    return _is_int(v) and v >= 1


def _non_neg_int(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _stop(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _prompt(v: Any) -> bool:
    if isinstance(v, str):
        return True
    if not isinstance(v, list) or not v:
        return False
    return (
        all(isinstance(p, str) for p in v)
        or all(_is_int(p) for p in v)
        or all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in v)
    )


_COMMON: dict[str, Check] = {
    "model": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    "n": (_pos_int, "an integer >= 1"),
    "max_tokens": (_pos_int, "an integer >= 1"),
    "temperature": (lambda v: _is_num(v) and 0 <= v <= 2, "a number in [0, 2]"),
    "top_p": (lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "presence_penalty": (lambda v: _is_num(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: _is_num(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "seed": (_is_int, "an integer"),
    "stop": (_stop, "a string or an array of strings"),
    "reasoning_effort": (lambda v: isinstance(v, str), "a string"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict), "an object"),
    "thinking_token_budget": (_non_neg_int, "an integer >= 0 (tokens)"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object"),
}
_CHAT: dict[str, Check] = {
    **_COMMON,
    "max_completion_tokens": (_pos_int, "an integer >= 1"),
    "logprobs": (lambda v: isinstance(v, bool), "a boolean"),
    "top_logprobs": (lambda v: _is_int(v) and 0 <= v <= 20, "an integer in [0, 20]"),
    "tools": (lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v), "an array of objects"),
    "tool_choice": (lambda v: isinstance(v, str | dict), "a string or an object"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),
    "response_format": (lambda v: isinstance(v, dict), "an object"),
}
_COMPLETIONS: dict[str, Check] = {
    **_COMMON,
    "best_of": (_pos_int, "an integer >= 1"),
    "logprobs": (lambda v: _is_int(v) and 0 <= v <= 5, "an integer in [0, 5]"),
    "echo": (lambda v: isinstance(v, bool), "a boolean"),
    "suffix": (lambda v: isinstance(v, str), "a string"),
}
#: The chat roles of the OpenAI API (``developer`` is the newer name of ``system``; ``function`` is legacy).
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
#: The roles whose messages must carry ``content`` (OpenAI's rule: an assistant turn may hold only tool calls, a
#: legacy function result may be null).
CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse ``raw`` as a JSON object; raises InvalidRequest (400) for malformed JSON or a non-object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    try:  # the gateway re-encodes what it forwards, inside records of its own: orjson encodes 254 levels (reads 1,024)
        orjson.dumps([[[[body]]]])
    except orjson.JSONEncodeError:
        # it was a 500 with a 176 KB traceback per 6 KB request, from wherever the body was next encoded or walked
        raise InvalidRequest("request body nests too deeply (at most 250 levels)", code="invalid_json") from None
    return body


def _check_fields(body: dict[str, Any], checks: dict[str, Check]) -> None:
    for name, (ok, what) in checks.items():
        v = body.get(name)
        if v is not None and not ok(v):
            raise InvalidRequest(f"'{name}' must be {what}, got {orjson.dumps(v).decode()[:80]}", param=name)
    if not isinstance(body.get("model"), str):
        raise InvalidRequest("'model' is required", param="model")
    so = body.get("stream_options")
    if so and not body.get("stream"):  # OpenAI's and vLLM's rule, in OpenAI's words
        raise InvalidRequest("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                             param="stream_options")
    if so is not None and "include_usage" in so and not isinstance(so["include_usage"], bool):
        raise InvalidRequest("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")


def validate_chat(body: dict[str, Any]) -> None:
    """Check a ``/v1/chat/completions`` body in place (no copy); raises InvalidRequest."""
    _check_fields(body, _CHAT)
    if body.get("chat_template") is not None:
        # a request's own Jinja template renders whatever prompt it likes from a short body: no bound admission can
        # book against the budgets (vLLM itself refuses one unless started with --trust-request-chat-template)
        raise InvalidRequest("'chat_template' is not accepted: the tier's model renders its own template",
                             param="chat_template", code="unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array of messages", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", param=f"messages.{i}")
        if m["role"] not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {sorted(ROLES)}, got {m['role'][:40]!r}",
                                 param=f"messages.{i}.role")
        c = m.get("content")
        if c is None and m["role"] in CONTENT_REQUIRED:  # only an assistant turn may carry none (its tool calls)
            raise InvalidRequest(f"Missing required parameter: 'messages[{i}].content'.", param=f"messages.{i}.content")
        if c is not None and not isinstance(c, str | list):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or an array of content parts", param=f"messages.{i}.content"
            )
        if isinstance(c, list):
            for j, p in enumerate(c):
                if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                    raise InvalidRequest(f"messages[{i}].content parts must be objects with a string 'type'",
                                         param=f"messages.{i}.content")
                if p["type"] == "text" and not isinstance(p.get("text"), str):
                    raise InvalidRequest(f"Missing required parameter: 'messages[{i}].content[{j}].text'.",
                                         param=f"messages.{i}.content.{j}.text")


def validate_completion(body: dict[str, Any]) -> None:
    """Check a ``/v1/completions`` body in place; raises InvalidRequest."""
    _check_fields(body, _COMPLETIONS)
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and best_of < (n if n is not None else 1):
        raise InvalidRequest("'best_of' must be >= 'n'", param="best_of")
    if not _prompt(body.get("prompt")):
        raise InvalidRequest(
            "'prompt' must be a string, an array of strings, or token ids", param="prompt"
        )
