"""One exception hierarchy for the gateway, mapped to OpenAI's error JSON and an HTTP status.

Every failure the request path can produce is a :class:`GatewayError` subclass carrying its HTTP status,
OpenAI ``type`` and ``code``, and every subclass lives in this module; :func:`gateway.api.errors.install_handlers`
turns them (and anything unexpected) into::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

The shape follows the OpenAI API reference ("Error codes") so the official SDKs raise the matching
``openai.*Error`` classes (400 → BadRequestError, 401 → AuthenticationError, 429 → RateLimitError, …).
No handler ever returns a traceback. Errors that are not HTTP answers (a bad config, Redis down for an offline
command, a missing extra) derive from :class:`ThinkGateError` instead (re-exported here from ``router.errors``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from router.errors import ThinkGateError

__all__ = ["CAP_FIELDS", "CAP_FIELDS_AND_N",
           "AuthError", "BodyTooLarge", "ClientClosed", "ConversationsUnavailable", "GatewayError",
           "InvalidRequest", "KeyStoreUnavailable", "LimitsUnavailable", "NotFound", "OutcomesUnavailable",
           "Overloaded", "PermissionDenied",
           "RateLimited", "RequestTimeout",
           "ThinkGateError", "TierNotAllowed", "UnknownModel", "UpstreamConnectTimeout", "UpstreamError",
           "UpstreamRejected", "UpstreamStreamError", "UpstreamTimeout", "UpstreamUnavailable", "UsageUnavailable"]



class GatewayError(Exception):
    """Base class: ``status`` (HTTP; an instance attribute defaulting to the class's), ``type`` and ``code``
    (OpenAI error fields), optional ``param`` and extra response ``headers``."""

    status: int = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    #: an admission refused without Redis's answer after its script call was sent (a timeout, a lost connection):
    #: the script may have run all the same (``gateway/state/limits.py``, "Outcome unknown") — what it may have left
    #: is the request's audit event's to take back (``Accounting.admit_estimate``)
    outcome_unknown: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())


class InvalidRequest(GatewayError):
    """400: the body is not valid JSON, or has a field of the wrong type or value (an unknown model is
    :class:`UnknownModel`, 404)."""

    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class UnknownModel(InvalidRequest):
    """404: ``model`` is neither ``auto`` nor a configured tier (or no tier that serves the endpoint) — OpenAI's
    and vLLM's status for an unknown model (the SDKs raise ``NotFoundError``), Anthropic's ``not_found_error``."""

    status = 404
    default_code = "model_not_found"


class NotFound(InvalidRequest):
    """404: the object named in the path (e.g. a stored response) is unknown, expired or another key's."""

    status = 404
    default_code = "not_found"


class AuthError(GatewayError):
    """401: no ``Authorization: Bearer`` key, or a key that is not known."""

    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(GatewayError):
    """403: the key is valid but may not use this endpoint (e.g. admin-only)."""

    status = 403
    type = "permission_error"
    default_code = "permission_denied"


class TierNotAllowed(PermissionDenied):
    """403: the key may not use the tier the request was routed or forced to (``KeyConfig.allowed_tiers``)."""

    default_code = "tier_not_allowed"


class ClientClosed(GatewayError):
    """499 (nginx's "client closed request"): the client went away before a non-streamed answer was ready;
    the upstream call was cancelled. Nobody reads the response; the status is for logs and the usage event."""

    status = 499
    type = "invalid_request_error"
    default_code = "client_disconnected"


class RequestTimeout(GatewayError):
    """408: the client did not send its request (head or body) within ``server.request_head_timeout_s`` /
    ``request_body_timeout_s`` (``gateway/api/slow_clients.py``). The connection is closed after it."""

    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"


class BodyTooLarge(GatewayError):
    """413: the request body exceeds ``server.max_body_bytes``."""

    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


#: How a budget refusal's message names the request fields that bound its estimate (``gateway/state/limits.py``):
#: the chat and completions fields. The Responses and Messages APIs name their own (:meth:`RateLimited.naming`).
CAP_FIELDS = "max_tokens (or max_completion_tokens)"
#: ... and what lowers an estimate larger than the whole budget (chat and completions also take ``n``)
CAP_FIELDS_AND_N = CAP_FIELDS + " or n"


class RateLimited(GatewayError):
    """429: a rate or budget limit refused the request; set ``Retry-After`` through ``headers``."""

    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def naming(self, field: str) -> RateLimited:
        """This refusal with its message naming ``field``, the API's own output cap (``max_output_tokens`` on
        ``/v1/responses``, ``max_tokens`` on ``/v1/messages``), where it named the chat fields: a client of those
        APIs has neither ``max_completion_tokens`` nor ``n``. Returns ``self``."""
        self.message = self.message.replace(CAP_FIELDS_AND_N, field).replace(CAP_FIELDS, field)
        self.args = (self.message,)
        return self
    #: A budget refusal on spend already past the budget: ``(level, "day" | "month", spent micro-USD)`` (a
    #: ``gateway.state.budgets.Level``) — the budget alerts of that level are checked on it (a budget lowered below
    #: the spend refuses every request and meters none, which is where alerts were checked). None otherwise.
    exhausted: Any = None


class UpstreamError(GatewayError):
    """502: the upstream refused the connection, failed (5xx) or broke the response.

    Sent with ``x-should-retry: false`` (the header the OpenAI and Anthropic SDKs obey): a 500 or a broken body
    may follow a generation that ran — which an SDK's retry would pay again — and the gateway has already retried
    what is safe to retry. :class:`UpstreamUnavailable` (no connection, or the upstream's 502/503: nothing ran)
    leaves the client's retry to the client."""

    status = 502
    type = "upstream_error"
    default_code = "upstream_error"
    #: the SDKs may retry it (nothing ran upstream)
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        if not self.retryable:
            self.headers.setdefault("x-should-retry", "false")


class UpstreamStreamError(UpstreamError):
    """The upstream's stream cannot be read as SSE (a line past ``gateway.openai.sse.MAX_LINE_BYTES``): the relay's
    broken stream (502 ``upstream_stream_broken`` in the stream)."""

    default_code = "upstream_stream_broken"


class UpstreamUnavailable(UpstreamError):
    """502: no connection to the upstream could be made after the retries (a candidate for tier fallback)."""

    default_code = "upstream_unavailable"
    retryable = True


class UpstreamTimeout(UpstreamError):
    """504: the upstream did not connect or answer within the tier's timeouts."""

    status = 504
    default_code = "upstream_timeout"


class UpstreamConnectTimeout(UpstreamTimeout):
    """504: the upstream did not accept a connection in time after the retries (a fallback candidate)."""

    default_code = "upstream_connect_timeout"
    retryable = True


class UpstreamRejected(GatewayError):
    """The upstream answered 4xx; ``status`` is the upstream's folded to 400 (400/404/422 …) or 429."""

    type = "invalid_request_error"
    default_code = "upstream_rejected"

    def __init__(self, message: str, *, status: int, **kwargs: Any) -> None:
        super().__init__(message, status=429 if status == 429 else 400, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if self.status == 429:
            d["error"]["type"] = "rate_limit_error"
        return d


class Overloaded(GatewayError):
    """503: this process holds ``server.limit_concurrency`` connections or requests already
    (``gateway/api/slow_clients.py``); retry, another replica may have room. Probes are never refused for it."""

    status = 503
    type = "server_error"
    default_code = "overloaded"


class LimitsUnavailable(GatewayError):
    """503: Redis is unreachable and ``limits.on_redis_down`` is ``fail_closed``."""

    status = 503
    type = "server_error"
    default_code = "limits_unavailable"


class KeyStoreUnavailable(GatewayError):
    """503: the presented key is not known locally and the Redis key store is unreachable."""

    status = 503
    type = "server_error"
    default_code = "key_store_unavailable"


class OutcomesUnavailable(GatewayError):
    """503: Redis is unreachable: the request a feedback is about cannot be looked up (``retry-after``: the breaker's
    cooldown)."""

    status = 503
    type = "server_error"
    default_code = "outcomes_unavailable"


class UsageUnavailable(GatewayError):
    """503: the usage store (Redis) is unreachable."""

    status = 503
    type = "server_error"
    default_code = "usage_unavailable"


class ConversationsUnavailable(GatewayError):
    """503: a ``previous_response_id`` was given while Redis is unreachable."""

    status = 503
    type = "server_error"
    default_code = "conversation_store_unavailable"
