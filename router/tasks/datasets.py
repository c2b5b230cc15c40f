"""Loaders for the real math data sets (GSM8K, MATH), with ``math-verify`` checking (extra ``eval``).

The test splits ship in the wheel as package data (``router/tasks/data/{gsm8k,math}/test.jsonl``, read with
``importlib.resources``); the train splits are large and live only in a source checkout
(``data/{gsm8k,math}/train.jsonl.gz``). Sources and licences: the ``NOTICE.md`` beside each file
(openai/grade-school-math, MIT; MATH via PRM800K splits, MIT).

Difficulty: GSM8K has no level, so it is the number of ``<<calc>>`` annotations in the reference solution
(≈ arithmetic steps, capped at 8); MATH uses its level 1–5 (0 when the source says ``Level ?``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any

from router.errors import require
from router.jsonl import read_jsonl
from router.tasks.base import Problem, answer_region, extract_answer

#: The train splits: in a source checkout only (``<repo>/data``), not in the wheel.
REPO_DATA_DIR = Path(__file__).resolve().parents[2] / "data"


def data_file(name: str, split: str) -> Path:
    """The file of ``name`` (gsm8k | math) ``split`` (test: package data; train: ``<repo>/data``).

    Raises ValueError for an unknown split and FileNotFoundError (saying where it comes from) when missing.
    """
    if name not in ("gsm8k", "math") or split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r} for {name!r}; expected train|test")
    if split == "test":
        path = Path(str(files("router.tasks").joinpath("data", name, "test.jsonl")))
    else:
        path = REPO_DATA_DIR / name / "train.jsonl.gz"
    if not path.is_file():
        where = ("it ships with the package: reinstall thinkgate" if split == "test" else
                 "the train splits are not in the wheel: run from a source checkout (see data/"
                 f"{name}/NOTICE.md)")
        raise FileNotFoundError(f"{path} is missing; {where}")
    return path


@lru_cache(maxsize=8)
def _all(name: str, split: str) -> tuple[Problem, ...]:
    path = data_file(name, split)
    out: list[Problem] = []
    for i, rec in enumerate(read_jsonl(path)):
        if name == "gsm8k":
            solution, _, final = rec["answer"].rpartition("####")
            answer = final.strip().replace(",", "")
            level = min(8, max(1, solution.count("<<")))
            out.append(
                Problem(f"gsm8k/{split}/{i}", rec["question"], answer, level, "gsm8k", {"solution": solution.strip()})
            )
        else:
            level = rec.get("level")
            out.append(
                Problem(
                    f"math/{rec['unique_id']}",
                    rec["problem"],
                    rec["answer"],
                    int(level) if level is not None else 0,
                    "math",
                    {"subject": rec["subject"], "solution": rec["solution"]},
                )
            )
    return tuple(out)


def load(
    name: str, split: str, n: int | None, seed: int = 0, difficulties: Iterable[int] | None = None
) -> list[Problem]:
    """Up to ``n`` problems (all when None) of GSM8K or MATH ``split``, shuffled by ``seed``.

    ``difficulties`` keeps only those levels. Raises FileNotFoundError when the data file is missing.
    """
    items = list(_all(name, split))
    if difficulties is not None:
        keep = set(difficulties)
        items = [p for p in items if p.difficulty in keep]
    random.Random(f"{name}|{split}|{seed}").shuffle(items)
    return items if n is None else items[:n]


def _mv_parse(text: str) -> list[Any]:
    return list(require("math_verify", "eval", "checking math answers").parse(text))


def verify(problem: Problem, completion: str) -> bool:
    """``math-verify`` equivalence of the answer after the last ``</think>`` and the reference.

    The gold answer is parsed as LaTeX (``$answer$``). The prediction is parsed from the answer region (boxed
    or last expression); if that yields nothing, from :func:`extract_answer`'s string.
    """
    mv_verify = require("math_verify", "eval", "checking math answers").verify
    gold = _mv_parse(f"${problem.answer}$") or _mv_parse(problem.answer)
    if not gold:
        return False
    region = answer_region(completion)
    candidates = [_mv_parse(region)]
    extracted = extract_answer(completion)
    if extracted:
        candidates.append(_mv_parse(f"${extracted}$"))
        if re.fullmatch(r"-?[\d,]+(?:\.\d+)?", extracted):
            candidates.append(_mv_parse(extracted.replace(",", "")))
    return any(pred and mv_verify(gold, pred) for pred in candidates)
