"""What every config model shares: the strict frozen base and :class:`ConfigError`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from router.errors import ThinkGateError


class ConfigError(ThinkGateError, ValueError):
    """Raised when the configuration is invalid; the message names each offending field."""


class _Strict(BaseModel):
    # Frozen: the settings are built once (Settings.load) and never edited; an override is a model_copy(update=…).
    model_config = ConfigDict(extra="forbid", frozen=True)

