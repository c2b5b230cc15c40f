"""The cost-target controller (``routing.target``) on the real Redis: convergence on a drifting synthetic score
stream within its step bound, spend targets, replicas sharing one state, and two real gateways on one prefix."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.config import RedisConfig, RoutingConfig, Settings
from gateway.control.target import TargetController, share_for_spend
from gateway.state.breaker import Breaker
from gateway.state.redis import connect
from tests.fixtures.gateway import ADMIN_SECRET, SECRETS, accounting_gateway
from tests.fixtures.redis_stack import PersistentRedis
from tests.fixtures.upstream import SimProcess, wait_for

ADMIN = {"authorization": f"Bearer {ADMIN_SECRET}"}  # /metrics is the operator's


def _controller(redis_url: str, prefix: str, **target: object) -> TargetController:
    cfg = RoutingConfig(router_path=None, routed_tiers=["short", "long"], thresholds=[0.5],
                        target={"update_every": 10**6, **target})
    handle = connect(RedisConfig(url=redis_url, key_prefix=prefix, start_if_missing=False))
    return TargetController(cfg, handle, Breaker(1.0), [0.5])


def _stream(rng: np.random.Generator) -> np.ndarray:
    """4,000 scores: Beta(2, 5) (mostly easy), then drifted to Beta(5, 2) (mostly hard)."""
    return np.concatenate([rng.beta(2, 5, 2000), rng.beta(5, 2, 2000)])


def _drive(ctrl: TargetController, scores: np.ndarray, batch: int = 16) -> tuple[list[int], list[float]]:
    return asyncio.run(_drive_async(ctrl, scores, batch))


async def _drive_async(ctrl: TargetController, scores: np.ndarray, batch: int) -> tuple[list[int], list[float]]:
    """Route ``scores`` with the controller's threshold (an update every ``batch``); the tier of each and the
    threshold after each update."""
    tiers, thresholds = [], []
    for j, s in enumerate(scores):
        thr = ctrl.thresholds([0.5])[-1]
        k = int(s >= thr)
        tiers.append(k)
        ctrl.record(float(s), k)
        if (j + 1) % batch == 0:
            await ctrl.update()
            thresholds.append(ctrl.thresholds([0.5])[-1])
    await ctrl.redis.aclose()
    return tiers, thresholds


def test_controller_converges_on_drifting_stream_within_step_bound(redis_url: str, redis_prefix: str) -> None:
    ctrl = _controller(redis_url, redis_prefix, long_share=0.3, window=500, min_samples=50, max_step=0.02)
    scores = _stream(np.random.default_rng(0))
    tiers, thresholds = _drive(ctrl, scores)
    steps = np.abs(np.diff([0.5, *thresholds]))
    assert steps.max() <= 0.02 + 1e-9  # the step bound holds on every update
    assert steps.max() > 0.019  # and the controller did have to move at full speed
    t = np.array(tiers)
    # after a warm-up (the first 1,000 requests of each regime) the realized top share is within ±3 points
    for lo, hi in ((1000, 2000), (3000, 4000)):
        for a in range(lo, hi, 250):
            assert abs(t[a:a + 250].mean() - 0.3) <= 0.03 + 0.03, (a, t[a:a + 250].mean())  # 250-request slices
        assert abs(t[lo:hi].mean() - 0.3) <= 0.03, (lo, t[lo:hi].mean())
    # where the fixed threshold misses the target by far on both regimes
    assert abs((scores[:2000] >= 0.5).mean() - 0.3) > 0.15 and abs((scores[2000:] >= 0.5).mean() - 0.3) > 0.4
    assert ctrl.state.n == 500 and ctrl.state.target == 0.3


def test_step_bound_is_what_limits_the_speed(redis_url: str, redis_prefix: str) -> None:
    """A tiny step bound keeps the threshold from reaching the target quantile quickly."""
    ctrl = _controller(redis_url, redis_prefix, long_share=0.9, window=200, min_samples=20, max_step=0.001)
    scores = np.random.default_rng(1).uniform(0, 1, 800)  # the 10 % quantile is ~0.1, far from 0.5
    _, thresholds = _drive(ctrl, scores)
    # every update after the first min_samples scores moved it by exactly the bound
    assert thresholds[-1] == pytest.approx(0.5 - 0.001 * (len(thresholds) - 1), abs=1e-6)


def test_replicas_share_the_controller_state(redis_url: str, redis_prefix: str) -> None:
    async def go() -> None:
        a = _controller(redis_url, redis_prefix, long_share=0.5, window=100, min_samples=10, max_step=0.05)
        b = _controller(redis_url, redis_prefix, long_share=0.5, window=100, min_samples=10, max_step=0.05)
        rng = np.random.default_rng(2)
        for s in rng.uniform(0.0, 0.4, 60):  # A sees all of the traffic
            a.record(float(s), 0)
        await a.update()
        assert a.state.threshold == pytest.approx(0.45)  # one bounded step down from 0.5
        await b.update()  # B has nothing pending: it reads the shared threshold
        assert b.thresholds([0.5]) == [a.state.threshold]
        for s in rng.uniform(0.0, 0.4, 20):  # B's decisions land in the same window and move the same threshold
            b.record(float(s), 0)
        await b.update()
        assert b.state.n == 80 and b.state.threshold == pytest.approx(0.40)
        await a.update()
        assert a.state.threshold == b.state.threshold
        await a.redis.aclose()
        await b.redis.aclose()
    asyncio.run(go())


def test_spend_target_becomes_a_share(redis_url: str, redis_prefix: str) -> None:
    costs = {0: (100 * 10, 10), 1: (1000 * 10, 10)}  # short 100 µ$/request, long 1,000 µ$/request
    assert share_for_spend(325, costs, 1) == pytest.approx(0.25)
    assert share_for_spend(2000, costs, 1) == 1.0 and share_for_spend(50, costs, 1) == 0.0
    assert share_for_spend(325, {0: (1000, 10)}, 1) is None  # the top tier not measured yet

    async def go() -> None:
        ctrl = _controller(redis_url, redis_prefix, usd_per_1k_requests="0.325", window=100, min_samples=10)
        assert ctrl.target_share() is None
        for _ in range(10):
            ctrl.record_cost(0, 100)
            ctrl.record_cost(1, 1000)
        ctrl.record(0.7, 1)
        await ctrl.update()
        assert ctrl.state.costs == {0: (1000, 10), 1: (10000, 10)}
        assert ctrl.target_share() == pytest.approx(0.25)
        await ctrl.redis.aclose()
    asyncio.run(go())


def test_target_long_share_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THINKGATE_ROUTING__TARGET__LONG_SHARE", "0.35")
    s = Settings.load(None)
    assert s.routing.target.long_share == 0.35 and s.routing.target.enabled
    monkeypatch.delenv("THINKGATE_ROUTING__TARGET__LONG_SHARE")
    assert not Settings.load(None).routing.target.enabled  # off by default


def _metric(text: str, name: str, tier: str | None = None) -> float | None:
    pat = rf'^{name}{{tier="{tier}"}} (\S+)$' if tier else rf"^{name} (\S+)$"
    m = re.search(pat, text, re.M)
    return float(m.group(1)) if m else None


def test_two_gateways_on_one_prefix_share_thresholds(upstream_sim: SimProcess, redis_url: str,
                                                     tmp_path: Path) -> None:
    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    routing = {"router_path": None, "routed_tiers": ["short", "long"], "thresholds": [0.5], "default_tier": "long",
               "target": {"long_share": 0.2, "window": 200, "min_samples": 10, "max_step": 0.25,
                          "update_every": 8, "interval_s": 0.1}}
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=prefix, routing=routing) as a, \
            accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, prefix=prefix, routing=routing) as b:
        headers = {"authorization": f"Bearer {SECRETS['alice']}"}
        tiers = []
        with httpx.Client(timeout=30, headers=headers) as client:
            lengths = np.random.default_rng(3).integers(20, 400, 64)
            for n in lengths:  # short prompts: the length baseline scores them low (all under 0.5)
                r = client.post(a.base_url + "/chat/completions", json={
                    "model": "auto", "max_tokens": 4, "messages": [{"role": "user", "content": "q" * int(n)}]})
                assert r.status_code == 200, r.text
                tiers.append(r.headers["x-thinkgate-tier"])
            ma = client.get(a.url + "/metrics", headers=ADMIN).text
            thr_a = _metric(ma, "thinkgate_routing_threshold", "long")
            assert thr_a is not None and thr_a < 0.5  # A moved its threshold down toward a 20 % long share
            assert _metric(ma, "thinkgate_routing_target_share") == 0.2
            assert tiers[:8] == ["short"] * 8  # before the first update: the configured 0.5

            def b_agrees() -> bool:  # A's loop sends its last pending decisions; then both read one state
                ta = _metric(client.get(a.url + "/metrics", headers=ADMIN).text, "thinkgate_routing_threshold", "long")
                tb = _metric(client.get(b.url + "/metrics", headers=ADMIN).text, "thinkgate_routing_threshold", "long")
                return ta is not None and ta == tb
            assert wait_for(b_agrees, timeout_s=10)  # B (no traffic) applies the shared threshold
            mb = client.get(b.url + "/metrics", headers=ADMIN).text
            assert _metric(mb, "thinkgate_routing_share", "long") is not None
            on_b = [client.post(b.base_url + "/chat/completions", json={
                "model": "auto", "max_tokens": 4, "messages": [{"role": "user", "content": "q" * int(n)}]}
            ).headers["x-thinkgate-tier"] for n in lengths[:40]]
            assert 0 < on_b.count("long") < 20  # B routes with the moved threshold: long again, near 20 %


def test_realized_share_feedback_keeps_every_block_within_three_points(redis_url: str, redis_prefix: str) -> None:
    """The score quantile alone promises the share only in expectation: on fresh samples a 500-request block is off
    by its binomial noise (sd ~2.1 points at 35 %), past 3 points somewhere in 12 blocks. The feedback on the
    realized share (``gain``) makes later decisions compensate, so every block stays inside ±3 points."""
    scores = np.random.default_rng(1).beta(2, 3, 6500)
    ctrl = _controller(redis_url, redis_prefix, long_share=0.35, window=500, min_samples=50, max_step=0.02)
    t = np.array(_drive(ctrl, scores)[0][500:])
    errors = [abs(t[a:a + 500].mean() - 0.35) for a in range(0, len(t), 500)]
    assert max(errors) <= 0.03, [round(e, 3) for e in errors]


def test_a_batch_whose_reply_was_lost_is_counted_once(tmp_path: Path) -> None:
    """Redis stops (SIGSTOP) with an update in flight: the call times out, and Redis applies the script once it runs
    again. The controller sends the same batch again at the next update; its costs and decisions count once (they
    used to be put back in the buffer and counted twice), and the decisions made meanwhile follow."""
    server = PersistentRedis(tmp_path)
    server.start()
    prefix = "tgtest:rt-lost-reply:"

    async def go() -> None:
        cfg = RoutingConfig(router_path=None, routed_tiers=["short", "long"], thresholds=[0.5],
                            target={"update_every": 10**6, "long_share": 0.5, "window": 100, "min_samples": 10})
        # the bound the stopped call times out at is every other call's too: 0.25 s timed out live commands on a
        # loaded box elsewhere in the suite (ed4ceb4, 34af34d), and here one would open the breaker before the pause
        handle = connect(RedisConfig(url=server.url, key_prefix=prefix, start_if_missing=False,
                                     socket_timeout_s=2.0))
        ctrl = TargetController(cfg, handle, Breaker(0.1), [0.5])
        try:
            ctrl.record(0.1, 0)
            await ctrl.update()  # connected, and the script loaded (a fresh server answers NOSCRIPT to EVALSHA)
            for i in range(20):
                ctrl.record(i / 20, int(i >= 10))
            ctrl.record_cost(1, 700)
            server.pause()
            try:
                await ctrl.update()  # times out: Redis has the batch, the reply is lost
            finally:
                server.resume()
            await asyncio.sleep(0.3)  # the breaker's cooldown
            assert ctrl.state.n == 1 and await handle.client.llen(prefix + "rt:win") == 21  # applied, unanswered
            for _ in range(5):
                ctrl.record(0.9, 1)
            ctrl.record_cost(1, 50)
            await ctrl.update()
            state = await handle.client.hgetall(prefix + "rt:state")
            assert state[b"cost:1"] == b"750" and state[b"cnt:1"] == b"2", state
            assert await handle.client.llen(prefix + "rt:win") == 26
            assert ctrl.state.n == 26
        finally:
            await handle.close()
            server.stop()

    asyncio.run(go())
