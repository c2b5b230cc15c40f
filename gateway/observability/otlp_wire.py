"""OTLP/HTTP protobuf export of finished traces, encoded by hand and batched: the ``ExportTraceServiceRequest``
wire format (opentelemetry-proto ``trace/v1``) for the traces :mod:`gateway.observability.telemetry` records,
POSTed to the traces URL.

Why not the SDK's ``BatchSpanProcessor`` + ``OTLPSpanExporter``: measured under load (bench/RESULTS.md
"Telemetry overhead"), building ``ReadableSpan`` objects and encoding them through protobuf message objects
(~20 µs a span), or even by hand from those objects in the export thread, cost more than the 10 % of a
request's CPU the gateway allows tracing. Here a finished trace is queued as the few objects it is (ids, step
times, the attribute dict); a daemon thread writes a batch's bytes directly — a few fixed byte strings and
``struct`` packs a span, attribute keys and low-cardinality values cached — frames it (one resource, one
scope) and POSTs it on a kept-alive connection (``Content-Type: application/x-protobuf``, the configured
headers); 429/502/503/504 and connection errors are retried with exponential backoff within ``timeout_s``, as
the SDK's exporter does.
A batch goes at 2048 spans or every 5 s, at most 8192 spans queued (the SDK's batch processor: 512 and 2048;
larger here, fewer POSTs at a gateway's rates); more are dropped and counted in
:attr:`OtlpBatchExporter.dropped`, with a warning. Pure stdlib.
"""

from __future__ import annotations

import http.client
import logging
import struct
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger("thinkgate.telemetry")

#: The step that calls the upstream: a CLIENT span (the others are INTERNAL).
CLIENT_STEP = "upstream"


class Step(Protocol):
    """What the encoder reads of a finished step (:class:`gateway.observability.telemetry.Step` is one): its name,
    start and end in ns since the epoch, the exception class name when it raised, and its span id (drawn on demand).
    Declared here so that this module imports nothing of the telemetry that uses it."""

    @property
    def name(self) -> str: ...

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def error(self) -> str | None: ...

    def sid(self) -> int: ...


class RequestTrace(Protocol):
    """What the encoder reads of a finished request trace (:class:`gateway.observability.telemetry.RequestTrace`
    is one): ids, W3C trace state ("" when none), span name, start in ns, finished steps and events."""

    @property
    def trace_id(self) -> int: ...

    @property
    def span_id(self) -> int: ...

    @property
    def parent_id(self) -> int | None: ...

    @property
    def remote(self) -> bool: ...

    @property
    def trace_state(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def start(self) -> int: ...

    @property
    def steps(self) -> Sequence[Step]: ...

    @property
    def events(self) -> Sequence[tuple[int, str, Mapping[str, Any]]]: ...

_RETRY = {429, 502, 503, 504}
_PACK_Q = struct.Struct("<Q").pack
_PACK_D = struct.Struct("<d").pack
# SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE, and IS_REMOTE for a client's parent (as the SDK's encoder writes them)
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)
_STATUS_UNSET = b"\x7a\x00"


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


class _Cache(dict[Any, bytes]):
    """A bounded memo (cleared past 4096 entries): span names, attribute keys, low-cardinality values."""

    def put(self, k: Any, v: bytes) -> bytes:
        if len(self) > 4096:
            self.clear()
        self[k] = v
        return v


_KEYS = _Cache()  # attribute key → its encoded ``key`` field
_KVS = _Cache()  # (key, str or bool value) → the encoded KeyValue body (values that repeat: tier, model, …)
_NAMES = _Cache()  # span name → its encoded ``name`` field
_UNIQUE = frozenset({"thinkgate.request_id"})  # string values never worth caching


def _key(k: str) -> bytes:
    return _KEYS.get(k) or _KEYS.put(k, _str(b"\x0a", k))


def _name(name: str) -> bytes:
    return _NAMES.get(name) or _NAMES.put(name, _str(b"\x2a", name))


_KV_HEAD = _Cache()  # attribute key → the KeyValue's ``key`` field and the ``value`` tag


def _kv_int(k: str, v: int) -> bytes:
    head = _KV_HEAD.get(k) or _KV_HEAD.put(k, _str(b"\x0a", k) + b"\x12")
    if 0 <= v < 0x80:
        return head + bytes((2, 0x18, v))
    value = b"\x18" + _varint(v)
    return head + _varint(len(value)) + value


def _attributes(tag: bytes, attrs: Mapping[str, Any]) -> bytes:
    # KeyValue: key=1, value=2 (an AnyValue), each a repeated field ``tag`` of the enclosing message
    out = []
    for k, v in attrs.items():
        t = v.__class__
        if t is int:
            kv = _kv_int(k, v)
        elif t is float:
            kv = (_KV_HEAD.get(k) or _KV_HEAD.put(k, _str(b"\x0a", k) + b"\x12")) + b"\x09\x21" + _PACK_D(v)
        elif (t is str or t is bool) and k not in _UNIQUE:
            kv = _KVS.get((k, v)) or _KVS.put((k, v), _key(k) + _len(b"\x12", _any_value(v)))
        else:
            kv = _key(k) + _len(b"\x12", _any_value(v))
        out.append(tag + _varint(len(kv)) + kv)
    return b"".join(out)


def _status(code: int, message: str) -> bytes:
    # Status: message=2, code=3 (UNSET=0, OK=1, ERROR=2 in both the API and the proto)
    if not code and not message:
        return _STATUS_UNSET
    return _len(b"\x7a", (_str(b"\x12", message) if message else b"") + (b"\x18" + _varint(code) if code else b""))


_FRAMES = _Cache()  # a Span's length → its ``ScopeSpans.spans`` field tag and length
_TIMES = struct.Struct("<BBBQBQ").pack  # kind field, then start and end (fixed64)


def _frame_of(n: int) -> bytes:
    return _FRAMES.get(n) or _FRAMES.put(n, b"\x12" + _varint(n))


def _step_span(head: bytes, parent: bytes, step: Step) -> bytes:
    # trace id, span id, [trace state], parent (the request span), name, kind (INTERNAL = 1; CLIENT = 3 for the call
    # to the upstream, which propagates traceparent: service graphs pair it with the upstream's SERVER span),
    # times, status, flags
    name = _name(step.name)
    times = _TIMES(0x30, 3 if step.name == CLIENT_STEP else 1, 0x39, step.start, 0x41, step.end)
    tail = _status(2, step.error) + _FLAGS_LOCAL if step.error else _STEP_TAIL
    n = len(head) + 8 + len(parent) + len(name) + 20 + len(tail)  # 20: the packed kind and times
    return b"".join((_frame_of(n), head, step.sid().to_bytes(8, "big"), parent, name, times, tail))


_STEP_TAIL = _STATUS_UNSET + _FLAGS_LOCAL


def _heads(trace: RequestTrace) -> tuple[bytes, bytes]:
    """(trace id field + the span-id tag, trace state field + the request span as parent field) — the
    fields before and after a child span's id."""
    head = b"\x0a\x10" + trace.trace_id.to_bytes(16, "big") + b"\x12\x08"
    state = _str(b"\x1a", trace.trace_state) if trace.trace_state else b""
    return head, state + b"\x22\x08" + trace.span_id.to_bytes(8, "big")


def encode_trace(trace: RequestTrace, attrs: Mapping[str, Any], code: int, message: str, end: int) -> bytes:
    """A finished trace as ``Span`` messages, each framed as a ``ScopeSpans.spans`` field: its steps, then the
    request span (``SERVER``, ``attrs``, events, status ``code``/``message``, ended at ``end`` ns)."""
    head, as_parent = _heads(trace)
    out = [_step_span(head, as_parent, s) for s in trace.steps]
    root = [head, trace.span_id.to_bytes(8, "big")]
    if trace.trace_state:
        root.append(_str(b"\x1a", trace.trace_state))
    if trace.parent_id is not None:
        root.append(b"\x22\x08" + trace.parent_id.to_bytes(8, "big"))
    root += (_name(trace.name), _TIMES(0x30, 2, 0x39, trace.start, 0x41, end), _attributes(b"\x4a", attrs))
    for ts, name, ev_attrs in trace.events:  # Event: time_unix_nano=1, name=2, attributes=3
        root.append(_len(b"\x5a", b"\x09" + _PACK_Q(ts) + _str(b"\x12", name) + _attributes(b"\x1a", ev_attrs)))
    root += (_status(code, message), _FLAGS_REMOTE if trace.remote else _FLAGS_LOCAL)
    span = b"".join(root)
    out.append(_frame_of(len(span)) + span)
    return b"".join(out)


def encode_step(trace: RequestTrace, step: Step) -> bytes:
    """One step as a framed ``Span`` (a step that outlived its request span)."""
    head, as_parent = _heads(trace)
    return _step_span(head, as_parent, step)


def frame(resource_attrs: Mapping[str, Any], scope: str, spans: bytes) -> bytes:
    """An ``ExportTraceServiceRequest`` of one resource and one instrumentation scope around framed ``spans``."""
    scope_spans = _len(b"\x0a", _str(b"\x0a", scope)) + spans
    resource = _len(b"\x0a", _attributes(b"\x0a", resource_attrs))
    return _len(b"\x0a", resource + _len(b"\x12", scope_spans))


class OtlpBatchExporter:
    """The OTLP/HTTP :class:`~gateway.observability.telemetry.SpanSink`: a finished trace is queued as it is (its
    ids, step times and attributes: a handful of objects), and a daemon thread encodes each batch in one go and POSTs it
    to ``endpoint`` over a kept-alive connection (see the module doc). ``exported`` / ``dropped``: spans so far.

    Why encode in the thread, a batch at a time: measured in the gateway under load, the same encoder costs
    about twice as much CPU interleaved with request handling (its code and caches cold every time) as in a
    tight loop over a batch."""

    def __init__(self, endpoint: str, resource_attrs: Mapping[str, Any], scope: str,
                 headers: Mapping[str, str] | None = None, timeout_s: float = 10.0, *,
                 max_export_batch_size: int = 2048, max_queue_size: int = 8192,
                 schedule_delay_s: float = 5.0) -> None:
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"telemetry.otlp_endpoint must be an http(s) URL, got {endpoint!r}")
        self.endpoint = endpoint
        self._url = url
        self.headers = {"Content-Type": "application/x-protobuf", **(headers or {})}
        self.timeout_s = timeout_s
        self.batch = max_export_batch_size
        self.max_queue = max_queue_size
        self.delay_s = schedule_delay_s
        self._resource = dict(resource_attrs)
        self._scope = scope
        self._queue: list[tuple[Any, ...]] = []  # (trace, attrs, code, message, end) or (trace, step)
        self._queued = 0  # spans in _queue
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._conn: http.client.HTTPConnection | None = None
        self.exported = 0
        self.dropped = 0
        self._warned = 0.0
        self._thread = threading.Thread(target=self._run, name="thinkgate-otlp-export", daemon=True)
        self._thread.start()

    def _add(self, item: tuple[Any, ...], n: int) -> None:
        full = drop = False
        with self._lock:
            if self._stop or self._queued + n > self.max_queue:
                self.dropped += n
                drop = True
            else:
                self._queue.append(item)
                self._queued += n
                full = self._queued >= self.batch
        if drop:
            now = time.monotonic()
            if now - self._warned > 60:
                self._warned = now
                log.warning("OTLP export queue full or stopped: %d spans dropped so far", self.dropped)
        elif full and not self._wake.is_set():
            self._wake.set()

    def trace_ended(self, trace: RequestTrace, attrs: Mapping[str, Any], code: int, message: str,
                    end: int) -> None:
        self._add((trace, attrs, code, message, end), len(trace.steps) + 1)

    def step_ended(self, trace: RequestTrace, step: Step) -> None:
        self._add((trace, step), 1)

    def _take(self) -> tuple[list[tuple[Any, ...]], int]:
        with self._lock:
            items, n = self._queue, self._queued
            self._queue, self._queued = [], 0
        return items, n

    def _run(self) -> None:
        while True:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            items, n = self._take()
            if n:
                spans = b"".join([encode_trace(*it) if len(it) == 5 else encode_step(*it) for it in items])
                del items
                self._post(frame(self._resource, self._scope, spans), n)
            if self._stop:
                if self._conn is not None:
                    self._conn.close()
                return

    def _send(self, body: bytes, timeout: float) -> int:
        """POST ``body`` on the kept-alive connection (a new one when there is none or it broke); the status."""
        conn = self._conn
        if conn is None:
            cls = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
            conn = self._conn = cls(self._url.hostname or "", self._url.port, timeout=timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        path = self._url.path or "/"
        if self._url.query:
            path += "?" + self._url.query
        try:
            conn.request("POST", path, body=body, headers=self.headers)
            r = conn.getresponse()
            r.read()
        except BaseException:
            conn.close()
            self._conn = None
            raise
        if r.will_close:
            conn.close()
            self._conn = None
        return r.status

    def _post(self, body: bytes, n: int) -> bool:
        deadline = time.monotonic() + self.timeout_s
        delay = 0.5
        while True:
            try:
                status = self._send(body, max(0.1, deadline - time.monotonic()))
                if 200 <= status < 300:
                    self.exported += n
                    return True
                if status not in _RETRY:
                    log.warning("OTLP export refused: HTTP %s (%d spans dropped)", status, n)
                    self.dropped += n
                    return False
                why = f"HTTP {status}"
            except (http.client.HTTPException, OSError) as exc:
                why = type(exc).__name__
            # past the deadline, or shutting down and already retried once: give up rather than hold the stop
            if time.monotonic() + delay > deadline or (self._stop and delay > 0.5):
                log.warning("OTLP export failed: %s (%d spans dropped)", why, n)
                self.dropped += n
                return False
            time.sleep(delay)
            delay *= 2

    def shutdown(self) -> None:
        """Export what is queued (one last batch, within ``timeout_s``) and stop the thread."""
        with self._lock:
            self._stop = True
        self._wake.set()
        self._thread.join(self.timeout_s + 1)
