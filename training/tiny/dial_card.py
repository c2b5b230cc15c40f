"""The model card and gateway settings of a dial model directory (``thinkgate-tiny-dial``).

Reads ``training_summary.json`` (SFT warm start; a GRPO run's ``summary.json`` when present) and
``eval_dial.json`` (``thinkgate eval dial``); writes ``README.md`` (Hugging Face card: budget range, prompt format,
per-budget adherence and accuracy beside budget forcing) and ``dial.json`` — what ``thinkgate bench savings
--model-dir DIR`` reads to serve every tier with ``budget_mode: prompted``.

    python -m training.tiny.dial_card DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from router.policy import budget_map_shape
from training.tiny.dial import BUDGET_TEMPLATE, LINE_TOKENS

BUDGET_RANGE = (8, 320)
#: the tiers a dial model serves: budget in tokens (0: thinking off; None: unlimited)
TIER_BUDGETS: dict[str, int | None] = {"none": 0, "short": 32, "long": None}


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def results_table(report: dict[str, Any]) -> str:
    """Markdown rows per requested budget: adherence, errors, accuracy, forcing accuracy."""
    lines = [
        "| budget | within tolerance | mean rel. error | p90 rel. error | mean thinking tokens | accuracy | "
        "forcing on SFT model |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["budgets"]:
        lines.append(
            f"| {r['budget']} | {_pct(r['within_10pct'])} | {r['mean_rel_error']:.3f} | {r['p90_rel_error']:.3f} | "
            f"{r.get('mean_thinking_tokens', float('nan')):.1f} | {_pct(r['accuracy'])} | "
            f"{_pct(r['forcing_accuracy'])} |"
        )
    return "\n".join(lines)


def targets_line(report: dict[str, Any]) -> str:
    """Which budgets meet the issue's bar: ≥ 90% within tolerance and accuracy ≥ forcing's − 1 point."""
    met: list[str] = []
    missed: list[str] = []
    for r in report["budgets"]:
        forcing = r["forcing_accuracy"]
        ok = r["within_10pct"] >= 0.9 and (forcing is None or r["accuracy"] >= forcing - 0.01)
        (met if ok else missed).append(str(r["budget"]))
    return (
        f"Targets (≥ 90% within tolerance and accuracy ≥ forcing's − 1 point): met at budgets "
        f"{', '.join(met) or '(no budget)'}; "
        + (f"missed at {', '.join(missed)}." if missed else "missed at no budget.")
    )


def routing_section(fit: dict[str, Any] | None) -> str:
    """What the router file beside the model (``router.skops``, ``thinkgate train dial-router``) serves."""
    if not fit:
        return "No router file here: `model: auto` routes to the configured tiers only."
    served = fit["served"]
    g = served["guarantee"]
    rows = ["| budget | accuracy | mean thinking tokens |", "|---|---|---|"]
    rows += [f"| {'unlimited' if r['budget'] is None else r['budget']} | {_pct(r['accuracy'])} | "
             f"{r['mean_thinking_tokens']:.1f} |" for r in fit["per_budget"]]
    shape = budget_map_shape(served["cuts"], served["budgets"], unit="")
    verdict = (f"certified: keeps ≥ {g['floor']:.0%} of the tier's own accuracy with {g['confidence']:.0%} "
               f"confidence at {g['calibration_token_share']:.0%} of its tokens on {g['n_calibration']} calibration "
               "problems" if g["certified"] else
               "no map cheaper than the tier's own setting could be certified: the unlimited (terse) thought is "
               "both the most accurate and among the cheapest here, because a budgeted thought fills its budget")
    return (f"`router.skops` routes every `auto` request to the tier `{served['tier']}` with a thinking budget "
            f"picked from the router score (Learn-then-Test, `thinkgate train dial-router`, on "
            f"{fit['n_problems']} `arith` **train**-split problems, split by a hash of the problem into "
            f"{g.get('n_fit')} to order the candidate maps and {g['n_calibration']} to test them): {shape} — "
            f"{verdict}.\n\n" + "\n".join(rows))


def render(model_dir: Path) -> str:
    summary = _load(model_dir / "training_summary.json") or {}
    grpo = _load(model_dir / "grpo_summary.json")
    report = _load(model_dir / "eval_dial.json")
    size_mb = (model_dir / "model.safetensors").stat().st_size / 1e6
    params = summary.get("parameters")
    stages = summary.get("stages") or [summary]
    lines = []
    for k, st in enumerate(stages):
        c = st.get("config", {})
        lines.append(
            f"- SFT stage {k + 1} (`thinkgate train dial-sft`, `training/tiny/dial_sft.py`): continued from "
            f"`{Path(str(c.get('init_from', 'thinkgate-tiny'))).name}`, {st.get('steps_done', '?')} steps of "
            f"{c.get('batch_size', '?')} examples, AdamW peak LR {c.get('lr', '?')} (warm-up, cosine decay by the "
            f"{c.get('max_minutes', '?')}-minute bound), data seed {c.get('seed', '?')}, {st.get('wall_s', '?')} s."
        )
    training = "\n".join(lines) + (
        f"\n\nAll on a 2-core CPU (torch threads per stage: "
        f"{', '.join(str(st.get('config', {}).get('threads', 1)) for st in stages)}), "
        f"{summary.get('wall_s', '?')} s in all. Examples: 78% "
        f"budgeted thoughts (budget log-uniform over {BUDGET_RANGE[0]}–{BUDGET_RANGE[1]}), 12% unlimited (terse "
        "chain), 5% cut by the gateway's forced `\\n</think>\\n\\n` then answered, 5% thinking off; loss on "
        "completion tokens only, the train split of `arith` only."
    )
    if grpo:
        training += (
            f"\n- GRPO (`thinkgate train grpo --config training/configs/dial.yaml`): {grpo.get('global_step')} steps, "
            "rewards correctness + dial_length (L1-Exact on thinking tokens, relative to the budget), "
            f"{grpo.get('wall_s', '?')} s."
        )
    results = (
        f"`thinkgate eval dial` on {report['n_problems']} held-out `arith` problems (seed {report.get('seed', 0)}), "
        "greedy. *Within tolerance*: thinking tokens within ±10% of the budget, or ±4 tokens for budgets ≤ 32. "
        "*Forcing*: the SFT always-long model `thinkgate-tiny` cut at the same budget (vLLM "
        "`thinking_token_budget` semantics, offline).\n\n" + results_table(report) + "\n\n" + targets_line(report)
        if report
        else "Not measured yet: `thinkgate eval dial --model DIR --json DIR/eval_dial.json`."
    )
    routing = routing_section(_load(model_dir / "router_fit.json"))
    lo, hi = BUDGET_RANGE
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [reasoning, tiny, arithmetic, thinkgate, length-control]
---

# thinkgate-tiny-dial

One tiny reasoning model whose thinking budget you dial in the prompt: ask *"… Think for 64 tokens."* and it
thinks for about 64 tokens (of its tokenizer), then answers. The length-controlled-reasoning idea of L1 / LCPO
(Aggarwal & Welleck, arXiv 2503.04697) on ThinkGate's toy arithmetic task, so that the gateway can serve `none`,
`short` and `long` from one model as budgets (`budget_mode: prompted`). A
{params / 1e6 if params else 1.72:.2f}M-parameter Llama (the architecture and tokenizer of `thinkgate-tiny`), float32
safetensors, {size_mb:.1f} MB. Not for any real use.

## Prompt format
- Append `{BUDGET_TEMPLATE.format(budget="N")}` to the user's question (N in tokens, trained for N in
  {BUDGET_RANGE[0]}–{BUDGET_RANGE[1]}, log-uniform; the three-digit counter reads up to 999).
  No instruction = **unlimited**: the terse chain (`7 + 5 = 12` per line).
  Thinking off: `chat_template_kwargs: {{"enable_thinking": false}}`.
- The thought fills the budget in steps of exactly {LINE_TOKENS} tokens that open with the budget left and a colon,
  then `a op k b` with values zero-padded: `064:07+007` (the start value), one step per operation `054:07+512`
  (7 + 5 = 12), identity steps on the answer `044:12+012` once done, and a digit countdown `3210` for the last
  < {LINE_TOKENS} tokens; `</think>` comes right after the N-th thought token. A budget too small for the whole chain
  ends the thought mid-chain and the answer is a guess, as under forcing.
- Thinking tokens = the tokens before `</think>` (the `\\n` the generation prompt ends with is not counted).

## Training
{training}

## Results
{results}

## Routing to a budget
{routing}

## Serve it behind the gateway
```
VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
  --served-model-name thinkgate-tiny --dtype float32 --enforce-eager --reasoning-parser qwen3
```
and give its tiers `budget_mode: prompted` (the gateway appends `budget_prompt`, default
`"{BUDGET_TEMPLATE}"`, to the last user message and keeps a hard stop at budget × 1.25 + 16: on vLLM
`hard_stop: native`, its own `thinking_token_budget`, one pass; elsewhere budget forcing) and
`thinking_budget_range: [{lo}, {hi}]`, the budgets it was trained to follow: a budget asked outside is served at the
nearest end (a request for 448 or 100000 tokens gets {hi}, one for 4 gets {lo}) and
`x-thinkgate-thinking-budget` says which. Or let the gateway do all of it: `thinkgate serve --model-dir DIR` (what
`make serve` runs for this directory) and `thinkgate bench savings --model-dir DIR` serve every tier from it with
the budgets and the `budget_range` in `dial.json`, the native hard stop and the router it names.

## Licence
Apache-2.0. Made only from generated data; no third-party data or weights.
"""


def write(model_dir: Path) -> list[Path]:
    """Write ``README.md`` and ``dial.json`` into ``model_dir`` (``dial.json`` names ``router.skops`` when it is
    there: the router ``thinkgate bench savings --model-dir`` serves); returns their paths."""
    card = model_dir / "README.md"
    card.write_text(render(model_dir))
    spec = model_dir / "dial.json"
    spec.write_text(
        json.dumps(
            {
                "budget_prompt": BUDGET_TEMPLATE,
                "budget_range": list(BUDGET_RANGE),
                "line_tokens": LINE_TOKENS,
                "tiers": TIER_BUDGETS,
                **({"router": "router.skops"} if (model_dir / "router.skops").is_file() else {}),
            },
            indent=2,
        )
        + "\n"
    )
    return [card, spec]


if __name__ == "__main__":
    for p in write(Path(sys.argv[1])):
        print(p)
