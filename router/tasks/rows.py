"""Bridge to the project's verifiable tasks (:mod:`router.tasks`): question rows (labelled items from them:
:func:`router.fit.labels.items_from_rows`).

A question row (input of ``thinkgate router label gateway``) is
``{"id", "question", "answer", "task", "difficulty", "group"}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from router.tasks.base import Problem

#: arith levels used when none are given (the task's default 1–6 plus 7, one step past the training curriculum)
ARITH_LEVELS = (1, 2, 3, 4, 5, 6, 7)


def task_rows(
    task: str, split: str, n: int | None, seed: int = 0, levels: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """Problems of ``task``/``split`` as question rows.

    ``arith``: up to ``n`` (default 100) problems per level in ``levels`` (default :data:`ARITH_LEVELS`),
    ids ``<task id>/ops<level>``; a level whose distinct-problem space is smaller (1 operation has a few
    hundred) gives what it has, found by halving the request. ``gsm8k``/``math``: ``n`` problems (None = the
    whole split), optionally only
    ``levels``. Deterministic per ``seed``. Raises ValueError/FileNotFoundError from the task loader.
    """
    from router.tasks import load_task

    problems: list[Problem] = []
    if task == "arith":
        per = n or 100
        for d in levels or ARITH_LEVELS:
            k = per
            while True:
                try:
                    # ids restart at 0 for each load: make them unique across levels
                    problems.extend(
                        replace(p, id=f"{p.id}/ops{d}")
                        for p in load_task("arith", split, n=k, seed=seed, difficulties=[d])
                    )
                    break
                except RuntimeError:  # this level's space is exhausted before k distinct problems
                    if k <= 1:
                        raise
                    k //= 2
    else:
        problems = load_task(task, split, n=n, seed=seed, difficulties=levels)
    return [
        {
            "id": p.id,
            "question": p.question,
            "answer": p.answer,
            "task": p.source,
            "difficulty": p.difficulty,
            "group": str(p.meta.get("subject", "")) if isinstance(p.meta, dict) else "",
        }
        for p in problems
    ]

