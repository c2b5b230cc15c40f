"""Observability (``telemetry:``, ``metrics:``): OpenTelemetry traces and Prometheus labels
(``gateway/observability/``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.base import _Strict


class TelemetryConfig(_Strict):
    """OpenTelemetry traces (``gateway/observability/telemetry.py``), off unless ``otlp_endpoint`` is set: the OTLP/HTTP
    traces URL (e.g. ``http://127.0.0.1:4318/v1/traces``). Needs the ``otel`` extra (``router.errors.install_hint``).
    ``sample_ratio``: the share of new traces recorded (``ParentBased(TraceIdRatioBased)``: a client's sampled
    ``traceparent`` is always followed); 1.0 records every request."""

    otlp_endpoint: str | None = None
    sample_ratio: float = Field(1.0, ge=0, le=1)
    service_name: str = "thinkgate"
    headers: dict[str, str] = Field(default_factory=dict)
    export_timeout_s: float = Field(10.0, gt=0)


class MetricsConfig(_Strict):
    """Prometheus ``/metrics``. Labels are bounded: tier, upstream model (both from this config), route reason,
    cache result, status class; the key id only when ``key_id_label`` (one series per key)."""

    key_id_label: bool = False
    #: who reads ``/metrics``. The series are the operator's, not a tenant's: the upstream replicas' URLs
    #: (``thinkgate_upstream_*{upstream}``: internal hosts and ports), the tiers' upstream models, every key's
    #: spend with ``key_id_label``. ``admin`` (default): the admin key or the scrape key below (403 for any other
    #: key); ``any_key``: any valid API key (the behaviour before this setting); ``open``: no key — only for a
    #: listener no client can reach (a NetworkPolicy or firewall admitting Prometheus alone)
    access: Literal["admin", "any_key", "open"] = "admin"
    #: SHA-256 (hex) of a key that opens ``/metrics`` and nothing else — Prometheus' bearer token, so the scrape
    #: job need not hold the admin key (``printf %s "$SECRET" | sha256sum``)
    scrape_key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")

