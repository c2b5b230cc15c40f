"""The ``normalised`` shadow judge: do the cheap and the higher tier reach the same *final answer*?

Beside ``agreement`` (:func:`gateway.control.shadow.answers_agree`: the normalised texts after the last
``Answer:`` are equal), this judge compares what each answer concludes, with the ``router.tasks`` checkers where
a task applies. Both texts are first cleaned: ``<think>`` blocks and chat special tokens (``<|im_end|>``) removed.
Then, on the higher tier's final answer as the reference:

1. **numbers** — the reference's final answer (:func:`router.tasks.extract_answer`: last ``\\boxed{}``, else after
   "answer is"/``Answer:``, else the last number) parses as a number (:func:`router.tasks.parse_int`, or a
   decimal): the cheap answer's final answer must be the same number (decimals within 1e-6 relative);
2. **math** — the reference has a ``\\boxed{}`` that is not a plain number: math-verify equivalence
   (:func:`router.tasks.verifiers.verify_math`; a checker error is a disagreement);
3. **text** — both say they do not know (``I don't know``, ``unknown``, ``cannot determine``…) → agree; one
   does and the other does not → disagree; otherwise the normalised answers (:func:`normalise_answer`) are equal,
   or the shorter one's words all appear, in order, in the longer one (``sarah rudolph`` in ``sarah ann
   rudolph``) and it has at least half its words.

The task code is imported by name when the judge is configured (never per request), as the ``verifier`` judge
does: the request path's import contract keeps ``router.tasks`` out of its imports. The label noise of each judge
against the recorded grading on the traces: ``bench/shadow_judges.py`` (numbers in bench/RESULTS.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_SPECIAL = re.compile(r"<\|[^|>]*\|>")
_THINK = re.compile(r"<think>.*?</think>", re.S)
_DECIMAL = re.compile(r"^[-+]?\$?\s*\d[\d,]*(\.\d+)?%?$")
_IDK = re.compile(r"\b(i\s+do\s*n[o']?t\s+know|i\s+dont\s+know|unknown|not\s+sure|cannot\s+(be\s+)?determine[d]?|"
                  r"can\s*not\s+(be\s+)?determine[d]?|unable\s+to\s+(determine|find|answer)|no\s+information)\b")


def clean(text: str) -> str:
    """``text`` without ``<think>`` blocks and chat special tokens."""
    return _SPECIAL.sub(" ", _THINK.sub(" ", text or ""))


def _number(s: str | None) -> float | None:
    if s is None:
        return None
    t = s.strip().rstrip(".")
    if not _DECIMAL.match(t):
        return None
    try:
        return float(t.replace("$", "").replace(",", "").replace("%", "").strip())
    except ValueError:
        return None


def abstains(normalised: str) -> bool:
    """Whether a normalised final answer says it does not know."""
    return bool(_IDK.search(normalised)) or normalised in ("", "none", "n a", "na")


def _subsequence(short: list[str], long: list[str]) -> bool:
    it = iter(long)
    return all(any(w == x for x in it) for w in short)


class NormalisedJudge:
    """``judge(cheap_answer, higher_answer) -> bool`` (module doc). Build at start-up (imports the checkers)."""

    def __init__(self, normalise: Callable[[str], str]) -> None:
        # lazy: the task checkers load only when this judge is configured (listed in the request-path contract)
        from router.tasks import extract_answer
        from router.tasks.verifiers import verify_math

        self.extract: Callable[[str], str | None] = extract_answer
        self.verify_math: Callable[[dict[str, Any], str], bool] = verify_math
        #: the agreement judge's normalisation (``gateway.control.shadow.normalise_answer``, passed in)
        self.normalise = normalise

    def final(self, text: str) -> str | None:
        """The checker's final answer of a cleaned ``text`` (after ``Answer:`` first, as the tiers are told)."""
        low = text.lower()
        cut = low.rfind("answer:")
        if cut >= 0:
            tail = text[cut + len("answer:"):].strip()
            if tail:
                return tail.splitlines()[0].strip()
        return self.extract(text)

    def __call__(self, cheap: str, higher: str) -> bool:
        a, b = clean(cheap), clean(higher)
        ref = self.final(b)
        ref_num = _number(ref)
        if ref_num is not None:  # 1. numbers
            got = _number(self.final(a))
            return got is not None and abs(got - ref_num) <= 1e-6 * max(1.0, abs(ref_num))
        if "\\boxed" in b:  # 2. math
            boxed = self.extract(b)
            if boxed:
                try:
                    return bool(self.verify_math({"answer": boxed}, a))
                except Exception:
                    return False
        na, nb = self.normalise(a), self.normalise(b)  # 3. text
        ia, ib = abstains(na), abstains(nb)
        if ia or ib:
            return ia and ib
        if na == nb:
            return bool(na)
        wa, wb = na.split(), nb.split()
        short, long = (wa, wb) if len(wa) <= len(wb) else (wb, wa)
        return bool(short) and 2 * len(short) >= len(long) and _subsequence(short, long)
