"""Held-out evaluation for GRPO runs: accuracy and completion/thought length (tokens) per difficulty bucket.

Greedy decoding with ``transformers`` ``generate`` on the tokenizer's chat template (generation prompt opens
``<think>``), up to ``max_new_tokens``; a completion ends at EOS. ``thought_tokens`` counts tokens before the first
``</think>`` (all tokens when the thought never closes). Correctness is :func:`reward_utils.is_correct`, the
same decision as the rewards': a completion that never closed its thought is wrong whatever its text says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.grpo.reward_utils import THINK_CLOSE, Verifier, is_correct, split_thought


@dataclass
class EvalRow:
    problem_id: str
    difficulty: int
    completion_tokens: int
    thought_tokens: int
    truncated: bool
    correct: bool
    thought_closed: bool = True
    text: str = ""  # the decoded completion (for inspection; not in the summaries)


def _thought_tokens(ids: list[int], text_prefix_tokens: Any, close_id: int | None) -> int:
    if close_id is not None and close_id in ids:
        return ids.index(close_id)
    return text_prefix_tokens(ids)


def generate_and_score(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    verifier: Verifier,
    max_new_tokens: int,
    batch_size: int = 32,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    require_closed_thought: bool = True,
) -> list[EvalRow]:
    """Answer every row (dataset rows from :mod:`training.grpo.data`) and verify: greedily, or — ``temperature``
    > 0 — ``samples`` sampled completions per row (seeded; one :class:`EvalRow` per completion). With
    ``require_closed_thought`` (a thinking model) a completion without ``</think>`` is wrong."""
    import torch

    sampling = temperature > 0
    if sampling:
        torch.manual_seed(seed)

    close_id = tokenizer.convert_tokens_to_ids(THINK_CLOSE)
    if close_id == tokenizer.unk_token_id or not isinstance(close_id, int):
        close_id = None

    def prefix_tokens(ids: list[int]) -> int:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        head = text.split(THINK_CLOSE, 1)[0]
        return len(tokenizer.encode(head, add_special_tokens=False)) if THINK_CLOSE in text else len(ids)

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = (
        model.generation_config.eos_token_id
        if model.generation_config.eos_token_id is not None
        else tokenizer.eos_token_id
    )
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    was_training = model.training
    model.eval()
    out: list[EvalRow] = []
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            prompts = [
                tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chunk
            ]
            enc = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
            width = max(len(e) for e in enc)
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc], device=model.device)
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], device=model.device)
            with torch.no_grad():
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=sampling,
                    temperature=temperature if sampling else None,
                    top_p=1.0 if sampling else None,
                    top_k=0 if sampling else None,
                    num_return_sequences=samples if sampling else 1,
                    pad_token_id=pad,
                    eos_token_id=list(eos_ids),
                )
            per_row = samples if sampling else 1
            expanded = [r for r in chunk for _ in range(per_row)]
            for r, seq in zip(expanded, gen[:, width:].tolist(), strict=True):
                comp: list[int] = []
                for t in seq:
                    comp.append(t)
                    if t in eos_ids:
                        break
                truncated = not comp or comp[-1] not in eos_ids
                text = tokenizer.decode(comp, skip_special_tokens=True)
                ok = is_correct(verifier, r, text, require_closed_thought)
                out.append(
                    EvalRow(
                        r["problem_id"],
                        int(r["difficulty"]),
                        len(comp),
                        _thought_tokens(comp, prefix_tokens, close_id),
                        truncated,
                        ok,
                        split_thought(text)[2],
                        text,
                    )
                )
    finally:
        model.train(was_training)
    return out


def summarize(rows: Sequence[EvalRow]) -> dict[str, Any]:
    """Overall and per-difficulty accuracy (fraction), mean completion and thought tokens, truncation rate."""

    def agg(rs: Sequence[EvalRow]) -> dict[str, float | int]:
        n = len(rs)
        return {
            "n": n,
            "accuracy": sum(r.correct for r in rs) / n if n else 0.0,
            "mean_completion_tokens": sum(r.completion_tokens for r in rs) / n if n else 0.0,
            "mean_thought_tokens": sum(r.thought_tokens for r in rs) / n if n else 0.0,
            "truncated_rate": sum(r.truncated for r in rs) / n if n else 0.0,
            "unclosed_thought_rate": sum(not r.thought_closed for r in rs) / n if n else 0.0,
        }

    by: dict[int, list[EvalRow]] = {}
    for r in rows:
        by.setdefault(r.difficulty, []).append(r)
    return {"overall": agg(rows), "by_difficulty": {str(d): agg(v) for d, v in sorted(by.items())}}
