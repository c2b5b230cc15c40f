"""What goes into the pipeline and what comes out of it — no HTTP on either side.

- :class:`Caller` — who asks, built once by ``gateway/api/`` after authentication and body validation: the key
  (and its tags), the wire format served (``chat`` | ``completions``), the usage event's endpoint label, the model
  asked for, whether it streams, the request's headers. Every upstream attempt's usage record derives from it
  (:meth:`Caller.record`).
- :class:`Answer` — what :meth:`gateway.pipeline.proxy.Proxy.serve` returns: the route it was served on, the
  request id, cache status and similarity, session state and escalation note (``gateway/api/http.py`` turns these
  into ``x-thinkgate-*`` headers), the HTTP status, and either the completed chat/completion dict (``body``; with
  ``raw``, the upstream's own bytes when the dict is unchanged) or ``stream``, an async generator of chunk batches
  (:class:`gateway.openai.sse.Chunk`), plus ``after``, a hook to run once the response was sent.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.auth.keys import KeyInfo
from gateway.ledger.event import Endpoint, WireEndpoint
from gateway.ledger.record import UsageRecord
from gateway.openai.sse import Chunk

if TYPE_CHECKING:
    from gateway.pipeline.routing import RouteDecision
    from gateway.state.limits import RateState


@dataclass(frozen=True, slots=True)
class Caller:
    """The request's identity, fixed for its whole way (see the module doc)."""

    key: KeyInfo
    endpoint: WireEndpoint
    label: Endpoint
    model: Any
    stream: bool
    headers: Mapping[str, str]
    #: a stream that asked for the usage chunk (``stream_options.include_usage``)
    usage: bool = False

    @classmethod
    def of(cls, key: KeyInfo, body: dict[str, Any], endpoint: WireEndpoint, headers: Mapping[str, str],
           label: Endpoint | None = None) -> Caller:
        """The caller of a validated ``body`` (``model`` and ``stream`` read from it); ``label`` defaults to
        ``endpoint`` (``responses`` / ``messages`` are served as ``chat`` under their own label)."""
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return cls(key, endpoint, label or endpoint, body.get("model"), body.get("stream") is True, headers, usage)

    def record(self) -> UsageRecord:
        """A new usage record (its own request id) for one upstream attempt of this caller."""
        return UsageRecord(key_id=self.key.id, tags=self.key.tags, endpoint=self.label,
                           requested_model=self.model, stream=self.stream)


@dataclass(slots=True)
class Answer:
    """The pipeline's result for one request (see the module doc). ``cache``: ``hit`` | ``semantic-hit`` |
    ``miss`` | ``bypass``; ``similarity``: a semantic hit's cosine; ``session``: ``new`` | ``sticky`` (None: no
    session applies); ``escalation``: why an escalation was skipped or failed, the first answer kept
    (``skipped|failed; tier=…; reason=…``)."""

    route: RouteDecision
    request_id: str
    cache: str
    similarity: float | None = None
    session: str | None = None
    escalation: str | None = None
    status: int = 200
    body: dict[str, Any] | None = None
    raw: bytes | None = None
    stream: AsyncGenerator[list[Chunk], None] | None = None
    after: Callable[[], Awaitable[None]] | None = None
    #: the key's RPM/TPM windows after its admission (``x-ratelimit-*`` headers); None when it has no such limit
    rate: RateState | None = None
    #: a relayed stream's usage record: what the call is metered, final once ``stream`` has ended (the relay meters a
    #: failed stream after its error chunk, so a translated API can say the metered usage in its failure event);
    #: None for a non-streamed answer or a cache hit's replay
    record: UsageRecord | None = None

    @property
    def escalated(self) -> bool:
        """True when the answer came from an escalation's retry on a higher tier."""
        return self.route.reason == "escalated"
