"""Shared helpers of the GRPO experiments (``bench/grpo_*.py``): run one variant, tabulate, write RESULTS.md.

Every experiment starts from the same run file (``--config``, default ``training/configs/bench.yaml``) and changes
one thing. Results go under ``--out`` (default ``runs/bench``), tables into the *Training* section of
``bench/RESULTS.md`` (only that section is rewritten), figures into ``bench/results/``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
FIGURES = ROOT / "bench" / "results"
SECTION = "Training"


def load_base(config: str | Path) -> Any:
    from training.grpo.config import load_config

    return load_config(config)


def variant(base: Any, **changes: Any) -> Any:
    """A deep copy of the run config with top-level fields replaced (dataclass or dict values)."""
    cfg = copy.deepcopy(base)
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def run_variant(cfg: Any, out_dir: Path, fresh: bool = True) -> dict[str, Any]:
    """Run one variant into ``out_dir`` (removed first when ``fresh``); returns summary + evals + per-row ledger."""
    from training.grpo.run import run_grpo

    if fresh and out_dir.exists():
        shutil.rmtree(out_dir)
    t0 = time.perf_counter()
    summary = run_grpo(cfg, output_dir=out_dir, progress=False)
    wall = time.perf_counter() - t0

    def read(name: str) -> Any:
        p = out_dir / name
        return json.loads(p.read_text()) if p.is_file() else None

    def lines(name: str) -> list[dict[str, Any]]:
        p = out_dir / name
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []

    return {
        "summary": summary,
        "before": read("eval_before.json"),
        "after": read("eval_after.json"),
        "ledger": lines("ledger.jsonl"),
        "metrics": [m for m in lines("metrics.jsonl") if "loss" in m],
        "heldout": lines("heldout.jsonl"),
        "wall_s": wall,
        "dir": str(out_dir),
    }


def mean_metric(metrics: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [m[key] for m in metrics if isinstance(m.get(key), int | float)]
    return sum(vals) / len(vals) if vals else None


def environment_line(cfg: Any) -> str:
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    weights = Path(cfg.model.path)
    weights = weights if weights.is_absolute() else ROOT / weights
    try:
        digest = hashlib.sha256((weights / "model.safetensors").read_bytes()).hexdigest()[:12]
    except OSError:
        digest = "unknown"
    trl = cfg.trl_kwargs()
    ev = cfg.eval
    mode = "greedy" if ev.temperature == 0 else f"sampled at temperature {ev.temperature:g}, {ev.samples} per problem"
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; model `{Path(cfg.model.path).name}` (weights sha256 "
        f"{digest}), task "
        f"`{cfg.task.name}` ({cfg.task.n_train} train / {cfg.task.n_eval} held-out problems, difficulties "
        f"{cfg.task.difficulties or 'all'}), {trl.get('max_steps')} GRPO steps of "
        f"{trl.get('per_device_train_batch_size')} rollouts (group {trl.get('num_generations')}, "
        f"max {trl.get('max_completion_length')} tokens), "
        f"{cfg.threads} torch thread(s) on {os.cpu_count()} shared CPU cores ({platform.machine()}, load "
        f"{load:.1f} at the end), commit {commit}. Held-out evaluation: {mode}."
    )


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def write_subsection(title: str, body: str, path: Path = RESULTS_MD) -> None:
    """Replace (or append) ``### title`` inside ``## Training`` of RESULTS.md, leaving other sections alone."""
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    sec = re.search(rf"^## {SECTION}\s*$", text, flags=re.M)
    if sec is None:
        text = text.rstrip("\n") + f"\n\n## {SECTION}\n\nGRPO experiments (`bench/grpo_*.py`, docs/training.md).\n"
        sec = re.search(rf"^## {SECTION}\s*$", text, flags=re.M)
        assert sec is not None
    nxt = re.search(r"^## ", text[sec.end() :], flags=re.M)
    end = sec.end() + nxt.start() if nxt else len(text)
    section = text[sec.end() : end]
    block = f"### {title}\n\n{body.strip()}\n\n"
    sub = re.search(rf"^### {re.escape(title)}\s*$", section, flags=re.M)
    if sub:
        nsub = re.search(r"^### ", section[sub.end() :], flags=re.M)
        send = sub.end() + nsub.start() if nsub else len(section)
        section = section[: sub.start()] + block + section[send:]
    else:
        section = section.rstrip("\n") + "\n\n" + block
    path.write_text(text[: sec.end()] + section.rstrip("\n") + "\n" + ("\n" + text[end:] if end < len(text) else ""))


def plot_lines(
    path: Path, title: str, xlabel: str, ylabel: str, series: Sequence[tuple[str, Sequence[float], Sequence[float]]]
) -> Path:
    """The experiments' figures, drawn by the package's plotter (``training.grpo.plots.line_plot``)."""
    from training.grpo.plots import line_plot

    out = line_plot(path, title, ylabel, [(label, (xs, ys)) for label, xs, ys in series], xlabel=xlabel)
    if out is None:
        raise ValueError(f"{path}: no data to plot")
    return out


def per_difficulty_rows(
    name: str,
    ev: dict[str, Any] | None,
    extra: Callable[[str], list[Any]] | None = None,
) -> list[list[Any]]:
    if not ev:
        return []
    rows = []
    for d, s in [*ev["by_difficulty"].items(), ("all", ev["overall"])]:
        rows.append(
            [
                name,
                d,
                s["accuracy"],
                s["mean_completion_tokens"],
                s["mean_thought_tokens"],
                s["truncated_rate"],
                *(extra(d) if extra else []),
            ]
        )
    return rows


def before_after_tokens(r: dict[str, Any]) -> str:
    """``"<before> → <after>"`` mean completion tokens of a variant's held-out evaluations."""
    before, after = r["before"]["overall"], r["after"]["overall"]
    return f"{before['mean_completion_tokens']:.1f} → {after['mean_completion_tokens']:.1f}"
