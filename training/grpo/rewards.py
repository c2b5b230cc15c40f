"""Reward functions with TRL's signature, and the registry that builds them from a run config.

Signature (TRL ``GRPOTrainer``): ``reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]``,
one value per rollout; dataset columns (``problem_id``, ``answer``, ``difficulty``, ``budget_tokens`` …) arrive as
list-valued keywords. Each reward is a small callable object with a ``__name__`` (TRL logs ``rewards/<name>/…``),
picklable, holding its parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.grpo.dial_rewards import DialLengthReward
from training.grpo.length_penalties import (
    AlpLengthReward,
    CosineReward,
    DapoOverlongReward,
    KimiLengthReward,
    L1ExactReward,
    L1MaxReward,
)
from training.grpo.reward_utils import THINK_CLOSE, THINK_OPEN, LengthCap, Verifier, completion_text, verify_rows


class CorrectnessReward:
    """Verifiable correctness: R = 1.0 if ``verifier(row, completion)`` else 0.0 (unitless).

    Source: RL with verifiable rewards (DeepSeek-R1, arXiv 2501.12948; Tülu 3 RLVR, arXiv 2411.15124). The verifier
    reads the answer after ``</think>``; a completion that never closes its thought is incorrect, and so is one
    cut by ``cap`` anywhere (its answer after ``</think>`` is unfinished too).
    """

    def __init__(
        self, verifier: Verifier, require_closed_thought: bool = True, wrong: float = 0.0, cap: LengthCap | None = None
    ) -> None:
        self.__name__ = "correctness"
        self.verifier = verifier
        self.require_closed_thought = require_closed_thought
        self.wrong = wrong
        self.cap = cap

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        ok = verify_rows(self.verifier, completions, kwargs, self.require_closed_thought, completion_ids, self.cap)
        return [1.0 if x else self.wrong for x in ok]


def think_format_ok(text: str, require_thought: bool = True) -> bool:
    """True when ``text`` is ``[<think>] thought </think> answer`` with exactly one ``</think>``.

    The chat template's generation prompt already ends with ``<think>\\n``, so the completion starts inside the
    thought; a leading ``<think>`` is tolerated, any other ``<think>`` is not. The answer must be non-empty, and the
    thought too when ``require_thought`` (``<think>\\n\\n</think>`` is the no-thinking form).
    """
    body = text.lstrip()
    if body.startswith(THINK_OPEN):
        body = body[len(THINK_OPEN) :]
    if THINK_OPEN in body or body.count(THINK_CLOSE) != 1:
        return False
    thought, _, answer = body.partition(THINK_CLOSE)
    if not answer.strip():
        return False
    return bool(thought.strip()) or not require_thought


class FormatReward:
    """Think-structure format reward: R = 1.0 if :func:`think_format_ok` else 0.0 (unitless).

    Source: DeepSeek-R1 format reward (arXiv 2501.12948, sec. 2.2.2), adapted to templates that open ``<think>``
    in the prompt.
    """

    def __init__(self, require_thought: bool = True) -> None:
        self.__name__ = "format"
        self.require_thought = require_thought

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        return [1.0 if think_format_ok(completion_text(c), self.require_thought) else 0.0 for c in completions]


@dataclass(frozen=True)
class RewardContext:
    """What factories may need besides their own params (all lengths in tokens)."""

    verifier: Verifier
    max_completion_length: int
    num_generations: int
    eos_token_ids: frozenset[int] | None = None
    require_closed_thought: bool = True  # the policy thinks: no </think> -> wrong (model.thinks)

    @property
    def cap(self) -> LengthCap:
        """The generation cap: a rollout cut by it scores wrong in every correctness-based reward."""
        return LengthCap(self.max_completion_length, self.eos_token_ids)


RewardFactory = Callable[[RewardContext, dict[str, Any]], Callable[..., list[float]]]

REWARD_REGISTRY: dict[str, RewardFactory] = {
    "correctness": lambda ctx, p: CorrectnessReward(
        ctx.verifier, **{"require_closed_thought": ctx.require_closed_thought, "cap": ctx.cap, **p}
    ),
    "format": lambda ctx, p: FormatReward(**p),
    "dapo_overlong": lambda ctx, p: DapoOverlongReward(**{"max_len": ctx.max_completion_length, **p}),
    "cosine": lambda ctx, p: CosineReward(
        ctx.verifier,
        **{
            "max_len": ctx.max_completion_length,
            "eos_token_ids": ctx.eos_token_ids,
            "require_closed_thought": ctx.require_closed_thought,
            **p,
        },
    ),
    "l1_exact": lambda ctx, p: L1ExactReward(**p),
    "l1_max": lambda ctx, p: L1MaxReward(
        ctx.verifier, **{"require_closed_thought": ctx.require_closed_thought, "cap": ctx.cap, **p}
    ),
    "kimi_length": lambda ctx, p: KimiLengthReward(
        ctx.verifier,
        **{"num_generations": ctx.num_generations, "require_closed_thought": ctx.require_closed_thought,
           "cap": ctx.cap, **p},
    ),
    "alp_length": lambda ctx, p: AlpLengthReward(
        ctx.verifier,
        **{
            "norm_tokens": ctx.max_completion_length,
            "num_generations": ctx.num_generations,
            "require_closed_thought": ctx.require_closed_thought,
            "cap": ctx.cap,
            **p,
        },
    ),
    "dial_length": lambda ctx, p: DialLengthReward(**p),  # training/grpo/dial_rewards.py
}
"""name -> factory(ctx, params). ``cosine`` and ``l1_max`` already include correctness."""

INCLUDES_CORRECTNESS = frozenset({"cosine", "l1_max"})


def build_rewards(specs: list[Any], ctx: RewardContext) -> tuple[list[Callable[..., list[float]]], list[float]]:
    """Reward functions and weights from ``RewardSpec``-like objects (``name``, ``weight``, ``params``).

    Raises ValueError naming the reward for an unknown one, or params its factory refuses: an unknown keyword
    (TypeError) or a value out of range (ValueError). The run config builds every reward once at load
    (``training.grpo.config``), so these are config errors before any model loads."""
    funcs, weights = [], []
    for s in specs:
        if s.name not in REWARD_REGISTRY:
            raise ValueError(f"unknown reward {s.name!r}; known: {sorted(REWARD_REGISTRY)}")
        try:
            funcs.append(REWARD_REGISTRY[s.name](ctx, dict(s.params)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"rewards.{s.name}.params: {e}") from e
        weights.append(float(s.weight))
    return funcs, weights
