"""The recipe of the shipped router (``router/assets/default.skops``), rebuilt by
``thinkgate router build-default``.

Training data (label source 1, a data set's own difficulty; "long" = hard enough to need the long tier):

* MATH train split (``data/math/train.jsonl.gz``, 11,998 problems with a level): ``level ≥ 4``;
  groups = subject.
* the project's generated arithmetic task (:mod:`router.tasks`, train split, up to 500 problems per number
  of operations 1–7): ``operations ≥ k``, where *k* is **measured**, not assumed: the smallest number of
  operations at which the shipped model's ``short`` tier, through the gateway, answers fewer than 95 % as many
  problems as its ``long`` tier (``router/assets/tier_outcomes.json``, the JSON of ``thinkgate eval tiers``;
  see :func:`arith_threshold_from_outcomes`). Re-measure it whenever the model or the tier budgets change.

RouteLLM's MMLU outcome pairs are *not* in the shipped mix: with them, MATH-500 AUC fell from 0.77 to 0.75
and their own held-out-subject APGR stayed near 0.55 (their label, "Mixtral wrong and GPT-4 right", is about
two particular models, not about how long to think). They are used for evaluation: the dedicated MMLU
numbers and the transfer row (``bench/router_eval.py``).

Held-out data: validation groups of the training split (reported, then the model is refitted on all),
MATH-500 and the arithmetic test split (calibration set for the threshold and the reported metrics),
GSM8K test (``#calculation steps ≥ 4``) and RouteLLM MMLU as transfer sets.
Threshold: the highest cut that keeps ≥ 95% of always-long quality on the calibration set
(``max_quality_loss = 0.05``; quality from labels, i.e. "needs-long items sent long").
"""

from __future__ import annotations

from dataclasses import replace
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from router.fit.calibrate import fraction_at_or_above, threshold_for_quality_loss
from router.fit.evaluate import EvalResult, evaluate_scores, outcomes_of, plot_curves, render_table
from router.fit.fitter import fit_router
from router.fit.jsonl import read_jsonl, sha256_files
from router.fit.labels import LabelledItem, from_difficulty, from_outcome_pairs
from router.model import ModelConfig
from router.persistence import save_router
from router.tasks.rows import items_from_rows, task_rows

REPO = Path(__file__).resolve().parents[2]
MATH_TRAIN = REPO / "data" / "math" / "train.jsonl.gz"
MATH_TEST = Path(str(files("router.tasks").joinpath("data", "math", "test.jsonl")))  # package data
MMLU = REPO / "data" / "routellm" / "mmlu_responses.jsonl.gz"
MMLU_WEAK = "mistralai/Mixtral-8x7B-Instruct-v0.1"
MMLU_STRONG = "gpt-4-1106-preview"
MATH_LEVEL = 4
TIER_OUTCOMES = REPO / "router" / "assets" / "tier_outcomes.json"
SHORT_KEEPS = 0.95
GSM8K_STEPS = 4
MAX_QUALITY_LOSS = 0.05
DEFAULT_CONFIG = ModelConfig()


def math_items(
    path: Path = MATH_TRAIN, threshold: float = MATH_LEVEL, source: str = "math-level"
) -> list[LabelledItem]:
    """MATH problems labelled ``level ≥ threshold`` (source 1), grouped by subject."""
    return list(from_difficulty(read_jsonl(path), threshold=threshold, source=source, id_prefix=f"{source}/"))


def mmlu_items(path: Path = MMLU) -> list[LabelledItem]:
    """RouteLLM MMLU outcome pairs (source 2), grouped by subject."""
    return list(from_outcome_pairs(read_jsonl(path), weak_field=MMLU_WEAK, strong_field=MMLU_STRONG,
                                   source="routellm-mmlu", id_prefix="mmlu/"))


def arith_threshold_from_outcomes(
    path: Path = TIER_OUTCOMES, short: str = "short", long: str = "long", keeps: float = SHORT_KEEPS
) -> int:
    """The number of operations from which ``arith`` problems need the long tier, from measured outcomes.

    ``path``: a ``thinkgate eval tiers --json`` report with both tiers and a ``by_difficulty`` breakdown
    (accuracy per number of operations). Returns the smallest level *k* at which
    ``accuracy(short, k) < keeps * accuracy(long, k)``; every level at and above *k* is then labelled long
    (accuracy falls with the number of operations, so one cut is enough). If the short tier keeps up at every
    measured level, returns one past the largest. Raises ``ValueError`` for a missing file or tier.
    """
    import json

    if not path.is_file():
        raise ValueError(f"{path}: no tier outcomes; run `thinkgate eval tiers --tiers short,long --json {path}`")
    tiers = json.loads(path.read_text())["tiers"]
    if short not in tiers or long not in tiers:
        raise ValueError(f"{path}: needs tiers {short!r} and {long!r}, has {sorted(tiers)}")
    s_by, l_by = tiers[short]["by_difficulty"], tiers[long]["by_difficulty"]
    levels = sorted(int(k) for k in s_by if k in l_by)
    for k in levels:
        if s_by[str(k)]["accuracy"] < keeps * l_by[str(k)]["accuracy"]:
            return k
    return (levels[-1] + 1) if levels else 1


def arith_items(split: str, per_level: int, seed: int = 0, threshold: int | None = None) -> list[LabelledItem]:
    """Generated arithmetic problems labelled ``operations ≥ threshold`` (default: measured, see
    :func:`arith_threshold_from_outcomes`)."""
    k = arith_threshold_from_outcomes() if threshold is None else threshold
    return items_from_rows(task_rows("arith", split, per_level, seed), k, "arith-ops")


def gsm8k_items() -> list[LabelledItem]:
    """GSM8K test labelled ``calculation steps ≥ GSM8K_STEPS`` (transfer only)."""
    return items_from_rows(task_rows("gsm8k", "test", None), GSM8K_STEPS, "gsm8k-steps")


def build_default_router(
    out: Path, *, plot: Path | None = None, seed: int = 0, console: Any = None
) -> tuple[Any, list[EvalResult]]:
    """Fit, calibrate, evaluate and save the shipped router (~2–4 min on 2 busy cores). Returns the router
    and the held-out results (calibration sets, then transfer sets)."""
    say = console.print if console is not None else print
    arith_k = arith_threshold_from_outcomes()
    say(f"arith: long from {arith_k} operations (measured in {TIER_OUTCOMES.relative_to(REPO)})")
    train = math_items() + arith_items("train", 500, seed, arith_k)
    cfg = replace(DEFAULT_CONFIG, seed=seed)
    say(f"training items: {len(train)}")
    router, report = fit_router(
        train, cfg, val_frac=0.2, platt_frac=0.15, refit=True,
        data_files=[str(MATH_TRAIN.relative_to(REPO)), f"router.tasks arith train (seed {seed})"],
        extra_metadata={
            "recipe": "router.fit.default.build_default_router",
            "arith_long_from_operations": arith_k,
            "tier_outcomes": str(TIER_OUTCOMES.relative_to(REPO)),
            "tier_outcomes_sha256": sha256_files([TIER_OUTCOMES]),
        },
    )
    if console is not None:
        console.print(render_table(report.validation, title="Validation (held-out subjects/items, pre-refit)"))

    calib = math_items(MATH_TEST, source="math500-level") + arith_items("test", 100, seed, arith_k)
    scores = router.predict_proba([it.text for it in calib])
    qs, ql, _ = outcomes_of(calib)
    cut = threshold_for_quality_loss(scores, qs, ql, MAX_QUALITY_LOSS)
    router.thresholds = [cut]
    router.metadata["thresholds_calibration"] = {
        "method": "max_quality_loss",
        "target": MAX_QUALITY_LOSS,
        "achieved_frac_at_or_above": [round(fraction_at_or_above(scores, cut), 4)],
        "quality": round(float(np.mean(np.where(scores >= cut, ql, qs))), 4),
        "always_long_quality": round(float(ql.mean()), 4),
        "n": len(calib),
        "data_files": [str(MATH_TEST.relative_to(REPO)), f"router.tasks arith test (seed {seed})"],
        "sha256": sha256_files([MATH_TEST]),
    }

    results: list[EvalResult] = []
    for name, items in (
        ("math500-level>=4", [it for it in calib if it.source.startswith("math500")]),
        (f"arith-test-ops>={arith_k}", [it for it in calib if it.source.startswith("arith")]),
        ("gsm8k-test-steps>=4 (transfer)", gsm8k_items()),
        ("routellm-mmlu (transfer)", mmlu_items()),
    ):
        s = router.predict_proba([it.text for it in items])
        results.append(evaluate_scores(name, items, s))
    router.metadata["metrics"]["heldout"] = [r.summary() for r in results]
    save_router(router, out)
    if console is not None:
        console.print(render_table(results, title="Held-out and transfer sets (shipped model)"))
    if plot is not None:
        plot_curves(results, plot, title="Shipped router: quality vs % sent to long (held-out sets)")
    say(f"threshold {cut:.4f}; saved {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return router, results
