"""The trace-replay upstream as a real process behind the real gateway (real Redis, real ledger): hits, misses,
streams, unknown models, and the cascade's two metered calls."""

from __future__ import annotations

import gzip
import json
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.traces.replay_upstream import ReplayProcess, estimate_prompt_tokens
from gateway.ledger.pricing import cost_micro_usd
from tests.fixtures.gateway import SECRETS, accounting_gateway, usage_events
from tests.fixtures.upstream import GatewayServer

Q_PARIS = "What is the capital of France?"
Q_CUP = "Which country won the first FIFA World Cup in 1930?"
Q_NOCOUNT = "Who wrote the novel Middlemarch?"
ROWS = {
    "cheap": [
        {"id": "1", "question": Q_PARIS, "response": "Answer: Paris", "thought": None, "grading": "A",
         "correct": True, "reasoning_tokens": 0, "completion_tokens": 4},
        {"id": "2", "question": Q_CUP, "response": "Answer: I don't know.", "thought": None, "grading": "C",
         "correct": False, "reasoning_tokens": 0, "completion_tokens": 7},
        {"id": "3", "question": Q_NOCOUNT, "response": "Answer: Jane Austen", "thought": None, "grading": "B",
         "correct": False, "reasoning_tokens": None, "completion_tokens": 5},
    ],
    "top": [
        {"id": "1", "question": Q_PARIS, "response": "Answer: Paris",
         "thought": "France's capital is Paris, seat of government since the tenth century.", "grading": "A",
         "correct": True, "reasoning_tokens": 41, "completion_tokens": 45},
        {"id": "2", "question": Q_CUP, "response": "Answer: Uruguay",
         "thought": "The 1930 World Cup was hosted in Montevideo; the hosts beat Argentina 4-2 in the final.",
         "grading": "A", "correct": True, "reasoning_tokens": 300, "completion_tokens": 310},
        {"id": "3", "question": Q_NOCOUNT, "response": "Answer: George Eliot",
         "thought": "Middlemarch (1871-72) is by Mary Ann Evans, who wrote as George Eliot.", "grading": "A",
         "correct": True, "reasoning_tokens": None, "completion_tokens": 120},
    ],
}
ROWS["mid"] = [
    {"id": "1", "question": Q_PARIS, "response": "Answer: Paris", "thought": "Paris.", "grading": "A",
     "correct": True, "reasoning_tokens": 9, "completion_tokens": 12},
    {"id": "2", "question": Q_CUP, "response": "Answer: I do not have enough information to answer.",
     "thought": "Not sure.", "grading": "C", "correct": False, "reasoning_tokens": 30, "completion_tokens": 44},
]
PRICES = {"cheap": {"input_usd_per_mtok": Decimal("0.30"), "output_usd_per_mtok": Decimal("2.50")},
          "mid": {"input_usd_per_mtok": Decimal("0.30"), "output_usd_per_mtok": Decimal("2.50")},
          "top": {"input_usd_per_mtok": Decimal("1.10"), "output_usd_per_mtok": Decimal("4.40")}}


def write_traces(root: Path) -> Path:
    (root / "frames").mkdir(parents=True)
    for setting, rows in ROWS.items():
        with gzip.open(root / "frames" / f"M__{setting}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return root


def tiers(base_url: str, cheap_escalates: list[str] | None = None) -> list[dict[str, Any]]:
    common = {"base_url": base_url, "max_tokens": 4096, "budget_mode": "off", "read_timeout_s": 10.0,
              "connect_timeout_s": 2.0, "max_retries": 0}
    return [{**common, "name": "cheap", "model": "M:cheap", "enable_thinking": False, "prices": PRICES["cheap"],
             "escalate_on": cheap_escalates or []},
            {**common, "name": "top", "model": "M:top", "prices": PRICES["top"]}]


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplayProcess]:
    traces = write_traces(tmp_path_factory.mktemp("traces"))
    with ReplayProcess(traces, "frames", [("M", "cheap"), ("M", "mid"), ("M", "top")]) as r:
        yield r


def _gateway(replay: ReplayProcess, redis_url: str, tmp: Path, escalates: list[str] | None) -> Any:
    return accounting_gateway(replay.base_url, redis_url, tmp, f"tgtest:{uuid.uuid4().hex[:12]}:",
                              tiers=tiers(replay.base_url, escalates),
                              routing={"router_path": None, "routed_tiers": ["cheap", "top"], "thresholds": [0.99],
                                       "default_tier": "top", "effort_tiers": {"low": "cheap", "high": "top"}},
                              cache={"mode": "off"})


@pytest.fixture(scope="module")
def gw(replay: ReplayProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with _gateway(replay, redis_url, tmp_path_factory.mktemp("gw"), None) as g:
        yield g


@pytest.fixture(scope="module")
def cascade_gw(replay: ReplayProcess, redis_url: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with _gateway(replay, redis_url, tmp_path_factory.mktemp("cgw"), ["empty_answer", "abstain"]) as g:
        yield g


def sdk(gw: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0, timeout=30)


def events_until(gw: GatewayServer, rid: str, pred: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    """Ledger events once request ``rid`` and an event matching ``pred`` are there (each is written just after
    its call; the two calls of a cascade are written independently)."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = usage_events(gw, [rid])
        if any(pred(e) for e in events.values()) or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def user(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


def test_hit_serves_the_recording_and_the_ledger_prices_its_tokens(replay: ReplayProcess, gw: GatewayServer) -> None:
    # direct: the recorded answer, thought and token counts; whitespace and the system prompt do not matter
    spaced = "  Which country won the first FIFA\n World Cup   in 1930? "
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": spaced}]
    r = httpx.post(replay.base_url + "/chat/completions", json={"model": "M:top", "messages": msgs}, timeout=10)
    assert r.status_code == 200
    body = r.json()
    msg = body["choices"][0]["message"]
    assert msg["content"] == "Answer: Uruguay" and msg["reasoning"] == ROWS["top"][1]["thought"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 310
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 300}
    # the documented estimate: Σ (ceil(chars/4) + 4) + 3
    assert body["usage"]["prompt_tokens"] == estimate_prompt_tokens(msgs) == \
        (-(-len(msgs[0]["content"]) // 4) + 4) + (-(-len(msgs[1]["content"]) // 4) + 4) + 3
    cheap = httpx.post(replay.base_url + "/chat/completions", json={"model": "M:cheap", "messages": user(Q_PARIS)},
                       timeout=10).json()
    assert "reasoning" not in cheap["choices"][0]["message"], "no thought recorded: no reasoning field"
    # through the gateway: the same answer, metered with the recorded tokens at the tier's prices
    raw = sdk(gw).chat.completions.with_raw_response.create(model="top", messages=user(Q_CUP))
    out = raw.parse()
    assert out.choices[0].message.content == "Answer: Uruguay"
    assert raw.headers["x-thinkgate-tier"] == "top"
    ev = usage_events(gw, [raw.headers["x-request-id"]])[raw.headers["x-request-id"]]
    prompt = estimate_prompt_tokens(user(Q_CUP))
    assert (ev.prompt_tokens, ev.completion_tokens, ev.reasoning_tokens) == (prompt, 310, 300)
    assert ev.cost_micro_usd == cost_micro_usd(gw.settings.tier("top").prices, prompt_tokens=prompt, cached_tokens=0,
                                               completion_tokens=310)


def test_reasoning_count_left_out_when_not_recorded(replay: ReplayProcess) -> None:
    r = httpx.post(replay.base_url + "/chat/completions", json={"model": "M:top", "messages": user(Q_NOCOUNT)},
                   timeout=10).json()
    assert r["usage"]["completion_tokens"] == 120
    assert "completion_tokens_details" not in r["usage"], "a count the provider never reported is not invented"


def test_unknown_question_is_a_404_never_an_answer(replay: ReplayProcess, gw: GatewayServer) -> None:
    before = replay.stats()
    r = httpx.post(replay.base_url + "/chat/completions",
                   json={"model": "M:top", "messages": user("What is the airspeed of an unladen swallow?")}, timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "question_not_recorded" and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}
    assert replay.stats()["misses"] == before["misses"] + 1
    # through the gateway the client gets an OpenAI-shaped 4xx carrying the upstream's message, not an answer
    with pytest.raises(openai.BadRequestError) as info:
        sdk(gw).chat.completions.create(model="cheap", messages=user("What is the airspeed of a swallow?"))
    assert "question not in the recorded traces" in str(info.value)


def test_unknown_model_is_a_404(replay: ReplayProcess) -> None:
    r = httpx.post(replay.base_url + "/chat/completions", json={"model": "M:other", "messages": user(Q_PARIS)},
                   timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def _sse(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), "every event is one data: line"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_stream_is_valid_sse_with_the_usage_chunk(replay: ReplayProcess, gw: GatewayServer) -> None:
    body = {"model": "M:top", "messages": user(Q_PARIS), "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(replay.base_url + "/chat/completions", json=body, timeout=10)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Answer: Paris"
    assert "".join(d.get("reasoning") or "" for d in deltas) == ROWS["top"][0]["thought"]
    assert len([d for d in deltas if d.get("reasoning")]) > 1, "the thought goes out in pieces"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 45
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    no_usage = _sse(httpx.post(replay.base_url + "/chat/completions", json={**body, "stream_options": None},
                               timeout=10).text)
    assert all("usage" not in c for c in no_usage), "usage only when asked"
    # through the gateway with the official SDK: the same text, the usage chunk, the ledger
    stream = sdk(gw).chat.completions.with_raw_response.create(
        model="top", messages=user(Q_PARIS), stream=True, stream_options={"include_usage": True})
    parts = list(stream.parse())
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == "Answer: Paris"
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 45
    rid = stream.headers["x-request-id"]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.stream, ev.completion_tokens, ev.reasoning_tokens) == (True, 45, 41)


@pytest.mark.parametrize("stream", [False, True])
def test_cascade_meters_both_calls_at_their_recorded_tokens(cascade_gw: GatewayServer, stream: bool) -> None:
    c = sdk(cascade_gw)
    kw: dict[str, Any] = {"model": "cheap", "messages": user(Q_CUP)}
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    raw = c.chat.completions.with_raw_response.create(**kw)
    parsed = raw.parse()
    content = ("".join(p.choices[0].delta.content or "" for p in parsed if p.choices) if stream
               else parsed.choices[0].message.content)
    assert content == "Answer: Uruguay", "the abstaining cheap answer never reaches the client"
    assert raw.headers["x-thinkgate-tier"] == "top" and raw.headers["x-thinkgate-route-reason"] == "escalated"
    rid = raw.headers["x-request-id"]
    events = events_until(cascade_gw, rid, lambda e: e.error_code == "escalated_abstain" and e.stream is stream)
    second = events[rid]
    firsts = [e for e in events.values() if e.error_code == "escalated_abstain" and e.tier == "cheap"
              and e.stream is stream and e.ts <= second.ts]
    assert firsts, "the cheap attempt is metered under its own record"
    first = max(firsts, key=lambda e: e.ts)
    prompt = estimate_prompt_tokens(user(Q_CUP))
    assert (first.completion_tokens, first.prompt_tokens, first.route_reason) == (7, prompt, "forced")
    assert (second.completion_tokens, second.reasoning_tokens, second.route_reason) == (310, 300, "escalated")
    price = {t: cascade_gw.settings.tier(t).prices for t in ("cheap", "top")}
    assert first.cost_micro_usd == cost_micro_usd(price["cheap"], prompt_tokens=prompt, cached_tokens=0,
                                                  completion_tokens=7)
    assert second.cost_micro_usd == cost_micro_usd(price["top"], prompt_tokens=prompt, cached_tokens=0,
                                                   completion_tokens=310)
    # exact integers: 7 and 310 output tokens at 2.50 / 4.40 USD per 1M, plus the prompt at 0.30 / 1.10
    assert first.cost_micro_usd + second.cost_micro_usd == round(prompt * 0.30 + 7 * 2.50) + \
        round(prompt * 1.10 + 310 * 4.40)


def test_cascade_keeps_a_real_answer_and_combines_with_the_router(cascade_gw: GatewayServer) -> None:
    c = sdk(cascade_gw)
    kept = c.chat.completions.with_raw_response.create(model="cheap", messages=user(Q_PARIS))
    assert kept.headers["x-thinkgate-tier"] == "cheap" and kept.headers["x-thinkgate-route-reason"] == "forced"
    assert kept.parse().choices[0].message.content == "Answer: Paris"
    # model auto: the (length) router sends the question cheap (threshold 0.99), the cascade escalates it
    routed = c.chat.completions.with_raw_response.create(model="auto", messages=user(Q_CUP))
    assert routed.headers["x-thinkgate-route-reason"] == "escalated" and routed.headers["x-thinkgate-tier"] == "top"
    rid = routed.headers["x-request-id"]
    events = events_until(cascade_gw, rid, lambda e: e.route_reason == "predicted")
    assert any(e.route_reason == "predicted" and e.error_code == "escalated_abstain" for e in events.values())


def test_cascade_climbs_every_tier_that_checks_its_answer(replay: ReplayProcess, redis_url: str,
                                                          tmp_path: Path) -> None:
    # three tiers, cheap and mid both escalating: cheap abstains, mid abstains too, top answers; three events
    base = tiers(replay.base_url, ["abstain"])
    mid = {**base[0], "name": "mid", "model": "M:mid", "prices": PRICES["mid"]}
    three = [base[0], mid, base[1]]
    with accounting_gateway(replay.base_url, redis_url, tmp_path, f"tgtest:{uuid.uuid4().hex[:12]}:", tiers=three,
                            routing={"router_path": None, "routed_tiers": ["cheap", "mid", "top"],
                                     "thresholds": [0.98, 0.99], "default_tier": "top",
                                     "effort_tiers": {"low": "cheap", "high": "top"}},
                            cache={"mode": "off"}) as g:
        raw = sdk(g).chat.completions.with_raw_response.create(model="cheap", messages=user(Q_CUP))
        assert raw.parse().choices[0].message.content == "Answer: Uruguay"
        assert raw.headers["x-thinkgate-tier"] == "top"
        rid = raw.headers["x-request-id"]
        events = events_until(g, rid, lambda e: e.tier == "mid" and e.error_code == "escalated_abstain")
        by_tier = {e.tier: e for e in events.values()}
        assert set(by_tier) == {"cheap", "mid", "top"}
        assert (by_tier["cheap"].completion_tokens, by_tier["mid"].completion_tokens,
                by_tier["top"].completion_tokens) == (7, 44, 310)
        assert by_tier["mid"].route_reason == "escalated" and by_tier["mid"].error_code == "escalated_abstain"
        assert by_tier["top"].route_reason == "escalated" and by_tier["top"].error_code is None


def test_a_traces_path_relative_to_the_callers_directory_is_found(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``thinkgate bench learn --traces ../data/traces`` from a subdirectory: the replay process runs in the
    repository, where the relative path named nothing ("no recording for M:cheap in frames")."""
    write_traces(tmp_path / "traces")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with ReplayProcess(Path("../traces"), "frames", [("M", "cheap")], timeout_s=30) as r:
        assert httpx.get(r.root + "/health", timeout=5).status_code == 200
