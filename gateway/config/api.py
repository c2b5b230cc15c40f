"""The HTTP surface's own settings: the dashboard (``dashboard:``) and the Responses API (``responses:``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from gateway.config.base import _Strict
from gateway.config.paths import STATE_DIR


class DashboardConfig(_Strict):
    """``GET /dashboard`` (``gateway/api/dashboard/``): on unless ``enabled: false``. The session cookie is
    signed with the secret in ``secret_file`` (created 0600 on first use; replicas behind one load balancer
    share it by pointing at the same file) and expires after ``session_ttl_s`` seconds. ``secure_cookie``
    adds the ``Secure`` attribute (set it behind TLS). ``poll_s``: how often the page refreshes its data.
    ``window_events``: how many of the most recent usage events a poll reads for the figures that need each event
    (latency percentiles, routing mix, the always-long estimate); every sum comes from the usage cubes."""

    enabled: bool = True
    session_ttl_s: int = Field(8 * 3600, ge=60)
    secret_file: Path = STATE_DIR / "dashboard-secret"
    secure_cookie: bool = False
    poll_s: float = Field(10.0, ge=1)
    window_events: int = Field(5000, ge=1, le=100_000)


class ResponsesConfig(_Strict):
    """``POST /v1/responses``: a stored answer (``store`` not false) can be continued with
    ``previous_response_id`` for ``store_ttl_s`` seconds (``gateway/state/conversations.py``)."""

    store_ttl_s: int = Field(3600, ge=1)

