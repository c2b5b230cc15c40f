"""The shipped default's cold start (issue 24, item 1): the served scorer follows its validation on the real
outcome sets it was not fitted on (no set where it is worse than prompt length unless it serves length), the table
is in ``thinkgate router info``, and a fresh gateway says at start and in ``/v1/models`` which default it serves."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from gateway.config import DEFAULT_ROUTER_PATH, RoutingConfig
from router.cli import app as router_app
from router.fit.coldstart import choose, learned_not_worse, length_threshold, outcome_sets
from router.fit.evaluate import auc_score
from router.model import length_prior
from router.persistence import load_router
from router.policy import serving
from router.serving import RouterService
from tests.fixtures.upstream import TEST_KEY, GatewayServer, sim_settings

ASSETS = Path(__file__).resolve().parents[2] / "router" / "assets"
SHIPPED = ASSETS / "default.skops"
LEARNED = ASSETS / "default-learned.skops"
README_EASY = "Start with 6. Add 8. What is the result?"  # README "Try it": answered on the short tier


def _row(name: str, learned: tuple[float, float], length: tuple[float, float]) -> dict[str, Any]:
    return {"set": name, "learned": {"auc": learned[0], "savings_95": learned[1]},
            "length": {"auc": length[0], "savings_95": length[1]}}


def test_choice_rule_ships_length_when_the_learned_candidate_loses_anywhere() -> None:
    ok = [_row("a", (0.7, 0.4), (0.6, 0.3)), _row("b", (0.5, None), (0.5, 0.2))]  # type: ignore[arg-type]
    assert choose(ok) == ("learned", [])
    assert choose([*ok, _row("c", (0.62, 0.2), (0.61, 0.25))]) == ("length", ["c"])  # savings lost
    assert choose([*ok, _row("d", (0.55, 0.3), (0.58, 0.3))]) == ("length", ["d"])  # AUC lost


def test_the_shipped_default_follows_its_validation() -> None:
    shipped = load_router(SHIPPED, pipeline=False)
    cs = shipped.metadata.get("cold_start")
    assert isinstance(cs, dict), "the shipped default carries no cold-start validation (thinkgate router cold-start)"
    rows = cs["rows"]
    assert [r["set"] for r in rows] == [name for name, _, _ in outcome_sets()] == cs["validated_on"]
    worse = [r["set"] for r in rows if not learned_not_worse(r)]
    s = serving(shipped.metadata) or {}
    if worse:  # a learned default worse than length on a set must not be shipped as the served policy
        assert cs["choice"] == "length" and cs["worse_than_length"] == worse
        assert shipped.scorer == "length" and s.get("policy") == "length" and s.get("scorer") == "length"
        assert shipped.thresholds == [pytest.approx(length_threshold(), abs=1e-6)]
    else:
        assert cs["choice"] == "learned" and shipped.scorer == "pipeline"


def test_the_table_is_measured_not_written_down() -> None:
    # recompute the held-out MMLU subjects row from the data and the learned candidate
    row = load_router(SHIPPED, pipeline=False).metadata["cold_start"]["rows"][0]
    name, _, items = outcome_sets()[0]
    assert row["set"] == name and row["n"] == len(items)
    y = np.array([it.label for it in items], dtype=float)
    assert row["length"]["auc"] == pytest.approx(auc_score(y, np.array([length_prior(it.text) for it in items])),
                                                 abs=1e-4)
    learned = load_router(LEARNED)
    assert row["learned"]["auc"] == pytest.approx(auc_score(y, learned.predict_proba([it.text for it in items])),
                                                  abs=1e-4)


def test_router_info_prints_the_cold_start_table() -> None:
    out = CliRunner().invoke(router_app, ["info", str(SHIPPED)])
    assert out.exit_code == 0, out.output
    cs = load_router(SHIPPED, pipeline=False).metadata["cold_start"]
    served = "prompt length" if cs["choice"] == "length" else "the learned router"
    assert f"cold start: serves {served}" in out.output
    for r in cs["rows"]:
        assert r["set"] in out.output
    assert out.output.count("← learned worse than length") == len(cs["worse_than_length"])
    # the name the gateway reports for the file (not the recipe's router_version), once, in the summary
    meta = load_router(SHIPPED, pipeline=False).metadata
    assert f"version (as the gateway reports it): {meta.get('version') or meta['created_utc']}" in out.output
    # the summary comes first and alone: the whole metadata only with --json, as one JSON document
    first = out.output.splitlines()[0]  # one sentence: what it serves and that it promises no floor
    assert first.startswith(f"Serves {served}") and "states no quality guarantee" in first
    assert '"cold_start"' not in out.output
    whole = CliRunner().invoke(router_app, ["info", str(SHIPPED), "--json"])
    assert whole.exit_code == 0 and json.loads(whole.output)["cold_start"] == cs


def test_a_fresh_gateway_says_which_default_it_serves(upstream_sim: Any, redis_url: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    assert Path(str(RoutingConfig().router_path)).resolve() == Path(DEFAULT_ROUTER_PATH).resolve() == SHIPPED.resolve()
    with caplog.at_level(logging.INFO, logger="thinkgate.router"):
        RouterService.from_config(RoutingConfig())
    lines = [r.getMessage() for r in caplog.records if "shipped default router: serves" in r.getMessage()]
    assert len(lines) == 1 and "validated on" in lines[0] and "routellm-mmlu held-out subjects" in lines[0]
    # no router_path configured: the shipped default, and /v1/models says what it is
    settings = sim_settings(upstream_sim.base_url, redis_url,
                            routing={"routed_tiers": ["short", "long"], "default_tier": "long"})
    with GatewayServer(settings) as gw:
        models = httpx.get(gw.base_url + "/models", headers={"authorization": f"Bearer {TEST_KEY}"}).json()
        r = httpx.post(gw.base_url + "/chat/completions", headers={"authorization": f"Bearer {TEST_KEY}"},
                       json={"model": "auto", "messages": [{"role": "user", "content": README_EASY}]}, timeout=60)
    status = next(m for m in models["data"] if m["id"] == "auto")["thinkgate"]["router_status"]
    cs = load_router(SHIPPED, pipeline=False).metadata["cold_start"]
    assert status["cold_start"]["serves"] == ("length" if cs["choice"] == "length" else "router")
    assert status["cold_start"]["validated_on"] == cs["validated_on"]
    assert status["cold_start"]["summary"] == lines[0].rsplit(" (", 1)[0]
    # README "Try it": the easy arithmetic question still goes to the short tier
    assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
