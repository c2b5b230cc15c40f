"""A streaming client that hangs up while the gateway holds its stream back to decide an escalation (the peek: a tier
with ``escalate_on`` is read up to its answer's start — through the whole thought — or, checking the answer's
content, to its end, before the 200 is sent): through a real gateway on loopback, real Redis and the upstream
simulator.

Nothing has been sent to the client then, so nothing noticed it was gone: the upstream kept generating the thought
nobody would read (a reasoning model's long part; vLLM aborts a request only when its connection closes) until the
answer began and the relay's first write failed — with ``escalate_on: [abstain]``, until the whole answer was
generated — and an escalation could even be sent for it. The embedded ``short`` tier escalates on an empty answer,
so every streamed request on it was peeked so.

Now the client is watched during the peek, as for a non-streamed answer: the upstream call is closed when the client
goes, and the call is metered as such — status 499, partial, its prompt and the deltas read billed."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config
from tests.fixtures.redis_db import read_usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess, sim_tiers, wait_for

CHUNK_MS = 400  # the simulator's delay between chunks: the thought (16-31 words) takes 6-12 s
QUESTION = "Please think about this question for a while before you answer it in full"
GONE_AFTER_S = 1.2  # the client hangs up while the thought streams (2-3 chunks read)


@pytest.fixture(params=[["empty_answer"], ["abstain"]], ids=["to-answer-start", "whole-answer"])
def peeked(request: pytest.FixtureRequest, upstream_sim: SimProcess, redis_url: str, tmp_path: Path,
           redis_prefix: str) -> Iterator[GatewayServer]:
    """``short`` thinks without a budget and escalates to ``long`` (on an empty answer: peeked to the answer's start;
    on an abstention: peeked to its end); alice has a daily budget (her calls reserve)."""
    _, short, long = sim_tiers(upstream_sim.base_url)
    short.update({"thinking_budget": None, "max_tokens": 512, "escalate_on": request.param})
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix, tiers=[short, long],
                            auth=keys_config(alice={"budget_usd_day": "1"})) as g:
        yield g


def _hang_up_after(gw: GatewayServer, body: dict[str, Any], seconds: float) -> bytes:
    """POST ``body`` streamed on a raw socket, read for ``seconds`` (what came, if anything), then close it."""
    url = urlsplit(gw.base_url)
    payload = orjson.dumps(body)
    head = (f"POST {url.path}/chat/completions HTTP/1.1\r\nhost: {url.hostname}:{url.port}\r\n"
            f"authorization: Bearer {SECRETS['alice']}\r\ncontent-type: application/json\r\n"
            f"cache-control: no-store\r\ncontent-length: {len(payload)}\r\n\r\n").encode()
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=seconds)
    got = b""
    try:
        sock.sendall(head + payload)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            got += data
    finally:
        sock.close()
    return got


def test_a_client_gone_during_the_peek_closes_the_upstream_call_and_is_billed_what_ran(
        peeked: GatewayServer, upstream_sim: SimProcess, redis_url: str, redis_prefix: str) -> None:
    tag = uuid.uuid4().hex
    body = {"model": "short", "stream": True, "messages": [{"role": "user", "content": QUESTION}],
            "sim": {"tag": tag, "chunk_delay_ms": CHUNK_MS}}
    got = _hang_up_after(peeked, body, GONE_AFTER_S)
    assert got == b"", got  # the peek holds the 200 back: nothing reached the client
    gone = time.monotonic()

    # the upstream call is closed within a beat of the client, long before its thought would have ended (6-12 s)
    def closed() -> bool:
        sent = upstream_sim.tag(tag)
        return sent is not None and sent["status"] != "running"
    assert wait_for(closed, 10.0), upstream_sim.tag(tag)
    sent = upstream_sim.tag(tag)
    assert sent is not None
    assert time.monotonic() - gone < 2.5, f"the upstream ran {time.monotonic() - gone:.1f} s after the client left"
    assert (sent["status"], sent["attempts"]) == ("cancelled", 1), sent  # never escalated for a gone client
    assert sent["chunks_sent"] <= 8, sent

    [event] = read_usage_events(redis_url, redis_prefix, 1)
    assert (event["tier"], event["status"], event["error_code"], event["partial"]) == \
        ("short", 499, "client_disconnected", True), event
    assert event["usage_source"] == "counted", event
    assert event["prompt_tokens"] > 0, event  # the upstream had the prompt and began on it
    assert 0 < event["completion_tokens"] <= sent["chunks_sent"], event  # the deltas the peek read
    assert event["cost_micro_usd"] > 0, event
