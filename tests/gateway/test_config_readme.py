"""The configurations the README shows load as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.config import ConfigError, Settings

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def _gpu_yaml() -> str:
    text = README.read_text()
    section = text[text.index("### On GPUs"):]
    match = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert match, "README's 'On GPUs' section has no YAML block"
    return match.group(1)


def test_readme_gpu_config_loads_and_fits_the_effort_map(tmp_path: Path) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text(_gpu_yaml())
    s = Settings.load(path)
    assert [t.name for t in s.tiers] == ["short", "long"]
    # the default effort map named a 'none' tier this config does not have: efforts resolve to existing tiers
    assert s.routing.effort_tiers == {"none": "short", "minimal": "short", "low": "short", "medium": "long",
                                      "high": "long", "xhigh": "long", "max": "long"}


def test_an_explicit_effort_map_is_checked_as_written(tmp_path: Path) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text(_gpu_yaml() + "routing: {effort_tiers: {none: none}}\n")
    with pytest.raises(ConfigError, match=r"routing\.effort_tiers\.none: unknown tier 'none'"):
        Settings.load(path)


def test_embedded_default_tiers_follow_the_engine_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THINKGATE_ENGINE__PORT", "9123")  # the README's port setting for the local engine
    s = Settings.load(None)
    assert s.engine.port == 9123
    assert {t.base_url for t in s.tiers} == {"http://127.0.0.1:9123/v1"}
    configured = Settings.load(None, engine={"port": 9123},
                               tiers=[{"name": "solo", "base_url": "http://elsewhere:1/v1", "model": "m"}],
                               routing={"routed_tiers": ["solo"], "default_tier": "solo", "router_path": None})
    assert configured.tiers[0].base_url == "http://elsewhere:1/v1"  # configured tiers are taken as written


def test_a_configured_tier_without_an_upstream_follows_the_engine_port(tmp_path: Path) -> None:
    """docs/local-model.md's dial tiers name no ``base_url``: the engine serves them, wherever it listens (they
    stayed on 8001 when the engine moved, and every request failed with 502)."""
    path = tmp_path / "dial.yaml"
    path.write_text("engine: {port: 8002}\ntiers:\n"
                    "- {name: none, budget_mode: \"off\", thinking_budget: 0, enable_thinking: false}\n"
                    "- {name: short, budget_mode: prompted, thinking_budget: 32, hard_stop: native}\n"
                    "- {name: long, budget_mode: prompted, thinking_budget: null, base_url: http://gpu:9/v1}\n"
                    "- {name: pool, base_urls: [http://a:1/v1, http://b:1/v1]}\n")
    s = Settings.load(path)
    assert [t.base_url for t in s.tiers] == ["http://127.0.0.1:8002/v1", "http://127.0.0.1:8002/v1",
                                             "http://gpu:9/v1", "http://a:1/v1"]


def _doc_yaml(doc: str, after: str) -> str:
    text = (REPO / doc).read_text()
    match = re.search(r"```yaml\n(.*?)```", text[text.index(after):], re.S)
    assert match, f"{doc}: no YAML block after {after!r}"
    return match.group(1)


@pytest.mark.parametrize(("doc", "after", "tiers"), [
    ("docs/closed-loop.md", "## An operator's first day", ["no_think", "exd0"]),
    ("docs/deploy.md", "## 1. One box", ["short", "long"]),
])
def test_the_configs_the_docs_walk_through_load_as_written(tmp_path: Path, doc: str, after: str,
                                                          tiers: list[str]) -> None:
    """A new user copies these into a file and runs ``thinkgate serve -c`` (the closed-loop one named a default
    tier its tiers did not have and exited 2)."""
    path = tmp_path / "gateway.yaml"
    path.write_text(_doc_yaml(doc, after))
    s = Settings.load(path)
    assert [t.name for t in s.tiers] == tiers
    assert not s.engine.enabled
    assert all(t.prices.output_usd_per_mtok > 0 for t in s.tiers)  # else serve warns: metered at $0
