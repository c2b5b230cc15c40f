"""Does the dial length term teach budget following? A few CPU GRPO steps on the shipped SFT over-thinker.

Policy: ``models/thinkgate-tiny`` (re-checks every step: 30-120 thinking tokens on one operation with a
budget instruction it never saw). Prompts: one-operation ``arith`` problems with "Think for 16 tokens." The only
weighted reward is ``dial_length`` (training/grpo/dial_rewards.py, cap 8 so that long thoughts still differ);
``correctness`` is computed with weight 0: it would confound the control, since a thought cut at the length cap
scores wrong and correctness alone already shortens the over-thinker's thoughts (measured: 4.8 -> 0.5 relative
error in 8 steps). With the length term's weight set to 0 as well (it is still computed and logged, as
``rewards/dial_length/mean``) mean |thinking − budget| / budget must not fall by the margin; with weight 1 it must.
The whole product path runs (``run_grpo`` → trainer → metrics).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from training.grpo.config import RunConfig, from_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # two GRPO runs of 8 steps on a shared CPU

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "models" / "thinkgate-tiny"
STEPS = 8
BUDGET = 16
MARGIN = 2.5  # fall of the mean relative error |n_think - B| / B, first 2 steps vs last 2 (measured: 3.5 on, 1.25 off)


def cfg(weight: float) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "model": {"path": str(POLICY)},
            "task": {"name": "arith", "n_train": 16, "n_eval": 4, "difficulties": [1]},
            "budget_prompt": {"enabled": True, "min_tokens": BUDGET, "max_tokens": BUDGET},
            "rewards": [
                {"name": "correctness", "weight": 0.0},
                {"name": "dial_length", "weight": weight, "params": {"tokenizer": str(POLICY), "cap": 8.0}},
            ],
            "advantages": {"aggregation": "sum_then_normalize"},
            "dynamic_sampling": {"enabled": False},
            "eval": {"before": False, "after": False},
            "monitors": {"rules": []},
            "trl": {
                "num_generations": 4,
                "per_device_train_batch_size": 16,
                "max_completion_length": 144,
                "learning_rate": 1e-3,
                "lr_scheduler_type": "constant",
                "temperature": 1.0,
                "beta": 0.0,
                "max_steps": STEPS,
                "save_steps": 1000,
                "seed": 0,
            },
        },
    )


def rel_errors(run_dir: Path) -> list[float]:
    """Mean |n_think - B| / B per optimizer step (the logged dial_length reward is its negative)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [-m["rewards/dial_length/mean"] for m in rows if "loss" in m and "rewards/dial_length/mean" in m]


def fall(errors: list[float]) -> float:
    return sum(errors[:2]) / 2 - sum(errors[-2:]) / 2


def run(weight: float, out: Path) -> dict[str, Any]:
    import torch

    from training.grpo.run import run_grpo

    torch.set_num_threads(1)
    return run_grpo(cfg(weight), output_dir=out, progress=False)


def test_length_term_moves_thinking_towards_the_budget(tmp_path: Path) -> None:
    run(1.0, tmp_path)
    e = rel_errors(tmp_path)
    assert len(e) == STEPS
    assert fall(e) > MARGIN, f"mean |n - B| / B did not fall by {MARGIN}: {[round(x, 3) for x in e]}"


def test_without_the_length_term_it_does_not(tmp_path: Path) -> None:
    run(0.0, tmp_path)
    e = rel_errors(tmp_path)
    assert len(e) == STEPS
    assert fall(e) < MARGIN, [round(x, 3) for x in e]  # the assertion above fails without the length term
