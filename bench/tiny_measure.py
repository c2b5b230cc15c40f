"""Accuracy of the served model per difficulty × thinking budget, through the real vLLM server.

    python -m bench.tiny_measure [--model-dir DIR] [--base-url URL] [--per-level 40] \
        [--budgets 16,24,32,48,64,128,256] [--json FILE]

Starts a :class:`gateway.engine.vllm.LocalEngine` for ``--model-dir`` (unless ``--base-url`` points at a running
server), sends each held-out ``arith`` problem as a chat completion (temperature 0) with vLLM's
``thinking_token_budget`` for each budget, and once with ``chat_template_kwargs.enable_thinking=false``;
verifies ``message.content`` and reads ``usage.completion_tokens_details.reasoning_tokens`` (tokens). Prints a
Markdown table and writes JSON: ``{"engine_start_s", "n_per_level", "settings": {NAME: {"accuracy",
"mean_reasoning_tokens", "max_reasoning_tokens", "by_difficulty": {LEVEL: {same keys}}}}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.probe import Outcome, ProbeClient, Target, probe, summarize
from router.tasks import Problem, load_task, verify
from training.tiny.card import markdown


def _summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    s = summarize(outcomes)
    return {"n": s["requests"], "accuracy": round(s["accuracy"], 4),
            "mean_reasoning_tokens": round(s["mean_reasoning_tokens"], 2),
            "max_reasoning_tokens": s["max_reasoning_tokens"]}


def measure(
    base_url: str,
    model: str,
    problems: Sequence[Problem],
    settings: dict[str, tuple[int | None, bool]],
    concurrency: int = 16,
    max_tokens: int = 1024,
) -> dict[str, Any]:
    """Run every problem under every setting (name → (thinking budget or None for unlimited, thinking on));
    per-setting and per-level summaries. The calls go through :func:`router.probe.probe` (temperature 0)."""
    out: dict[str, Any] = {}
    with ProbeClient(base_url, None, max_retries=0, max_connections=concurrency) as client:
        for name, (budget, thinking) in settings.items():
            body: dict[str, Any] = {"max_tokens": max_tokens}
            if not thinking:
                body["chat_template_kwargs"] = {"enable_thinking": False}
            elif budget is not None:
                body["thinking_token_budget"] = budget
            outcomes = probe(client, problems, [Target(model, body, name)], concurrency=concurrency, verify=verify)
            levels = sorted({p.difficulty for p in problems})
            out[name] = _summary(outcomes) | {
                "budget": budget,
                "thinking": thinking,
                "by_difficulty": {d: _summary([o for o in outcomes if o.problem.difficulty == d]) for d in levels},
            }
            print(f"{name}: {out[name]['accuracy']:.3f}", file=sys.stderr, flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from gateway.config import DEFAULT_MODEL_DIR, EngineConfig
    from gateway.engine.redis_server import free_port
    from gateway.engine.vllm import LocalEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--base-url", default=None, help="use this running server instead of starting one")
    ap.add_argument("--model", default="thinkgate-tiny")
    ap.add_argument("--per-level", type=int, default=40)
    ap.add_argument("--levels", default="1,2,3,4,5,6")
    ap.add_argument("--budgets", default="16,24,32,48,64,128,256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    problems = load_task("arith", "test", args.per_level * len(levels), args.seed, levels)
    settings: dict[str, tuple[int | None, bool]] = {"thinking off": (None, False)}
    settings |= {f"budget {b}": (int(b), True) for b in args.budgets.split(",")}
    settings["unlimited"] = (None, True)
    engine = None
    base_url = args.base_url
    if base_url is None:
        engine = LocalEngine(EngineConfig(model_path=args.model_dir, port=free_port()))
        engine.start()
        base_url = engine.base_url
        print(f"engine healthy after {engine.startup_s:.1f} s", file=sys.stderr)
    try:
        result = measure(base_url, args.model, problems, settings)
    finally:
        if engine is not None:
            engine.stop()
    report = {
        "engine_start_s": engine.startup_s if engine else None,
        "n_per_level": args.per_level,
        "seed": args.seed,
        "settings": result,
    }
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
