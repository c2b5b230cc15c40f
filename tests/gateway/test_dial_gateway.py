"""``budget_mode: prompted`` through the real gateway over the simulator: the tier's (or the request's smaller)
thinking budget reaches the model as the dial prompt, unchanged otherwise; forcing stays the hard stop above it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.thinking.dial import hard_stop
from router.model import TrainedRouter
from router.persistence import save_router
from router.policy import BudgetMap
from router.window import routing_window
from tests.fixtures.upstream import TEST_KEY, GatewayServer, SimProcess, sim_settings, sim_tiers
from tests.fixtures.upstream_sim import reasoning_words

QUESTION = "Start with 7. Add 5, then multiply by 3. What is the result of all these steps please?"
SHORT, LONG = 32, 2  # "long" gets a tiny budget so that the simulator's thought overruns its hard stop


@pytest.fixture
def dial_gateway(upstream_sim: SimProcess, redis_url: str) -> Iterator[GatewayServer]:
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"budget_mode": "prompted", "thinking_budget": SHORT, "max_tokens": 128})
    tiers[2].update({"budget_mode": "prompted", "thinking_budget": LONG, "max_tokens": 128,
                     "budget_prompt": "Budget: {budget} tokens."})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        yield gw


def _ask(gw: GatewayServer, sim: SimProcess, **kw: Any) -> tuple[Any, dict[str, Any]]:
    tag = uuid.uuid4().hex
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=30)
    extra = {**kw.pop("extra_body", {}), "sim": {"tag": tag}}
    kw.setdefault("messages", [{"role": "user", "content": QUESTION}])
    resp = client.chat.completions.create(extra_body=extra, **kw)
    last = sim.tag(tag)
    assert last is not None
    return resp, last["body"]


def _user_texts(body: dict[str, Any]) -> list[Any]:
    return [m["content"] for m in body["messages"] if m["role"] == "user"]


def test_tier_budget_reaches_the_model_in_the_prompt(dial_gateway: GatewayServer, upstream_sim: SimProcess) -> None:
    resp, body = _ask(dial_gateway, upstream_sim, model="short")
    assert _user_texts(body) == [f"{QUESTION} Think for {SHORT} tokens."]
    assert "thinking_token_budget" not in body
    assert resp.choices[0].message.content.startswith("echo:")


def test_request_budget_below_the_tier_is_the_one_sent(dial_gateway: GatewayServer, upstream_sim: SimProcess) -> None:
    _, body = _ask(dial_gateway, upstream_sim, model="short", extra_body={"thinking_token_budget": 12})
    assert _user_texts(body) == [f"{QUESTION} Think for 12 tokens."]
    _, body = _ask(dial_gateway, upstream_sim, model="short", extra_body={"thinking_token_budget": 999})
    assert _user_texts(body) == [f"{QUESTION} Think for {SHORT} tokens."]  # never above the tier's
    _, body = _ask(dial_gateway, upstream_sim, model="short", extra_body={"thinking_token_budget": 0})
    assert _user_texts(body) == [QUESTION] and body["chat_template_kwargs"]["enable_thinking"] is False


def test_reasoning_effort_maps_to_the_tier_budget(dial_gateway: GatewayServer, upstream_sim: SimProcess) -> None:
    _, body = _ask(dial_gateway, upstream_sim, model="auto", reasoning_effort="low")
    assert _user_texts(body) == [f"{QUESTION} Think for {SHORT} tokens."]


def test_earlier_turns_and_parts_are_untouched(dial_gateway: GatewayServer, upstream_sim: SimProcess) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Start with 2."},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
    ]
    _, body = _ask(dial_gateway, upstream_sim, model="short", messages=messages)
    sent = [m for m in body["messages"] if m["role"] != "assistant" or m["content"] == "2"]
    assert sent[:3] == messages[:3]
    assert sent[3]["content"] == [{"type": "text", "text": QUESTION}, {"type": "text", "text": " Think for 32 tokens."}]


def test_forcing_is_the_hard_stop_above_the_requested_budget(
    dial_gateway: GatewayServer, upstream_sim: SimProcess
) -> None:
    resp, body = _ask(dial_gateway, upstream_sim, model="long")
    assert _user_texts(body) == [f"{QUESTION} Budget: {LONG} tokens."]
    reasoning = (resp.choices[0].message.model_extra or {}).get("reasoning") or ""
    # the simulator thinks 16+ words whatever the prompt says: the gateway cuts it at the hard stop and answers
    unbudgeted = len(reasoning_words(_user_texts(body)[0]))
    assert hard_stop(LONG) < unbudgeted
    assert len(reasoning.split()) == hard_stop(LONG)
    assert resp.usage.completion_tokens_details.reasoning_tokens == hard_stop(LONG)
    assert body["continue_final_message"] is True  # phase 2 of forcing
    assert resp.choices[0].message.content.startswith("echo:")


def test_a_native_hard_stop_is_one_pass_and_bills_the_prompt_once(upstream_sim: SimProcess, redis_url: str) -> None:
    # two dial tiers with the same small budget: "short" stops an overrun by forcing (two passes), "long" by the
    # upstream's own thinking_token_budget (hard_stop: native, vLLM's cut; the simulator honours it)
    tiers = sim_tiers(upstream_sim.base_url)
    for t, stop in ((tiers[1], "forced"), (tiers[2], "native")):
        t.update({"budget_mode": "prompted", "thinking_budget": LONG, "max_tokens": 128, "hard_stop": stop})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        forced, forced_body = _ask(gw, upstream_sim, model="short")
        native, native_body = _ask(gw, upstream_sim, model="long")
    assert _user_texts(native_body) == _user_texts(forced_body) == [f"{QUESTION} Think for {LONG} tokens."]
    assert native_body["thinking_token_budget"] == hard_stop(LONG) and "continue_final_message" not in native_body
    assert forced_body["continue_final_message"] is True
    for resp in (forced, native):  # the same cut thought and answer either way
        reasoning = (resp.choices[0].message.model_extra or {}).get("reasoning") or ""
        assert len(reasoning.split()) == hard_stop(LONG)
        assert resp.usage.completion_tokens_details.reasoning_tokens == hard_stop(LONG)
        assert resp.choices[0].message.content.startswith("echo:")
    # phase 2 sent the prompt again (with the thought); one pass sends it once
    assert native.usage.prompt_tokens < forced.usage.prompt_tokens / 2


# ----------------------------------------------------------------------------- routing to a budget (router file)

MAP_CUT, LOW_BUDGET, HIGH_BUDGET = 0.5, 24, 96


@pytest.fixture
def budget_router_gateway(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> Iterator[GatewayServer]:
    """A dial tier ``long`` (prompted, unlimited by its config) and a router file that sends every routed request
    to it with a budget from the score: below ``MAP_CUT`` (a short question) ``LOW_BUDGET``, else ``HIGH_BUDGET``."""
    bmap = BudgetMap("long", (MAP_CUT,), (LOW_BUDGET, HIGH_BUDGET))
    meta = {"serving": {"policy": "length+budgets", "scorer": "length", "thresholds": [0.0],
                        "budgets": bmap.to_dict()}}
    path = save_router(TrainedRouter(pipeline=None, scorer="length", thresholds=[0.0], metadata=meta),
                       tmp_path / "dial-router.skops")
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[2].update({"budget_mode": "prompted", "thinking_budget": None, "max_tokens": 256})
    routing = {"router_path": str(path), "routed_tiers": ["short", "long"], "default_tier": "long",
               "on_router_error": "refuse_start"}
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers, routing=routing)) as gw:
        yield gw


def _ask_raw(gw: GatewayServer, sim: SimProcess, model: str, question: str,
             **extra: Any) -> tuple[Any, dict[str, Any]]:
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0, timeout=30)
    tag = uuid.uuid4().hex
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": question}], extra_body={"sim": {"tag": tag}, **extra})
    last = sim.tag(tag)
    assert last is not None
    return raw, last["body"]


def test_auto_routes_to_the_budget_the_router_file_maps_the_score_to(
    budget_router_gateway: GatewayServer, upstream_sim: SimProcess
) -> None:
    long_question = QUESTION + " Then add 1." * 120
    scorer = TrainedRouter(pipeline=None, scorer="length")  # the file's scorer, on the gateway's routing window
    score = [scorer.score(routing_window([{"role": "user", "content": q}])) for q in (QUESTION, long_question)]
    assert score[0] < MAP_CUT <= score[1], score
    for question, budget in ((QUESTION, LOW_BUDGET), (long_question, HIGH_BUDGET)):
        raw, body = _ask_raw(budget_router_gateway, upstream_sim, "auto", question)
        assert raw.headers["x-thinkgate-tier"] == "long" and raw.headers["x-thinkgate-route-reason"] == "predicted"
        assert raw.headers["x-thinkgate-thinking-budget"] == str(budget)
        assert _user_texts(body) == [f"{question} Think for {budget} tokens."]
    # a forced route keeps the tier as configured: unlimited, no instruction, no budget header — and one pass
    # (no budget, so no forcing: phase 2 would send the prompt again)
    raw, body = _ask_raw(budget_router_gateway, upstream_sim, "long", QUESTION)
    assert _user_texts(body) == [QUESTION] and "x-thinkgate-thinking-budget" not in raw.headers
    assert "continue_final_message" not in body
    # a request's own smaller budget is the one stated to the model, and the one the header shows
    raw, body = _ask_raw(budget_router_gateway, upstream_sim, "auto", QUESTION, thinking_token_budget=12)
    assert _user_texts(body) == [f"{QUESTION} Think for 12 tokens."]
    assert raw.headers["x-thinkgate-thinking-budget"] == "12"
    # a budget of 0 turns thinking off, and the header says 0 (it was missing)
    raw, body = _ask_raw(budget_router_gateway, upstream_sim, "auto", QUESTION, thinking_token_budget=0)
    assert raw.headers["x-thinkgate-thinking-budget"] == "0"
    assert body["chat_template_kwargs"]["enable_thinking"] is False


def test_models_says_which_budgets_the_router_file_serves(budget_router_gateway: GatewayServer) -> None:
    import httpx

    data = httpx.get(budget_router_gateway.base_url + "/models", headers={"authorization": f"Bearer {TEST_KEY}"},
                     timeout=10).json()["data"]
    auto = next(m for m in data if m["id"] == "auto")
    said = auto["thinkgate"]["router_status"]["budgets"]
    assert f"score < {MAP_CUT:.3f}: {LOW_BUDGET} tokens, else {HIGH_BUDGET} tokens" in said, said


# ----------------------------------------------------------------- the budgets the model follows (budget_range)

DIAL_DIR = Path(__file__).resolve().parents[2] / "models" / "thinkgate-tiny-dial"
REPRO = "Start with 3. Add 4. What is the result?"


@pytest.fixture
def shipped_dial_gateway(upstream_sim: SimProcess, redis_url: str) -> Iterator[GatewayServer]:
    """The shipped dial model's tiers (``--model-dir models/thinkgate-tiny-dial``: its dial.json, its
    ``budget_range: [8, 320]``) served over the simulator instead of vLLM, with a key that refuses what it would
    otherwise get clamped (``over_cap: refuse``)."""
    from gateway.config.model_dir import dial_tiers

    auth = {"keys": [{"id": "test", "secret": TEST_KEY}, {"id": "strict", "secret": STRICT_KEY, "over_cap": "refuse"}]}
    routing = {"router_path": None, "routed_tiers": ["short", "long"], "default_tier": "long"}  # the file's cuts
    settings = dial_tiers(sim_settings(upstream_sim.base_url, redis_url, auth=auth, routing=routing), DIAL_DIR)
    assert {t.name: t.thinking_budget_range for t in settings.tiers}["long"] == (8, 320)
    with GatewayServer(settings) as gw:
        yield gw


STRICT_KEY = "tg-test-strict-0123456789"


@pytest.mark.parametrize(("asked", "applied"), [(448, 320), (100000, 320), (4, 8), (100, 100), (320, 320), (8, 8)])
def test_a_budget_outside_the_models_range_is_served_at_its_nearest_end_and_said_so(
    shipped_dial_gateway: GatewayServer, upstream_sim: SimProcess, asked: int, applied: int
) -> None:
    # the new user's repro (make serve, model auto: every request goes to the unlimited `long`, so the request's
    # budget is the one stated): 448 and 100000 were stated as asked (the model's 3-digit counter read "100") and
    # the header echoed them; 4 was below anything the model was trained on
    for model in ("auto", "long"):
        raw, body = _ask_raw(shipped_dial_gateway, upstream_sim, model, REPRO, thinking_token_budget=asked)
        assert raw.headers["x-thinkgate-tier"] == "long"
        assert _user_texts(body) == [f"{REPRO} Think for {applied} tokens."], (asked, _user_texts(body))
        assert raw.headers["x-thinkgate-thinking-budget"] == str(applied)


def test_the_range_bounds_a_tier_budget_too_and_leaves_thinking_off_alone(
    shipped_dial_gateway: GatewayServer, upstream_sim: SimProcess
) -> None:
    # `short` (32): a larger request keeps the tier's own budget, as before; a smaller one below the range gets 8
    raw, body = _ask_raw(shipped_dial_gateway, upstream_sim, "short", REPRO, thinking_token_budget=448)
    assert _user_texts(body) == [f"{REPRO} Think for 32 tokens."] and raw.headers["x-thinkgate-thinking-budget"] == "32"
    raw, body = _ask_raw(shipped_dial_gateway, upstream_sim, "short", REPRO, thinking_token_budget=3)
    assert _user_texts(body) == [f"{REPRO} Think for 8 tokens."] and raw.headers["x-thinkgate-thinking-budget"] == "8"
    # 0 is not a budget but thinking off (the model's direct mode): not raised to the minimum
    raw, body = _ask_raw(shipped_dial_gateway, upstream_sim, "long", REPRO, thinking_token_budget=0)
    assert raw.headers["x-thinkgate-thinking-budget"] == "0" and _user_texts(body) == [REPRO]
    assert body["chat_template_kwargs"]["enable_thinking"] is False
    # no budget asked on the unlimited tier: no instruction, no header, as before
    raw, body = _ask_raw(shipped_dial_gateway, upstream_sim, "long", REPRO)
    assert _user_texts(body) == [REPRO] and "x-thinkgate-thinking-budget" not in raw.headers


def test_the_messages_api_clamps_budget_tokens_the_same_way(
    shipped_dial_gateway: GatewayServer, upstream_sim: SimProcess
) -> None:
    import httpx

    for asked, applied, max_tokens in ((448, 320, 512), (4, 8, 64)):
        tag = uuid.uuid4().hex
        r = httpx.post(shipped_dial_gateway.url + "/v1/messages", timeout=30, headers={"x-api-key": TEST_KEY},
                       json={"model": "long", "max_tokens": max_tokens, "sim": {"tag": tag},
                             "thinking": {"type": "enabled", "budget_tokens": asked},
                             "messages": [{"role": "user", "content": REPRO}]})
        assert r.status_code == 200, r.text
        assert r.headers["x-thinkgate-thinking-budget"] == str(applied)
        last = upstream_sim.tag(tag)
        assert last is not None and _user_texts(last["body"]) == [f"{REPRO} Think for {applied} tokens."]


def test_a_refusing_key_gets_a_400_naming_the_range_and_nothing_is_sent(
    shipped_dial_gateway: GatewayServer, upstream_sim: SimProcess
) -> None:
    import httpx

    auth = {"authorization": f"Bearer {STRICT_KEY}"}
    for asked in (448, 4):
        tag = uuid.uuid4().hex
        r = httpx.post(shipped_dial_gateway.base_url + "/chat/completions", headers=auth, timeout=30,
                       json={"model": "long", "thinking_token_budget": asked, "sim": {"tag": tag},
                             "messages": [{"role": "user", "content": REPRO}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"]) == ("invalid_request_error", "thinking_token_budget")
        assert "between 8 and 320" in err["message"] and f"got {asked}" in err["message"]
        assert upstream_sim.tag(tag) is None
        # the Messages API: Anthropic's error shape, naming its own field
        r = httpx.post(shipped_dial_gateway.url + "/v1/messages", timeout=30, headers={"x-api-key": STRICT_KEY},
                       json={"model": "long", "max_tokens": 512, "sim": {"tag": tag},
                             "thinking": {"type": "enabled", "budget_tokens": asked},
                             "messages": [{"role": "user", "content": REPRO}]})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "'thinking.budget_tokens' must be between 8 and 320" in body["error"]["message"]
        assert upstream_sim.tag(tag) is None
    # /v1/models states the range on each tier's card
    cards = httpx.get(shipped_dial_gateway.base_url + "/models", headers=auth, timeout=10).json()["data"]
    assert {c["id"]: c.get("thinkgate", {}).get("thinking_budget_range") for c in cards if c["id"] != "auto"} == {
        "none": None, "short": [8, 320], "long": [8, 320]}
    # in range, or the tier's own smaller budget applies: served
    raw, _ = _ask_raw_key(shipped_dial_gateway, upstream_sim, STRICT_KEY, "long", thinking_token_budget=100)
    assert raw.headers["x-thinkgate-thinking-budget"] == "100"
    raw, _ = _ask_raw_key(shipped_dial_gateway, upstream_sim, STRICT_KEY, "short", thinking_token_budget=448)
    assert raw.headers["x-thinkgate-thinking-budget"] == "32"


def _ask_raw_key(gw: GatewayServer, sim: SimProcess, key: str, model: str, **extra: Any) -> tuple[Any, dict[str, Any]]:
    client = openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=30)
    tag = uuid.uuid4().hex
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": REPRO}], extra_body={"sim": {"tag": tag}, **extra})
    last = sim.tag(tag)
    assert last is not None
    return raw, last["body"]


@pytest.mark.parametrize("model", ["short", "long"])
def test_a_native_or_forced_tier_with_a_range_clamps_what_the_upstream_cuts_at(
    upstream_sim: SimProcess, redis_url: str, model: str
) -> None:
    # not only dial tiers: a native tier sends the clamped budget as vLLM's thinking_token_budget, a forced tier
    # cuts its thought phase there (the simulator thinks 16-31 words and honours thinking_token_budget)
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"budget_mode": "native", "thinking_budget": None, "thinking_budget_range": [8, 12]})
    tiers[2].update({"budget_mode": "forced", "thinking_budget": None, "thinking_budget_range": [8, 12]})
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        for asked, applied in ((1000, 12), (3, 8), (10, 10)):  # short: native, long: forced
            raw, body = _ask_raw(gw, upstream_sim, model, QUESTION, thinking_token_budget=asked)
            assert raw.headers["x-thinkgate-thinking-budget"] == str(applied), asked
            assert raw.parse().usage.completion_tokens_details.reasoning_tokens == applied, asked
            if model == "short":
                assert body["thinking_token_budget"] == applied


@pytest.mark.parametrize("model", ["short", "long"])
def test_budgets_served_at_one_applied_budget_share_one_cache_entry(
    upstream_sim: SimProcess, redis_url: str, model: str
) -> None:
    # the exact cache's key is the upstream body: a forced tier kept the client's budget there, so 448 and 100000
    # (both served at 12) were two entries and a request at 12 hit neither; never may a request get an answer
    # cached at another applied budget (10 here: a shorter thought). short: native (always was right), long: forced
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"budget_mode": "native", "thinking_budget": None, "thinking_budget_range": [8, 12]})
    tiers[2].update({"budget_mode": "forced", "thinking_budget": None, "thinking_budget_range": [8, 12]})
    client = openai.OpenAI(api_key=TEST_KEY, max_retries=0, timeout=30)
    question = f"{QUESTION} {uuid.uuid4().hex}"  # entries of earlier runs on a shared Redis are not found

    def ask(budget: int) -> tuple[str, str, str]:
        raw = client.with_options(base_url=gw.base_url).chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0,
            extra_body={"thinking_token_budget": budget})
        msg = raw.parse().choices[0].message
        assert raw.headers["x-thinkgate-thinking-budget"] == str(min(max(budget, 8), 12))
        return raw.headers["x-thinkgate-cache"], (msg.model_extra or {}).get("reasoning") or "", msg.content or ""

    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)) as gw:
        cache, thought, answer = ask(448)
        assert cache == "miss" and len(thought.split()) == 12 and answer
        assert ask(100000) == ask(12) == ("hit", thought, answer)
        cache, shorter, _ = ask(10)
        assert cache == "miss" and len(shorter.split()) == 10
        assert ask(10)[0] == "hit"
