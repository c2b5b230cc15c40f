"""The trained router inside the real gateway (uvicorn on loopback over the upstream simulator):
easy vs hard real prompts, hot reload (admin endpoint and file watch), missing/corrupt file policies."""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from router.fit.default import MATH_TEST
from router.fit.jsonl import read_jsonl
from router.persistence import load_router, save_router
from router.serving import RouterUnavailable
from router.tasks.rows import task_rows
from router.window import routing_window
from tests.fixtures.upstream import TEST_KEY, TEST_KEY_ID, GatewayServer, sim_settings

# the learned default candidate (the shipped default serves prompt length: router/fit/coldstart.py)
SHIPPED = Path(__file__).resolve().parents[2] / "router" / "assets" / "default-learned.skops"
ADMIN = "tg-router-admin-secret-0000"
# Real prompts: a one-operation problem of the project's arithmetic task, and a level-5 MATH-500 problem.
EASY = task_rows("arith", "test", 1, seed=0, levels=[1])[0]["question"]
HARD = next(r["problem"] for r in read_jsonl(MATH_TEST) if r["level"] == 5 and len(r["problem"]) > 200)


def settings_for(upstream_sim: Any, redis_url: str, router_path: Path | None, **routing: Any) -> Any:
    return sim_settings(
        upstream_sim.base_url, redis_url,
        routing={"router_path": None if router_path is None else str(router_path), "routed_tiers": ["short", "long"],
                 "default_tier": "long", **routing},
        auth={"keys": [{"id": TEST_KEY_ID, "secret": TEST_KEY}],
              "admin_key_sha256": hashlib.sha256(ADMIN.encode()).hexdigest()},
    )


def route(gw: GatewayServer, prompt: str) -> tuple[str, str, str | None]:
    client = openai.OpenAI(base_url=gw.base_url, api_key=TEST_KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=[{"role": "user", "content": prompt}])
    h = raw.headers
    return h["x-thinkgate-tier"], h["x-thinkgate-route-reason"], h.get("x-thinkgate-difficulty")


def reload(gw: GatewayServer, key: str) -> httpx.Response:
    return httpx.post(gw.url + "/admin/router/reload", headers={"authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def all_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped router with threshold 0.0: every request goes long."""
    r = load_router(SHIPPED)
    r.thresholds = [0.0]
    return save_router(r, tmp_path_factory.mktemp("variants") / "all-long.skops")


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Path]:
    p = tmp_path / "router.skops"
    shutil.copy(SHIPPED, p)
    yield p


def test_easy_and_hard_real_prompts_land_on_different_tiers(upstream_sim: Any, redis_url: str) -> None:
    router = load_router(SHIPPED)
    with GatewayServer(settings_for(upstream_sim, redis_url, SHIPPED)) as gw:
        tier_e, reason_e, diff_e = route(gw, EASY)
        tier_h, reason_h, diff_h = route(gw, HARD)
        models = httpx.get(gw.base_url + "/models", headers={"authorization": f"Bearer {TEST_KEY}"}).json()
    assert (tier_e, reason_e) == ("short", "predicted") and (tier_h, reason_h) == ("long", "predicted")
    assert diff_e is not None and diff_h is not None and float(diff_e) < router.thresholds[0] <= float(diff_h)
    # the header is the router's score of the routing window
    assert float(diff_h) == pytest.approx(router.score(routing_window([{"role": "user", "content": HARD}])),
                                          abs=1e-4)
    auto = next(m for m in models["data"] if m["id"] == "auto")["thinkgate"]
    assert auto["router"] == "service" and auto["thresholds"] == router.thresholds
    assert auto["router_status"]["mode"] == "router" and auto["router_status"]["training_data_sha256"]


def test_hot_reload_through_the_admin_endpoint(upstream_sim: Any, redis_url: str, live: Path,
                                               all_long: Path) -> None:
    settings = settings_for(upstream_sim, redis_url, live, reload_interval_s=3600.0)  # watcher idle here
    with GatewayServer(settings) as gw:
        assert route(gw, EASY)[0] == "short"
        shutil.copy(all_long, live)
        assert route(gw, EASY)[0] == "short"  # nothing reloaded yet
        r = reload(gw, TEST_KEY)
        assert r.status_code == 403
        r = reload(gw, ADMIN)
        assert r.status_code == 200 and r.json()["router"]["thresholds"] == [0.0]
        assert route(gw, EASY)[:2] == ("long", "predicted")
        live.write_bytes(b"not a router")  # a broken deploy: the router in service stays
        r = reload(gw, ADMIN)
        assert r.status_code == 422 and r.json()["error"]["code"] == "router_reload_failed"
        assert "corrupt" in r.json()["error"]["message"]
        assert route(gw, EASY)[:2] == ("long", "predicted")


def test_file_watch_reloads_without_a_call(upstream_sim: Any, redis_url: str, live: Path, all_long: Path) -> None:
    with GatewayServer(settings_for(upstream_sim, redis_url, live, reload_interval_s=0.1)) as gw:
        assert route(gw, EASY)[0] == "short"
        tmp = live.with_suffix(".new")
        shutil.copy(all_long, tmp)
        tmp.replace(live)  # atomic, as save_router does
        deadline = time.monotonic() + 30
        while gw.app.state.routing.thresholds != [0.0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert route(gw, EASY)[:2] == ("long", "predicted")


def test_missing_router_file_default_tier_and_refuse_start(upstream_sim: Any, redis_url: str,
                                                           tmp_path: Path) -> None:
    missing = tmp_path / "absent.skops"
    with GatewayServer(settings_for(upstream_sim, redis_url, missing, on_router_error="default_tier")) as gw:
        assert route(gw, EASY) == ("long", "fallback", None)
        assert route(gw, HARD) == ("long", "fallback", None)
        status = gw.app.state.routing.service.info()
        assert status["mode"] == "default_tier" and "not found" in status["error"]
        shutil.copy(SHIPPED, missing)  # the file arrives: the admin reload brings routing back
        assert reload(gw, ADMIN).status_code == 200
        assert route(gw, EASY)[:2] == ("short", "predicted")
    with pytest.raises(RouterUnavailable, match="refuse_start"):
        create_app(settings_for(upstream_sim, redis_url, tmp_path / "absent2.skops", on_router_error="refuse_start"))
    corrupt = tmp_path / "corrupt.skops"
    corrupt.write_bytes(SHIPPED.read_bytes()[:1000])
    with pytest.raises(RouterUnavailable, match="corrupt"):
        create_app(settings_for(upstream_sim, redis_url, corrupt, on_router_error="refuse_start"))


def test_models_names_the_router_file_without_its_path(upstream_sim: Any, redis_url: str, live: Path) -> None:
    """``GET /v1/models`` is read by every API key: it names the router file by its name and the SHA-256 of its
    bytes, never by its absolute path (the server's directory layout) — not in a load error either. The admin key
    reads the path (there and in the reload answer)."""
    digest = hashlib.sha256(live.read_bytes()).hexdigest()
    with GatewayServer(settings_for(upstream_sim, redis_url, live, reload_interval_s=3600.0)) as gw:
        def models(key: str, path: str = "/models") -> httpx.Response:
            return httpx.get(gw.base_url + path, headers={"authorization": f"Bearer {key}"}, timeout=10)

        for r in (models(TEST_KEY), models(TEST_KEY, "/models/auto")):
            assert r.status_code == 200 and str(live.parent) not in r.text
        status = models(TEST_KEY).json()["data"][0]["thinkgate"]["router_status"]
        assert "path" not in status and (status["file"], status["sha256"]) == ("router.skops", digest)
        admin = models(ADMIN).json()["data"][0]["thinkgate"]["router_status"]
        assert admin["path"] == str(live) and admin["sha256"] == digest
        live.write_bytes(b"not a router")  # a broken deploy: its error names the file
        r = reload(gw, ADMIN)
        assert r.status_code == 422 and str(live) in r.json()["router"]["error"]
        r = models(TEST_KEY)
        status = r.json()["data"][0]["thinkgate"]["router_status"]
        assert "router.skops" in status["error"] and str(live.parent) not in r.text
        assert status["sha256"] == digest  # the router in service is still the one loaded
