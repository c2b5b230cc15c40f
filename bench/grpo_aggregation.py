"""Experiment 3: correctness + length rewards, sum-then-normalise vs decoupled (GDPO) advantages — the collapse
(rollouts with different reward vectors given the same advantage) and its effect on accuracy and length.

    .venv/bin/python bench/grpo_aggregation.py [--config training/configs/bench.yaml] [--steps N] [--write-results]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import bench.grpo_common as gc
from training.grpo.config import AdvantageConfig, RewardSpec

REWARDS = [RewardSpec("correctness", 1.0), RewardSpec("format", 0.2), RewardSpec("kimi_length", 0.5)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(gc.ROOT / "training" / "configs" / "bench.yaml"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=str(gc.ROOT / "runs" / "bench" / "aggregation"))
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()

    base = gc.load_base(a.config)
    if a.steps:
        base.trl["max_steps"] = a.steps
    results = {}
    for mode in ("sum_then_normalize", "decoupled"):
        cfg = gc.variant(base, run_name=f"agg-{mode}", rewards=REWARDS, advantages=AdvantageConfig(aggregation=mode))
        print(f"== {mode}", flush=True)
        results[mode] = gc.run_variant(cfg, Path(a.out) / mode)

    rows = []
    for mode, r in results.items():
        s, m = r["summary"], r["metrics"]
        rows.append(
            [
                mode,
                gc.mean_metric(m, "advantages/collapsed_pair_frac"),
                gc.mean_metric(m, "signal/effective_ratio"),
                gc.mean_metric(m, "frac_reward_zero_std"),
                f"{s['accuracy_before']:.3f} → {s['accuracy_after']:.3f}",
                gc.before_after_tokens(r),
                s["train_wall_s"],
            ]
        )
    table = gc.md_table(
        [
            "advantages",
            "collapsed pairs (mean/step)",
            "effective-signal ratio (per group)",
            "TRL frac_reward_zero_std",
            "held-out accuracy",
            "completion tokens",
            "train wall s",
        ],
        rows,
    )
    fig = gc.plot_lines(
        gc.FIGURES / "grpo_aggregation.png",
        "Collapsed pairs per step",
        "optimizer step",
        "share of pairs",
        [
            (
                mode,
                [x["step"] for x in r["metrics"]],
                [x.get("advantages/collapsed_pair_frac", 0.0) for x in r["metrics"]],
            )
            for mode, r in results.items()
        ],
    )
    body = (
        f"`bench/grpo_aggregation.py` — {gc.environment_line(base)} Rewards: correctness ×1, format ×0.2, "
        f"Kimi length ×0.5. *Collapsed pairs*: share of rollout pairs in a batch whose reward vectors differ but "
        f"whose advantages are equal (±1e-3). TRL's `frac_reward_zero_std` is batch-level in decoupled mode; the "
        f"per-group ratio is ours.\n\n{table}\n\n![collapse](results/{fig.name})"
    )
    print(body)
    if a.write_results:
        gc.write_subsection("Sum-then-normalise vs decoupled advantages (experiment 3)", body)


if __name__ == "__main__":
    main()
