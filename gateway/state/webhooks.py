"""Webhook delivery with retries and exponential backoff, and a dead-letter log for what never arrived.

:func:`deliver` POSTs a JSON body (Slack incoming-webhook compatible: it carries ``text``) up to
``limits.alert_webhook_attempts`` times. It retries a connection error, a timeout, HTTP 429 and 5xx, waiting
``alert_webhook_backoff_s`` × 2^(attempt − 1) seconds between attempts (a ``Retry-After`` in seconds, capped at
60 s, wins when larger); another 4xx is final (retrying a rejected payload cannot help). When no attempt
succeeds, one JSON line ``{"ts", "url", "attempts", "error", "body"}`` is appended to
``limits.alert_dead_letter_path`` (so an operator can replay it) and an error is logged — the URL's query
(where a webhook's secret may live) is never logged or written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from urllib.parse import urlsplit

import httpx
import orjson

from gateway.config import LimitsConfig

log = logging.getLogger("thinkgate.alerts")

RETRY_AFTER_MAX_S = 60.0


def redacted(url: str) -> str:
    """``url`` as logs and the dead-letter file show it: scheme, host and port only. Webhook services put the
    secret in the path (Slack ``/services/T…/B…/<secret>``, Mattermost ``/hooks/<secret>``, Discord
    ``/api/webhooks/<id>/<secret>``) or the query, so no part of either is shown."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname or ''}{port}{'/…' if parts.path.strip('/') or parts.query else ''}"


def _retry_after(resp: httpx.Response) -> float:
    try:
        return min(RETRY_AFTER_MAX_S, max(0.0, float(resp.headers.get("retry-after", "0"))))
    except ValueError:
        return 0.0


async def deliver(http: httpx.AsyncClient, url: str, body: bytes, cfg: LimitsConfig) -> bool:
    """POST ``body`` to ``url`` with retries (see the module doc); True once an attempt got a 2xx/3xx answer."""
    error = ""
    attempt = 0
    for attempt in range(1, cfg.alert_webhook_attempts + 1):
        wait = cfg.alert_webhook_backoff_s * 2 ** (attempt - 1)
        try:
            resp = await http.post(url, content=body, headers={"content-type": "application/json"},
                                   timeout=cfg.alert_webhook_timeout_s)
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        else:
            if resp.status_code < 400:
                if attempt > 1:
                    log.info("alert webhook %s delivered on attempt %d", redacted(url), attempt)
                return True
            error = f"HTTP {resp.status_code}"
            if resp.status_code != 429 and resp.status_code < 500:
                break
            wait = max(wait, _retry_after(resp))
        if attempt < cfg.alert_webhook_attempts:
            log.warning("alert webhook %s: %s (attempt %d of %d); retrying in %.2f s", redacted(url), error,
                        attempt, cfg.alert_webhook_attempts, wait)
            await asyncio.sleep(wait)
    log.error("alert webhook %s failed after %d attempt(s) (%s); dead-lettered to %s", redacted(url), attempt,
              error, cfg.alert_dead_letter_path)
    dead_letter(cfg, url, attempt, error, body)
    return False


def dead_letter(cfg: LimitsConfig, url: str, attempts: int, error: str, body: bytes) -> None:
    """Append one undelivered webhook body to the dead-letter log (JSON Lines, created 0600)."""
    path = cfg.alert_dead_letter_path
    line = orjson.dumps({"ts": time.time(), "url": redacted(url), "attempts": attempts, "error": error,
                         "body": orjson.loads(body)}) + b"\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as f:
            f.write(line)
    except OSError as exc:
        log.error("cannot write the alert dead-letter log %s: %r", path, exc)
