"""``thinkgate usage report``: the savings report an operator puts in front of finance, from the ledger alone.

Source: the usage events of the metering ledger (the Redis Stream ``usage:events``, read with
:meth:`gateway.state.metering.Meter.events`, the same reader as ``thinkgate usage export``). Nothing is recomputed
from requests; the only input besides the events is the price list of the counterfactual tier (the
configuration's ``long`` tier, "current prices", as ``saved_micro_usd`` of cache hits uses).

What it reports (money in exact integer micro-USD, 1 USD = 1 000 000; tokens are upstream tokens):

- **Spend by tier**: per tier the events, tokens (prompt / completion / reasoning), ``cost_micro_usd``
  (what was paid) and ``saved_micro_usd`` (cache hits: what the upstream call would have cost).
- **Cache savings**: the sum of ``saved_micro_usd``.
- **Counterfactual always-long**: the estimated cost had every request been answered by the long tier's
  upstream (no routing, no cache). Per request (an event that is not an escalated first attempt —
  ``error_code`` ``escalated_*``: its retry event stands for the request —, not a shadow call — route reason
  ``shadow``: the gateway's own call to learn from, paid but asked by no client — and not refused, status < 400
  or 499): its own prompt tokens (and upstream-prefix-cached tokens) at the long tier's input prices plus the
  long tier's **measured mean completion tokens** for the request's difficulty bucket at the output price.
  Buckets are ``n_buckets`` equal-width bins of the router score ``difficulty`` in [0, 1] (deciles by
  default; score 1.0 falls in the last bin); events without a score form the bucket ``unscored``. The mean
  of a bucket comes from the events that ran on the long tier in it (uncached, status 200, complete); a
  bucket with none falls back to the long tier's overall mean, and the row says so (``estimate:
  fallback``). With no long-tier event at all there is no estimate (``None``).
- **Savings** (on served traffic) = counterfactual − what the served requests cost (their escalated first
  attempts included), and the share of the counterfactual saved.
- **Shadow spend** (learning): what the shadow calls cost (route reason ``shadow``: the next tier asked, after
  the client had its answer, to label the cheap one for retraining). Paid, so in the spend; asked by no client, so
  not in the savings: counted there, a first day that shadowed every cheap answer read −4.5% saved with nothing to
  say why. It is its own line, and **net savings** = savings − shadow spend says what the learning costs on top.

The counterfactual cost of a bucket is a ``Decimal`` sum (prices in USD per 1M tokens are micro-USD per
token, so no division is needed except the mean) rounded once, half up, to micro-USD; the total is rounded
once from the unrounded bucket sums.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from gateway.config import Prices, Settings
from gateway.ledger.event import UsageEvent, micro_to_usd

UNSCORED = "unscored"


def bucket_of(difficulty: float | None, n_buckets: int = 10) -> str:
    """Bucket label of a router score: ``"0.3-0.4"`` for deciles (``"0.25-0.50"`` for quartiles),
    ``unscored`` for None.

    Equal-width bins over [0, 1]; values outside are clamped (1.0 lands in the last bin).
    """
    if difficulty is None:
        return UNSCORED
    i = min(n_buckets - 1, max(0, int(float(difficulty) * n_buckets)))
    lo, hi = Decimal(i) / n_buckets, Decimal(i + 1) / n_buckets
    places = 1 if 10 % n_buckets == 0 else 2 if 100 % n_buckets == 0 else 3
    return f"{lo:.{places}f}-{hi:.{places}f}"


def _round_micro(value: Decimal) -> int:
    return int(value.quantize(Decimal(1), rounding=ROUND_HALF_UP))


def long_tier_of(settings: Settings) -> str:
    """The counterfactual tier (the report's and the dashboard's): ``long`` when configured, else the last tier
    (the top of the ladder)."""
    names = [t.name for t in settings.tiers]
    return "long" if "long" in names else names[-1]


def counts_as_request(event: UsageEvent) -> bool:
    """True when the event stands for one answered client request (see the module doc): not an escalated first
    attempt (its retry stands for the request), not a shadow call (the gateway's own, to learn from), not refused."""
    if event.error_code and event.error_code.startswith("escalated_"):
        return False
    if event.route_reason == "shadow":
        return False
    return event.status < 400 or event.status == 499


def is_long_sample(event: UsageEvent, long_tier: str) -> bool:
    """True when the event measures the long tier: ran on it upstream, complete, status 200."""
    return (event.tier == long_tier and not event.cached and event.status == 200 and not event.partial
            and not (event.error_code or "").startswith("escalated_"))


@dataclass
class TierSpend:
    """Spend of one tier: events, upstream tokens, paid and saved micro-USD."""

    tier: str
    events: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost_micro_usd: int = 0
    saved_micro_usd: int = 0


@dataclass
class BucketRow:
    """One difficulty bucket: requests, what they cost, and the always-long estimate.

    ``long_mean_completion_tokens`` is the mean the estimate used (tokens); ``estimate`` is ``measured``
    (from this bucket's long-tier events), ``fallback`` (the long tier's overall mean) or ``none``.
    """

    bucket: str
    requests: int = 0
    cost_micro_usd: int = 0
    saved_micro_usd: int = 0
    shadow_micro_usd: int = 0  # the bucket's shadow calls (learning): paid, not in ``cost_micro_usd``
    long_samples: int = 0
    long_completion_sum: int = 0
    long_reasoning_sum: int = 0
    long_mean_completion_tokens: Decimal | None = None
    estimate: str = "none"
    always_long_exact: Decimal | None = None
    prompt_part: Decimal = Decimal(0)

    @property
    def always_long_micro_usd(self) -> int | None:
        return None if self.always_long_exact is None else _round_micro(self.always_long_exact)


@dataclass
class SavingsReport:
    """The whole report; see the module doc for every definition. Money: integer micro-USD."""

    events: int
    requests: int
    tiers: list[TierSpend]
    buckets: list[BucketRow]
    long_tier: str
    long_prices: Prices
    long_mean_completion_tokens: Decimal | None
    since: float | None = None
    until: float | None = None
    key: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def spend_micro_usd(self) -> int:
        """Everything paid (every event, escalated first attempts and errors included)."""
        return sum(t.cost_micro_usd for t in self.tiers)

    @property
    def request_spend_micro_usd(self) -> int:
        """Paid for the requests the counterfactual covers, incl. their escalated first attempts (served traffic;
        no shadow call)."""
        return sum(b.cost_micro_usd for b in self.buckets)

    @property
    def shadow_spend_micro_usd(self) -> int:
        """Paid for shadow calls (learning): part of :attr:`spend_micro_usd`, not of the served requests'."""
        return sum(b.shadow_micro_usd for b in self.buckets)

    @property
    def cache_saved_micro_usd(self) -> int:
        return sum(t.saved_micro_usd for t in self.tiers)

    @property
    def always_long_micro_usd(self) -> int | None:
        if self.long_mean_completion_tokens is None:
            return None
        return _round_micro(sum((b.always_long_exact or Decimal(0) for b in self.buckets), Decimal(0)))

    @property
    def savings_micro_usd(self) -> int | None:
        cf = self.always_long_micro_usd
        return None if cf is None else cf - self.request_spend_micro_usd

    @property
    def savings_fraction(self) -> float | None:
        cf, saved = self.always_long_micro_usd, self.savings_micro_usd
        return None if cf in (None, 0) or saved is None else saved / cf

    @property
    def net_savings_micro_usd(self) -> int | None:
        """Savings on served traffic less the shadow spend: what routing saved once its learning is paid for."""
        sv = self.savings_micro_usd
        return None if sv is None else sv - self.shadow_spend_micro_usd

    def summary(self) -> dict[str, Any]:
        """Headline figures (micro-USD ints, USD as exact decimal strings)."""
        cf, sv, net = self.always_long_micro_usd, self.savings_micro_usd, self.net_savings_micro_usd
        return {
            "events": self.events,
            "requests": self.requests,
            "spend_micro_usd": self.spend_micro_usd,
            "spend_usd": str(micro_to_usd(self.spend_micro_usd)),
            "request_spend_micro_usd": self.request_spend_micro_usd,
            "request_spend_usd": str(micro_to_usd(self.request_spend_micro_usd)),
            "cache_saved_micro_usd": self.cache_saved_micro_usd,
            "cache_saved_usd": str(micro_to_usd(self.cache_saved_micro_usd)),
            "always_long_micro_usd": cf,
            "always_long_usd": None if cf is None else str(micro_to_usd(cf)),
            "savings_micro_usd": sv,
            "savings_usd": None if sv is None else str(micro_to_usd(sv)),
            "savings_fraction": self.savings_fraction,
            "shadow_spend_micro_usd": self.shadow_spend_micro_usd,
            "shadow_spend_usd": str(micro_to_usd(self.shadow_spend_micro_usd)),
            "net_savings_micro_usd": net,
            "net_savings_usd": None if net is None else str(micro_to_usd(net)),
            "long_mean_completion_tokens": (None if self.long_mean_completion_tokens is None
                                            else float(self.long_mean_completion_tokens)),
            "notes": list(self.notes),
        }


def _bucket_order(label: str) -> tuple[int, str]:
    return (1, label) if label == UNSCORED else (0, label)


def _add_to_tier(t: TierSpend, ev: UsageEvent) -> None:
    """Count one billed event into its tier's spend (tokens only when not served from the cache)."""
    t.events += 1
    t.cache_hits += int(ev.cached)
    t.cost_micro_usd += ev.cost_micro_usd
    t.saved_micro_usd += ev.saved_micro_usd
    if not ev.cached:
        t.prompt_tokens += ev.prompt_tokens
        t.completion_tokens += ev.completion_tokens
        t.reasoning_tokens += ev.reasoning_tokens


def _add_to_bucket(row: BucketRow, ev: UsageEvent, long_tier: str) -> bool:
    """Count one billed event into its difficulty bucket; True when it counts as a request (the always-long
    price is computed over those). Escalated first attempts are paid for the request: their cost stays with the
    bucket's. Shadow calls are paid for learning: their cost is the bucket's ``shadow_micro_usd`` (a shadow call on
    the long tier also measures it: a long sample)."""
    request = counts_as_request(ev)
    if ev.route_reason == "shadow":
        row.shadow_micro_usd += ev.cost_micro_usd
    elif request or (ev.error_code or "").startswith("escalated_"):
        row.cost_micro_usd += ev.cost_micro_usd
        row.saved_micro_usd += ev.saved_micro_usd
    if request:
        row.requests += 1
    if is_long_sample(ev, long_tier):
        row.long_samples += 1
        row.long_completion_sum += ev.completion_tokens
        row.long_reasoning_sum += ev.reasoning_tokens
    return request


def _long_means(buckets: dict[str, BucketRow], long_tier: str) -> tuple[Decimal | None, list[str]]:
    """Each bucket's mean long-tier completion tokens (measured, or the long tier's overall mean as a fallback);
    returns ``(overall mean or None, notes)``."""
    total_samples = sum(b.long_samples for b in buckets.values())
    overall = (Decimal(sum(b.long_completion_sum for b in buckets.values())) / total_samples
               if total_samples else None)
    notes: list[str] = []
    for row in buckets.values():
        if row.long_samples:
            row.long_mean_completion_tokens = Decimal(row.long_completion_sum) / row.long_samples
            row.estimate = "measured"
        elif overall is not None and row.requests:
            row.long_mean_completion_tokens = overall
            row.estimate = "fallback"
    fallback = sorted((b.bucket for b in buckets.values() if b.estimate == "fallback"), key=_bucket_order)
    if overall is None:
        notes.append(f"no complete uncached events on tier {long_tier!r} in this period: no always-long estimate")
    elif fallback:
        notes.append(f"buckets without long-tier events use the long tier's overall mean "
                     f"({overall:.1f} completion tokens): {', '.join(fallback)}")
    return overall, notes


def build(events: Iterable[UsageEvent], long_tier: str, long_prices: Prices, n_buckets: int = 10,
          since: float | None = None, until: float | None = None, key: str | None = None) -> SavingsReport:
    """The report over ``events`` (already filtered by period and key). See the module doc."""
    tiers: dict[str, TierSpend] = {}
    buckets: dict[str, BucketRow] = {}
    n_events = 0
    requests: list[UsageEvent] = []
    # escalated first attempts are paid; they belong to the bucket of the request they were part of
    for ev in events:
        if ev.audit:  # refused requests: no tier spend, no savings
            continue
        n_events += 1
        name = ev.tier or "_unrouted"
        _add_to_tier(tiers.setdefault(name, TierSpend(name)), ev)
        row = buckets.setdefault(bucket_of(ev.difficulty, n_buckets), BucketRow(bucket_of(ev.difficulty, n_buckets)))
        if _add_to_bucket(row, ev, long_tier):
            requests.append(ev)

    overall, notes = _long_means(buckets, long_tier)
    shadow = sum(b.shadow_micro_usd for b in buckets.values())
    if shadow:  # said where the figures are read, so a low or negative net saving is not a mystery
        notes.append(f"savings are on served traffic; shadow calls (learning: the next tier asked to label cheap "
                     f"answers for retraining) cost {micro_to_usd(shadow)} USD on top (net savings: after them)")
    p = long_prices
    for ev in requests:
        row = buckets[bucket_of(ev.difficulty, n_buckets)]
        cached = min(max(ev.cached_tokens, 0), ev.prompt_tokens)
        row.prompt_part += (ev.prompt_tokens - cached) * p.input_usd_per_mtok + cached * p.cached_input_usd_per_mtok
    if overall is not None:
        for row in buckets.values():
            if row.long_mean_completion_tokens is not None:
                row.always_long_exact = (row.prompt_part
                                         + row.requests * row.long_mean_completion_tokens * p.output_usd_per_mtok)
    return SavingsReport(
        events=n_events,
        requests=len(requests),
        tiers=sorted(tiers.values(), key=lambda t: t.tier),
        buckets=sorted(buckets.values(), key=lambda b: _bucket_order(b.bucket)),
        long_tier=long_tier,
        long_prices=long_prices,
        long_mean_completion_tokens=overall,
        since=since,
        until=until,
        key=key,
        notes=notes,
    )


# ----------------------------------------------------------------------------------------------- outputs

CSV_COLUMNS = ("section", "name", "events", "requests", "cache_hits", "prompt_tokens", "completion_tokens",
               "reasoning_tokens", "cost_micro_usd", "cost_usd", "saved_micro_usd", "saved_usd", "long_samples",
               "long_mean_completion_tokens", "estimate", "always_long_micro_usd", "always_long_usd",
               "shadow_micro_usd", "shadow_usd")


def usd_text(micro: int | None) -> str:
    return "" if micro is None else str(micro_to_usd(micro))


def rows(report: SavingsReport) -> list[dict[str, Any]]:
    """Flat rows: one per tier (``section=tier``), one per bucket (``bucket``), one ``total``."""
    out: list[dict[str, Any]] = []
    for t in report.tiers:
        out.append({"section": "tier", "name": t.tier, "events": t.events, "cache_hits": t.cache_hits,
                    "prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens,
                    "reasoning_tokens": t.reasoning_tokens, "cost_micro_usd": t.cost_micro_usd,
                    "cost_usd": usd_text(t.cost_micro_usd), "saved_micro_usd": t.saved_micro_usd,
                    "saved_usd": usd_text(t.saved_micro_usd)})
    for b in report.buckets:
        mean = b.long_mean_completion_tokens
        out.append({"section": "bucket", "name": b.bucket, "requests": b.requests,
                    "cost_micro_usd": b.cost_micro_usd, "cost_usd": usd_text(b.cost_micro_usd),
                    "saved_micro_usd": b.saved_micro_usd, "saved_usd": usd_text(b.saved_micro_usd),
                    "long_samples": b.long_samples,
                    "long_mean_completion_tokens": "" if mean is None else f"{mean:.3f}",
                    "estimate": b.estimate, "always_long_micro_usd": b.always_long_micro_usd,
                    "always_long_usd": usd_text(b.always_long_micro_usd), "shadow_micro_usd": b.shadow_micro_usd,
                    "shadow_usd": usd_text(b.shadow_micro_usd)})
    cf = report.always_long_micro_usd
    out.append({"section": "total", "name": "all", "events": report.events, "requests": report.requests,
                "cache_hits": sum(t.cache_hits for t in report.tiers),
                "cost_micro_usd": report.spend_micro_usd, "cost_usd": usd_text(report.spend_micro_usd),
                "saved_micro_usd": report.cache_saved_micro_usd, "saved_usd": usd_text(report.cache_saved_micro_usd),
                "estimate": "measured" if cf is not None else "none",
                "always_long_micro_usd": cf, "always_long_usd": usd_text(cf),
                "shadow_micro_usd": report.shadow_spend_micro_usd,
                "shadow_usd": usd_text(report.shadow_spend_micro_usd)})
    return out


def to_csv(report: SavingsReport) -> str:
    """The :func:`rows` as CSV text (empty cells for fields a section does not have)."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows(report):
        w.writerow({c: ("" if r.get(c) is None else r.get(c, "")) for c in CSV_COLUMNS})
    return buf.getvalue()
