"""The root of ThinkGate's library errors, and the one-line answer when an optional extra is missing.

Library code (gateway, router, training) raises subclasses of :class:`ThinkGateError` — a bad configuration, an
unreadable router file, an unreachable Redis, a missing extra — so an embedder catches "ours" in one place. The
errors that become HTTP responses are the separate ``gateway.errors.GatewayError`` hierarchy. This module lives in
the lowest package so every package may import it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Import name → distribution name, where they differ.
_DISTRIBUTION = {"math_verify": "math-verify", "yaml": "pyyaml"}


class ThinkGateError(Exception):
    """Base class of ThinkGate's library (non-HTTP) errors."""


class MissingExtra(ThinkGateError, ImportError):
    """An optional dependency is not installed; the message says which extra to install, in one line, e.g.
    ``thinkgate usage export --format parquet needs pyarrow: pip install 'thinkgate[report]'``."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtra` naming ``what`` needs it and the ``extra`` that provides it.

    ``extra`` is one of the distribution's extras (``eval``, ``report``, ``train``, ``engine-cpu``, ``dev``).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.partition(".")[0]
        dist = _DISTRIBUTION.get(top, top)
        raise MissingExtra(f"{what} needs {dist}: pip install 'thinkgate[{extra}]'") from exc
