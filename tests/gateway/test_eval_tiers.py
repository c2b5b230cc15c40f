"""``thinkgate eval tiers``'s client (gateway/cli/evals.py) against a real gateway over the simulator."""

from __future__ import annotations

import pytest

from gateway.cli.evals import run
from tests.fixtures.upstream import TEST_KEY, GatewayServer


def test_eval_tiers_measures_each_tier(gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THINKGATE_URL", gateway.url)
    monkeypatch.setenv("THINKGATE_API_KEY", TEST_KEY)
    result = run(["short", "long"], task="arith", n_per_level=2, difficulties=[1, 2], concurrency=2,
                 progress=False)
    short, long_ = result["tiers"]["short"], result["tiers"]["long"]
    assert short["requests"] == long_["requests"] == 4
    assert set(long_["by_difficulty"]) == {"1", "2"}
    assert long_["mean_reasoning_tokens"] > short["mean_reasoning_tokens"] > 0  # short's budget cuts the thought
    assert short["accuracy"] == 0.0  # the simulator echoes the question
    assert long_["cost_micro_usd"] > 0


def test_eval_tiers_unknown_tier(gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THINKGATE_URL", gateway.base_url)
    monkeypatch.setenv("THINKGATE_API_KEY", TEST_KEY)
    with pytest.raises(RuntimeError, match="tiers unknown to the gateway: \\['huge'\\]"):
        run(["huge"], n_per_level=1, progress=False)
