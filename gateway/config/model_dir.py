"""Serve a model directory with the embedded engine: ``thinkgate serve --model-dir DIR`` and
``thinkgate bench savings --model-dir DIR``.

A **dial model** directory (one with ``dial.json``: ``{"budget_prompt", "budget_range"?: [min, max],
"tiers": {name: budget|null},
"served_model_name"?, "router"?: FILE}``, written by ``python -m training.tiny.dial_card``) is served under its own
name (``served_model_name``, else the directory's: ``engine.served_model_name`` and the ``model`` of every tier that
named the engine's model), serves every tier it names with ``budget_mode: prompted``, its prompt format and its
per-tier budget (0: thinking off, ``budget_mode: off``; null: unlimited) — with ``hard_stop: native`` on the
embedded engine's tiers (vLLM cuts an overrun in one pass) and its ``budget_range`` (``[min, max]``, the budgets
the model was trained to follow) as their ``thinking_budget_range``, so a budget asked outside it is served at the
nearest end and said so (``x-thinkgate-thinking-budget``) —, and its ``router`` (a router file beside it
that maps the score to a thinking budget, ``thinkgate train dial-router``) as ``routing.router_path``. Any other
directory only replaces ``engine.model_path``: same served name and tiers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.config.base import ConfigError
from gateway.config.settings import Settings


def with_model_dir(settings: Settings, model_dir: Path) -> Settings:
    """``settings`` serving ``model_dir`` (module doc). Raises ConfigError when it is not a model directory or its
    ``dial.json`` is unreadable."""
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model-dir {model_dir}: not a model directory (no config.json)")
    out = settings.model_copy(update={"engine": settings.engine.model_copy(
        update={"model_path": model_dir.resolve()})})
    return dial_tiers(out, model_dir)


def dial_tiers(settings: Settings, model_dir: Path) -> Settings:
    """The dial settings of ``model_dir`` applied to ``settings`` (module doc); unchanged without ``dial.json``."""
    path = model_dir / "dial.json"
    if not path.is_file():
        return settings
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    budgets = spec.get("tiers") or {}
    span = _budget_range(spec, path)
    served = str(spec.get("served_model_name") or model_dir.resolve().name)
    engine_name = settings.engine.served_model_name
    tiers = []
    for t in settings.tiers:
        update: dict[str, Any] = {"model": served} if t.model == engine_name else {}
        # the embedded engine is vLLM: its own thinking_token_budget is the hard stop, one pass (forcing's phase 2
        # would bill the prompt again); a tier on some other upstream keeps forcing
        native = "native" if settings.engine.enabled and t.model == engine_name else "forced"
        if t.name in budgets:
            b = budgets[t.name]
            if span is not None and b not in (0, None) and not span[0] <= b <= span[1]:
                raise ConfigError(f"{path}: tier {t.name!r}'s budget {b} is outside its budget_range {list(span)}")
            update.update(
                {"budget_mode": "off", "thinking_budget": 0, "enable_thinking": False} if b == 0  # the direct mode
                else {"budget_mode": "prompted", "budget_prompt": spec["budget_prompt"], "thinking_budget": b,
                      "enable_thinking": True, "hard_stop": native, "thinking_budget_range": span})
        tiers.append(t.model_copy(update=update) if update else t)
    out = settings.model_copy(update={"tiers": tiers, "engine": settings.engine.model_copy(
        update={"served_model_name": served})})
    router = spec.get("router")
    if router and (model_dir / router).is_file():
        out = out.model_copy(update={"routing": out.routing.model_copy(
            update={"router_path": (model_dir / router).resolve()})})
    return out


def _budget_range(spec: dict[str, Any], path: Path) -> tuple[int, int] | None:
    """``dial.json``'s ``budget_range`` (the budgets the model was trained to follow) as ``(min, max)``; None when
    it has none. Raises ConfigError for anything but two integers 1 <= min <= max."""
    r = spec.get("budget_range")
    if r is None:
        return None
    if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            or not 1 <= r[0] <= r[1]):
        raise ConfigError(f"{path}: budget_range must be [min, max], integers with 1 <= min <= max, got {r!r}")
    return r[0], r[1]
