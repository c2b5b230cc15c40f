"""Fitting on real data subsets: grouped splits, determinism, and the fit → calibrate → eval CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gateway.cli.main import app
from router.fit.default import math_items, mmlu_items
from router.fit.fitter import fit_router, split_by_group
from router.fit.jsonl import write_jsonl
from router.fit.labels import LabelledItem
from router.model import ModelConfig
from router.persistence import load_router

SMALL = ModelConfig(word_max_features=2000, char_max_features=3000, min_df=2)


@pytest.fixture(scope="module")
def items() -> list[LabelledItem]:
    # every 20th MATH train problem (600, 7 subjects) + every 20th MMLU row (703, 57 subjects, with outcomes)
    return math_items()[::20] + mmlu_items()[::20]


def test_split_by_group_holds_out_whole_groups_per_source(items: list[LabelledItem]) -> None:
    rest, held = split_by_group(items, 0.2, seed=0)
    assert sorted(rest + held) == list(range(len(items))) and not set(rest) & set(held)
    for source in {it.source for it in items}:
        n_src = sum(it.source == source for it in items)
        n_held = sum(items[i].source == source for i in held)
        assert 0.2 * n_src <= n_held < 0.6 * n_src  # whole groups: at least the target, never everything
        held_groups = {items[i].group for i in held if items[i].source == source}
        rest_groups = {items[i].group for i in rest if items[i].source == source}
        assert not held_groups & rest_groups
    assert split_by_group(items, 0.2, seed=0) == (rest, held)
    assert split_by_group(items, 0.2, seed=1) != (rest, held)
    no_groups = [LabelledItem(id=str(i), text="t", label=i % 2, source="s") for i in range(100)]
    assert len(split_by_group(no_groups, 0.3, seed=0)[1]) == 30  # each item its own group


def test_same_data_and_seed_give_the_same_model_and_thresholds(items: list[LabelledItem], tmp_path: Path) -> None:
    from router.fit.calibrate import thresholds_for_fractions

    a, rep_a = fit_router(items, SMALL)
    b, rep_b = fit_router(items, SMALL)
    np.testing.assert_array_equal(a.pipeline.named_steps["clf"].coef_, b.pipeline.named_steps["clf"].coef_)
    assert (a.platt.a, a.platt.b) == (b.platt.a, b.platt.b)
    assert a.metadata["training_data_sha256"] == b.metadata["training_data_sha256"]
    texts = [it.text for it in items[:200]]
    assert thresholds_for_fractions(a.predict_proba(texts), [0.3]) == thresholds_for_fractions(
        b.predict_proba(texts), [0.3])
    assert rep_a.val_index == rep_b.val_index and rep_a.n_val > 0
    c, _ = fit_router(items, ModelConfig(**{**SMALL.to_dict(), "seed": 1, "word_ngrams": (1, 2),
                                            "char_ngrams": (2, 4)}))
    assert not np.array_equal(a.pipeline.named_steps["clf"].coef_, c.pipeline.named_steps["clf"].coef_)
    # validation metrics are real numbers on held-out subjects, per source
    names = [r.name for r in rep_a.validation]
    assert names[0] == "validation" and {"math-level>=4", "routellm-mmlu"} <= set(names)
    assert 0.5 < rep_a.validation[names.index("math-level>=4")].auc <= 1.0


def test_fit_calibrate_eval_cli_end_to_end(items: list[LabelledItem], tmp_path: Path) -> None:
    runner = CliRunner()
    data = tmp_path / "train.jsonl"
    write_jsonl(data, (it.to_dict() for it in items))
    calib = tmp_path / "calib.jsonl"
    write_jsonl(calib, (it.to_dict() for it in math_items()[5::40] + mmlu_items()[5::40]))
    out = tmp_path / "r.skops"
    r = runner.invoke(app, ["router", "fit", str(data), "--out", str(out), "--word-max-features", "2000",
                            "--char-max-features", "3000", "--min-df", "2"])
    assert r.exit_code == 0, r.output
    assert "Validation" in r.output and out.is_file()

    fitted = load_router(out).metadata
    r = runner.invoke(app, ["router", "calibrate", str(out), str(calib), "--target-long", "0.3"])
    assert r.exit_code == 0, r.output
    router = load_router(out)
    cal = router.metadata["thresholds_calibration"]
    assert cal["method"] == "target_long" and abs(cal["achieved_frac_at_or_above"][0] - 0.3) <= 0.02
    # a new version: outcomes and promotions must not mix the recalibrated file with the one it came from
    before = fitted.get("version") or fitted.get("created_utc")
    assert router.metadata["version"].startswith(f"{before}+calibrated-")
    assert router.metadata["calibrated_from"] == before
    scores = router.predict_proba([json.loads(line)["text"] for line in calib.read_text().splitlines()])
    assert abs(float(np.mean(scores >= router.thresholds[0])) - 0.3) <= 0.02

    r = runner.invoke(app, ["router", "calibrate", str(out), str(calib), "--max-quality-loss", "0.05"])
    assert r.exit_code == 0, r.output
    cal = load_router(out).metadata["thresholds_calibration"]
    assert cal["quality"] >= 0.95 * cal["always_long_quality"] - 1e-9

    png, js = tmp_path / "curve.png", tmp_path / "eval.json"
    r = runner.invoke(app, ["router", "eval", str(out), str(calib), "--plot", str(png), "--json", str(js)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (row,) = json.loads(js.read_text())
    assert {"auc", "apgr", "cpt50", "cpt80", "cost_reduction_95", "random_cost_reduction_95"} <= set(row)
    assert "APGR" in r.output

    r = runner.invoke(app, ["router", "calibrate", str(out), str(calib)])
    assert r.exit_code == 2 and "exactly one" in r.output
    r = runner.invoke(app, ["router", "calibrate", str(out), str(calib), "--target-long", "0.3,x"])
    assert r.exit_code == 2 and "fractions" in r.output
    r = runner.invoke(app, ["router", "eval", str(tmp_path / "missing.skops"), str(calib)])
    assert r.exit_code == 2 and "not found" in r.output


def test_calibrate_a_file_with_a_serving_block_moves_its_served_thresholds(tmp_path: Path) -> None:
    """The shipped default carries ``metadata.serving`` (what ``model: auto`` serves): calibrating it for three
    tiers (two fractions, comma-separated) writes both cuts there too, under a new version — a new user's trial
    found the recalibrated file still named the shipped version."""
    import shutil

    from gateway.config.paths import DEFAULT_ROUTER_PATH

    calib = tmp_path / "calib.jsonl"
    write_jsonl(calib, (it.to_dict() for it in math_items()[5::40] + mmlu_items()[5::40]))
    path = Path(shutil.copy(DEFAULT_ROUTER_PATH, tmp_path / "default.skops"))
    shipped = load_router(path).metadata
    r = CliRunner().invoke(app, ["router", "calibrate", str(path), str(calib), "--target-long", "0.5,0.2"])
    assert r.exit_code == 0, r.output
    router = load_router(path)
    assert len(router.thresholds) == 2 and router.thresholds[0] <= router.thresholds[1]
    assert router.metadata["serving"]["thresholds"] == [round(t, 6) for t in router.thresholds]
    assert router.metadata["thresholds_calibration"]["target"] == [0.5, 0.2]
    assert router.metadata["version"] != (shipped.get("version") or shipped.get("created_utc"))
    assert router.metadata["version"] in r.output


def test_calibrating_a_file_that_does_not_route_names_what_it_serves_now(tmp_path: Path) -> None:
    """A trace router whose fit certified nothing serves ``always_top``; calibrated to a target share it routes at
    the new thresholds — ``router info`` and ``/v1/models`` still said "always the top tier" (a new user's file sent
    99 of 116 questions cheap under that name). The policy becomes the scorer's, with no guarantee."""
    import shutil

    from gateway.config.paths import DEFAULT_ROUTER_PATH
    from router.persistence import save_router
    from router.policy import serving

    calib = tmp_path / "calib.jsonl"
    write_jsonl(calib, (it.to_dict() for it in math_items()[5::40] + mmlu_items()[5::40]))
    path = Path(shutil.copy(DEFAULT_ROUTER_PATH, tmp_path / "top.skops"))
    router = load_router(path)
    router.metadata["serving"] = {"policy": "always_top", "scorer": router.scorer, "thresholds": [1.0],
                                  "cascade": None, "guarantee": {"floor": 0.98, "delta": 0.1, "n_calibration": 396}}
    router.thresholds = [1.0]
    save_router(router, path)
    assert "always the top tier" in CliRunner().invoke(app, ["router", "info", str(path)]).output
    r = CliRunner().invoke(app, ["router", "calibrate", str(path), str(calib), "--target-long", "0.3"])
    assert r.exit_code == 0, r.output
    sv = serving(load_router(path).metadata) or {}
    assert sv["policy"] == router.scorer and sv["guarantee"] is None and sv["thresholds"][0] < 1.0
    info = CliRunner().invoke(app, ["router", "info", str(path)]).output
    assert "always the top tier" not in info and "states no quality guarantee" in info


def test_calibrate_and_eval_need_as_many_labelled_items_as_fit(tmp_path: Path) -> None:
    """An empty labels file gave a scikit-learn traceback; one item silently wrote a threshold. Both are fit's
    one-line error (exit 2), and the router file is left as it was."""
    import shutil

    from gateway.config.paths import DEFAULT_ROUTER_PATH

    path = Path(shutil.copy(DEFAULT_ROUTER_PATH, tmp_path / "default.skops"))
    before = path.read_bytes()
    empty, one = tmp_path / "empty.jsonl", tmp_path / "one.jsonl"
    empty.write_text("")
    write_jsonl(one, (it.to_dict() for it in math_items()[:1]))
    for labels, n in ((empty, 0), (one, 1)):
        for argv in (["calibrate", str(path), str(labels), "--target-long", "0.3"],
                     ["calibrate", str(path), str(labels), "--max-quality-loss", "0.05"],
                     ["eval", str(path), str(labels)]):
            r = CliRunner().invoke(app, ["router", *argv])
            assert r.exit_code == 2, (argv, r.output)
            assert f"need at least 10 labelled items, got {n}" in r.output and "Traceback" not in r.output
    assert path.read_bytes() == before


def test_info_on_a_file_fitted_from_labels_says_what_is_true_and_prints_its_validation() -> None:
    """It read "Serves pipeline at the thresholds below…" with thresholds [] and no validation table."""
    from types import SimpleNamespace

    from router.cli import _info_summary

    row = {"name": "validation", "n": 120, "auc": 0.7712, "apgr": 0.61, "cost_reduction_95": 0.25,
           "random_cost_reduction_95": 0.05}
    meta = {"created_utc": "2025-01-01T00:00:00Z",
            "metrics": {"validation": [row, {**row, "name": "math-level>=4", "auc": None}],
                        "validation_note": "held-out groups"}}
    lines = _info_summary(SimpleNamespace(scorer="pipeline", thresholds=[], metadata=meta))
    text = "\n".join(lines)
    assert "Serves pipeline" not in text and "at the thresholds below" not in text
    assert "learned text classifier" in text and "thinkgate router calibrate" in text
    assert "validation (held-out groups):" in text
    assert "validation: n 120, AUC 0.771, APGR 0.610" in text and "25.0% (random 5.0%)" in text
    assert "math-level>=4: n 120, AUC —" in text
    calibrated = "\n".join(_info_summary(SimpleNamespace(scorer="pipeline", thresholds=[0.4], metadata=meta)))
    assert "at the thresholds below" in calibrated
