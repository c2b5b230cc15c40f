"""Answer checkers for gateway-measured labels, by name: ``verify(item, completion_text) -> bool``.

``item`` is one input row of ``thinkgate router label gateway`` (a dict with at least ``question`` and
``answer``). Built-in names:

* ``task`` — the project's task interface (:func:`router.tasks.verify`): the row's ``task`` field
  (``arith`` | ``gsm8k`` | ``math``) picks exact integer match or math-verify equivalence.
* ``math`` — math-verify equivalence of the reference ``answer`` and the completion's final answer
  (:func:`router.tasks.extract_answer`: last ``\\boxed{}``, else after "answer is", else the last number).
* ``int`` — exact integer match of that final answer.
* ``exact`` — whitespace/case-normalised string equality of that final answer.
* ``module:function`` — any importable callable with the same signature (plug in your own).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from router.errors import require

Verifier = Callable[[dict[str, Any], str], bool]


def _final(text: str) -> str | None:
    from router.tasks import extract_answer

    return extract_answer(text)


def verify_math(item: dict[str, Any], completion: str) -> bool:
    """math-verify equivalence of ``item["answer"]`` and the completion's final answer."""
    mv = require("math_verify", "eval", "checking math answers")
    parse, verify = mv.parse, mv.verify

    got = _final(completion)
    if got is None:
        return False
    ref = str(item["answer"])
    gold = parse(f"${ref}$") or parse(ref)
    pred = parse(f"${got}$") or parse(got)
    return bool(gold and pred and verify(gold, pred))


def verify_int(item: dict[str, Any], completion: str) -> bool:
    """Exact integer equality (``"1,200"``, ``"$36"``, ``"36.0"`` parse as integers)."""
    from router.tasks import parse_int

    want = parse_int(str(item["answer"]))
    return want is not None and parse_int(_final(completion)) == want


def verify_exact(item: dict[str, Any], completion: str) -> bool:
    """Case- and whitespace-insensitive equality of the final answer with ``item["answer"]``."""
    got = _final(completion)
    return got is not None and " ".join(got.split()).lower() == " ".join(str(item["answer"]).split()).lower()


def verify_task(item: dict[str, Any], completion: str) -> bool:
    """:func:`router.tasks.verify` on a :class:`router.tasks.Problem` rebuilt from the row."""
    from router.tasks import Problem, verify

    problem = Problem(
        id=str(item.get("id", "")),
        question=str(item["question"]),
        answer=str(item["answer"]),
        difficulty=int(item.get("difficulty") or 0),
        source=str(item.get("task") or item.get("source") or ""),
    )
    return bool(verify(problem, completion))


BUILTIN: dict[str, Verifier] = {"task": verify_task, "math": verify_math, "int": verify_int, "exact": verify_exact}


def get_verifier(name: str) -> Verifier:
    """A built-in verifier by name, or ``"package.module:function"``. Raises ValueError when not found."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"verifier {name!r} not importable: {exc}") from None
        if not callable(fn):
            raise ValueError(f"verifier {name!r} is not callable")
        return fn
    raise ValueError(f"unknown verifier {name!r}; built-ins: {sorted(BUILTIN)} or 'module:function'")
