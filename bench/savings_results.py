"""The savings bench for ``bench/RESULTS.md``: ``thinkgate bench savings`` plus the "Savings" section.

Runs :func:`bench.savings_stack.run` (the whole stack, five policies; see ``docs/savings.md``) — or reads the JSON
of an earlier run with ``--from-json`` — writes ``bench/results/savings.{json,png,md}`` and, with
``--write-results``, replaces the "Savings" section of ``bench/RESULTS.md`` (other sections are kept). The
section states what ran (model files' last commit and hash, router, tier budgets, machine, load) and the targets
met or not, with the numbers.

    .venv/bin/python bench/savings_results.py [--n 120] [--engine-url URL] [--from-json FILE] [--write-results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from bench import savings_stack as sv
from bench._lib.results_md import write_section
from gateway.config import DEFAULT_MODEL_DIR, Settings

REPO = Path(__file__).resolve().parent.parent

OUT = REPO / "bench" / "results"
SECTION = "## Savings"


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def model_hash(path: Path = DEFAULT_MODEL_DIR) -> str:
    """SHA-256 (first 12 hex) of the model's weight files, to name the model a table was measured with."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def router_words(stack: dict[str, Any]) -> str:
    """The router the run served, for the section's header line: its path (relative to the checkout when inside it),
    its content's SHA-256 (first 12 hex) and version (``thinkgate router info``'s) — the path alone named two runs the
    same though another router was saved there between them. A JSON of a run before the stack block named the digest
    gives the path alone; one before it named the path, the shipped router (what those runs served)."""
    path = stack.get("router")
    if path is None:
        return "the shipped router (`router/assets/default.skops`)"
    if path == "None":  # routing.router_path: null — the stack block holds str() of it
        return "no router file (default-tier mode)"
    shown = Path(path)
    if shown.is_relative_to(REPO):
        shown = shown.relative_to(REPO)
    ident = [f"sha256 {stack['router_sha256']}"] if stack.get("router_sha256") else []
    ident += [f"version {stack['router_version']}"] if stack.get("router_version") else []
    return f"the router `{shown}`" + (f" ({', '.join(ident)})" if ident else "")


def section(result: dict[str, Any], started: str, load: float) -> str:
    """The Markdown "Savings" section for ``result``."""
    w, st = result["workload"], result.get("stack", {})
    tiers = ", ".join(f"`{k}` budget {v['thinking_budget']} / max {v['max_tokens']}"
                      for k, v in st.get("tiers", {}).items())
    lines = [
        SECTION, "",
        f"`bench/savings_results.py` (= `thinkgate bench savings`) — {started}, {result['wall_s']:.0f} s in all "
        f"(engine start-up {st.get('engine_startup_s', '—')} s). The whole stack on this machine: Redis, the local "
        f"vLLM engine with the model in `models/thinkgate-tiny` (weights sha256 "
        f"{st.get('model_sha256') or model_hash()}, last commit of the folder "
        f"{git('log', '-1', '--format=%h', '--', 'models')}), two `thinkgate serve` with "
        f"{router_words(st)}; tiers {tiers}. Workload: {w['n']} requests per policy "
        f"({w['synthetic']} synthetic arithmetic held-out levels 1–6, {w['real']} GSM8K/MATH test questions), "
        f"{w['repeat_fraction']:.0%} repeats, temperature 0, {w['concurrency']} in flight, seed {w['seed']}. "
        f"Accuracy = the synthetic task's verifier; *real* = GSM8K/MATH (the tiny model cannot solve them: routing "
        f"and cost only). Tokens, cost and cache hits are read from the metering ledger (each policy's own keys), "
        f"tokens are upstream tokens; latency is client-side (queueing at {w['concurrency']} in flight included). "
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with training jobs (load average "
        f"{load:.1f} at the start), Python {platform.python_version()}; commit {git('rev-parse', '--short', 'HEAD')}. "
        f"JSON: `bench/results/savings.json`; frontier: `bench/results/savings.png`.",
        "",
        sv.markdown(result),
        "",
    ]
    for name, t in result.get("targets", {}).items():
        tok, acc = t["reasoning_tokens_vs_long"], t["accuracy_vs_long"]
        syn, lsyn = result["policies"][name]["synthetic"], result["policies"]["long"]["synthetic"]
        lines.append(
            f"- **{name} vs always-long, synthetic task**: reasoning tokens {syn['reasoning_tokens']} vs "
            f"{lsyn['reasoning_tokens']} = {sv._fmt(tok, '.1%')} (target ≤ 40%), accuracy "
            f"{sv._fmt(syn['accuracy'], '.1%')} vs {sv._fmt(lsyn['accuracy'], '.1%')} = {sv._fmt(acc, '.1%')} "
            f"(target ≥ 98%): **{'met' if t['met'] else 'not met'}**.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=sv.BenchConfig.n)
    ap.add_argument("--concurrency", type=int, default=sv.BenchConfig.concurrency)
    ap.add_argument("--engine-url", default=None, help="a running vLLM server for every tier")
    ap.add_argument("--from-json", type=Path, default=None, help="use this earlier run instead of running")
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        started = result.get("started", started)
        load = result.get("load_average", load)
    else:
        settings = Settings.load(None)
        if args.engine_url:
            for t in settings.tiers:
                t.base_url = args.engine_url
        result = sv.run(sv.BenchConfig(n=args.n, concurrency=args.concurrency), settings,
                        start_engine=not args.engine_url)
        result.update({"started": started, "load_average": load})
    OUT.mkdir(exist_ok=True)
    sv.write_json(result, OUT / "savings.json")
    sv.plot(result, OUT / "savings.png")
    (OUT / "savings.md").write_text(sv.markdown(result) + "\n")
    text = section(result, started, load)
    print(text)
    if args.write_results:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
