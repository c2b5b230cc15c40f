"""An upstream's usage the gateway cannot trust, through a real gateway, Redis and the upstream simulator (its
``"sim": {"usage": …}`` sends any usage object): negative, fractional, null, non-numeric or absurd counts, or
none at all. Every request is metered once — counted by the gateway where the usage is no count (it was lost, a
500 after the upstream had generated, or free at $0) — no write-ahead record stays open, and a completion count
above what the call was allowed is held to that bound."""

from __future__ import annotations

import csv
import io
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.ledger import export
from tests.fixtures.gateway import SECRETS, accounting_gateway, usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess
from tests.fixtures.upstream_sim import answer_words

QUESTION = "What is six times seven exactly?"


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[GatewayServer]:
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("usage")) as g:
        yield g


def _ask(gw: GatewayServer, usage: Any, stream: bool = False, **extra: Any) -> httpx.Response:
    body = {"model": "long", "messages": [{"role": "user", "content": f"{QUESTION} {uuid.uuid4().hex[:6]}"}],
            "sim": {"usage": usage}, **extra}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {SECRETS['alice']}"})


def _open_wal(gw: GatewayServer, redis_url: str) -> int:
    r = redis.Redis.from_url(redis_url)
    try:
        return int(r.hlen(gw.settings.redis.key_prefix + "wal:open"))
    finally:
        r.close()


BAD = [
    pytest.param("omit", id="no-usage"),
    pytest.param({"prompt_tokens": None, "completion_tokens": None}, id="null-counts"),
    pytest.param({"prompt_tokens": -10, "completion_tokens": -1000}, id="negative"),
    pytest.param({"prompt_tokens": 12, "completion_tokens": "abc"}, id="string"),
    pytest.param({"prompt_tokens": 12, "completion_tokens": 1e12}, id="absurd"),
    pytest.param({"prompt_tokens": 12.7, "completion_tokens": 20}, id="fractional"),
    pytest.param("not a usage object", id="not-an-object"),
]


@pytest.mark.parametrize("usage", BAD)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_usage_that_is_no_count_is_counted_by_the_gateway(gw: GatewayServer, redis_url: str, usage: Any,
                                                            stream: bool) -> None:
    r = _ask(gw, usage, stream)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    if stream:
        chunks = [orjson.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert r.text.rstrip().endswith("data: [DONE]")
        told = [c["usage"] for c in chunks if c.get("usage") and not c.get("choices")]
    else:
        told = [r.json()["usage"]]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.status, ev.usage_source) == (200, "counted")
    assert ev.prompt_tokens > 0 and ev.completion_tokens >= len(answer_words(QUESTION)) // 2 and ev.cost_micro_usd > 0
    # the client is told the usage that was metered (the upstream's was none to trust)
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in told] == [(ev.prompt_tokens, ev.completion_tokens)]
    assert _open_wal(gw, redis_url) == 0 or rid.encode() not in redis.Redis.from_url(redis_url).hkeys(
        gw.settings.redis.key_prefix + "wal:open")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_bad_details_are_clipped_not_fatal(gw: GatewayServer, stream: bool) -> None:
    """A negative reasoning count (a Prometheus counter refused it inside the usage sink: the request answered 200
    and its usage event was lost) and a cached count above the prompt: the totals are taken, the details clipped."""
    usage = {"prompt_tokens": 12, "completion_tokens": 20, "total_tokens": 32,
             "completion_tokens_details": {"reasoning_tokens": -5},
             "prompt_tokens_details": {"cached_tokens": 100_000}}
    r = _ask(gw, usage, stream)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.usage_source, ev.prompt_tokens, ev.completion_tokens) == ("upstream", 12, 20)
    assert ev.cached_tokens == 12 and 0 <= ev.reasoning_tokens <= 20
    assert not ev.over_bound  # within its bound (256): metered as reported, no mark


def _told(r: httpx.Response, stream: bool) -> list[dict[str, Any]]:
    """The usage objects a client read: the JSON answer's, or every SSE data line's (``usage``, a Responses
    event's ``response.usage``, an Anthropic ``message_delta``'s)."""
    if not stream:
        return [r.json()["usage"]]
    docs = [orjson.loads(x[x.index("data: ") + 6:]) for x in r.text.split("\n\n") if "data: {" in x]
    told = [d.get("usage") or (d.get("response") or {}).get("usage") for d in docs]
    return [u for u in told if u and any(u.values())]


@pytest.mark.parametrize("path", ["/chat/completions", "/responses", "/messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_client_is_told_the_clipped_details_that_were_metered(gw: GatewayServer, path: str, stream: bool) -> None:
    """A cached count above the prompt and a reasoning count above the completion are clipped where they are
    metered; the client was told the upstream's counts — 100,000 cached tokens of a 12-token prompt, 50 thought
    tokens of 20, and on ``/v1/messages`` ``input_tokens: -99988`` — where every API promises the usage it is
    priced with."""
    usage = {"prompt_tokens": 12, "completion_tokens": 20, "total_tokens": 32,
             "completion_tokens_details": {"reasoning_tokens": 50},
             "prompt_tokens_details": {"cached_tokens": 100_000}}
    text = f"{QUESTION} {uuid.uuid4().hex[:6]}"
    body: dict[str, Any] = {"model": "long", "sim": {"usage": usage}, "stream": stream}
    if path == "/responses":
        body |= {"input": text}
    else:
        body |= {"messages": [{"role": "user", "content": text}], "max_tokens": 256}
    if path == "/chat/completions" and stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(gw.base_url + path, json=body, timeout=30, headers={"authorization": f"Bearer {SECRETS['alice']}"})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, ev.reasoning_tokens) == (12, 20, 12, 20)
    told = _told(r, stream)
    assert told, r.text
    for u in told:
        if path == "/chat/completions":
            got = (u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                   u["completion_tokens_details"]["reasoning_tokens"])
        elif path == "/responses":
            got = (u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"],
                   u["output_tokens_details"]["reasoning_tokens"])
        else:  # Anthropic counts the cache read apart from input_tokens
            got = (u["input_tokens"] + u["cache_read_input_tokens"], u["output_tokens"], u["cache_read_input_tokens"],
                   u["output_tokens_details"]["thinking_tokens"])
            assert u["input_tokens"] >= 0, u
        assert got == (12, 20, 12, 20), u


@pytest.mark.parametrize("path", ["/chat/completions", "/responses", "/messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("details", [{"prompt_tokens_details": "x"}, {"completion_tokens_details": 7}],
                         ids=["prompt-details", "completion-details"])
def test_details_that_are_no_object_are_told_as_metered(gw: GatewayServer, path: str, stream: bool,
                                                        details: dict[str, Any]) -> None:
    """A usage whose ``*_tokens_details`` is no object (a string, a number) is metered with those details at 0,
    and was passed on as it came: ``/v1/messages`` and ``/v1/responses`` read it to translate it, so the client got
    a 500 (JSON) or a stream cut before its end (metered 499 ``client_disconnected``) for an answer billed in full.
    The client is told the usage that was metered, on every endpoint. Tier ``none`` does not think: no reasoning
    count is filled in (which replaced a bad ``completion_tokens_details`` by chance)."""
    usage = {"prompt_tokens": 12, "completion_tokens": 20, "total_tokens": 32, **details}
    text = f"{QUESTION} {uuid.uuid4().hex[:6]}"
    body: dict[str, Any] = {"model": "none", "sim": {"usage": usage}, "stream": stream}
    if path == "/responses":
        body |= {"input": text}
    else:
        body |= {"messages": [{"role": "user", "content": text}], "max_tokens": 64}
    if path == "/chat/completions" and stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(gw.base_url + path, json=body, timeout=30, headers={"authorization": f"Bearer {SECRETS['alice']}"})
    assert r.status_code == 200, r.text
    if stream:  # ended as its API ends a stream, not cut
        end = {"/chat/completions": "data: [DONE]", "/responses": "event: response.completed",
               "/messages": "event: message_stop"}[path]
        assert end in r.text, r.text[-300:]
    rid = r.headers["x-request-id"]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.status, ev.error_code, ev.partial) == (200, None, False)
    assert (ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, ev.reasoning_tokens) == (12, 20, 0, 0)
    told = _told(r, stream)
    assert told, r.text
    for u in told:
        if path == "/chat/completions":
            got = (u["prompt_tokens"], u["completion_tokens"],
                   (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                   u["completion_tokens_details"]["reasoning_tokens"])
        elif path == "/responses":
            got = (u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"],
                   u["output_tokens_details"]["reasoning_tokens"])
        else:
            got = (u["input_tokens"] + u["cache_read_input_tokens"], u["output_tokens"], u["cache_read_input_tokens"],
                   u["output_tokens_details"]["thinking_tokens"])
        assert got == (12, 20, 0, 0), u


def test_a_completion_count_above_the_bound_is_held_to_it(gw: GatewayServer) -> None:
    """An upstream reporting 5,000 completion tokens for a call allowed 50 (max_tokens): admission reserved 50,
    and a hard budget could be overspent 100-fold on one request. Metered at 50 — and the usage event says so
    (``over_bound``: the request was a 200, its code None; the cap had left only a log line), in ``GET /v1/usage``
    and every export format."""
    events = []
    for stream in (False, True):
        r = _ask(gw, {"prompt_tokens": 12, "completion_tokens": 5000, "total_tokens": 5012}, stream, max_tokens=50)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        ev = usage_events(gw, [rid])[rid]  # GET /v1/usage's raw row
        assert (ev.usage_source, ev.prompt_tokens, ev.completion_tokens) == ("upstream", 12, 50)
        assert (ev.status, ev.error_code, ev.over_bound) == (200, None, True)
        # ... and the client is told what was metered (the review found it told the upstream's 5,000)
        told = [orjson.loads(x[6:])["usage"] for x in r.text.split("\n\n")
                if x.startswith("data: {") and '"usage"' in x] if stream else [r.json()["usage"]]
        assert [u["completion_tokens"] for u in told] == [50], told
        events.append(ev)
    import pyarrow.parquet as pq

    rows, cols = export.build(events, [])
    formats: tuple[export.Format, ...] = ("csv", "jsonl", "parquet")
    out = {fmt: io.BytesIO() for fmt in formats}
    for fmt in formats:
        export.write(rows, cols, fmt, out[fmt])
    assert [r["over_bound"] for r in csv.DictReader(io.StringIO(out["csv"].getvalue().decode()))] == ["true"] * 2
    assert [orjson.loads(line)["over_bound"] for line in out["jsonl"].getvalue().splitlines()] == [True] * 2
    assert pq.read_table(io.BytesIO(out["parquet"].getvalue())).column("over_bound").to_pylist() == [True] * 2


def test_embeddings_without_usage_are_estimated_not_free(tmp_path: Path, upstream_sim: SimProcess,
                                                         redis_url: str) -> None:
    from tests.fixtures.upstream import sim_tiers

    tiers = [*sim_tiers(upstream_sim.base_url), {"name": "embed", "base_url": upstream_sim.base_url,
                                                 "model": "sim-model", "embeddings": True}]
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, tiers=tiers) as g:
        r = httpx.post(g.base_url + "/embeddings", timeout=30, headers={"authorization": f"Bearer {SECRETS['alice']}"},
                       json={"model": "embed", "input": "some words to embed here", "sim": {"usage": "omit"}})
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        ev = usage_events(g, [rid])[rid]
    assert ev.usage_source == "counted" and ev.prompt_tokens > 0


def test_a_counted_stream_is_held_to_the_bound_too(gw: GatewayServer) -> None:
    """An upstream that ignores max_tokens and sends no usage: the gateway counts the relayed deltas — held to the
    call's bound as a reported count is (a security review overspent a hard budget by 20% this way)."""
    r = _ask(gw, "omit", stream=True, max_tokens=4, sim={"usage": "omit", "ignore_max_tokens": True})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    deltas = sum(1 for x in r.text.split("\n\n") if x.startswith("data: {") and '"delta"' in x and
                 ('"content"' in x or '"reasoning"' in x))
    ev = usage_events(gw, [rid])[rid]
    assert deltas > 4 and (ev.usage_source, ev.completion_tokens) == ("counted", 4)
    assert ev.over_bound  # marked on the event, as a reported count held to the bound is


def test_an_escalated_non_streamed_attempt_without_usage_is_counted(upstream_sim: SimProcess, redis_url: str,
                                                                    tmp_path: Path) -> None:
    """The cascade's first attempt (cut in its thought, escalated) sent no usage: it was metered at $0 while the
    escalated call was counted (a review)."""
    from tests.fixtures.upstream import sim_tiers

    tiers = sim_tiers(upstream_sim.base_url)
    tiers[1].update({"thinking_budget": 100, "max_tokens": 4, "escalate_on": ["length_in_thought"]})
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, tiers=tiers) as g:
        r = httpx.post(g.base_url + "/chat/completions", timeout=30,
                       headers={"authorization": f"Bearer {SECRETS['alice']}"},
                       json={"model": "short", "messages": [{"role": "user", "content": QUESTION}],
                             "sim": {"usage": "omit"}})
        assert r.status_code == 200 and r.headers["x-thinkgate-route-reason"] == "escalated", r.text
        events = usage_events(g, count=2)
    first = [e for e in events.values() if (e.error_code or "").startswith("escalated_")]
    assert len(first) == 1 and first[0].usage_source == "counted" and first[0].completion_tokens == 4
    assert first[0].prompt_tokens > 0 and first[0].cost_micro_usd > 0


#: parts of a chat answer of the wrong type, which ``/v1/chat/completions`` passes on as they came
MALFORMED = [
    pytest.param({"content": 5}, id="content-number"),
    pytest.param({"reasoning": ["x"]}, id="reasoning-list"),
    pytest.param({"tool_calls": "abc"}, id="tool-calls-string"),
    pytest.param({"tool_calls": [7, {"index": 0, "id": "call_1", "function": "f"}]}, id="tool-call-parts"),
]


@pytest.mark.parametrize("path", ["/chat/completions", "/responses", "/messages"])
@pytest.mark.parametrize("part", MALFORMED)
def test_a_malformed_part_is_skipped_by_the_translated_apis(gw: GatewayServer, path: str, part: dict[str, Any]) -> None:
    """An answer part of the wrong type (a number for ``content``, a string for ``tool_calls``…) is relayed as it
    came on chat; ``/v1/messages`` and ``/v1/responses`` concatenated or read it and raised after the call was
    billed: a stream was cut before its end and metered as the client's disconnect (499, partial), a JSON answer
    was a 500 metered as a 200. The translators skip such a part: the rest of the answer is served, the request
    metered as the 200 it is. A reasoning text that is no string broke the relay itself, on chat too: it is none."""
    text = f"{QUESTION} {uuid.uuid4().hex[:6]}"
    body: dict[str, Any] = {"model": "none"}
    if path == "/responses":
        body |= {"input": text}
    else:
        body |= {"messages": [{"role": "user", "content": text}], "max_tokens": 64}
    streamed: dict[str, Any] = {"stream": True}
    if path == "/chat/completions":
        streamed["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {SECRETS['alice']}"}
    chunk = {"choices": [{"index": 0, "delta": part, "finish_reason": None}]}
    r = httpx.post(gw.base_url + path, json={**body, **streamed, "sim": {"inject": chunk}}, timeout=30,
                   headers=headers)
    assert r.status_code == 200, r.text
    end = {"/chat/completions": "data: [DONE]", "/responses": "event: response.completed",
           "/messages": "event: message_stop"}[path]
    assert end in r.text, r.text[-300:]
    if path != "/chat/completions":  # (chat relays the part as it came)
        docs = [orjson.loads(x[x.index("data: ") + 6:]) for x in r.text.split("\n\n") if "data: {" in x]
        said = "".join(d.get("delta") or "" for d in docs if d["type"] == "response.output_text.delta") + "".join(
            d["delta"].get("text", "") for d in docs if d["type"] == "content_block_delta")
        assert said == " ".join(answer_words(text))
    rid = r.headers["x-request-id"]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.status, ev.error_code, ev.partial, ev.usage_source) == (200, None, False, "upstream")
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "fine", **part},
                           "finish_reason": "stop"}]}
    if "content" in part:
        answer["choices"][0]["message"]["tool_calls"] = [{"id": "call_2", "type": "function", "function": 3}]
    r = httpx.post(gw.base_url + path, json={**body, "sim": {"inject": answer}}, timeout=30, headers=headers)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.status, ev.error_code, ev.partial) == (200, None, False)


@pytest.mark.parametrize("inject", [{"choices": "abc"}, {"choices": [1, 2]}, {"choices": [{"delta": "str"}]}])
def test_a_malformed_chunk_is_skipped_and_a_malformed_answer_is_a_502(gw: GatewayServer, inject: Any) -> None:
    """Chunks whose choices are no list of objects crashed the relay mid-stream (the client got a truncated 200 and
    the request was metered as its own disconnect); a non-streamed answer like that was a 500 — which the SDKs
    retry — not the upstream's 502."""
    r = _ask(gw, None, stream=True, sim={"inject": inject})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    rid = r.headers["x-request-id"]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.status, ev.error_code, ev.usage_source) == (200, None, "upstream")
    bad = {"choices": [{"index": 0, "message": "not an object", "finish_reason": "stop"}]} \
        if inject == {"choices": [{"delta": "str"}]} else inject
    r = _ask(gw, None, sim={"inject": bad})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.text
    assert r.headers.get("x-should-retry") == "false"


@pytest.mark.parametrize("index", ["x", [0]], ids=["string", "list"])
def test_a_reasoning_chunk_whose_index_is_no_integer_is_relayed_and_metered(gw: GatewayServer, index: Any) -> None:
    """A reasoning delta under a choice ``index`` that is no integer: relayed as it came (chat passes the upstream's
    chunks on) and the stream metered as the 200 it is. ``int(index)`` raised in the relay's tally mid-stream: a
    truncated 200, metered as the client's disconnect (499)."""
    chunk = {"choices": [{"index": index, "delta": {"reasoning_content": "hm"}, "finish_reason": None}]}
    r = _ask(gw, None, stream=True, sim={"inject": chunk})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    assert '"reasoning_content":"hm"' in r.text
    rid = r.headers["x-request-id"]
    ev = usage_events(gw, [rid])[rid]
    assert (ev.status, ev.error_code, ev.partial, ev.usage_source) == (200, None, False, "upstream")


CACHED_MALFORMED = [
    pytest.param({"index": "x", "delta": {"reasoning_content": "hm"}, "finish_reason": "stop"}, id="string-index"),
    pytest.param({"index": [0], "delta": {"reasoning_content": "hm"}, "finish_reason": None}, id="list-index"),
    pytest.param({"index": 0, "delta": {"content": 5}, "finish_reason": None}, id="content-no-string"),
    pytest.param({"index": 0, "delta": {"tool_calls": [{"index": "x", "function": {"arguments": 1}}]},
                  "finish_reason": None}, id="tool-call-index"),
]


@pytest.mark.parametrize("choice", CACHED_MALFORMED)
def test_a_malformed_choice_in_a_cacheable_stream_is_relayed_metered_and_not_cached(gw: GatewayServer,
                                                                                   choice: dict[str, Any]) -> None:
    """The same malformed choices on a request the exact cache stores (``temperature: 0``), whose stream the relay
    also assembles: the assembler keyed its choices by the ``index`` as it came — a list raised mid-stream (a
    truncated 200 metered as the client's disconnect), a string next to choice 0, or a content that is no string,
    raised as the relay closed the call (the client had ``[DONE]``; the call went unmetered). Relayed and metered as
    the 200 it is; such an answer is not cached (a second ask is no hit)."""
    body = {"model": "long", "messages": [{"role": "user", "content": f"{QUESTION} {uuid.uuid4().hex[:6]}"}],
            "sim": {"inject": {"choices": [choice]}}, "temperature": 0, "stream": True}
    hits = []
    for _ in range(2):
        r = httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30,
                       headers={"authorization": f"Bearer {SECRETS['alice']}"})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        rid = r.headers["x-request-id"]
        ev = usage_events(gw, [rid])[rid]
        assert (ev.status, ev.error_code, ev.partial) == (200, None, False), ev
        hits.append(r.headers.get("x-thinkgate-cache"))
    assert "hit" not in hits, hits


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_large_legitimate_batch_is_metered_as_reported(upstream_sim: SimProcess, redis_url: str, tmp_path: Path,
                                                         stream: bool) -> None:
    """``n: 128`` choices of up to 100k tokens each may generate 12.8M tokens: a report of 11M was taken for no count
    (every field was capped at 10M whatever the call) and the gateway counted the answer itself — 128 /tokenize
    calls, and a bill far below the upstream's."""
    from gateway.ledger.pricing import cost_micro_usd
    from tests.fixtures.upstream import sim_tiers

    tiers = sim_tiers(upstream_sim.base_url)
    tiers[2].update({"max_tokens": 100_000, "max_n": 128})
    reported = {"prompt_tokens": 12, "completion_tokens": 11_000_000, "total_tokens": 11_000_012,
                "completion_tokens_details": {"reasoning_tokens": 9_000_000}}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, tiers=tiers) as g:
        r = _ask(g, reported, stream, n=128, max_tokens=100_000)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        ev = usage_events(g, [rid])[rid]
        long = g.settings.tier("long").prices
    assert (ev.usage_source, ev.prompt_tokens, ev.completion_tokens, ev.reasoning_tokens) == (
        "upstream", 12, 11_000_000, 9_000_000)
    assert ev.cost_micro_usd == cost_micro_usd(long, prompt_tokens=12, cached_tokens=0,
                                               completion_tokens=11_000_000) == 6 + 22_000_000


def test_a_hostile_answer_is_counted_with_bounded_tokenize_calls(redis_url: str, tmp_path: Path) -> None:
    """An upstream answering ``n: 16`` with 200 choices and an absurd usage: the gateway counts the answer itself,
    and it called the upstream's /tokenize once per choice (twice with a thought), all at once — thousands of
    requests at an upstream's command. Now the choices asked for are tokenized, at most TOKENIZE_CONCURRENCY at a
    time (seen at the simulator's /tokenize), the rest estimated; the count is held to the call's bound."""
    from tests.fixtures.upstream import sim_tiers, start_sim

    sim = start_sim("--tokenize-delay-ms", "50")
    try:
        tiers = sim_tiers(sim.base_url)
        tiers[2].update({"max_n": 16})
        words = " ".join(["word"] * 20)
        choices = [{"index": i, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": words, "reasoning": words}} for i in range(200)]
        with accounting_gateway(sim.base_url, redis_url, tmp_path, tiers=tiers) as g:
            before = sim.stats()["tokenize"]
            r = _ask(g, {"prompt_tokens": 12, "completion_tokens": 1e12}, n=16, max_tokens=8,
                     sim={"usage": {"prompt_tokens": 12, "completion_tokens": 1e12}, "inject": {"choices": choices}})
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            ev = usage_events(g, [rid])[rid]
            bound = 16 * 8
        stats = sim.stats()
    finally:
        sim.stop()
    assert len(r.json()["choices"]) == 200  # the answer is the upstream's, passed on
    assert (ev.usage_source, ev.completion_tokens) == ("counted", bound)  # 200 × ~25 tokens, held to 16 × 8
    # the reasoning fill, the answer's texts and its thoughts (16 each) and the prompt: not 601 calls
    assert stats["tokenize"] - before <= 3 * 16 + 1
    assert 1 < stats["tokenize_max_inflight"] <= 8  # gateway.pipeline.relay.TOKENIZE_CONCURRENCY


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_large_legitimate_reasoning_count_is_not_recounted(redis_url: str, tmp_path: Path, stream: bool) -> None:
    """The reasoning count of an ``n: 128`` batch may pass 10M as its completion count may (5cf5346): one of 10.5M
    was checked against the fixed 10M (``needs_reasoning_count``), taken for no count, and replaced by the
    gateway's own count of the thoughts — 128 /tokenize calls and a reasoning figure a million times too small,
    while the completion count beside it was trusted."""
    from tests.fixtures.upstream import sim_tiers, start_sim

    sim = start_sim()
    try:
        tiers = sim_tiers(sim.base_url)
        tiers[2].update({"max_tokens": 100_000, "max_n": 128})
        reported = {"prompt_tokens": 12, "completion_tokens": 11_000_000, "total_tokens": 11_000_012,
                    "completion_tokens_details": {"reasoning_tokens": 10_500_000}}
        with accounting_gateway(sim.base_url, redis_url, tmp_path, tiers=tiers) as g:
            before = sim.stats()["tokenize"]
            r = _ask(g, reported, stream, n=128, max_tokens=100_000)
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            ev = usage_events(g, [rid])[rid]
        tokenized = sim.stats()["tokenize"] - before
    finally:
        sim.stop()
    if stream:
        chunks = [orjson.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        told = [c["usage"] for c in chunks if c.get("usage") and not c.get("choices")]
    else:
        told = [r.json()["usage"]]
    assert (ev.usage_source, ev.completion_tokens, ev.reasoning_tokens) == ("upstream", 11_000_000, 10_500_000)
    assert [u["completion_tokens_details"]["reasoning_tokens"] for u in told] == [10_500_000]
    assert tokenized == 0  # nothing was counted: the upstream's count was one
