"""Does the trainer learn? A small learnable setting on the tiny random-init model, at a fixed seed, on CPU.

The reward is the share of completion tokens whose id is in the lowest quarter of the vocabulary
(``low_token_share``): about 0.25 for the untrained policy, rising towards 1.0 when GRPO works. It is a real TRL
reward registered in ``REWARD_REGISTRY`` (the registry is the extension point for rewards), so the whole product path
runs: ``run_grpo`` -> ``ThinkGateGRPOTrainer`` -> ledger, metrics. Each learning test has a negative control (the
trainer's advantages zeroed) that must *not* reach the margin, so the margin cannot be met by chance.

Also: invariants of the dynamic-sampling merge (every kept rollout keeps its own prompt, completion, rewards and
advantage; every rolled-out rollout is either trained or counted as dropped in the ledger).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.toy_problems import PROBLEMS
from training.grpo.config import MonitorRule, RunConfig, from_dict
from training.grpo.reward_utils import exact_answer_verifier
from training.grpo.rewards import REWARD_REGISTRY

pytestmark = pytest.mark.slow

STEPS = 12  # optimizer steps
MARGIN = 0.30  # mean reward of the last 2 logged steps must exceed that of the first 2 by this much
G = 4




class LowTokenShare:
    """Share of completion tokens with id < ``bound`` (tokens; TRL reward signature)."""

    def __init__(self, bound: int) -> None:
        self.__name__ = "low_token_share"
        self.bound = bound

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kw: Any
    ) -> list[float]:
        return [sum(t < self.bound for t in ids) / max(1, len(ids)) for ids in completion_ids]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def bound(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    from transformers import AutoTokenizer

    b = len(AutoTokenizer.from_pretrained(tiny)) // 4
    monkeypatch.setitem(REWARD_REGISTRY, "low_token_share", lambda ctx, p: LowTokenShare(**p))
    return b


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger's optimizer-step rows (not the start-up / finish rows)."""
    rows = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind", "step") == "step"]


def learn_cfg(model: Path, bound: int, dynamic: bool) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "model": {"path": str(model)},
            "rewards": [{"name": "low_token_share", "params": {"bound": bound}}],
            # dynamic sampling filters on accuracy: "solved" = at least half the tokens are low
            "advantages": {"pass_reward": "low_token_share", "pass_threshold": 0.5},
            "dynamic_sampling": {"enabled": dynamic, "max_rounds": 3},
            "eval": {"before": False, "after": False},
            "monitors": {"rules": []},
            "trl": {
                "num_generations": G,
                "per_device_train_batch_size": 16,
                "max_completion_length": 8,
                "learning_rate": 3e-2,
                "lr_scheduler_type": "constant",
                "max_steps": STEPS,
                "save_steps": 1000,
                "seed": 0,
            },
        },
    )


def run(cfg: RunConfig, out: Path) -> dict[str, Any]:
    from training.grpo.run import run_grpo

    return run_grpo(
        cfg,
        output_dir=out,
        verifier=exact_answer_verifier,
        train_problems=PROBLEMS,
        eval_problems=PROBLEMS[:2],
        progress=False,
    )


def rewards_per_step(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["reward"] for m in lines if "loss" in m and "reward" in m]


def rise(rewards: list[float]) -> float:
    return sum(rewards[-2:]) / 2 - sum(rewards[:2]) / 2


def zero_advantages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the trainer's advantages replaced by zeros (no policy gradient)."""
    from training.grpo import trainer as trainer_mod

    real = trainer_mod.compute_advantages

    def zeroed(*a: Any, **kw: Any) -> Any:
        res = real(*a, **kw)
        res.advantages = torch.zeros_like(res.advantages)
        return res

    monkeypatch.setattr(trainer_mod, "compute_advantages", zeroed)


@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic_sampling"])
def test_mean_reward_rises_within_12_steps(tiny: Path, bound: int, tmp_path: Path, dynamic: bool) -> None:
    s = run(learn_cfg(tiny, bound, dynamic), tmp_path)
    r = rewards_per_step(tmp_path)
    if dynamic and s["global_step"] < STEPS:  # learned until every group was solved: DAPO's filter stops cleanly
        assert "all solved" in s["stop_reason"] and s["global_step"] >= 5, (s["stop_reason"], r)
    else:
        assert s["global_step"] == STEPS and len(r) == STEPS
    assert rise(r) > MARGIN, f"mean reward did not rise by {MARGIN}: {[round(x, 3) for x in r]}"


@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic_sampling"])
def test_control_with_zeroed_advantages_does_not_rise(
    tiny: Path, bound: int, tmp_path: Path, dynamic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    zero_advantages(monkeypatch)
    run(learn_cfg(tiny, bound, dynamic), tmp_path)
    r = rewards_per_step(tmp_path)
    assert rise(r) < MARGIN / 2, [round(x, 3) for x in r]


def test_dynamic_sampling_merge_keeps_each_rollout_whole(
    tiny: Path, bound: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every trained row: its completion's recomputed reward equals the reward row it carries, its prompt is its
    group's prompt, its advantage is compute_advantages of the merged rewards; the ledger's rollouts = trained rows
    + dropped rollouts."""
    from transformers import AutoTokenizer

    from training.grpo.advantages import compute_advantages
    from training.grpo.trainer import ThinkGateGRPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny)
    seen: list[dict[str, Any]] = []
    real = ThinkGateGRPOTrainer._dynamic_generate_and_score

    def observe(self: ThinkGateGRPOTrainer, inputs: list[dict[str, Any]], g: int) -> dict[str, Any]:
        out = real(self, inputs, g)
        seen.append(
            {
                "batch": {k: v for k, v in out.items()},
                "rewards": self.last_batch_rewards.clone(),
                "pids": list(self.last_batch_problem_ids),
            }
        )
        return out

    monkeypatch.setattr(ThinkGateGRPOTrainer, "_dynamic_generate_and_score", observe)
    cfg = learn_cfg(tiny, bound, dynamic=True)
    cfg.trl["max_steps"] = 4
    run(cfg, tmp_path)
    assert len(seen) == 4
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("dynamic_sampling/rounds", 0) > 1 for m in metrics), "no refill happened: the test is vacuous"
    prompts = {f"t{i}": p for i, p in enumerate(PROBLEMS)}
    reward = LowTokenShare(bound)
    for step in seen:
        b, rewards, pids = step["batch"], step["rewards"], step["pids"]
        n = b["completion_ids"].size(0)
        assert rewards.shape == (n, 1) and len(pids) == n
        for i in range(n):
            ids = b["completion_ids"][i][b["completion_mask"][i].bool()].tolist()
            assert reward([None], [None], [ids])[0] == pytest.approx(rewards[i, 0].item()), f"row {i}"
            prompt = tok.decode(b["prompt_ids"][i][b["prompt_mask"][i].bool()].tolist())
            assert prompts[pids[i]].question in prompt, f"row {i}: prompt of {pids[i]} expected"
        for j in range(0, n, G):
            assert len(set(pids[j : j + G])) == 1  # a group is one prompt
        expected = compute_advantages(rewards, torch.ones(1), G, "sum_then_normalize", "group", 1e-4).advantages
        assert torch.allclose(b["advantages"].cpu(), expected, atol=1e-6)
    rows = step_rows(tmp_path)
    assert sum(r["dropped_rollouts"] for r in rows) > 0
    for r in rows:
        assert r["rollouts"] == 16 + r["dropped_rollouts"], r  # trained + dropped = rolled out
        assert r["zero_signal_rollouts"] >= r["dropped_rollouts"]


def test_early_stop_on_heldout_drop_publishes_the_best_checkpoint(tiny: Path, bound: int, tmp_path: Path) -> None:
    """Held-out 'accuracy' = a sampled completion has 25-75% low tokens: it rises while training pushes the share
    up from ~0.25, then falls when the share passes 0.75. The drop_from_best rule stops the run and model/ holds the
    weights of the best periodic check, not the last ones."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)

    def window(row: Any, text: str) -> bool:
        ids = tok.encode(text, add_special_tokens=False)
        share = sum(t < bound for t in ids) / max(1, len(ids))
        return 0.25 <= share <= 0.75

    cfg = learn_cfg(tiny, bound, dynamic=False)
    cfg.model.thinks = False
    cfg.eval.every_steps = 2
    cfg.eval.max_new_tokens = 8
    cfg.eval.temperature, cfg.eval.samples = 1.0, 4  # seeded sampling: the greedy output of a random model repeats
    cfg.eval.after = True
    cfg.monitors.rules = [
        MonitorRule("heldout_drop", "heldout/accuracy", "drop_from_best", 0.2, patience=1, action="stop")
    ]
    cfg.trl["max_steps"] = 30
    from training.grpo.run import run_grpo

    s = run_grpo(
        cfg, output_dir=tmp_path, verifier=window, train_problems=PROBLEMS, eval_problems=PROBLEMS, progress=False
    )
    heldout = [json.loads(x) for x in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    accs = [h["accuracy"] for h in heldout]
    best_i = accs.index(max(accs))
    assert "heldout_drop" in (s["stop_reason"] or ""), (s["stop_reason"], accs)
    assert s["global_step"] < 30 and s["published_step"] == heldout[best_i]["step"] < s["global_step"]
    assert s["best_heldout"] == {"step": heldout[best_i]["step"], "accuracy": max(accs)}
    assert s["accuracy_after"] == pytest.approx(max(accs))  # model/ is the best model, evaluated on the same set
    best = load_file(tmp_path / "best" / "model.safetensors")
    published = load_file(tmp_path / "model" / "model.safetensors")
    assert all(torch.equal(best[k], published[k]) for k in best)
