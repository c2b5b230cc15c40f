"""The routing window: the part of a chat request the router reads.

Default: the system prompt(s) and the last user turn, because the last ask decides how hard the next answer
is, and the system prompt says what kind of task it is; earlier turns mostly add length, not difficulty
(RouteLLM routes on the last user turn too). Length-capped so a 100 kB paste costs no more than 4 kB.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.features import DEFAULT_MAX_CHARS, clip_text

#: Roles whose text counts as the system prompt.
SYSTEM_ROLES = ("system", "developer")


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string, or a list of parts whose ``type == "text"``
    parts are joined by newlines (images and audio contribute nothing). None → ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


def routing_window(
    messages: Sequence[Mapping[str, Any]],
    max_chars: int = DEFAULT_MAX_CHARS,
    *,
    include_system: bool = True,
) -> str:
    """System prompt(s) + ``"\\n\\n"`` + the last user turn, at most ~``max_chars`` characters.

    ``messages``: OpenAI chat messages (dicts with ``role`` and ``content``). With no user turn, the last
    message of any non-system role is used. When over the cap, the system part keeps its head, up to a
    quarter of the budget (more when the user turn is short), and the user turn the rest (head and tail,
    :func:`router.features.clip_text`).
    Raises ValueError if ``max_chars`` < 8.
    """
    if max_chars < 8:
        raise ValueError("max_chars must be >= 8")
    system = ""
    if include_system:
        texts = (message_text(m.get("content")) for m in messages if m.get("role") in SYSTEM_ROLES)
        system = "\n".join(t for t in texts if t)
    user = ""
    for m in reversed(messages):
        if m.get("role") == "user":
            user = message_text(m.get("content"))
            break
    else:
        for m in reversed(messages):
            if m.get("role") not in SYSTEM_ROLES:
                user = message_text(m.get("content"))
                break
    if not system:
        return clip_text(user, max_chars)
    if not user:
        return system[:max_chars]
    if len(system) + 2 + len(user) <= max_chars:
        return f"{system}\n\n{user}"
    # over the cap: the system prompt gets a quarter of the budget, more if the user turn is short
    sys_budget = min(len(system), max(max_chars // 4, max_chars - 2 - len(user)))
    return f"{system[:sys_budget]}\n\n{clip_text(user, max(2, max_chars - 2 - sys_budget))}"
