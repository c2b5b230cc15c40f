"""The difficulty model: a scikit-learn Pipeline (hand features + TF-IDF word/char n-grams → logistic
regression) followed by Platt scaling, wrapped as a :class:`router.base.Router`.

``P(needs long) = sigmoid(a · f(x) + b)`` where ``f`` is the Pipeline's ``decision_function`` (the linear
model's logit) and ``(a, b)`` are fitted on the logits of items held out from the fit (Platt 1999,
"Probabilistic outputs for support vector machines"), so probabilities are calibrated without a second
copy of the model.
The request path does not call the Pipeline: :class:`router.fastpath.FastScorer` evaluates the same
function for one string in pure Python + NumPy (sklearn's per-call overhead is ~1 ms).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from router.base import Router, register
from router.features import DEFAULT_MAX_CHARS, HAND_FEATURE_NAMES, WORD_PATTERN

if TYPE_CHECKING:
    from sklearn.pipeline import Pipeline


@dataclass(frozen=True)
class ModelConfig:
    """Knobs of :func:`build_pipeline`. Every field has a default that the shipped router uses.

    ``max_chars``: characters the model reads (head + tail, :func:`router.features.clip_text`).
    ``word_ngrams`` / ``char_ngrams``: inclusive n-gram ranges (word unigrams by default: word bigrams gained
    0.002 MATH-500 AUC and cost ~40 µs per request; the char 2–4-grams already see across word boundaries).
    ``*_max_features``: vocabulary caps (by corpus frequency) that bound the file size and the request-path
    cost. ``min_df``: minimum document frequency of a term. ``C``: inverse L2 strength of the logistic
    regression. ``class_weight``: ``None`` or ``"balanced"``. ``seed``: everything random (splits, solver)
    derives from it.
    """

    max_chars: int = DEFAULT_MAX_CHARS
    word_ngrams: tuple[int, int] = (1, 1)
    char_ngrams: tuple[int, int] = (2, 4)
    word_max_features: int = 10_000
    char_max_features: int = 15_000
    min_df: int = 3
    C: float = 2.0
    class_weight: str | None = None
    seed: int = 0
    feature_set: str = "base"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["word_ngrams"] = list(self.word_ngrams)
        d["char_ngrams"] = list(self.char_ngrams)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["word_ngrams"] = tuple(d["word_ngrams"])
        d["char_ngrams"] = tuple(d["char_ngrams"])
        return cls(**d)


def build_pipeline(cfg: ModelConfig) -> Pipeline:
    """An unfitted Pipeline: clip → [word TF-IDF | char TF-IDF | scaled hand features] → LogisticRegression.

    Input: a sequence of str (routing windows). ``decision_function`` → float64 array (n,), the logit of
    "needs long". TF-IDF uses sublinear tf and L2 norm per block (float64, so the fast path can match it).
    """
    # scikit-learn is imported here, not at module level: serving loads a router without it (router.persistence)
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import FeatureUnion, Pipeline
    from sklearn.preprocessing import StandardScaler

    from router.features.steps import HandFeatures, TextClipper

    word = TfidfVectorizer(
        lowercase=True,
        token_pattern=WORD_PATTERN,
        ngram_range=cfg.word_ngrams,
        min_df=cfg.min_df,
        max_features=cfg.word_max_features,
        sublinear_tf=True,
        dtype=np.float64,
    )
    char = TfidfVectorizer(
        lowercase=True,
        analyzer="char",
        ngram_range=cfg.char_ngrams,
        min_df=cfg.min_df,
        max_features=cfg.char_max_features,
        sublinear_tf=True,
        dtype=np.float64,
    )
    hand = Pipeline([("extract", HandFeatures(cfg.feature_set)), ("scale", StandardScaler())])
    clf = LogisticRegression(
        C=cfg.C,
        solver="liblinear",
        class_weight=cfg.class_weight,
        max_iter=1000,
        random_state=cfg.seed,
    )
    return Pipeline(
        [
            ("clip", TextClipper(cfg.max_chars)),
            ("features", FeatureUnion([("word", word), ("char", char), ("hand", hand)])),
            ("clf", clf),
        ]
    )


def strip_for_storage(pipeline: Pipeline) -> None:
    """Drop fitted attributes that only inflate the file (TfidfVectorizer's ``stop_words_``: every term cut
    by ``max_features``/``min_df``, often larger than the vocabulary itself). In place."""
    for _, vec in pipeline.named_steps["features"].transformer_list:
        if hasattr(vec, "stop_words_"):
            del vec.stop_words_


def sigmoid(z: np.ndarray | float) -> np.ndarray:
    """Numerically stable logistic function, elementwise."""
    z = np.asarray(z, dtype=np.float64)
    out = np.empty_like(z)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    ez = np.exp(z[~pos])
    out[~pos] = ez / (1.0 + ez)
    return out


@dataclass
class Platt:
    """Platt scaling ``p = sigmoid(a·f + b)`` of a logit ``f``. Identity-like default: a=1, b=0."""

    a: float = 1.0
    b: float = 0.0

    @classmethod
    def fit(cls, logits: np.ndarray, y: np.ndarray) -> Platt:
        """Fit (a, b) by (nearly unregularised) logistic regression of ``y`` (n,) in {0,1} on ``logits`` (n,)."""
        from sklearn.linear_model import LogisticRegression

        lr = LogisticRegression(C=1e6, solver="lbfgs", max_iter=1000)
        lr.fit(np.asarray(logits, dtype=np.float64).reshape(-1, 1), np.asarray(y, dtype=int))
        return cls(a=float(lr.coef_[0, 0]), b=float(lr.intercept_[0]))


@register
@dataclass(eq=False)
class TrainedRouter(Router):
    """A fitted difficulty router: Pipeline + Platt + metadata (+ a lazily compiled fast scorer).

    ``thresholds``: ascending cut points in [0, 1] (one fewer than the routed tiers), from ``calibrate``.
    ``metadata``: JSON-able dict (version, features, label sources, data sha256, metrics…) saved with it.
    ``pipeline`` is None for a router loaded for serving (:func:`router.persistence.load_router` with
    ``pipeline=False``, :meth:`from_fast`): it scores through the fast path only, and the batched reference
    methods (:meth:`logits`, :meth:`predict_proba`) raise RuntimeError.
    """

    name = "tfidf-linear"

    pipeline: Pipeline | None
    platt: Platt = field(default_factory=Platt)
    thresholds: list[float] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: ``"pipeline"`` (the learned model), or a baseline that needs no model: ``"length"``
    #: (:func:`length_prior`) or ``"hash"`` (:func:`hash_score`, random routing at the thresholds' tier mix).
    scorer: str = "pipeline"
    _fast: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown scorer {self.scorer!r} (known: {sorted(SCORERS)})")

    @classmethod
    def from_fast(cls, fast: Any, platt: Platt, thresholds: list[float], metadata: dict[str, Any],
                  pipeline: Pipeline | None = None) -> TrainedRouter:
        """A learned router around an already built :class:`router.fastpath.FastScorer` (``pipeline``
        optional: None when loaded for serving)."""
        router = cls(pipeline=pipeline, platt=platt, thresholds=thresholds, metadata=metadata)
        router._fast = fast
        return router

    def _require_pipeline(self) -> Pipeline:
        if self.pipeline is None:
            raise RuntimeError("this router has no sklearn Pipeline (loaded for serving, or scorer 'pipeline' "
                               "built without one): load it with router.persistence.load_router(path)")
        return self.pipeline

    def logits(self, texts: Sequence[str]) -> np.ndarray:
        """Batched Pipeline logits, float64 (n,). Baseline scorers: the logit of their score. Raises
        RuntimeError for a learned router without its pipeline."""
        if self.scorer != "pipeline":
            p = np.clip(np.array([self.fast.score(t) for t in texts], dtype=np.float64), 1e-12, 1 - 1e-12)
            return np.log(p / (1 - p))
        return np.asarray(self._require_pipeline().decision_function(list(texts)), dtype=np.float64)

    def predict_proba(self, texts: Sequence[str]) -> np.ndarray:
        """Batched P(needs long) through the sklearn Pipeline (the reference path), float64 (n,) in [0, 1].
        Raises RuntimeError for a learned router without its pipeline."""
        if self.scorer != "pipeline":
            return np.array([self.fast.score(t) for t in texts], dtype=np.float64)
        return sigmoid(self.platt.a * self.logits(texts) + self.platt.b)

    @property
    def fast(self) -> Any:
        """The single-request scorer (:class:`router.fastpath.FastScorer`, or the baseline's scorer): given at
        load, else built on first use (compiled from the pipeline)."""
        if self._fast is None:
            if self.scorer == "pipeline":
                from router.fastpath import FastScorer

                self._fast = FastScorer.compile(self._require_pipeline(), self.platt)
            else:
                self._fast = _BaselineScorer(SCORERS[self.scorer])
        return self._fast

    def score(self, text: str) -> float:
        """P(needs long) for one routing window via the fast path (~0.1–0.3 ms); equals :meth:`predict_proba`."""
        return self.fast.score(text)

    def route(self, score: float, tiers: Sequence[str], thresholds: Sequence[float] | None = None) -> str:
        """The tier for ``score``: ``tiers[i]`` where i = number of thresholds ≤ score (RouteLLM's rule)."""
        cuts = list(self.thresholds if thresholds is None else thresholds)
        if len(cuts) != len(tiers) - 1:
            raise ValueError(f"need {len(tiers) - 1} thresholds for tiers {list(tiers)}, have {cuts}")
        return tiers[sum(1 for t in cuts if score >= t)]


def length_prior(text: str) -> float:
    """Length baseline score: ``log1p(characters) / log1p(100_000)``, clipped to 1 (monotone in length)."""
    return min(1.0, math.log1p(len(text)) / _LOG_100K)


def hash_score(text: str) -> float:
    """Pseudo-random score, uniform in [0, 1): BLAKE2b of the whitespace-normalised text. The same prompt always
    gets the same score, so thresholds at quantile ``1 − f`` send a fraction ``f`` up at random."""
    key = " ".join(text.split()).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0**64


_LOG_100K = math.log1p(100_000)
SCORERS: dict[str, Any] = {"pipeline": None, "length": length_prior, "hash": hash_score}


class _BaselineScorer:
    def __init__(self, fn: Any) -> None:
        self.score = fn


FEATURE_DESCRIPTION = {
    "hand": list(HAND_FEATURE_NAMES),
    "word_tfidf": "lowercased \\w+ tokens, n-grams per config, sublinear tf, l2",
    "char_tfidf": "lowercased characters (whitespace runs collapsed), n-grams per config, sublinear tf, l2",
    "classifier": "LogisticRegression (liblinear, L2) + Platt scaling fitted on a held-out split",
}
