"""What the router reads off a prompt: hand-made text features (:mod:`router.features.text`, NumPy-free, the
request path imports them) and the two stateless scikit-learn Pipeline steps built on them
(:mod:`router.features.steps`, offline: fitting and the full skops load).

The steps are re-exported lazily, so ``import router.features`` never imports scikit-learn, yet router files
(skops archives), which name the steps ``router.features.TextClipper`` / ``router.features.HandFeatures``,
still resolve them here. The package imports its two modules; ``steps`` imports ``text``; nothing imports back.
"""

from __future__ import annotations

from router.features.text import (
    DEFAULT_MAX_CHARS,
    FAMILY_OF,
    FEATURE_SETS,
    HAND_FEATURE_NAMES,
    HOW_BIGRAMS,
    N_FAMILIES,
    N_QA_CLASSES,
    QA_CLASS_OF,
    QA_FEATURE_NAMES,
    VAR_LETTERS,
    WORD_PATTERN,
    WORD_RE,
    assemble_hand_features,
    assemble_qa_features,
    clip_text,
    feature_names,
    hand_features,
    qa_features,
)

__all__ = [
    "DEFAULT_MAX_CHARS",
    "FAMILY_OF",
    "FEATURE_SETS",
    "HAND_FEATURE_NAMES",
    "HOW_BIGRAMS",
    "N_FAMILIES",
    "N_QA_CLASSES",
    "QA_CLASS_OF",
    "QA_FEATURE_NAMES",
    "VAR_LETTERS",
    "WORD_PATTERN",
    "WORD_RE",
    "assemble_hand_features",
    "assemble_qa_features",
    "clip_text",
    "feature_names",
    "hand_features",
    "qa_features",
]


def __getattr__(name: str) -> object:
    # ``TextClipper`` / ``HandFeatures``: imported on first use (scikit-learn comes with them).
    if name in ("TextClipper", "HandFeatures"):
        from router.features import steps

        return getattr(steps, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
