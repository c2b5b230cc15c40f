"""The dial length term: L1-Exact on **thinking** tokens against the budget requested in the prompt.

Why Exact, not Max: the dial model is asked to *fill* a budget (``thinkgate eval dial`` scores |thinking tokens −
budget| both ways, ±10%), and the gateway keeps forcing as the hard stop above it; L1-Max only punishes going
over, so under it the policy drifts short of small budgets and nothing pulls it up to large ones. Why relative:
budgets span 8–320 tokens; an absolute |n − B| (the paper's alpha·|n_gold − n_y|) would weigh a 10% miss at 320
forty times one at 8, while the adherence target is relative. Why thinking tokens, not the completion length:
the answer after ``</think>`` (≈ 10 tokens) is not part of the budget the gateway meters as reasoning tokens.

    R_len = -min(cap, |n_think - B| / B)        (0 for rows without a budget: "unlimited")

Added to ``correctness`` (weight in the run file). ``n_think``: completion tokens before the first ``</think>``
token (all of them when the thought never closes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from training.grpo.reward_utils import THINK_CLOSE, token_lengths
from training.models import TINY_MODEL_DIR

DEFAULT_TOKENIZER = str(TINY_MODEL_DIR)


def thinking_tokens(ids: Sequence[int], close_id: int) -> int:
    """Tokens before the first ``close_id`` in ``ids`` (``len(ids)`` when absent)."""
    for i, t in enumerate(ids):
        if t == close_id:
            return i
    return len(ids)


def dial_length_penalty(n_think: int, budget: int | None, cap: float = 1.0) -> float:
    """``-min(cap, |n_think - budget| / budget)``; 0.0 when ``budget`` is None (unlimited). Tokens."""
    if budget is None:
        return 0.0
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    return -min(cap, abs(n_think - budget) / budget)


def close_token_id(tokenizer_path: str) -> int:
    """The id of ``</think>`` in the tokenizer at ``tokenizer_path`` (a model directory)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    tid = tok.convert_tokens_to_ids(THINK_CLOSE)
    if not isinstance(tid, int) or tid == tok.unk_token_id:
        raise ValueError(f"{tokenizer_path}: no single {THINK_CLOSE} token")
    return tid


class DialLengthReward:
    """TRL reward: :func:`dial_length_penalty` per rollout against the ``budget_tokens`` column (additive).

    ``close_id``: the ``</think>`` token id; or ``tokenizer``: a model directory to read it from (default: the
    tiny models' shared tokenizer, ``models/thinkgate-tiny``)."""

    def __init__(self, close_id: int | None = None, tokenizer: str | None = None, cap: float = 1.0) -> None:
        self.__name__ = "dial_length"
        if close_id is None:
            close_id = close_token_id(tokenizer or DEFAULT_TOKENIZER)
        self.close_id, self.cap = int(close_id), cap

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        n = len(completions)
        token_lengths(completion_ids, n)  # validates presence and shape
        budgets = kwargs.get("budget_tokens")
        if budgets is None or len(budgets) != n:
            raise ValueError("dial_length needs the budget_tokens column (budget_prompt.enabled: true)")
        return [
            dial_length_penalty(thinking_tokens(ids, self.close_id), None if b is None else int(b), self.cap)
            for ids, b in zip(completion_ids, budgets, strict=True)
        ]
