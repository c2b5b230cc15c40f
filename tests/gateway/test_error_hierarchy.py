"""The two error hierarchies: every HTTP error (GatewayError) in gateway/errors.py with one ``status``; every
library error under ThinkGateError."""

from __future__ import annotations

import importlib
import pkgutil

import orjson

import gateway
from gateway import errors
from gateway.api import errors as api_errors
from gateway.errors import GatewayError, ThinkGateError, UpstreamError, UpstreamRejected, UpstreamTimeout


def _all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_all_subclasses(sub)}
    return out


def test_every_gateway_error_lives_in_gateway_errors() -> None:
    for mod in pkgutil.walk_packages(gateway.__path__, "gateway."):
        if mod.name.endswith("__main__"):
            continue
        importlib.import_module(mod.name)
    found = {c for c in _all_subclasses(GatewayError) if c.__module__.startswith("gateway.")}
    elsewhere = sorted(f"{c.__module__}.{c.__qualname__}" for c in found if c.__module__ != "gateway.errors")
    assert elsewhere == []
    assert len(found) >= 15
    assert {c.__name__ for c in found} <= set(errors.__all__)


def test_status_is_one_instance_attribute() -> None:
    assert UpstreamRejected("x", status=404).status == 400
    rejected = UpstreamRejected("slow down", status=429)
    assert rejected.status == 429 and not hasattr(rejected, "status_code")
    assert orjson.loads(rejected.to_json())["error"]["type"] == "rate_limit_error"
    assert api_errors.error_response(rejected).status_code == 429
    assert api_errors.error_response(errors.LimitsUnavailable("down")).status_code == 503
    assert GatewayError("x", status=418).status == 418 and GatewayError("x").status == 500


def test_upstream_timeout_is_an_upstream_error() -> None:
    assert issubclass(UpstreamTimeout, UpstreamError) and issubclass(errors.UpstreamConnectTimeout, UpstreamTimeout)
    exc = UpstreamTimeout("late")
    assert (exc.status, exc.type, exc.code) == (504, "upstream_error", "upstream_timeout")


def test_library_errors_share_thinkgate_error() -> None:
    from gateway.auth.redis_store import KeyExists
    from gateway.config import ConfigError
    from gateway.engine.redis_server import RedisUnavailable
    from gateway.engine.vllm import EngineError
    from gateway.ledger.export import ExportError
    from gateway.state.breaker import RedisDown
    from router.errors import MissingExtra
    from router.persistence import RouterFileError
    from router.probe import ProbeError
    from router.serving import RouterUnavailable

    for cls in (ConfigError, EngineError, RedisUnavailable, RedisDown, ExportError, KeyExists, RouterFileError,
                RouterUnavailable, MissingExtra, ProbeError):
        assert issubclass(cls, ThinkGateError), cls
        assert not issubclass(cls, GatewayError), cls
    assert issubclass(ConfigError, ValueError) and issubclass(RedisDown, RuntimeError)  # as before, for callers
