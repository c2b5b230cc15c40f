"""Problems -> GRPO dataset rows (conversational prompts + the columns reward functions read).

Row columns: ``prompt`` (``[{"role": "user", "content": …}]``; TRL applies the chat template, whose generation
prompt opens ``<think>``), ``problem_id``, ``question``, ``answer``, ``difficulty``, ``source`` and, with L1 budgets,
``budget_tokens`` (int, tokens; the question then ends with "Think for N tokens."; None for an "unlimited" row).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from training.grpo.config import BudgetPromptConfig, TaskConfig


def problem_rows(problems: Sequence[Any], budget: BudgetPromptConfig | None = None) -> list[dict[str, Any]]:
    """Dataset rows for ``problems`` (objects with id, question, answer, difficulty, source)."""
    rng = random.Random(f"budget-{budget.seed}") if budget and budget.enabled else None
    rows = []
    for p in problems:
        question = str(p.question)
        row: dict[str, Any] = {
            "problem_id": str(p.id),
            "question": question,
            "answer": str(p.answer),
            "difficulty": int(p.difficulty),
            "source": str(p.source),
        }
        if rng is not None and budget is not None:
            n = draw_budget(rng, budget)
            row["budget_tokens"] = n
            if n is not None:
                question = f"{question} {budget.template.format(budget=n)}"
        row["prompt"] = [{"role": "user", "content": question}]
        rows.append(row)
    return rows


def draw_budget(rng: random.Random, budget: BudgetPromptConfig) -> int | None:
    """One prompt's budget in tokens (None = unlimited, with probability ``unlimited_fraction``)."""
    if budget.unlimited_fraction > 0 and rng.random() < budget.unlimited_fraction:
        return None
    if budget.distribution == "log_uniform":
        lo, hi = math.log(budget.min_tokens), math.log(budget.max_tokens + 0.5)
        return min(budget.max_tokens, max(budget.min_tokens, round(math.exp(rng.uniform(lo, hi)))))
    return rng.randint(budget.min_tokens, budget.max_tokens)


L1_EXACT_TEMPLATE = "Think for {budget} tokens."
L1_MAX_TEMPLATE = "Think for maximum {budget} tokens."


def resolve_budget_prompt(budget: BudgetPromptConfig, reward_names: Sequence[str]) -> BudgetPromptConfig:
    """The budget instruction as the L1 paper (arXiv 2503.04697) words it per mode: L1-Max trains on "Think for
    maximum N tokens.", L1-Exact on "Think for N tokens." — the default template is switched to the L1-Max wording
    when ``l1_max`` is among the rewards; a template set in the run file is kept as written."""
    if "l1_max" in reward_names and budget.template == L1_EXACT_TEMPLATE:
        return budget.model_copy(update={"template": L1_MAX_TEMPLATE})
    return budget


def load_problems(task: TaskConfig, split: str, n: int) -> list[Any]:
    """Problems from ``router.tasks.load_task`` (lazy import; owned by the tasks package)."""
    from router.tasks import load_task

    return load_task(task.name, split, n, seed=task.seed, difficulties=task.difficulties)


def data_fingerprint(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str, int | None]]:
    """What identifies the training data for the ledger's data hash: (id, answer, budget) per row."""
    return [(r["problem_id"], r["answer"], r.get("budget_tokens")) for r in rows]
