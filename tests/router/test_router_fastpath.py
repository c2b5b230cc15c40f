"""The request-path scorer equals the sklearn Pipeline (shipped router and a freshly fitted one), and the
hand features' fast counting equals the reference implementation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from router.features import WORD_RE, hand_features
from router.fit.default import MATH_TEST, math_items
from router.fit.fitter import fit_router
from router.model import ModelConfig, TrainedRouter
from router.persistence import load_router

# the learned default candidate (the shipped default serves prompt length: router/fit/coldstart.py)
SHIPPED = Path(__file__).resolve().parents[2] / "router" / "assets" / "default-learned.skops"

EDGE_TEXTS = [
    "",
    " ",
    "a",
    "x",
    "Hello  \n\n\t world",
    "日本語のテキスト 123 と 45.6",
    "İstanbul ǅ ﬁ 𝔘 ²³ x2 2x ٣ ½",  # case mapping that changes length, non-ASCII digits and numerics
    "```python\ndef f(x):\n    return x**2\n```\nWhat does f(3) return?",
    "A. 1\nB. 2\nC. 3\nD. 4\nAnswer:",
    "What is 2+2? " * 3000,  # beyond max_chars: clipped head + tail
    "$\\frac{1}{2} + \\sqrt{3}$ " * 50,
    "\ud800 lone surrogate",
]


@pytest.fixture(scope="module")
def shipped() -> TrainedRouter:
    return load_router(SHIPPED)


def _texts() -> list[str]:
    return [it.text for it in math_items(MATH_TEST)[:150]] + EDGE_TEXTS


def test_shipped_router_fast_path_equals_pipeline(shipped: TrainedRouter) -> None:
    texts = _texts()
    ref = shipped.predict_proba(texts)
    fast = np.array([shipped.score(t) for t in texts])
    np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-14)
    logits = np.array([shipped.fast.logit(t) for t in texts])
    np.testing.assert_allclose(logits, shipped.logits(texts), rtol=1e-12, atol=1e-12)
    assert ((fast >= 0) & (fast <= 1)).all() and len(set(np.round(fast, 6))) > 100  # not constant


def test_fresh_fit_with_other_ngram_ranges_matches_too() -> None:
    items = math_items()[::20]  # 600 problems
    cfg = ModelConfig(word_ngrams=(1, 3), char_ngrams=(1, 5), word_max_features=3000, char_max_features=4000,
                      min_df=2)
    router, _ = fit_router(items, cfg, val_frac=0.0)
    texts = _texts()
    np.testing.assert_allclose([router.score(t) for t in texts], router.predict_proba(texts), rtol=1e-12,
                               atol=1e-14)


QA_TEXTS = [
    "How many years after the 15th president's death was the 2nd tallest building, which was older than "
    "\u201cThe Tower\u201d, finished in 1999 and 2021?",
    "what year", "how", "How  many", "the 1st, 21st, 112th and last of the oldest", "Smith\u2019s and Jones's",
]


def test_question_structure_features_fast_path_matches_pipeline() -> None:
    from router.features import QA_FEATURE_NAMES, qa_features

    items = math_items()[::40]  # 300 problems
    texts = [it.text for it in items] + QA_TEXTS
    labels = [it.label for it in items] + [1, 0, 0, 1, 1, 0]
    from router.fit.labels import LabelledItem

    extra = [LabelledItem(id=f"qa{i}", text=t, label=y, source="math-level") for i, (t, y) in
             enumerate(zip(QA_TEXTS, labels[-len(QA_TEXTS):], strict=True))]
    cfg = ModelConfig(word_max_features=3000, char_max_features=4000, min_df=2, feature_set="qa")
    router, _ = fit_router(items + extra, cfg, val_frac=0.0)
    all_texts = _texts() + QA_TEXTS
    np.testing.assert_allclose([router.score(t) for t in all_texts], router.predict_proba(all_texts), rtol=1e-12,
                               atol=1e-14)
    coef = router.pipeline.named_steps["clf"].coef_.ravel()
    assert np.abs(coef[-len(QA_FEATURE_NAMES):]).sum() > 0  # the block is really in the model
    q = qa_features(QA_TEXTS[0], WORD_RE.findall(QA_TEXTS[0].lower()))
    # years 2, ordinals (15th, 2nd) 2, capitals H T T 3, possessive 1, comparatives (after tallest older than) 4,
    # how-many 1, relative (which) 1, commas 2, and 1, curly quotes 2
    assert q == pytest.approx([np.log1p(2), np.log1p(2), np.log1p(3), np.log1p(1), np.log1p(4), 1.0,
                               np.log1p(1), np.log1p(2), np.log1p(1), np.log1p(2)])
    assert len(texts) == len(labels)


def test_hand_features_reference_and_token_path_agree(shipped: TrainedRouter) -> None:
    f = shipped.fast
    for t in _texts():
        tokens = WORD_RE.findall(t.lower())
        ids = np.fromiter((f.word_ids.get(x, 0) for x in tokens), dtype=np.int64, count=len(tokens))
        attr = np.bincount(f.token_attr[ids], minlength=7).tolist()
        from router.features import N_FAMILIES, assemble_hand_features

        assert assemble_hand_features(t, len(tokens), attr[:N_FAMILIES], attr[N_FAMILIES]) == hand_features(t)
    h = hand_features("Find $x$ if 12 + 345 = x. How many digits?")
    assert h[5] == pytest.approx(np.log1p(2)) and h[6] == pytest.approx(np.log1p(3))  # 2 numbers, longest 3


def test_compile_refuses_a_pipeline_of_another_shape(shipped: TrainedRouter) -> None:
    from sklearn.pipeline import Pipeline

    from router.fastpath import FastScorer

    with pytest.raises(ValueError, match="not a ThinkGate router pipeline"):
        FastScorer.compile(Pipeline([("clf", shipped.pipeline.named_steps["clf"])]), shipped.platt)
