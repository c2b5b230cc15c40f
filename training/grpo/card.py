"""Model card (README.md in the output model directory) and the gateway tier snippet for a GRPO run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from training.grpo.tier_prices import tier_prices


def _table(summary: dict[str, Any] | None) -> list[str]:
    if not summary:
        return ["(not evaluated)"]
    lines = [
        "| difficulty | n | accuracy | mean completion tokens | mean thought tokens | truncated |",
        "|---|---|---|---|---|---|",
    ]
    rows = [*summary["by_difficulty"].items(), ("all", summary["overall"])]
    for d, s in rows:
        lines.append(
            f"| {d} | {s['n']} | {s['accuracy']:.3f} | {s['mean_completion_tokens']:.1f} | "
            f"{s['mean_thought_tokens']:.1f} | {s['truncated_rate']:.2f} |"
        )
    return lines


def model_card(
    run_name: str,
    base_model: str,
    config: dict[str, Any],
    eval_before: dict[str, Any] | None,
    eval_after: dict[str, Any] | None,
    ledger_summary: dict[str, Any],
) -> str:
    """Markdown card: base model, rewards, held-out accuracy and length per difficulty (before/after), cost."""
    rewards = ", ".join(f"{r['name']}×{r['weight']}" for r in config["rewards"])
    trl = config.get("trl", {})
    s = ledger_summary
    gain_pp = s.get("accuracy_gain_pp")
    if gain_pp is None:  # not evaluated before and after (eval off, or a budget stop skipped it): no gain is known
        gain = "Accuracy gain: not measured (no held-out evaluation before and after training); cost per accuracy " \
               "point: n/a"
    else:
        per_point = f"${s['usd_per_accuracy_point']}" if s.get("usd_per_accuracy_point") else "n/a (no gain)"
        gain = f"Accuracy gain: {gain_pp} percentage points; cost per accuracy point: {per_point}"
    lines = [
        f"# {run_name}",
        "",
        f"GRPO post-training of `{base_model}` with ThinkGate (`thinkgate train grpo`, TRL GRPOTrainer).",
        "",
        f"- Task: `{config['task']['name']}` ({config['task']['n_train']} training problems)",
        f"- Rewards: {rewards}; advantages: `{config['advantages']['aggregation']}`",
        f"- Dynamic sampling: {'on' if config['dynamic_sampling']['enabled'] else 'off'}; "
        f"group size {trl.get('num_generations')}, max completion {trl.get('max_completion_length')} tokens",
        f"- Steps: {s['steps']}; stop reason: {s.get('stop_reason') or 'max_steps'}",
        "",
        "## Held-out evaluation (greedy)",
        "",
        "After training:",
        "",
        *_table(eval_after),
        "",
        "Before training:",
        "",
        *_table(eval_before),
        "",
        "## Cost",
        "",
        f"- Device: {s['device_count']} × {s['device_kind']} at ${s['price_usd_per_device_hour']}/device-hour",
        f"- Spent: ${s['spent_usd']} ({s['device_hours']:.6f} device-hours; "
        f"{s['totals']['sampled_tokens']} sampled tokens, {s['totals']['trained_tokens']} trained tokens)",
        f"- {gain}",
        f"- Tags: {', '.join(f'{k}={v}' for k, v in s['tags'].items())}",
        "",
    ]
    return "\n".join(lines)


def tier_snippet(
    tier_name: str,
    served_model_name: str,
    base_url: str,
    model_dir: str | Path,
    max_completion_length: int,
    eval_after: dict[str, Any] | None,
    dial_prompt: str | None = None,
    prices: dict[str, dict[str, str]] | None = None,
) -> str:
    """YAML for the gateway config: a tier serving this model, ``thinking_budget`` = the held-out p95-ish budget
    (max of the per-difficulty mean thought tokens, rounded up to 8), and the command that serves it.

    ``dial_prompt``: the budget instruction of a dial run (``budget_prompt.template`` when the run trained with
    ``dial_length``): the model follows the budget in its prompt, so the snippet is the three ``prompted`` tiers
    (``none`` thinking off, ``short`` 32 tokens, ``long`` unlimited: the default tiers' names, so ``reasoning_effort``
    and routing find them) with vLLM's native hard stop, as docs/local-model.md serves the shipped dial model.

    ``prices``: the run file's ``output.tier_prices`` (tier name -> USD per 1M tokens). Each tier carries its
    prices — those, else the shipped default tier of the same name's (:mod:`training.grpo.tier_prices`): the snippet
    replaces that tier, and a tier without prices is metered at $0. A tier name with neither gets none and a
    header line saying so.

    Without a held-out evaluation after training (``eval.after: false``, or a budget's hard stop skipped it) the
    thought lengths are unknown: ``thinking_budget`` is then ``max_completion_length`` — no training rollout could
    think longer — and the header says so (``null`` would be *unlimited* thinking)."""
    port = base_url.rsplit(":", 1)[-1].split("/")[0]
    header = (
        f"# Gateway tier for the GRPO model in {model_dir}.\n"
        f"# Serve it (CPU build of vLLM; see docs/training.md):\n"
        f"#   VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model {model_dir} \\\n"
        f"#     --served-model-name {served_model_name} --port {port} --dtype float32 --enforce-eager \\\n"
        f"#     --reasoning-parser qwen3\n"
        f"# then merge this into the gateway config's `tiers:` (replacing the tier of the same name).\n"
    )
    configured = prices or {}
    if dial_prompt is not None:
        common = {"base_url": base_url, "model": served_model_name}
        tiers = [
            {"name": "none", **common, "budget_mode": "off", "thinking_budget": 0,
             "enable_thinking": False, "max_tokens": 64},
            {"name": "short", **common, "budget_mode": "prompted", "budget_prompt": dial_prompt,
             "thinking_budget": 32, "hard_stop": "native", "max_tokens": 96},
            {"name": "long", **common, "budget_mode": "prompted", "budget_prompt": dial_prompt,
             "thinking_budget": None, "hard_stop": "native", "max_tokens": int(max_completion_length + 32)},
        ]
        header = header.replace("the tier of the same name", "the tiers of the same names")
        header += ("# A dial model: each tier states its budget in the prompt (a request's thinking_token_budget\n"
                   "# dials it lower). To serve it with --model-dir and a budget router instead, see\n"
                   "# docs/training.md, *A dial model* (steps 3-5).\n")
        header += _prices_note([t["name"] for t in tiers], configured)
        return header + yaml.safe_dump({"tiers": [_priced(t, configured) for t in tiers]}, sort_keys=False)
    if eval_after and eval_after.get("by_difficulty"):
        worst = max(v["mean_thought_tokens"] for v in eval_after["by_difficulty"].values())
        budget = max(8, int(math.ceil(worst / 8.0) * 8))
    else:
        budget = int(max_completion_length)
        header += (f"# thinking_budget: not measured (no held-out evaluation after training: eval.after is off or a\n"
                   f"# budget stop skipped it); {budget} = trl.max_completion_length, the longest thought a training\n"
                   f"# rollout could have. Evaluate model/ and lower it to the measured thought length.\n")
    tier = {
        "name": tier_name,
        "base_url": base_url,
        "model": served_model_name,
        "max_tokens": int(max_completion_length + 32),
        "thinking_budget": budget,
        "budget_mode": "native",
    }
    header += _prices_note([tier_name], configured)
    return header + yaml.safe_dump({"tiers": [_priced(tier, configured)]}, sort_keys=False)


def _priced(tier: dict[str, Any], configured: dict[str, dict[str, str]]) -> dict[str, Any]:
    """``tier`` with its ``prices`` (:func:`training.grpo.tier_prices.tier_prices`), when any are known."""
    p = tier_prices(tier["name"], configured)
    return {**tier, "prices": p} if p is not None else tier


def _prices_note(names: list[str], configured: dict[str, dict[str, str]]) -> str:
    """Header lines: where the tiers' prices come from, and which tiers have none (metered at $0)."""
    unpriced = [n for n in names if tier_prices(n, configured) is None]
    note = ("# prices: USD per 1M tokens, from the run file's output.tier_prices, else the shipped default tier of\n"
            "# the same name's; set output.tier_prices.<tier> to your own.\n")
    if unpriced:
        note += (f"# NO PRICES for tier(s) {', '.join(unpriced)} (no default tier of that name): the gateway meters\n"
                 f"# them at $0 and no spend budget binds; add prices: or set output.tier_prices.\n")
    return note
