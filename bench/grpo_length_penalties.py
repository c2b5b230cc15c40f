"""Experiment 1: GRPO without a length penalty vs each length penalty — held-out accuracy and mean completion /
thought tokens per difficulty bucket, and the training cost of each run.

    .venv/bin/python bench/grpo_length_penalties.py [--config training/configs/bench.yaml] [--steps N]
        [--variants none,dapo_overlong,...] [--write-results]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import bench.grpo_common as gc
from training.grpo.config import BudgetPromptConfig, RewardSpec

FORMAT = RewardSpec("format", 0.2)
CORRECT = RewardSpec("correctness", 1.0)


def variants(max_len: int) -> dict[str, dict]:
    budget = BudgetPromptConfig(enabled=True, min_tokens=max(8, max_len // 8), max_tokens=max_len // 2)
    return {
        "none": {"rewards": [CORRECT, FORMAT]},
        "dapo_overlong": {"rewards": [CORRECT, FORMAT, RewardSpec("dapo_overlong", 1.0, {"cache": max_len // 2})]},
        "cosine": {"rewards": [RewardSpec("cosine", 0.1), FORMAT]},  # 0.1: its range is [-10, 2]
        "l1_exact": {
            "rewards": [CORRECT, FORMAT, RewardSpec("l1_exact", 1.0, {"alpha": 0.01})],
            "budget_prompt": budget,
        },
        "l1_max": {"rewards": [RewardSpec("l1_max", 1.0, {"alpha": 0.01}), FORMAT], "budget_prompt": budget},
        "kimi_length": {"rewards": [CORRECT, FORMAT, RewardSpec("kimi_length", 0.5)]},
        "alp_length": {"rewards": [CORRECT, FORMAT, RewardSpec("alp_length", 1.0, {"beta": 0.5})]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(gc.ROOT / "training" / "configs" / "bench.yaml"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=str(gc.ROOT / "runs" / "bench" / "length"))
    ap.add_argument("--variants", default=None, help="comma-separated subset")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--section", default="Length penalties (experiment 1)", help="RESULTS.md subsection title")
    ap.add_argument("--figure", default="grpo_length_penalties.png", help="PNG name under bench/results/")
    a = ap.parse_args()

    base = gc.load_base(a.config)
    if a.steps:
        base.trl["max_steps"] = a.steps
    max_len = int(base.trl_kwargs()["max_completion_length"])
    todo = variants(max_len)
    if a.variants:
        todo = {k: v for k, v in todo.items() if k in a.variants.split(",")}
    results = {}
    for name, change in todo.items():
        cfg = gc.variant(base, run_name=f"length-{name}", **change)
        print(f"== {name}", flush=True)
        results[name] = gc.run_variant(cfg, Path(a.out) / name)
        s = results[name]["summary"]
        print(
            f"   acc {s['accuracy_before']} -> {s['accuracy_after']}, "
            f"tokens {results[name]['after']['overall']['mean_completion_tokens']:.1f}, "
            f"{results[name]['wall_s']:.0f} s",
            flush=True,
        )

    header = ["variant", "difficulty", "accuracy", "mean completion tokens", "mean thought tokens", "truncated"]
    rows = []
    first = next(iter(results.values()))
    rows += gc.per_difficulty_rows("SFT model (no GRPO)", first["before"])
    for name, r in results.items():
        rows += gc.per_difficulty_rows(name, r["after"])
    overall = gc.md_table(
        [
            "variant",
            "accuracy before → after",
            "completion tokens before → after",
            "sampled tokens",
            "train wall s",
            "spent USD",
        ],
        [
            [
                n,
                f"{r['summary']['accuracy_before']:.3f} → {r['summary']['accuracy_after']:.3f}",
                gc.before_after_tokens(r),
                r["summary"]["totals"]["sampled_tokens"],
                r["summary"]["train_wall_s"],
                r["summary"]["spent_usd"],
            ]
            for n, r in results.items()
        ],
    )
    fig = gc.plot_lines(
        gc.FIGURES / a.figure,
        "Held-out mean completion length during GRPO",
        "optimizer step",
        "tokens",
        [
            (n, [h["step"] for h in r["heldout"]], [h["mean_completion_tokens"] for h in r["heldout"]])
            for n, r in results.items()
            if r["heldout"]
        ],
    )
    body = (
        f'`bench/grpo_length_penalties.py` — {gc.environment_line(base)} The L1 variants add "Think for N tokens." '
        f"to every prompt (N uniform in the configured range), also at evaluation, so their before/after rows are on "
        f"those prompts.\n\n{overall}\n\nPer difficulty after training:\n\n{gc.md_table(header, rows)}\n\n"
        f"![held-out length](results/{fig.name})"
    )
    print(body)
    if a.write_results:
        gc.write_subsection(a.section, body)


if __name__ == "__main__":
    main()
