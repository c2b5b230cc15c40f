"""The admission estimate is an upper bound for every request shape; the reservation format has one owner."""

from __future__ import annotations

from decimal import Decimal

import pytest

from gateway.config import Prices, TierConfig
from gateway.ledger.pricing import cost_micro_usd
from gateway.state.limits import MESSAGE_OVERHEAD_TOKENS, REQUEST_OVERHEAD_TOKENS, TOOLS_OVERHEAD_TOKENS, estimate
from gateway.state.reservations import Reservation, open_total

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))
LONG = TierConfig(name="long", max_tokens=100, prices=PRICES)


def _cost(prompt: int, completion: int, prices: Prices = PRICES) -> int:
    return cost_micro_usd(prices, prompt_tokens=prompt, cached_tokens=0, completion_tokens=completion)


@pytest.mark.parametrize(("body", "prompt", "choices"), [
    ({"prompt": "abc"}, 3, 1),
    ({"prompt": "abc", "n": 3}, 3, 3),
    ({"prompt": "abc", "n": 2, "best_of": 5}, 3, 5),  # best_of completions are generated and billed
    ({"prompt": ["abc", "def"], "n": 2}, 6, 4),  # a batch: n completions per prompt
    ({"prompt": [1, 2, 3]}, 3, 1),  # token ids: one prompt, one token each
])
def test_choices_count_n_best_of_and_batches(body: dict[str, object], prompt: int, choices: int) -> None:
    est = estimate(body, [LONG])
    assert est.tokens == prompt + REQUEST_OVERHEAD_TOKENS + choices * 100
    assert est.micro_usd == _cost(prompt + REQUEST_OVERHEAD_TOKENS, choices * 100)


def test_token_ids_tools_and_cached_price_count() -> None:
    ids = estimate({"prompt": list(range(50)), "max_tokens": 1}, [LONG])
    assert ids.tokens == 50 + REQUEST_OVERHEAD_TOKENS + 1  # a token id counts one token
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 100}}]
    plain = estimate({"messages": msgs, "max_tokens": 1}, [LONG])
    with_tools = estimate({"messages": msgs, "tools": tools, "max_tokens": 1}, [LONG])
    assert with_tools.tokens - plain.tokens >= 100 + TOOLS_OVERHEAD_TOKENS
    odd = Prices(input_usd_per_mtok=Decimal("1"), cached_input_usd_per_mtok=Decimal("3"))  # cached dearer
    tier = TierConfig(name="odd", max_tokens=1, prices=odd)
    prompt = len(b"user") + len(b"hi") + MESSAGE_OVERHEAD_TOKENS + REQUEST_OVERHEAD_TOKENS
    assert estimate({"messages": msgs, "max_tokens": 1}, [tier]).micro_usd == prompt * 3  # at the dearer rate


def test_estimate_bounds_the_real_cost_of_any_cut() -> None:
    # whatever the upstream does within the caps, the real cost is <= the estimate (integer micro-USD, one rounding)
    body = {"messages": [{"role": "user", "content": "héllo " * 7}], "n": 3, "max_tokens": 40}
    est = estimate(body, [LONG])
    prompt_ub = est.tokens - 3 * 40
    for prompt in (1, prompt_ub // 2, prompt_ub):
        for completion in (0, 1, 59, 120):
            assert _cost(prompt, completion) <= est.micro_usd


def test_reservation_format_round_trip_and_open_total() -> None:
    r = Reservation(1234, 56, 1_000)
    assert r.encode() == "1234|56|1000" and Reservation.decode(b"1234|56|1000") == r
    assert Reservation.decode("garbage") is None and Reservation.decode("1|2") is None
    fields = {b"a": b"10|0|2000", b"b": b"5|0|500", b"c": b"bad"}
    assert open_total(fields, now_ms=1000) == 10  # expired and malformed fields never count
