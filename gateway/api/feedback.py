"""``POST /v1/feedback``: a client says whether the answer to one of its requests was right.

Body: ``{"request_id": str, "correct": bool}`` or ``{"request_id": str, "score": number in [0, 1]}``, plus an
optional ``"comment"`` (a string of at most 2,000 characters). ``request_id`` is the ``x-request-id`` header
(= the ``id`` the usage event carries) of a request made with the same API key within
``routing.outcomes.request_ttl_s``; another key's request, or an unknown one, is a 404 (the two are not told
apart). Recorded as a ``feedback`` outcome (``gateway/control/outcomes.py``; spooled while Redis is down): 200
``{"id", "object": "feedback", "request_id", "sufficed", "stored": "redis" | "spool" | "duplicate"}``. One
outcome per request: a second feedback on the same request — also after midnight: grades are deduplicated in the
answered request's UTC day, and while the first waits in this replica's spool for Redis — answers ``stored:
"duplicate"`` with the ``sufficed`` of the first (which stands) and changes nothing — a first written before grades
were kept beside the seen-set
(``p outcomes:grades:{day}``) is read from its stream entry; ``null`` only when the stream no longer holds it.
Errors: 400 ``invalid_request`` (body), 401 (key), 403 ``permission_denied`` (a key not in
``routing.outcomes.feedback_keys``, when that is set: feedback trains the router every key is served by), 404
``request_not_found`` (its message says to retry after a second: a request another replica answered less than one
index flush ago is not in Redis yet), 503 ``outcomes_unavailable`` (Redis down: the request's key cannot be checked).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.api.common import json_response
from gateway.api.http import read_body
from gateway.auth.keys import KeyStore
from gateway.control.outcomes import INDEX_FLUSH_S, OutcomeStore
from gateway.errors import InvalidRequest, OutcomesUnavailable, PermissionDenied
from gateway.ledger.outcome import Outcome
from gateway.pipeline.request import parse_json_object
from gateway.state.breaker import RedisDown

MAX_COMMENT = 2000
MAX_BODY = 16_384


def parse_feedback(body: dict[str, Any]) -> tuple[str, bool | None, float | None, str | None]:
    """``(request_id, correct, score, comment)`` from a feedback body; raises InvalidRequest (400)."""
    unknown = set(body) - {"request_id", "correct", "score", "comment"}
    if unknown:
        raise InvalidRequest(f"unknown field(s) {sorted(unknown)}", param=sorted(unknown)[0])
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid or len(rid) > 128:
        raise InvalidRequest("request_id must be the x-request-id of one of your requests", param="request_id")
    correct, score = body.get("correct"), body.get("score")
    if (correct is None) == (score is None):
        raise InvalidRequest("give exactly one of 'correct' (boolean) or 'score' (number in [0, 1])",
                             param="correct")
    if correct is not None and not isinstance(correct, bool):
        raise InvalidRequest("correct must be a boolean", param="correct")
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score) \
                or not 0 <= score <= 1:
            raise InvalidRequest("score must be a number in [0, 1]", param="score")
        score = float(score)
    comment = body.get("comment")
    if comment is not None and (not isinstance(comment, str) or len(comment) > MAX_COMMENT):
        raise InvalidRequest(f"comment must be a string of at most {MAX_COMMENT} characters", param="comment")
    return rid, correct, score, comment


def attach(app: FastAPI, keys: KeyStore, store: OutcomeStore) -> None:
    """Add ``POST /v1/feedback`` to ``app``."""

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> Response:
        key = await keys.authenticate(request.headers.get("authorization"))
        allowed = store.cfg.feedback_keys
        if allowed is not None and key.id not in allowed:
            # the grades of every accepted key train the one router all keys are served by (and decide its rollback)
            raise PermissionDenied("this API key may not grade answers: feedback is accepted from the keys in "
                                   "routing.outcomes.feedback_keys only")
        raw = await read_body(request, MAX_BODY)  # refused past the limit, before the rest is read (413)
        rid, correct, score, comment = parse_feedback(parse_json_object(raw))
        try:
            entry = await store.request(rid, key.id)
        except RedisDown as exc:
            raise OutcomesUnavailable("the outcome store is unavailable; retry later",
                                      headers=store.breaker.retry_after()) from exc
        if entry is None or entry.get("key_id") != key.id:
            # the request index is written in the background (INDEX_FLUSH_S): another replica's answer of a moment
            # ago is not in Redis yet, and a retry after a second finds it
            raise InvalidRequest(f"no request {rid!r} made with this key (or it is older than the feedback window); "
                                 f"one another replica answered moments ago is indexed within {INDEX_FLUSH_S:g} s: "
                                 "retry after a second", param="request_id", code="request_not_found", status=404)
        sufficed = correct if correct is not None else bool(score is not None and score >= 0.5)
        outcome = Outcome(source="feedback", request_id=rid, key_id=key.id, tier=entry.get("tier"),
                          sufficed=sufficed, judge="client", outcome_id=f"fb:{rid}",
                          route_reason=entry.get("route_reason"), escalated_from=entry.get("escalated_from"),
                          window_digest=entry.get("window_digest"),
                          score=entry.get("score"), value=score if score is not None else float(bool(correct)),
                          comment=comment, text=entry.get("text"),
                          request_ts=float(entry["ts"]) if isinstance(entry.get("ts"), int | float) else None,
                          # the router that served the request (an entry written before the index kept it: now's)
                          router_version=entry["router_version"] if "router_version" in entry
                          else store.router_version())
        stored, kept = await store.record_graded(outcome)
        # a duplicate changes nothing: the answer says the grade that stands (the first), not this one
        return json_response({"id": outcome.outcome_id, "object": "feedback", "request_id": rid,
                              "sufficed": kept, "stored": stored})
