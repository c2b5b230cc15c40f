"""The dial format and its metric: thoughts that fill a budget exactly (shipped tokenizer), the adherence rule of
``thinkgate eval dial`` on a hand-made set with known lengths, the budget draw and the dial_length reward."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from router.tasks.arithmetic import Chain, Op, random_chain
from training.grpo.config import BudgetPromptConfig
from training.grpo.data import draw_budget, problem_rows
from training.grpo.dial_rewards import DialLengthReward, dial_length_penalty, thinking_tokens
from training.tiny.dial import adherence, dial_thought, log_uniform_budget, with_budget, within_tolerance

ASSET = Path(__file__).resolve().parents[2] / "models" / "thinkgate-tiny"


def test_adherence_on_a_hand_made_set() -> None:
    # budget 16 (<= 32): ±4 tokens; |errors| = 4, 4, 5, 0
    a = adherence([12, 20, 21, 16], 16)
    assert a["within_10pct"] == pytest.approx(3 / 4)
    assert a["mean_rel_error"] == pytest.approx((4 + 4 + 5 + 0) / 16 / 4)
    assert a["p90_rel_error"] == pytest.approx(5 / 16)  # nearest rank: ceil(0.9 * 4) = the 4th smallest
    # budget 32 is still absolute: 28 and 36 are in, 27 is not (10% would be 3.2 tokens)
    assert adherence([28, 36, 27], 32)["within_10pct"] == pytest.approx(2 / 3)
    # budget 100: ±10 tokens; 10 errors: 0..9 -> rank 9 is 8/100
    a = adherence([90, 110, 111, 100, 50], 100)
    assert a["within_10pct"] == pytest.approx(3 / 5)
    assert a["mean_rel_error"] == pytest.approx((10 + 10 + 11 + 0 + 50) / 100 / 5)
    assert a["p90_rel_error"] == pytest.approx(0.5)
    assert adherence([100 + i for i in range(10)], 100)["p90_rel_error"] == pytest.approx(0.08)
    assert within_tolerance(33 + 3, 33) and not within_tolerance(33 + 4, 33)
    with pytest.raises(ValueError):
        adherence([], 16)


def test_thoughts_fill_the_budget_exactly_in_the_shipped_tokenizer() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSET)
    rng = random.Random(0)
    for budget in [0, 1, 5, 8, 9, 10, 11, 16, 19, 20, 32, 47, 64, 100, 128, 256, 320, 500]:
        for d in (1, 3, 6):
            text = dial_thought(random_chain(rng, d), budget)
            assert len(tok.encode(text, add_special_tokens=False)) == budget, (budget, text)


def test_thought_shape() -> None:
    chain = Chain(7, (Op("add", 5), Op("mul", 3)))
    assert dial_thought(chain, 48) == "048:07+007038:07+512028:12*336018:36+03676543210"
    assert dial_thought(chain, 20) == "020:07+007010:07+512"  # the budget ends the chain early
    assert dial_thought(chain, 6) == "543210"
    assert with_budget("Q?", 64) == "Q? Think for 64 tokens." and with_budget("Q?", None) == "Q?"


def test_budget_draws() -> None:
    rng = random.Random(1)
    xs = [log_uniform_budget(rng, 8, 320) for _ in range(4000)]
    assert min(xs) >= 8 and max(xs) <= 320
    # log-uniform: as many below the geometric mean (~50.6) as above it
    assert 0.45 < sum(x < 50.6 for x in xs) / len(xs) < 0.55
    cfg = BudgetPromptConfig(enabled=True, min_tokens=8, max_tokens=320, distribution="log_uniform",
                             unlimited_fraction=0.25)
    draws = [draw_budget(rng, cfg) for _ in range(4000)]
    assert 0.22 < sum(d is None for d in draws) / len(draws) < 0.28


def test_unlimited_rows_carry_no_instruction() -> None:
    from router.tasks import load_task

    cfg = BudgetPromptConfig(enabled=True, min_tokens=8, max_tokens=320, distribution="log_uniform",
                             unlimited_fraction=0.5)
    rows = problem_rows(load_task("arith", "train", 40, 0), cfg)
    for r in rows:
        text = r["prompt"][0]["content"]
        if r["budget_tokens"] is None:
            assert text == r["question"]
        else:
            assert text == f"{r['question']} Think for {r['budget_tokens']} tokens."
    assert any(r["budget_tokens"] is None for r in rows) and any(r["budget_tokens"] for r in rows)


def test_dial_length_reward() -> None:
    close = 7
    assert thinking_tokens([1, 2, close, 3], close) == 2 and thinking_tokens([1, 2], close) == 2
    assert dial_length_penalty(12, 16) == pytest.approx(-0.25)
    assert dial_length_penalty(100, 16) == -1.0 and dial_length_penalty(5, None) == 0.0
    r = DialLengthReward(close_id=close)
    ids = [[1] * 16 + [close, 9], [1] * 8 + [close], [1] * 40]
    out = r(prompts=[None] * 3, completions=["a", "b", "c"], completion_ids=ids, budget_tokens=[16, 16, None])
    assert out == [0.0, pytest.approx(-0.5), 0.0]
    from transformers import AutoTokenizer

    close_id = AutoTokenizer.from_pretrained(ASSET).convert_tokens_to_ids("</think>")
    assert DialLengthReward(tokenizer=str(ASSET)).close_id == close_id
