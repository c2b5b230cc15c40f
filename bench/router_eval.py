"""Router quality on the real data in data/: the numbers of bench/RESULTS.md "Router".

1. MATH-500 (level labels, level ≥ 4 = long): a router fitted on the MATH train split only, and the shipped
   router. AUC, and Spearman ρ of the score with the level.
2. RouteLLM MMLU outcome labels (weak = Mixtral-8x7B, strong = GPT-4; long = weak wrong and strong right)
   with **subjects held out**: 5-fold GroupKFold over the 57 subjects; each fold's router is fitted (Platt
   included) on the other subjects only; the out-of-fold scores of all 14,042 questions give APGR,
   CPT(50%/80%) and the cost reduction at 95% of always-strong quality, against random routing.
   Also each fold on its own held-out subjects (mean ± sd) and, for contrast, a random 80/20 item split.
3. Transfer: MATH-trained → MMLU, MMLU-trained → MATH-500, and the shipped router on both and on GSM8K.

    .venv/bin/python bench/router_eval.py [--json bench/results/router_eval.json] [--folds 5]

Runs ~5 minutes on 2 busy cores (9 fits). Deterministic (seed 0).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from router.fit.default import MATH_TEST, gsm8k_items, math_items, mmlu_items
from router.fit.evaluate import EvalResult, evaluate_scores, plot_curves, render_table
from router.fit.fitter import fit_router
from router.model import ModelConfig
from router.persistence import load_router

REPO = Path(__file__).resolve().parent.parent

CFG = ModelConfig()


def mmlu_heldout_subjects(folds: int) -> tuple[list, np.ndarray, list[EvalResult]]:  # type: ignore[type-arg]
    """Out-of-fold scores for every MMLU question (subjects never shared between a fold's fit and its
    scoring), and each fold's own result on its held-out subjects."""
    from sklearn.model_selection import GroupKFold

    items = mmlu_items()
    groups = np.array([it.group for it in items])
    scores = np.empty(len(items))
    per_fold = []
    for k, (fit_idx, test_idx) in enumerate(GroupKFold(n_splits=folds).split(items, groups=groups)):
        t0 = time.perf_counter()
        router, _ = fit_router([items[i] for i in fit_idx], CFG, val_frac=0.0)
        scores[test_idx] = router.predict_proba([items[i].text for i in test_idx])
        per_fold.append(evaluate_scores(f"fold {k + 1}", [items[i] for i in test_idx], scores[test_idx]))
        print(f"  fold {k + 1}/{folds}: {len(set(groups[test_idx]))} subjects held out, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    return items, scores, per_fold


def main() -> None:
    from scipy.stats import spearmanr

    from router.console import console

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "router_eval.json")
    ap.add_argument("--plot", type=Path, default=REPO / "bench" / "results" / "router_eval.png")
    ap.add_argument("--folds", type=int, default=5)
    args = ap.parse_args()
    con = console(width=200)
    results: list[EvalResult] = []
    extra: dict[str, float] = {}

    math_train, math500 = math_items(), math_items(MATH_TEST, source="math500-level")
    levels = np.array([it.meta["difficulty"] for it in math500])
    print("MATH train → MATH-500 …", flush=True)
    math_router, _ = fit_router(math_train, CFG, val_frac=0.0)
    s = math_router.predict_proba([it.text for it in math500])
    results.append(evaluate_scores("MATH-trained → MATH-500 (level≥4)", math500, s))
    extra["math_trained_math500_spearman_level"] = float(spearmanr(s, levels).statistic)

    shipped = load_router(REPO / "router" / "assets" / "default-learned.skops")  # the learned default candidate
    s = shipped.predict_proba([it.text for it in math500])
    results.append(evaluate_scores("shipped → MATH-500 (level≥4)", math500, s))
    extra["shipped_math500_spearman_level"] = float(spearmanr(s, levels).statistic)

    print(f"MMLU, {args.folds}-fold subjects held out …", flush=True)
    mmlu, oof, per_fold = mmlu_heldout_subjects(args.folds)
    results.append(evaluate_scores("MMLU-trained → MMLU (subjects held out, pooled)", mmlu, oof))
    mmlu_plot = [results[-1]]
    for key in ("auc", "apgr", "cost_reduction_95", "random_cost_reduction_95"):
        vals = np.array([getattr(r, key) for r in per_fold], dtype=float)
        extra[f"mmlu_subjects_heldout_per_fold_{key}_mean"] = float(np.nanmean(vals))
        extra[f"mmlu_subjects_heldout_per_fold_{key}_sd"] = float(np.nanstd(vals))
    # the same model family on a random (not subject-grouped) split, to show what grouping removes
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(mmlu))
    cut = int(0.8 * len(mmlu))
    random_router, _ = fit_router([mmlu[i] for i in perm[:cut]], CFG, val_frac=0.0)
    test = [mmlu[i] for i in perm[cut:]]
    results.append(evaluate_scores("MMLU-trained → MMLU (random 20% split)", test,
                                   random_router.predict_proba([it.text for it in test])))

    print("transfer …", flush=True)
    s = math_router.predict_proba([it.text for it in mmlu])
    results.append(evaluate_scores("MATH-trained → MMLU (transfer)", mmlu, s))
    s = shipped.predict_proba([it.text for it in mmlu])
    results.append(evaluate_scores("shipped → MMLU (transfer)", mmlu, s))
    mmlu_plot.append(results[-1])
    mmlu_router, _ = fit_router(mmlu, CFG, val_frac=0.0)
    s = mmlu_router.predict_proba([it.text for it in math500])
    results.append(evaluate_scores("MMLU-trained → MATH-500 (transfer)", math500, s))
    gsm = gsm8k_items()
    s = shipped.predict_proba([it.text for it in gsm])
    results.append(evaluate_scores("shipped → GSM8K test (steps≥4, transfer)", gsm, s))

    con.print(render_table(results, title="Router evaluation on the real data (bench/router_eval.py)"))
    for k, v in extra.items():
        con.print(f"{k}: {v:.3f}")
    plot_curves(mmlu_plot, args.plot, title="RouteLLM MMLU: accuracy vs % sent to GPT-4 (subjects held out)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"results": [r.summary() for r in results], **extra}, indent=2) + "\n")
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
