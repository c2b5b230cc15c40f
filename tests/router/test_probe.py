"""router.probe against a real gateway over the simulator: answers, verification, summaries, failures."""

from __future__ import annotations

import pytest

from router.probe import Answer, ProbeClient, ProbeError, Target, api_base, by_difficulty, probe
from router.tasks import load_task
from tests.fixtures.upstream import TEST_KEY, GatewayServer


def test_probe_verifies_and_summarises_by_difficulty(gateway: GatewayServer) -> None:
    problems = load_task("arith", "test", 2, seed=0, difficulties=[1]) + load_task("arith", "test", 2, seed=0,
                                                                                    difficulties=[3])
    seen: list[str] = []
    with ProbeClient(gateway.url, TEST_KEY, headers={"cache-control": "no-store"}) as client:
        # a verifier that accepts the simulator's echo: the probe must hand it each problem's answer text
        outcomes = probe(client, problems, ["short", Target("long", name="long-tier")], concurrency=2,
                         verify=lambda p, text: p.question in text, on_outcome=lambda o: seen.append(o.target))
    assert [o.target for o in outcomes] == ["short"] * 4 + ["long-tier"] * 4
    assert sorted(seen) == sorted(o.target for o in outcomes)
    assert all(o.correct and o.answer.ok and o.answer.completion_tokens > 0 for o in outcomes)
    assert {o.answer.headers["x-thinkgate-tier"] for o in outcomes} == {"short", "long"}
    report = by_difficulty(outcomes, extra=lambda rows: {"n_ok": sum(o.answer.ok for o in rows)})
    assert set(report) == {"short", "long-tier"}
    assert report["short"]["requests"] == 4 and report["short"]["accuracy"] == 1.0 and report["short"]["n_ok"] == 4
    assert set(report["long-tier"]["by_difficulty"]) == {"1", "3"}
    assert report["long-tier"]["mean_reasoning_tokens"] > report["short"]["mean_reasoning_tokens"] > 0


def test_probe_failures_are_errors_or_statuses(gateway: GatewayServer) -> None:
    with ProbeClient(gateway.url, "not-a-key", max_retries=0) as client:
        with pytest.raises(ProbeError, match="HTTP 401"):
            client.chat("short", [{"role": "user", "content": "hi"}])
        answer = client.chat("short", [{"role": "user", "content": "hi"}], check=False)
        assert isinstance(answer, Answer) and answer.status == 401 and not answer.ok and answer.content == ""
    with ProbeClient("http://127.0.0.1:9", TEST_KEY, max_retries=0, timeout_s=2) as dead:
        assert dead.chat("short", [{"role": "user", "content": "hi"}], check=False).status == 0
        with pytest.raises(ProbeError, match="not reachable"):
            dead.models()
    assert api_base("http://h:1/") == "http://h:1/v1"
