"""What the semantic cache compares and within which scope: pure functions, no I/O.

A request is split into the **question** — the text of its last user turn (chat: the last ``user`` message,
a string or text-only content parts; completions: a string ``prompt``) — and its **context**: everything
else in the post-routing upstream request. Entries are only ever compared within one context: the
context key is the exact cache's key (:func:`gateway.state.cache_policy.cache_key`: tenant scope,
endpoint, tier, upstream model, thinking settings, sampling, tools, ``response_format``, system prompt and
earlier turns) of the body with the question blanked, ``max_tokens`` replaced by its bucket (the next power
of two) and the embedder's name added. So two tenants, two tiers, two thinking budgets or two system prompts
never share a semantic entry, whatever the similarity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.state.cache_policy import cache_key
from gateway.state.keys import tenant_tag as tenant_tag  # one definition: the tag of key names and Cluster slots


@dataclass(frozen=True, slots=True)
class Question:
    """``text``: the last user turn; ``context``: hex key of everything else (see the module doc);
    ``max_tokens``: the request's capped ``max_tokens`` (None when absent)."""

    text: str
    context: str
    max_tokens: int | None


def max_tokens_bucket(n: int) -> int:
    """The smallest power of two ≥ ``n`` (≥ 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _text_only(content: Any) -> str | None:
    """The text of a message ``content`` that is text only (a string, or parts all of type ``text``, joined by
    newlines); None when any part is not text (an image, audio, a file: not a text question)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None  # images, audio, files: not a text question
            parts.append(part["text"])
        return "\n".join(parts)
    return None


def question(scope: str, endpoint: str, tier: str, upstream_body: Mapping[str, Any], embedder: str,
             max_chars: int) -> Question | None:
    """Split ``upstream_body`` into question and context; None when the request has no text question of at
    most ``max_chars`` characters (no user turn, multimodal content, a list prompt, an empty text).

    ``endpoint``: the usage label (``chat``, ``completions``, or ``responses``/``messages``, whose upstream body
    is a chat body); it is part of the context, as in the exact cache's key."""
    body = dict(upstream_body)  # shallow: only top-level keys and the question's message are replaced below
    text: str | None
    messages = body.get("messages")
    if endpoint != "completions":  # chat, and the APIs translated onto chat (responses, messages)
        if not isinstance(messages, list):
            return None
        messages = body["messages"] = list(messages)
        idx = next((i for i in range(len(messages) - 1, -1, -1)
                    if isinstance(messages[i], dict) and messages[i].get("role") == "user"), None)
        if idx is None:
            return None
        text = _text_only(messages[idx].get("content"))
        messages[idx] = {**messages[idx], "content": None}
    else:
        text = body.get("prompt") if isinstance(body.get("prompt"), str) else None
        body["prompt"] = None
    if text is None or not text.strip() or len(text) > max_chars:
        return None
    max_tokens = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else None
    if max_tokens is not None:
        body["max_tokens"] = max_tokens_bucket(max_tokens)
    body["__semantic_embedder"] = embedder
    return Question(text, cache_key(scope, endpoint, tier, body), max_tokens)


def servable(answer: Mapping[str, Any], stored_max_tokens: int | None, max_tokens: int | None) -> bool:
    """May a stored ``answer`` (made with ``stored_max_tokens``) serve a request capped at ``max_tokens``?

    Yes when it used no more completion tokens than the request allows and, if it was cut by its own limit
    (``finish_reason: length``), only for the very same limit (a larger one would have let it go on).
    """
    choices = answer.get("choices") or []
    if any(isinstance(c, dict) and c.get("finish_reason") == "length" for c in choices):
        return stored_max_tokens == max_tokens
    usage = answer.get("usage") or {}
    used = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return max_tokens is None or not isinstance(used, int) or used <= max_tokens
