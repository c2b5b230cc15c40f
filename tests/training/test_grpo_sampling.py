"""Dynamic sampling: keeps informative groups, refills, pads, skips predicted prompts, stops cleanly."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from training.grpo.config import DynamicSamplingConfig
from training.grpo.sampling import Candidate, DynamicSampler, NoLearningSignalError, PassRateHistory, ScoredGroup

G = 4


def pool(n: int) -> list[Candidate]:
    return [Candidate(f"p{i}") for i in range(n)]


def fake_rollout(
    outcome: Callable[[str], int], calls: list[list[str]]
) -> Callable[[list[Candidate]], list[ScoredGroup]]:
    """``outcome(pid)`` = solved rollouts out of G; a group has signal iff 0 < solved < G."""

    def rollout(cands: list[Candidate]) -> list[ScoredGroup]:
        calls.append([str(c.pid) for c in cands])
        out = []
        for c in cands:
            k = outcome(str(c.pid))
            out.append(ScoredGroup(c.pid, 0 < k < G, G, k))
        return out

    return rollout


def idx(pid: str) -> int:
    return int(pid[1:])


def test_keeps_signal_groups_and_refills() -> None:
    cfg = DynamicSamplingConfig(enabled=True, max_rounds=5, oversample=1.5, seed=1)
    s = DynamicSampler(cfg, pool(20))
    calls: list[list[str]] = []
    # even prompts are informative (2/4 solved), odd ones all solved
    res = s.fill(4, pool(4), fake_rollout(lambda p: 2 if idx(p) % 2 == 0 else G, calls))
    assert len(res.groups) == 4
    assert all(g.has_signal for g in res.groups)
    assert res.padded == 0
    assert calls[0] == ["p0", "p1", "p2", "p3"]  # the dataloader's batch goes first
    assert len(calls) == res.rounds >= 2
    assert calls[1] and len(calls[1]) == 3  # ceil(2 missing * 1.5)
    rolled = [p for c in calls for p in c]
    assert len(rolled) == len(set(rolled))  # no prompt twice in one batch
    assert res.rolled_groups == len(rolled)
    assert res.signal_groups - res.extra_signal_dropped == 4
    assert res.dropped == res.rolled_groups - res.signal_groups  # every zero-variance group is dropped
    assert len({g.pid for g in res.groups}) == 4


def test_pads_with_zero_variance_groups_when_rounds_run_out() -> None:
    cfg = DynamicSamplingConfig(enabled=True, max_rounds=2, oversample=1.0, skip_predicted=False)
    s = DynamicSampler(cfg, pool(10))
    calls: list[list[str]] = []
    res = s.fill(4, pool(4), fake_rollout(lambda p: 1 if p == "p0" else 0, calls))
    assert len(calls) == 2  # bounded by max_rounds
    assert [g.has_signal for g in res.groups] == [True, False, False, False]
    assert res.groups[0].pid == "p0"
    assert res.padded == 3
    assert res.rolled_groups == 4 + 3  # round 2 rolled the 3 missing (oversample 1.0)
    assert res.dropped == res.rolled_groups - 1 - 3


@pytest.mark.parametrize(("solved", "word"), [(G, "all solved"), (0, "all failed")])
def test_stops_cleanly_when_nothing_has_signal(solved: int, word: str) -> None:
    cfg = DynamicSamplingConfig(enabled=True, max_rounds=3, oversample=2.0, skip_predicted=False)
    s = DynamicSampler(cfg, pool(50))
    calls: list[list[str]] = []
    with pytest.raises(NoLearningSignalError, match=word):
        s.fill(4, pool(4), fake_rollout(lambda p: solved, calls))
    assert len(calls) == 3  # max_rounds rollout rounds, then a clear error — not an endless refill


def test_all_solved_pool_stops_before_rolling_out_when_predicted() -> None:
    cfg = DynamicSamplingConfig(enabled=True, max_rounds=10, skip_after=1, skip_probability=1.0)
    s = DynamicSampler(cfg, pool(6))
    calls: list[list[str]] = []
    with pytest.raises(NoLearningSignalError):
        s.fill(2, pool(2), fake_rollout(lambda p: G, calls))
    n_rounds = len(calls)
    assert n_rounds <= 10
    # every prompt has now been seen zero-variance once: all predicted solved -> the pool refuses immediately
    calls.clear()
    with pytest.raises(NoLearningSignalError, match="predicted zero-variance"):
        s.fill(2, pool(2), fake_rollout(lambda p: G, calls))
    assert calls == []


def test_skip_predicted_solved_and_keep_share_of_hard() -> None:
    cfg = DynamicSamplingConfig(enabled=True, skip_after=2, skip_probability=1.0, hard_keep_share=0.0)
    s = DynamicSampler(cfg, pool(4))
    s.history.observe("p0", G, G, False)
    assert not s.should_skip("p0")  # one zero-variance group is not yet a prediction
    s.history.observe("p0", G, G, False)
    assert s.history.prediction("p0") == "solved"
    assert s.should_skip("p0")
    s.history.observe("p1", G, 0, False)
    s.history.observe("p1", G, 0, False)
    assert s.history.prediction("p1") == "failed"
    assert s.should_skip("p1")  # hard_keep_share 0: hard prompts skipped too
    s.cfg = DynamicSamplingConfig(enabled=True, skip_after=2, skip_probability=1.0, hard_keep_share=1.0)
    assert not s.should_skip("p1")  # hard_keep_share 1: always kept
    s.history.observe("p0", G, 2, True)  # a group with signal resets the streak
    assert s.history.prediction("p0") is None
    assert not s.should_skip("p0")


def test_hard_keep_share_is_a_share() -> None:
    cfg = DynamicSamplingConfig(enabled=True, skip_after=1, hard_keep_share=0.25, seed=3)
    s = DynamicSampler(cfg, pool(2))
    s.history.observe("p0", G, 0, False)
    kept = sum(not s.should_skip("p0") for _ in range(4000))
    assert 0.22 < kept / 4000 < 0.28


def test_prefilter_skips_then_tops_up_from_pool() -> None:
    cfg = DynamicSamplingConfig(enabled=True, skip_after=1, skip_probability=1.0, max_rounds=1, seed=0)
    s = DynamicSampler(cfg, pool(8))
    s.history.observe("p0", G, G, False)  # predicted solved -> skipped before rollout
    calls: list[list[str]] = []
    res = s.fill(2, [Candidate("p0"), Candidate("p1")], fake_rollout(lambda p: 2, calls))
    assert res.skipped == 1
    assert "p0" not in calls[0] and "p1" in calls[0] and len(calls[0]) == 2  # topped up to the batch size
    assert len(res.groups) == 2 and all(g.has_signal for g in res.groups)


def test_pass_rate_history() -> None:
    h = PassRateHistory(skip_after=2)
    assert h.pass_rate("x") is None
    h.observe("x", 4, 1, True)
    h.observe("x", 4, 3, True)
    assert h.pass_rate("x") == pytest.approx(0.5)
    h.observe("y", 4, 2, False)
    h.observe("y", 4, 2, False)
    assert h.prediction("y") == "flat"  # constant total reward with a mixed pass rate (e.g. only length varies)


def test_state_roundtrip_reproduces_draws() -> None:
    cfg = DynamicSamplingConfig(enabled=True, seed=7)
    a = DynamicSampler(cfg, pool(30))
    a.history.observe("p3", G, G, False)
    a.draw(5)
    state = a.state_dict()
    b = DynamicSampler(cfg, pool(30))
    b.load_state_dict(state)
    assert [c.pid for c in a.draw(12)[0]] == [c.pid for c in b.draw(12)[0]]
    assert b.history.records["p3"].solved == G


def test_draw_is_bounded_and_excludes() -> None:
    s = DynamicSampler(DynamicSamplingConfig(enabled=True), pool(3))
    got, skipped = s.draw(10, exclude={"p0"})
    assert sorted(str(c.pid) for c in got) == ["p1", "p2"]  # only what the pool has, no repeats
    assert skipped == 0
