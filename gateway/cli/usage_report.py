"""Presentation of the usage report (``thinkgate usage report``): a rich table and a matplotlib PNG.

The numbers come from :mod:`gateway.ledger.report` (compute only); this module only draws them, so the ledger
package never imports rich or matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.ledger.event import micro_to_usd
from gateway.ledger.report import SavingsReport
from gateway.ledger.report import usd_text as _usd
from router.errors import require


def render(report: SavingsReport) -> Any:
    """A rich renderable: tiers table, buckets table and the headline."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    tt = Table(title="Spend by tier (upstream tokens; USD)")
    for c in ("tier", "events", "cache hits", "prompt tok", "completion tok", "reasoning tok", "spend USD",
              "cache saved USD"):
        # fold, never cut: in a narrow or piped terminal rich shortened amounts to "0.0001…" (a bill must not)
        tt.add_column(c, justify="left" if c == "tier" else "right", overflow="fold")
    for t in report.tiers:
        tt.add_row(t.tier, str(t.events), str(t.cache_hits), str(t.prompt_tokens), str(t.completion_tokens),
                   str(t.reasoning_tokens), _usd(t.cost_micro_usd), _usd(t.saved_micro_usd))
    bt = Table(title=f"Always-{report.long_tier} counterfactual by difficulty bucket")
    for c in ("bucket", "requests", "spend USD", "shadow USD", f"{report.long_tier} samples", "mean completion tok",
              "estimate", f"always-{report.long_tier} USD"):
        bt.add_column(c, justify="left" if c == "bucket" else "right", overflow="fold")
    for b in report.buckets:
        mean = b.long_mean_completion_tokens
        bt.add_row(b.bucket, str(b.requests), _usd(b.cost_micro_usd), _usd(b.shadow_micro_usd), str(b.long_samples),
                   "—" if mean is None else f"{mean:.1f}", b.estimate, _usd(b.always_long_micro_usd) or "—")
    parts: list[Any] = [tt, bt, Text(headline(report))]
    parts += [Text("note: " + n, style="yellow") for n in report.notes]
    return Group(*parts)


def headline(report: SavingsReport) -> str:
    """The report's two summary lines: served spend against the always-long estimate, then the shadow spend, the net
    and the total paid.

    The first line compares like with like: the savings are computed on what the served requests cost, so that is
    the spend it names. The total (served + shadow calls + any failed call that was billed) follows on the second
    line: shown first, a day that shadowed every cheap answer read "spend 0.127 above always-long 0.123, saved 46%".
    """
    s = report.summary()
    frac = s["savings_fraction"]
    served, shadow = report.request_spend_micro_usd, report.shadow_spend_micro_usd
    # billed events that are neither a request nor a shadow call (a failed call billed its prompt): named, so the
    # total is seen to add up
    other = report.spend_micro_usd - served - shadow
    parts = f"served {_usd(served)} + shadow {_usd(shadow)}" + (f" + other calls {_usd(other)}" if other else "")
    return (f"served spend {_usd(served)} USD over {report.requests} requests ({report.events} events); "
            f"cache saved {s['cache_saved_usd']} USD; always-{report.long_tier} estimate "
            f"{s['always_long_usd'] or 'n/a'} USD; saved {s['savings_usd'] or 'n/a'} USD"
            + (f" ({frac:.1%})" if frac is not None else "") + " on served traffic"
            + f"\nshadow calls (learning) {s['shadow_spend_usd']} USD; net of them saved "
            f"{s['net_savings_usd'] or 'n/a'} USD; total spend {s['spend_usd']} USD ({parts})")


def plot(report: SavingsReport, path: Path) -> None:
    """PNG: spend and cache savings per tier (left); actual vs always-long per bucket (right). USD."""
    require("matplotlib", "report", "thinkgate usage report --png").use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [t.tier for t in report.tiers]
    spend = [float(micro_to_usd(t.cost_micro_usd)) for t in report.tiers]
    saved = [float(micro_to_usd(t.saved_micro_usd)) for t in report.tiers]
    ax1.bar(names, spend, label="spend")
    ax1.bar(names, saved, bottom=spend, label="cache saved", alpha=0.6)
    cf = report.always_long_micro_usd
    # the always-long estimate prices the served requests: set against their spend, the shadow calls apart
    title = (f"served spend {_usd(report.request_spend_micro_usd)} USD (+ shadow "
             f"{_usd(report.shadow_spend_micro_usd)} USD)")
    if cf is not None:
        title += f" vs always-{report.long_tier} {_usd(cf)} USD"
    ax1.set_title(title, fontsize=9)
    ax1.set_ylabel("USD")
    ax1.legend()
    labels = [b.bucket for b in report.buckets]
    x = range(len(labels))
    served = [float(micro_to_usd(b.cost_micro_usd)) for b in report.buckets]
    ax2.bar([i - 0.2 for i in x], served, width=0.4, label="actual (served)")
    ax2.bar([i - 0.2 for i in x], [float(micro_to_usd(b.shadow_micro_usd)) for b in report.buckets], width=0.4,
            bottom=served, label="shadow (learning)", alpha=0.6)
    ax2.bar([i + 0.2 for i in x], [float(micro_to_usd(b.always_long_micro_usd or 0)) for b in report.buckets],
            width=0.4, label=f"always-{report.long_tier} (est.)",
            color=["tab:orange" if b.estimate == "measured" else "tab:gray" for b in report.buckets])
    ax2.set_xticks(list(x), labels, rotation=45, fontsize=7)
    ax2.set_xlabel("router difficulty bucket (gray: long-tier overall mean used)")
    ax2.set_ylabel("USD")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

