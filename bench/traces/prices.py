"""List prices of the traced models, USD per 1M tokens, for the tiers of ``thinkgate bench traces``.

One price per model: a thinking setting changes how many tokens a request uses, not what a token costs
(thinking tokens are billed as output tokens by every provider below).

=====================  ========  =============  =========  ======================================================
model                  input     cached input   output     source (list price, standard tier, ≤ 200k context)
=====================  ========  =============  =========  ======================================================
gemini-2.5-flash       0.30      0.075          2.50       Google Gemini API pricing page, gemini-2.5-flash (GA)
claude-sonnet4         3.00      0.30           15.00      Anthropic pricing page, Claude Sonnet 4 (cache read)
gpt-5-mini             0.25      0.025          2.00       OpenAI API pricing page, gpt-5-mini
o3-mini                1.10      0.55           4.40       OpenAI API pricing page, o3-mini
o4-mini                1.10      0.275          4.40       OpenAI API pricing page, o4-mini
=====================  ========  =============  =========  ======================================================

Qwen3-8B and Qwen3-14B are open-weight models with no first-party per-token list price: they get the
**nominal** price :data:`NOMINAL` (1 USD per 1M tokens in and out, so ``cost_usd`` reads as millions of
tokens), and the bench says so in its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal


@dataclass(frozen=True)
class ListPrice:
    """USD per 1M tokens, and where the figure comes from (``nominal`` when there is no list price)."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    source: str

    @property
    def nominal(self) -> bool:
        return self.source == "nominal"

    def as_config(self) -> dict[str, str]:
        """The ``prices`` section of a tier (strings: exact decimals through YAML)."""
        return {"input_usd_per_mtok": str(self.input), "cached_input_usd_per_mtok": str(self.cached_input),
                "output_usd_per_mtok": str(self.output)}


LIST_PRICES: dict[str, ListPrice] = {
    "gemini-2.5-flash": ListPrice(Decimal("0.30"), Decimal("0.075"), Decimal("2.50"), "Google Gemini API pricing"),
    "claude-sonnet4": ListPrice(Decimal("3.00"), Decimal("0.30"), Decimal("15.00"), "Anthropic pricing"),
    "gpt-5-mini": ListPrice(Decimal("0.25"), Decimal("0.025"), Decimal("2.00"), "OpenAI API pricing"),
    "o3-mini": ListPrice(Decimal("1.10"), Decimal("0.55"), Decimal("4.40"), "OpenAI API pricing"),
    "o4-mini": ListPrice(Decimal("1.10"), Decimal("0.275"), Decimal("4.40"), "OpenAI API pricing"),
}

NOMINAL = ListPrice(Decimal("1"), Decimal("1"), Decimal("1"), "nominal")


def price_of(model: str) -> ListPrice:
    """The list price of ``model`` (the trace files' model name), else :data:`NOMINAL`."""
    return LIST_PRICES.get(model, NOMINAL)
