"""A stream keeps its budget reservation while it runs (renewed past ``limits.reservation_ttl_s``) and is cut at
``limits.max_stream_s``: ``finish_reason: "length"``, ``[DONE]``, metered as partial, reservation settled — through a
real gateway over the upstream simulator and a real Redis."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis

from gateway.ledger.event import micro_to_usd
from tests.fixtures.gateway import accounting_gateway, create_key, usage_events
from tests.fixtures.upstream import SimProcess


def test_a_long_stream_renews_its_reservation_and_is_cut_at_its_bound(upstream_sim: SimProcess, redis_url: str,
                                                                      tmp_path: Path) -> None:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    limits = {"reservation_ttl_s": 1.2, "max_stream_s": 2.5}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix, limits=limits) as gw:
        kid = f"stream-{uuid.uuid4().hex[:8]}"
        secret = create_key(redis_url, prefix, kid, budget_usd_day=micro_to_usd(1_000_000))
        t = uuid.uuid4().hex
        body = {"model": "long", "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "a slow stream of words"}],
                "sim": {"tag": t, "chunk_delay_ms": 200}}  # ~25 chunks: ~5 s unbounded, finish_reason "stop"
        events: list[dict[str, Any]] = []
        head: dict[str, str] = {}

        def consume() -> None:
            with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30,
                              headers={"authorization": f"Bearer {secret}", "cache-control": "no-store"}) as r:
                head.update(r.headers)
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))

        worker = threading.Thread(target=consume)
        started = time.monotonic()
        worker.start()
        client = redis.Redis.from_url(redis_url)
        samples: list[tuple[float, int | None]] = []  # (epoch s, the reservation's expiry in ms or None)
        try:
            while worker.is_alive() and time.monotonic() - started < 20:
                rid = head.get("x-request-id")
                if rid:
                    raw = client.hget(f"{prefix}lim:{kid}:resv", rid)
                    text = raw.decode() if isinstance(raw, bytes) else raw
                    samples.append((time.time(), int(text.split("|")[2]) if text is not None else None))
                time.sleep(0.05)
            worker.join(timeout=20)
        finally:
            client.close()
        finishes = [c["finish_reason"] for e in events for c in e.get("choices") or () if c.get("finish_reason")]
        assert finishes == ["length"] and events[-1] == {"done": True}
        assert events[-2]["usage"]["completion_tokens"] > 0  # the usage chunk the client asked for
        rid = head["x-request-id"]
        ev = usage_events(gw, [rid])[rid]
        # renewed: past the TTL of the reservation made at admission, it was still there and unexpired
        late = [(at, exp) for at, exp in samples if ev.ts + 1.4 < at < ev.ts + 2.3]
        assert late and all(exp is not None and exp > at * 1000 for at, exp in late), (ev.ts, samples)
        assert ev.partial and ev.status == 200 and ev.error_code == "stream_max_duration"
        assert 0 < ev.completion_tokens < 25 and ev.cost_micro_usd > 0
        rec = upstream_sim.wait_tag_status(t, {"cancelled", "completed"}, timeout_s=10)
        assert rec is not None and rec["status"] == "cancelled"  # the upstream request was closed
        check = redis.Redis.from_url(redis_url)
        try:
            assert check.hlen(f"{prefix}lim:{kid}:resv") == 0  # settled, not left to expire
        finally:
            check.close()
