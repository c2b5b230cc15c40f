"""``routing.outcomes.request_ttl_s`` is bounded by the life of the seen-sets that deduplicate grades: a request's
grades go to its UTC day's seen-set (``Outcome.seen_day``), which lives 40 days; a request accepting feedback
longer than that could be graded a second time after the first grade's seen-set expired, and count twice. A config
over the bound is refused naming the field and the limit; at the bound, on a real gateway and Redis, the seen-set of
a graded request outlives its feedback index by at least a day."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from pydantic import ValidationError

from gateway.config import MAX_REQUEST_TTL_S, OUTCOMES_SEEN_TTL_S, OutcomesConfig
from tests.fixtures.gateway import SECRETS, accounting_gateway
from tests.fixtures.upstream import SimProcess, wait_for

REPO = Path(__file__).resolve().parents[2]


def test_a_request_ttl_longer_than_the_seen_sets_is_refused(tmp_path: Path, redis_url: str) -> None:
    assert MAX_REQUEST_TTL_S == OUTCOMES_SEEN_TTL_S - 86400 == 39 * 86400
    assert OutcomesConfig(request_ttl_s=MAX_REQUEST_TTL_S).request_ttl_s == MAX_REQUEST_TTL_S
    with pytest.raises(ValidationError, match=f"request_ttl_s must be at most {MAX_REQUEST_TTL_S} s"):
        OutcomesConfig(request_ttl_s=MAX_REQUEST_TTL_S + 1)
    # as an operator meets it: the CLI exits 2 naming the field and the limit
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"redis": {"url": redis_url, "start_if_missing": False},
                                   "routing": {"outcomes": {"request_ttl_s": 60 * 86400}}}))
    r = subprocess.run([sys.executable, "-m", "gateway", "config", "show", "--config", str(cfg)], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "routing.outcomes.request_ttl_s" in r.stderr and str(MAX_REQUEST_TTL_S) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_at_the_bound_the_seen_set_outlives_the_feedback_index(upstream_sim: SimProcess, redis_url: str,
                                                               redis_prefix: str, tmp_path: Path) -> None:
    auth = {"authorization": f"Bearer {SECRETS['alice']}"}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=redis_prefix,
                            routing={"router_path": None, "outcomes": {"request_ttl_s": MAX_REQUEST_TTL_S}}) as gw, \
            httpx.Client(timeout=30) as client:
        r = client.post(gw.base_url + "/chat/completions", headers=auth, json={
            "model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": "name a city"}]})
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        rdb = redis.Redis.from_url(redis_url)
        try:
            assert wait_for(lambda: rdb.exists(redis_prefix + "req:" + rid) == 1, timeout_s=5)
            fb = client.post(gw.base_url + "/feedback", headers=auth, json={"request_id": rid, "correct": True})
            assert fb.status_code == 200 and fb.json()["stored"] == "redis", fb.text
            day = time.strftime("%Y-%m-%d", time.gmtime())
            index_ttl = rdb.ttl(redis_prefix + "req:" + rid)  # how much longer this request may be graded
            seen_ttl = rdb.ttl(redis_prefix + f"outcomes:seen:{day}")  # how much longer its first grade is known
            grades_ttl = rdb.ttl(redis_prefix + f"outcomes:grades:{day}")
            assert MAX_REQUEST_TTL_S - 60 <= index_ttl <= MAX_REQUEST_TTL_S
            assert min(seen_ttl, grades_ttl) >= index_ttl + 86400 - 60, (index_ttl, seen_ttl, grades_ttl)
            again = client.post(gw.base_url + "/feedback", headers=auth, json={"request_id": rid, "correct": False})
            assert again.json()["stored"] == "duplicate" and again.json()["sufficed"] is True
        finally:
            rdb.close()
