"""OpenAI usage objects and generated text: the one reader of the reasoning field, the one token estimate.

Reasoning text sits in ``reasoning`` (vLLM ≥ 0.10) or ``reasoning_content`` (DeepSeek, older vLLM) of a
chat ``message`` or ``delta``; completions carry everything in ``text``. Usage follows OpenAI's
``{"prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details": {"reasoning_tokens"},
"prompt_tokens_details": {"cached_tokens"}}``; all counts are tokens.
"""

from __future__ import annotations

from typing import Any

#: Where reasoning-capable servers put the thought, in the order replays emit them.
REASONING_FIELDS = ("reasoning_content", "reasoning")


def reasoning_of(part: dict[str, Any] | None) -> str | None:
    """The reasoning text of a chat ``message`` or ``delta`` (``reasoning`` or ``reasoning_content``), or None."""
    if not part:
        return None
    return part.get("reasoning") or part.get("reasoning_content")


def generated_text(choice: dict[str, Any], endpoint: str, delta: bool = False) -> str:
    """All text a choice generated, thought included: reasoning + content (chat) or ``text`` (completions)."""
    if endpoint == "completions":
        return str(choice.get("text") or "")
    part = choice.get("delta" if delta else "message") or {}
    return str(reasoning_of(part) or "") + str(part.get("content") or "")


def needs_reasoning_count(usage: dict[str, Any] | None) -> bool:
    """True when ``usage`` lacks a positive ``completion_tokens_details.reasoning_tokens``.

    A 0 next to non-empty reasoning text is treated as missing: some vLLM reasoning parsers report 0.
    """
    details = (usage or {}).get("completion_tokens_details") or {}
    return not details.get("reasoning_tokens")


def estimate_tokens(text: str) -> int:
    """Token count when no tokenizer answers: ~4 characters per token, rounded up (OpenAI's rule of thumb);
    0 for empty text, else at least 1."""
    return max(1, (len(text) + 3) // 4) if text else 0


def merge_usage(u1: dict[str, Any] | None, u2: dict[str, Any] | None, reasoning_tokens: int) -> dict[str, Any]:
    """Sum two upstream usage objects (tokens); ``reasoning_tokens`` is set as given (the thought phase's
    completion tokens under budget forcing). Cached prompt tokens are summed when either reports them."""
    u1, u2 = u1 or {}, u2 or {}
    prompt = int(u1.get("prompt_tokens") or 0) + int(u2.get("prompt_tokens") or 0)
    completion = int(u1.get("completion_tokens") or 0) + int(u2.get("completion_tokens") or 0)
    cached = sum(int(((u or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for u in (u1, u2))
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage
