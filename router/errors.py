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


#: What ``pip install`` is told to install an extra from. ThinkGate is on no package index (README "Install the
#: product alone": build the wheel, install that file), so ``pip install 'thinkgate[report]'`` named a project pip
#: cannot find; an extra comes from the same wheel file or checkout ThinkGate was installed from.
INSTALL_SOURCE = "<the thinkgate wheel or checkout>"


def install_hint(extra: str | None = None) -> str:
    """The one wording of how to install ThinkGate's optional ``extra`` (None: ThinkGate itself), for every one-line
    message that asks for it: ``install the 'report' extra: pip install '<the thinkgate wheel or checkout>[report]'``
    — e.g. ``'dist/thinkgate-0.1.0-py3-none-any.whl[report]'`` or, in a checkout, ``'.[report]'``."""
    if extra is None:
        return f"install thinkgate: pip install '{INSTALL_SOURCE}'"
    return f"install the {extra!r} extra: pip install '{INSTALL_SOURCE}[{extra}]'"


class MissingExtra(ThinkGateError, ImportError):
    """An optional dependency is not installed; the message says which extra to install, in one line, e.g.
    ``thinkgate usage export --format parquet needs pyarrow; install the 'report' extra: pip install
    '<the thinkgate wheel or checkout>[report]'`` (:func:`install_hint`)."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtra` naming ``what`` needs it and the ``extra`` that provides it.

    ``extra`` is one of the distribution's extras (``eval``, ``report``, ``train``, ``engine-cpu``, ``dev``).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.partition(".")[0]
        dist = _DISTRIBUTION.get(top, top)
        raise MissingExtra(f"{what} needs {dist}; {install_hint(extra)}") from exc
