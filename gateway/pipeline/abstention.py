"""Cascade checks on a finished answer: did the model abstain ("I don't know"), or is it unsure (logprobs)?

Pure functions over the answer text and the choice's ``logprobs``; the proxy calls :func:`cascade_reason`
after the empty/cut checks of :func:`gateway.thinking.forcing.escalation_reason`, for the conditions a tier
lists in ``escalate_on``:

- ``abstain``: the **final-answer part** of the text contains one of the tier's ``abstain_phrases`` (default
  :data:`DEFAULT_PHRASES`, English only). Final-answer part: the text after the last ``Answer:`` when there is
  one, else the last :data:`TAIL_CHARS` characters; special tokens such as ``<|im_end|>`` are removed, curly
  apostrophes made straight, whitespace collapsed and case folded before matching (plain substring match, so
  a phrase should be a whole expression, e.g. ``"i don't know"``). An answer that is blank after that
  clean-up abstains too (a blank raw answer is already ``empty_answer``).
- ``low_confidence``: the mean token log-probability of the answer (``choices[0].logprobs.content[*].logprob``,
  OpenAI's / vLLM's shape, natural log) is below the tier's ``min_answer_logprob``. Only where the upstream
  returned logprobs (ask for them in the tier's ``sampling: {logprobs: true}``); without them it never fires.

The default phrases were chosen on the recorded traces' questions outside the held-out split
(``python -m bench.traces.calibrate_abstention`` prints, per phrase, how often it fires on the cheap settings'
answers and how often such an answer was nevertheless graded correct; a phrase is dropped when more than 5 %
of the answers it flags were correct — "i cannot verify" was, at 1 of 4). On those 7,919 answers the list flags
3,157, none graded correct, and catches 3,148 of the 3,247 "not attempted" ones. Grading is never read at
serving time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

TAIL_CHARS = 300

#: English "I don't know"-like expressions (lower case, straight apostrophes); see the module doc.
DEFAULT_PHRASES: tuple[str, ...] = (
    "i don't know",
    "i do not know",
    "i'm not sure",
    "i am not sure",
    "i'm not certain",
    "i am not certain",
    "not enough information",
    "enough information to",
    "insufficient information",
    "don't have information",
    "do not have information",
    "don't have specific information",
    "don't have this specific information",
    "don't have reliable information",
    "i cannot determine",
    "i can't determine",
    "cannot be determined",
    "unable to determine",
    "i'm unable to",
    "i am unable to",
    "i cannot answer",
    "i can't answer",
    "i cannot provide",
    "i can't provide",
    "i cannot confirm",
    "i can't confirm",
    "i can't verify",
    "unable to verify",
    "i couldn't find",
    "i could not find",
    "may i look this up",
    "look this up on the web",
    "i don't have access",
    "don't have this information",
    "don't have that information",
    "don't have sufficient information",
    "don't have enough",
    "don't have that fact",
    "may i look it up",
    "want me to look",
    "want me to search",
    "like me to look",
    "allow me to look",
)

_SPECIAL = re.compile(r"<\|[^|>]*\|>")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)


def final_part(text: str) -> str:
    """The cleaned final-answer part of ``text`` (see the module doc), lower case."""
    t = _SPECIAL.sub("", text).replace("\u2019", "'").replace("\u2018", "'")
    hits = list(_ANSWER.finditer(t))
    tail = t[hits[-1].end():] if hits else t[-TAIL_CHARS:]
    return " ".join(tail.split()).casefold()


def abstains(text: str | None, phrases: Sequence[str] | None = None) -> bool:
    """True when ``text`` gives no answer: blank after clean-up, or its final-answer part contains a phrase
    (``phrases``, default :data:`DEFAULT_PHRASES`; matched case-insensitively)."""
    if text is None:
        return True
    tail = final_part(text)
    if not tail:
        return True
    return any(p.casefold().replace("\u2019", "'") in tail for p in (DEFAULT_PHRASES if phrases is None else phrases))


def mean_logprob(choice: dict[str, Any]) -> float | None:
    """Mean of ``choice.logprobs.content[*].logprob`` (natural log), None when the choice has none."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    vals = [float(t["logprob"]) for t in content or () if isinstance(t, dict) and isinstance(t.get("logprob"),
                                                                                           int | float)]
    return sum(vals) / len(vals) if vals else None


def answer_text(choice: dict[str, Any], endpoint: str) -> str:
    """The answer of a choice: chat ``message.content``; completions ``text`` after the last ``</think>``."""
    if endpoint == "chat":
        return str((choice.get("message") or {}).get("content") or "")
    text = str(choice.get("text") or "")
    return text.rsplit("</think>", 1)[1] if "</think>" in text else text


def cascade_reason(escalate_on: Sequence[str], phrases: Sequence[str] | None, min_logprob: float | None,
                   data: dict[str, Any], endpoint: str) -> str | None:
    """``"abstain"`` or ``"low_confidence"`` when the first choice of ``data`` (an OpenAI response, or the
    proxy's stream summary) meets that condition and it is listed in ``escalate_on``; else None."""
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    if "abstain" in escalate_on and abstains(answer_text(c, endpoint), phrases):
        return "abstain"
    if "low_confidence" in escalate_on and min_logprob is not None:
        m = mean_logprob(c)
        if m is not None and m < min_logprob:
            return "low_confidence"
    return None
