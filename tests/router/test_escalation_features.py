"""Answer-aware escalation: the features the fit computes on a recorded answer (router.fit.escalation_fit) are the
features the gateway computes on the same answer served by the trace-replay upstream (gateway.pipeline.escalation),
for every cheap answer of the shipped traces' ladders. Scoring latency (≤ 0.3 ms p50 at 2,000 characters) is measured in
``python -m bench.router_latency --escalation``, not here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from bench.traces.replay_upstream import build_state, make_app
from gateway.config import TierConfig
from gateway.pipeline.escalation import learned_reason, serving_features
from router.escalation import FEATURES
from router.fit.escalation_fit import tier_features
from router.fit.traces import load_ladder
from router.model import length_prior

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
#: (data set, ladder, tier): every tier below the top of the README's ladders, the three-tier one's middle too
CASES = (("frames", "o3-mini:low_effort,high_effort", 0), ("frames", "Qwen3-8B:no_think,exd0", 0),
         ("frames", "gemini-2.5-flash:no_think,budget256,budget1024", 1),
         ("simpleqa", "claude-sonnet4:no_think,budget1024", 0))


@pytest.mark.parametrize(("dataset", "ladder", "tier"), CASES)
def test_fit_and_serving_features_are_equal_on_every_recorded_answer(dataset: str, ladder: str, tier: int) -> None:
    data = load_ladder(TRACES, dataset, ladder)
    scores = np.array([length_prior(q) for q in data.questions])
    fit = tier_features(data, tier, scores)
    model, _, rest = ladder.partition(":")
    setting = rest.split(",")[tier]
    app = make_app(build_state(TRACES, dataset, [(model, setting)]))
    cfg = TierConfig(name="cheap")
    with TestClient(app) as client:
        for i in range(data.n):
            r = client.post("/v1/chat/completions", json={
                "model": f"{model}:{setting}", "messages": [{"role": "user", "content": data.questions[i]}]})
            assert r.status_code == 200
            served = serving_features(r.json(), "chat", cfg, data.questions[i], float(scores[i]))
            assert served is not None
            assert np.allclose(served, fit[i], atol=1e-12), (i, [
                (n, a, b) for n, a, b in zip(FEATURES, served, fit[i], strict=True) if abs(a - b) > 1e-12])


def test_learned_reason_reads_the_tier_model() -> None:
    """``learned`` escalates by the tier's model and threshold, only when listed in ``escalate_on``."""
    d = len(FEATURES)
    coef = [0.0] * d
    coef[FEATURES.index("abstains")] = 5.0
    model = {"features": list(FEATURES), "mean": [0.0] * d, "scale": [1.0] * d, "coef": coef, "intercept": -2.5,
             "threshold": 0.5}
    tier = TierConfig(name="cheap", escalate_on=["learned"], escalation_model=model)
    sure = {"choices": [{"message": {"content": "Answer: 1912"}, "finish_reason": "stop"}]}
    unsure = {"choices": [{"message": {"content": "I don't know."}, "finish_reason": "stop"}]}
    assert learned_reason(tier, sure, "chat", "When?", 0.2) is None
    assert learned_reason(tier, unsure, "chat", "When?", 0.2) == "learned"
    assert learned_reason(TierConfig(name="cheap"), unsure, "chat", "When?", 0.2) is None, "only when listed"
    with pytest.raises(ValueError, match="learned needs escalation_model"):
        TierConfig(name="cheap", escalate_on=["learned"])
