"""The dial format: a thought that fills a requested thinking budget, for budget-conditioned training.

Prompt: the question followed by :data:`BUDGET_TEMPLATE` (``"Think for 128 tokens."``, the L1-Exact wording of
``training/grpo/data.py``); no instruction means *unlimited* (the model writes the plain terse chain).

Thought (between ``<think>\\n`` and ``</think>``), for a budget of ``B`` tokens of the tiny tokenizer:

* steps of exactly :data:`LINE_TOKENS` (10) tokens, each opening with the **budget left** as three digits and a
  colon, then ``a op k b`` with the values zero-padded to two digits: ``128:07+007`` (the start value as an
  identity step), one step per operation ``118:07+512`` (7 + 5 = 12), then, once the chain is done, identity
  steps on the answer ``098:36+036``; no separator between steps (the counter is one);
* when fewer than 10 tokens are left, a countdown of single digits ``76543210`` (one token each) uses them up,
  so that ``</think>`` is the ``B+1``-th thought token.

Why this shape: a 1.7M-parameter model cannot count 300 positions, but it can copy the budget, subtract 10 from a
three-digit number (the tens digit goes down by one) and count down digits — the counter makes hitting the budget
a local decision at every line. When the budget is too small for the whole chain the thought stops where the
budget does and the answer is the model's best guess (as under budget forcing), so accuracy grows with ``B``.
Values are zero-padded so that every line has the same token count (digits are single tokens).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.stats import percentile
from router.tasks.arithmetic import Chain

BUDGET_TEMPLATE = "Think for {budget} tokens."
LINE_TOKENS = 10
#: largest budget the three-digit counter can state
MAX_BUDGET = 999


def budget_instruction(budget: int | None) -> str:
    """The instruction appended to the question (``""`` for unlimited)."""
    return "" if budget is None else BUDGET_TEMPLATE.format(budget=budget)


def with_budget(question: str, budget: int | None) -> str:
    """``question`` with the dial budget instruction appended (unchanged when ``budget`` is None)."""
    return question if budget is None else f"{question} {budget_instruction(budget)}"


def _contents(chain: Chain) -> list[str]:
    v = chain.values()
    out = [f"{v[0]:02d}+0{v[0]:02d}"]  # the start value as an identity step
    out += [f"{v[i]:02d}{o.symbol}{o.k}{v[i + 1]:02d}" for i, o in enumerate(chain.ops)]
    return out


def dial_thought(chain: Chain, budget: int) -> str:
    """The thought text for ``chain`` that is exactly ``budget`` tiny-tokenizer tokens long (see module doc).

    Raises ValueError outside ``0 <= budget <= MAX_BUDGET``."""
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in [0, {MAX_BUDGET}], got {budget}")
    contents = _contents(chain)
    recap = f"{chain.answer:02d}+0{chain.answer:02d}"
    parts = []
    left, i = budget, 0
    while left >= LINE_TOKENS:
        parts.append(f"{left:03d}:{contents[i] if i < len(contents) else recap}")
        left -= LINE_TOKENS
        i += 1
    parts.append("".join(str(d) for d in range(left - 1, -1, -1)))
    return "".join(parts)


def log_uniform_budget(rng: random.Random, lo: int, hi: int) -> int:
    """A budget drawn log-uniformly from ``[lo, hi]`` tokens (integers; both ends included)."""
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got {lo}, {hi}")
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi + 0.5))))))


@dataclass(frozen=True)
class BudgetDraw:
    """Per-prompt budgets: log-uniform over ``[min_tokens, max_tokens]``, or unlimited with ``unlimited``."""

    min_tokens: int = 8
    max_tokens: int = 320
    unlimited: float = 0.15

    def draw(self, rng: random.Random) -> int | None:
        """One budget in tokens, or None (unlimited)."""
        if rng.random() < self.unlimited:
            return None
        return log_uniform_budget(rng, self.min_tokens, self.max_tokens)


def within_tolerance(tokens: int, budget: int) -> bool:
    """The adherence rule of ``thinkgate eval dial``: within ±10% of ``budget``, or ±4 tokens for budgets ≤ 32."""
    tol = 4.0 if budget <= 32 else 0.1 * budget
    return abs(tokens - budget) <= tol + 1e-9


def adherence(lengths: Sequence[int], budget: int) -> dict[str, float]:
    """Adherence of thought lengths (tokens) to one requested ``budget`` (tokens).

    Returns ``{"within_10pct", "mean_rel_error", "p90_rel_error"}``: the share within :func:`within_tolerance`, and
    the mean and 90th percentile (nearest rank) of ``|length - budget| / budget``. Raises ValueError when empty
    or ``budget < 1``."""
    if not lengths:
        raise ValueError("no lengths")
    if budget < 1:
        raise ValueError("budget must be >= 1")
    rel = [abs(n - budget) / budget for n in lengths]
    return {
        "within_10pct": sum(within_tolerance(n, budget) for n in lengths) / len(lengths),
        "mean_rel_error": sum(rel) / len(rel),
        "p90_rel_error": percentile(rel, 90, math.nan),
    }
