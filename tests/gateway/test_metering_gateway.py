"""Metering through a real gateway: stream == non-stream cost, disconnects metered, exports == counters ==
events (CLI and API), keys from the CLI, /v1/usage visibility and /metrics."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pyarrow.parquet as pq
import pytest
import yaml

from gateway.ledger.event import COUNTER_FIELDS, cost_micro_usd, counter_increments
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway, keys_config, usage_events
from tests.fixtures.upstream import GatewayServer, SimProcess

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gw_prefix() -> str:
    return f"tgtest:{uuid.uuid4().hex[:12]}:"


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory,
       gw_prefix: str) -> Iterator[GatewayServer]:
    from tests.fixtures.gateway import cleanup

    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("metergw"), gw_prefix,
                                auth={**keys_config(), "key_cache_s": 0}) as g:
            yield g
    finally:
        cleanup(redis_url, gw_prefix)


def sdk(gw: GatewayServer, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=secret, max_retries=0, timeout=30)


def test_stream_and_non_stream_meter_the_same_cost(gw: GatewayServer) -> None:
    c = sdk(gw, SECRETS["alice"])
    ids = []
    for model in ("short", "long"):
        kw: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "explain stream metering"}],
                              "extra_headers": {"cache-control": "no-store"}}
        plain = c.chat.completions.with_raw_response.create(**kw)
        streamed = c.chat.completions.with_raw_response.create(**kw, stream=True)  # no usage asked for
        assert not any(ch.usage for ch in streamed.parse())
        ids.append((plain.headers["x-request-id"], streamed.headers["x-request-id"]))
    events = usage_events(gw, [i for pair in ids for i in pair])
    for plain_id, stream_id in ids:
        p, s = events[plain_id], events[stream_id]
        assert (p.stream, s.stream) == (False, True)
        assert p.cost_micro_usd == s.cost_micro_usd > 0
        assert (p.prompt_tokens, p.completion_tokens, p.reasoning_tokens) == \
            (s.prompt_tokens, s.completion_tokens, s.reasoning_tokens)
        assert p.usage_source == s.usage_source == "upstream"
        tier = gw.settings.tier(p.tier or "")
        assert p.cost_micro_usd == cost_micro_usd(tier.prices, prompt_tokens=p.prompt_tokens,
                                                  cached_tokens=p.cached_tokens, completion_tokens=p.completion_tokens)


def test_client_disconnect_mid_stream_is_metered(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    body = {"model": "long", "messages": [{"role": "user", "content": "a long careful answer please " + tag}],
            "stream": True, "sim": {"tag": tag, "chunk_delay_ms": 40}}
    headers = {"authorization": f"Bearer {SECRETS['alice']}"}
    got = b""
    with httpx.Client(timeout=30) as http, http.stream("POST", gw.base_url + "/chat/completions", json=body,
                                                       headers=headers) as r:
        request_id = r.headers["x-request-id"]
        for part in r.iter_raw():
            got += part
            if got.count(b"data: ") >= 6:
                break  # walk away mid-stream
    rec = upstream_sim.wait_tag_status(tag, {"cancelled", "completed"})
    assert rec is not None and rec["status"] == "cancelled"  # the gateway cancelled the upstream call
    ev = usage_events(gw, [request_id])[request_id]
    assert ev.status == 499 and ev.partial and ev.error_code == "client_disconnected"
    assert ev.usage_source == "counted"
    assert 5 <= ev.completion_tokens <= rec["chunks_sent"]  # what was relayed, counted one token per delta
    # the prompt is billed too (the upstream read it before its first chunk): the upstream's /tokenize of the
    # messages, the count a complete answer to the same messages reports
    whole = httpx.post(gw.base_url + "/chat/completions", headers=headers, timeout=30,
                       json={**body, "stream": False, "sim": {"tag": tag + "-whole"}})
    assert whole.status_code == 200
    assert ev.prompt_tokens == whole.json()["usage"]["prompt_tokens"] > 0
    tier = gw.settings.tier("long")
    assert ev.cost_micro_usd == cost_micro_usd(tier.prices, prompt_tokens=ev.prompt_tokens, cached_tokens=0,
                                               completion_tokens=ev.completion_tokens) > 0


def _cli(*args: str, config: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "gateway", *args, "--config", str(config)], cwd=REPO,
                          capture_output=True, timeout=60, env={**os.environ, "THINKGATE_CONFIG": ""})


@pytest.fixture(scope="module")
def cli_config(gw: GatewayServer, gw_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "thinkgate.yaml"
    path.write_text(yaml.safe_dump({"engine": {"enabled": False},
                                    "redis": {"url": gw.settings.redis.url, "key_prefix": gw_prefix,
                                              "start_if_missing": False},
                                    "routing": {"router_path": None}}))
    return path


def test_cli_keys_create_use_list_revoke(gw: GatewayServer, cli_config: Path) -> None:
    kid = "cli-" + uuid.uuid4().hex[:8]
    r = _cli("keys", "create", "--id", kid, "--tag", "project=atlas", "--tag", "team=ml", "--budget-usd-day", "2.5",
             "--rpm", "100", config=cli_config)
    assert r.returncode == 0, r.stderr
    secret = r.stdout.decode().strip()
    assert r.stdout.decode() == secret + "\n" and secret.startswith("tg-")  # alone on stdout
    resp = sdk(gw, secret).chat.completions.with_raw_response.create(
        model="short", messages=[{"role": "user", "content": "hi from the cli key"}])
    ev = usage_events(gw, [resp.headers["x-request-id"]])[resp.headers["x-request-id"]]
    assert ev.key_id == kid and ev.tags == {"project": "atlas", "team": "ml"}
    again = _cli("keys", "create", "--id", kid, config=cli_config)
    assert again.returncode == 1 and again.stdout == b""
    listed = _cli("keys", "list", "--json", config=cli_config)
    rows = [json.loads(line) for line in listed.stdout.decode().splitlines()]
    mine = next(x for x in rows if x["id"] == kid)
    assert mine["budget_usd_day"] == "2.5" and mine["rpm"] == 100 and "secret_sha256" not in mine
    assert secret not in listed.stdout.decode()
    assert _cli("keys", "revoke", kid, config=cli_config).returncode == 0
    with pytest.raises(openai.AuthenticationError):
        sdk(gw, secret).models.list()
    assert _cli("keys", "revoke", "no-such-key", config=cli_config).returncode == 1


def test_exports_equal_counters_equal_events(gw: GatewayServer, cli_config: Path, tmp_path: Path) -> None:
    ids = []
    for who in ("alice", "bob"):
        c = sdk(gw, SECRETS[who])
        for i, model in enumerate(("short", "long", "none", "short")):
            raw = c.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": f"{who} question {i}"}], stream=i % 2 == 1)
            if i % 2 == 1:
                list(raw.parse())
            ids.append(raw.headers["x-request-id"])
    admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
    events = list(usage_events(gw, ids).values())
    assert set(ids) <= {e.request_id for e in events}
    by_key: dict[str, dict[str, int]] = {}
    for e in events:
        acc = by_key.setdefault(e.key_id, dict.fromkeys(COUNTER_FIELDS, 0))
        for k, v in counter_increments(e).items():
            acc[k] += v
    # counters (API summary, admin view) == sum of the events
    summaries = httpx.get(gw.base_url + "/usage", headers=admin, timeout=10).json()["data"]
    counters = {s["key_id"]: s["counters"]["total"] for s in summaries}
    assert counters == by_key
    # exports (CLI, three formats) == counters
    out = tmp_path / "u.csv"
    r = _cli("usage", "export", "--format", "csv", "--group-by", "key", "--output", str(out), config=cli_config)
    assert r.returncode == 0, r.stderr
    csv_rows = {row["key"]: {k: int(row[k]) for k in COUNTER_FIELDS} for row in csv.DictReader(io.StringIO(
        out.read_text()))}
    assert csv_rows == by_key
    r = _cli("usage", "export", "--format", "jsonl", "--group-by", "key", "--output", "-", config=cli_config)
    assert not (REPO / "-").exists()  # '-' is standard output, not a file of that name
    jsonl_rows = {row["key"]: {k: row[k] for k in COUNTER_FIELDS} for row in map(json.loads, r.stdout.splitlines())}
    assert jsonl_rows == by_key
    pq_path = tmp_path / "u.parquet"
    r = _cli("usage", "export", "--format", "parquet", "--group-by", "key,tier", "--output", str(pq_path),
             config=cli_config)
    assert r.returncode == 0, r.stderr
    table = pq.read_table(pq_path).to_pylist()
    for key, want in by_key.items():
        assert sum(row["cost_micro_usd"] for row in table if row["key"] == key) == want["cost_micro_usd"]
        assert sum(row["requests"] for row in table if row["key"] == key) == want["requests"]
    raw = _cli("usage", "export", "--format", "jsonl", config=cli_config)
    assert len(raw.stdout.splitlines()) == len(events)
    # per-tier counters agree with the events too
    tiers = {e.tier for e in events}
    grouped = httpx.get(gw.base_url + "/usage", params={"group_by": "tier", "since": "0"}, headers=admin,
                        timeout=10).json()["data"]
    assert {row["tier"] for row in grouped} == tiers
    assert sum(row["cost_micro_usd"] for row in grouped) == sum(e.cost_micro_usd for e in events)


def test_usage_visibility(gw: GatewayServer) -> None:
    sdk(gw, SECRETS["bob"]).chat.completions.create(model="short", messages=[{"role": "user", "content": "vis"}])
    alice = {"authorization": f"Bearer {SECRETS['alice']}"}
    mine = httpx.get(gw.base_url + "/usage", headers=alice, timeout=10)
    assert mine.status_code == 200 and mine.json()["key_id"] == "alice"
    assert httpx.get(gw.base_url + "/usage", params={"key_id": "bob"}, headers=alice, timeout=10).status_code == 403
    rows = httpx.get(gw.base_url + "/usage", params={"group_by": "key", "since": "0"}, headers=alice,
                     timeout=10).json()["data"]
    assert {r["key"] for r in rows} <= {"alice"}
    admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
    # a key id that names no key and no usage is a 404, not a summary of zeros (a typo read as "nothing spent")
    nosuch = httpx.get(gw.base_url + "/usage", params={"key_id": "no-such-key"}, headers=admin, timeout=10)
    assert nosuch.status_code == 404 and nosuch.json()["error"]["code"] == "key_not_found"
    bob = httpx.get(gw.base_url + "/usage", params={"key_id": "bob"}, headers=admin, timeout=10).json()
    assert bob["key_id"] == "bob" and bob["counters"]["total"]["requests"] >= 1
    assert httpx.get(gw.base_url + "/usage", timeout=10).status_code == 401
    assert httpx.get(gw.base_url + "/usage", params={"group_by": "colour"}, headers=admin, timeout=10).status_code \
        == 400
    # a time that is no time (not finite, before 1970, after 9999) is the client's 400, not a 500 from the reader
    for bad in ({"since": "1e400"}, {"since": "nan"}, {"since": "-1e20"}, {"until": "nan"},
                {"since": "99999999999999999999"}):
        r = httpx.get(gw.base_url + "/usage", params=bad, headers=admin, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)


def test_raw_usage_says_when_it_is_cut(gw: GatewayServer) -> None:
    """Raw rows stop at ``limit``: ``has_more`` says the period holds more (a cut list summed as a month's bill
    undercounted it, silently); a ``limit`` that is no count of rows, and an empty period, are 400s naming the
    parameter (``limit=0`` and ``limit=-3`` answered one event; ``since`` after ``until`` an empty list)."""
    admin = {"authorization": f"Bearer {ADMIN_SECRET}"}
    t0 = time.time()
    c = sdk(gw, SECRETS["bob"])
    ids = [c.chat.completions.with_raw_response.create(
        model="short", messages=[{"role": "user", "content": f"cut {i}"}],
        extra_headers={"cache-control": "no-store"}).headers["x-request-id"] for i in range(3)]
    usage_events(gw, ids)

    def raw(**params: str) -> httpx.Response:
        return httpx.get(gw.base_url + "/usage", params={"since": str(t0), "key_id": "bob", **params},
                         headers=admin, timeout=10)

    cut = raw(limit="2").json()
    assert len(cut["data"]) == 2 and cut["has_more"] is True
    for whole in (raw(limit="3").json(), raw().json()):
        assert {r["request_id"] for r in whole["data"]} == set(ids) and whole["has_more"] is False
    grouped = raw(group_by="key").json()
    assert grouped["has_more"] is False and grouped["data"][0]["requests"] == 3
    for params, param in (({"limit": "0"}, "limit"), ({"limit": "-3"}, "limit"), ({"limit": "1.5"}, "limit"),
                          ({"limit": "10001"}, "limit"), ({"until": str(t0)}, "until"),
                          ({"until": str(t0 - 60)}, "until"), ({"since": "yesterday"}, "since"),
                          ({"group_by": "colour"}, "group_by")):
        r = raw(**params)
        assert r.status_code == 400, (params, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param, r.text


def test_metrics_endpoint(gw: GatewayServer) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    c = sdk(gw, SECRETS["alice"])
    question = [{"role": "user", "content": "metrics " + uuid.uuid4().hex}]
    c.chat.completions.create(model="short", messages=question, temperature=0)
    c.chat.completions.create(model="short", messages=question, temperature=0)
    time.sleep(0.1)
    assert httpx.get(gw.url + "/metrics", timeout=10).status_code == 401
    text = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_SECRET}"}, timeout=10).text
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert "_created" not in text  # one sample per series: no start-time twins

    def total(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v
                                                                         for k, v in labels.items()))

    assert total("thinkgate_cache_requests_total", result="hit") >= 1
    assert total("thinkgate_cache_requests_total", result="miss") >= 1
    assert total("thinkgate_requests_total", tier="short", route_reason="cache", cache="hit", status="2xx") >= 1
    assert total("thinkgate_tokens_total", kind="prompt") > 0 and total("thinkgate_tokens_total", kind="reasoning") > 0
    assert total("thinkgate_cost_micro_usd_total", tier="short") > 0
    assert total("thinkgate_saved_micro_usd_total", tier="short") > 0
    assert total("thinkgate_route_decisions_total", tier="short", reason="cache") >= 1
    assert total("thinkgate_request_latency_seconds_count") >= 2 and total("thinkgate_ttft_seconds_count") >= 2
    assert total("thinkgate_redis_breaker_open") == 0
    # counters end in _total (a cumulative count as a gauge breaks rate()); no controller, no target-share series
    # (a label-less gauge always renders, and its 0 read as "target 0%")
    assert any(s.name == "thinkgate_usage_spooled_events_total" for s in samples)
    assert not any(s.name.startswith("thinkgate_routing_target_share") for s in samples)
    # ... but the cut points in force have their gauge (it had a HELP line and no sample without the controller)
    cuts = {s.labels["tier"]: s.value for s in samples if s.name == "thinkgate_routing_threshold"}
    routed = gw.settings.routing.routed_tiers
    assert set(cuts) == set(routed[1:]) and all(0.0 <= v <= 1.0 for v in cuts.values()), cuts
    # bounded labels: tiers/models from the config only, no per-key series unless configured
    tiers = {s.labels["tier"] for s in samples if "tier" in s.labels}
    assert tiers <= {t.name for t in gw.settings.tiers} | {"_unrouted", "other"}
    assert not any("key_id" in s.labels for s in samples)


def test_shadow_calls_stay_out_of_the_client_latency_histograms(gw: GatewayServer) -> None:
    """A shadow call runs in the background after the client's answer: it is counted (requests, tokens, cost, with
    route_reason shadow) but no client waited for it, so it must not move the latency an SLO reads."""
    from gateway.ledger.event import UsageEvent
    from gateway.observability.metrics import Metrics

    m = Metrics(gw.settings.metrics, gw.settings.tiers)
    shadow = UsageEvent(key_id="alice", requested_model="auto", tier="long", upstream_model="m", route_reason="shadow",
                        prompt_tokens=10, completion_tokens=5, status=200, latency_ms=900.0, ttft_ms=100.0)
    client = UsageEvent(key_id="alice", requested_model="auto", tier="long", upstream_model="m",
                        route_reason="predicted", prompt_tokens=10, completion_tokens=5, status=200,
                        latency_ms=50.0, ttft_ms=10.0)
    m.observe(shadow, "bypass")
    m.observe(client, "miss")
    reg = m.registry
    assert reg.get_sample_value("thinkgate_requests_total", {"endpoint": "chat", "tier": "long", "model": "other",
                                                             "route_reason": "shadow", "cache": "bypass",
                                                             "status": "2xx"}) == 1
    for hist in ("thinkgate_request_latency_seconds_count", "thinkgate_ttft_seconds_count"):
        assert reg.get_sample_value(hist, {"tier": "long", "stream": "false"}) == 1  # the client's only


def test_a_cut_streams_prompt_estimate_counts_text_not_image_bytes() -> None:
    """Where the upstream cannot tokenize (not vLLM, or a multimodal prompt), the prompt of a cut stream is
    estimated from its text: a 1 MB base64 image was 250,000 "tokens" (a client that walked away from a vision
    request billed a quarter of a million prompt tokens)."""
    from gateway.openai.usage import MEDIA_TOKENS, estimate_prompt

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1_000_000}}
    text = {"type": "text", "text": "what is in this image?"}
    # the words (role and part type included: a rough count) plus one image's share
    assert MEDIA_TOKENS < estimate_prompt([{"role": "user", "content": [text, image]}]) < MEDIA_TOKENS + 20
    assert 3 <= estimate_prompt([{"role": "user", "content": "hello there world"}]) <= 8


def test_metrics_are_the_operators(upstream_sim: SimProcess, redis_url: str, tmp_path: Path) -> None:
    """``/metrics`` labels the upstream replicas by URL (internal hosts and ports) and names every tier's upstream
    model: by default (``metrics.access: admin``) a tenant's key is refused (403, OpenAI's shape), the admin key
    and the scrape key read it, and the scrape key opens nothing else; ``any_key`` is the old, open behaviour."""
    scrape = "tg-scrape-" + uuid.uuid4().hex
    digest = hashlib.sha256(scrape.encode()).hexdigest()

    def get(gw: GatewayServer, secret: str | None, path: str = "/metrics") -> httpx.Response:
        headers = {"authorization": f"Bearer {secret}"} if secret else {}
        return httpx.get(gw.url + path, headers=headers, timeout=10)

    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, metrics={"scrape_key_sha256": digest}) as gw:
        refused = get(gw, SECRETS["alice"])
        assert refused.status_code == 403 and upstream_sim.base_url.split("//")[1] not in refused.text
        err = refused.json()["error"]
        assert err["type"] == "permission_denied" or err["code"] == "permission_denied", err
        assert "scrape_key_sha256" in err["message"]
        assert get(gw, None).status_code == 401 and get(gw, "tg-not-a-key").status_code == 401
        assert get(gw, ADMIN_SECRET).status_code == 200
        ok = get(gw, scrape)
        assert ok.status_code == 200 and "# TYPE thinkgate_requests" in ok.text
        assert get(gw, scrape, "/v1/models").status_code == 401  # a scrape key, not an API key
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, metrics={"access": "any_key"}) as gw:
        assert get(gw, SECRETS["alice"]).status_code == 200 and get(gw, None).status_code == 401


def test_a_stream_longer_than_five_minutes_lands_in_a_finite_latency_bucket(gw: GatewayServer) -> None:
    """A 15-minute reasoning stream (limits.max_stream_s allows an hour): counted in the 1,800 s bucket. The buckets
    stopped at 300 s, so it was only in +Inf and histogram_quantile read every such p99 as 300 s."""
    from gateway.ledger.event import UsageEvent
    from gateway.observability.metrics import Metrics

    m = Metrics(gw.settings.metrics, gw.settings.tiers)
    m.observe(UsageEvent(key_id="alice", requested_model="long", tier="long", upstream_model="m",
                         route_reason="forced", prompt_tokens=10, completion_tokens=5, status=200, stream=True,
                         latency_ms=900_000.0, ttft_ms=1_000.0), "miss")
    sample = m.registry.get_sample_value
    labels = {"tier": "long", "stream": "true"}
    assert sample("thinkgate_request_latency_seconds_bucket", {**labels, "le": "300.0"}) == 0
    assert sample("thinkgate_request_latency_seconds_bucket", {**labels, "le": "1800.0"}) == 1
