"""Exact request cost in integer micro-USD from a tier's prices.

Prices are USD per 1M tokens (``Decimal``, see :class:`gateway.config.Prices`). Cached prompt tokens are
billed at the cached-input rate, the rest of the prompt at the input rate, and every completion token
(reasoning included) at the output rate::

    cost_usd = ((prompt - cached) * in + cached * cached_in + completion * out) / 1_000_000

and micro-USD = cost_usd * 1_000_000, so the per-1M divisor and the micro multiplier cancel: the cost in
micro-USD is exactly the weighted token sum in USD-per-1M units. It is rounded once, half-up, to an
integer. Metering and every report use this function; never sum float costs.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from gateway.config import Prices


def cost_micro_usd(prices: Prices, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
    """Cost of one request in integer micro-USD.

    ``prompt_tokens`` includes ``cached_tokens`` (as in OpenAI/vLLM usage; ``cached_tokens`` is clamped to
    ``[0, prompt_tokens]``); ``completion_tokens`` includes reasoning tokens (a breakdown, not an addition).
    Raises ValueError on negative counts. The counts are keyword-only: three positional ints in a row are
    easy to swap (one caller once billed completion tokens as cached prompt tokens).
    Example: 1000 prompt (200 cached), 500 completion at 0.50/0.25/2.00 USD per 1M → 400+50+1000 = 1450.
    """
    if min(prompt_tokens, completion_tokens, cached_tokens) < 0:
        raise ValueError("token counts must be >= 0")
    cached = min(cached_tokens, prompt_tokens)
    micro = (
        (prompt_tokens - cached) * prices.input_usd_per_mtok
        + cached * prices.cached_input_usd_per_mtok
        + completion_tokens * prices.output_usd_per_mtok
    )
    return int(Decimal(micro).quantize(Decimal(1), rounding=ROUND_HALF_UP))
