"""What the gateway tells operators about itself: Prometheus metrics (``metrics``) and OpenTelemetry traces
(``telemetry``, whose OTLP/HTTP bytes ``otlp_wire`` writes)."""
