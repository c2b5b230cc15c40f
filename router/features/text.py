"""Hand-made text features of a routing window (re-exported by :mod:`router.features`).

Every feature is cheap (a ``str.count``, a ``str.translate``, one pass over the word-token counts) because
the same function :func:`hand_features` runs on the request path (see :mod:`router.fastpath`), where the
whole prediction budget is ~0.3 ms for a 2,000-character prompt. Counts are squashed with ``log1p`` so a
long paste does not dominate the linear model.

Units: characters in; a float vector of length ``len(HAND_FEATURE_NAMES)`` out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

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


#: Extra features of ``feature_set="qa"`` (knowledge questions: constraints, dates, entities, multi-hop cues).
QA_FEATURE_NAMES: tuple[str, ...] = (
    "log_years",
    "log_ordinals",
    "log_capital_letters",
    "log_possessives",
    "log_comparatives",
    "how_many",
    "log_relative_words",
    "log_commas",
    "log_and",
    "log_quotes",
)
FEATURE_SETS: dict[str, tuple[str, ...]] = {"base": HAND_FEATURE_NAMES, "qa": HAND_FEATURE_NAMES + QA_FEATURE_NAMES}
_ORDINAL_WORDS = (
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth", "eleventh",
    "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth", "nineteenth",
    "twentieth", "thirtieth", "fortieth", "fiftieth", "hundredth", "thousandth", "last", "penultimate"
)
_SUFFIX = {1: "st", 2: "nd", 3: "rd"}
_NUMERIC_ORDINALS = [f"{i}{'th' if 10 <= i % 100 <= 20 else _SUFFIX.get(i % 10, 'th')}" for i in range(1, 1000)]
_COMPARATIVE_WORDS = (
    "than", "more", "less", "fewer", "older", "younger", "larger", "smaller", "bigger", "longer", "shorter",
    "higher", "lower", "taller", "before", "after", "between", "difference", "combined", "total", "earlier",
    "later", "most", "least", "oldest", "youngest", "largest", "smallest", "biggest", "longest", "shortest",
    "highest", "lowest", "tallest", "earliest", "latest", "greatest", "best", "worst", "fastest", "closest",
    "farthest", "furthest", "deepest", "richest", "heaviest"
)
_RELATIVE_WORDS = ["who", "which", "that", "whose", "whom", "where", "when"]
#: token → QA word class: 0 ordinal, 1 comparative/superlative, 2 relative word, 3 "and"
QA_CLASS_OF: dict[str, int] = {
    **{w: 0 for w in (*_ORDINAL_WORDS, *_NUMERIC_ORDINALS)},
    **{w: 1 for w in _COMPARATIVE_WORDS},
    **{w: 2 for w in _RELATIVE_WORDS},
    "and": 3,
}
N_QA_CLASSES = 4
#: bigrams that set ``how_many``: first token → allowed second tokens
HOW_BIGRAMS: dict[str, frozenset[str]] = {"how": frozenset(["many", "much", "old", "long", "far"]),
                                          "what": frozenset(("year",))}
_UPPER = bytes(range(65, 91))


def feature_names(feature_set: str = "base") -> tuple[str, ...]:
    """The hand-feature names of ``feature_set`` (``base`` or ``qa``). Raises ValueError for another."""
    try:
        return FEATURE_SETS[feature_set]
    except KeyError:
        raise ValueError(f"unknown feature_set {feature_set!r} (known: {sorted(FEATURE_SETS)})") from None


def qa_features(text: str, tokens: Sequence[str]) -> list[float]:
    """The :data:`QA_FEATURE_NAMES` of one (clipped) text; ``tokens`` = ``WORD_RE.findall(text.lower())``.

    Reference implementation (the Pipeline's); :mod:`router.fastpath` counts the same token classes with NumPy
    and both end in :func:`assemble_qa_features`. Word classes are :data:`QA_CLASS_OF` (ordinals — words and
    ``1st``…``999th`` —, comparatives and superlatives, relative words, "and"); ``how_many`` is 1 when a
    :data:`HOW_BIGRAMS` pair occurs ("how many/much/old/long/far", "what year").
    """
    counts = [0] * N_QA_CLASSES
    how = False
    prev = ""
    for tok in tokens:
        c = QA_CLASS_OF.get(tok)
        if c is not None:
            counts[c] += 1
        nxt = HOW_BIGRAMS.get(prev)
        if nxt is not None and tok in nxt:
            how = True
        prev = tok
    return assemble_qa_features(text, counts, how)


def assemble_qa_features(text: str, class_counts: Sequence[int], how: bool) -> list[float]:
    """Finish :func:`qa_features` from the token-class counts. Years are 4-digit ASCII numbers starting with
    1 or 20; capitalised letters (ASCII A–Z, an entity-count proxy), possessives, commas and quotes are
    counted on the text. Counts squashed with log1p."""
    log1p = math.log1p
    raw = text.encode("utf-8", "surrogatepass")
    numbers = raw.translate(_BYTES_NON_DIGIT_TO_SPACE).split()
    years = sum(1 for x in numbers if len(x) == 4 and (x[:1] == b"1" or x[:2] == b"20"))
    capitals = len(raw) - len(raw.translate(None, _UPPER))
    return [
        log1p(years),
        log1p(class_counts[0]),
        log1p(capitals),
        log1p(text.count("'s") + text.count("\u2019s")),
        log1p(class_counts[1]),
        1.0 if how else 0.0,
        log1p(class_counts[2]),
        log1p(text.count(",")),
        log1p(class_counts[3]),
        log1p(text.count('"') + text.count("\u201c") + text.count("\u201d")),
    ]


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

