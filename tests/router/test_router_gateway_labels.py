"""Label source 3: outcomes measured through a real OpenAI-compatible HTTP server on loopback.

The server below is deterministic: tier ``long`` always answers correctly; tier ``short`` answers
correctly only problems with at most two operations. Questions are real generated arithmetic problems
(:mod:`router.tasks`) checked with the project's verifier.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gateway.cli.main import app
from router.fit.jsonl import write_jsonl
from router.fit.labels import load_items
from router.fit.outcomes import label_via_gateway
from router.probe import ProbeClient, api_base
from router.tasks.rows import task_rows
from router.tasks.verifiers import get_verifier

API_KEY = "tg-label-test-key"


class FakeTiers:
    """State shared with the handler: answers by question, call log, and questions forced to fail (500)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.by_question = {r["question"]: r for r in rows}
        self.calls: list[tuple[str, str]] = []
        self.fail: set[str] = set()
        self.lock = threading.Lock()


def _handler(state: FakeTiers) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            if self.path != "/v1/chat/completions" or self.headers.get("authorization") != f"Bearer {API_KEY}":
                self.send_response(401 if self.path == "/v1/chat/completions" else 404)
                self.end_headers()
                return
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            question = body["messages"][-1]["content"]
            row = state.by_question[question]
            with state.lock:
                state.calls.append((body["model"], row["id"]))
            if row["id"] in state.fail:
                self.send_response(500)
                self.end_headers()
                return
            right = body["model"] == "long" or row["difficulty"] <= 2
            answer = int(row["answer"]) + (0 if right else 1)
            thought_tokens = 10 if body["model"] == "short" else 20 * row["difficulty"]
            payload = {
                "id": "x", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "reasoning_content": "steps…",
                                         "content": f"The answer is {answer}."}}],
                "usage": {"prompt_tokens": 30, "completion_tokens": thought_tokens + 6, "total_tokens": 0,
                          "completion_tokens_details": {"reasoning_tokens": thought_tokens}},
            }
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return H


@pytest.fixture
def rows() -> list[dict[str, Any]]:
    return task_rows("arith", "test", 3, seed=0, levels=[1, 2, 4, 6])  # 12 real problems


@pytest.fixture
def server(rows: list[dict[str, Any]]) -> Iterator[tuple[str, FakeTiers]]:
    state = FakeTiers(rows)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))  # port 0: a free port
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_labels_tokens_and_resume(server: tuple[str, FakeTiers], rows: list[dict[str, Any]], tmp_path: Path) -> None:
    url, state = server
    inp, out = tmp_path / "questions.jsonl", tmp_path / "labels.jsonl"
    write_jsonl(inp, rows)
    hard_id = next(r["id"] for r in rows if r["difficulty"] == 6)
    state.fail = {hard_id}
    client = ProbeClient(url, API_KEY, max_retries=1)
    try:
        stats = label_via_gateway(inp, out, ["short", "long"], get_verifier("task"), client=client, concurrency=3,
                                  progress=False)
        assert (stats.total, stats.written, stats.failed) == (12, 11, 1) and hard_id in stats.errors[0]
        items = {it.id: it for it in load_items([out])}
        assert hard_id not in items and len(items) == 11
        for r in rows:
            if r["id"] == hard_id:
                continue
            it = items[r["id"]]
            easy = r["difficulty"] <= 2
            assert (it.short_correct, it.long_correct, it.label) == (easy, True, int(not easy))
            tiers = it.meta["tiers"]
            assert tiers["long"]["reasoning_tokens"] == 20 * r["difficulty"]
            assert tiers["short"]["completion_tokens"] == 16 and tiers["short"]["latency_ms"] >= 0
            assert it.text == r["question"] and it.source == "gateway" and it.meta["difficulty"] == r["difficulty"]
        # resume: only the failed item is asked again (both tiers), nothing is duplicated
        state.fail = set()
        before = len(state.calls)
        stats = label_via_gateway(inp, out, ["short", "long"], get_verifier("task"), client=client,
                                  progress=False)
        assert (stats.skipped_existing, stats.written, stats.failed) == (11, 1, 0)
        assert sorted(state.calls[before:]) == [("long", hard_id), ("short", hard_id)]
        assert len(load_items([out])) == 12  # load_items would raise on a duplicate id
    finally:
        client.close()


def test_label_gateway_cli_uses_env_and_reports_failures(server: tuple[str, FakeTiers],
                                                         rows: list[dict[str, Any]], tmp_path: Path) -> None:
    url, _ = server
    inp, out = tmp_path / "q.jsonl", tmp_path / "l.jsonl"
    write_jsonl(inp, rows[:4])
    env = {"THINKGATE_URL": url + "/v1", "THINKGATE_API_KEY": API_KEY}
    r = CliRunner().invoke(app, ["router", "label", "gateway", str(inp), str(out), "--verifier", "int"], env=env)
    assert r.exit_code == 0, r.output
    assert "4 written" in r.output and len(load_items([out])) == 4
    r = CliRunner().invoke(app, ["router", "label", "gateway", str(inp), str(out)],
                           env={**env, "THINKGATE_API_KEY": "wrong"})
    assert r.exit_code == 0 and "0 written, 4 already done" in r.output  # resumed: nothing left to do
    write_jsonl(inp, rows[4:6])
    r = CliRunner().invoke(app, ["router", "label", "gateway", str(inp), str(out)],
                           env={**env, "THINKGATE_API_KEY": "wrong"})
    assert r.exit_code == 1 and "2 failed" in r.output  # 401: not retried, not written


def test_chat_url_and_verifiers() -> None:
    assert api_base("http://h:1") == api_base("http://h:1/v1/") == "http://h:1/v1"
    row = {"question": "q", "answer": "\\frac{1}{2}"}
    assert get_verifier("math")(row, "<think>…</think>The answer is $\\boxed{0.5}$")
    assert not get_verifier("math")(row, "The answer is 2.")
    assert get_verifier("int")({"answer": "1200"}, "so the answer is 1,200.")
    assert get_verifier("exact")({"answer": "Paris"}, "The answer is  paris.")
    assert get_verifier("router.tasks.verifiers:verify_int") is get_verifier("int")
    with pytest.raises(ValueError):
        get_verifier("nope")
