"""The verifiable tasks: determinism, split disjointness, verifiers and answer extraction on edge cases."""

from __future__ import annotations

import random

import pytest

from router.tasks import Problem, extract_answer, load_task, parse_int, verify
from router.tasks import arithmetic as ar


def test_arith_is_deterministic_per_seed() -> None:
    a = load_task("arith", "test", 60, seed=3)
    b = load_task("arith", "test", 60, seed=3)
    c = load_task("arith", "test", 60, seed=4)
    assert [(p.question, p.answer) for p in a] == [(p.question, p.answer) for p in b]
    assert [p.question for p in a] != [p.question for p in c]


def test_arith_difficulty_is_number_of_operations_and_answer_is_correct() -> None:
    probs = load_task("arith", "train", 90, seed=0, difficulties=[1, 4, 7])
    assert {p.difficulty for p in probs} == {1, 4, 7}
    for p in probs:
        chain: ar.Chain = p.meta["chain"]
        assert len(chain.ops) == p.difficulty
        vals = chain.values()
        assert all(0 <= v <= ar.MAX_VALUE for v in vals)
        # recompute independently of Op.apply
        x = chain.start
        for op in chain.ops:
            x = {"add": x + op.k, "sub": x - op.k, "mul": x * op.k}.get(op.kind, x // op.k if x % op.k == 0 else -1)
        assert str(x) == p.answer
        assert str(chain.start) in p.question and p.question.endswith("?")


def test_train_and_test_never_share_a_problem() -> None:
    train = load_task("arith", "train", 1800, seed=0)
    test = load_task("arith", "heldout", 600, seed=0)
    train_keys = {p.meta["chain"].key() for p in train}
    test_keys = {p.meta["chain"].key() for p in test}
    assert not train_keys & test_keys
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(ar.split_of(p.meta["chain"]) == "test" for p in test)
    # within one held-out set, no duplicates
    assert len(test_keys) == len(test)


def test_split_partition_is_by_content_not_wording() -> None:
    chain = ar.Chain(7, (ar.Op("add", 5), ar.Op("mul", 3)))
    q1 = ar.phrase(chain, random.Random(1))
    q2 = ar.phrase(chain, random.Random(2))
    assert chain.answer == 36
    assert ar.split_of(chain) in ("train", "test")
    p1, p2 = ar.make_problem(chain, q1, "a"), ar.make_problem(chain, q2, "b")
    assert p1.answer == p2.answer == "36"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\n7 + 5 = 12\n</think>\n\nThe answer is 36.", "36"),
        ("</think>\n\nThe answer is -4.", "-4"),
        ("The answer is 1,200.", "1,200"),
        ("no think tag, the answer is 12", "12"),
        ("7 + 5 = 12\n</think>\n\nI think 12 or maybe 13", "13"),
        ("</think>\n\nThe answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("thinking: the answer is 5\n</think>\n\n", None),
        ("", None),
        ("</think>\n\nThe answer is $x^2+1$.", "$x^2+1$"),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_arith_verifier_edge_cases() -> None:
    p = Problem("x", "Start with 7. Add 5, then multiply by 3. What is the result?", "36", 2, "arith")
    assert verify(p, "7 + 5 = 12\n12 * 3 = 36\n</think>\n\nThe answer is 36.")
    assert verify(p, "The answer is 36.")  # vLLM message.content (thought already removed)
    assert verify(p, "</think>\n\nThe answer is 36.0")
    assert not verify(p, "The answer is 36 is 3.")
    assert not verify(p, "12 * 3 = 36\n</think>\n\nThe answer is 35.")  # 36 only inside the thought
    assert not verify(p, "12 * 3 = 36\n</think>\n\n")  # nothing after the thought
    assert not verify(p, "The answer is 360.")
    assert not verify(p, "The answer is 3.6")
    assert parse_int(" $1,200. ") == 1200
    assert parse_int("12/3") is None


def test_gsm8k_loader_and_math_verify() -> None:
    probs = load_task("gsm8k", "test", 5, seed=1)
    assert len(probs) == 5 and all(p.source == "gsm8k" and p.difficulty >= 1 for p in probs)
    p = probs[0]
    assert verify(p, f"...</think>\n\nThe answer is {p.answer}.")
    assert verify(p, f"</think>\n\nSo the total is \\boxed{{{p.answer}}}")
    assert not verify(p, f"</think>\n\nThe answer is {int(p.answer) + 1}.")
    assert load_task("gsm8k", "test", 5, seed=1) == probs
    train_q = {q.question for q in load_task("gsm8k", "train", None)}
    assert not train_q & {q.question for q in load_task("gsm8k", "test", None)}


def test_math_loader_levels_and_latex_equivalence() -> None:
    probs = load_task("math", "test", None, difficulties=[1])
    assert len(probs) == 43 and all(p.difficulty == 1 for p in probs)
    frac = next(p for p in load_task("math", "test", None) if p.answer == "\\frac{1}{2}")
    assert verify(frac, "</think>\n\nThe answer is $\\boxed{0.5}$.")
    assert verify(frac, "</think>\n\nThe answer is \\boxed{\\dfrac12}.")
    assert not verify(frac, "</think>\n\nThe answer is \\boxed{\\frac{1}{3}}.")


def test_unknown_task_and_split_raise() -> None:
    with pytest.raises(ValueError):
        load_task("nope", "test", 1)
    with pytest.raises(ValueError):
        load_task("arith", "validation", 1)
    with pytest.raises(ValueError):
        load_task("arith", "test", None)
