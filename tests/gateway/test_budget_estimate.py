"""The admission estimate is an upper bound for every request shape — forced thinking's two phases per choice
included —; the reservation format has one owner."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Prices, TierConfig, prompted_hard_stop
from gateway.ledger.pricing import cost_micro_usd
from gateway.ledger.record import UsageRecord
from gateway.state.limits import MESSAGE_OVERHEAD_TOKENS, REQUEST_OVERHEAD_TOKENS, TOOLS_OVERHEAD_TOKENS, estimate
from gateway.state.reservations import Reservation, open_total
from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config, usage_events
from tests.fixtures.upstream import TEST_KEY, GatewayServer, SimProcess, sim_settings, sim_tiers

PRICES = Prices(input_usd_per_mtok=Decimal("0.50"), cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"))
LONG = TierConfig(name="long", max_tokens=100, prices=PRICES)


def _cost(prompt: int, completion: int, prices: Prices = PRICES) -> int:
    return cost_micro_usd(prices, prompt_tokens=prompt, cached_tokens=0, completion_tokens=completion)


@pytest.mark.parametrize(("body", "prompt", "choices"), [
    ({"prompt": "abc"}, 3, 1),
    ({"prompt": "abc", "n": 3}, 3, 3),
    ({"prompt": "abc", "n": 2, "best_of": 5}, 3, 5),  # best_of completions are generated and billed
    ({"prompt": ["abc", "def"], "n": 2}, 6, 4),  # a batch: n completions per prompt
    ({"prompt": [1, 2, 3]}, 3, 1),  # token ids: one prompt, one token each
])
def test_choices_count_n_best_of_and_batches(body: dict[str, object], prompt: int, choices: int) -> None:
    est = estimate(body, [LONG])
    assert est.tokens == prompt + REQUEST_OVERHEAD_TOKENS + choices * 100
    assert est.micro_usd == _cost(prompt + REQUEST_OVERHEAD_TOKENS, choices * 100)


def test_token_ids_tools_and_cached_price_count() -> None:
    ids = estimate({"prompt": list(range(50)), "max_tokens": 1}, [LONG])
    assert ids.tokens == 50 + REQUEST_OVERHEAD_TOKENS + 1  # a token id counts one token
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 100}}]
    plain = estimate({"messages": msgs, "max_tokens": 1}, [LONG])
    with_tools = estimate({"messages": msgs, "tools": tools, "max_tokens": 1}, [LONG])
    assert with_tools.tokens - plain.tokens >= 100 + TOOLS_OVERHEAD_TOKENS
    odd = Prices(input_usd_per_mtok=Decimal("1"), cached_input_usd_per_mtok=Decimal("3"))  # cached dearer
    tier = TierConfig(name="odd", max_tokens=1, prices=odd)
    prompt = len(b"user") + len(b"hi") + MESSAGE_OVERHEAD_TOKENS + REQUEST_OVERHEAD_TOKENS
    assert estimate({"messages": msgs, "max_tokens": 1}, [tier]).micro_usd == prompt * 3  # at the dearer rate


FORCED = TierConfig(name="forced", max_tokens=100, prices=PRICES, budget_mode="forced", thinking_budget=30)


def _forced_worst(prompt: int, choices: int, max_tokens: int, tier: TierConfig) -> tuple[int, int]:
    """What two-phase forcing (gateway/thinking/forcing.py) can bill at most, phase by phase, per choice: phase 1
    sends the prompt and generates a thought of ``used`` ≤ min(budget, max) tokens; phase 2 sends the prompt,
    the opening marker, the thought and the closing marker as the assistant message, and generates at most
    max(1, max − used)."""
    budget = min(tier.thinking_budget or max_tokens, max_tokens)
    markers = len(b"<think>\n") + len(tier.end_of_thinking.encode()) + MESSAGE_OVERHEAD_TOKENS
    worst = (0, 0)
    for used in (0, 1, budget // 2, budget):
        p = prompt + (prompt + markers + used)
        c = used + max(1, max_tokens - used)
        worst = max(worst, (choices * p, choices * c), key=lambda pc: _cost(*pc))
    return worst


@pytest.mark.parametrize(("n", "max_tokens", "text"), [
    (1, 40, "héllo " * 7),
    (3, 40, "héllo " * 7),
    (4, 4, "a " * 300),  # a long prompt re-sent per choice and per phase dominates: 8 x the prompt
    (2, 100, "x"),
])
def test_estimate_bounds_the_real_cost_of_every_call_forcing_makes(n: int, max_tokens: int, text: str) -> None:
    # n > 1 with forcing runs n independent two-phase generations: the prompt goes upstream 2n times plus the
    # thoughts; the old estimate (the prompt once, n x max_tokens) did not cover it
    body = {"messages": [{"role": "user", "content": text}], "n": n, "max_tokens": max_tokens}
    est = estimate(body, [FORCED])
    prompt_ub = len(b"user") + len(text.encode()) + MESSAGE_OVERHEAD_TOKENS + REQUEST_OVERHEAD_TOKENS
    worst = _forced_worst(prompt_ub, n, max_tokens, FORCED)
    assert _cost(*worst) <= est.micro_usd and sum(worst) <= est.tokens
    assert est.prompt is not None and worst[0] <= est.prompt  # both phases' prompts, every choice's
    old = estimate(body, [FORCED.model_copy(update={"budget_mode": "native"})])  # the estimate before forcing counted
    if n > 1 or max_tokens <= 40:
        assert _cost(*worst) > old.micro_usd  # these shapes overspent a hard budget before
    # native tiers: whatever the upstream does within the caps, the real cost is <= the estimate
    native = estimate(body, [LONG])
    for prompt in (1, prompt_ub // 2, prompt_ub):
        for completion in (0, 1, n * min(max_tokens, LONG.max_tokens)):
            assert _cost(prompt, completion) <= native.micro_usd


def test_the_prompt_bound_is_the_largest_over_the_tiers_on_its_own() -> None:
    # A killed call's write-ahead record is billed at most Estimate.prompt. Over a forced tier (the prompt twice per
    # choice) and a native one with a larger completion cap, the largest prompt bound is the forced tier's — more
    # than tokens − completion, the native tier's prompt: derived from the other two bounds, it would have held a
    # forced call's honest prompt count to half of it.
    text = "a " * 300
    big = TierConfig(name="big", max_tokens=4000, prices=PRICES)
    body = {"messages": [{"role": "user", "content": text}]}
    prompt_ub = len(b"user") + len(text.encode()) + MESSAGE_OVERHEAD_TOKENS + REQUEST_OVERHEAD_TOKENS
    est = estimate(body, [FORCED, big])
    assert est.prompt == estimate(body, [FORCED]).prompt and est.prompt is not None and est.prompt > 2 * prompt_ub
    assert (est.completion, est.tokens - 4000) == (4000, prompt_ub)
    assert estimate(body, [big]).prompt == prompt_ub


def _dial_request(tier: TierConfig, n: int, max_tokens: int, budget: int) -> tuple[dict[str, Any], int]:
    """A request to a prompted tier and the upper bound of its prompt tokens (one byte a token), the dial
    instruction (appended with one separator) included."""
    text = "héllo " * 7
    body = {"messages": [{"role": "user", "content": text}], "n": n, "max_tokens": max_tokens}
    said = tier.budget_prompt.format(budget=budget)
    prompt_ub = (len(b"user") + len(text.encode()) + 1 + len(said.encode()) + MESSAGE_OVERHEAD_TOKENS
                 + REQUEST_OVERHEAD_TOKENS)
    return body, prompt_ub


@pytest.mark.parametrize(("n", "max_tokens", "budget"), [(1, 400, 64), (3, 400, 16), (2, 40, 64)])
def test_a_prompted_dial_tier_is_bounded_like_forcing_with_its_instruction_and_hard_stop(
        n: int, max_tokens: int, budget: int) -> None:
    # budget_mode prompted (a dial model) is served by two-phase forcing at prompted_hard_stop(budget), with the
    # dial instruction appended to the prompt: its bound is forcing's with that thought and that prompt
    tier = FORCED.model_copy(update={"budget_mode": "prompted", "thinking_budget": budget, "max_tokens": 512})
    body, prompt_ub = _dial_request(tier, n, max_tokens, budget)
    est = estimate(body, [tier])
    worst = _forced_worst(prompt_ub, n, max_tokens,
                          tier.model_copy(update={"thinking_budget": prompted_hard_stop(budget)}))
    assert _cost(*worst) <= est.micro_usd and sum(worst) <= est.tokens
    assert est.prompt is not None and worst[0] <= est.prompt  # both phases' prompts, every choice's


@pytest.mark.parametrize(("n", "max_tokens", "budget"), [(1, 400, 64), (3, 400, 16)])
def test_a_prompted_tier_with_a_native_hard_stop_is_bounded_as_one_pass(n: int, max_tokens: int, budget: int) -> None:
    # hard_stop: native (vLLM cuts the overrun): one pass, the prompt with its instruction billed once — the bound
    # covers that and is below the forced hard stop's (which pays the prompt twice), so a spend limit admits more
    forced = FORCED.model_copy(update={"budget_mode": "prompted", "thinking_budget": budget, "max_tokens": 512})
    native = forced.model_copy(update={"hard_stop": "native"})
    body, prompt_ub = _dial_request(native, n, max_tokens, budget)
    est = estimate(body, [native])
    assert _cost(prompt_ub, n * max_tokens) <= est.micro_usd and prompt_ub + n * max_tokens <= est.tokens
    assert est.micro_usd < estimate(body, [forced]).micro_usd


def test_an_unlimited_prompted_tier_with_a_range_bounds_the_instruction_at_the_range_maximum() -> None:
    # an unlimited dial tier states a request's own budget, clamped into thinking_budget_range: at most the range's
    # maximum ("Think for 320 tokens."), not "Think for 0 tokens." (the bound once counted the digits of 0)
    tier = FORCED.model_copy(update={"budget_mode": "prompted", "thinking_budget": None, "max_tokens": 512,
                                     "hard_stop": "native", "thinking_budget_range": (8, 320)})
    body, prompt_ub = _dial_request(tier, 1, 400, tier.applied_budget(100000) or 0)
    est = estimate({**body, "thinking_token_budget": 100000}, [tier])
    assert est.prompt is not None and prompt_ub <= est.prompt and prompt_ub + 400 <= est.tokens


def test_forced_n3_billed_by_a_real_gateway_fits_the_estimate_and_not_the_old_one(upstream_sim: SimProcess,
                                                                                  redis_url: str) -> None:
    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"budget_mode": "forced", "thinking_budget": 8})
    settings = sim_settings(upstream_sim.base_url, redis_url, tiers=tiers)
    short = settings.tier("short")
    body = {"model": "short", "n": 3, "max_tokens": 6, "messages": [{"role": "user", "content": "a " * 300}]}
    with GatewayServer(settings) as gw:
        records: list[UsageRecord] = []
        gw.app.state.proxy.usage_sinks.append(records.append)
        r = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                       headers={"authorization": f"Bearer {TEST_KEY}", "cache-control": "no-store"})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 3
    (billed,) = [rec for rec in records if rec.request_id == r.headers["x-request-id"]]
    assert billed.prompt_tokens > 6 * 300  # three choices x two phases, each with the 300-word prompt
    assert billed.cost_micro_usd <= estimate(body, [short]).micro_usd
    assert billed.cost_micro_usd > estimate(body, [short.model_copy(update={"budget_mode": "native"})]).micro_usd


def test_reservation_format_round_trip_and_open_total() -> None:
    r = Reservation(1234, 56, 1_000)
    assert r.encode() == "1234|56|1000" and Reservation.decode(b"1234|56|1000") == r
    assert Reservation.decode("garbage") is None and Reservation.decode("1|2") is None
    fields = {b"a": b"10|0|2000", b"b": b"5|0|500", b"c": b"bad"}
    assert open_total(fields, now_ms=1000) == 10  # expired and malformed fields never count


def test_a_request_with_an_image_has_no_prompt_bound() -> None:
    """The prompt bound counts bytes; an image by URL is a few dozen bytes and bills hundreds of tokens (a reviewer's
    snippet: an image_url request bounded at 96 tokens, a killed call's 1,200 claimed tokens billed as 96). A request
    with an image, audio or file part has none; a text request keeps its bound."""
    tier = TierConfig(name="long", base_url="http://u/v1", model="m", max_tokens=64)
    image = {"model": "long", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in it?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "high"}}]}]}
    assert estimate(image, [tier]).prompt is None
    text = {"model": "long", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is in it?"}]}]}
    assert estimate(text, [tier]).prompt is not None


def _key_heavy_tools(n: int) -> list[dict[str, Any]]:
    """A function tool whose schema is almost all key names (``{"<name>": {}}`` per parameter): a chat template
    renders it as JSON, keys and punctuation included."""
    props = {f"a_rather_long_descriptive_parameter_name_{i:05d}": {} for i in range(n)}
    return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props,
                                                                          "minimum": 1.5, "strict": True}}}]


def test_a_tool_schema_counts_as_the_json_a_template_renders_keys_included() -> None:
    # The prompt bound counted only the string values of ``tools``: the 3,000 parameter names of this schema (its
    # keys, ~150 KB rendered) counted 0 bytes, and the request was bounded at ~300 prompt tokens
    tools = _key_heavy_tools(3000)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 1}
    rendered = len(json.dumps(tools, ensure_ascii=False).encode())  # Jinja's tojson: ", " and ": " separators
    est = estimate(body, [LONG])
    assert est.prompt is not None and est.prompt >= rendered + TOOLS_OVERHEAD_TOKENS


def test_a_hard_budget_holds_for_a_request_whose_tool_schema_is_mostly_keys(upstream_sim: SimProcess,
                                                                            redis_url: str,
                                                                            tmp_path: Path) -> None:
    # a real gateway and Redis: the upstream reports the prompt a tokenizer would (~3 bytes a token of the rendered
    # JSON) — before, admitted on a ~300-token bound against a $0.01 budget and booked $0.013
    tools = _key_heavy_tools(1500)  # ~78 KB: under the test gateway's max_body_bytes
    prompt = len(json.dumps(tools).encode()) // 3
    _refused_by_a_cent(upstream_sim, redis_url, tmp_path, prompt,
                       {"tools": tools, "tool_choice": "none",
                        "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex[:6]}"}]})


def _refused_by_a_cent(upstream_sim: SimProcess, redis_url: str, tmp_path: Path, prompt: int,
                       fields: dict[str, Any]) -> None:
    """One request of ``fields`` (``max_tokens`` 5) from a key with a $0.01 daily hard budget, its upstream
    reporting ``prompt`` prompt tokens: refused (429) on its estimate alone, nothing booked past the budget."""
    auth = keys_config(alice={"budget_usd_day": "0.01"})
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, auth=auth) as gw:
        body = {"model": "long", "max_tokens": 5, **fields,
                "sim": {"usage": {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}}}
        r = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                       headers={"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"})
        assert r.status_code in (200, 429), r.text
        spent = sum(ev.cost_micro_usd for ev in usage_events(gw, [r.headers["x-request-id"]]).values()
                    if ev.key_id == "alice" and not ev.audit)
        assert spent <= 10_000, f"a $0.01 hard budget was booked {spent} micro-USD (status {r.status_code})"
        assert r.status_code == 429  # the estimate alone is above the whole budget


def _history_with_a_tool_call(arguments: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"hi {uuid.uuid4().hex[:6]}"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]


@pytest.mark.parametrize("arguments", [
    pytest.param("[" + ",".join(["1e15"] * 2000) + "]", id="compact-string"),  # 5 bytes sent, 20 rendered
    pytest.param({f"key_{i:05d}": 1 for i in range(2000)}, id="object"),  # keys: text _text_bytes did not count
])
def test_a_tool_calls_arguments_count_as_the_json_a_template_renders(arguments: Any) -> None:
    # vLLM parses a tool call's arguments string (and takes an object as is) before the template renders it with
    # tojson: ", " separators and floats as Python prints them (1e15 -> 1000000000000000.0) — the prompt bound
    # counted the string's bytes (a quarter of the rendered text) or an object's values only
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    rendered = len(json.dumps(parsed, ensure_ascii=False).encode())
    est = estimate({"messages": _history_with_a_tool_call(arguments), "max_tokens": 1}, [LONG])
    assert est.prompt is not None and est.prompt >= rendered
    # no JSON, or nested past the parser: the string as sent (the upstream refuses it)
    for odd in ("not json", "[" * 5000):
        est = estimate({"messages": _history_with_a_tool_call(odd), "max_tokens": 1}, [LONG])
        assert est.prompt is not None and est.prompt >= len(odd)


def test_a_hard_budget_holds_for_a_request_whose_tool_call_arguments_render_longer(upstream_sim: SimProcess,
                                                                                   redis_url: str,
                                                                                   tmp_path: Path) -> None:
    # a real gateway and Redis: the upstream reports the prompt of the rendered arguments (~0.9 tokens a byte: a
    # tokenizer splitting digits one a token) — before, admitted on the ~15 KB string's bound against a $0.01 budget
    # and booked 2.7x it
    arguments = "[" + ",".join(["1e15"] * 3000) + "]"
    prompt = len(json.dumps(json.loads(arguments)).encode()) * 9 // 10
    _refused_by_a_cent(upstream_sim, redis_url, tmp_path, prompt, {"messages": _history_with_a_tool_call(arguments)})


def test_documents_and_template_arguments_count_in_the_prompt_bound() -> None:
    # vLLM renders a chat request's `documents` (retrieval) and `chat_template_kwargs` into the prompt through the
    # template: the bound counted neither, so 20 KB of documents were booked as a one-word question
    question = [{"role": "user", "content": "summarise"}]
    docs = [{"title": f"doc {i}", "text": "lorem ipsum dolor " * 60} for i in range(20)]
    rendered = len(json.dumps(docs, ensure_ascii=False).encode())
    plain = estimate({"messages": question, "max_tokens": 1}, [LONG])
    with_docs = estimate({"messages": question, "max_tokens": 1, "documents": docs}, [LONG])
    assert plain.prompt is not None and with_docs.prompt is not None
    assert with_docs.prompt - plain.prompt >= rendered
    kwargs = {"enable_thinking": True, "persona": "x" * 5000}
    with_kwargs = estimate({"messages": question, "max_tokens": 1, "chat_template_kwargs": kwargs}, [LONG])
    assert with_kwargs.prompt is not None and with_kwargs.prompt - plain.prompt >= 5000


def test_a_requests_own_chat_template_is_refused(upstream_sim: SimProcess, redis_url: str) -> None:
    # a request's template renders any prompt it likes from a short body (here: the question 5,000 times) — no bound
    # could be booked; refused before any upstream call, as vLLM refuses it unless told to trust request templates
    template = "{% for i in range(5000) %}{{ messages[0].content }}{% endfor %}"
    with GatewayServer(sim_settings(upstream_sim.base_url, redis_url)) as gw:
        before = upstream_sim.stats()["requests"]
        r = httpx.post(gw.base_url + "/chat/completions", timeout=10, headers={"authorization": f"Bearer {TEST_KEY}"},
                       json={"model": "long", "messages": [{"role": "user", "content": "hi"}],
                             "chat_template": template})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template" and r.json()["error"]["code"] == "unsupported_parameter"
        assert upstream_sim.stats()["requests"] == before


def test_a_completions_suffix_counts_in_the_prompt_bound_once_per_prompt() -> None:
    # fill-in-the-middle: the suffix is prompt text the upstream reads with every prompt of a batch
    suffix = "s" * 3000
    one = estimate({"prompt": "def f(", "max_tokens": 1}, [LONG])
    with_suffix = estimate({"prompt": "def f(", "suffix": suffix, "max_tokens": 1}, [LONG])
    assert one.prompt is not None and with_suffix.prompt is not None and with_suffix.prompt - one.prompt == 3000
    batch = estimate({"prompt": ["a(", "b("], "suffix": suffix, "max_tokens": 1}, [LONG])
    assert batch.prompt is not None and batch.prompt >= 2 * 3000
