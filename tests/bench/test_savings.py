"""``thinkgate bench savings`` end to end: real gateways (``thinkgate serve`` processes), real Redis, the
deterministic upstream simulator (and, marked ``engine``, the real vLLM server). Checks the JSON shape and that
every policy's cost is the sum of its usage events in the ledger, read back independently here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import savings_stack as sv
from gateway.config import Settings
from gateway.ledger.event import UsageEvent
from gateway.ledger.pricing import cost_micro_usd
from tests.fixtures.redis_stack import stack
from tests.fixtures.upstream import SimProcess, sim_settings, start_sim


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    s = start_sim()
    try:
        yield s
    finally:
        s.stop()


def ledger(redis_url: str, prefix: str, tmp_path: Path) -> list[UsageEvent]:
    async def read() -> list[UsageEvent]:
        async with stack(redis_url, prefix, tmp_path / "spool.jsonl") as st:
            return [e async for e in st.meter.events()]
    return asyncio.run(read())


def check_against_ledger(result: dict[str, Any], events: list[UsageEvent], settings: Settings) -> None:
    run = result["stack"]["run"]
    for name, entry in result["policies"].items():
        keys = {f"savings-{run}-{name.replace('+', '-')}-{subset}" for subset in ("synthetic", "real")}
        mine = [e for e in events if e.key_id in keys]
        assert entry["events"] == len(mine) >= entry["requests"]
        assert entry["cost_micro_usd"] == sum(e.cost_micro_usd for e in mine)
        assert entry["cost_usd"] == sum(e.cost_micro_usd for e in mine) / 1_000_000
        upstream = [e for e in mine if not e.cached]
        for k in ("prompt_tokens", "reasoning_tokens", "completion_tokens"):
            assert entry[k] == sum(getattr(e, k) for e in upstream)
        for e in upstream:  # each event priced at its tier's configured prices
            prices = settings.tier(e.tier).prices
            want = cost_micro_usd(prices, prompt_tokens=e.prompt_tokens, cached_tokens=e.cached_tokens,
                                  completion_tokens=e.completion_tokens)
            assert e.cost_micro_usd == want
        present = [s for s in ("synthetic", "real") if s in entry]
        for subset in present:
            sub = [e for e in mine if e.key_id.endswith("-" + subset)]
            assert entry[subset]["cost_micro_usd"] == sum(e.cost_micro_usd for e in sub)
        assert sum(entry[s]["cost_micro_usd"] for s in present) == entry["cost_micro_usd"]


def test_workload_is_deterministic_with_repeats_after_originals() -> None:
    items = sv.workload(20, repeat_fraction=0.25, real_fraction=0.2, seed=3)
    again = sv.workload(20, repeat_fraction=0.25, real_fraction=0.2, seed=3)
    assert [i.question for i in items] == [i.question for i in again]
    syn = [i for i in items if i.subset == "synthetic"]
    real = [i for i in items if i.subset == "real"]
    assert (len(syn), len(real)) == (16, 4)
    assert len({i.qid for i in syn}) == 12 and len({i.qid for i in real}) == 3  # 4 + 1 repeats
    assert {i.source for i in syn} == {"arith"} and {i.source for i in real} == {"gsm8k", "math"}
    # originals keep their order and every repeat comes after its original: per subset, the first occurrences
    # are the originals in qid order (a repeat placed before its original would make its qid first appear early)
    for subset in (syn, real):
        seen: set[int] = set()
        firsts = []
        for i in subset:
            if i.qid not in seen:
                firsts.append(i.qid)
            seen.add(i.qid)
        assert firsts == sorted(firsts) and len(subset) - len(firsts) == {16: 4, 4: 1}[len(subset)]
    assert {p.difficulty for p in (i.problem for i in syn)} == {1, 2, 3, 4, 5, 6}
    with pytest.raises(sv.BenchError):
        sv.workload(10, repeat_fraction=1.0, real_fraction=0.0)


def test_bench_against_the_simulator(sim: SimProcess, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    settings = sim_settings(sim.base_url, redis_url,
                            redis={"url": redis_url, "start_if_missing": False, "key_prefix": redis_prefix})
    cfg = sv.BenchConfig(n=12, repeat_fraction=0.25, real_fraction=0.25, concurrency=2, progress=False)
    result = sv.run(cfg, settings, start_engine=False, log=lambda _m: None)
    out = tmp_path / "savings.json"
    sv.write_json(result, out)
    data = json.loads(out.read_text())
    assert set(data["policies"]) == set(sv.POLICIES)
    for name, entry in data["policies"].items():
        assert set(sv.REQUIRED_KEYS) <= set(entry), name
        assert entry["requests"] == 12 and entry["errors"] == 0
        assert 0.0 <= entry["accuracy"] <= 1.0 and entry["p50_ms"] <= entry["p99_ms"]
        # 2 of 9 synthetic and 1 of 3 real requests repeat an earlier question at temperature 0: cache hits
        assert entry["cache_hit_rate"] == pytest.approx(3 / 12), name
    p = data["policies"]
    assert p["none"]["tiers"] == {"none": 12} and p["none"]["reasoning_tokens"] == 0
    assert p["long"]["tiers"] == {"long": 12}
    # the simulator thinks 16 + words mod 16 words, cut to the short tier's budget of 8
    assert p["short"]["reasoning_tokens"] == 8 * 9 and p["long"]["reasoning_tokens"] > p["short"]["reasoning_tokens"]
    assert set(p["auto"]["tiers"]) <= {"short", "long"} and sum(p["auto"]["tiers"].values()) == 12
    assert p["auto"]["cost_micro_usd"] < p["long"]["cost_micro_usd"]
    assert set(data["targets"]) == {"auto", "auto+escalation"}
    assert {"router", "router_sha256", "router_version"} <= set(data["stack"])  # the router by its bytes too
    check_against_ledger(result, ledger(redis_url, redis_prefix, tmp_path), settings)
    sv.plot(result, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert sv.markdown(result).count("\n") == 1 + len(sv.POLICIES)


def test_unknown_policy_is_refused(sim: SimProcess, redis_url: str) -> None:
    with pytest.raises(sv.BenchError, match="unknown policies"):
        sv.run(sv.BenchConfig(n=2, policies=("sometimes",), progress=False), sim_settings(sim.base_url, redis_url),
               start_engine=False)


def test_targets_against_a_baseline_run() -> None:
    """Routed policies of one run against another run's always-long (same workload), e.g. the length-penalised
    model's auto vs the SFT model's long: 30 / 100 tokens at 0.93 / 0.94 accuracy → both targets met."""
    wl = {"n": 10, "seed": 0}

    def pol(tok: int, acc: float) -> dict[str, Any]:
        return {"synthetic": {"reasoning_tokens": tok, "accuracy": acc}}

    result = {"workload": wl, "policies": {"long": pol(40, 0.92), "auto": pol(30, 0.93)}}
    base = {"workload": wl, "stack": {"model_sha256": "abc"}, "policies": {"long": pol(100, 0.94)}}
    out = sv.targets_vs_baseline(result, base, "b.json")
    t = out["targets"]["auto"]
    assert t["reasoning_tokens_vs_long"] == pytest.approx(0.30) and t["accuracy_vs_long"] == pytest.approx(0.93 / 0.94)
    assert t["met"] and out["baseline_model_sha256"] == "abc"
    assert not sv.targets(result["policies"])["auto"]["met"]  # vs its own long: 75% of the tokens
    with pytest.raises(sv.BenchError, match="different workload"):
        sv.targets_vs_baseline(result, {**base, "workload": {"n": 11, "seed": 0}}, "b.json")
    with pytest.raises(sv.BenchError, match="no always-long"):
        sv.targets_vs_baseline(result, {"workload": wl, "policies": {}}, "b.json")


def test_stack_block_names_the_router_by_its_bytes_and_version() -> None:
    """The stack block named the router file by its path alone: a rerun with another router saved at the same path
    read as nondeterminism. It now carries the file's SHA-256 (first 12 hex) and the version ``router info`` reports,
    and the RESULTS section's header line says both — on the shipped router file."""
    import hashlib

    from typer.testing import CliRunner

    from bench.savings_results import section
    from gateway.config.paths import DEFAULT_ROUTER_PATH
    from router.cli import app

    ident = sv.router_identity(DEFAULT_ROUTER_PATH)
    assert ident["router_sha256"] == hashlib.sha256(DEFAULT_ROUTER_PATH.read_bytes()).hexdigest()[:12]
    info = CliRunner().invoke(app, ["info", str(DEFAULT_ROUTER_PATH)])
    assert info.exit_code == 0, info.output
    assert ident["router_version"] and \
        f"version (as the gateway reports it): {ident['router_version']};" in info.output
    assert sv.router_identity(None) == {"router_sha256": None, "router_version": None}
    stack = {"run": "r", "model_sha256": "abc", "gateways": 2, "router": str(DEFAULT_ROUTER_PATH), **ident,
             "tiers": {}}
    result = {"wall_s": 1.0, "stack": stack, "policies": {}, "targets": {},
              "workload": {"n": 2, "synthetic": 1, "real": 1, "repeat_fraction": 0.0, "concurrency": 1, "seed": 0}}
    header = section(result, "2026-12-06 00:00 UTC", 0.0).splitlines()[2]
    assert f"`router/assets/default.skops` (sha256 {ident['router_sha256']}, version {ident['router_version']})" \
        in header


def test_model_dir_must_be_a_model_directory(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from bench.cli import app

    r = CliRunner().invoke(app, ["savings", "--model-dir", str(tmp_path), "--n", "1"])
    assert r.exit_code == 2
    assert "not a model directory" in r.output


@pytest.mark.engine
def test_bench_through_the_real_engine(engine: str, redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    loaded = Settings.load(None, engine={"enabled": False},
                           redis={"url": redis_url, "start_if_missing": False, "key_prefix": redis_prefix})
    base = loaded.model_copy(update={"tiers": [t.model_copy(update={"base_url": engine}) for t in loaded.tiers]})
    cfg = sv.BenchConfig(n=4, repeat_fraction=0.0, real_fraction=0.0, concurrency=2, progress=False,
                         policies=("none", "long", "auto+escalation"))
    result = sv.run(cfg, base, start_engine=False, log=lambda _m: None)
    p = result["policies"]
    assert set(p) == {"none", "long", "auto+escalation"}
    assert all(e["requests"] == 4 and e["errors"] == 0 for e in p.values())
    assert p["none"]["reasoning_tokens"] == 0 < p["long"]["reasoning_tokens"]
    assert p["long"]["cost_micro_usd"] > p["none"]["cost_micro_usd"] > 0
    check_against_ledger(result, ledger(redis_url, redis_prefix, tmp_path), base)


def test_time_budget_skips_and_says_so(sim: SimProcess, redis_url: str, redis_prefix: str) -> None:
    settings = sim_settings(sim.base_url, redis_url,
                            redis={"url": redis_url, "start_if_missing": False, "key_prefix": redis_prefix})
    cfg = sv.BenchConfig(n=4, real_fraction=0.0, policies=("none",), progress=False, time_budget_s=0.001)
    said: list[str] = []
    result = sv.run(cfg, settings, start_engine=False, log=said.append)
    entry = result["policies"]["none"]
    assert result["complete"] is False and entry["skipped"] == 4 and entry["requests"] == 0
    assert entry["events"] == 0 and entry["cost_micro_usd"] == 0 and any("4 requests not sent" in m for m in said)
