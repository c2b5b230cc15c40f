"""The usage event of a record (``gateway.pipeline.accounting.event_of``) carries every field the two share, as
it is, and converts only the ones it names — a field added to both is never silently dropped from the ledger."""

from __future__ import annotations

from dataclasses import fields

from gateway.ledger.event import UsageEvent
from gateway.ledger.record import UsageRecord
from gateway.pipeline.accounting import event_of


def test_every_shared_field_reaches_the_event() -> None:
    rec = UsageRecord(request_id="r-1", ts=1.5, key_id="alice", tags={"team": "a"}, endpoint="completions",
                      requested_model="auto", tier="short", upstream_model="m", route_reason="predicted",
                      difficulty=0.25, stream=True, prompt_tokens=11, cached_tokens=3, completion_tokens=7,
                      reasoning_tokens=5, usage_source="upstream", partial=True, cost_micro_usd=42, cached=True,
                      saved_micro_usd=9, latency_ms=12.34567, ttft_ms=1.23456, status=206, error_code="x",
                      cache_request_id="r-0", cache_similarity=0.912345, over_bound=True)
    ev = event_of(rec)
    shared = {f.name for f in fields(UsageEvent)} & {f.name for f in fields(UsageRecord)}
    converted = {"latency_ms": 12.346, "ttft_ms": 1.235, "cache_similarity": 0.9123}
    for name in shared:
        assert getattr(ev, name) == converted.get(name, getattr(rec, name)), name
    assert ev.event_id == "r-1" and ev.tags == {"team": "a"} and ev.tags is not rec.tags
    anon = event_of(UsageRecord())
    assert (anon.key_id, anon.requested_model, anon.ttft_ms, anon.cache_similarity) == ("anonymous", "", None, None)
