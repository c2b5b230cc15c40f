"""Reward functions against hand-computed values, including edge cases (empty, truncated, all-equal group)."""

from __future__ import annotations

import math

import pytest

from training.grpo.config import RewardSpec
from training.grpo.length_penalties import (
    AlpLengthReward,
    CosineReward,
    DapoOverlongReward,
    KimiLengthReward,
    L1ExactReward,
    L1MaxReward,
    alp_penalties,
    cosine_reward,
    dapo_overlong_penalty,
    kimi_length_rewards,
    l1_exact_penalty,
    l1_max_reward,
)
from training.grpo.reward_utils import exact_answer_verifier, group_indices, split_thought, token_lengths
from training.grpo.rewards import REWARD_REGISTRY, CorrectnessReward, FormatReward, RewardContext, build_rewards


def ids(n: int, eos: int | None = None) -> list[int]:
    """A fake completion of n tokens (the last one EOS when given)."""
    body = [5] * n
    if eos is not None and n:
        body[-1] = eos
    return body


# -- DAPO soft overlong (L_max=20, L_cache=5: penalty starts after 15 tokens) ------------------------------------
@pytest.mark.parametrize(
    ("length", "expected"), [(0, 0.0), (15, 0.0), (16, -0.2), (18, -0.6), (20, -1.0), (21, -1.0), (100, -1.0)]
)
def test_dapo_overlong_values(length: int, expected: float) -> None:
    assert dapo_overlong_penalty(length, 20, 5) == pytest.approx(expected)


def test_dapo_overlong_rejects_bad_cache() -> None:
    with pytest.raises(ValueError):
        dapo_overlong_penalty(3, 10, 0)
    with pytest.raises(ValueError):
        DapoOverlongReward(max_len=10, cache=11)


def test_dapo_reward_fn_uses_token_ids_not_characters() -> None:
    fn = DapoOverlongReward(max_len=20, cache=5)
    # The text is long in characters but short in tokens: only token ids count.
    out = fn(prompts=["p"] * 3, completions=["x" * 500, "", "y"], completion_ids=[ids(16), ids(0), ids(20)])
    assert out == pytest.approx([-0.2, 0.0, -1.0])
    assert fn.__name__ == "dapo_overlong"


def test_length_rewards_refuse_missing_completion_ids() -> None:
    with pytest.raises(ValueError, match="completion_ids"):
        DapoOverlongReward(max_len=20)(prompts=["p"], completions=["c"])


# -- cosine (L_max = 10, paper defaults) ---------------------------------------------------------------------------
def test_cosine_values() -> None:
    assert cosine_reward(0, True, False, 10) == pytest.approx(2.0)  # correct, shortest: r0_correct
    assert cosine_reward(5, True, False, 10) == pytest.approx(1.5)  # cos(pi/2) = 0: midpoint
    assert cosine_reward(10, True, False, 10) == pytest.approx(1.0)  # at L_max: rL_correct
    assert cosine_reward(2, True, False, 10) == pytest.approx(1 + (1 + math.cos(0.2 * math.pi)) / 2)  # 1.9045
    assert cosine_reward(5, False, False, 10) == pytest.approx(-5.0)
    assert cosine_reward(0, False, False, 10) == pytest.approx(-10.0)  # empty wrong answer: worst wrong
    assert cosine_reward(10, False, False, 10) == pytest.approx(0.0)
    assert cosine_reward(10, True, True, 10) == pytest.approx(-10.0)  # truncated: r_exceed even if "correct"


def test_cosine_fn_truncation_needs_cap_without_eos() -> None:
    fn = CosineReward(exact_answer_verifier, max_len=10, eos_token_ids=frozenset({1}))
    comps = ["a</think>7", "a</think>7", "a</think>3", ""]
    cids = [ids(10, eos=1), ids(10), ids(5, eos=1), []]
    out = fn(prompts=["p"] * 4, completions=comps, completion_ids=cids, answer=["7", "7", "7", "7"])
    # 1: ended with EOS exactly at the cap -> not truncated, correct -> 1.0; 2: hit the cap unfinished -> -10;
    # 3: wrong at 5 tokens -> -5; 4: empty -> wrong at length 0 -> -10.
    assert out == pytest.approx([1.0, -10.0, -5.0, -10.0])


# -- L1 (budget n_gold = 50) ---------------------------------------------------------------------------------------
def test_l1_exact_values() -> None:
    assert l1_exact_penalty(30, 50, alpha=0.01) == pytest.approx(-0.2)
    assert l1_exact_penalty(70, 50, alpha=0.01) == pytest.approx(-0.2)  # symmetric: over and under both cost
    assert l1_exact_penalty(50, 50, alpha=0.01) == 0.0
    assert l1_exact_penalty(0, 50) == pytest.approx(-0.015)  # paper alpha 0.0003, empty completion


def test_l1_max_values() -> None:
    assert l1_max_reward(30, 50, True, alpha=0.01) == pytest.approx(0.7)
    assert l1_max_reward(80, 50, True, alpha=0.01) == pytest.approx(0.2)
    assert l1_max_reward(150, 50, True, alpha=0.01) == 0.0  # clipped at 0
    assert l1_max_reward(0, 50, True, alpha=0.01) == 1.0  # clipped at 1
    assert l1_max_reward(10, 50, False, alpha=0.01) == 0.0  # wrong answers earn nothing


def test_l1_fns_read_budget_column() -> None:
    exact = L1ExactReward(alpha=0.01)
    assert exact(
        prompts=["p", "p"], completions=["a", "b"], completion_ids=[ids(30), ids(55)], budget_tokens=[50, 50]
    ) == pytest.approx([-0.2, -0.05])
    mx = L1MaxReward(exact_answer_verifier, alpha=0.01)
    out = mx(
        prompts=["p", "p"],
        completions=["x</think>4", "x</think>5"],
        completion_ids=[ids(30), ids(30)],
        budget_tokens=[50, 50],
        answer=["4", "4"],
    )
    assert out == pytest.approx([0.7, 0.0])
    with pytest.raises(ValueError, match="budget_tokens"):
        exact(prompts=["p"], completions=["a"], completion_ids=[ids(3)])


# -- Kimi k1.5 group-relative --------------------------------------------------------------------------------------
def test_kimi_values() -> None:
    out = kimi_length_rewards([10, 20, 30, 40], [True, True, False, False])
    assert out == pytest.approx([0.5, 0.5 - 1 / 3, -(0.5 - 1 / 3), -0.5])
    # A wrong answer never earns a positive length reward: min(0, lambda).
    assert kimi_length_rewards([10, 40], [False, True]) == pytest.approx([0.0, -0.5])
    # All-equal group: no length signal.
    assert kimi_length_rewards([7, 7, 7], [True, False, True]) == [0.0, 0.0, 0.0]
    assert kimi_length_rewards([], []) == []


def test_kimi_fn_groups_by_problem_id_not_position() -> None:
    fn = KimiLengthReward(exact_answer_verifier, num_generations=2)
    # Rows of problems a and b interleaved: adjacency would pair (a, b); problem_id pairs them correctly.
    comps = ["x</think>1", "x</think>2", "x</think>1", "x</think>2"]
    out = fn(
        prompts=["p"] * 4,
        completions=comps,
        completion_ids=[ids(10), ids(10), ids(30), ids(50)],
        problem_id=["a", "b", "a", "b"],
        answer=["1", "2", "1", "2"],
    )
    # group a: lengths 10, 30 (both correct) -> 0.5, -0.5; group b: 10, 50 -> 0.5, -0.5
    assert out == pytest.approx([0.5, 0.5, -0.5, -0.5])


def test_kimi_fn_without_ids_uses_consecutive_groups() -> None:
    fn = KimiLengthReward(exact_answer_verifier, num_generations=2)
    out = fn(
        prompts=["p"] * 4,
        completions=["x</think>1"] * 4,
        completion_ids=[ids(10), ids(20), ids(5), ids(5)],
        answer=["1"] * 4,
    )
    assert out == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_group_indices() -> None:
    assert group_indices(4, ["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    assert group_indices(4, None, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        group_indices(5, None, 2)
    with pytest.raises(ValueError):
        group_indices(4)


# -- ALP -----------------------------------------------------------------------------------------------------------
def test_alp_values() -> None:
    # p_solved = 2/4; scale = beta/N * max(p, 1/K) = 0.5/100 * 0.5 = 0.0025 per token
    assert alp_penalties([10, 20, 30, 40], [True, True, False, False], 0.5, 100) == pytest.approx(
        [-0.025, -0.05, -0.075, -0.1]
    )
    # never solved: floor 1/K = 0.25 -> 0.00125 per token
    assert alp_penalties([40, 0], [False, False], 0.5, 100) == pytest.approx([-0.1, -0.0])
    # all solved (easy prompt): the full rate, 0.005 per token
    assert alp_penalties([40, 40], [True, True], 0.5, 100) == pytest.approx([-0.2, -0.2])


def test_alp_fn_scales_by_group_pass_rate() -> None:
    fn = AlpLengthReward(exact_answer_verifier, norm_tokens=100, beta=0.5, num_generations=2)
    comps = ["x</think>1", "x</think>1", "x</think>9", "x</think>9"]
    out = fn(
        prompts=["p"] * 4,
        completions=comps,
        completion_ids=[ids(40)] * 4,
        problem_id=["e", "e", "h", "h"],
        answer=["1", "1", "1", "1"],
    )
    # easy group (2/2 solved) pays 0.005/token, hard group (0/2) pays the floor 0.0025/token
    assert out == pytest.approx([-0.2, -0.2, -0.1, -0.1])


# -- correctness / format ------------------------------------------------------------------------------------------
def test_correctness_reward() -> None:
    fn = CorrectnessReward(exact_answer_verifier)
    comps = ["3+4=7</think>\n\n7", "</think>8", "no close 7", "", [{"role": "assistant", "content": "t</think> 7"}]]
    out = fn(prompts=["p"] * 5, completions=comps, completion_ids=None, answer=["7"] * 5)
    assert out == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_correctness_counts_verifier_error_as_wrong() -> None:
    def boom(row: object, text: str) -> bool:
        raise RuntimeError("verifier crashed")

    assert CorrectnessReward(boom)(prompts=["p"], completions=["x"], answer=["1"]) == [0.0]


@pytest.mark.parametrize(
    ("text", "require_thought", "expected"),
    [
        ("3+4=7\n</think>\n\n7", True, 1.0),
        ("<think>x</think> 7", True, 1.0),  # a re-opened <think> at the very start is tolerated
        ("x</think>", True, 0.0),  # no answer
        ("x</think>  \n", True, 0.0),  # whitespace-only answer
        ("", True, 0.0),  # empty completion
        ("never closes the thought", True, 0.0),  # truncated inside the thought
        ("x</think>7</think>8", True, 0.0),  # two closes
        ("x</think>7<think>", True, 0.0),  # re-opens after the answer
        ("\n\n</think>\n\n7", True, 0.0),  # empty thought
        ("\n\n</think>\n\n7", False, 1.0),
    ],
)
def test_format_reward(text: str, require_thought: bool, expected: float) -> None:
    assert FormatReward(require_thought)(prompts=["p"], completions=[text]) == [expected]


def test_split_thought() -> None:
    assert split_thought("<think>a</think>b") == ("a", "b", True)
    assert split_thought("a") == ("a", "", False)


def test_token_lengths_checks_rows() -> None:
    assert token_lengths([[1, 2], []], 2) == [2, 0]
    with pytest.raises(ValueError):
        token_lengths([[1]], 2)


def test_task_verifier_on_arith() -> None:
    tasks = pytest.importorskip("router.tasks")
    from training.grpo.reward_utils import task_verifier

    p = tasks.load_task("arith", "train", 1, seed=0, difficulties=[1])[0]
    row = {
        "problem_id": p.id,
        "question": p.question,
        "answer": p.answer,
        "difficulty": p.difficulty,
        "source": p.source,
    }
    verify = task_verifier()
    assert verify(row, f"thinking</think>\n\nThe answer is {p.answer}.")
    assert not verify(row, f"thinking</think>\n\nThe answer is {int(p.answer) + 1}.")


# -- registry ------------------------------------------------------------------------------------------------------
def test_build_rewards_names_weights_and_defaults() -> None:
    ctx = RewardContext(exact_answer_verifier, max_completion_length=40, num_generations=4)
    specs = [RewardSpec(name, 0.5, {}) for name in sorted(REWARD_REGISTRY)]
    funcs, weights = build_rewards(specs, ctx)
    assert [f.__name__ for f in funcs] == sorted(REWARD_REGISTRY)
    assert weights == [0.5] * len(specs)
    dapo = funcs[sorted(REWARD_REGISTRY).index("dapo_overlong")]
    assert (dapo.max_len, dapo.cache) == (40, 10)  # defaults: L_max = max_completion_length, cache = L_max / 4
    with pytest.raises(ValueError, match="params"):
        build_rewards([RewardSpec("format", 1.0, {"nope": 1})], ctx)
    with pytest.raises(ValueError, match="unknown reward"):
        build_rewards([RewardSpec("nope", 1.0, {})], ctx)


# -- cut-off thoughts ------------------------------------------------------------------------------------------
def _arith_row() -> dict:
    from router import tasks

    p = tasks.load_task("arith", "train", 1, seed=0, difficulties=[5])[0]
    return {
        "problem_id": p.id,
        "question": p.question,
        "answer": p.answer,
        "difficulty": p.difficulty,
        "source": p.source,
    }


def test_task_verifier_scores_a_cut_off_thought_wrong() -> None:
    from training.grpo.reward_utils import is_correct, task_verifier

    row = _arith_row()
    cut = f"2 + 3 = 5, so far the answer is {row['answer']} but let me re-check"  # hit the cap inside the thought
    verify = task_verifier()
    assert not is_correct(verify, row, cut)
    assert not is_correct(verify, row, f"The answer is {row['answer']}.")  # still inside the thought
    assert is_correct(verify, row, f"re-checked</think>\n\nThe answer is {row['answer']}.")
    assert is_correct(verify, row, f"The answer is {row['answer']}.", require_closed_thought=False)  # no thinking


def test_every_correctness_based_reward_refuses_cut_off_thoughts() -> None:
    """A verifier that accepts anything: the closed-thought rule alone decides (rewards use is_correct)."""
    from training.grpo.reward_utils import task_verifier

    row = _arith_row()
    cut, done = f"... the answer is {row['answer']}", f"x</think>\n\nThe answer is {row['answer']}."
    comps, cids = [cut, done], [ids(8), ids(8)]
    cols = {k: [v, v] for k, v in row.items()}
    assert CorrectnessReward(task_verifier())(prompts=["p"] * 2, completions=comps, **cols) == [0.0, 1.0]

    def accept(r: object, t: str) -> bool:
        return True

    assert CorrectnessReward(accept)(prompts=["p"] * 2, completions=comps, **cols) == [0.0, 1.0]
    l1 = L1MaxReward(accept, alpha=0.01)(
        prompts=["p"] * 2, completions=comps, completion_ids=cids, budget_tokens=[50, 50]
    )
    assert l1[0] == 0.0 and l1[1] > 0
    kimi = KimiLengthReward(accept, num_generations=2)(
        prompts=["p"] * 2, completions=comps, completion_ids=[ids(4), ids(8)]
    )
    assert kimi == pytest.approx([0.0, -0.5])  # the short cut-off one is wrong: min(0, +0.5) = 0
    cos = CosineReward(accept, max_len=10)(prompts=["p"] * 2, completions=comps, completion_ids=[ids(5), ids(5)])
    assert cos[0] == pytest.approx(-5.0) and cos[1] == pytest.approx(1.5)  # wrong vs right at half length


def test_thinking_is_detected_from_the_chat_template() -> None:
    from transformers import AutoTokenizer

    from training.grpo.config import DEFAULT_MODEL_DIR
    from training.grpo.reward_utils import template_opens_thought

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert template_opens_thought(tok)  # generation prompt ends with "<think>\n"
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    assert not template_opens_thought(tok)
    tok.chat_template = tok.chat_template.replace("A:", "A:<think>\n\n</think>\n\n")  # thinking switched off
    assert not template_opens_thought(tok)


def test_l1_max_gets_the_papers_max_prompt() -> None:
    from training.grpo.config import BudgetPromptConfig
    from training.grpo.data import problem_rows, resolve_budget_prompt

    class P:
        id, question, answer, difficulty, source = "p", "What is 2 + 2?", "4", 1, "arith"

    bp = BudgetPromptConfig(enabled=True, min_tokens=10, max_tokens=10)
    mx = problem_rows([P()], resolve_budget_prompt(bp, ["l1_max"]))[0]
    assert mx["prompt"][0]["content"].endswith("Think for maximum 10 tokens.") and mx["budget_tokens"] == 10
    ex = problem_rows([P()], resolve_budget_prompt(bp, ["correctness", "l1_exact"]))[0]
    assert ex["prompt"][0]["content"].endswith("Think for 10 tokens.")
    own = BudgetPromptConfig(enabled=True, template="Budget: {budget}.")
    assert resolve_budget_prompt(own, ["l1_max"]).template == "Budget: {budget}."  # a chosen template is kept


def test_correctness_plus_minus_one() -> None:
    """DAPO's rule-based reward is +1 / -1 (arXiv 2503.14476, eq. 7): ``params: {wrong: -1}``."""
    ctx = RewardContext(exact_answer_verifier, max_completion_length=40, num_generations=2)
    (fn,), _ = build_rewards([RewardSpec("correctness", 1.0, {"wrong": -1.0})], ctx)
    out = fn(prompts=["p"] * 3, completions=["x</think>7", "x</think>8", "cut off 7"], answer=["7"] * 3)
    assert out == [1.0, -1.0, -1.0]
