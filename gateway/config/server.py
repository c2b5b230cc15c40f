"""The HTTP server (``server:``): bind address, body size, log level, the garbage collector's thresholds.
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
    #: request at concurrency 32 (bench/RESULTS.md, "CPU per request"). ``null``: Python's defaults.
    gc_thresholds: tuple[int, int, int] | None = (20000, 50, 100)

    @field_validator("gc_thresholds")
    @classmethod
    def _positive(cls, v: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if v is not None and min(v) < 1:
            raise ValueError("gc_thresholds: three integers >= 1 (or null for Python's defaults)")
        return v

