"""Hand-made text features of a routing window, and the small stateless transformers the Pipeline needs.

Every feature is cheap (a ``str.count``, a ``str.translate``, one pass over the word-token counts) because
the same function :func:`hand_features` runs on the request path (see :mod:`router.fastpath`), where the
whole prediction budget is ~0.3 ms for a 2,000-character prompt. Counts are squashed with ``log1p`` so a
long paste does not dominate the linear model.

Units: characters in; a float vector of length ``len(HAND_FEATURE_NAMES)`` out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin

#: Default cap on the characters the model reads (head and tail kept, see :func:`clip_text`).
DEFAULT_MAX_CHARS = 4000

#: Word tokens, shared with the word TF-IDF (its ``token_pattern``): maximal runs of word characters.
WORD_PATTERN = r"\w+"
WORD_RE = re.compile(WORD_PATTERN)

_BYTES_NON_DIGIT_TO_SPACE = bytes(b if 48 <= b <= 57 else 32 for b in range(256))
_OPS = str.maketrans("", "", "+-*/^=<>×÷±≤≥√∑∫π%!|")
_CHOICE_RE = re.compile(r"(?m)^\s*[A-Ea-e][.)]\s")

_FAMILIES: tuple[tuple[str, ...], ...] = (
    ("what", "how", "why", "which", "who", "when", "where"),
    ("find", "compute", "calculate", "evaluate", "determine", "solve", "simplify", "express", "many", "much"),
    ("prove", "show", "justify", "explain", "derive", "suppose", "assume", "let", "if", "then"),
    ("def", "return", "import", "class", "function", "print", "code", "python", "array", "string", "int"),
    (
        "probability", "integer", "integers", "prime", "remainder", "polynomial", "matrix", "triangle",
        "circle", "area", "sequence", "sum", "product", "digit", "digits", "root", "roots", "real", "complex",
        "maximum", "minimum", "largest", "smallest", "positive", "equation",
    ),
)  # fmt: skip
#: token → family index (0–4) for the five word families above
FAMILY_OF: dict[str, int] = {w: i for i, words in enumerate(_FAMILIES) for w in words}
N_FAMILIES = len(_FAMILIES)
#: one-letter tokens counted as variables ("a" and "i" are usually words)
VAR_LETTERS = frozenset("bcdefghjklmnopqrstuvwxyz")

HAND_FEATURE_NAMES: tuple[str, ...] = (
    "log_chars",
    "log_word_tokens",
    "log_lines",
    "chars_per_token",
    "digit_frac",
    "log_numbers",
    "log_max_number_len",
    "log_operators",
    "log_backslashes",
    "log_dollars",
    "log_braces",
    "log_question_marks",
    "log_wh_words",
    "log_task_words",
    "log_reasoning_words",
    "log_code_words",
    "log_math_nouns",
    "log_choice_lines",
    "log_single_letter_vars",
    "code_fence",
)


def clip_text(text: str, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Cap ``text`` at about ``max_chars`` characters, keeping the head and the tail.

    The question of a long prompt is usually at its end (context first, ask last) and instructions at its
    start, so the middle is dropped: ``text[:h] + "\\n" + text[-t:]`` with ``h = max_chars // 2`` and
    ``t = max_chars - h`` (``max_chars + 1`` characters). Shorter texts are returned unchanged.
    Raises ValueError if ``max_chars`` < 2.
    """
    if max_chars < 2:
        raise ValueError("max_chars must be >= 2")
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    return text[:head] + "\n" + text[len(text) - (max_chars - head) :]


def hand_features(text: str, tokens: Sequence[str] | None = None) -> list[float]:
    """The hand features of one (already clipped) text, in :data:`HAND_FEATURE_NAMES` order.

    ``tokens`` are ``WORD_RE.findall(text.lower())`` when the caller already has them. Numbers are maximal
    runs of ASCII digits (``[0-9]+``); variables are one-letter tokens in :data:`VAR_LETTERS`; the word
    families are :data:`FAMILY_OF`. Shape: a list of ``len(HAND_FEATURE_NAMES)`` floats.
    This is the reference implementation (used by the Pipeline); :mod:`router.fastpath` counts the token
    families with NumPy and both end in :func:`assemble_hand_features`; a test asserts they agree.
    """
    if tokens is None:
        tokens = WORD_RE.findall(text.lower())
    fam = [0] * N_FAMILIES
    variables = 0
    for tok in tokens:
        f = FAMILY_OF.get(tok)
        if f is not None:
            fam[f] += 1
        if tok in VAR_LETTERS:
            variables += 1
    return assemble_hand_features(text, len(tokens), fam, variables)


def assemble_hand_features(text: str, n_tokens: int, family_counts: Sequence[int], variables: int) -> list[float]:
    """Finish :func:`hand_features` from the token-level counts (shared by the Pipeline and the fast path)."""
    n = len(text)
    log1p = math.log1p
    # maximal runs of ASCII digits, via bytes.translate (C speed): every other byte, including all bytes of
    # multi-byte UTF-8 sequences, becomes a space
    numbers = text.encode("utf-8", "surrogatepass").translate(_BYTES_NON_DIGIT_TO_SPACE).split()
    n_digits = sum(map(len, numbers))
    return [
        log1p(n),
        log1p(n_tokens),
        log1p(text.count("\n")),
        n / (n_tokens + 1),
        n_digits / (n + 1),
        log1p(len(numbers)),
        log1p(max(map(len, numbers), default=0)),
        log1p(n - len(text.translate(_OPS))),
        log1p(text.count("\\")),
        log1p(text.count("$")),
        log1p(text.count("{")),
        log1p(text.count("?")),
        *(log1p(float(c)) for c in family_counts),
        log1p(len(_CHOICE_RE.findall(text))),
        log1p(variables),
        1.0 if "```" in text else 0.0,
    ]


class TextClipper(TransformerMixin, BaseEstimator):
    """Pipeline step: :func:`clip_text` on each document (stateless). In: iterable of str; out: list of str."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_chars = max_chars

    def fit(self, X: Iterable[str], y: object = None) -> TextClipper:
        return self

    def transform(self, X: Iterable[str]) -> list[str]:
        return [clip_text(str(x), self.max_chars) for x in X]


class HandFeatures(TransformerMixin, BaseEstimator):
    """Pipeline step: :func:`hand_features` per document (stateless). Out: float64 array (n_docs, n_features)."""

    def fit(self, X: Iterable[str], y: object = None) -> HandFeatures:
        return self

    def transform(self, X: Sequence[str]) -> np.ndarray:
        rows = [hand_features(x) for x in X]
        return np.asarray(rows, dtype=np.float64).reshape(-1, len(HAND_FEATURE_NAMES))

    def get_feature_names_out(self, input_features: object = None) -> np.ndarray:
        return np.asarray(HAND_FEATURE_NAMES, dtype=object)
