"""The HTTP server (``server:``): bind address, body size, log level.
"""

from __future__ import annotations

from pydantic import Field

from gateway.config.base import _Strict


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(1_000_000, ge=1)
    log_level: str = "info"

