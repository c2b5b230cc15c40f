"""The ``verifier`` shadow judge: reference answers for requests whose question is a known task problem.

A served request carries no reference answer, so the task verifier can only judge where the operator says what
the right answer is: ``routing.shadow.references`` names a JSONL file of question rows — the format of
``thinkgate router label gateway``'s input and of :func:`router.tasks.rows.task_rows` (``{"question",
"answer"}``, optionally ``"task"`` (``arith`` | ``gsm8k`` | ``math``), ``"id"``, ``"difficulty"``) — and
``routing.shadow.verifier`` names the checker (:func:`router.tasks.verifiers.get_verifier`: ``task``,
``math``, ``int``, ``exact`` or ``module:function``). A request matches a row when its last user message equals
the row's ``question`` after whitespace is collapsed and case folded (an exact lookup: a paraphrase, a
different system prompt's effect on the answer, or extra turns are not recognised). Where a row matches,
the outcome is the verifier's verdict on the cheap answer (``sufficed`` = it is right) and no higher-tier call
is needed; elsewhere the shadow falls back to ``agreement``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.jsonl import read_jsonl

#: a checker: ``verify(row, completion_text) -> bool`` (:data:`router.tasks.verifiers.Verifier`)
Verifier = Callable[[dict[str, Any], str], bool]


def load_verifier(name: str) -> Verifier:
    """``router.tasks.verifiers.get_verifier(name)``, imported when the judge is configured (at startup, never
    per request): the request path imports no other offline task code — this one edge is the named exception
    of the request-path import contract (``ignore_imports`` in pyproject) — and the verifiers (math-verify for
    ``math``/``task``) are only needed where an operator asked for them. Raises ValueError for an unknown name."""
    from router.tasks.verifiers import get_verifier

    fn: Verifier = get_verifier(name)
    return fn


def question_key(text: str) -> str:
    """The lookup key of a question: whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def last_user_text(messages: Any) -> str | None:
    """The text of the last ``user`` message of a chat ``messages`` list (string content, or the ``text``
    parts of a content list joined by newlines); None when there is none."""
    if not isinstance(messages, list):
        return None
    for msg in reversed(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(p.get("text", "") for p in content if isinstance(p, dict)
                                 and p.get("type") == "text")
            return None
    return None


class References:
    """Question rows by :func:`question_key`, and the verifier that checks an answer against one."""

    def __init__(self, rows: list[dict[str, Any]], verifier: Verifier) -> None:
        self.rows = {question_key(str(r["question"])): r for r in rows}
        self.verifier = verifier

    @classmethod
    def load(cls, path: Path, verifier: str) -> References:
        """Read ``path`` (JSONL, one row per line, blank lines skipped). Raises ValueError naming the file and
        line for a row without ``question`` / ``answer``, bad JSON, a missing file or an unknown verifier."""
        check = load_verifier(verifier)
        try:
            rows = list(read_jsonl(path))
        except OSError as exc:
            raise ValueError(f"routing.shadow.references: cannot read {path}: {exc}") from None
        except ValueError as exc:  # names the file and the line
            raise ValueError(f"routing.shadow.references: {exc}") from None
        for n, row in enumerate(rows, 1):
            if "question" not in row or "answer" not in row:
                raise ValueError(f"routing.shadow.references: {path}: row {n} needs 'question' and 'answer'")
        return cls(rows, check)

    def find(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The row whose question is the request's last user message, or None."""
        text = last_user_text(body.get("messages"))
        return None if text is None else self.rows.get(question_key(text))

    def verdict(self, row: dict[str, Any], answer: str) -> bool:
        """Whether ``answer`` (the cheap tier's completion text) is right for ``row``; a verifier error is a
        wrong answer."""
        try:
            return bool(self.verifier(row, answer))
        except Exception:  # a checker that cannot parse the answer has not verified it
            return False
