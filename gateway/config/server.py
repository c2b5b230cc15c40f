"""The HTTP server (``server:``): bind address, body size, log level, the garbage collector's thresholds, CORS,
slow-client timeouts.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.base import _Strict


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(1_000_000, ge=1)
    log_level: str = "info"
    #: ``gc.set_threshold`` of the serving process, set once the startup heap is frozen (``gateway.app``): a
    #: request allocates a few thousand short-lived containers, and with Python's default first threshold (700)
    #: the young generation is collected several times per request. 20000/50/100 measured 3–5% less CPU per
    #: request at concurrency 32 (bench/RESULTS.md, "ThinkGate vs LiteLLM", the 23:01 reading). ``null``: Python's
    #: defaults.
    gc_thresholds: tuple[int, int, int] | None = (20000, 50, 100)
    #: browser origins allowed to call the API (CORS, Starlette's middleware: preflight answered, the gateway's
    #: headers exposed); ``["*"]`` any origin (LiteLLM's default). Empty (the default): no CORS headers, and the
    #: generation endpoints keep their direct dispatch (``gateway/api/asgi.py``), which a middleware would undo
    cors_allow_origins: list[str] = Field(default_factory=list)
    #: ``/ready`` for a replica that has never reached Redis since it started, under ``limits.on_redis_down:
    #: fail_open`` (gateway/api/ops.py): ``null`` (auto) — not ready unless the config holds keys of its own (it
    #: can serve those); ``true`` — never ready (clients on keys of the Redis store, config keys only for ops: a
    #: rolling update during an outage then waits on warm replicas); ``false`` — ready, degraded
    ready_requires_redis_sync: bool | None = None
    #: slow clients (slowloris; ``gateway/api/slow_clients.py``): the request line and headers must be in within
    #: ``request_head_timeout_s`` of the connection opening (or of the request's first byte on a kept-alive one),
    #: the whole body within ``request_body_timeout_s`` of the head — else 408 and the connection is closed. The
    #: bounds are on the whole head and body, not per read (a byte every few seconds passes a per-read timeout)
    request_head_timeout_s: float = Field(10.0, gt=0)
    request_body_timeout_s: float = Field(60.0, gt=0)
    #: how long an idle kept-alive connection stays open between requests (uvicorn's ``timeout_keep_alive``)
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    #: at most this many connections or requests in flight; beyond, uvicorn answers 503 (null: no cap)
    limit_concurrency: int | None = Field(None, ge=1)

    @field_validator("gc_thresholds", mode="before")
    @classmethod
    def _three_positive(cls, v: object) -> object:
        # before pydantic's own tuple check, whose message for a short list is "gc_thresholds.2: Field required"
        ok = v is None or (isinstance(v, list | tuple) and len(v) == 3
                           and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v))
        if not ok:
            raise ValueError(f"expected three integers >= 1 (generations 0, 1, 2, e.g. [20000, 50, 100]) or null for "
                             f"Python's defaults, got {v!r}")
        return v

