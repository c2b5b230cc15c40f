"""The routing outcome: did the tier a request was answered on suffice? One record per piece of evidence.

Sources (``source``):

- ``feedback``: the client said so (``POST /v1/feedback``: ``correct`` or a ``value`` in [0, 1]; judge
  ``client``); ``sufficed`` = correct, or value >= 0.5.
- ``escalation``: the gateway's cascade found the answer empty, cut or abstaining and asked the next tier
  (judge ``escalation:<why>``, ``sufficed`` False) — or would have, but the escalation was refused (budget, key
  policy) or failed: the same verdict on the same answer, with ``other_tier`` the tier it would have asked and
  ``comment`` the ``x-thinkgate-escalation`` note (``skipped; …`` / ``failed; …``).
- ``shadow``: a sampled request was also sent to the next tier up after the client's answer was complete and
  the two answers were compared (judge ``agreement`` | ``verifier`` | ``tier:<name>``).

Every outcome carries the request id, the key id, the routing window's digest (SHA-256 of the text the
router scored, 16 hex characters; None when the request was not routed), the router score and the tier(s);
``text`` (the routing window) and ``answers`` only when ``routing.outcomes.retain_text`` is on. These are the
labels ``thinkgate router retrain --from-outcomes`` learns from.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import orjson

OutcomeSource = Literal["feedback", "escalation", "shadow"]


def window_digest(text: str) -> str:
    """The routing window's digest: the first 16 hex characters of its SHA-256 (UTF-8)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class Outcome:
    """One routing outcome (see the module docstring). ``ts`` epoch seconds; ``score`` the router score in
    [0, 1] (None: not routed); ``value`` a client's score in [0, 1]; ``cost_micro_usd`` what the evidence cost
    (a shadow call, a judge call; 0 for feedback)."""

    source: OutcomeSource
    request_id: str
    key_id: str
    tier: str | None
    sufficed: bool | None
    judge: str
    outcome_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ts: float = field(default_factory=time.time)
    route_reason: str | None = None
    escalated_from: str | None = None  # an escalated answer: the first attempt's route reason
    window_digest: str | None = None
    score: float | None = None
    other_tier: str | None = None
    value: float | None = None
    comment: str | None = None
    cost_micro_usd: int = 0
    router_version: str | None = None
    text: str | None = None
    answers: list[str] | None = None
    #: when the graded request was answered (epoch s; feedback only, None for entries indexed before it was kept)
    request_ts: float | None = None

    @property
    def day(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.ts))

    @property
    def seen_day(self) -> str:
        """The UTC day whose seen-set (and grades hash) holds this outcome's id: the answered request's day for
        feedback — a grade may come up to ``request_ttl_s`` later, across midnight, and must meet the first
        grade's seen-set to be a duplicate —, else (and for a request indexed before its time was kept) the
        outcome's own."""
        return time.strftime("%Y-%m-%d", time.gmtime(self.ts if self.request_ts is None else self.request_ts))

    def to_json(self) -> bytes:
        return orjson.dumps(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Outcome:
        """Parse one record, ignoring unknown fields (written by a newer version)."""
        data: dict[str, Any] = orjson.loads(raw)
        return cls(**{k: v for k, v in data.items() if k in _FIELD_NAMES})


# read once: dataclasses.fields() per record was a fifth of parsing the newest 100,000 outcomes (1.26 s → 0.98 s here)
_FIELD_NAMES = frozenset(f.name for f in fields(Outcome))
