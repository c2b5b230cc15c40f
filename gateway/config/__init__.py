"""The settings tree, one module per owner (the ``vllm/config/`` pattern); :class:`Settings` composes them.

=====================  =========================================================================================
module                 models (the top-level key they configure)
=====================  =========================================================================================
``settings``           :class:`Settings` (sources: kwargs > ``THINKGATE_*`` env > YAML > defaults), the
                       cross-field checks, :meth:`Settings.load`
``server``             ``server:`` :class:`ServerConfig`
``engine``             ``engine:`` :class:`EngineConfig` (the embedded dev vLLM)
``tiers``              ``tiers:`` :class:`TierConfig`, :class:`Prices`, :class:`LoopGuard`,
                       :class:`UpstreamPoolConfig`, :func:`prompted_hard_stop`, the default tiers
``routing``            ``routing:`` :class:`RoutingConfig` and the control loop's :class:`RoutingTargetConfig`,
                       :class:`OutcomesConfig`, :class:`ShadowConfig`, :class:`DriftConfig`
``redis``              ``redis:`` :class:`RedisConfig`
``cache``              ``cache:`` :class:`CacheConfig`, :class:`SemanticCacheConfig`
``metering``           ``metering:`` :class:`MeteringConfig`
``auth``               ``auth:`` :class:`AuthConfig`, :class:`KeyConfig`
``limits``             ``limits:`` :class:`LimitsConfig`, :class:`LevelBudget`
``api``                ``dashboard:`` :class:`DashboardConfig`, ``responses:`` :class:`ResponsesConfig`
``observability``      ``telemetry:`` :class:`TelemetryConfig`, ``metrics:`` :class:`MetricsConfig`
``paths``              :data:`DEFAULT_MODEL_DIR` (in :data:`MODELS_DIR`, a checkout's ``models/``),
                       :data:`DEFAULT_ROUTER_PATH`, :data:`STATE_DIR`, :func:`missing_model`
``base``               :class:`ConfigError`, the strict frozen base model
=====================  =========================================================================================

Every name is re-exported here: ``from gateway.config import TierConfig`` is the way to import one.
"""

from gateway.config.api import DashboardConfig, ResponsesConfig
from gateway.config.auth import AuthConfig, KeyConfig
from gateway.config.base import ConfigError
from gateway.config.cache import CacheConfig, SemanticCacheConfig
from gateway.config.engine import EngineConfig
from gateway.config.limits import LevelBudget, LimitsConfig
from gateway.config.metering import MeteringConfig
from gateway.config.observability import MetricsConfig, TelemetryConfig
from gateway.config.paths import DEFAULT_MODEL_DIR, DEFAULT_ROUTER_PATH, MODELS_DIR, STATE_DIR, missing_model
from gateway.config.redis import RedisConfig
from gateway.config.routing import (
    MAX_REQUEST_TTL_S,
    OUTCOMES_SEEN_TTL_S,
    DriftConfig,
    OutcomesConfig,
    RetrainConfig,
    RoutingConfig,
    RoutingTargetConfig,
    ShadowConfig,
)
from gateway.config.server import ServerConfig
from gateway.config.settings import Settings
from gateway.config.tiers import (
    LoopGuard,
    Prices,
    TierConfig,
    UpstreamPoolConfig,
    _default_tiers,
    prompted_hard_stop,
    unpriced_tiers,
)

__all__ = [
    "DEFAULT_MODEL_DIR",
    "DEFAULT_ROUTER_PATH",
    "MAX_REQUEST_TTL_S",
    "MODELS_DIR",
    "OUTCOMES_SEEN_TTL_S",
    "STATE_DIR",
    "AuthConfig",
    "CacheConfig",
    "ConfigError",
    "DashboardConfig",
    "DriftConfig",
    "EngineConfig",
    "KeyConfig",
    "LevelBudget",
    "LimitsConfig",
    "LoopGuard",
    "MeteringConfig",
    "MetricsConfig",
    "OutcomesConfig",
    "Prices",
    "RedisConfig",
    "ResponsesConfig",
    "RetrainConfig",
    "RoutingConfig",
    "RoutingTargetConfig",
    "SemanticCacheConfig",
    "ServerConfig",
    "Settings",
    "ShadowConfig",
    "TelemetryConfig",
    "TierConfig",
    "UpstreamPoolConfig",
    "_default_tiers",
    "missing_model",
    "prompted_hard_stop",
    "unpriced_tiers",
]
