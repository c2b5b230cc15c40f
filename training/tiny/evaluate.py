"""Offline evaluation of the tiny model with a thinking budget, in transformers (no server).

Reproduces vLLM's ``thinking_token_budget`` semantics (``vllm/v1/sample/thinking_budget_state.py``): the budget
counts thought tokens after the last ``<think>``, *including* the ``\\n`` that the generation prompt already
holds, so with budget ``B`` the model writes at most ``B - 1`` thought tokens before ``</think>`` is forced.
Greedy decoding (temperature 0). Used for quick checks during training; the reported figures come from the
real vLLM server (``bench/tiny_measure.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.tasks import Problem, verify
from training.tiny.tokenizer import IM_END, THINK_END, render_prompt


@dataclass
class Outcome:
    """One evaluated problem: full completion text, thought length in tokens, whether it was cut, correctness."""

    problem: Problem
    text: str
    thought_tokens: int
    cut: bool
    correct: bool


def _encode_prompts(tokenizer: Any, questions: Sequence[str], enable_thinking: bool = True) -> list[list[int]]:
    """Each question as a one-user-turn chat prompt (:func:`render_prompt`), encoded to token ids."""
    return [
        tokenizer.encode(render_prompt([{"role": "user", "content": q}], enable_thinking), add_special_tokens=False)
        for q in questions
    ]


def _generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_new: int, stop: list[int]) -> list[list[int]]:
    import torch

    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=pad,
        )
    gens = []
    for row in out[:, width:].tolist():
        keep = []
        for t in row:
            keep.append(t)
            if t in stop:
                break
        gens.append([t for t in keep if t != pad])
    return gens


def run(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    budget: int | None,
    enable_thinking: bool = True,
    max_thought: int = 512,
    max_answer: int = 24,
    batch_size: int = 64,
) -> list[Outcome]:
    """Answer ``problems`` greedily; ``budget`` in tokens (None = up to ``max_thought``)."""
    end_id = tokenizer.convert_tokens_to_ids(THINK_END)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    outcomes: list[Outcome] = []
    model.eval()
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = _encode_prompts(tokenizer, [p.question for p in chunk], enable_thinking)
        if enable_thinking:
            limit = max_thought if budget is None else max(0, budget - 1)
            thoughts = (
                _generate(model, tokenizer, prompts, limit, [end_id, eos_id]) if limit > 0 else [[] for _ in chunk]
            )
            cut = [not (t and t[-1] == end_id) for t in thoughts]
            thoughts = [t if t and t[-1] == end_id else [*t, end_id] for t in thoughts]
        else:
            thoughts, cut = [[] for _ in chunk], [False] * len(chunk)
        answers = _generate(
            model, tokenizer, [p + t for p, t in zip(prompts, thoughts, strict=True)], max_answer, [eos_id]
        )
        for p, t, a, c in zip(chunk, thoughts, answers, cut, strict=True):
            text = tokenizer.decode(t + a, skip_special_tokens=True)
            outcomes.append(Outcome(p, text, len(t), c, verify(p, text)))
    return outcomes


def accuracy_by_difficulty(outcomes: Sequence[Outcome]) -> dict[int, float]:
    """Fraction correct per difficulty level."""
    by: dict[int, list[bool]] = {}
    for o in outcomes:
        by.setdefault(o.problem.difficulty, []).append(o.correct)
    return {d: sum(v) / len(v) for d, v in sorted(by.items())}


def offline_report(
    model_dir: Any, n: int = 240, threads: int = 2, budgets: Sequence[int] = (24, 256), seed: int = 0
) -> dict[str, Any]:
    """Accuracy per difficulty on ``n`` held-out ``arith`` problems at each budget and with thinking off.

    Returns ``{"n": n, "accuracy": {"budget_24": {d: acc}, …, "off": {d: acc}}, "mean_thought_tokens": {…}}``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from router.tasks import load_task

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    problems = load_task("arith", "test", n, seed)
    acc: dict[str, dict[int, float]] = {}
    mean_len: dict[str, float] = {}
    for b in budgets:
        out = run(model, tok, problems, b)
        acc[f"budget_{b}"] = accuracy_by_difficulty(out)
        mean_len[f"budget_{b}"] = sum(o.thought_tokens for o in out) / len(out)
    acc["off"] = accuracy_by_difficulty(run(model, tok, problems, None, enable_thinking=False))
    return {"n": n, "seed": seed, "accuracy": acc, "mean_thought_tokens": mean_len}
