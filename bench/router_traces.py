"""Real traces — offline router evaluation: fit a router per ladder on the non-held-out questions, score the
fixed held-out questions (``router.fit.traces.is_heldout``), compare every policy.

    python -m bench.router_traces [--traces ../shared/data/traces] [--bootstrap 300] [--json out] [--png out]

Per ladder: the fallback rule's choice (router / length / random, on 5-fold validation), then on the held-out
questions savings_at_98 (cheapest point of each policy's threshold curve with accuracy ≥ 98% of always-top) of
router, router+cascade (abstaining cheap answers escalate), random, length, oracle; accuracy and tokens at the
calibrated thresholds; a bootstrap interval over held-out questions; leave-one-dataset-out transfer (fit on
the other data set, same ladder). Pure offline (recorded outcomes), 2 cores: ~1 min in all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np

from router.fit.ladder_eval import (
    abstain_matrix,
    cascade_curve,
    evaluate_ladder,
    random_curve,
    savings_at_98,
    threshold_curve,
    top_totals,
)
from router.fit.ladder_fit import fit_ladder_router, length_score
from router.fit.traces import LadderData, heldout_mask, load_ladder, parse_ladder

REPO = Path(__file__).resolve().parent.parent
#: the traces shipped in the repository (data/traces: the nine ladders' models, the fields fit and bench read);
#: --traces overrides (e.g. the full shared folder)
DEFAULT_TRACES = REPO / "data" / "traces"
LADDERS: tuple[tuple[str, str], ...] = (
    ("frames", "Qwen3-14B:no_think,exd0"),
    ("frames", "Qwen3-8B:no_think,exd0"),
    ("frames", "gemini-2.5-flash:no_think,budget1024"),
    ("frames", "gemini-2.5-flash:budget256,budget1024"),
    ("frames", "gpt-5-mini:low_effort,high_effort"),
    ("frames", "o3-mini:low_effort,high_effort"),
    ("simpleqa", "gemini-2.5-flash:no_think,budget1024"),
    ("simpleqa", "claude-sonnet4:no_think,budget1024"),
    ("frames", "gemini-2.5-flash:no_think,budget256,budget1024"),
)
SPREAD_POLICIES = ("router", "router+cascade", "length", "random", "oracle")


def fail(msg: str) -> NoReturn:
    """One line on stderr (``error: …``), exit 2 — the scripts' bad-argument exit, as the CLI's."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def check_traces_folder(traces: Path) -> None:
    """Exit 2 (:func:`fail`) unless ``traces`` is a folder: a typo in ``--traces`` is said at once, before a fit."""
    if not traces.is_dir():
        fail(f"--traces {traces}: no such folder (DIR/<dataset>/<MODEL>__<SETTING>.jsonl.gz)")


def _heldout(traces: Path, ds: str, ladder: str) -> LadderData:
    data = load_ladder(traces, ds, ladder)
    return data.subset(np.flatnonzero(heldout_mask(data)))


def _savings_sample(idx: np.ndarray, data: LadderData, s_router: np.ndarray, s_len: np.ndarray,
                    ab: np.ndarray) -> dict[str, float]:
    c, t = data.correct[idx], data.tokens[idx]
    top_acc, top_tok = top_totals(c, t)
    oc = np.where(c.any(axis=1), np.argmax(c, axis=1), 0)
    return {
        "router": savings_at_98(threshold_curve(s_router[idx], c, t), top_acc),
        "router+cascade": savings_at_98(cascade_curve(s_router[idx], c, t, ab[idx]), top_acc),
        "length": savings_at_98(threshold_curve(s_len[idx], c, t), top_acc),
        "random": savings_at_98(random_curve(c, t, 201), top_acc),
        "oracle": float(1 - t[np.arange(len(idx)), oc].sum() / top_tok),
    }


def bootstrap(data: LadderData, s_router: np.ndarray, s_len: np.ndarray, ab: np.ndarray, n_boot: int,
              seed: int = 0) -> dict[str, list[float]]:
    """Each policy's savings_at_98 on ``n_boot`` resamples of the held-out questions (a resample where
    always-top gets nothing right counts 0 for every policy)."""
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {p: [] for p in SPREAD_POLICIES}
    for _ in range(n_boot):
        idx = rng.integers(0, data.n, data.n)
        if data.correct[idx, -1].sum() == 0:
            for p in draws:
                draws[p].append(0.0)
            continue
        for p, v in _savings_sample(idx, data, s_router, s_len, ab).items():
            draws[p].append(v)
    return draws


def p5_p95(v: list[float] | np.ndarray) -> list[float]:
    return [round(float(np.percentile(v, 5)), 4), round(float(np.percentile(v, 95)), 4)]


def run_ladder(traces: Path, ds: str, ladder: str, n_boot: int) -> dict:
    t0 = time.perf_counter()
    fit = fit_ladder_router(traces, [ds], ladder)
    test = _heldout(traces, ds, ladder)
    router = fit.router
    s_router = router.predict_proba(test.questions)
    s_len = np.array([length_score(q) for q in test.questions])
    ab = abstain_matrix(test.responses)
    # the router-alone point (the file's own thresholds are the served policy's router cut, with its escalation)
    alone = router.metadata.get("router_thresholds", router.thresholds)
    res = evaluate_ladder(parse_ladder(ladder).settings, test.correct, test.tokens, s_router, alone, s_len,
                          abstain=ab, cascade_thresholds=router.metadata["cascade_thresholds"],
                          reasoning_tokens=test.reasoning_tokens)
    # the learned score itself, even where the fallback shipped a baseline
    s_learned = fit.learned.predict_proba(test.questions)
    top_acc, _ = top_totals(test.correct, test.tokens)
    res["savings_at_98"]["learned"] = round(savings_at_98(threshold_curve(s_learned, test.correct, test.tokens),
                                                          top_acc), 4)
    res["savings_at_98"]["learned+cascade"] = round(savings_at_98(
        cascade_curve(s_learned, test.correct, test.tokens, ab), top_acc), 4)
    res["dataset"], res["ladder"], res["policy_shipped"] = ds, ladder, fit.policy
    res["validation"] = fit.validation
    draws = bootstrap(test, s_router, s_len, ab, n_boot)
    res["spread_p5_p95"] = {p: p5_p95(v) for p, v in draws.items()}
    res["_draws"] = draws
    # leave-one-dataset-out: the same ladder fitted on the other data set, tested on these held-out questions
    other = "simpleqa" if ds == "frames" else "frames"
    lodo = fit_ladder_router(traces, [other], ladder)
    s_lodo = lodo.router.predict_proba(test.questions)
    s_lodo_learned = lodo.learned.predict_proba(test.questions)
    res["lodo"] = {
        "fit_on": other, "policy_shipped": lodo.policy,
        "router": round(savings_at_98(threshold_curve(s_lodo, test.correct, test.tokens), top_acc), 4),
        "router+cascade": round(savings_at_98(cascade_curve(s_lodo, test.correct, test.tokens, ab), top_acc), 4),
        "learned": round(savings_at_98(threshold_curve(s_lodo_learned, test.correct, test.tokens), top_acc), 4),
    }
    res["best_router"] = max(res["savings_at_98"]["router"], res["savings_at_98"]["router+cascade"])
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def plot(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    cols = 3
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.9 * rows), squeeze=False)
    for ax, r in zip(axes.ravel(), results, strict=False):
        top = r["always_top_accuracy"]
        styles = {"router": "-", "router+cascade": "-", "length": "--", "random": ":"}
        for name, ls in styles.items():
            cv = np.asarray(r["curves"].get(name, []))
            if cv.size:
                ax.plot(100 * cv[:, 0], 100 * cv[:, 1], ls, lw=1.5,
                        label=f"{name} ({100 * r['savings_at_98'].get(name, 0):.0f}%)")
        o = r["policies"]["oracle"]
        ax.plot([100 * o["token_share"]], [100 * o["accuracy"]], "g*", ms=9,
                label=f"oracle ({100 * r['savings_at_98']['oracle']:.0f}%)")
        ax.axhline(100 * 0.98 * top, color="red", lw=0.7, ls="-.", label="98% of always-top")
        ax.set_xlim(0, 110)
        ax.set_title(f"{r['dataset']} {r['ladder']} (n={r['n_questions']})", fontsize=8)
        ax.set_xlabel("tokens, % of always-top")
        ax.set_ylabel("accuracy %")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    fig.suptitle("Held-out questions: accuracy vs tokens over thresholds (savings_at_98 in brackets)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--bootstrap", type=int, default=300)
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "router_traces.json")
    ap.add_argument("--png", type=Path, default=REPO / "bench" / "results" / "router_traces.png")
    args = ap.parse_args(argv)
    check_traces_folder(args.traces)
    t0 = time.perf_counter()
    results = []
    for ds, ladder in LADDERS:
        try:
            r = run_ladder(args.traces, ds, ladder, args.bootstrap)
        except (FileNotFoundError, ValueError) as exc:  # a data set, model or setting the folder lacks
            fail(f"{ds} {ladder}: {exc}")
        results.append(r)
        print(f"  {ds} {ladder}: shipped {r['policy_shipped']} ({r['seconds']} s)", flush=True)
    la = os.getloadavg()
    print(f"\nheld-out questions (sha256 split, 20%); savings_at_98 = 1 - tokens/always-top at the cheapest point with "
          f"accuracy >= 98% of always-top; 2 CPUs, load {la[0]:.1f}")
    head = (f"{'data':8} {'ladder':44} {'n':>4} {'ship':>6} {'router':>7} {'r+casc':>7} {'learned':>7} "
            f"{'length':>7} {'random':>7} {'oracle':>7} {'top acc':>7} {'rtr acc':>7} {'rtr tok%':>8} "
            f"{'cal. ok':>7} {'router p5-p95':>14} {'LODO r/r+c':>11}")
    print(head)
    for r in results:
        s = r["savings_at_98"]
        sp = r["spread_p5_p95"].get("router", [0, 0])
        p = r["policies"]["router"]
        print(f"{r['dataset']:8} {r['ladder']:44} {r['n_questions']:>4} {r['policy_shipped']:>6} "
              f"{100 * s['router']:6.1f}% {100 * s['router+cascade']:6.1f}% {100 * s['learned']:6.1f}% "
              f"{100 * s['length']:6.1f}% {100 * s['random']:6.1f}% {100 * s['oracle']:6.1f}% "
              f"{100 * r['always_top_accuracy']:6.1f}% {100 * p['accuracy']:6.1f}% {100 * p['token_share']:7.1f}% "
              f"{'yes' if p['meets_target'] else 'no':>7} {100 * sp[0]:5.1f}–{100 * sp[1]:4.1f}% "
              f"{100 * r['lodo']['router']:4.0f}/{100 * r['lodo']['router+cascade']:3.0f}%")
    two = [r for r in results if len(r["settings"]) == 2]
    # spread of the eight-ladder mean: each ladder's held-out questions resampled independently
    best_draws = np.mean([np.maximum(r["_draws"]["router"], r["_draws"]["router+cascade"]) for r in two], axis=0)
    router_draws = np.mean([r["_draws"]["router"] for r in two], axis=0)
    for r in results:
        del r["_draws"]
    summary = {
        "mean_best_router_two_tier_p5_p95": p5_p95(best_draws),
        "mean_router_two_tier_p5_p95": p5_p95(router_draws),
        "calibrated_router_meets_98_on_heldout": sum(r["policies"]["router"]["meets_target"] for r in results),
        "calibrated_router_cascade_meets_98_on_heldout": sum(r["policies"]["router+cascade"]["meets_target"]
                                                             for r in results),
        # at the thresholds stored in the file (chosen on validation), not the best point of the held-out curve
        "mean_calibrated_router_cascade_savings_two_tier": round(float(np.mean(
            [1 - r["policies"]["router+cascade"]["token_share"] for r in two])), 4),
        "mean_calibrated_router_savings_two_tier": round(float(np.mean(
            [1 - r["policies"]["router"]["token_share"] for r in two])), 4),
        "mean_best_router_two_tier": round(float(np.mean([r["best_router"] for r in two])), 4),
        "mean_router_two_tier": round(float(np.mean([r["savings_at_98"]["router"] for r in two])), 4),
        "mean_router_cascade_two_tier": round(float(np.mean([r["savings_at_98"]["router+cascade"] for r in two])), 4),
        "mean_random_two_tier": round(float(np.mean([r["savings_at_98"]["random"] for r in two])), 4),
        "mean_length_two_tier": round(float(np.mean([r["savings_at_98"]["length"] for r in two])), 4),
        "mean_oracle_two_tier": round(float(np.mean([r["savings_at_98"]["oracle"] for r in two])), 4),
        "fallback_rule_violations": [
            f"{r['dataset']} {r['ladder']}" for r in results
            if r["best_router"] < max(r["savings_at_98"]["random"], r["savings_at_98"]["length"]) - 0.02],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print("\n" + "  ".join(f"{k}={v}" for k, v in summary.items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"summary": summary, "ladders": results}, indent=1) + "\n")
    print(f"json {args.json}; png {plot(results, args.png)}")


if __name__ == "__main__":
    main()
