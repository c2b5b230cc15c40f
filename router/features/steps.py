"""The two stateless scikit-learn Pipeline steps of the router model (:func:`router.model.build_pipeline`).

They live apart from :mod:`router.features.text` so that the request path, which imports the features but never
the Pipeline, does not import scikit-learn. Their ``__module__`` stays ``router.features``: router files (skops
archives) name the types they contain, every file written so far says ``router.features.TextClipper`` /
``router.features.HandFeatures``, and :mod:`router.features` re-exports both lazily.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin

from router.features.text import DEFAULT_MAX_CHARS, WORD_RE, clip_text, feature_names, hand_features, qa_features


class TextClipper(TransformerMixin, BaseEstimator):
    """Pipeline step: :func:`clip_text` on each document (stateless). In: iterable of str; out: list of str."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_chars = max_chars

    def fit(self, X: Iterable[str], y: object = None) -> TextClipper:
        return self

    def transform(self, X: Iterable[str]) -> list[str]:
        return [clip_text(str(x), self.max_chars) for x in X]


class HandFeatures(TransformerMixin, BaseEstimator):
    """Pipeline step: :func:`hand_features` per document (stateless), plus :func:`qa_features` when
    ``feature_set="qa"``. Out: float64 array (n_docs, len(feature_names(feature_set))). Files written before
    the parameter existed load as ``"base"``."""

    def __init__(self, feature_set: str = "base") -> None:
        self.feature_set = feature_set

    def fit(self, X: Iterable[str], y: object = None) -> HandFeatures:
        feature_names(self._set())
        return self

    def _set(self) -> str:
        return getattr(self, "feature_set", "base")

    def transform(self, X: Sequence[str]) -> np.ndarray:
        fs = self._set()
        if fs == "qa":
            rows = []
            for x in X:
                toks = WORD_RE.findall(x.lower())
                rows.append(hand_features(x, toks) + qa_features(x, toks))
        else:
            rows = [hand_features(x) for x in X]
        return np.asarray(rows, dtype=np.float64).reshape(-1, len(feature_names(fs)))

    def get_feature_names_out(self, input_features: object = None) -> np.ndarray:
        return np.asarray(feature_names(self._set()), dtype=object)

for _cls in (TextClipper, HandFeatures):
    _cls.__module__ = "router.features"
