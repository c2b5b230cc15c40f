"""``thinkgate bench savings --model-dir <dial model>``: every tier is served from it with the dial settings."""

from __future__ import annotations

from pathlib import Path

from bench.savings_stack import dial_tiers
from gateway.config import Settings

ASSETS = Path(__file__).resolve().parents[2] / "models"


def test_dial_model_dir_serves_tiers_as_budgets() -> None:
    tiers = {t.name: t for t in dial_tiers(Settings.load(None), ASSETS / "thinkgate-tiny-dial").tiers}
    assert (tiers["none"].budget_mode, tiers["none"].enable_thinking) == ("off", False)
    assert (tiers["short"].budget_mode, tiers["short"].thinking_budget) == ("prompted", 32)
    assert (tiers["long"].budget_mode, tiers["long"].thinking_budget) == ("prompted", None)
    assert tiers["short"].budget_prompt == "Think for {budget} tokens."


def test_other_model_dirs_keep_their_tiers() -> None:
    base = Settings.load(None)
    assert dial_tiers(base, ASSETS / "thinkgate-tiny").tiers == base.tiers
