"""Length penalties in tokens, as TRL reward functions, plus the per-rollout formulas they apply.

Additive penalties return only the penalty term (combine with the ``correctness`` reward): DAPO soft overlong,
L1-Exact, Kimi k1.5 group-relative length reward, ALP. Non-additive forms return the paper's whole reward (they
already contain correctness; use them *instead of* ``correctness``): cosine, L1-Max.

Length ``L`` is the completion length in tokens as sampled (``len(completion_ids[i])``, EOS included when it was
generated). Group-relative penalties group rows by ``problem_id`` (see :func:`reward_utils.group_indices`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from training.grpo.reward_utils import LengthCap, Verifier, group_indices, token_lengths, verify_rows

# ---------------------------------------------------------------------------------------------------------------------
# formulas (one rollout or one group)


def dapo_overlong_penalty(length: int, max_len: int, cache: int) -> float:
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13), tokens.

    R(L) = 0                               if L <= L_max - L_cache
         = ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max
         = -1                              if L > L_max
    """
    if cache <= 0 or cache > max_len:
        raise ValueError(f"need 0 < cache <= max_len, got cache={cache}, max_len={max_len}")
    start = max_len - cache
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / cache
    return -1.0


def cosine_reward(
    length: int,
    correct: bool,
    truncated: bool,
    max_len: int,
    r0_correct: float = 2.0,
    rl_correct: float = 1.0,
    r0_wrong: float = -10.0,
    rl_wrong: float = 0.0,
    r_exceed: float = -10.0,
) -> float:
    """Cosine length-scaled reward (Yeo et al., arXiv 2502.03373, sec. 4.1), tokens.

    R = r_exceed                                         if truncated (hit the generation cap unfinished)
      = r_L + (r_0 - r_L) * (1 + cos(pi * L / L_max)) / 2  otherwise,
    with (r_0, r_L) = (r0_correct, rl_correct) when correct, else (r0_wrong, rl_wrong): the reward at length 0
    is r_0 and at L_max is r_L. Paper defaults: correct 2.0 -> 1.0 (shorter is better), wrong -10.0 -> 0.0
    (longer wrong answers are punished less), exceed -10.0.
    """
    if truncated:
        return r_exceed
    r0, rl = (r0_correct, rl_correct) if correct else (r0_wrong, rl_wrong)
    t = min(length, max_len)
    return rl + (r0 - rl) * (1.0 + math.cos(math.pi * t / max_len)) / 2.0


def l1_exact_penalty(length: int, budget: int, alpha: float = 0.0003) -> float:
    """L1 LCPO-Exact length term (Aggarwal & Welleck, arXiv 2503.04697, eq. 1), tokens.

    The paper's reward is 1[correct] - alpha * |n_gold - n_y|; this returns the penalty -alpha * |n_gold - n_y|
    (add ``correctness``). ``budget`` = n_gold, the N of "Think for N tokens." in the prompt.
    """
    return -alpha * abs(budget - length)


def l1_max_reward(length: int, budget: int, correct: bool, alpha: float = 0.0003, delta: float = 0.5) -> float:
    """L1 LCPO-Max reward (arXiv 2503.04697, eq. 2), tokens: 1[correct] * clip(alpha * (n_gold - n_y) + delta, 0, 1).

    Whole reward (contains correctness). Under budget a correct answer earns between delta and 1.
    """
    if not correct:
        return 0.0
    return min(1.0, max(0.0, alpha * (budget - length) + delta))


def kimi_length_rewards(lengths: Sequence[int], correct: Sequence[bool]) -> list[float]:
    """Kimi k1.5 length reward for one group (arXiv 2501.12599, sec. 2.3.3), tokens.

    lambda_i = 0.5 - (L_i - min_L) / (max_L - min_L) over the group's rollouts;
    reward_i = lambda_i if correct_i else min(0, lambda_i). An all-equal-length group gets 0 (no length signal).
    """
    if len(lengths) != len(correct):
        raise ValueError("lengths and correct differ in size")
    if not lengths:
        return []
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    out = []
    for n, c in zip(lengths, correct, strict=True):
        lam = 0.5 - (n - lo) / (hi - lo)
        out.append(lam if c else min(0.0, lam))
    return out


def alp_penalties(lengths: Sequence[int], correct: Sequence[bool], beta: float, norm_tokens: int) -> list[float]:
    """Adaptive Length Penalty for one group (Xiang et al., arXiv 2506.05256, eq. 1), tokens.

    The paper's reward is 1[correct] - (beta / N) * max(p_solved, 1/K) * L; this returns the penalty
    -(beta / N) * max(p_solved, 1/K) * L with p_solved the group's solve rate over its K rollouts and N =
    ``norm_tokens``. Easy prompts (high p) pay more per token; never-solved prompts pay the floor 1/K.
    """
    if len(lengths) != len(correct):
        raise ValueError("lengths and correct differ in size")
    k = len(lengths)
    if k == 0:
        return []
    if norm_tokens <= 0:
        raise ValueError("norm_tokens must be > 0")
    p = sum(bool(c) for c in correct) / k
    scale = beta / norm_tokens * max(p, 1.0 / k)
    return [-scale * n for n in lengths]


# ---------------------------------------------------------------------------------------------------------------------
# TRL reward functions


def _truncated(ids: Sequence[int], max_len: int, eos_token_ids: frozenset[int] | None) -> bool:
    return LengthCap(max_len, eos_token_ids).cut(ids)


class DapoOverlongReward:
    """TRL reward: :func:`dapo_overlong_penalty` per rollout (additive, in [-1, 0])."""

    def __init__(self, max_len: int, cache: int | None = None) -> None:
        self.__name__ = "dapo_overlong"
        self.max_len = max_len
        self.cache = cache if cache is not None else max(1, max_len // 4)
        dapo_overlong_penalty(0, self.max_len, self.cache)  # validate

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        return [
            dapo_overlong_penalty(n, self.max_len, self.cache) for n in token_lengths(completion_ids, len(completions))
        ]


class CosineReward:
    """TRL reward: :func:`cosine_reward` (whole reward; replaces correctness)."""

    def __init__(
        self,
        verifier: Verifier,
        max_len: int,
        eos_token_ids: frozenset[int] | None = None,
        r0_correct: float = 2.0,
        rl_correct: float = 1.0,
        r0_wrong: float = -10.0,
        rl_wrong: float = 0.0,
        r_exceed: float = -10.0,
        require_closed_thought: bool = True,
    ) -> None:
        self.__name__ = "cosine"
        self.verifier, self.max_len, self.eos = verifier, max_len, eos_token_ids
        self.require_closed_thought = require_closed_thought
        self.params = dict(
            r0_correct=r0_correct, rl_correct=rl_correct, r0_wrong=r0_wrong, rl_wrong=rl_wrong, r_exceed=r_exceed
        )

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        lengths = token_lengths(completion_ids, len(completions))
        ok = verify_rows(self.verifier, completions, kwargs, self.require_closed_thought)
        return [
            cosine_reward(n, c, _truncated(ids, self.max_len, self.eos), self.max_len, **self.params)
            for n, c, ids in zip(lengths, ok, completion_ids, strict=True)
        ]


def _budgets(kwargs: dict[str, Any], n: int) -> list[int]:
    budgets = kwargs.get("budget_tokens")
    if budgets is None or len(budgets) != n or any(b is None for b in budgets):
        raise ValueError("L1 rewards need the budget_tokens column (budget_prompt.enabled: true)")
    return [int(b) for b in budgets]


class L1ExactReward:
    """TRL reward: :func:`l1_exact_penalty` against the ``budget_tokens`` column (additive)."""

    def __init__(self, alpha: float = 0.0003) -> None:
        self.__name__ = "l1_exact"
        self.alpha = alpha

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        lengths = token_lengths(completion_ids, len(completions))
        return [
            l1_exact_penalty(n, b, self.alpha) for n, b in zip(lengths, _budgets(kwargs, len(lengths)), strict=True)
        ]


class L1MaxReward:
    """TRL reward: :func:`l1_max_reward` against the ``budget_tokens`` column (whole reward)."""

    def __init__(
        self,
        verifier: Verifier,
        alpha: float = 0.0003,
        delta: float = 0.5,
        require_closed_thought: bool = True,
        cap: LengthCap | None = None,
    ) -> None:
        self.__name__ = "l1_max"
        self.verifier, self.alpha, self.delta = verifier, alpha, delta
        self.require_closed_thought, self.cap = require_closed_thought, cap

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        lengths = token_lengths(completion_ids, len(completions))
        ok = verify_rows(self.verifier, completions, kwargs, self.require_closed_thought, completion_ids, self.cap)
        budgets = _budgets(kwargs, len(lengths))
        return [l1_max_reward(n, b, c, self.alpha, self.delta) for n, b, c in zip(lengths, budgets, ok, strict=True)]


class _GroupReward:
    """Base for rewards computed per group (rows grouped by ``problem_id``, else chunks of ``num_generations``)."""

    def __init__(
        self,
        verifier: Verifier,
        num_generations: int | None,
        require_closed_thought: bool = True,
        cap: LengthCap | None = None,
    ) -> None:
        self.verifier, self.num_generations = verifier, num_generations
        self.require_closed_thought, self.cap = require_closed_thought, cap

    def _group(self, lengths: list[int], ok: list[bool]) -> list[float]:
        raise NotImplementedError

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        n = len(completions)
        lengths = token_lengths(completion_ids, n)
        ok = verify_rows(self.verifier, completions, kwargs, self.require_closed_thought, completion_ids, self.cap)
        out = [0.0] * n
        for idx in group_indices(n, kwargs.get("problem_id"), self.num_generations):
            for i, v in zip(idx, self._group([lengths[i] for i in idx], [ok[i] for i in idx]), strict=True):
                out[i] = v
        return out


class KimiLengthReward(_GroupReward):
    """TRL reward: :func:`kimi_length_rewards` per group (additive, in [-0.5, 0.5])."""

    def __init__(
        self,
        verifier: Verifier,
        num_generations: int | None = None,
        require_closed_thought: bool = True,
        cap: LengthCap | None = None,
    ) -> None:
        super().__init__(verifier, num_generations, require_closed_thought, cap)
        self.__name__ = "kimi_length"

    def _group(self, lengths: list[int], ok: list[bool]) -> list[float]:
        return kimi_length_rewards(lengths, ok)


class AlpLengthReward(_GroupReward):
    """TRL reward: :func:`alp_penalties` per group (additive, <= 0)."""

    def __init__(
        self,
        verifier: Verifier,
        norm_tokens: int,
        beta: float = 0.5,
        num_generations: int | None = None,
        require_closed_thought: bool = True,
        cap: LengthCap | None = None,
    ) -> None:
        super().__init__(verifier, num_generations, require_closed_thought, cap)
        self.__name__ = "alp_length"
        self.beta, self.norm_tokens = beta, norm_tokens

    def _group(self, lengths: list[int], ok: list[bool]) -> list[float]:
        return alp_penalties(lengths, ok, self.beta, self.norm_tokens)
