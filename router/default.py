"""The recipe of the shipped router (``router/assets/default.skops``), rebuilt by
``thinkgate router build-default``.

Training data (label source 1, a data set's own difficulty; "long" = hard enough to need the long tier):

* MATH train split (``data/math/train.jsonl.gz``, 11,998 problems with a level): ``level ≥ 4``;
  groups = subject.
* the project's generated arithmetic task (:mod:`training.tasks`, train split, up to 500 problems per number
  of operations 1–7): ``operations ≥ 4``. This is the default gateway's upstream task: the tiny model's
  ``short`` tier thinks ≤ 48 tokens, enough for about three chained operations.

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
from pathlib import Path
from typing import Any

import numpy as np

from router.calibrate import fraction_at_or_above, threshold_for_quality_loss
from router.evaluate import EvalResult, evaluate_scores, outcomes_of, plot_curves, render_table
from router.fit import fit_router
from router.jsonl import read_jsonl, sha256_files
from router.labels import LabelledItem, from_difficulty, from_outcome_pairs
from router.model import ModelConfig
from router.persistence import save_router
from router.tasks_data import items_from_rows, task_rows

REPO = Path(__file__).resolve().parent.parent
MATH_TRAIN = REPO / "data" / "math" / "train.jsonl.gz"
MATH_TEST = REPO / "data" / "math" / "test.jsonl"
MMLU = REPO / "data" / "routellm" / "mmlu_responses.jsonl.gz"
MMLU_WEAK = "mistralai/Mixtral-8x7B-Instruct-v0.1"
MMLU_STRONG = "gpt-4-1106-preview"
MATH_LEVEL = 4
ARITH_OPS = 4
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


def arith_items(split: str, per_level: int, seed: int = 0) -> list[LabelledItem]:
    """Generated arithmetic problems labelled ``operations ≥ ARITH_OPS``."""
    return items_from_rows(task_rows("arith", split, per_level, seed), ARITH_OPS, "arith-ops")


def gsm8k_items() -> list[LabelledItem]:
    """GSM8K test labelled ``calculation steps ≥ GSM8K_STEPS`` (transfer only)."""
    return items_from_rows(task_rows("gsm8k", "test", None), GSM8K_STEPS, "gsm8k-steps")


def build_default_router(
    out: Path, *, plot: Path | None = None, seed: int = 0, console: Any = None
) -> tuple[Any, list[EvalResult]]:
    """Fit, calibrate, evaluate and save the shipped router (~2–4 min on 2 busy cores). Returns the router
    and the held-out results (calibration sets, then transfer sets)."""
    say = console.print if console is not None else print
    train = math_items() + arith_items("train", 500, seed)
    cfg = replace(DEFAULT_CONFIG, seed=seed)
    say(f"training items: {len(train)}")
    router, report = fit_router(
        train, cfg, val_frac=0.2, platt_frac=0.15, refit=True,
        data_files=[str(MATH_TRAIN.relative_to(REPO)), f"training.tasks arith train (seed {seed})"],
        extra_metadata={"recipe": "router.default.build_default_router"},
    )
    if console is not None:
        console.print(render_table(report.validation, title="Validation (held-out subjects/items, pre-refit)"))

    calib = math_items(MATH_TEST, source="math500-level") + arith_items("test", 100, seed)
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
        "data_files": [str(MATH_TEST.relative_to(REPO)), f"training.tasks arith test (seed {seed})"],
        "sha256": sha256_files([MATH_TEST]),
    }

    results: list[EvalResult] = []
    for name, items in (
        ("math500-level>=4", [it for it in calib if it.source.startswith("math500")]),
        ("arith-test-ops>=4", [it for it in calib if it.source.startswith("arith")]),
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
