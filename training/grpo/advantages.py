"""Multi-reward GRPO advantages and per-group signal metrics.

Rows are prompt-major: ``rewards_per_func`` has shape (B, K) with B = n_groups * G, the G rollouts of a group
adjacent (TRL's order). Rewards may be NaN (a reward function returned None); means/stds ignore NaN, a row NaN in
every reward gets advantage 0. Std uses Bessel's correction, as TRL's ``nanstd``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["sum_then_normalize", "decoupled"]
Scale = Literal["group", "batch", "none"]


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample standard deviation (Bessel-corrected) ignoring NaN; NaN where fewer than 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    var = torch.where(count > 1, var, torch.full_like(var, float("nan")))
    out = var.sqrt()
    return out if keepdim or dim is None else out.squeeze(dim)


@dataclass
class AdvantageResult:
    """``advantages`` (B,); ``group_has_signal`` (n_groups,) bool: the group's advantages are not all equal;
    ``component_zero_std`` (n_groups, K) bool: reward k is constant within the group."""

    advantages: torch.Tensor
    group_has_signal: torch.Tensor
    component_zero_std: torch.Tensor


def compute_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    aggregation: Aggregation = "sum_then_normalize",
    scale: Scale = "group",
    epsilon: float = 1e-4,
) -> AdvantageResult:
    """GRPO advantages from several rewards. Units: rewards are unitless (length penalties already in reward units).

    ``sum_then_normalize`` (GRPO, DeepSeekMath arXiv 2402.03300; ``scale="none"`` is Dr. GRPO, arXiv 2503.20783):
        r_i = sum_k w_k r_ik;  A_i = (r_i - mean_g(r)) / (std_g(r) + eps)   (std over the batch for scale="batch",
        no division for scale="none").
    ``decoupled`` (GDPO, arXiv 2601.05242; TRL ``multi_objective_aggregation="normalize_then_sum"``):
        a_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + eps);  s_i = sum_k w_k a_ik;
        A_i = (s_i - mean_batch(s)) / (std_batch(s) + eps).
    Summing first maps distinct reward combinations to the same advantage (a group with sums [2, 0] and one with
    [1, 0] both give [+0.707, -0.707]); decoupling keeps them apart.

    Signal: a group "has signal" when max - min of its advantages exceeds 1e-6 — the same test in both modes
    (TRL's ``frac_reward_zero_std`` in normalize_then_sum mode looks at the batch std, not the groups).
    """
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be (B, K), got {tuple(rewards_per_func.shape)}")
    b, k = rewards_per_func.shape
    g = num_generations
    if g < 1 or b % g:
        raise ValueError(f"batch of {b} rows is not a multiple of num_generations={g}")
    r = rewards_per_func.float()
    w = weights.to(r).reshape(1, k)
    unscorable = torch.isnan(r).all(dim=1)

    if aggregation == "sum_then_normalize":
        total = (r * w).nansum(dim=1)
        total[unscorable] = float("nan")
        grouped = total.view(-1, g)
        centred = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
        if scale == "group":
            std = nanstd(grouped, dim=1, keepdim=True).expand(-1, g).reshape(-1)
            adv = centred / (std + epsilon)
        elif scale == "batch":
            adv = centred / (nanstd(total) + epsilon)
        elif scale == "none":
            adv = centred
        else:
            raise ValueError(f"unknown scale {scale!r}")
    elif aggregation == "decoupled":
        grouped = r.view(-1, g, k)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        norm = ((grouped - mean_k) / (std_k + epsilon)).view(b, k)
        s = (norm * w).nansum(dim=1)
        s[unscorable] = float("nan")
        adv = (s - torch.nanmean(s)) / (nanstd(s) + epsilon)
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")

    adv = torch.nan_to_num(adv, nan=0.0)
    ga = adv.view(-1, g)
    has_signal = (ga.max(dim=1).values - ga.min(dim=1).values) > 1e-6
    rg = r.view(-1, g, k)
    filled = torch.nan_to_num(rg, nan=0.0)
    component_zero_std = (filled.max(dim=1).values - filled.min(dim=1).values) <= 1e-12
    return AdvantageResult(adv, has_signal, component_zero_std)


def collapsed_pair_fraction(rewards_per_func: torch.Tensor, advantages: torch.Tensor, tol: float = 1e-3) -> float:
    """Share of rollout pairs with *different* reward vectors but (within ``tol``) the *same* advantage.

    The reward-collapse diagnostic of GDPO (arXiv 2601.05242): such pairs are pushed equally hard although their
    outcomes differ. Unitless in [0, 1]; 0.0 when no pair has different reward vectors. O(B^2) in the batch size.
    """
    r = torch.nan_to_num(rewards_per_func.float(), nan=float("inf"))
    a = advantages.float().reshape(-1)
    differ = (r.unsqueeze(0) != r.unsqueeze(1)).any(dim=-1)
    same_adv = (a.unsqueeze(0) - a.unsqueeze(1)).abs() < tol
    upper = torch.triu(torch.ones_like(differ), diagonal=1)
    n_differ = int((differ & upper).sum())
    if n_differ == 0:
        return 0.0
    return int((differ & same_adv & upper).sum()) / n_differ
