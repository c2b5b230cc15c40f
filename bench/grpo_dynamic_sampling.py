"""Experiment 2: dynamic sampling on vs off — effective-signal ratio, sampled tokens and wall time to reach a
target held-out accuracy.

    .venv/bin/python bench/grpo_dynamic_sampling.py [--config training/configs/bench.yaml] [--steps N]
        [--target 0.5] [--write-results]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import bench.grpo_common as gc
from training.grpo.config import DynamicSamplingConfig


def reach(heldout: list[dict], target: float) -> tuple[int | None, int | None, float | None]:
    """(step, cumulative sampled tokens, cumulative train wall s) at the first evaluation >= target."""
    for h in heldout:
        if h["accuracy"] >= target:
            return h["step"], h.get("cum_sampled_tokens"), (h.get("cum_wall_ms") or 0) / 1000
    return None, None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(gc.ROOT / "training" / "configs" / "bench.yaml"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--target", type=float, default=None, help="held-out accuracy to reach (default: before + 0.05)")
    ap.add_argument("--out", default=str(gc.ROOT / "runs" / "bench" / "dynamic"))
    ap.add_argument("--write-results", action="store_true")
    a = ap.parse_args()

    base = gc.load_base(a.config)
    if a.steps:
        base.trl["max_steps"] = a.steps
    results = {}
    for name, enabled in (("off", False), ("on", True)):
        ds = DynamicSamplingConfig(enabled=enabled, max_rounds=4, oversample=1.5)
        cfg = gc.variant(base, run_name=f"dynamic-{name}", dynamic_sampling=ds)
        print(f"== dynamic sampling {name}", flush=True)
        results[name] = gc.run_variant(cfg, Path(a.out) / name)

    before = results["off"]["summary"]["accuracy_before"]
    target = a.target if a.target is not None else round(before + 0.05, 3)
    rows = []
    for name, r in results.items():
        s = r["summary"]
        step, toks, wall = reach(r["heldout"], target)
        rows.append(
            [
                name,
                gc.mean_metric(r["metrics"], "signal/effective_ratio"),
                gc.mean_metric(r["metrics"], "signal/batch_effective_ratio"),
                s["totals"]["rollouts"],
                s["totals"]["sampled_tokens"],
                s["totals"]["trained_tokens"],
                s["totals"]["dropped_rollouts"],
                s["train_wall_s"],
                f"{s['accuracy_before']:.3f} → {s['accuracy_after']:.3f}",
                step,
                toks,
                wall,
            ]
        )
    table = gc.md_table(
        [
            "dynamic sampling",
            "effective-signal ratio (rolled out)",
            "signal ratio (trained batch)",
            "rollouts",
            "sampled tokens",
            "trained tokens",
            "dropped rollouts",
            "train wall s",
            "held-out accuracy",
            f"step reaching {target:.2f}",
            "sampled tokens to reach",
            "train wall s to reach",
        ],
        rows,
    )
    fig = gc.plot_lines(
        gc.FIGURES / "grpo_dynamic_sampling.png",
        "Held-out accuracy vs sampled tokens",
        "cumulative sampled tokens",
        "accuracy",
        [
            (f"dynamic {n}", [h["cum_sampled_tokens"] for h in r["heldout"]], [h["accuracy"] for h in r["heldout"]])
            for n, r in results.items()
        ],
    )
    body = (
        f"`bench/grpo_dynamic_sampling.py` — {gc.environment_line(base)} Same steps and batch size; with dynamic "
        f"sampling on, zero-variance groups are dropped and refilled (up to 4 rounds, oversample 1.5).\n\n"
        f"{table}\n\n![accuracy vs tokens](results/{fig.name})"
    )
    print(body)
    if a.write_results:
        gc.write_subsection("Dynamic sampling (experiment 2)", body)


if __name__ == "__main__":
    main()
