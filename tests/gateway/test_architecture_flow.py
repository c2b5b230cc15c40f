"""docs/ARCHITECTURE.md "One chat request, in code" names the function of every step as ``module:qualname``; each
must exist, so the documented request flow cannot drift from the code (issue 23: "checked against the code")."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"
REF = re.compile(r"`((?:gateway|router)(?:\.\w+)+):([\w.]+)`")


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## One chat request, in code")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_every_step_of_the_documented_request_flow_names_code_that_exists() -> None:
    refs = REF.findall(_section())
    assert len(refs) >= 30, refs  # the twelve steps, each with its functions
    missing = []
    for module, qualname in refs:
        obj: object = importlib.import_module(module)
        for part in qualname.split("."):
            if not hasattr(obj, part):
                missing.append(f"{module}:{qualname}")
                break
            obj = getattr(obj, part)
    assert not missing, f"docs/ARCHITECTURE.md names code that does not exist: {missing}"


def test_the_flow_names_the_steps_the_old_one_left_out() -> None:
    """Policy, sessions, the semantic cache and shadow were missing from the earlier request flow."""
    sec = _section()
    for step in ("gateway.pipeline.policy:key_route", "gateway.pipeline.sessions:Sessions.stick",
                 "gateway.semantic.cache:SemanticCache", "gateway.control.shadow:Shadow.sampled",
                 "gateway.upstream.pool:UpstreamPool.open"):
        assert f"`{step}`" in sec, step
