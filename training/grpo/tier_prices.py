"""Token prices (USD per 1M tokens) that a run's ``tier.yaml`` carries, so the gateway meters the trained tier.

A tier without ``prices`` is metered at $0 by the gateway (no spend budget or cost limit binds on it), and the
docs tell the operator to merge ``tier.yaml`` *replacing* the tier of the same name: the snippet must carry the
prices itself. ``training`` may not import ``gateway`` (import-linter), so the shipped default tiers' prices
(``gateway/config/tiers.py`` ``_default_tiers``) are repeated here; ``tests/training/test_tier_snippet.py``
checks the two stay equal.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

PRICE_KEYS = ("input_usd_per_mtok", "cached_input_usd_per_mtok", "output_usd_per_mtok")

DEFAULT_TIER_PRICES: dict[str, dict[str, str]] = {
    "none": {"input_usd_per_mtok": "0.05", "cached_input_usd_per_mtok": "0.025", "output_usd_per_mtok": "0.20"},
    "short": {"input_usd_per_mtok": "0.10", "cached_input_usd_per_mtok": "0.05", "output_usd_per_mtok": "0.40"},
    "long": {"input_usd_per_mtok": "0.50", "cached_input_usd_per_mtok": "0.25", "output_usd_per_mtok": "2.00"},
}


def check_prices(field: str, prices: dict[str, str]) -> str | None:
    """Why ``prices`` (one tier's, ``field`` names it in the message) is not a valid gateway ``prices:`` block —
    the three keys of :data:`PRICE_KEYS` only, each a finite decimal >= 0 — or None when it is."""
    unknown = sorted(set(prices) - set(PRICE_KEYS))
    if unknown:
        return f"{field}: unknown key(s) {unknown}; known {list(PRICE_KEYS)}"
    for k, v in prices.items():
        try:
            d = Decimal(str(v))
        except InvalidOperation:
            return f"{field}.{k}: not a decimal: {v!r}"
        if not d.is_finite() or d < 0:
            return f"{field}.{k}: must be finite and >= 0, got {v}"
    return None


def tier_prices(tier_name: str, configured: dict[str, dict[str, str]]) -> dict[str, str] | None:
    """The prices for ``tier_name``: the run file's ``output.tier_prices[tier_name]`` when set, else the shipped
    default tier of that name's, else None (a tier name the gateway does not ship: the operator must price it).
    Values are decimal strings, as the gateway's config reads them exactly."""
    if tier_name in configured:
        return {k: str(v) for k, v in configured[tier_name].items()}
    default = DEFAULT_TIER_PRICES.get(tier_name)
    return dict(default) if default is not None else None
