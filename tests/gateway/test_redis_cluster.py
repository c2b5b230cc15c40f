"""``thinkgate serve``, ``/ready`` and every Redis CLI command on a real Redis Cluster (3 masters + 3 replicas)
and a real Sentinel set (1 master, 2 replicas, 3 sentinels), all on loopback, through real gateway processes
configured with ``THINKGATE_REDIS__URL`` as a user would."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import TierConfig
from gateway.state.limits import estimate
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, keys_config
from tests.fixtures.gateway_process import REPO, ServeProcess, serve, serve_config
from tests.fixtures.redis_cluster import ClusterSet, SentinelSet
from tests.fixtures.upstream import SimProcess, sim_tiers

ADMIN = {"authorization": f"Bearer {ADMIN_SECRET}"}
BUDGET_BODY = {"model": "short", "messages": [{"role": "user", "content": "budget race"}], "sim": {"delay_ms": 300}}


@pytest.fixture(scope="module", params=["cluster", "cluster-tenant", "sentinel"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    """``cluster-tenant``: the Cluster with ``redis.cluster_placement: tenant`` (each key's own metering and
    admission keys in its tenant slot: the metering scripts run per slot, admission per level)."""
    return str(request.param)


@pytest.fixture(scope="module")
def backend(backend_kind: str, request: pytest.FixtureRequest) -> ClusterSet | SentinelSet:
    """The real Cluster (the session's, whole again: :meth:`ClusterSet.wait_settled`), then the real Sentinel set
    (started for this module)."""
    if backend_kind.startswith("cluster"):
        c: ClusterSet = request.getfixturevalue("shared_redis_cluster")
        c.wait_settled()
        return c
    s: SentinelSet = request.getfixturevalue("redis_sentinel")
    return s


@pytest.fixture(autouse=True)
def _settled(backend: ClusterSet | SentinelSet) -> None:
    """Each test, not only the module's first, starts on a whole shared Cluster (the check takes milliseconds)."""
    if isinstance(backend, ClusterSet):
        backend.wait_settled()


@pytest.fixture(scope="module")
def served(backend: ClusterSet | SentinelSet, backend_kind: str, upstream_sim: SimProcess,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """``thinkgate serve`` on ``THINKGATE_REDIS__URL=<backend url>`` with the defaults a new user has
    (``redis.start_if_missing: true``); alice's daily budget fits one request's admission estimate, not two."""
    tmp = tmp_path_factory.mktemp("serve")
    one = estimate(BUDGET_BODY, [TierConfig(**t) for t in sim_tiers(upstream_sim.base_url)[1:]]).micro_usd
    auth = keys_config(alice={"budget_usd_day": str(Decimal(one * 3 // 2) / 1_000_000)},
                       bob={"rpm": 1000, "tpm": 1_000_000})
    cfg = serve_config(upstream_sim.base_url, tmp, f"tgc{uuid.uuid4().hex[:6]}:", auth=auth)
    if backend_kind == "cluster-tenant":  # in the config file: the CLI commands below read it too
        cfg["redis"]["cluster_placement"] = "tenant"
    with serve(cfg, tmp, {"THINKGATE_REDIS__URL": backend.url}) as sp:
        yield sp


def _post(sp: ServeProcess, who: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(sp.base_url + "/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {SECRETS[who]}", **headers})


def _usage(sp: ServeProcess, key_id: str) -> dict[str, Any]:
    r = httpx.get(sp.base_url + "/usage", params={"key_id": key_id}, headers=ADMIN, timeout=10)
    r.raise_for_status()
    return dict(r.json())


def test_serve_starts_and_ready_answers_200(served: ServeProcess) -> None:
    # before: serve crashed at start on redis+cluster:// (Redis.from_url refuses the scheme) and /ready said 500
    assert served.proc.poll() is None
    r = httpx.get(served.root + "/ready", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["redis"] is True
    assert "warning" not in served.stderr().lower(), served.stderr()


def test_requests_are_served_cached_and_metered(served: ServeProcess, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    body = {"model": "short", "temperature": 0, "messages": [{"role": "user", "content": "cluster " + tag}],
            "sim": {"tag": tag}}
    before = _usage(served, "bob")["counters"]["total"]["requests"]
    first, second = _post(served, "bob", body), _post(served, "bob", body)
    assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
    assert (first.headers["x-thinkgate-cache"], second.headers["x-thinkgate-cache"]) == ("miss", "hit")
    # the key's RPM/TPM windows as admission left them (one script on Sentinel and on the Cluster's shared slot; the
    # key's own group first under cluster_placement: tenant)
    for r in (first, second):
        assert r.headers["x-ratelimit-limit-requests"] == "1000" and r.headers["x-ratelimit-limit-tokens"] == "1000000"
        assert 0 < int(r.headers["x-ratelimit-remaining-requests"]) < 1000
        assert 0 < int(r.headers["x-ratelimit-remaining-tokens"]) < 1_000_000
    assert int(second.headers["x-ratelimit-remaining-requests"]) < int(first.headers["x-ratelimit-remaining-requests"])
    assert first.json()["choices"] == second.json()["choices"]
    rec = upstream_sim.tag(tag)
    assert rec is not None and rec["attempts"] == 1
    deadline = time.monotonic() + 10
    while _usage(served, "bob")["counters"]["total"]["requests"] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    view = _usage(served, "bob")["counters"]["total"]
    assert view["requests"] == before + 2
    assert view["cache_hits"] >= 1
    assert not Path(serve_cfg_spool(served)).exists() or Path(serve_cfg_spool(served)).stat().st_size == 0


def serve_cfg_spool(sp: ServeProcess) -> str:
    import yaml

    return str(yaml.safe_load(sp.config.read_text())["metering"]["spool_path"])


def test_budget_holds_under_concurrency(served: ServeProcess) -> None:
    # hard mode: the first admitted request reserves its estimate; 15 concurrent others see it and are refused
    async def burst() -> list[httpx.Response]:
        headers = {"authorization": f"Bearer {SECRETS['alice']}", "cache-control": "no-store"}
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*(http.post(served.base_url + "/chat/completions", json=BUDGET_BODY,
                                                    headers=headers) for _ in range(16)))

    codes = [r.status_code for r in asyncio.run(burst())]
    assert codes.count(200) == 1 and codes.count(429) == 15, codes


def _cli(served: ServeProcess, backend: ClusterSet | SentinelSet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args, "--config", str(served.config)], cwd=REPO,
                          env={**os.environ, "THINKGATE_CONFIG": "", "THINKGATE_REDIS__URL": backend.url},
                          capture_output=True, text=True, timeout=60)


def test_every_cli_command_works(served: ServeProcess, backend: ClusterSet | SentinelSet,
                                 tmp_path: Path) -> None:
    kid = f"cli-{uuid.uuid4().hex[:6]}"
    created = _cli(served, backend, "keys", "create", "--id", kid, "--tag", "team=z", "--budget-usd-day", "3")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    listed = _cli(served, backend, "keys", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert kid in [orjson.loads(line)["id"] for line in listed.stdout.splitlines()]
    # the new key authenticates on the running gateway and its request is metered
    r = httpx.post(served.base_url + "/chat/completions", timeout=30, headers={"authorization": f"Bearer {secret}"},
                   json={"model": "none", "messages": [{"role": "user", "content": "from the cli key"}]})
    assert r.status_code == 200, r.text
    assert _cli(served, backend, "budgets", "set", "--tag", "team=z", "--usd-day", "7").returncode == 0
    budgets = _cli(served, backend, "budgets", "list", "--json")
    assert budgets.returncode == 0, budgets.stderr
    rows = {orjson.loads(line)["level"]: orjson.loads(line) for line in budgets.stdout.splitlines()}
    assert Decimal(rows["tag:team=z"]["usd_day"]) == 7
    assert _cli(served, backend, "budgets", "remove", "--tag", "team=z").returncode == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        export = _cli(served, backend, "usage", "export", "--format", "jsonl", "--key", kid)
        assert export.returncode == 0, export.stderr
        if export.stdout.strip():
            break
        time.sleep(0.2)
    events = [orjson.loads(line) for line in export.stdout.splitlines()]
    assert [e["key_id"] for e in events] == [kid]
    # grouped with --since: from the usage cubes (written by the metering script in the shared slot), the same rows
    # as the scan of the whole stream (no --since); the backfill finds nothing to rebuild
    day = events[0]["ts"][:10]
    by_cubes = _cli(served, backend, "usage", "export", "--format", "jsonl", "--key", kid, "--group-by",
                    "day,tier,model,tag", "--since", day)
    by_scan = _cli(served, backend, "usage", "export", "--format", "jsonl", "--key", kid, "--group-by",
                   "day,tier,model,tag")
    assert by_cubes.returncode == 0 and by_scan.returncode == 0, by_cubes.stderr + by_scan.stderr
    assert by_cubes.stdout == by_scan.stdout and orjson.loads(by_cubes.stdout)["requests"] == 1
    assert "days from the usage cubes, 0 events scanned" in by_cubes.stderr, by_cubes.stderr
    backfill = _cli(served, backend, "usage", "backfill", "--since", day)
    assert backfill.returncode == 0 and "0 rebuilt" in backfill.stdout, backfill.stdout + backfill.stderr
    report = _cli(served, backend, "usage", "report", "--key", kid, "--json", str(tmp_path / "r.json"))
    assert report.returncode == 0, report.stderr
    assert orjson.loads((tmp_path / "r.json").read_bytes())["summary"]["requests"] == 1
    revoked = _cli(served, backend, "keys", "revoke", kid)
    assert revoked.returncode == 0, revoked.stderr
