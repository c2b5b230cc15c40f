"""The settings tree: one typed model for the whole product.

Sources, highest priority first: keyword arguments, ``THINKGATE_*`` environment variables (nested
fields joined by ``__``, e.g. ``THINKGATE_SERVER__PORT=9000``), the YAML file given by ``--config`` or
``THINKGATE_CONFIG``, then the embedded defaults below (the local vLLM engine serving the shipped model,
three tiers ``none``/``short``/``long``). ``REDIS_URL`` is honoured as an alias of ``redis.url``.

Units: token counts are tokens; prices are USD per 1M tokens (``Decimal``); durations are seconds.
Invalid configuration raises :class:`ConfigError` whose message names the offending field.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from gateway.config.api import DashboardConfig, ResponsesConfig
from gateway.config.auth import AuthConfig
from gateway.config.base import ConfigError
from gateway.config.cache import CacheConfig
from gateway.config.engine import EngineConfig
from gateway.config.limits import LimitsConfig
from gateway.config.metering import MeteringConfig
from gateway.config.observability import MetricsConfig, TelemetryConfig
from gateway.config.redis import RedisConfig
from gateway.config.routing import RoutingConfig
from gateway.config.server import ServerConfig
from gateway.config.tiers import TierConfig, _default_tiers

#: The YAML file of the :meth:`Settings.load` call in progress (a context variable: loads on several threads or
#: nested loads do not see each other's file).
_YAML_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("thinkgate_yaml_file", default=None)


class Settings(BaseSettings):
    """The whole configuration. Build with :meth:`Settings.load`."""

    model_config = SettingsConfigDict(env_prefix="THINKGATE_", env_nested_delimiter="__", extra="forbid", frozen=True)

    server: ServerConfig = Field(default_factory=ServerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    tiers: list[TierConfig] = Field(default_factory=_default_tiers)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    metering: MeteringConfig = Field(default_factory=MeteringConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        yaml_file = _YAML_FILE.get()
        if yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)

    @model_validator(mode="after")
    def _cross_check(self) -> Settings:
        # A tier that names no upstream (the embedded defaults, or a configured tier without base_url/base_urls)
        # is served by the embedded engine: it follows engine.host/port (moving the engine to another port left
        # such tiers on 8001, and every request failed with 502). A tier that names its upstream is as written.
        url = f"http://{self.engine.host}:{self.engine.port}/v1"
        object.__setattr__(self, "tiers", [
            t if t.base_urls or "base_url" in t.model_fields_set else t.model_copy(update={"base_url": url})
            for t in self.tiers])
        names = _tier_names(self.tiers)
        _check_routing(self.routing, names)
        embedder = self.cache.semantic.embedder
        if embedder.startswith("openai:") and embedder.removeprefix("openai:") not in names:
            raise ValueError(f"cache.semantic.embedder: unknown tier {embedder.removeprefix('openai:')!r} "
                             f"(tiers: {names})")
        r = self.routing
        if r.thresholds is not None and len(r.thresholds) != len(r.routed_tiers) - 1:
            raise ValueError("routing.thresholds: need exactly len(routed_tiers) - 1 values")
        for k in self.auth.keys:
            _known(f"auth.keys.{k.id}.allowed_tiers", k.allowed_tiers or (), names)
        return self

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``; raises KeyError if there is none."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> Settings:
        """Build the settings from ``path`` (or ``$THINKGATE_CONFIG``), the environment and ``overrides``.

        Raises :class:`ConfigError` naming each invalid field, or when the file is missing/unreadable.
        """
        path = path or os.environ.get("THINKGATE_CONFIG")
        yaml_path = Path(path) if path else None
        if yaml_path is not None and not yaml_path.is_file():
            raise ConfigError(f"config file not found: {yaml_path}")
        # an exported but empty REDIS_URL is no URL: it used to override the config file's with '' ("unsupported
        # scheme ''") — a shell's `REDIS_URL= thinkgate …` or a blank Kubernetes env var
        if os.environ.get("REDIS_URL", "").strip() and "THINKGATE_REDIS__URL" not in os.environ:
            overrides.setdefault("redis", {}).setdefault("url", os.environ["REDIS_URL"].strip())
        token = _YAML_FILE.set(yaml_path)
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise ConfigError(_describe(exc, yaml_path)) from None
        except SettingsError as exc:  # an environment variable pydantic-settings cannot parse (a list or a
            # mapping must be JSON there): name it, as for any other invalid setting
            raise ConfigError(f"invalid configuration: {exc}; a list or mapping in an environment variable is "
                              f"JSON, e.g. THINKGATE_SERVER__CORS_ALLOW_ORIGINS='[\"https://app.example\"]'"
                              ) from None
        finally:
            _YAML_FILE.reset(token)


def _describe(exc: ValidationError, path: Path | None) -> str:
    where = f" in {path}" if path else ""
    lines = [f"invalid configuration{where}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def _known(field: str, tiers: Iterable[str], names: list[str]) -> None:
    """Raise ValueError naming ``field`` for the first of ``tiers`` not among the tier ``names``."""
    for t in tiers:
        if t not in names:
            raise ValueError(f"{field}: unknown tier {t!r} (tiers: {names})")


def _tier_names(tiers: list[TierConfig]) -> list[str]:
    """The tier names in order; raises ValueError when there are none, duplicates, or the reserved ``auto``."""
    names = [t.name for t in tiers]
    if not names:
        raise ValueError("tiers: at least one tier is required")
    if len(set(names)) != len(names):
        raise ValueError(f"tiers: names must be unique, got {names}")
    if "auto" in names:
        raise ValueError("tiers: 'auto' is reserved for routed requests")
    return names


def _check_routing(r: RoutingConfig, names: list[str]) -> None:
    """Check ``routing``'s tier names against ``names`` (raises ValueError naming the field); fits the default
    ``effort_tiers`` to the tiers there are (in place: the frozen model is resolved once, during validation)."""
    _known("routing.routed_tiers", r.routed_tiers, names)
    _known("routing.default_tier", [r.default_tier], names)
    if "effort_tiers" not in r.model_fields_set:
        # The embedded default names the none/short/long tiers; with other tiers (e.g. only short and long on
        # GPUs) each effort falls back to the cheapest (none, minimal, low) or the top routed tier instead of
        # refusing a config that never mentioned effort. An explicit map is checked as written.
        cheap, top = r.routed_tiers[0], r.routed_tiers[-1]
        fitted = {e: t if t in names else (cheap if e in ("none", "minimal", "low") else top)
                  for e, t in r.effort_tiers.items()}
        object.__setattr__(r, "effort_tiers", fitted)
    for effort, t in r.effort_tiers.items():
        _known(f"routing.effort_tiers.{effort}", [t], names)
