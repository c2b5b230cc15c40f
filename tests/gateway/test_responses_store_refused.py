"""``/v1/responses`` against a Redis that refuses the conversation write (an error reply, not an outage): the
client gets the whole answer it was billed for — a 200, a stream ending in ``response.completed`` — the refusal
is counted in ``thinkgate_conversations_not_stored_total{reason="refused"}``, and ``previous_response_id`` naming
it is refused as an unknown or expired one. Before, the write's ``NoPermissionError`` (likewise ``OOM command not
allowed``, ``READONLY``: the breaker counts none of them as an outage) raised through: a 500 for an answer metered
200, or a stream cut before its end.

The refusal is real: a private ``redis-server`` whose ACL user for the gateway may run every command on every key
of the gateway's prefix except write the conversation keys (``<prefix>resp:…``, read-only), so admission, metering
and the key store work as usual."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from gateway.config import RedisConfig
from gateway.engine.redis_server import start_private
from gateway.errors import ConversationsUnavailable
from gateway.state.breaker import Breaker
from gateway.state.conversations import ConversationStore
from gateway.state.redis import connect
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway
from tests.fixtures.metered import events_of
from tests.fixtures.upstream import GatewayServer, SimProcess
from tests.fixtures.upstream_sim import answer_words

PREFIX = f"tgtest:{uuid.uuid4().hex[:12]}:"
CONVERSATIONS = "resp:"  # RedisKeys.conversation: <prefix>resp:<scope>:<id> (one server: no tenant hash tag)
USER = "what is seven times six"


def key_patterns(prefix: str) -> list[str]:
    """ACL key rules: every key of ``prefix`` read-write except those that start with ``prefix + "resp:"``,
    which are read-only. ACL rules only add, so the exception is carved with glob classes: ``p[^r]*``,
    ``pr[^e]*``, … — a name differing from ``resp:`` at its first differing character."""
    rules = [f"~{prefix}{CONVERSATIONS[:i]}[^{CONVERSATIONS[i]}]*" for i in range(len(CONVERSATIONS))]
    return [*rules, f"%R~{prefix}{CONVERSATIONS}*"]


@pytest.fixture(scope="module")
def refusing_redis() -> Iterator[tuple[str, str]]:
    """(the admin's URL, the gateway user's URL) of a private redis-server whose user ``gw`` is refused
    (``NOPERM``) every write of a conversation key under :data:`PREFIX`."""
    proc, url = start_private()
    try:
        admin = redis.Redis.from_url(url)
        admin.execute_command("ACL", "SETUSER", "gw", "on", ">gw-secret", "+@all", "&*", *key_patterns(PREFIX))
        gw_url = url.replace("redis://", "redis://gw:gw-secret@", 1)
        client = redis.Redis.from_url(gw_url)
        client.set(PREFIX + "probe", "1")  # the ACL lets the gateway write its other keys…
        with pytest.raises(redis.exceptions.NoPermissionError):  # …and refuses a conversation's
            client.set(f"{PREFIX}{CONVERSATIONS}key:x:resp_probe", "1")
        client.close()
        admin.close()
        yield url, gw_url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, refusing_redis: tuple[str, str],
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    _, gw_url = refusing_redis
    with accounting_gateway(upstream_sim.base_url, gw_url, tmp_path_factory.mktemp("refusedgw"), PREFIX) as g:
        yield g


def tag() -> dict[str, dict[str, str]]:
    return {"sim": {"tag": uuid.uuid4().hex}}  # a request of its own: never a cache hit


def sdk(gw: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0, timeout=30)


def refused_count(gw: GatewayServer) -> float | None:
    """``thinkgate_conversations_not_stored_total{reason="refused"}``, None when not exposed."""
    text = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10).text
    found = re.search(r'^thinkgate_conversations_not_stored_total\{reason="refused"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


def assert_billed_whole(gw: GatewayServer, request_id: str, output_tokens: int) -> None:
    rows = events_of(gw, request_id)
    assert len(rows) == 1, rows
    ev = rows[0]
    assert (ev["endpoint"], ev["status"], ev["partial"], ev["error_code"]) == ("responses", 200, False, None), ev
    assert ev["completion_tokens"] == output_tokens


def assert_not_continuable(gw: GatewayServer, admin_url: str, response_id: str) -> None:
    """Not stored, and answered as an expired one: continuing it is a 400 ``previous_response_not_found``
    (OpenAI's code for an unknown previous response), retrieving it a 404."""
    admin = redis.Redis.from_url(admin_url)
    try:
        assert not admin.keys(f"{PREFIX}{CONVERSATIONS}*{response_id}")
    finally:
        admin.close()
    with pytest.raises(openai.BadRequestError) as cont:
        sdk(gw).responses.create(model="short", input="and then?", previous_response_id=response_id)
    assert cont.value.status_code == 400 and cont.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError) as got:
        sdk(gw).responses.retrieve(response_id)
    assert got.value.status_code == 404


def test_a_refused_conversation_write_still_delivers_the_answer(gw: GatewayServer,
                                                                refusing_redis: tuple[str, str]) -> None:
    admin_url, _ = refusing_redis
    before = refused_count(gw) or 0.0
    raw = sdk(gw).responses.with_raw_response.create(model="long", input=USER, extra_body=tag())
    assert raw.status_code == 200
    r = raw.parse()
    assert r.status == "completed" and r.output_text == " ".join(answer_words(USER))
    assert r.usage is not None
    assert_billed_whole(gw, raw.headers["x-request-id"], r.usage.output_tokens)
    assert refused_count(gw) == before + 1
    assert_not_continuable(gw, admin_url, r.id)


def test_a_refused_conversation_write_still_ends_the_stream(gw: GatewayServer,
                                                            refusing_redis: tuple[str, str]) -> None:
    admin_url, _ = refusing_redis
    before = refused_count(gw) or 0.0
    with sdk(gw).responses.with_streaming_response.create(model="long", input=USER, stream=True,
                                                          extra_body=tag()) as raw:
        request_id = raw.headers["x-request-id"]
        events = list(raw.parse())
    assert events[-1].type == "response.completed", [e.type for e in events]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == " ".join(answer_words(USER))
    assert_billed_whole(gw, request_id, final.usage.output_tokens)
    assert refused_count(gw) == before + 1
    assert_not_continuable(gw, admin_url, final.id)



def test_refusals_are_counted_and_logged_once_a_minute(refusing_redis: tuple[str, str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """``ConversationStore.put`` on a refused write: False, counted each time, one ERROR line per distinct error a
    minute (a full or read-only Redis refuses every answer's write), the breaker left closed (Redis answered)."""
    _, gw_url = refusing_redis

    async def go() -> tuple[list[bool], dict[str, int], bool]:
        handle = connect(RedisConfig(url=gw_url, key_prefix=PREFIX, socket_timeout_s=2.0))
        breaker = Breaker(1.0)
        store = ConversationStore(handle, breaker, 60)
        try:
            stored = [await store.put("key:alice", f"resp_{i}", [{"role": "user", "content": "hi"}], "short")
                      for i in range(3)]
            return stored, store.not_stored, breaker.closed
        finally:
            await handle.close()

    with caplog.at_level(logging.ERROR, logger="thinkgate.conversations"):
        stored, counts, closed = asyncio.run(go())
    assert stored == [False, False, False] and counts == {"redis_down": 0, "refused": 3} and closed
    lines = [r for r in caplog.records if r.name == "thinkgate.conversations"]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, lines
    assert "resp_0" in lines[0].getMessage() and "NoPermissionError" in lines[0].getMessage()


def test_writes_skipped_with_redis_down_are_counted_and_logged_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    """Redis unreachable: every ``put`` is skipped (False, counted as ``redis_down``) — one WARNING line a minute,
    not one per answer (an outage would otherwise log every answer's skipped write)."""
    proc, url = start_private()
    proc.terminate()  # nothing listens there any more: a real outage, not a stand-in
    proc.wait(timeout=10)

    async def go() -> tuple[list[bool], dict[str, int], list[ConversationsUnavailable]]:
        handle = connect(RedisConfig(url=url, key_prefix=PREFIX, socket_timeout_s=0.5))
        store = ConversationStore(handle, Breaker(2.5), 60)
        try:
            stored = [await store.put("key:alice", f"resp_{i}", [{"role": "user", "content": "hi"}], "short")
                      for i in range(4)]
            refused = []
            for read in (store.get, store.delete):  # a continuation or a delete cannot be answered: a 503
                with pytest.raises(ConversationsUnavailable) as info:
                    await read("key:alice", "resp_0")
                refused.append(info.value)
            return stored, store.not_stored, refused
        finally:
            await handle.close()

    with caplog.at_level(logging.WARNING, logger="thinkgate.conversations"):
        stored, counts, refused = asyncio.run(go())
    assert stored == [False] * 4 and counts == {"redis_down": 4, "refused": 0}
    # when to retry: the breaker's cooldown, rounded up (a client retrying sooner meets the open breaker again)
    assert [(e.status, e.headers.get("retry-after")) for e in refused] == [(503, "3"), (503, "3")]
    lines = [r for r in caplog.records if r.name == "thinkgate.conversations"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, lines
    assert "resp_0" in lines[0].getMessage() and "redis_down" in lines[0].getMessage()
