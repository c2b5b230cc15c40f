"""Routers from recorded traces: labels from a hand-made trace folder, the held-out split, calibration to a
quality target, savings_at_98 by hand, the fallback rule, baseline router files, and `router fit --traces`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gateway.cli.main import app
from router.fit.ladder_eval import (
    abstains,
    cascade_outcome,
    evaluate_ladder,
    random_curve,
    route,
    savings_at_98,
    threshold_curve,
)
from router.fit.ladder_fit import calibrate_thresholds, choose_policy, fit_ladder_router, random_thresholds
from router.fit.traces import heldout_mask, is_heldout, load_ladder, parse_ladder, sufficing_labels
from router.model import TrainedRouter, hash_score, length_prior
from router.persistence import load_router, save_router


def write_trace(folder: Path, dataset: str, model: str, setting: str, rows: list[dict]) -> Path:
    p = folder / dataset / f"{model}__{setting}.jsonl.gz"
    p.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(p, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return p


def row(qid: object, q: str, correct: bool, tokens: int, response: str = "Answer: x") -> dict:
    return {"id": qid, "question": q, "reference_answer": "x", "response": response, "thought": None,
            "grading": "A" if correct else "B", "correct": correct, "reasoning_tokens": None,
            "completion_tokens": tokens}


# ---- labels --------------------------------------------------------------------------------------------------


def test_labels_from_a_hand_made_trace_folder(tmp_path: Path) -> None:
    # question:        0 cheap right   1 only top right   2 none right   3 only mid right   4 missing in mid
    cheap = [row(0, "q0", True, 5), row(1, "q1", False, 6), row(2, "q2", False, 7), row(3, "q3", False, 8),
             row(4, "q4", True, 9)]
    mid = [row(0, "q0", True, 50), row(1, "q1", False, 60), row(2, "q2", False, 70), row(3, "q3", True, 80)]
    top = [row(0, "q0", False, 500), row(1, "q1", True, 600), row(2, "q2", False, 700), row(3, "q3", True, 800),
           row(4, "q4", True, 900)]
    for s, rows in (("no_think", cheap), ("budget256", mid), ("budget1024", top)):
        write_trace(tmp_path, "toy", "m", s, rows)
    d = load_ladder(tmp_path, "toy", "m:no_think,budget256,budget1024")
    assert d.ids == ["0", "1", "2", "3"]  # q4 lacks the middle setting: dropped
    assert d.tokens.tolist() == [[5, 50, 500], [6, 60, 600], [7, 70, 700], [8, 80, 800]]
    assert sufficing_labels(d.correct).tolist() == [0, 2, 0, 1]
    two = load_ladder(tmp_path, "toy", "m:no_think,budget1024")
    assert two.ids == ["0", "1", "2", "3", "4"]
    assert sufficing_labels(two.correct).tolist() == [0, 1, 0, 1, 0]  # 1 iff cheap wrong and top right


def test_ladder_spec_parsing() -> None:
    lad = parse_ladder("Qwen3-14B:no_think,exd0")
    assert lad.model == "Qwen3-14B" and lad.settings == ("no_think", "exd0") and lad.slug == "Qwen3-14B__no_think-exd0"
    for bad in ("Qwen3-14B", "m:one", "m:a,a", ":a,b", "m:a,,b"):
        with pytest.raises(ValueError):
            parse_ladder(bad)


def test_heldout_split_is_fixed_and_about_the_fraction() -> None:
    ids = [str(i) for i in range(5000)]
    share = np.mean([is_heldout("frames", q) for q in ids])
    assert 0.18 < share < 0.22
    assert [is_heldout("frames", q) for q in ids[:50]] == [is_heldout("frames", q) for q in ids[:50]]
    assert [is_heldout("frames", q) for q in ids[:200]] != [is_heldout("simpleqa", q) for q in ids[:200]]


# ---- metrics ---------------------------------------------------------------------------------------------------


def test_savings_at_98_on_a_hand_computed_example() -> None:
    # 4 questions; cheap: right on 0, 1; top: right on 0, 1, 2. Tokens cheap 10, top 100 each.
    correct = np.array([[1, 1], [1, 1], [0, 1], [0, 0]], dtype=bool)
    tokens = np.array([[10, 100]] * 4, dtype=float)
    scores = np.array([0.1, 0.2, 0.9, 0.5])  # ranks question 2 (the one needing top) first
    curve = threshold_curve(scores, correct, tokens)
    # points: all cheap (40/400=0.1, 0.5); q2 up (130/400, 0.75) = top accuracy; then q3, q1, q0 up add cost only
    assert curve[0] == pytest.approx([0.1, 0.5])
    assert curve[1] == pytest.approx([0.325, 0.75])
    assert len(curve) == 2  # the rest are dominated (same accuracy, more tokens)
    assert savings_at_98(curve, 0.75) == pytest.approx(1 - 0.325)
    assert savings_at_98(curve, 1.0) == 0.0  # nothing reaches 98% of 1.0
    # random: expected line from (0.1, 0.5) to (1.0, 0.75); 98% of 0.75 = 0.735 → w = 0.94 → share 0.946
    assert savings_at_98(random_curve(correct, tokens, 10001), 0.75) == pytest.approx(1 - (0.1 + 0.94 * 0.9),
                                                                                      abs=1e-3)
    assert route(np.array([0.1, 0.5, 0.9]), [0.5]).tolist() == [0, 1, 1]


def test_cascade_escalates_abstentions_and_pays_both_calls() -> None:
    correct = np.array([[0, 1], [1, 1], [0, 1]], dtype=bool)
    tokens = np.array([[5, 50], [6, 60], [7, 70]], dtype=float)
    ab = np.array([[True, False], [False, False], [False, False]])
    final, ok, spent = cascade_outcome(np.zeros(3, dtype=np.int64), correct, tokens, ab)
    assert final.tolist() == [1, 0, 0] and ok.tolist() == [1, 1, 0] and spent.tolist() == [55, 6, 7]
    assert abstains("Answer: I don't know.<|im_end|>") and abstains("") and abstains("<|im_end|>")
    assert abstains("Reasoning...\nAnswer:\nI don't have enough reliable information to answer this question.")
    assert not abstains("Answer: Jane Ballou") and not abstains("I don't know why, but Answer: 1953")


# ---- calibration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_calibration_hits_the_quality_target_at_the_cheapest_point(k: int) -> None:
    rng = np.random.default_rng(0)
    n = 600
    difficulty = rng.uniform(size=n)
    # setting j is right when the difficulty is below its reach, with noise; cost rises 10x per setting
    reach = np.linspace(0.4, 1.1, k)
    correct = (difficulty[:, None] + rng.normal(0, 0.1, (n, k))) < reach[None, :]
    tokens = (10.0 ** np.arange(1, k + 1))[None, :] * rng.uniform(0.5, 1.5, (n, k))
    scores = np.clip(difficulty + rng.normal(0, 0.15, n), 0, 1)
    cal = calibrate_thresholds(scores, correct, tokens, 0.98)
    assert len(cal.thresholds) == k - 1 and cal.thresholds == sorted(cal.thresholds)
    ch = route(scores, cal.thresholds)
    rows = np.arange(n)
    acc = correct[rows, ch].mean()
    share = tokens[rows, ch].sum() / tokens[:, -1].sum()
    top = correct[:, -1].mean()
    assert acc >= 0.98 * top - 1e-12 and acc == pytest.approx(cal.accuracy) and share == pytest.approx(cal.token_share)
    assert share < 0.9  # it found savings
    # no point of the curve is cheaper and still at target
    curve = threshold_curve(scores, correct, tokens, grid=10_000)
    assert savings_at_98(curve, top) == pytest.approx(1 - share, abs=1e-9)
    # random thresholds: the expected accuracy of the mix reaches the target too
    rc = random_thresholds(correct, tokens, 0.98)
    assert rc.accuracy >= 0.98 * top - 1e-12 and len(rc.thresholds) == k - 1


# ---- fallback rule, baseline files ----------------------------------------------------------------------------


def test_choose_policy_prefers_the_best_validation_savings() -> None:
    assert choose_policy({"router": 0.10, "length": 0.25, "random": 0.05}) == "length"
    assert choose_policy({"router": 0.01, "length": 0.00, "random": 0.04}) == "random"
    assert choose_policy({"router": 0.30, "length": 0.30, "random": 0.04}) == "router"  # ties: learned first


def _toy_folder(tmp_path: Path, n: int = 240) -> Path:
    """Questions whose need for the top setting follows their length (long → top needed): prompt length is
    the right ranking, and words carry nothing (every question uses the same few words)."""
    rng = np.random.default_rng(1)
    cheap, top = [], []
    for i in range(n):
        words = int(rng.integers(3, 40))
        q = "what is the value " + " ".join(["of it"] * words) + f" number {i}?"
        need = words > 25
        cheap_ok = (not need) and rng.uniform() < 0.8
        top_ok = cheap_ok or (need and rng.uniform() < 0.9)
        cheap.append(row(i, q, bool(cheap_ok), 10, "Answer: 3" if cheap_ok else "I don't know."))
        top.append(row(i, q, bool(top_ok), 200))
    write_trace(tmp_path, "toy", "m", "no_think", cheap)
    write_trace(tmp_path, "toy", "m", "exd0", top)
    return tmp_path


def test_fallback_ships_length_when_the_learned_router_is_worse(tmp_path: Path) -> None:
    folder = _toy_folder(tmp_path)
    # an over-regularised ridge is a constant score: worse than length on validation → length ships
    res = fit_ladder_router(folder, ["toy"], "m:no_think,exd0", alpha=1e9, pool="none")
    v = res.validation["savings_at_98"]
    assert v["length"] > v["router"] + 0.05
    assert res.policy == "length" and res.router.scorer == "length"
    assert res.router.metadata["policy"] == "length" and len(res.router.thresholds) == 1
    # the same data, forced: the learned router is what ships
    forced = fit_ladder_router(folder, ["toy"], "m:no_think,exd0", alpha=1e9, pool="none", policy="router")
    assert forced.policy == "router" and forced.router.scorer == "pipeline"
    # no fit sees the held-out questions
    assert not heldout_mask(res.train).any() and res.train.n < 240


@pytest.mark.parametrize("scorer", ["length", "hash"])
def test_baseline_router_files_round_trip(tmp_path: Path, scorer: str) -> None:
    r = TrainedRouter(pipeline=None, scorer=scorer, thresholds=[0.4], metadata={"policy": scorer})
    p = save_router(r, tmp_path / "b.skops")
    back = load_router(p)
    assert back.scorer == scorer and back.thresholds == [0.4] and back.pipeline is None
    text = "How many moons does Mars have?"
    assert back.score(text) == (length_prior(text) if scorer == "length" else hash_score(text))
    assert back.score(text + " ") == back.score(text) or scorer == "length"  # hash ignores whitespace runs
    assert back.route(back.score(text), ["cheap", "top"]) in ("cheap", "top")


def test_hash_score_is_uniform_enough() -> None:
    s = np.array([hash_score(f"question {i}") for i in range(4000)])
    assert s.min() >= 0.0 and s.max() < 1.0
    assert np.histogram(s, bins=4, range=(0, 1))[0].min() > 900


# ---- CLI end to end --------------------------------------------------------------------------------------------


def test_router_fit_traces_cli_end_to_end(tmp_path: Path) -> None:
    # enough questions that the calibration split can certify routing down (issue 27: the served thresholds carry a
    # 90%-confidence guarantee; with the 240-question folder the honest answer is "do not route")
    folder = _toy_folder(tmp_path / "traces", n=1500)
    out = tmp_path / "r.skops"
    argv = ["router", "fit", "--traces", str(folder), "--dataset", "toy", "--ladder", "m:no_think,exd0",
            "--output", str(out)]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert "curve metric" in res.output and "serves" in res.output and "90% confidence" in res.output
    r = load_router(out)
    meta = r.metadata
    assert meta["ladder"] == {"model": "m", "settings": ["no_think", "exd0"]} and meta["tiers"] == ["no_think", "exd0"]
    assert meta["datasets"] == ["toy"] and meta["quality_target"] == 0.98 and len(r.thresholds) == 1
    assert meta["policy"] in ("router", "length", "random") and meta["metrics"]["validation"]["savings_at_98"]
    # on the held-out questions the shipped router keeps (close to) the target and saves tokens
    d = load_ladder(folder, "toy", "m:no_think,exd0")
    test = d.subset(np.flatnonzero(heldout_mask(d)))
    ev = evaluate_ladder(["no_think", "exd0"], test.correct, test.tokens, r.predict_proba(test.questions),
                         r.thresholds, np.array([length_prior(q) for q in test.questions]))
    assert ev["savings_at_98"]["router"] > 0.3
    assert meta["serving"]["policy"] != "always_top" and meta["serving"]["guarantee"]["delta"] == 0.1
    info = CliRunner().invoke(app, ["router", "info", str(out)])
    assert info.exit_code == 0 and "scorer chosen at fit:" in info.output and "ladder m" in info.output
    assert "keeps >= 98% of always-top accuracy" in info.output and "90% confidence" in info.output
    # several ladders → a folder; a bad ladder is a clear error
    base = ["router", "fit", "--traces", str(folder), "--dataset", "toy"]
    bad = CliRunner().invoke(app, [*base, "--ladder", "m", "--output", str(out)])
    assert bad.exit_code == 2 and "MODEL:SETTING1" in bad.output
    small = _toy_folder(tmp_path / "small")
    for s in ("no_think", "exd0"):  # a second model with the same recordings: a second (cheapest-first) ladder
        (small / "toy" / f"m2__{s}.jsonl.gz").write_bytes((small / "toy" / f"m__{s}.jsonl.gz").read_bytes())
    base = ["router", "fit", "--traces", str(small), "--dataset", "toy"]
    many = CliRunner().invoke(app, [*base, "--ladder", "m:no_think,exd0", "--ladder", "m2:no_think,exd0",
                                    "--output", str(tmp_path / "routers")])
    assert many.exit_code == 0, many.output
    assert sorted(p.name for p in (tmp_path / "routers").iterdir()) == ["m2__no_think-exd0.skops",
                                                                         "m__no_think-exd0.skops"]


def test_a_wrong_data_set_model_or_setting_is_named_with_what_the_folder_has(tmp_path: Path) -> None:
    for s in ("no_think", "exd0"):
        write_trace(tmp_path, "frames", "Qwen3-14B", s, [row(0, "q0", True, 5)])
    cases = {"gsm8k Qwen3-14B:no_think,exd0": "no data set 'gsm8k' under .* \\(have: frames\\)",
             "frames Qwen3-99B:no_think,exd0": "no model 'Qwen3-99B' in .* \\(have: Qwen3-14B\\)",
             "frames Qwen3-14B:no_think,budget9": "Qwen3-14B has no setting 'budget9' in .* \\(has: exd0, no_think\\)"}
    for case, message in cases.items():
        ds, ladder = case.split()
        with pytest.raises(FileNotFoundError, match=message):
            load_ladder(tmp_path, ds, ladder)
    with pytest.raises(FileNotFoundError, match="traces folder not found"):
        load_ladder(tmp_path / "nope", "frames", "Qwen3-14B:no_think,exd0")


def test_a_ladder_not_cheapest_first_is_refused_and_no_share_reads_as_negative_savings(tmp_path: Path) -> None:
    """Most expensive first (exd0 200 tokens, no_think 10): one line, exit 2, no file — it used to fit, and print
    "(calibration: -437% fewer tokens)"; a share above 1 is said as more tokens."""
    from router.policy import guarantee_sentence

    folder = _toy_folder(tmp_path / "traces")
    out = tmp_path / "rev.skops"
    res = CliRunner().invoke(app, ["router", "fit", "--traces", str(folder), "--dataset", "toy", "--ladder",
                                   "m:exd0,no_think", "--output", str(out)])
    assert res.exit_code == 2 and not out.exists()
    assert "not cheapest first" in res.output and "exd0 200" in res.output and "m:no_think,exd0" in res.output
    assert "Traceback" not in res.output
    meta = {"serving": {"policy": "router", "guarantee": {"floor": 0.98, "delta": 0.1, "n_calibration": 50,
                                                          "calibration_token_share": 5.37}}}
    sentence = guarantee_sentence(meta) or ""
    assert "437% more tokens than always-top" in sentence and "fewer" not in sentence


def test_an_output_that_cannot_be_written_fails_before_fitting(tmp_path: Path) -> None:
    """One line, exit 2, naming --output, before any fit (the data folder here does not even exist: a fit would fail
    on it first) — these were tracebacks after the fit. A single file may not be a folder; several ladders need one."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["router", "fit", "--traces", str(tmp_path / "no-traces"), "--dataset", "toy"]
    one, two = ["--ladder", "m:no_think,exd0"], ["--ladder", "m:no_think,exd0", "--ladder", "m2:no_think,exd0"]
    cases = {(str(afile / "x.skops"), 1): "is not a folder", (str(tmp_path), 1): "is a folder; give a file name",
             ("/proc/x.skops", 1): "no file can be created in /proc", (str(afile), 2): "several outputs need a folder"}
    for (out, n), message in cases.items():
        res = CliRunner().invoke(app, [*base, *(one if n == 1 else two), "--output", out])
        assert res.exit_code == 2, (out, res.output)
        assert "--output" in res.output and message in res.output and "Traceback" not in res.output, res.output
    labels = CliRunner().invoke(app, ["router", "fit", str(tmp_path / "none.jsonl"), "--output", str(afile / "x")])
    assert labels.exit_code == 2 and "is not a folder" in labels.output


def test_fit_range_checks_its_shares_and_confidence(tmp_path: Path) -> None:
    """--quality-target 1.5, --delta 0 or 1, --cal-frac 1.5 were accepted; each is one line naming the flag, exit 2
    (before anything is read: the folder does not exist)."""
    base = ["router", "fit", "--traces", str(tmp_path / "none"), "--dataset", "toy", "--ladder", "m:no_think,exd0",
            "--output", str(tmp_path / "r.skops")]
    for flag, value in (("--quality-target", "1.5"), ("--quality-target", "0"), ("--delta", "0"),
                        ("--delta", "1"), ("--cal-frac", "1.5"), ("--cal-frac", "0"), ("--heldout-frac", "1")):
        res = CliRunner().invoke(app, [*base, flag, value])
        assert res.exit_code == 2 and f"{flag} must be in (0, 1" in res.output, (flag, value, res.output)
    ok = CliRunner().invoke(app, [*base, "--quality-target", "1"])  # a floor of all of always-top is allowed
    assert "--quality-target" not in ok.output and "traces folder not found" in ok.output


def test_fit_summary_names_each_point_with_its_cuts_and_what_was_certified(tmp_path: Path) -> None:
    """The README's o3-mini fit serves length+escalation at a cut of 1.0 while the split family's points (the
    scorer alone and with the cascade) certified nothing on the calibration split: always top, [0.0]. The summary
    printed "serves length+escalation at thresholds [1.0] (router alone [0.0], with the cascade [0.0])" — read as
    cuts of the served policy, with the in-sample "router+cascade 32.1%" above it as if that were certified (a new
    user's report). Each point is now named with its cuts, what they mean, and what was certified for it."""
    out = tmp_path / "o3.skops"
    res = CliRunner().invoke(app, ["router", "fit", "--traces", str(Path(__file__).parents[2] / "data" / "traces"),
                                   "--dataset", "frames", "--ladder", "o3-mini:low_effort,high_effort",
                                   "--output", str(out)])
    assert res.exit_code == 0, res.output
    sv = load_router(out).metadata["serving"]
    assert (sv["policy"], sv["thresholds"], sv["router_thresholds"], sv["cascade_thresholds"]) == (
        "length+escalation", [1.0], [0.0], [0.0])  # the reported case, unchanged by the fix
    g, n_cal = sv["guarantee"], sv["cascade_guarantee"]["n_calibration"]
    assert ("serves length+escalation at thresholds [1.0] = none straight to the top: certified on "
            f"{g['n_calibration']} cross-fitted questions (every non-held-out one): "
            f"{1 - g['calibration_token_share']:.0%} fewer tokens at {g['calibration_accuracy_ratio']:.1%} of "
            "always-top accuracy") in res.output, res.output
    assert (f"length alone at [0.0] = always top, nothing certified on {n_cal} calibration questions: 0% savings; "
            f"length+cascade at [0.0] = always top, nothing certified on {n_cal} calibration questions: 0% "
            "savings") in res.output, res.output
    assert "a ranking, not a certificate" in res.output and "router alone" not in res.output


def test_bench_traces_names_the_cuts_each_row_ran_at() -> None:
    """``bench traces``' router line: "thresholds [1.0], router+cascade at [0.0]" left a row at 0.0% savings looking
    like a broken cascade; [0.0] is always top, the calibration split having certified nothing for that point."""
    from bench.traces.bench import _router_line

    line = _router_line({"router": "o3.skops", "router_policy": "length", "served_policy": "length+escalation",
                         "thresholds": [1.0], "router_thresholds": [0.0], "cascade_thresholds": [0.0]})
    assert line.startswith("router o3.skops (scorer length; auto serves length+escalation at [1.0] = none straight "
                           "to the top; row router at [0.0] = always top, router+cascade at [0.0] = always top")
    assert "certified nothing" in line
