"""``server.gc_thresholds``: the serving process's garbage-collector thresholds, set when a gateway starts (after
its startup heap is frozen); ``null`` leaves Python's; anything below 1 is a config error naming the field."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import Settings
from tests.fixtures.gateway import accounting_gateway
from tests.fixtures.upstream import SimProcess


def test_a_started_gateway_sets_the_configured_thresholds(upstream_sim: SimProcess, redis_url: str,
                                                          tmp_path: Path) -> None:
    before = gc.get_threshold()
    try:
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path,
                                server={"host": "127.0.0.1", "gc_thresholds": [12345, 7, 9]}):
            assert gc.get_threshold() == (12345, 7, 9)
        gc.set_threshold(700, 10, 10)
        with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path,
                                server={"host": "127.0.0.1", "gc_thresholds": None}):
            assert gc.get_threshold() == (700, 10, 10)  # null: left as the process had them
    finally:
        gc.set_threshold(*before)
    assert Settings().server.gc_thresholds == (20000, 50, 100)  # the default


@pytest.mark.parametrize("bad", [[0, 10, 10], [20000, 50], [1, 2, 3, 4], "20000", [1.5, 2, 3], [True, 2, 3]])
def test_anything_but_three_positive_integers_is_a_config_error_naming_the_field(bad: object) -> None:
    with pytest.raises(ValidationError, match=r"gc_thresholds[\s\S]*expected three integers >= 1") as err:
        Settings.model_validate({"server": {"gc_thresholds": bad}})
    assert "Field required" not in str(err.value)
