"""The run's ``tier.yaml``: what a GRPO run tells the operator to put in the gateway config."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import yaml

from gateway.config.tiers import Prices, TierConfig, unpriced_tiers
from training.grpo.card import tier_snippet
from training.grpo.tier_prices import DEFAULT_TIER_PRICES

AFTER = {"by_difficulty": {"1": {"mean_thought_tokens": 41.0}, "2": {"mean_thought_tokens": 77.5}}}


def test_a_length_penalised_run_gets_one_native_tier_at_its_thought_length() -> None:
    text = tier_snippet("short", "tiny-short", "http://127.0.0.1:8002/v1", "runs/x/model", 256, AFTER)
    (tier,) = yaml.safe_load(text)["tiers"]
    assert tier["budget_mode"] == "native" and tier["thinking_budget"] == 80 and tier["name"] == "short"
    TierConfig(**tier)


def test_a_dial_run_gets_prompted_tiers_that_the_gateway_accepts() -> None:
    """A dial model reads its budget from the prompt: a ``native`` tier at one fixed budget (what the snippet
    said before) would serve it without the instruction it was trained on."""
    text = tier_snippet("dial", "thinkgate-tiny-dial", "http://127.0.0.1:8002/v1", "runs/d/model", 432, AFTER,
                        dial_prompt="Think for {budget} tokens.")
    tiers = [TierConfig(**t) for t in yaml.safe_load(text)["tiers"]]
    assert [t.name for t in tiers] == ["none", "short", "long"]
    none, short, long = tiers
    assert none.budget_mode == "off" and none.enable_thinking is False
    assert (short.budget_mode, short.thinking_budget, short.hard_stop) == ("prompted", 32, "native")
    assert (long.budget_mode, long.thinking_budget) == ("prompted", None)
    assert short.budget_prompt == long.budget_prompt == "Think for {budget} tokens."
    assert all(t.base_url == "http://127.0.0.1:8002/v1" and t.model == "thinkgate-tiny-dial" for t in tiers)
    assert "--served-model-name thinkgate-tiny-dial" in text and "the tiers of the same names" in text


def _default_prices() -> dict[str, Prices]:
    from gateway.config.tiers import _default_tiers

    return {t.name: t.prices for t in _default_tiers()}


def test_the_tier_carries_the_default_tiers_prices_so_it_is_not_metered_at_zero() -> None:
    """N6 D1: merged as the header says ("replacing the tier of the same name"), a tier without ``prices`` dropped
    the default ``short`` tier's and the gateway metered the trained model at $0 (``unpriced_tiers``)."""
    text = tier_snippet("short", "tiny-short", "http://127.0.0.1:8002/v1", "runs/x/model", 256, AFTER)
    tiers = [TierConfig(**t) for t in yaml.safe_load(text)["tiers"]]
    assert unpriced_tiers(tiers) == []
    assert tiers[0].prices == _default_prices()["short"]
    # the dial snippet's three tiers replace the three default tiers: each keeps its own prices
    dial = tier_snippet("dial", "d", "http://127.0.0.1:8002/v1", "runs/d/model", 432, AFTER, dial_prompt="{budget}")
    defaults = _default_prices()
    assert {t["name"]: Prices(**t["prices"]) for t in yaml.safe_load(dial)["tiers"]} == defaults


def test_the_run_files_tier_prices_win_and_an_unknown_tier_is_flagged() -> None:
    mine = {"input_usd_per_mtok": "0.30", "cached_input_usd_per_mtok": "0.15", "output_usd_per_mtok": "1.20"}
    text = tier_snippet("short", "s", "http://127.0.0.1:8002/v1", "m", 256, AFTER, prices={"short": mine})
    (tier,) = yaml.safe_load(text)["tiers"]
    assert TierConfig(**tier).prices == Prices(**{k: Decimal(v) for k, v in mine.items()})
    # a tier name the gateway does not ship has no default: no made-up price, and the header says so
    text = tier_snippet("terse", "s", "http://127.0.0.1:8002/v1", "m", 256, AFTER)
    assert "prices" not in yaml.safe_load(text)["tiers"][0] and "NO PRICES for tier(s) terse" in text


def test_the_training_copy_of_the_default_prices_matches_the_gateway() -> None:
    """``training`` may not import ``gateway``: its copy of the default tiers' prices must not drift."""
    assert {n: Prices(**p) for n, p in DEFAULT_TIER_PRICES.items()} == _default_prices()


def test_a_bad_tier_price_in_the_run_file_is_a_config_error() -> None:
    import pytest

    from training.grpo.config import ConfigError, RunConfig, from_dict, validate

    with pytest.raises(ConfigError, match=r"output.tier_prices.short.output_usd_per_mtok: must be finite and >= 0"):
        validate(from_dict(RunConfig, {"output": {"tier_prices": {"short": {"output_usd_per_mtok": "-1"}}}}))
    with pytest.raises(ConfigError, match=r"output.tier_prices.short: unknown key"):
        validate(from_dict(RunConfig, {"output": {"tier_prices": {"short": {"usd": "1"}}}}))


def test_an_unevaluated_run_gets_its_training_length_cap_not_unlimited_thinking() -> None:
    """N6 D3: a budget-stopped run (no evaluation after training) wrote ``thinking_budget: null`` — unlimited
    thinking — on a tier named ``short``. The cap its rollouts trained under is known; the header says it is not
    a measured length."""
    text = tier_snippet("short", "s", "http://127.0.0.1:8002/v1", "m", 128, None)
    (tier,) = yaml.safe_load(text)["tiers"]
    assert TierConfig(**tier).thinking_budget == 128
    assert "thinking_budget: not measured" in text and "trl.max_completion_length" in text


def test_the_card_of_an_unevaluated_run_says_not_measured(tmp_path: Path) -> None:
    """N6 D8: a budget-stopped run's card said "Accuracy gain: None percentage points ... (no gain)"."""
    from training.grpo.card import model_card
    from training.grpo.config import RunConfig
    from training.grpo.ledger import CostLedger

    led = CostLedger(tmp_path, "cpu", 1, Decimal("0.05"))
    led.record_overhead("startup", 0, {"startup": 1.0})
    cfg = RunConfig().to_dict()
    card = model_card("r", "m", cfg, None, None, {**led.summary(None, None), "tags": {}})
    assert "None" not in card and "no gain" not in card and "Accuracy gain: not measured" in card
    gained = model_card("r", "m", cfg, None, None, {**led.summary(0.5, 0.6), "tags": {}})
    assert "Accuracy gain: 10.0 percentage points" in gained
