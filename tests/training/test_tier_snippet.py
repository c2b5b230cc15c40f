"""The run's ``tier.yaml``: what a GRPO run tells the operator to put in the gateway config."""

from __future__ import annotations

import yaml

from gateway.config.tiers import TierConfig
from training.grpo.card import tier_snippet

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
