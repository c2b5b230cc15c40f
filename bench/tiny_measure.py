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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from router.tasks import Problem, load_task, verify


def ask(
    client: httpx.Client,
    base_url: str,
    model: str,
    problem: Problem,
    budget: int | None,
    thinking: bool = True,
    max_tokens: int = 1024,
) -> dict[str, Any]:
    """One chat completion; returns ``{"correct", "reasoning_tokens", "content", "reasoning", "finish_reason"}``.

    ``budget`` None sends no ``thinking_token_budget`` (unlimited up to ``max_tokens``).
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": problem.question}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    elif budget is not None:
        body["thinking_token_budget"] = budget
    r = client.post(f"{base_url}/chat/completions", json=body)
    r.raise_for_status()
    data = r.json()
    msg = data["choices"][0]["message"]
    content = msg.get("content") or ""
    details = (data.get("usage") or {}).get("completion_tokens_details") or {}
    return {
        "correct": verify(problem, content),
        "reasoning_tokens": int(details.get("reasoning_tokens") or 0),
        "content": content,
        "reasoning": msg.get("reasoning"),
        "finish_reason": data["choices"][0]["finish_reason"],
    }


def _summary(rows: Sequence[tuple[Problem, dict[str, Any]]]) -> dict[str, Any]:
    toks = [r["reasoning_tokens"] for _, r in rows]
    return {
        "n": len(rows),
        "accuracy": round(sum(r["correct"] for _, r in rows) / len(rows), 4),
        "mean_reasoning_tokens": round(sum(toks) / len(toks), 2),
        "max_reasoning_tokens": max(toks),
    }


def measure(
    base_url: str,
    model: str,
    problems: Sequence[Problem],
    settings: dict[str, tuple[int | None, bool]],
    concurrency: int = 16,
) -> dict[str, Any]:
    """Run every problem under every setting (name → (budget, thinking)); per-setting and per-level summaries."""
    out: dict[str, Any] = {}
    with httpx.Client(timeout=300, trust_env=False) as client, ThreadPoolExecutor(concurrency) as pool:
        for name, (budget, thinking) in settings.items():
            results = list(pool.map(lambda p, b=budget, t=thinking: ask(client, base_url, model, p, b, t), problems))
            rows = list(zip(problems, results, strict=True))
            levels = sorted({p.difficulty for p in problems})
            out[name] = _summary(rows) | {
                "budget": budget,
                "thinking": thinking,
                "by_difficulty": {d: _summary([(p, r) for p, r in rows if p.difficulty == d]) for d in levels},
            }
            print(f"{name}: {out[name]['accuracy']:.3f}", file=sys.stderr, flush=True)
    return out


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
