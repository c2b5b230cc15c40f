"""Observability (``telemetry:``, ``metrics:``): OpenTelemetry traces and Prometheus labels
(``gateway/observability/``).
"""

from __future__ import annotations

from pydantic import Field

from gateway.config.base import _Strict


class TelemetryConfig(_Strict):
    """OpenTelemetry traces (``gateway/observability/telemetry.py``), off unless ``otlp_endpoint`` is set: the OTLP/HTTP
    traces URL (e.g. ``http://127.0.0.1:4318/v1/traces``). Needs ``pip install 'thinkgate[otel]'``.
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

