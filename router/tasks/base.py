"""The common problem type and answer extraction shared by every task family."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

#: The string that closes a thought; the answer is read from the text after its last occurrence.
THINK_END = "</think>"

_ANSWER_RE = re.compile(r"answer\s+is\s*:?\s*(.+?)\s*(?:\.\s*)?(?:<\|im_end\|>)?\s*$", re.IGNORECASE | re.DOTALL)
_BOXED_RE = re.compile(r"\\boxed\{")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Problem:
    """One verifiable problem.

    ``id`` is unique within its task (e.g. ``"arith/test/1000017"``), ``question`` is the user message
    (characters), ``answer`` the reference answer as a string (an integer for ``arith``/``gsm8k``, a LaTeX
    expression for ``math``), ``difficulty`` an int level (number of operations for ``arith``; MATH level
    1–5; 0 when unknown), ``source`` the task name, and ``meta`` free-form extras (never used to verify).
    """

    id: str
    question: str
    answer: str
    difficulty: int
    source: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def answer_region(text: str) -> str:
    """The part of a completion that holds the answer: everything after the last ``</think>``.

    A completion with no ``</think>`` is taken whole (e.g. vLLM's ``message.content``, which already has the
    thought removed by the reasoning parser).
    """
    idx = text.rfind(THINK_END)
    return text[idx + len(THINK_END) :] if idx >= 0 else text


def _last_boxed(text: str) -> str | None:
    start = None
    for m in _BOXED_RE.finditer(text):
        start = m.end()
    if start is None:
        return None
    depth, i = 1, start
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
        i += 1
    return None


def extract_answer(text: str) -> str | None:
    """Extract the final answer from a completion, or None when there is none.

    Looks only after the last ``</think>`` (see :func:`answer_region`). In order: the content of the last
    ``\\boxed{…}``; the text after the last "answer is" up to a final period (``"The answer is 36."`` →
    ``"36"``); otherwise the last number in the region (commas removed). Units: characters in, a string out.
    """
    region = answer_region(text).strip()
    if not region:
        return None
    boxed = _last_boxed(region)
    if boxed:
        return boxed
    lowered = region.lower()
    idx = lowered.rfind("answer is")
    if idx >= 0:
        m = _ANSWER_RE.search(region[idx:])
        if m:
            candidate = m.group(1).strip().rstrip(".").strip()
            if candidate:
                return candidate
    numbers = _NUMBER_RE.findall(region)
    if numbers:
        return numbers[-1].replace(",", "")
    return None


def parse_int(text: str | None) -> int | None:
    """Parse an integer answer such as ``"36"``, ``"-4"``, ``"1,200"``, ``"$36"`` or ``"36.0"``; None if not one."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    m = re.fullmatch(r"(-?\d+)(?:\.0+)?", s)
    if m is None:
        return None
    return int(m.group(1))
