"""The ``normalised`` shadow judge: final answers compared with the task checkers (numbers), abstentions and word
containment, and on a real gateway with the real Redis: the shadow outcome carries judge ``normalised``."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis

from gateway.control.shadow import answers_agree, normalise_answer
from gateway.control.shadow_normalised import NormalisedJudge
from gateway.ledger.outcome import Outcome
from tests.fixtures.gateway import SECRETS, accounting_gateway
from tests.fixtures.upstream import SimProcess, wait_for


def test_normalised_judge_compares_final_answers() -> None:
    judge = NormalisedJudge(normalise_answer)
    cases = [  # (cheap, higher, normalised, agreement)
        ("Answer: 1,200<|im_end|>", "So the total is 1200.\nAnswer: 1200", True, False),  # the same number
        ("The answer is 41.", "Answer: 42", False, False),
        ("Answer: I don't know.<|im_end|>", "Answer: I do not know", True, False),  # both abstain
        ("Answer: I don't know.", "Answer: Spain", False, False),  # the cheap tier abstained
        ("Answer: Sarah Rudolph", "Answer: Sarah Ann Rudolph", True, False),  # the shorter one contained
        ("Answer: Spain", "Answer: France", False, False),
        ("Answer: the Eiffel Tower", "Answer: Eiffel tower", True, True),
    ]
    for cheap, higher, norm, agree in cases:
        assert judge(cheap, higher) is norm, (cheap, higher)
        assert answers_agree(cheap, higher) is agree, (cheap, higher)


def test_normalised_judge_on_the_gateway(upstream_sim: SimProcess, redis_url: str, redis_prefix: str,
                                         tmp_path: Path) -> None:
    routing = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.9], "default_tier": "long",
               "shadow": {"fraction": 1.0, "judge": "normalised"}}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing=routing) as gw, httpx.Client(timeout=30) as client:
        r = client.post(gw.base_url + "/chat/completions", headers={"authorization": f"Bearer {SECRETS['alice']}"},
                        json={"model": "auto", "max_tokens": 16,
                              "messages": [{"role": "user", "content": "what is 3 plus 4?"}]})
        assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short"
        rdb = redis.Redis.from_url(redis_url)
        try:
            assert wait_for(lambda: rdb.xlen(redis_prefix + "outcomes") == 1, timeout_s=10)
            [o] = [Outcome.from_json(f[b"o"]) for _, f in rdb.xrange(redis_prefix + "outcomes")]
        finally:
            rdb.close()
        assert (o.source, o.judge, o.tier, o.other_tier) == ("shadow", "normalised", "short", "long")
        assert o.sufficed is not None
