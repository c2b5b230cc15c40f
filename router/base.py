"""The router interface: one method returning a difficulty score, plus a name → class registry.

Follows RouteLLM's shape (``routellm/routers/routers.py``: an abstract ``calculate_strong_win_rate`` and a
``ROUTER_CLS`` registry), typed and without model ids or devices baked into constructors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar


class Router(ABC):
    """Scores a routing window (text) with P(needs a more capable tier), a float in [0, 1]."""

    name: ClassVar[str]

    @abstractmethod
    def score(self, text: str) -> float:
        """Return the difficulty score of ``text`` (characters in, probability out, in [0, 1])."""


ROUTER_CLS: dict[str, type[Router]] = {}


def register(cls: type[Router]) -> type[Router]:
    """Class decorator adding ``cls`` to :data:`ROUTER_CLS` under ``cls.name``."""
    ROUTER_CLS[cls.name] = cls
    return cls


@register
class LengthBaselineRouter(Router):
    """Baseline, not a learned model: longer prompts are assumed harder.

    score = min(1, len(text) / ``saturate_chars``), so a prompt of ``saturate_chars`` characters or more
    scores 1.0. Used by the gateway when ``routing.router_path`` is null (no learned router); a configured
    file that is missing or fails to load follows ``routing.on_router_error`` instead (router/serving.py).
    """

    name = "length-baseline"

    def __init__(self, saturate_chars: int = 2000) -> None:
        if saturate_chars <= 0:
            raise ValueError("saturate_chars must be positive")
        self.saturate_chars = saturate_chars

    def score(self, text: str) -> float:
        return min(1.0, len(text) / self.saturate_chars)
