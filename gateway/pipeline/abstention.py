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

The abstention rule itself (:func:`abstains`, :func:`final_part`, :data:`DEFAULT_PHRASES`) lives in
:mod:`router.abstention` — the same function the trace router is calibrated with (``thinkgate router fit --traces``),
so the cascade a router file was calibrated for is the cascade the gateway serves (tested equal on every recorded
cheap answer of the traces). Grading is never read at serving time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.abstention import DEFAULT_PHRASES, TAIL_CHARS, abstains, final_part

__all__ = ["DEFAULT_PHRASES", "TAIL_CHARS", "abstains", "answer_text", "cascade_reason", "final_part",
           "mean_logprob"]


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
