"""``bench.learn.measure`` against a real gateway and Redis: the tokens of a measurement are every upstream call it
made — the escalated first attempts too, which are metered under request ids of their own."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench.learn import Client, measure
from bench.savings_stack import Ledger
from tests.fixtures.gateway import SECRETS, accounting_gateway, usage_events
from tests.fixtures.upstream import SimProcess, sim_tiers


def test_measure_counts_the_escalated_first_attempts(upstream_sim: SimProcess, redis_url: str,
                                                     tmp_path: Path) -> None:
    tiers = sim_tiers(upstream_sim.base_url)
    # short: a thought cut by the tier's max_tokens escalates to long — every question here
    tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]})
    questions = [f"question number {i} about nothing in particular" for i in range(6)]
    data = SimpleNamespace(questions=questions, correct=np.ones((6, 2), dtype=bool))
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, tiers=tiers,
                            routing={"router_path": None, "routed_tiers": ["short", "long"],
                                     "thresholds": [0.99]}) as gw:
        client = Client(gw.base_url.removesuffix("/v1"), SECRETS["bob"], 2)
        try:
            correct, tokens, tiers_seen = measure(client, Ledger(gw.settings), "bob", data,  # type: ignore[arg-type]
                                                  np.arange(6), ("short", "long"), 2)
        finally:
            client.close()
        events = usage_events(gw, count=12)
    assert tiers_seen == {"long": 6} and correct.all()
    firsts = [e for e in events.values() if (e.error_code or "").startswith("escalated_")]
    assert len(firsts) == 6 and all(e.completion_tokens > 0 for e in firsts)
    assert tokens == sum(e.completion_tokens for e in events.values())  # the answers' alone read less
    assert tokens > sum(e.completion_tokens for e in events.values() if e not in firsts)
