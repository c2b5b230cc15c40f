"""Verifiable reasoning tasks: one interface for generated and real problems.

Interface (used by the tiny-model recipe, ``thinkgate eval tiers``, the router labeller and GRPO)::

    from router.tasks import Problem, load_task, verify, extract_answer

    probs = load_task("arith", "test", n=120, seed=0, difficulties=[1, 2, 6])
    ok = verify(probs[0], completion_text)   # completion: full text "…</think>\\n\\nThe answer is 36."
                                             # or only the answer (vLLM message.content)

* ``load_task(name, split, n, seed=0, difficulties=None) -> list[Problem]``
  ``name``: ``arith`` (generated chained arithmetic, difficulty = number of operations, default levels 1–6),
  ``gsm8k`` (difficulty = number of calculation steps), ``math`` (difficulty = MATH level 1–5).
  ``split``: ``train`` | ``test`` (``heldout`` is an alias of ``test``). Deterministic per ``seed``; train and
  test never share a problem (``arith``: content-hash partition plus disjoint seed strings; GSM8K/MATH:
  the data sets' own disjoint splits).
* ``verify(problem, completion_text) -> bool``: exact integer match for ``arith``; ``math-verify``
  equivalence for ``gsm8k``/``math``. Only the text after the last ``</think>`` counts.
* ``extract_answer(text) -> str | None``: the final answer string (last ``\\boxed{}``, else after
  "answer is", else the last number), read after the last ``</think>``.

The models in this project answer in the form ``The answer is 36.`` after their thought.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.tasks import arithmetic, datasets
from router.tasks.base import THINK_END, Problem, answer_region, extract_answer, parse_int

TASKS = ("arith", "gsm8k", "math")
_ALIASES = {"heldout": "test", "held-out": "test", "eval": "test"}

__all__ = ["TASKS", "THINK_END", "Problem", "answer_region", "extract_answer", "load_task", "parse_int", "verify"]


def load_task(
    name: str, split: str, n: int | None, seed: int = 0, difficulties: Iterable[int] | None = None
) -> list[Problem]:
    """Load ``n`` problems of task ``name`` and ``split`` (see the module docstring).

    ``n`` may be None for GSM8K/MATH (the whole split); ``arith`` needs an int. Raises ValueError for an
    unknown task or split, FileNotFoundError when a data file under ``data/`` is missing.
    """
    split = _ALIASES.get(split, split)
    if name == "arith":
        if n is None:
            raise ValueError("arith is generated: give n")
        return arithmetic.load(split, n, seed, difficulties)
    if name in ("gsm8k", "math"):
        return datasets.load(name, split, n, seed, difficulties)
    raise ValueError(f"unknown task {name!r}; expected one of {TASKS}")


def verify(problem: Problem, completion_text: str) -> bool:
    """True when ``completion_text`` answers ``problem`` correctly (dispatch on ``problem.source``)."""
    if problem.source == arithmetic.SOURCE:
        return arithmetic.verify(problem, completion_text)
    if problem.source in ("gsm8k", "math"):
        return datasets.verify(problem, completion_text)
    raise ValueError(f"no verifier for source {problem.source!r}")
