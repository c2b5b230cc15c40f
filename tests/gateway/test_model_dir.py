"""``--model-dir`` (``thinkgate serve``, ``thinkgate bench savings``): a dial model directory serves every tier
from it with the dial settings and its own router; any other model directory keeps the tiers."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, Settings
from gateway.config.model_dir import dial_tiers, with_model_dir

ASSETS = Path(__file__).resolve().parents[2] / "models"


def test_dial_model_dir_serves_tiers_as_budgets_with_its_router() -> None:
    settings = with_model_dir(Settings.load(None), ASSETS / "thinkgate-tiny-dial")
    tiers = {t.name: t for t in settings.tiers}
    assert (tiers["none"].budget_mode, tiers["none"].enable_thinking) == ("off", False)
    assert (tiers["short"].budget_mode, tiers["short"].thinking_budget) == ("prompted", 32)
    assert (tiers["long"].budget_mode, tiers["long"].thinking_budget) == ("prompted", None)
    assert tiers["short"].budget_prompt == "Think for {budget} tokens."
    # the embedded engine is vLLM: it cuts an overrun itself, one pass (forcing would bill the prompt twice)
    assert tiers["short"].hard_stop == tiers["long"].hard_stop == "native"
    assert settings.engine.model_path == (ASSETS / "thinkgate-tiny-dial").resolve()
    assert settings.routing.router_path == (ASSETS / "thinkgate-tiny-dial" / "router.skops").resolve()
    # dial.json's budget_range: the budgets the model follows (its counter reads three digits, trained on 8-320)
    assert tiers["short"].thinking_budget_range == tiers["long"].thinking_budget_range == (8, 320)
    assert tiers["none"].thinking_budget_range is None  # thinking off: no budget to bound


def test_without_the_embedded_engine_a_dial_tier_keeps_forcing_as_its_hard_stop() -> None:
    base = Settings.load(None)
    base = base.model_copy(update={"engine": base.engine.model_copy(update={"enabled": False})})
    tiers = {t.name: t for t in dial_tiers(base, ASSETS / "thinkgate-tiny-dial").tiers}
    assert (tiers["short"].budget_mode, tiers["short"].hard_stop) == ("prompted", "forced")


def test_other_model_dirs_keep_their_tiers_and_router() -> None:
    base = Settings.load(None)
    assert dial_tiers(base, ASSETS / "thinkgate-tiny").tiers == base.tiers
    short = with_model_dir(base, ASSETS / "thinkgate-tiny-short")
    assert short.tiers == base.tiers and short.routing.router_path == base.routing.router_path


def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a model directory"):
        with_model_dir(Settings.load(None), tmp_path)


def test_serve_refuses_a_model_dir_without_a_model_before_starting_anything(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gateway.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--model-dir", str(tmp_path)])
    assert result.exit_code == 2 and "not a model directory" in result.output, result.output


def test_a_dial_model_is_served_under_its_own_name() -> None:
    settings = with_model_dir(Settings.load(None), ASSETS / "thinkgate-tiny-dial")
    assert settings.engine.served_model_name == "thinkgate-tiny-dial"
    assert {t.model for t in settings.tiers} == {"thinkgate-tiny-dial"}


def test_the_dial_router_has_a_version_of_its_own() -> None:
    """The dial model's router is built from the shipped default (``thinkgate train dial-router``) and kept its
    version: two different files answered to one name in ``router info``, ``/v1/models``, ``router history`` and a
    rollback's ``router:bad`` (by version)."""
    from router.persistence import load_router
    from router.serving import file_version
    from training.tiny.dial_map import dial_version

    default = file_version(load_router(Path(__file__).resolve().parents[2] / "router" / "assets" / "default.skops"),
                           None)
    dial = file_version(load_router(ASSETS / "thinkgate-tiny-dial" / "router.skops"), None)
    assert dial != default
    assert dial == dial_version(default, "thinkgate-tiny-dial") == dial_version(dial, "thinkgate-tiny-dial")


def _dial_dir(tmp_path: Path, **spec: object) -> Path:
    import json
    import shutil

    d = tmp_path / "dial"
    d.mkdir()
    shutil.copy(ASSETS / "thinkgate-tiny-dial" / "config.json", d / "config.json")
    (d / "dial.json").write_text(json.dumps({"budget_prompt": "Think for {budget} tokens.",
                                             "tiers": {"none": 0, "short": 32, "long": None}, **spec}))
    return d


def test_a_dial_json_whose_budgets_or_range_do_not_fit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tier 'short'.s budget 32 is outside its budget_range \[48, 320\]"):
        dial_tiers(Settings.load(None), _dial_dir(tmp_path, budget_range=[48, 320]))
    for i, bad in enumerate(([320, 8], [0, 8], [8], "8-320", [8.0, 320])):
        (tmp_path / str(i)).mkdir()
        with pytest.raises(ConfigError, match="budget_range must be"):
            dial_tiers(Settings.load(None), _dial_dir(tmp_path / str(i), budget_range=bad))


def test_a_dial_json_without_a_range_leaves_every_budget_as_asked(tmp_path: Path) -> None:
    tiers = {t.name: t for t in dial_tiers(Settings.load(None), _dial_dir(tmp_path)).tiers}
    assert tiers["long"].thinking_budget_range is None and tiers["long"].applied_budget(100000) == 100000


def test_a_tier_budget_outside_its_declared_range_is_refused_at_load() -> None:
    from gateway.config import TierConfig

    with pytest.raises(ValueError, match=r"thinking_budget 448 is outside thinking_budget_range \[8, 320\]"):
        TierConfig(name="t", budget_mode="prompted", thinking_budget=448, thinking_budget_range=[8, 320])
    with pytest.raises(ValueError, match="1 <= min <= max"):
        TierConfig(name="t", thinking_budget_range=[0, 320])
    t = TierConfig(name="t", budget_mode="prompted", thinking_budget=0, thinking_budget_range=[8, 320])  # off: fine
    assert [t.applied_budget(b) for b in (None, 0, 1, 8, 100, 320, 448, 100000)] == [None, 0, 8, 8, 100, 320, 320, 320]

