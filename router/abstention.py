"""Whether an answer abstains ("I don't know"): the ONE rule the router fits with and the gateway serves.

Stdlib only (the gateway's request path imports it; so do the trace fit, the offline evaluation and the bench).
:func:`abstains` is True when the **final-answer part** of the text contains one of the phrases (default
:data:`DEFAULT_PHRASES`, English only), or is blank after clean-up. Final-answer part (:func:`final_part`): the text
after the last ``Answer:`` when there is one, else the last :data:`TAIL_CHARS` characters; special tokens such as
``<|im_end|>`` are removed, curly apostrophes made straight, whitespace collapsed and case folded before matching
(plain substring match, so a phrase should be a whole expression, e.g. ``"i don't know"``). ``None`` abstains.

The default phrases were chosen on the recorded traces' questions outside the held-out split
(``python -m bench.traces.calibrate_abstention`` prints, per phrase, how often it fires on the cheap settings'
answers and how often such an answer was nevertheless graded correct; a phrase is dropped when more than 5 %
of the answers it flags were correct — "i cannot verify" was, at 1 of 4). On those 7,919 answers the list flags
3,157, none graded correct, and catches 3,148 of the 3,247 "not attempted" ones. Grading is never read at
serving time. A router file fitted with ``thinkgate router fit --traces`` stores the phrase list it was calibrated
with (``metadata.serving.cascade.phrases``), and the gateway serves that list.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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
