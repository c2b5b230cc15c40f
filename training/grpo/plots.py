"""PNG plots of a GRPO run from ``metrics.jsonl`` and ``ledger.jsonl``: reward, length, entropy, effective-signal
ratio, cost vs optimizer step (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from router.jsonl import read_jsonl


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(read_jsonl(path, missing_ok=True))


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and v == v:
            xs.append(float(r["step"]))
            ys.append(float(v))
    return xs, ys


def line_plot(
    path: Path,
    title: str,
    ylabel: str,
    lines: Sequence[tuple[str, tuple[Sequence[float], Sequence[float]]]],
    xlabel: str = "optimizer step",
    hlines: Sequence[tuple[str, float]] = (),
) -> Path | None:
    """One PNG with a line per ``(label, (xs, ys))``; empty series are left out and nothing is written (None)
    when all are empty. Shared by the run plots below and the ``bench/grpo_*.py`` experiment figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [(label, s) for label, s in lines if len(s[0])]
    if not lines:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=100)
    for label, (xs, ys) in lines:
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label)
    for (label, y), style in zip(hlines, ("-", "--", ":"), strict=False):
        ax.axhline(y, color="tab:red", linestyle=style, linewidth=1, label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


_plot = line_plot


def budget_lines(budget_usd: str | None, warn_fraction: float) -> list[tuple[str, float]]:
    """Horizontal lines of the cost plot, in micro-USD: the budget and its warning line (none without a budget)."""
    if budget_usd is None:
        return []
    from decimal import Decimal

    budget = float(Decimal(str(budget_usd)) * 1_000_000)
    return [(f"budget ${budget_usd}", budget), (f"warning ({warn_fraction:.0%})", budget * warn_fraction)]


def dedupe_by_step(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep the last row per step (a resumed run re-logs the steps after its checkpoint), in step order."""
    last: dict[Any, dict[str, Any]] = {}
    for r in rows:
        last[r.get("step")] = r
    return sorted(last.values(), key=lambda r: r.get("step") or 0)


def plot_run(run_dir: str | Path, budget_usd: str | None = None, warn_fraction: float = 0.8) -> list[Path]:
    """Write ``plots/{reward,length,entropy,signal,cost}.png`` under ``run_dir``: :func:`plot_metrics` and
    :func:`plot_cost`; returns the files written."""
    written = plot_metrics(run_dir)
    cost = plot_cost(run_dir, budget_usd, warn_fraction)
    return written + ([cost] if cost is not None else [])


def plot_cost(run_dir: str | Path, budget_usd: str | None = None, warn_fraction: float = 0.8) -> Path | None:
    """Write ``plots/cost.png``: the cumulative spend (micro-USD, rolled-back work included) after every ledger row
    — start-up at step 0, the steps, the finish row at the last step — with the budget and warning lines. None
    when the ledger has no rows."""
    run = Path(run_dir)
    return _plot(
        run / "plots" / "cost.png",
        "Cumulative cost",
        "micro-USD",
        [("spent (micro-USD)", _series(_read_jsonl(run / "ledger.jsonl"), "spent_micro_usd"))],
        hlines=budget_lines(budget_usd, warn_fraction),
    )


def warm_up() -> float:
    """Import matplotlib (Agg) and render one figure the size of the run plots, with a few lines, legend and a
    budget line, to PNG in memory; returns the seconds the figure took (the import not counted).

    Called at start-up, so the one-time costs of the finish's plots — the import, font loading — are billed there,
    before the budget checks, and the figure's time is what the ledger reserves per plot
    (``CostLedger.figure_ms``): the finish does only warm work it measured beforehand."""
    import io
    import time

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = time.perf_counter()
    xs = [float(i) for i in range(100)]
    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=100)
    for k in (1.0, 0.5, 0.25):
        ax.plot(xs, [k * x for x in xs], label=f"x{k:g}")
    ax.axhline(50.0, color="tab:red", linestyle="--", linewidth=1, label="budget")
    ax.set_title("warm-up")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("value")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(io.BytesIO(), format="png")
    plt.close(fig)
    return time.perf_counter() - t0


def plot_metrics(run_dir: str | Path, fits: Callable[[float], bool] | None = None) -> list[Path]:
    """Write ``plots/{reward,length,entropy,signal}.png`` from ``metrics.jsonl`` (one log per step); returns the
    files written (a plot without data is left out).

    ``fits(seconds)``, when given, is asked before each figure with the seconds of the slowest one drawn so far in
    this call (0.0 before the first); once it says False the remaining figures are not drawn (the finish of a run
    whose budget cannot cover them: ``run.report_run``)."""
    import time

    run = Path(run_dir)
    metrics = dedupe_by_step([r for r in _read_jsonl(run / "metrics.jsonl") if "loss" in r or "reward" in r])
    out = run / "plots"
    out.mkdir(exist_ok=True)
    reward_keys = sorted({k for r in metrics for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    figures: list[tuple[str, str, str, list[tuple[str, tuple[list[float], list[float]]]]]] = [
        (
            "reward.png",
            "Reward",
            "reward",
            [("total", _series(metrics, "reward"))] + [(k.split("/")[1], _series(metrics, k)) for k in reward_keys],
        ),
        (
            "length.png",
            "Completion length",
            "tokens",
            [
                ("mean", _series(metrics, "completions/mean_length")),
                ("mean terminated", _series(metrics, "completions/mean_terminated_length")),
            ],
        ),
        ("entropy.png", "Policy entropy", "nats/token", [("entropy", _series(metrics, "entropy"))]),
        (
            "signal.png",
            "Effective-signal ratio",
            "groups with variance / groups",
            [
                ("rolled out", _series(metrics, "signal/effective_ratio")),
                ("trained batch", _series(metrics, "signal/batch_effective_ratio")),
                ("truncated rate", _series(metrics, "completions/clipped_ratio")),
            ],
        ),
    ]
    written: list[Path] = []
    slowest = 0.0
    for name, title, ylabel, lines in figures:
        if fits is not None and not fits(slowest):
            break
        t0 = time.perf_counter()
        path = _plot(out / name, title, ylabel, lines)
        slowest = max(slowest, time.perf_counter() - t0)
        if path is not None:
            written.append(path)
    return written
