"""``thinkgate eval dial``: how well a dial model follows a requested thinking budget, beside budget forcing.

For each requested budget ``B`` (tokens) on held-out ``arith`` problems (``load_task('arith', 'test', n, seed)``):

* the dial model is asked with "Think for B tokens." appended (:func:`training.tiny.dial.with_budget`) and decodes
  greedily; its **thinking tokens** are the tokens it generates before ``</think>``. A thought still open after
  ``hard_stop(B)`` tokens is closed there (the gateway's forcing above the requested budget) and answered;
* **budget forcing** on the SFT always-long model (``models/thinkgate-tiny``): the offline equivalent of
  the gateway's ``budget_mode: forced`` / vLLM's ``thinking_token_budget`` (:func:`training.tiny.evaluate.run`).

Output JSON: ``{"model", "n_problems", "seed", "forcing_model", "budgets": [{"budget", "within_10pct",
"mean_rel_error", "p90_rel_error", "accuracy", "forcing_accuracy", "mean_thinking_tokens"}]}`` (shares in [0, 1];
rel errors = |tokens − B| / B), optionally a PNG of the two accuracy curves and the adherence.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.tasks import Problem, verify
from training.models import TINY_MODEL_DIR
from training.tiny.dial import adherence, with_budget
from training.tiny.tokenizer import IM_END, THINK_END

DEFAULT_FORCING_MODEL = str(TINY_MODEL_DIR)


def hard_stop(budget: int) -> int:
    """Thinking tokens after which an open thought is closed: 25% + 16 tokens above the request (the gateway's
    forcing stop on a ``prompted`` tier uses the same rule, ``gateway.thinking.dial``)."""
    return budget + budget // 4 + 16


@dataclass
class DialOutcome:
    """One answered problem: thinking tokens (before ``</think>``), closed by the model itself, correctness."""

    problem: Problem
    thinking_tokens: int
    closed: bool
    correct: bool
    text: str


def answer_with_budget(
    model: Any, tokenizer: Any, problems: Sequence[Problem], budget: int | None, batch_size: int = 64
) -> list[DialOutcome]:
    """Greedy answers of the dial model with ``budget`` in the prompt (None: unlimited, hard stop 512)."""
    from training.tiny.evaluate import _encode_prompts, _generate

    end_id = tokenizer.convert_tokens_to_ids(THINK_END)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    limit = hard_stop(budget) if budget is not None else 512
    out: list[DialOutcome] = []
    model.eval()
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = _encode_prompts(tokenizer, [with_budget(p.question, budget) for p in chunk])
        thoughts = _generate(model, tokenizer, prompts, limit + 1, [end_id, eos_id])
        closed = [bool(t) and t[-1] == end_id for t in thoughts]
        n_think = [len(t) - 1 if c else len(t) for t, c in zip(thoughts, closed, strict=True)]
        # an unclosed thought (cut at the hard stop, or ended by EOS) is closed as forcing would
        thoughts = [t if c else [*(x for x in t if x != eos_id), end_id] for t, c in zip(thoughts, closed, strict=True)]
        answers = _generate(model, tokenizer, [p + t for p, t in zip(prompts, thoughts, strict=True)], 24, [eos_id])
        for p, t, a, c, n in zip(chunk, thoughts, answers, closed, n_think, strict=True):
            text = tokenizer.decode(t + a, skip_special_tokens=True)
            out.append(DialOutcome(p, n, c, verify(p, text), text))
    return out


def evaluate(
    model_dir: str,
    budgets: Sequence[int],
    n: int = 120,
    seed: int = 0,
    forcing_model: str | None = DEFAULT_FORCING_MODEL,
    threads: int = 1,
    log: Any = print,
) -> dict[str, Any]:
    """The report described in the module doc (``forcing_model=None``: no forcing column)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from router.tasks import load_task
    from training.tiny import evaluate as forcing

    torch.set_num_threads(threads)
    problems = load_task("arith", "test", n, seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = ref_tok = None
    if forcing_model:
        ref_tok = AutoTokenizer.from_pretrained(forcing_model)
        ref = AutoModelForCausalLM.from_pretrained(forcing_model, dtype=torch.float32)
    rows = []
    for b in budgets:
        outs = answer_with_budget(model, tok, problems, b)
        row: dict[str, Any] = {"budget": b, **adherence([o.thinking_tokens for o in outs], b)}
        row["accuracy"] = sum(o.correct for o in outs) / len(outs)
        row["forcing_accuracy"] = None
        if ref is not None:
            forced = forcing.run(ref, ref_tok, problems, b)
            row["forcing_accuracy"] = sum(o.correct for o in forced) / len(forced)
        row["mean_thinking_tokens"] = sum(o.thinking_tokens for o in outs) / len(outs)
        row["closed_by_model"] = sum(o.closed for o in outs) / len(outs)
        log(
            f"budget {b}: within {row['within_10pct']:.0%}, mean rel err {row['mean_rel_error']:.3f}, "
            f"p90 {row['p90_rel_error']:.3f}, accuracy {row['accuracy']:.0%}, forcing "
            + (f"{row['forcing_accuracy']:.0%}" if row["forcing_accuracy"] is not None else "not run")
        )
        rows.append(row)
    return {
        "model": str(model_dir),
        "n_problems": len(problems),
        "seed": seed,
        "forcing_model": forcing_model,
        "budgets": rows,
    }


def plot(report: dict[str, Any], path: Path) -> Path:
    """A PNG: accuracy of the dial model and of budget forcing, and the share within tolerance, per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["budgets"]
    xs = [r["budget"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["accuracy"] for r in rows], "o-", label="dial model: accuracy")
    if all(r["forcing_accuracy"] is not None for r in rows):
        ax.plot(xs, [r["forcing_accuracy"] for r in rows], "s--", label="forcing on SFT model: accuracy")
    ax.plot(xs, [r["within_10pct"] for r in rows], "^:", label="dial model: within tolerance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("requested thinking budget (tokens)")
    ax.set_title(f"{Path(report['model']).name}: {report['n_problems']} held-out problems")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(report: dict[str, Any], json_path: Path) -> Path:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    return json_path
