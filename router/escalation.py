"""Answer-aware escalation: a small logistic model on what the gateway sees of a cheap tier's finished answer,
giving P(this answer is wrong). ONE feature function (:func:`answer_features`) for the fit (the traces' recorded
answers, :mod:`router.fit.escalation_fit`) and for serving (:mod:`gateway.pipeline.escalation`); the model is a
plain dict in the router file (``metadata.serving.cascade.model``: names, means, scales, coefficients,
intercept, threshold — skops-safe, no pickled object) scored with NumPy-free arithmetic.

Features (all computed from serving-time data; grading is never read):

* ``abstains`` — :func:`router.abstention.abstains` of the answer (the one phrase rule);
* ``answer_chars``, ``answer_words`` — ``log1p`` of the answer's length (characters, words);
* ``thought_chars`` — ``log1p`` of the thinking text's length (``message.reasoning`` / ``reasoning_content``);
* ``completion_tokens``, ``reasoning_tokens`` — ``log1p`` of the usage counts (0 when absent) and
  ``has_reasoning_tokens`` (the provider reported them);
* ``finish_length`` — finish reason ``length``;
* ``hedges`` — ``log1p`` of the count of hedging words in the final-answer part (:data:`HEDGES`, English);
* ``digits`` — the final part contains a digit; ``entities`` — ``log1p`` of its capitalised words;
* ``overlap`` — share of the final part's words (≥ 4 letters) that also occur in the question;
* ``answer_marker`` — the answer has an ``Answer:`` line;
* ``score`` — the router's question score (0.5 when unknown).

Cost: one pass over at most :data:`MAX_CHARS` characters of answer and question each; ~0.05–0.1 ms at 2,000
characters (``bench/router_latency.py --escalation``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from router.abstention import abstains, final_part

#: the feature names, in the order :func:`answer_features` returns them (stored in the file and checked)
FEATURES: tuple[str, ...] = (
    "abstains", "answer_chars", "answer_words", "thought_chars", "completion_tokens", "reasoning_tokens",
    "has_reasoning_tokens", "finish_length", "hedges", "digits", "entities", "overlap", "answer_marker", "score",
)
#: hedging expressions counted in the final-answer part (lower case, whole words)
HEDGES: tuple[str, ...] = (
    "probably", "likely", "possibly", "perhaps", "might", "may", "maybe", "approximately", "around", "about",
    "roughly", "i think", "i believe", "it seems", "appears", "uncertain", "unclear", "not sure", "however",
    "estimate", "guess", "assume", "if ", "or ", "unknown",
)
#: characters of answer / question / thought read (the rest only counts in the lengths)
MAX_CHARS = 4000

_WORD = re.compile(r"[a-z0-9]{4,}")
_CAP = re.compile(r"\b[A-Z][a-zA-Z]+")
_DIGIT = re.compile(r"\d")
_HEDGE = re.compile("|".join(r"\b" + re.escape(h.strip()) + r"\b" for h in HEDGES))
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)


def answer_features(answer: str | None, thought: str | None = None, *, completion_tokens: float | None = None,
                    reasoning_tokens: float | None = None, finish_reason: str | None = None,
                    question: str | None = None, score: float | None = None,
                    phrases: Sequence[str] | None = None) -> list[float]:
    """The feature vector (len(:data:`FEATURES`), floats) of one finished answer; see the module doc."""
    a = (answer or "")[-MAX_CHARS:]
    tail = final_part(a)
    raw_tail = a[-300:]
    q_words = set(_WORD.findall((question or "")[:MAX_CHARS].casefold()))
    t_words = _WORD.findall(tail)
    overlap = (sum(w in q_words for w in t_words) / len(t_words)) if t_words else 0.0
    rt = reasoning_tokens if isinstance(reasoning_tokens, int | float) and not math.isnan(reasoning_tokens) else None
    ct = completion_tokens if isinstance(completion_tokens, int | float) and not math.isnan(completion_tokens) \
        else None
    return [
        1.0 if abstains(answer, phrases) else 0.0,
        math.log1p(len(answer or "")),
        math.log1p(len((answer or "").split())),
        math.log1p(len(thought or "")),
        math.log1p(max(0.0, float(ct or 0.0))),
        math.log1p(max(0.0, float(rt or 0.0))),
        0.0 if rt is None else 1.0,
        1.0 if finish_reason == "length" else 0.0,
        math.log1p(len(_HEDGE.findall(tail))),
        1.0 if _DIGIT.search(tail) else 0.0,
        math.log1p(len(_CAP.findall(raw_tail))),
        overlap,
        1.0 if _ANSWER.search(a) else 0.0,
        0.5 if score is None or not isinstance(score, int | float) else float(score),
    ]


def model_probability(model: Mapping[str, Any], x: Sequence[float]) -> float:
    """P(wrong) of feature vector ``x`` under a stored model (``{"features", "mean", "scale", "coef",
    "intercept"}``; standardise, dot, sigmoid). Raises ValueError when the stored feature names differ from
    :data:`FEATURES` (a file written by another version)."""
    names = model.get("features")
    if list(names or ()) != list(FEATURES):
        raise ValueError("escalation model features differ from router.escalation.FEATURES")
    z = float(model["intercept"])
    for xi, m, s, w in zip(x, model["mean"], model["scale"], model["coef"], strict=True):
        z += float(w) * (xi - float(m)) / (float(s) or 1.0)
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def should_escalate(model: Mapping[str, Any], x: Sequence[float]) -> bool:
    """True when :func:`model_probability` ≥ the model's stored ``threshold``."""
    return model_probability(model, x) >= float(model["threshold"])
