"""The routing window: system prompt + last user turn, length-capped."""

from __future__ import annotations

import pytest

from router.features import clip_text
from router.window import message_text, routing_window


def test_system_plus_last_user_turn() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "developer", "content": [{"type": "text", "text": "Use LaTeX."}]},
        {"role": "user", "content": [{"type": "text", "text": "second"}, {"type": "image_url", "image_url": {}}]},
    ]
    assert routing_window(msgs) == "Be brief.\nUse LaTeX.\n\nsecond"
    assert routing_window(msgs, include_system=False) == "second"
    assert routing_window([{"role": "assistant", "content": "only"}]) == "only"
    assert routing_window([]) == ""
    assert message_text(None) == "" and message_text([{"type": "input_text", "text": "a"}, "b"]) == "a\nb"


def test_length_cap_keeps_head_and_tail_of_user_and_head_of_system() -> None:
    user = "START " + "x" * 10_000 + " QUESTION?"
    w = routing_window([{"role": "user", "content": user}], max_chars=200)
    assert len(w) <= 201 and w.startswith("START") and w.endswith("QUESTION?")
    system = "RULES " + "y" * 5_000
    w = routing_window([{"role": "system", "content": system}, {"role": "user", "content": user}], max_chars=400)
    assert len(w) <= 401 and w.startswith("RULES") and w.endswith("QUESTION?")
    # a short user turn leaves the rest of the budget to the system prompt
    w = routing_window([{"role": "system", "content": system}, {"role": "user", "content": "hi"}], max_chars=400)
    assert w.endswith("\n\nhi") and len(w) == 400
    with pytest.raises(ValueError):
        routing_window([], max_chars=4)


def test_clip_text() -> None:
    assert clip_text("abc", 10) == "abc"
    assert clip_text("abcdefghij", 4) == "ab\nij"
    with pytest.raises(ValueError):
        clip_text("abc", 1)
