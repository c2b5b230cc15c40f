"""API keys (``auth:``): configured keys and the dev key (``gateway/auth/``).
"""

from __future__ import annotations

import hashlib
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from gateway.config.base import _Strict
from gateway.config.paths import STATE_DIR


class KeyConfig(_Strict):
    """An API key declared in the config file. Give ``secret_sha256`` (hex) — or ``secret`` for local
    development, which is hashed at load and never kept.

    Policy: ``allowed_tiers`` (None = all) with ``on_disallowed_tier`` (``refuse`` → 403 naming the allowed
    tiers; ``downgrade`` → the most capable allowed tier below the one asked for); ``max_thinking_budget``
    (tokens) caps the thinking budget of every request of the key; ``over_cap``: a ``max_tokens`` above the
    tier's cap or a ``thinking_token_budget`` above the key's is clamped (default) or refused (400)."""

    id: str = Field(pattern=r"^[A-Za-z0-9_.:-]+$")
    secret: str | None = None
    secret_sha256: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    budget_usd_day: Decimal | None = Field(None, ge=0)
    budget_usd_month: Decimal | None = Field(None, ge=0)
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    cache_namespace: str | None = None
    allowed_tiers: list[str] | None = None
    on_disallowed_tier: Literal["refuse", "downgrade"] = "refuse"
    max_thinking_budget: int | None = Field(None, ge=0)
    over_cap: Literal["clamp", "refuse"] = "clamp"

    @model_validator(mode="before")
    @classmethod
    def _hash_secret(cls, data: Any) -> Any:
        # The plain secret is hashed before the (frozen) model exists and never kept.
        if isinstance(data, dict) and isinstance(data.get("secret"), str):
            data = {**data, "secret_sha256": hashlib.sha256(data["secret"].encode()).hexdigest(), "secret": None}
        return data

    @model_validator(mode="after")
    def _has_secret(self) -> KeyConfig:
        if not self.secret_sha256:
            raise ValueError(f"key {self.id!r} needs secret or secret_sha256")
        return self


class AuthConfig(_Strict):
    """``key_cache_s``: how long a key found in the Redis store is trusted without asking again (revocation
    takes effect within it); ``key_stale_s``: how long a known key keeps working while Redis is down."""

    require_key: bool = True
    admin_key_sha256: str | None = None
    keys: list[KeyConfig] = Field(default_factory=list)
    dev_key_file: Path = STATE_DIR / "dev-key"
    key_cache_s: float = Field(5.0, ge=0)
    key_stale_s: float = Field(3600.0, ge=0)
    #: set by ``thinkgate serve`` when ``keys`` holds only the development key it made (no client of a fleet holds
    #: that one: ``/ready`` does not count it as a key of the replica's own)
    dev_key_only: bool = False

