"""RouterService: start-up policy for a missing/bad file, thresholds, and hot reload (explicit, mtime watch)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import pytest

from gateway.config import RoutingConfig
from router.persistence import load_router, save_router
from router.serving import RouterService, RouterUnavailable

SHIPPED = Path(__file__).resolve().parents[2] / "router" / "assets" / "default.skops"
EASY = "Start with 7. Add 5. What is the result?"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The shipped file and a copy whose only change is its threshold (0.9)."""
    d = tmp_path_factory.mktemp("variants")
    r = load_router(SHIPPED)
    r.thresholds = [0.9]
    return {"shipped": SHIPPED, "t09": save_router(r, d / "t09.skops")}


def cfg(path: Path | None, **kw: object) -> RoutingConfig:
    return RoutingConfig(router_path=path, **kw)  # type: ignore[arg-type]


def test_missing_file_refuse_start_raises_with_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(RouterUnavailable, match=r"not found.*refuse_start"):
        RouterService.from_config(cfg(tmp_path / "none.skops", on_router_error="refuse_start"))
    with pytest.raises(RouterUnavailable, match="router_path is null"):
        RouterService.from_config(cfg(None, on_router_error="refuse_start"))


def test_missing_or_corrupt_file_default_tier_mode(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "bad.skops"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    for path in (tmp_path / "none.skops", bad):
        with caplog.at_level(logging.WARNING, logger="thinkgate.router"):
            svc = RouterService.from_config(cfg(path, default_tier="long"))
        assert not svc.available and svc.mode == "default_tier"
        assert svc.error and str(path) in svc.error
        assert "routing every 'auto' request to tier 'long'" in caplog.text
        with pytest.raises(RouterUnavailable):
            svc.score(EASY)
        assert svc.info()["mode"] == "default_tier"


def test_loaded_router_scores_and_thresholds(variants: dict[str, Path]) -> None:
    svc = RouterService.from_config(cfg(variants["shipped"]))
    assert svc.available and svc.error is None
    assert svc.thresholds == load_router(SHIPPED).thresholds
    assert svc.tier_for(svc.score(EASY)) == "short"
    override = RouterService.from_config(cfg(variants["shipped"], thresholds=[0.0]))
    assert override.thresholds == [0.0] and override.tier_for(override.score(EASY)) == "long"
    # a file calibrated for two tiers drives three: its cut serves the top boundary (short / long as on two tiers),
    # and no score is below the one under it, so nothing is routed to `none` until a file with its cut is loaded
    three = cfg(variants["shipped"], routed_tiers=["none", "short", "long"], on_router_error="refuse_start")
    svc3 = RouterService.from_config(three)
    assert svc3.thresholds == [0.0, *load_router(SHIPPED).thresholds]
    assert svc3.tier_for(svc3.score(EASY)) == "short" and svc3.tier_for(0.0) == "short"
    assert svc3.tier_for(1.0) == "long"
    # configured thresholds must still name every boundary
    with pytest.raises(RouterUnavailable, match="needs 2"):
        RouterService.from_config(three.model_copy(update={"thresholds": [0.5]}))


def test_a_file_with_more_cuts_than_the_ladder_is_refused(tmp_path: Path) -> None:
    r = load_router(SHIPPED)
    r.thresholds = [0.3, 0.6]
    path = save_router(r, tmp_path / "two-cuts.skops")
    with pytest.raises(RouterUnavailable, match="needs 1"):
        RouterService.from_config(cfg(path, on_router_error="refuse_start"))


def test_reload_if_changed_respects_interval_and_survives_bad_files(variants: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    live = tmp_path / "live.skops"
    shutil.copy(variants["shipped"], live)
    clock = Clock()
    svc = RouterService.from_config(cfg(live, reload_interval_s=5.0), clock=clock)
    first = svc.thresholds
    shutil.copy(variants["t09"], live)
    assert not svc.reload_if_changed()  # not yet: checked at most every 5 s
    clock.t += 5.0
    assert svc.reload_if_changed() and svc.thresholds == [0.9] and svc.reloads == 2
    clock.t += 5.0
    assert not svc.reload_if_changed()  # unchanged file: no reload
    live.write_bytes(b"garbage")  # a broken deploy
    clock.t += 5.0
    assert not svc.reload_if_changed()
    assert svc.available and svc.thresholds == [0.9] and "corrupt" in (svc.error or "")  # old router kept
    clock.t += 5.0
    assert not svc.reload_if_changed()  # the same bad bytes are not retried
    shutil.copy(variants["shipped"], live)
    clock.t += 5.0
    assert svc.reload_if_changed() and svc.thresholds == first and svc.error is None


def test_default_tier_mode_recovers_when_a_file_appears(variants: dict[str, Path], tmp_path: Path) -> None:
    live = tmp_path / "later.skops"
    clock = Clock()
    svc = RouterService.from_config(cfg(live, reload_interval_s=1.0), clock=clock)
    assert not svc.available
    shutil.copy(variants["shipped"], live)
    clock.t += 1.0
    assert svc.reload_if_changed() and svc.available and svc.mode == "router"


async def test_watch_task_picks_up_a_new_file(variants: dict[str, Path], tmp_path: Path) -> None:
    live = tmp_path / "watched.skops"
    shutil.copy(variants["shipped"], live)
    svc = RouterService.from_config(cfg(live, reload_interval_s=0.05))
    stop = asyncio.Event()
    task = asyncio.create_task(svc.watch(stop))
    try:
        shutil.copy(variants["t09"], live)
        deadline = time.monotonic() + 30
        while svc.thresholds != [0.9] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert svc.thresholds == [0.9]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
