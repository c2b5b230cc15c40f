"""Learn-then-Test thresholds (router/fit/risk.py) on synthetic data where the truth is known: the quality floor holds
on the population at the stated rate over many seeds, and it does not when the bound is removed (point estimate)."""

from __future__ import annotations

import numpy as np
import pytest

from router.fit.risk import binom_cdf, certify, floor_pvalue, point_estimate

FLOOR, DELTA = 0.98, 0.1
CUTS = np.linspace(0.0, 1.0, 41)  # candidate thresholds: questions with score < t go to the cheap tier


P_TOP = 0.6  # the top tier's accuracy, independent of the score


def p_cheap_given_top(s: np.ndarray, top: np.ndarray) -> np.ndarray:
    # the cheap tier mostly agrees with the top one: it loses a top-right answer with probability 0.3·s (easy,
    # low-score questions rarely) and wins a top-wrong one with probability 0.05
    return np.where(top, 1.0 - 0.3 * s, 0.05)


def p_cheap_right(s: np.ndarray) -> np.ndarray:
    return P_TOP * (1.0 - 0.3 * s) + (1 - P_TOP) * 0.05
TOK_CHEAP, TOK_TOP = 1.0, 10.0


def draw(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    s = rng.random(n)
    top = rng.random(n) < P_TOP
    cheap = rng.random(n) < p_cheap_given_top(s, top)
    return s, top, cheap, rng.random(n)


def true_ratio(t: float) -> float:
    """Population accuracy of threshold t / always-top accuracy (exact integral over s ~ U(0, 1))."""
    grid = np.linspace(0.0, 1.0, 20001)
    acc = np.where(grid < t, p_cheap_right(grid), P_TOP).mean()
    return float(acc / P_TOP)


def points(s: np.ndarray, top: np.ndarray, cheap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    down = s[None, :] < CUTS[:, None]
    correct = np.where(down, cheap[None, :], top[None, :])
    tokens = np.where(down, TOK_CHEAP, TOK_TOP).sum(axis=1)
    return correct, tokens.astype(np.float64)


def test_binomial_cdf_is_exact() -> None:
    from math import comb

    for n, k, p in ((10, 3, 0.5), (25, 0, 0.505), (7, 6, 0.2)):
        assert binom_cdf(k, n, p) == pytest.approx(sum(comb(n, j) * p**j * (1 - p)**(n - j) for j in range(k + 1)))
    assert binom_cdf(0, 0, 0.5) == 1.0 and binom_cdf(-1, 5, 0.5) == 0.0


def test_pvalue_is_small_only_when_the_point_loses_nothing() -> None:
    top = np.array([True] * 50 + [False] * 50)
    u = np.full(100, 0.5)
    same = top.copy()
    assert floor_pvalue(top, same, u) == 1.0, "no changed answer: no evidence either way"
    better = top.copy()
    better[50:70] = True  # gains 20, loses none
    assert floor_pvalue(top, better, u) < 1e-5
    worse = top.copy()
    worse[:20] = False
    assert floor_pvalue(top, worse, u) == 1.0


def test_the_floor_holds_at_the_stated_rate_and_fails_without_the_bound() -> None:
    seeds, n = 300, 400
    ltt_bad = plain_bad = 0
    ltt_saved = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        fs, ft, fc, fu = draw(rng, n)
        cs, ct, cc, cu = draw(rng, n)
        f_cor, f_tok = points(fs, ft, fc)
        c_cor, c_tok = points(cs, ct, cc)
        cert = certify(f_cor, f_tok, ft, fu, c_cor, c_tok, ct, float(TOK_TOP * n), cu, delta=DELTA, floor=FLOOR)
        if cert.index is not None:
            ltt_bad += true_ratio(float(CUTS[cert.index])) < FLOOR
            ltt_saved.append(1 - cert.token_share)
        j = point_estimate(c_cor, c_tok, ct, FLOOR)
        plain_bad += j is not None and true_ratio(float(CUTS[j])) < FLOOR
    # the stated rate, with room for the Monte-Carlo error of 300 seeds (3 standard errors)
    assert ltt_bad / seeds <= DELTA + 3 * np.sqrt(DELTA * (1 - DELTA) / seeds)
    assert plain_bad / seeds > 0.3, "the point estimate breaks the floor on unseen traffic far more often than δ"
    assert len(ltt_saved) > seeds / 2 and np.mean(ltt_saved) > 0.1, "and the guarantee still routes"


def _joint_data(rng: np.random.Generator, n: int) -> tuple[object, np.ndarray, np.ndarray]:
    """A synthetic two-tier ladder for the joint family: router score s, cheap/top outcomes as above, and an
    escalation P(wrong) that is informative but noisy (wrong answers score 0.45 higher on average)."""
    from router.fit.traces import Ladder, LadderData

    s, top, cheap, _ = draw(rng, n)
    probs = np.clip(0.45 * ~cheap + 0.55 * rng.random(n), 0.0, 1.0)[:, None]
    data = LadderData(Ladder("m", ("a", "b")), [str(i) for i in range(n)], ["d"] * n, [""] * n,
                      np.c_[cheap, top], np.c_[np.full(n, TOK_CHEAP), np.full(n, TOK_TOP)],
                      np.full((n, 2), np.nan), [["", ""]] * n)
    return data, s, probs


def test_the_joint_family_holds_its_floor_and_fails_without_the_bound() -> None:
    """router.fit.escalation_fit: the fixed sequence over (router share, escalation rate) certifies points whose
    *population* ratio (a fresh 200,000-question sample at the same cuts) keeps the floor at the stated rate;
    the cheapest point of the same family that merely meets the floor on the calibration questions does not."""
    from router.fit.escalation_fit import certify_joint, joint_outcome, joint_points
    from router.fit.risk import slack_uniforms

    big, bs, bp = _joint_data(np.random.default_rng(10_000), 200_000)
    big_top = float(big.correct[:, 1].mean())  # type: ignore[attr-defined]

    def true_joint(cut: float, cuts: list[float]) -> float:
        _, c, _ = joint_outcome(bs, bp, big, cut, cuts)  # type: ignore[arg-type]
        return float(c.mean()) / big_top

    seeds, n = 200, 400
    ltt_bad = plain_bad = certified = 0
    for seed in range(seeds):
        data, s, probs = _joint_data(np.random.default_rng(seed), n)
        pts = joint_points(s, probs, data, slack_uniforms([str(i) for i in range(n)]), FLOOR)  # type: ignore[arg-type]
        best, _ = certify_joint(pts, DELTA)
        if best is not None:
            certified += 1
            ltt_bad += true_joint(pts[best].router_cut, pts[best].escalation_cuts) < FLOOR
        top_acc = float(data.correct[:, 1].mean())  # type: ignore[attr-defined]
        ok = [p for p in pts if p.correct.mean() >= FLOOR * top_acc - 1e-12]
        if ok:
            p = min(ok, key=lambda q: q.tokens)
            plain_bad += true_joint(p.router_cut, p.escalation_cuts) < FLOOR
    assert ltt_bad / seeds <= DELTA + 3 * np.sqrt(DELTA * (1 - DELTA) / seeds)
    assert plain_bad / seeds > 2 * DELTA, "without the bound the joint family breaks the floor far more often"
    assert certified > seeds / 4, "and the guarantee still routes"


def test_a_certified_point_dearer_than_always_top_is_not_served() -> None:
    """A point that keeps the floor (here: more accurate, by gaining 20 answers) but spends more tokens than always
    top — a cascade that calls both tiers — is rejected by the test yet never worth serving: always top (None)."""
    from router.fit.escalation_fit import JointPoint, certify_joint

    top = np.array([True] * 50 + [False] * 50)
    better = top.copy()
    better[50:70] = True
    u = np.full(100, 0.5)
    correct = np.stack([better, better])
    for dear, expect in ((1000.0, None), (900.0, 1)):
        c = certify(correct, np.array([2000.0, dear]), top, u, correct, np.array([2000.0, dear]), top, 950.0, u)
        assert c.index == expect and (expect is not None or c.rejected == 2), (dear, c)
    pv = floor_pvalue(top, better, u)
    pts = [JointPoint(0.0, 0.5, 1.0, [1.0], better, tokens, pv, 0, 20) for tokens in (2000.0, 1000.0)]
    assert certify_joint(pts, DELTA, 950.0) == (None, 2)
    assert certify_joint(pts, DELTA, 1500.0) == (1, 2)
