"""The embedded dev engine (``engine:``): a vLLM server on loopback serving the local model (``gateway/engine/``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from gateway.config.base import _Strict
from gateway.config.paths import DEFAULT_MODEL_DIR


class EngineConfig(_Strict):
    """The embedded upstream: a vLLM OpenAI server on loopback serving the local model."""

    enabled: bool = True
    model_path: Path = DEFAULT_MODEL_DIR
    served_model_name: str = "thinkgate-tiny"
    host: str = "127.0.0.1"
    port: int = Field(8001, ge=1, le=65535)
    kv_cache_gib: int = Field(1, ge=1)
    cpu_threads_bind: str = "0-1"
    reasoning_parser: str = "qwen3"
    dtype: str = "float32"
    max_model_len: int = Field(2048, ge=64)
    startup_timeout_s: float = Field(300.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)

