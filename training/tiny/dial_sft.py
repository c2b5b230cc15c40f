"""Warm start of the dial model: SFT on thoughts that fill a budget stated in the prompt (:mod:`training.tiny.dial`).

Continues a tiny model (default: the shipped SFT over-thinker ``models/thinkgate-tiny``) on examples of
four kinds, drawn per example:

* ``budget`` — the question ends with "Think for B tokens." (B log-uniform over [8, 320]); the thought is
  :func:`~training.tiny.dial.dial_thought` (exactly B tokens), then ``</think>`` and the answer;
* ``unlimited`` — no instruction; the plain terse chain (``7 + 5 = 12`` per line);
* ``forced`` — a budgeted thought cut early and closed by the gateway's forced ``\\n</think>\\n\\n`` (no loss on
  the forced tokens), then the answer: what the hard stop above a requested budget produces;
* ``direct`` — thinking disabled, the answer only.

Loss on completion tokens only. Everything is generated from the **train** split of ``arith``.

    python -m training.tiny.dial_sft --output-dir runs/dial-sft [--steps N] [--max-minutes M]

Billed like ``train grpo`` and ``train sft`` (:class:`~training.tiny.billing.SFTBilling`): ``ledger.jsonl`` /
``.parquet`` (rows ``startup`` / ``step`` / ``finish``, CPU at the default price), ``summary.json`` and
``heartbeat.json`` beside the model files, so ``train runs`` lists the run (tag ``method: dial-sft``).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from router.tasks.arithmetic import Chain, phrase, random_chain, split_of
from training.models import TINY_MODEL_DIR
from training.tiny.billing import SFTBilling
from training.tiny.data import FORCED_ENDS, Example, Mix, answer_text, thought
from training.tiny.dial import BudgetDraw, dial_thought, with_budget
from training.tiny.tokenizer import IM_END, THINK_END, render_prompt
from training.tiny.train import SFTConfig, train

DEFAULT_INIT = str(TINY_MODEL_DIR)


@dataclass(frozen=True)
class DialMix:
    """Shares of example kinds (``budget`` takes the rest) and the budget draw of ``budget`` examples."""

    unlimited: float = 0.12
    forced: float = 0.05
    direct: float = 0.05
    draw: BudgetDraw = field(default_factory=lambda: BudgetDraw(8, 320, unlimited=0.0))


def make_dial_example(tokenizer: Any, chain: Chain, question: str, rng: random.Random, mix: DialMix) -> Example:
    """One tokenized example for ``chain`` (kind drawn from ``mix`` with ``rng``)."""

    def enc(s: str) -> list[int]:
        return list(tokenizer.encode(s, add_special_tokens=False))

    r = rng.random()
    answer = enc(answer_text(chain) + IM_END)
    if r < mix.direct:
        prompt = enc(render_prompt([{"role": "user", "content": question}], enable_thinking=False))
        return Example(prompt + answer, [-100] * len(prompt) + answer, "direct")
    if r < mix.direct + mix.unlimited:
        prompt = enc(render_prompt([{"role": "user", "content": question}]))
        body = enc(thought(chain, "terse", rng) + THINK_END + "\n\n") + answer
        return Example(prompt + body, [-100] * len(prompt) + body, "unlimited")
    budget = mix.draw.draw(rng) or mix.draw.max_tokens
    prompt = enc(render_prompt([{"role": "user", "content": with_budget(question, budget)}]))
    body = enc(dial_thought(chain, budget))
    if r < mix.direct + mix.unlimited + mix.forced:
        cut = body[: rng.randint(0, max(0, len(body) - 1))]
        forced = enc(FORCED_ENDS[1])
        labels = [-100] * len(prompt) + cut + [-100] * len(forced) + answer
        return Example(prompt + cut + forced + answer, labels, "forced")
    tail = enc(THINK_END + "\n\n") + answer
    return Example(prompt + body + tail, [-100] * len(prompt) + body + tail, "budget")


def sampler(mix: DialMix) -> Any:
    """A :data:`training.tiny.train.Sampler` drawing dial examples (train split only)."""

    def draw(tokenizer: Any, rng: random.Random, difficulty: int, _mix: Mix) -> Example:
        while True:
            chain = random_chain(rng, difficulty)
            if split_of(chain) == "train":
                return make_dial_example(tokenizer, chain, phrase(chain, rng), rng, mix)

    return draw


def dial_stage(init_from: str = DEFAULT_INIT, steps: int = 1500, max_minutes: float = 22.0, seed: int = 5) -> SFTConfig:
    """The warm-start stage: batch 16, peak LR 1e-3 (warm-up 50, cosine), all difficulties from the start."""
    return SFTConfig(
        steps=steps,
        batch_size=16,
        lr=1e-3,
        warmup_steps=50,
        curriculum_frac=0.0,
        seed=seed,
        max_minutes=max_minutes,
        init_from=init_from,
    )


def run_dial_sft(cfg: SFTConfig, output_dir: Path, log: Any = print) -> dict[str, Any]:
    """Train the warm start ``cfg`` into ``output_dir`` under a :class:`~training.tiny.billing.SFTBilling` ledger;
    returns the training summary with ``spent_usd``. Raises ConfigError, before anything is written, for a directory
    that already holds a run or no model directory at ``cfg.init_from``."""
    from training.grpo.config import resolve_model_path

    if cfg.init_from:  # a wrong path is refused here: past this point the time spent is billed
        resolve_model_path(cfg.init_from)
    with SFTBilling(output_dir, {"run_name": "dial-sft", "method": "dial-sft"}) as billing:  # bills a Ctrl-C, an error
        summary = train(cfg, output_dir, log=log, sampler=sampler(DialMix()), on_step=billing.on_step)
        return {**summary, "spent_usd": billing.finish()["spent_usd"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", type=Path, required=True)
    ap.add_argument("--init-from", default=DEFAULT_INIT)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--max-minutes", type=float, default=22.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args(argv)
    cfg = replace(dial_stage(a.init_from, a.steps, a.max_minutes, a.seed), lr=a.lr)
    run_dial_sft(cfg, a.output_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
