"""Held-out accuracy of the shipped models under the old and the fixed correctness rule (cut-off thoughts).

Old rule: ``router.tasks.verify`` on the whole completion (with no ``</think>`` the whole text was read as the
answer). Fixed rule (``training.grpo.reward_utils.is_correct``, used by rewards and evaluation): no ``</think>``
-> wrong. Same held-out set as ``training/configs/short_tier.yaml`` (120 arith test problems, 1-6 operations,
seed 0), greedy, 256 new tokens, one torch thread. Prints a markdown table.

    python -m bench.grpo_closed_thought [--models models/thinkgate-tiny,models/thinkgate-tiny-short]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="models/thinkgate-tiny,models/thinkgate-tiny-short")
    ap.add_argument("--config", default="training/configs/short_tier.yaml")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from router import tasks
    from training.grpo.config import load_config
    from training.grpo.data import load_problems, problem_rows
    from training.grpo.evaluate import generate_and_score
    from training.grpo.reward_utils import task_verifier

    torch.set_num_threads(1)
    cfg = load_config(ROOT / args.config)
    rows = problem_rows(load_problems(cfg.task, cfg.task.eval_split, cfg.task.n_eval), cfg.budget_prompt)
    by_id = {r["problem_id"]: r for r in rows}
    print(
        "| model | n | accuracy (old rule) | accuracy (fixed) | unclosed thoughts | unclosed counted correct before "
        "| by operations: unclosed (old-correct) | eval s |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for m in args.models.split(","):
        path = ROOT / m
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        t0 = time.perf_counter()
        out = generate_and_score(model, tok, rows, task_verifier(), cfg.eval.max_new_tokens or 256, cfg.eval.batch_size)
        secs = time.perf_counter() - t0
        old = []
        for r in out:
            row = by_id[r.problem_id]
            p = tasks.Problem(row["problem_id"], row["question"], row["answer"], row["difficulty"], row["source"])
            old.append(bool(tasks.verify(p, r.text)))
        unclosed = [r for r in out if not r.thought_closed]
        wrongly = [r for r, o in zip(out, old, strict=True) if o and not r.thought_closed]
        per: dict[int, list[int]] = {}
        for r, o in zip(out, old, strict=True):
            if not r.thought_closed:
                c = per.setdefault(r.difficulty, [0, 0])
                c[0] += 1
                c[1] += int(o)
        detail = ", ".join(f"{d}: {a} ({b})" for d, (a, b) in sorted(per.items())) or "none"
        n = len(out)
        print(
            f"| `{m}` | {n} | {sum(old) / n:.3f} | {sum(r.correct for r in out) / n:.3f} | {len(unclosed)} "
            f"| {len(wrongly)} | {detail} | {secs:.0f} |"
        )


if __name__ == "__main__":
    main()
