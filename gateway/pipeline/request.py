"""Validation of the request bodies the gateway must understand; everything else passes through untouched.

The body is kept as the parsed ``dict`` (no model copy on the hot path). Only the fields the gateway reads
or that would make the upstream fail in a confusing way are type-checked, following the OpenAI API
reference for ``/v1/chat/completions`` and ``/v1/completions``. Unknown fields (vLLM extras such as
``chat_template_kwargs``, ``top_k``, ``thinking_token_budget``) are forwarded as sent.
Every failure raises :class:`gateway.errors.InvalidRequest` (400) naming the field in ``param``.
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
}
_CHAT: dict[str, Check] = {
    **_COMMON,
    "max_completion_tokens": (_pos_int, "an integer >= 1"),
}
_COMPLETIONS: dict[str, Check] = {**_COMMON}


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse ``raw`` as a JSON object; raises InvalidRequest (400) for malformed JSON or a non-object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    return body


def _check_fields(body: dict[str, Any], checks: dict[str, Check]) -> None:
    for name, (ok, what) in checks.items():
        v = body.get(name)
        if v is not None and not ok(v):
            raise InvalidRequest(f"'{name}' must be {what}, got {orjson.dumps(v).decode()[:80]}", param=name)
    if not isinstance(body.get("model"), str):
        raise InvalidRequest("'model' is required", param="model")
    so = body.get("stream_options")
    if so is not None and "include_usage" in so and not isinstance(so["include_usage"], bool):
        raise InvalidRequest("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")


def validate_chat(body: dict[str, Any]) -> None:
    """Check a ``/v1/chat/completions`` body in place (no copy); raises InvalidRequest."""
    _check_fields(body, _CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array of messages", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", param=f"messages.{i}")
        c = m.get("content")
        if c is not None and not isinstance(c, str | list):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or an array of content parts", param=f"messages.{i}.content"
            )


def validate_completion(body: dict[str, Any]) -> None:
    """Check a ``/v1/completions`` body in place; raises InvalidRequest."""
    _check_fields(body, _COMPLETIONS)
    if not _prompt(body.get("prompt")):
        raise InvalidRequest(
            "'prompt' must be a string, an array of strings, or token ids", param="prompt"
        )
