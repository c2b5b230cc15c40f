"""Router files: skops round trip with metadata; clear errors for missing, corrupt, untrusted and
incompatible files."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import skops.io as sio

from router.fit.default import TIER_OUTCOMES, arith_threshold_from_outcomes
from router.persistence import FORMAT, RouterFileError, load_router, save_router

# the learned default candidate (the shipped default serves prompt length: router/fit/coldstart.py)
SHIPPED = Path(__file__).resolve().parents[2] / "router" / "assets" / "default-learned.skops"


@pytest.fixture(scope="module")
def shipped_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("router") / "r.skops"
    shutil.copy(SHIPPED, p)
    return p


def test_shipped_file_is_small_and_carries_its_metadata() -> None:
    assert SHIPPED.stat().st_size < 5_000_000
    r = load_router(SHIPPED)
    meta = r.metadata
    assert meta["router"] == "tfidf-linear" and meta["router_version"]
    assert len(meta["training_data_sha256"]) == 64
    k = meta["arith_long_from_operations"]  # measured (router/assets/tier_outcomes.json), see router/fit/default.py
    # every real label source of the repo (router/fit/default.py)
    assert set(meta["label_sources"]) == {"math-level>=4", f"arith-ops>={k}", "gsm8k-steps>=4", "routellm-mmlu",
                                          "traces-frames", "traces-simpleqa"}
    assert k == arith_threshold_from_outcomes(TIER_OUTCOMES)
    assert meta["features"]["hand"] and meta["model_config"]["C"] > 0
    assert meta["metrics"]["validation"] and meta["metrics"]["heldout"]
    math500 = next(m for m in meta["metrics"]["heldout"] if m["name"].startswith("math500"))
    assert math500["auc"] > 0.75
    assert len(r.thresholds) == 1 and 0 < r.thresholds[0] < 1
    assert meta["thresholds_calibration"]["method"] == "max_quality_loss"
    # ranked against prompt length on every evaluation set, each kind present
    rows = meta["metrics"]["vs_length"]
    assert {r["kind"] for r in rows} == {"held-out questions", "held-out subjects", "held-out data set"}
    assert all(r["length_auc"] is not None for r in rows)


def test_roundtrip_keeps_scores_thresholds_and_metadata(shipped_copy: Path, tmp_path: Path) -> None:
    r = load_router(shipped_copy)
    r.thresholds = [0.25]
    r.metadata["note"] = "round trip ✓"
    out = save_router(r, tmp_path / "sub" / "again.skops")
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    back = load_router(out)
    texts = ["What is 1+1?", "Prove that there are infinitely many primes."]
    np.testing.assert_array_equal(back.predict_proba(texts), r.predict_proba(texts))
    assert [back.score(t) for t in texts] == [r.score(t) for t in texts]
    assert back.thresholds == [0.25] and back.metadata["note"] == "round trip ✓"
    assert not list((tmp_path / "sub").glob("*.tmp"))  # atomic write left no temp file


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RouterFileError, match="not found") as exc:
        load_router(tmp_path / "nope.skops")
    assert exc.value.path == tmp_path / "nope.skops"


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_file(shipped_copy: Path, tmp_path: Path, damage: str) -> None:
    p = tmp_path / "bad.skops"
    data = shipped_copy.read_bytes()
    p.write_bytes({"garbage": os.urandom(4096), "truncated": data[: len(data) // 2], "empty": b""}[damage])
    with pytest.raises(RouterFileError, match="corrupt"):
        load_router(p)


def test_untrusted_types_are_refused_without_loading(tmp_path: Path) -> None:
    p = tmp_path / "evil.skops"
    sio.dump({"format": FORMAT, "format_version": 1, "pipeline": os.system}, p)
    with pytest.raises(RouterFileError, match="untrusted types"):
        load_router(p)


def test_incompatible_files(shipped_copy: Path, tmp_path: Path) -> None:
    p = tmp_path / "other.skops"
    sio.dump({"hello": "world"}, p)
    with pytest.raises(RouterFileError, match="not a ThinkGate router"):
        load_router(p)
    sio.dump({"format": FORMAT, "format_version": 99}, p)
    with pytest.raises(RouterFileError, match="format_version 99"):
        load_router(p)
    sio.dump({"format": FORMAT, "format_version": 1, "pipeline": [1, 2], "platt": [1.0, 0.0], "thresholds": [],
              "metadata": "{}"}, p)
    with pytest.raises(RouterFileError, match="incompatible contents"):
        load_router(p)
    # a valid archive whose thresholds are out of range
    r = load_router(shipped_copy)
    r.thresholds = [0.7, 0.2]
    save_router(r, p)
    with pytest.raises(RouterFileError, match="ascending"):
        load_router(p)
    # not a zip at all but named like one
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("schema.json", "{not json")
    with pytest.raises(RouterFileError, match="corrupt"):
        load_router(p)


# ---- the "fast" block: serving without scikit-learn ------------------------------------------------------------

TEXTS = ["", "What is 1+1?", "Prove that there are infinitely many primes.", "日本語 ½ x2 \t\n  y", "ab " * 3000]


def test_serving_load_scores_like_the_sklearn_pipeline(shipped_copy: Path) -> None:
    from router.fit.default import MATH_TEST, math_items

    full = load_router(shipped_copy)
    lean = load_router(shipped_copy, pipeline=False)
    assert lean.pipeline is None and full.pipeline is not None
    assert (lean.thresholds, lean.platt, lean.metadata) == (full.thresholds, full.platt, full.metadata)
    texts = TEXTS + [it.text for it in math_items(MATH_TEST)[:200]]
    np.testing.assert_allclose([lean.score(t) for t in texts], full.predict_proba(texts), rtol=0, atol=1e-9)
    with pytest.raises(RuntimeError, match="has no sklearn Pipeline"):
        lean.predict_proba(texts)
    with pytest.raises(ValueError, match="without its pipeline"):
        save_router(lean, shipped_copy.parent / "lean.skops")


def _envelope(path: Path) -> dict:
    return sio.load(path, trusted=sio.get_untrusted_types(file=path))


def test_a_file_without_or_with_an_unreadable_fast_block_loads_through_its_pipeline(shipped_copy: Path,
                                                                                    tmp_path: Path) -> None:
    ref = [load_router(shipped_copy).score(t) for t in TEXTS]
    obj = _envelope(shipped_copy)
    del obj["fast"]
    sio.dump(obj, tmp_path / "old.skops")  # as written before the block existed
    obj = _envelope(shipped_copy)
    obj["fast"]["layout"] = 99  # as a future layout
    sio.dump(obj, tmp_path / "future.skops")
    obj = _envelope(shipped_copy)
    obj["fast"]["coef"] = obj["fast"]["coef"][:-1]  # damaged: the block is derived data, the pipeline decides
    sio.dump(obj, tmp_path / "damaged.skops")
    for name in ("old.skops", "future.skops", "damaged.skops"):
        r = load_router(tmp_path / name, pipeline=False)
        assert r.pipeline is not None and [r.score(t) for t in TEXTS] == ref


def test_a_fast_block_does_not_bypass_the_trust_check(shipped_copy: Path, tmp_path: Path) -> None:
    obj = _envelope(shipped_copy)
    obj["pipeline"] = os.system
    p = tmp_path / "evil.skops"
    sio.dump(obj, p)
    for pipeline in (True, False):
        with pytest.raises(RouterFileError, match="untrusted types"):
            load_router(p, pipeline=pipeline)
