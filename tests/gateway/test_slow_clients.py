"""Slow clients (slowloris) against ``thinkgate serve`` itself — the CLI's uvicorn with its protocol and options, on
loopback over the upstream simulator and the test Redis — from raw sockets: a connection that sends nothing, half
a request head, or half a body is answered 408 and closed within ``server.request_head_timeout_s`` /
``request_body_timeout_s``; an idle kept-alive one is closed after ``keep_alive_timeout_s``; a request that is
slow but inside the bounds is served."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from bench._lib.process import stop_process
from tests.fixtures.gateway import cleanup
from tests.fixtures.ports import Lease
from tests.fixtures.upstream import SimProcess, sim_tiers

REPO = Path(__file__).resolve().parents[2]
SECRET = "tg-slow-client-test-0000000000"
HEAD_S, BODY_S, IDLE_S = 1.0, 1.5, 1.0
SLACK_S = 3.0  # a busy 2-core box: timers fire late, never early


@pytest.fixture(scope="module")
def served(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The port of a ``thinkgate serve`` with short bounds."""
    yield from serve(upstream_sim, redis_url, tmp_path_factory.mktemp("slow"))


def serve(upstream_sim: SimProcess, redis_url: str, tmp: Path, **server: object) -> Iterator[int]:
    """Run ``thinkgate serve`` with the short bounds (and ``server`` settings); yield its port."""
    lease, prefix = Lease(), f"tgtest:{uuid.uuid4().hex[:12]}:"  # the port is the server's until it stops
    port = lease.port
    cfg = tmp / "thinkgate.yaml"
    cfg.write_text(yaml.safe_dump({
        "engine": {"enabled": False}, "routing": {"router_path": None},
        "redis": {"url": redis_url, "key_prefix": prefix, "start_if_missing": False},
        "tiers": [{**t, "prices": {k: str(v) for k, v in t["prices"].items()}}
                  for t in sim_tiers(upstream_sim.base_url)],
        "auth": {"keys": [{"id": "slow", "secret": SECRET}]},
        "server": {"host": "127.0.0.1", "port": port, "request_head_timeout_s": HEAD_S,
                   "request_body_timeout_s": BODY_S, "keep_alive_timeout_s": IDLE_S, **server},
    }))
    log = tmp / "serve.log"
    env = {**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_STATE_DIR": str(tmp / "state")}
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg)], cwd=REPO, env=env,
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield port
    finally:
        stop_process(proc, timeout_s=20)
        lease.release()
        cleanup(redis_url, prefix)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def until_closed(sock: socket.socket, start: float, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (s since ``start``); fails
    when the connection is still open ``limit_s`` after ``start``."""
    data = b""
    while True:
        left = start + limit_s - time.monotonic()
        if left <= 0:
            pytest.fail(f"the server kept the connection open for {limit_s} s (received {data!r})")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def one_response(sock: socket.socket) -> bytes:
    """One whole response (head and ``content-length`` body), however the segments fall."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def error_of(response: bytes) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), response
    assert b"connection: close" in head.lower(), response
    return dict(json.loads(body)["error"])


def test_a_silent_connection_is_closed(served: int) -> None:
    with connect(served) as s:
        t0 = time.monotonic()
        data, closed = until_closed(s, t0, HEAD_S + SLACK_S)
    assert closed >= HEAD_S * 0.9
    assert error_of(data)["code"] == "request_timeout"


def test_half_a_request_head_is_cut_at_the_head_bound(served: int) -> None:
    with connect(served) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
        for _ in range(3):  # still trickling: a per-read timeout would never fire
            time.sleep(0.3)
            s.sendall(b"X-Slow: 1\r\n")
        data, closed = until_closed(s, t0, HEAD_S + SLACK_S)
    assert closed >= HEAD_S * 0.9
    err = error_of(data)
    assert err["type"] == "invalid_request_error" and "request_head_timeout_s" in err["message"]


def test_half_a_body_gets_a_408_in_openai_shape(served: int) -> None:
    body = json.dumps({"model": "short", "messages": [{"role": "user", "content": "hi"}]}).encode()
    with connect(served) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + SECRET.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                  + body[:10])
        t0 = time.monotonic()
        data, closed = until_closed(s, t0, BODY_S + SLACK_S)
    assert closed >= BODY_S * 0.9
    err = error_of(data)
    assert err["code"] == "request_timeout" and "request_body_timeout_s" in err["message"]


def test_slow_but_in_time_is_served_and_idle_keep_alive_is_closed(served: int) -> None:
    with connect(served) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(HEAD_S / 3)
        s.sendall(b"Host: gw\r\n\r\n")
        first = one_response(s)
        assert first.startswith(b"HTTP/1.1 200") and b'"ok"' in first
        t0 = time.monotonic()  # the response is in: the connection is idle from here
        rest, closed = until_closed(s, t0, IDLE_S + SLACK_S)
    assert rest == b"" and closed >= IDLE_S * 0.9


def test_at_the_concurrency_cap_probes_are_served_and_the_rest_refused_in_openai_shape(
        upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    """``server.limit_concurrency: 3`` (connections, this one counted) with two slow requests in flight: uvicorn
    answered every other request — the
    probes too, so a liveness probe failed under load and the orchestrator restarted the busiest pod — with a
    plain-text 503. ``/health`` and ``/ready`` are served; a chat request gets 503 ``overloaded`` in OpenAI's shape
    with ``retry-after``; once the slow ones are done, requests are served again."""
    import threading

    gen = serve(upstream_sim, redis_url, tmp_path, limit_concurrency=3)
    port = next(gen)
    base = f"http://127.0.0.1:{port}"
    auth = {"authorization": f"Bearer {SECRET}"}
    slow = {"model": "short", "max_tokens": 8, "sim": {"delay_ms": 4000},
            "messages": [{"role": "user", "content": "take your time"}]}
    done: list[int] = []

    def post_slowly() -> None:
        done.append(httpx.post(base + "/v1/chat/completions", json=slow, headers=auth, timeout=30).status_code)

    try:
        threads = [threading.Thread(target=post_slowly) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # both in flight
        with httpx.Client(timeout=10) as client:
            assert client.get(base + "/health").status_code == 200
            assert client.get(base + "/ready").status_code == 200
        refused = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=10, json={
            "model": "short", "max_tokens": 8, "messages": [{"role": "user", "content": "one more"}]})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "overloaded"
        assert refused.json()["error"]["type"] == "server_error" and refused.headers["retry-after"] == "1"
        # the Messages API's clients get Anthropic's shape (its SDK reads error.type there), as on every other error
        anth = httpx.post(base + "/v1/messages", headers={"x-api-key": SECRET}, timeout=10, json={
            "model": "short", "max_tokens": 8, "messages": [{"role": "user", "content": "one more"}]})
        assert anth.status_code == 503 and anth.headers["retry-after"] == "1", anth.text
        assert anth.json() == {"type": "error", "error": {"type": "overloaded_error",
                                                          "message": refused.json()["error"]["message"]}}
        for t in threads:
            t.join(30)
        assert done == [200, 200]
        again = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=10, json={
            "model": "short", "max_tokens": 8, "messages": [{"role": "user", "content": "now?"}]})
        assert again.status_code == 200, again.text
    finally:
        gen.close()
