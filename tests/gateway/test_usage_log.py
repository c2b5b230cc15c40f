"""The usage log line (``thinkgate.usage`` at INFO, one per request) never carries the prompt: the routing window
the router scored is the user's text, kept only by the outcome store under ``routing.outcomes.retain_text``."""

from __future__ import annotations

import logging
import uuid

import httpx
import orjson
import pytest

from tests.fixtures.upstream import TEST_KEY, GatewayServer, wait_for


def test_usage_log_line_has_no_prompt_text(gateway: GatewayServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="thinkgate.usage")  # the gateway runs in this process
    secret = f"my private question {uuid.uuid4().hex}"
    r = httpx.post(gateway.base_url + "/chat/completions", timeout=30, headers={"authorization": f"Bearer {TEST_KEY}"},
                   json={"model": "auto", "messages": [{"role": "user", "content": secret}]})
    assert r.status_code == 200
    request_id = r.headers["x-request-id"]

    def line() -> dict[str, object] | None:
        for rec in caplog.records:
            if rec.name == "thinkgate.usage" and request_id in rec.getMessage():
                return dict(orjson.loads(rec.getMessage()))
        return None

    assert wait_for(lambda: line() is not None, 10)
    logged = line()
    assert logged is not None and logged["route_reason"] in ("predicted", "length") and logged["prompt_tokens"]
    assert all(secret not in rec.getMessage() for rec in caplog.records)
    assert "routing_window" not in logged
