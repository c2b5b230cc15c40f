"""OTLP/HTTP protobuf export of finished spans, encoded by hand: the ``ExportTraceServiceRequest`` wire format
(opentelemetry-proto ``trace/v1``) for the spans :mod:`gateway.telemetry` makes, POSTed to the traces URL.

Why not the SDK's ``OTLPSpanExporter``: its encoder builds a protobuf message object per span, attribute and
value (~20 µs a span in CPython), which alone was more than the 10 % of a request's CPU the gateway allows
tracing; writing the bytes directly is a few µs a span. The request is the same (``POST``,
``Content-Type: application/x-protobuf``, the configured headers); 429/502/503/504 and connection errors are
retried with backoff within ``timeout_s``, as the SDK's exporter does. Pure stdlib; spans are duck-typed
``ReadableSpan`` objects (``name``, ``context``, ``parent``, ``kind``, ``start_time``, ``end_time``,
``attributes``, ``events``, ``status``, ``resource``, ``instrumentation_scope``).
"""

from __future__ import annotations

import logging
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("thinkgate.telemetry")

_RETRY = {429, 502, 503, 504}
_PACK_Q = struct.Struct("<Q").pack
_PACK_D = struct.Struct("<d").pack
_PACK_I = struct.Struct("<I").pack


def _varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _str(tag: bytes, s: str) -> bytes:
    return _len(tag, s.encode())


def _any_value(v: Any) -> bytes:
    # AnyValue: string_value=1, bool_value=2, int_value=3, double_value=4
    if isinstance(v, bool):
        return b"\x10" + (b"\x01" if v else b"\x00")
    if isinstance(v, int):
        return b"\x18" + _varint(v)
    if isinstance(v, float):
        return b"\x21" + _PACK_D(v)
    return _str(b"\x0a", str(v))


_KEYS: dict[str, bytes] = {}  # attribute key → its encoded ``key`` field (the keys are a small fixed set)
_NAMES: dict[str, bytes] = {}  # span name → its encoded ``name`` field (bounded: cleared past 4096 entries)


def _key(k: str) -> bytes:
    b = _KEYS.get(k)
    if b is None:
        if len(_KEYS) > 4096:
            _KEYS.clear()
        b = _KEYS[k] = _str(b"\x0a", k)
    return b


def _attributes(tag: bytes, attrs: Mapping[str, Any] | None) -> bytes:
    # KeyValue: key=1, value=2
    if not attrs:
        return b""
    return b"".join(_len(tag, _key(k) + _len(b"\x12", _any_value(v))) for k, v in attrs.items())


def encode_span(span: Any) -> bytes:
    """One ``Span`` message (trace/v1): ids, name, kind, times, attributes, events, status, flags."""
    c = span.context
    parent = span.parent
    out = [b"\x0a\x10" + c.trace_id.to_bytes(16, "big"), b"\x12\x08" + c.span_id.to_bytes(8, "big")]
    if c.trace_state:
        out.append(_str(b"\x1a", c.trace_state.to_header()))
    if parent is not None:
        out.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    name = _NAMES.get(span.name)
    if name is None:
        if len(_NAMES) > 4096:
            _NAMES.clear()
        name = _NAMES[span.name] = _str(b"\x2a", span.name)
    out.append(name)
    out.append(b"\x30" + _varint(span.kind.value + 1))  # API SpanKind INTERNAL=0 → proto SPAN_KIND_INTERNAL=1
    out.append(b"\x39" + _PACK_Q(span.start_time) + b"\x41" + _PACK_Q(span.end_time))
    out.append(_attributes(b"\x4a", span.attributes))
    for e in span.events:  # Event: time_unix_nano=1, name=2, attributes=3
        out.append(_len(b"\x5a", b"\x09" + _PACK_Q(e.timestamp) + _str(b"\x12", e.name)
                        + _attributes(b"\x1a", e.attributes)))
    status = span.status  # Status: message=2, code=3 (UNSET=0, OK=1, ERROR=2 in both the API and the proto)
    code = status.status_code.value
    out.append(_len(b"\x7a", (_str(b"\x12", status.description) if status.description else b"")
                    + (b"\x18" + _varint(code) if code else b"")))
    # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE, and IS_REMOTE for a client's parent (as the SDK's encoder writes them)
    out.append(b"\x85\x01" + _PACK_I(0x300 if parent is not None and parent.is_remote else 0x100))
    return b"".join(out)


def encode_request(spans: Sequence[Any]) -> bytes:
    """An ``ExportTraceServiceRequest``: the spans grouped by resource, then by instrumentation scope."""
    groups: dict[int, tuple[Any, dict[tuple[str, str], list[bytes]]]] = {}
    for s in spans:
        res = s.resource
        _, scopes = groups.setdefault(id(res), (res, {}))
        scope = s.instrumentation_scope
        key = (scope.name, scope.version or "") if scope is not None else ("", "")
        scopes.setdefault(key, []).append(_len(b"\x12", encode_span(s)))
    out = []
    for res, scopes in groups.values():
        body = [_len(b"\x0a", _attributes(b"\x0a", res.attributes))]
        for (name, version), encoded in scopes.items():
            scope_msg = _str(b"\x0a", name) + (_str(b"\x12", version) if version else b"")
            body.append(_len(b"\x12", _len(b"\x0a", scope_msg) + b"".join(encoded)))
        out.append(_len(b"\x0a", b"".join(body)))
    return b"".join(out)


class OtlpHttpExporter:
    """A span exporter (the SDK's ``SpanExporter`` protocol: ``export``, ``shutdown``, ``force_flush``) that
    POSTs :func:`encode_request` bodies to ``endpoint``. ``export`` returns the SDK's ``SpanExportResult``."""

    def __init__(self, endpoint: str, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._result = SpanExportResult
        self.endpoint = endpoint
        self.headers = {"Content-Type": "application/x-protobuf", **(headers or {})}
        self.timeout_s = timeout_s
        self._shutdown = False

    def export(self, spans: Sequence[Any]) -> Any:
        if self._shutdown:
            return self._result.FAILURE
        if not spans:
            return self._result.SUCCESS
        body = encode_request(spans)
        deadline = time.monotonic() + self.timeout_s
        delay = 0.5
        while True:
            try:
                req = urllib.request.Request(self.endpoint, data=body, headers=self.headers, method="POST")
                left = max(0.1, deadline - time.monotonic())
                with urllib.request.urlopen(req, timeout=left) as r:
                    r.read()
                return self._result.SUCCESS
            except urllib.error.HTTPError as exc:
                if exc.code not in _RETRY:
                    log.warning("OTLP export refused: HTTP %s (%d spans dropped)", exc.code, len(spans))
                    return self._result.FAILURE
                why = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                why = type(exc).__name__
            if time.monotonic() + delay > deadline:
                log.warning("OTLP export failed: %s (%d spans dropped)", why, len(spans))
                return self._result.FAILURE
            time.sleep(delay)
            delay *= 2

    def shutdown(self) -> None:
        self._shutdown = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
