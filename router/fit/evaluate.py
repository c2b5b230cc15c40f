"""Evaluate a router on labelled items: AUC and the RouteLLM routing metrics, per data set, with a plot.

Outcomes per item come from ``short_correct``/``long_correct`` when measured (sources 2 and 3); otherwise
from the label (label 1 = short wrong, long right; label 0 = both right), marked ``outcomes="label"`` in the
result, where the routing numbers then say how much "needs long" traffic a threshold lets through.
Baselines: always-short (x = 0), always-long (x = 1), random (the straight line; APGR 0.5) and the oracle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from router.errors import require
from router.fit.labels import LabelledItem
from router.fit.metrics import (
    Curve,
    apgr,
    cost_reduction_at,
    cpt,
    frac_long_for_quality,
    oracle_curve,
    random_curve,
    routing_curve,
)


@dataclass
class EvalResult:
    """Metrics of one router on one data set. Fractions in [0, 1]; NaN where undefined (e.g. one class).

    ``cost_reduction_95``: 1 − cost/cost(always long) at 95% of always-long quality (RouteLLM convention,
    short calls free unless ``short_cost_ratio`` > 0); ``random_cost_reduction_95``: the same for random
    routing. ``frac_long_95``: the fraction sent to long at that point.
    """

    name: str
    n: int
    pos_rate: float
    outcomes: str  # "measured" | "label" | "mixed"
    auc: float
    brier: float
    acc_at_half: float
    q_short: float
    q_long: float
    apgr: float
    oracle_apgr: float
    cpt50: float
    cpt80: float
    frac_long_95: float
    cost_reduction_95: float
    random_cost_reduction_95: float
    curve: Curve = field(repr=False)
    oracle: Curve = field(repr=False)

    def summary(self) -> dict[str, Any]:
        """JSON-able numbers (no curves), rounded to 4 decimals."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if isinstance(v, Curve):
                continue
            if isinstance(v, float):
                v = round(v, 4) if math.isfinite(v) else None
            out[k] = v
        return out


def outcomes_of(items: Sequence[LabelledItem]) -> tuple[np.ndarray, np.ndarray, str]:
    """Per-item (short_correct, long_correct) as float arrays (n,), and where they came from."""
    qs = np.empty(len(items))
    ql = np.empty(len(items))
    measured = 0
    for i, it in enumerate(items):
        if it.short_correct is not None and it.long_correct is not None:
            qs[i], ql[i] = float(it.short_correct), float(it.long_correct)
            measured += 1
        else:
            qs[i], ql[i] = 1.0 - it.label, 1.0
    kind = "measured" if measured == len(items) else ("label" if measured == 0 else "mixed")
    return qs, ql, kind


def auc_score(y: np.ndarray, s: np.ndarray) -> float:
    """ROC AUC (ties counted half); NaN when only one class is present."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, s)) if 0 < y.sum() < y.shape[0] else float("nan")


def evaluate_scores(
    name: str, items: Sequence[LabelledItem], scores: np.ndarray, short_cost_ratio: float = 0.0
) -> EvalResult:
    """All metrics for precomputed ``scores`` (n,) of ``items``."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.array([it.label for it in items], dtype=np.float64)
    qs, ql, kind = outcomes_of(items)
    curve = routing_curve(s, qs, ql)
    rnd = random_curve(qs, ql)
    orc = oracle_curve(qs, ql)
    return EvalResult(
        name=name,
        n=len(items),
        pos_rate=float(y.mean()),
        outcomes=kind,
        auc=auc_score(y, s),
        brier=float(np.mean((s - y) ** 2)),
        acc_at_half=float(np.mean((s >= 0.5) == (y == 1))),
        q_short=curve.q_short,
        q_long=curve.q_long,
        apgr=apgr(curve),
        oracle_apgr=apgr(orc),
        cpt50=cpt(curve, 0.5),
        cpt80=cpt(curve, 0.8),
        frac_long_95=_frac_at(curve, 0.95),
        cost_reduction_95=cost_reduction_at(curve, 0.95, short_cost_ratio),
        random_cost_reduction_95=cost_reduction_at(rnd, 0.95, short_cost_ratio),
        curve=curve,
        oracle=orc,
    )


def _frac_at(curve: Curve, ratio: float) -> float:
    return frac_long_for_quality(curve, ratio * curve.q_long)


def evaluate_grouped(
    name: str, items: Sequence[LabelledItem], scores: np.ndarray, *, by_source: bool = True,
    short_cost_ratio: float = 0.0,
) -> list[EvalResult]:
    """:func:`evaluate_scores` overall and per ``source`` (when several)."""
    results = [evaluate_scores(name, items, scores, short_cost_ratio)]
    sources = sorted({it.source for it in items})
    if by_source and len(sources) > 1:
        for src in sources:
            idx = [i for i, it in enumerate(items) if it.source == src]
            results.append(evaluate_scores(src, [items[i] for i in idx], scores[idx], short_cost_ratio))
    return results


def _pct(v: float) -> str:
    return "—" if not math.isfinite(v) else f"{100 * v:.1f}%"


def _num(v: float) -> str:
    return "—" if not math.isfinite(v) else f"{v:.3f}"


def render_table(results: Sequence[EvalResult], title: str = "Router evaluation") -> Any:
    """A ``rich.table.Table`` of the results (one row each)."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("data", "n", "%long lbl", "outcomes", "AUC", "short q", "long q", "APGR", "oracle APGR",
                "CPT(50%)", "CPT(80%)", "%long @95%", "cost red. @95%", "random @95%"):
        t.add_column(col, justify="right" if col not in ("data", "outcomes") else "left")
    for r in results:
        t.add_row(
            r.name, str(r.n), _pct(r.pos_rate), r.outcomes, _num(r.auc), _pct(r.q_short), _pct(r.q_long),
            _num(r.apgr), _num(r.oracle_apgr), _pct(r.cpt50), _pct(r.cpt80), _pct(r.frac_long_95),
            _pct(r.cost_reduction_95), _pct(r.random_cost_reduction_95),
        )
    return t


def plot_curves(results: Sequence[EvalResult], path: str | Path, title: str = "Quality vs % sent to long") -> Path:
    """PNG: one panel per result — router curve, random line, oracle, always-short/-long levels."""
    require("matplotlib", "report", "plotting router curves").use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        ax.plot(100 * r.curve.frac_long, 100 * r.curve.quality, label=f"router (APGR {r.apgr:.3f})", lw=1.8)
        ax.plot([0, 100], [100 * r.q_short, 100 * r.q_long], "--", color="grey", label="random (APGR 0.5)")
        ax.plot(100 * r.oracle.frac_long, 100 * r.oracle.quality, ":", color="green",
                label=f"oracle (APGR {r.oracle_apgr:.3f})")
        ax.axhline(100 * r.q_short, color="black", lw=0.8, ls="-.", label="always short")
        ax.axhline(100 * r.q_long, color="red", lw=0.8, ls="-.", label="always long")
        ax.axhline(95 * r.q_long, color="red", lw=0.6, ls=":", label="95% of always long")
        ax.set_xlabel("% of requests sent to long")
        ax.set_ylabel("quality (% correct)" if r.outcomes != "label" else "label-derived quality (%)")
        ax.set_title(f"{r.name} (n={r.n}, AUC {r.auc:.3f})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
