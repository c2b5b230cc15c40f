"""Multi-reward advantages against a worked example (GDPO's collapse), plus the per-group signal metric."""

from __future__ import annotations

import math

import pytest
import torch

from training.grpo.advantages import collapsed_pair_fraction, compute_advantages, nanstd

EPS = 1e-4
# Worked example, G = 2, rewards (correctness, length_ok):
#   group 1: (1, 1) and (0, 0)  -> sums 2, 0
#   group 2: (1, 0) and (0, 0)  -> sums 1, 0
REWARDS = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
W = torch.tensor([1.0, 1.0])


def test_sum_then_normalize_collapses_distinct_combinations() -> None:
    res = compute_advantages(REWARDS, W, 2, "sum_then_normalize", "group", EPS)
    # group 1: (2 - 1) / (std([2, 0]) + eps) = 1 / (sqrt(2) + 1e-4); group 2: 0.5 / (sqrt(0.5) + 1e-4)
    a1 = 1 / (math.sqrt(2) + EPS)  # 0.707057
    a2 = 0.5 / (math.sqrt(0.5) + EPS)  # 0.707007
    assert res.advantages.tolist() == pytest.approx([a1, -a1, a2, -a2], abs=1e-6)
    # (1, 1) and (1, 0) get the same advantage (to 1e-4): one collapsed pair out of the five pairs whose reward
    # vectors differ ((0,1), (0,2), (0,3), (1,2), (2,3); rows 1 and 3 are both (0, 0)).
    assert collapsed_pair_fraction(REWARDS, res.advantages) == pytest.approx(1 / 5)


def test_decoupled_keeps_combinations_apart() -> None:
    res = compute_advantages(REWARDS, W, 2, "decoupled", "group", EPS)
    c = 0.5 / (math.sqrt(0.5) + EPS)  # each varying reward normalised within its group: +-0.707007
    s = [2 * c, -2 * c, c, -c]  # group 2's second reward is constant -> contributes 0
    sd = math.sqrt(sum(x * x for x in s) / 3)  # batch mean is 0; Bessel-corrected std = 1.290812
    expected = [x / (sd + EPS) for x in s]  # [1.095360, -1.095360, 0.547680, -0.547680]
    assert res.advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert res.advantages[0].item() == pytest.approx(1.0953603, abs=1e-6)
    assert collapsed_pair_fraction(REWARDS, res.advantages) == 0.0


def test_signal_metric_is_per_group_in_both_modes() -> None:
    # group 1 all equal (1, 1), (1, 1): no signal; group 2 varies.
    r = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    for mode in ("sum_then_normalize", "decoupled"):
        res = compute_advantages(r, W, 2, mode, "group", EPS)
        assert res.group_has_signal.tolist() == [False, True], mode
        assert res.advantages[:2].tolist() == [0.0, 0.0], mode  # the flat group is not pushed anywhere
        assert res.component_zero_std.tolist() == [[True, True], [False, True]]
    # TRL's normalize_then_sum flags zero std on the *batch* std of the summed normalised rewards, which is
    # non-zero here, so its frac_reward_zero_std would read 0.0 while one group of two carries no signal.
    grouped = r.view(-1, 2, 2)
    norm = (grouped - grouped.mean(1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + EPS)
    batch_std = nanstd(norm.view(4, 2).sum(1))
    assert batch_std.item() > 0


def test_scale_batch_and_none() -> None:
    r = torch.tensor([[3.0], [1.0], [2.0], [2.0]])
    w = torch.tensor([1.0])
    none = compute_advantages(r, w, 2, "sum_then_normalize", "none", EPS)
    assert none.advantages.tolist() == [1.0, -1.0, 0.0, 0.0]  # Dr. GRPO: centred only
    batch = compute_advantages(r, w, 2, "sum_then_normalize", "batch", EPS)
    sd = math.sqrt(((3 - 2) ** 2 + (1 - 2) ** 2 + 0 + 0) / 3)  # batch std of [3, 1, 2, 2] = 0.8165
    assert batch.advantages.tolist() == pytest.approx([1 / (sd + EPS), -1 / (sd + EPS), 0.0, 0.0], abs=1e-6)
    assert batch.group_has_signal.tolist() == [True, False]


def test_weights_apply() -> None:
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # weights (1, 0.5): sums 1.0 and 0.5 -> +-0.25 / (std([1, .5]) + eps)
    res = compute_advantages(r, torch.tensor([1.0, 0.5]), 2, "sum_then_normalize", "group", EPS)
    a = 0.25 / (math.sqrt(0.125) + EPS)
    assert res.advantages.tolist() == pytest.approx([a, -a], abs=1e-6)
    # equal weights: (1, 0) and (0, 1) sum to the same value -> no signal in sum mode
    flat = compute_advantages(r, torch.tensor([1.0, 1.0]), 2, "sum_then_normalize", "group", EPS)
    assert flat.group_has_signal.tolist() == [False]


def test_unscorable_row_gets_zero_advantage() -> None:
    nan = float("nan")
    r = torch.tensor([[1.0], [0.0], [nan], [1.0]])
    res = compute_advantages(r, torch.tensor([1.0]), 2, "sum_then_normalize", "group", EPS)
    assert res.advantages[2].item() == 0.0
    assert res.advantages[3].item() == 0.0  # the only scorable row of its group has nothing to compare with
    assert res.advantages[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + EPS), abs=1e-6)


def test_shape_errors() -> None:
    with pytest.raises(ValueError):
        compute_advantages(torch.zeros(3, 1), torch.ones(1), 2)
    with pytest.raises(ValueError):
        compute_advantages(torch.zeros(4), torch.ones(1), 2)
    with pytest.raises(ValueError):
        compute_advantages(torch.zeros(4, 1), torch.ones(1), 2, "nope")  # type: ignore[arg-type]


# -- scale-carrying rewards (ALP's solve-rate factor, L1's alpha) ----------------------------------------------------
def _easy_and_hard(mode: str, scale: str, beta: float = 0.5) -> tuple[float, float]:
    """Advantage gap between the shortest and longest of two equally-correct rollouts, in an easy group (4/4 solved)
    and a hard group (1/4 solved), with correctness + ALP (beta 0.5, N 100), same lengths in both groups."""
    from training.grpo.length_penalties import alp_penalties

    lengths = [10, 40, 25, 25]
    easy_c, hard_c = [True, True, True, True], [False, False, False, True]
    rows = []
    for correct in (easy_c, hard_c):
        pen = alp_penalties(lengths, correct, beta, 100)
        rows += [[float(c), p] for c, p in zip(correct, pen, strict=True)]
    res = compute_advantages(torch.tensor(rows), torch.tensor([1.0, 1.0]), 4, mode, scale, EPS)  # type: ignore[arg-type]
    a = res.advantages.tolist()
    return a[0] - a[1], a[4] - a[5]  # rows 0/1 easy (both correct), rows 4/5 hard (both wrong)


@pytest.mark.parametrize("scale", ["batch", "none"])
def test_alp_easy_and_hard_groups_get_different_pushes(scale: str) -> None:
    easy, hard = _easy_and_hard("sum_then_normalize", scale)
    assert easy > 0 and hard > 0
    assert easy / hard == pytest.approx(4.0, rel=1e-3)  # max(1, 1/4) / max(1/4, 1/4): ALP's solve-rate factor
    assert _easy_and_hard("sum_then_normalize", scale, beta=0.05)[0] < easy / 5  # beta acts


@pytest.mark.parametrize(("mode", "scale"), [("decoupled", "group"), ("sum_then_normalize", "group")])
def test_cancelling_aggregations_push_easy_and_hard_alike_and_are_refused(mode: str, scale: str) -> None:
    from training.grpo.config import ConfigError, RunConfig, from_dict, validate

    easy, hard = _easy_and_hard(mode, scale)
    # the penalty's size no longer matters in the easy group (a tenth of beta, the same push): beta and the
    # solve-rate factor are inert there -- why the config refuses these
    assert _easy_and_hard(mode, scale, beta=0.05)[0] == pytest.approx(easy, rel=0.03)  # (eps: 1e-4)
    if mode == "decoupled":
        assert easy == pytest.approx(hard, rel=0.05)  # and easy and hard groups get the same push
    data = {"rewards": [{"name": "correctness"}, {"name": "alp_length"}], "advantages": {"aggregation": mode}}
    with pytest.raises(ConfigError, match="cancels ALP's solve-rate scaling"):
        validate(from_dict(RunConfig, data))
    ok = {"rewards": data["rewards"], "advantages": {"aggregation": "sum_then_normalize", "scale": "batch"}}
    validate(from_dict(RunConfig, ok))


def test_l1_exact_alpha_is_refused_with_decoupled() -> None:
    from training.grpo.config import ConfigError, RunConfig, from_dict, validate

    data = {
        "rewards": [{"name": "correctness"}, {"name": "l1_exact", "params": {"alpha": 0.01}}],
        "budget_prompt": {"enabled": True},
        "advantages": {"aggregation": "decoupled"},
    }
    with pytest.raises(ConfigError, match="L1-Exact's alpha"):
        validate(from_dict(RunConfig, data))
    data["advantages"] = {"aggregation": "sum_then_normalize"}  # alpha weighs the budget error against correctness
    validate(from_dict(RunConfig, data))
