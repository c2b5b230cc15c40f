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
    """The reasoning text of a chat ``message`` or ``delta`` (``reasoning`` or ``reasoning_content``), or None. A
    value that is no string (an upstream's malformed part) is none: joined with the others, it broke the relay."""
    if not part:
        return None
    for name in ("reasoning", "reasoning_content"):
        if isinstance(text := part.get(name), str) and text:
            return text
    return None


def generated_text(choice: dict[str, Any], endpoint: str, delta: bool = False) -> str:
    """All text a choice generated, thought included: reasoning + content (chat) or ``text`` (completions)."""
    if endpoint == "completions":
        return str(choice.get("text") or "")
    part = choice.get("delta" if delta else "message") or {}
    return str(reasoning_of(part) or "") + str(part.get("content") or "")


def needs_reasoning_count(usage: dict[str, Any] | None, limit: int | None = None) -> bool:
    """True when ``usage`` lacks a positive ``completion_tokens_details.reasoning_tokens``.

    A 0 next to non-empty reasoning text is treated as missing: some vLLM reasoning parsers report 0; so is a count
    that is no count (negative, not a number, above ``limit``: the call's :func:`usage_limit`, as every other field
    of its usage is checked — None: :data:`MAX_USAGE_TOKENS`; a legitimate count of ``n`` choices above 10M was
    taken for none and recounted)."""
    details = (usage or {}).get("completion_tokens_details") or {}
    count = token_count(details.get("reasoning_tokens"), MAX_USAGE_TOKENS if limit is None else limit) \
        if isinstance(details, dict) else None
    return not (count or 0) > 0


#: The largest token count one usage field of a single prompt and choice may carry (above every context window
#: and output limit there is): a count past it — 1e12 completion tokens booked $2,000,000 on one request — is not a
#: count, and the gateway counts the call itself. A call admitted with a larger bound may report up to that bound
#: (:func:`usage_limit`): ``n: 128`` choices of 100k tokens each are 12.8M legitimately.
MAX_USAGE_TOKENS = 10_000_000


def usage_limit(token_bound: int | None) -> int:
    """The largest count one usage field of a call may carry: :data:`MAX_USAGE_TOKENS`, or the call's admitted
    token bound (prompt + every choice's completion, at most) when that is larger — a count above both is no count
    of this call; None: no bound known (the floor alone)."""
    return MAX_USAGE_TOKENS if token_bound is None else max(MAX_USAGE_TOKENS, token_bound)


def token_count(v: Any, limit: int | None = MAX_USAGE_TOKENS) -> int | None:
    """``v`` as a token count: a non-negative integer (an integral float too) up to ``limit`` (None: any size, for a
    sum of the gateway's own whose parts were checked, or are checked again as a whole); None for anything else
    (negative, fractional, a string, a bool, null, above the limit)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    if isinstance(v, float) and not v.is_integer():
        return None
    return int(v) if v >= 0 and (limit is None or v <= limit) else None


def usage_counts(usage: Any, completion: bool = True,
                 limit: int = MAX_USAGE_TOKENS) -> tuple[int, int, int, int] | None:
    """(prompt, completion, cached prompt, reasoning) tokens of an upstream ``usage`` object the gateway can meter,
    or None when it cannot trust it: ``prompt_tokens`` and ``completion_tokens`` must both be counts
    (:func:`token_count` up to ``limit``, the call's :func:`usage_limit`: a missing, null, negative, fractional,
    non-numeric or absurd value is none). The details are optional: a bad ``cached_tokens`` or ``reasoning_tokens``
    counts as 0, and each is clipped to its total (a cached count above the prompt, a reasoning count above the
    completion, are not possible). ``completion=False``: an embeddings usage, which has no ``completion_tokens`` (0
    when absent)."""
    if not isinstance(usage, dict):
        return None
    prompt = token_count(usage.get("prompt_tokens"), limit)
    generated = token_count(usage.get("completion_tokens", None if completion else 0), limit)
    if prompt is None or generated is None:
        return None
    pd, cd = usage.get("prompt_tokens_details"), usage.get("completion_tokens_details")
    cached = token_count(pd.get("cached_tokens"), limit) if isinstance(pd, dict) else None
    reasoning = token_count(cd.get("reasoning_tokens"), limit) if isinstance(cd, dict) else None
    return prompt, generated, min(cached or 0, prompt), min(reasoning or 0, generated)


def estimate_tokens(text: str) -> int:
    """Token count when no tokenizer answers: ~4 characters per token, rounded up (OpenAI's rule of thumb);
    0 for empty text, else at least 1."""
    return max(1, (len(text) + 3) // 4) if text else 0


#: Prompt tokens an image or audio part counts for in an estimate (OpenAI's low-detail image: 85); its bytes
#: (a base64 data URL of a megabyte is 250,000 "tokens" at 4 characters each) are never counted as text.
MEDIA_TOKENS = 85
#: content part types whose tokens are not their bytes (an image, audio or file: by URL or inline)
MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "input_audio", "audio", "file", "input_file"})


def _text_and_media(value: Any) -> tuple[list[str], int]:
    """The strings of a messages list (contents and tool arguments alike) and its count of media parts."""
    if isinstance(value, str):
        return ([] if value.startswith("data:") else [value]), 0
    if isinstance(value, dict) and value.get("type") in MEDIA_PARTS:
        return [], 1
    texts: list[str] = []
    media = 0
    for v in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        t, m = _text_and_media(v)
        texts += t
        media += m
    return texts, media


def has_media(value: Any) -> bool:
    """Whether a messages list (or a prompt, or tools) holds an image, audio or file part (:data:`MEDIA_PARTS`)."""
    if isinstance(value, dict):
        return value.get("type") in MEDIA_PARTS or any(has_media(v) for v in value.values())
    return isinstance(value, list) and any(has_media(v) for v in value)


def estimate_prompt(value: Any) -> int:
    """Prompt tokens of a messages list or a prompt when no tokenizer answers: ~4 characters a token of its
    text, :data:`MEDIA_TOKENS` per image or audio part (its bytes are not text)."""
    texts, media = _text_and_media(value)
    return estimate_tokens(" ".join(texts)) + MEDIA_TOKENS * media


def merge_usage(u1: dict[str, Any] | None, u2: dict[str, Any] | None, reasoning_tokens: int) -> dict[str, Any]:
    """Sum two upstream usage objects (tokens); ``reasoning_tokens`` is set as given (the thought phase's
    completion tokens under budget forcing). Cached prompt tokens are summed when either reports them."""
    u1, u2 = u1 or {}, u2 or {}

    def field(u: dict[str, Any], name: str, part: str | None = None) -> int:
        # each field on its own (phase 1 under the loop guard carries completion_tokens alone); one that is no
        # count adds 0 — not a 500 mid-answer. No size limit here: ``u1`` is the running sum over a request's
        # choices (n choices pass 10M legitimately), and the merged usage is held to the call's own limit where it
        # is metered (``UsageRecord.set_usage``)
        holder = u.get(part) if part else u
        return (token_count(holder.get(name), None) or 0) if isinstance(holder, dict) else 0

    prompt = field(u1, "prompt_tokens") + field(u2, "prompt_tokens")
    completion = field(u1, "completion_tokens") + field(u2, "completion_tokens")
    cached = min(prompt, field(u1, "cached_tokens", "prompt_tokens_details")
                 + field(u2, "cached_tokens", "prompt_tokens_details"))
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage
