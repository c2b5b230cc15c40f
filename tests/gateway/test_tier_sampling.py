"""A tier's ``sampling`` defaults may not ask for several answers: admission books a request's worst case from the
client's own ``n``/``best_of``, so a tier default of ``n: 4`` was billed four answers against a budget that had
booked one."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, Settings


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_a_tier_default_of_several_answers_is_refused_at_load(field: str) -> None:
    base = Settings.load(None, engine={"enabled": False})
    tiers = [t.model_dump() for t in base.tiers]
    tiers[0]["sampling"] = {"temperature": 0.2, field: 4}
    with pytest.raises(ConfigError, match=f"sampling: {field} cannot be set on a tier"):
        Settings.load(None, engine={"enabled": False}, tiers=tiers)
    tiers[0]["sampling"] = {"temperature": 0.2, field: 1}  # one answer: what admission books anyway
    assert Settings.load(None, engine={"enabled": False}, tiers=tiers).tiers[0].sampling[field] == 1
