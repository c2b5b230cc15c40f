"""One Redis round trip on the request path of a single Redis, counted on a real Redis with ``MONITOR``.

A real gateway (uvicorn on loopback, over the upstream simulator) with a budgeted, rate-limited key, the exact cache
on and write-ahead metering on. Every command the gateway sends with its key prefix is recorded by a ``MONITOR``
connection while it serves fresh prompts (cache misses) and then the same prompts again (hits). Each request makes
exactly one admission-path script call — ``HOT_LUA``: admission at every level + the write-ahead record + the
cache lookup — and nothing else before its upstream call: no separate ``ADMIT``, cache ``BEGIN`` or ``HSET`` of
the write-ahead hash. After the answer, a miss stores it (``FINISH``, one call) and metering writes the usage
event off the request path (``RECORD``, pipelined), as does the request index (``SET``, pipelined). With the three
calls of before (admission, cache lookup, write-ahead record) this test fails.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.state.cache import BEGIN_LUA, FINISH_LUA
from gateway.state.limits import ADMIT_LUA, HOT_LUA
from gateway.state.metering import RECORD_LUA
from gateway.state.write_ahead import PUT_LUA
from tests.fixtures.gateway import SECRETS, accounting_gateway, keys_config, usage_events
from tests.fixtures.upstream import SimProcess, wait_for

N = 6  # requests per phase (misses, then hits)
MONITOR_READ_S = 0.2


def sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


class Monitor:
    """A ``MONITOR`` connection in a thread: every command whose text mentions ``prefix``, as a list of words."""

    def __init__(self, redis_url: str, prefix: str, ignore: str = "") -> None:
        self.client = redis.Redis.from_url(redis_url, socket_timeout=MONITOR_READ_S)
        self.prefix = prefix
        self.ignore = ignore  # a client's address (``host:port``) whose commands are not recorded
        self.commands: list[list[str]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Monitor:
        self._thread.start()
        assert self._ready.wait(5), "MONITOR did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()

    def _run(self) -> None:
        with self.client.monitor() as m:
            self._ready.set()
            while not self._stop.is_set():
                try:
                    cmd = m.next_command()
                except (redis.TimeoutError, TimeoutError):
                    continue
                except redis.ConnectionError:
                    return
                text = str(cmd.get("command", ""))
                if cmd.get("client_type") == "lua" or cmd.get("client_address") == "lua":
                    continue  # a command a script ran (counted as that script's call)
                if self.prefix in text and f"{cmd.get('client_address')}:{cmd.get('client_port')}" != self.ignore:
                    self.commands.append(text.split())


def kind(words: list[str], prefix: str) -> str:
    """A command's name: the script's (by SHA) for EVALSHA, else the command and its first key's role."""
    names = {sha(HOT_LUA): "HOT", sha(ADMIT_LUA): "ADMIT", sha(BEGIN_LUA): "BEGIN", sha(FINISH_LUA): "FINISH",
             sha(RECORD_LUA): "RECORD", sha(PUT_LUA): "PUT"}
    op = words[0].upper()
    if op == "EVALSHA":
        return names.get(words[1], f"EVALSHA:{words[1][:8]}")
    key = words[1].removeprefix(prefix) if len(words) > 1 else ""
    return f"{op} {key.split(':')[0]}"


def ask(gw_url: str, content: str) -> httpx.Response:
    return httpx.post(gw_url + "/chat/completions", timeout=30, headers={"authorization": f"Bearer {SECRETS['alice']}"},
                      json={"model": "short", "temperature": 0, "max_tokens": 16,
                            "messages": [{"role": "user", "content": content}]})


@pytest.fixture
def gateway(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> Iterator[Any]:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=prefix,
                            auth=keys_config(alice={"budget_usd_day": "1000", "rpm": 100_000, "tpm": 10_000_000}),
                            cache={"mode": "deterministic"},
                            limits={"budget_refresh_s": 3600, "tag_budgets": {"team=a": {"usd_day": "1000"}}},
                            metering={"spool_path": str(tmp_path / "spool.jsonl"), "write_ahead": True,
                                      "heartbeat_ttl_s": 600, "reconcile_interval_s": 600}) as gw:
        yield gw, prefix


def test_one_script_call_per_request_on_a_single_redis(gateway: Any, redis_url: str) -> None:
    gw, prefix = gateway
    warm = ask(gw.base_url, f"warm-up {uuid.uuid4().hex}")  # connections opened, scripts loaded
    assert warm.status_code == 200
    usage_events(gw, [warm.headers["x-request-id"]])
    prompts = [f"hot path {uuid.uuid4().hex} {i}" for i in range(N)]
    poll = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        with Monitor(redis_url, prefix, ignore=str(poll.client_info()["addr"])) as mon:
            misses = [ask(gw.base_url, p) for p in prompts]
            hits = [ask(gw.base_url, p) for p in prompts]
            # metered off the request path, but within the window
            assert wait_for(lambda: poll.xlen(prefix + "usage:events") >= 1 + 2 * N, 10)
            # MONITOR's copy of the last commands may still be on its way: read until it has them all (then
            # the counts below are exact, not a race with the monitor thread)
            wait_for(lambda: sum(kind(c, prefix) == "RECORD" for c in list(mon.commands)) >= 2 * N, 5)
    finally:
        poll.close()
    ids = [r.headers["x-request-id"] for r in misses + hits]
    events = usage_events(gw, ids)
    assert [r.status_code for r in misses + hits] == [200] * 2 * N
    assert [r.headers["x-thinkgate-cache"] for r in misses] == ["miss"] * N
    assert [r.headers["x-thinkgate-cache"] for r in hits] == ["hit"] * N
    assert set(ids) <= set(events), "a request was not metered"
    # the warm-up's request index is flushed in the background (every second) and may land inside the window
    warm_id = warm.headers["x-request-id"]
    counts = Counter(kind(c, prefix) for c in mon.commands if not any(warm_id in w for w in c))
    # the request path: one script call per request, misses and hits alike
    assert counts["HOT"] == 2 * N, counts
    assert counts["ADMIT"] == 0 and counts["BEGIN"] == 0, counts
    assert counts["HSET wal"] == 0, counts  # the write-ahead record rode in the admission call
    # after the answer: a miss stores it (one call); every request's usage event is written by metering
    assert counts["FINISH"] == N, counts
    assert counts["RECORD"] == 2 * N, counts
    # the request index for feedback (gateway/control/outcomes.py): one SET per answered request, pipelined in
    # the background every second
    assert counts["SET req"] <= 2 * N, counts
    # a usage event whose metering batch waits behind one out past WAL_FINAL_AFTER_S (50 ms: a loaded box, MONITOR
    # itself) goes into its write-ahead record first (gateway/pipeline/accounting.py, sink): a background write, after
    # the answer, at most one per request
    assert counts["PUT"] <= 2 * N, counts
    others = {k: v for k, v in counts.items() if k not in ("HOT", "FINISH", "RECORD", "SET req", "PUT")}
    assert not others, f"unexpected commands on the request path: {others}"
    # the write-ahead records were written (and settled by the usage events: none is left open)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.hlen(prefix + "wal:open") == 0
    finally:
        client.close()


def test_a_refused_request_writes_no_write_ahead_record_and_looks_nothing_up(upstream_sim: SimProcess,
                                                                             redis_url: str, tmp_path: Path) -> None:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=prefix,
                            auth=keys_config(alice={"rpm": 1}), cache={"mode": "deterministic"},
                            metering={"spool_path": str(tmp_path / "spool.jsonl"), "write_ahead": True}) as gw:
        assert ask(gw.base_url, f"first {uuid.uuid4().hex}").status_code == 200
        with Monitor(redis_url, prefix) as mon:
            refused = ask(gw.base_url, f"second {uuid.uuid4().hex}")
        assert refused.status_code == 429
        counts = Counter(kind(c, prefix) for c in mon.commands)
        assert counts["HOT"] == 1, counts
        client = redis.Redis.from_url(redis_url)
        try:
            assert not client.hexists(prefix + "wal:open", refused.headers["x-request-id"])
            assert not client.keys(prefix + "cache:lock:*")
        finally:
            client.close()
