"""``thinkgate bench traces`` end to end on a hand-made traces folder: the real stack (Redis, replay upstream, two
gateway processes), the JSON contract, ledger costs equal to the recorded tokens at list prices, the cascade."""

from __future__ import annotations

import gzip
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.traces.bench import (
    Config,
    Run,
    Sent,
    TracesBenchError,
    check_router_ladder,
    plot,
    router_heldout_frac,
    run,
    served_block,
    token_shares,
)
from bench.traces.prices import price_of
from bench.traces.replay_upstream import estimate_prompt_tokens
from gateway.config import Prices, Settings
from gateway.ledger.pricing import cost_micro_usd
from gateway.pipeline.abstention import abstains
from router.fit.traces import parse_ladder
from router.model import TrainedRouter, length_prior
from router.persistence import load_router, save_router

MODEL = "o3-mini"  # a listed price: 1.10 in / 4.40 out USD per 1M tokens
N = 12


def questions() -> list[str]:
    return [f"Question {i}: which year did event number {i} happen" + " in the long history of it" * (i % 4) + "?"
            for i in range(N)]


def write(root: Path) -> Path:
    (root / "frames").mkdir(parents=True)
    qs = questions()
    rows: dict[str, list[dict[str, Any]]] = {
        "low_effort": [{"id": str(i), "question": q,
                        "response": "I don't know." if i % 3 == 0 else f"Answer: {1900 + i}", "thought": None,
                        "correct": i % 2 == 0 and i % 3 != 0, "grading": "A" if i % 2 else "B",
                        "reasoning_tokens": 10 + i, "completion_tokens": 20 + i} for i, q in enumerate(qs)],
        "high_effort": [{"id": str(i), "question": q, "response": f"Answer: {1900 + i}", "thought": "thinking " * i,
                         "correct": i % 4 != 1, "grading": "A", "reasoning_tokens": 500 + 10 * i,
                         "completion_tokens": 520 + 10 * i} for i, q in enumerate(qs)],
    }
    for s, rs in rows.items():
        with gzip.open(root / "frames" / f"{MODEL}__{s}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
    return root


def policy_router(path: Path) -> tuple[Path, float, float]:
    """A router file that is a whole policy (what ``router fit --traces`` writes): the length scorer served with
    the cascade at one threshold, the router alone at another. Returns (file, served cut, router-alone cut)."""
    scores = sorted(length_prior(q) for q in questions())
    served, alone = (scores[5] + scores[6]) / 2, (scores[2] + scores[3]) / 2
    meta = {"policy": "length", "ladder": {"model": MODEL, "settings": ["low_effort", "high_effort"]},
            "datasets": ["frames"], "router_thresholds": [alone], "cascade_thresholds": [served],
            "serving": {"policy": "length+cascade", "scorer": "length", "thresholds": [served],
                        "cascade": {"escalate_on": ["empty_answer", "length_in_thought", "abstain"],
                                    "rule": "router.abstention.abstains", "phrases": ["i don't know"]},
                        "guarantee": {"floor": 0.98, "delta": 0.1, "n_calibration": 12}}}
    return save_router(TrainedRouter(pipeline=None, scorer="length", thresholds=[served], metadata=meta), path), \
        served, alone


def test_bench_traces_end_to_end(tmp_path: Path, redis_url: str) -> None:
    traces = write(tmp_path / "traces")
    settings = Settings.load(None, engine={"enabled": False}, redis={"url": redis_url, "start_if_missing": False})
    router_file, served_cut, alone_cut = policy_router(tmp_path / "policy.skops")
    cfg = Config(traces, "frames", f"{MODEL}:low_effort,high_effort", router_file, concurrency=4,
                 time_budget_s=200, progress=False)
    report, details = run(cfg, settings, log=lambda _: None)
    assert set(report) == {"dataset", "ladder", "n_questions", "policies", "curves", "savings_at_98", "served",
                           "complete", "skipped"}
    assert report["complete"] is True and report["skipped"] == 0
    assert report["n_questions"] == N and details["complete"] and sum(details["errors"].values()) == 0
    assert sum(details["answer_mismatches"].values()) == 0, "every served answer is the answering tier's recording"
    pols = report["policies"]
    assert set(pols) == {"always:low_effort", "always:high_effort", "router", "random", "length", "router+cascade",
                         "auto", "oracle"}
    for p, e in pols.items():
        assert set(e) == {"accuracy", "completion_tokens", "reasoning_tokens", "cost_usd", "requests", "sent",
                          "tiers"}, p
        assert e["requests"] == e["sent"] == (0 if p == "oracle" else N)
    assert set(report["curves"]) == {"router", "router+cascade", "random", "length"}
    assert set(report["savings_at_98"]) == {"router", "router+cascade", "random", "length", "oracle"}

    # the ledger's cost is the recorded tokens at the model's list price, to the micro-dollar
    price = price_of(MODEL)
    prices = Prices(input_usd_per_mtok=price.input, cached_input_usd_per_mtok=price.cached_input,
                    output_usd_per_mtok=price.output)
    top = [520 + 10 * i for i in range(N)]
    micro = sum(cost_micro_usd(prices, prompt_tokens=estimate_prompt_tokens([{"role": "user", "content": q}]),
                               cached_tokens=0, completion_tokens=t) for q, t in zip(questions(), top, strict=True))
    assert Decimal(str(pols["always:high_effort"]["cost_usd"])) == Decimal(micro) / 1_000_000
    assert pols["always:high_effort"]["completion_tokens"] == sum(top)
    assert pols["always:high_effort"]["accuracy"] == pytest.approx(np.mean([i % 4 != 1 for i in range(N)]))

    # router+cascade: the questions routed cheap whose cheap answer abstains are escalated, both calls paid;
    # auto (a gateway with only the router file) does exactly the same, because the file says so
    router = load_router(router_file)
    assert details["cascade_thresholds"] == [served_cut] and details["router_thresholds"] == [alone_cut]
    cheap = [i for i, q in enumerate(questions()) if router.score(q) < served_cut]
    esc = [i for i in cheap if abstains("I don't know." if i % 3 == 0 else "Answer: x")]
    assert 0 < len(esc) < len(cheap)
    want = sum((20 + i) + ((520 + 10 * i) if i in esc else 0) for i in cheap) + sum(
        520 + 10 * i for i in range(N) if i not in cheap)
    for name in ("router+cascade", "auto"):
        assert details["escalations"][name] == len(esc), name
        assert pols[name]["completion_tokens"] == want, name
    # router alone serves the file's router-alone cut, no cascade
    alone = [i for i, q in enumerate(questions()) if router.score(q) < alone_cut]
    assert details["escalations"]["router"] == 0
    assert pols["router"]["completion_tokens"] == sum(20 + i for i in alone) + sum(
        520 + 10 * i for i in range(N) if i not in alone)
    # served: the deployable numbers, from the ledger's tokens and the recorded grading
    assert set(report["served"]) == {"router", "router+cascade", "auto"}
    top_acc = pols["always:high_effort"]["accuracy"]
    for name, e in report["served"].items():
        assert set(e) == {"accuracy_ratio", "token_share", "savings", "holds_floor", "n_questions"}
        assert e["n_questions"] == N
        share = pols[name]["completion_tokens"] / sum(top)
        assert e["token_share"] == pytest.approx(share, abs=1e-6)
        assert e["savings"] == pytest.approx(1 - share, abs=1e-6)
        assert e["accuracy_ratio"] == pytest.approx(pols[name]["accuracy"] / top_acc, abs=1e-6)
        assert e["holds_floor"] == (pols[name]["accuracy"] >= 0.98 * top_acc - 1e-12)
    assert report["served"]["auto"]["savings"] > 0
    # the oracle: cheapest correct setting, computed
    oracle = [0 if (i % 2 == 0 and i % 3 != 0) or i % 4 == 1 else 1 for i in range(N)]
    assert pols["oracle"]["tiers"]["low_effort"] == pytest.approx(oracle.count(0) / N, abs=1e-6)


def test_a_router_fitted_on_another_ladder_is_refused_before_anything_starts(tmp_path: Path) -> None:
    traces = write(tmp_path / "traces")
    other = save_router(TrainedRouter(pipeline=None, scorer="length", thresholds=[0.4], metadata={
        "policy": "length", "ladder": {"model": "Qwen3-14B", "settings": ["no_think", "exd0"]},
        "datasets": ["frames"]}), tmp_path / "q14.skops")
    settings = Settings.load(None, engine={"enabled": False}, redis={"url": "redis://127.0.0.1:1/0"})
    cfg = Config(traces, "frames", f"{MODEL}:low_effort,high_effort", other, progress=False)
    with pytest.raises(TracesBenchError, match="fitted on ladder Qwen3-14B:no_think,exd0, not o3-mini"):
        run(cfg, settings, log=lambda _: None)
    # a ladder given dearest first is refused too (its "always-top" would be the cheap setting)
    rev = Config(traces, "frames", f"{MODEL}:high_effort,low_effort", other, progress=False)
    with pytest.raises(TracesBenchError, match="not cheapest first"):
        run(rev, settings, log=lambda _: None)


def test_router_checks_transfer_note_and_the_files_heldout_share() -> None:
    lad = parse_ladder(f"{MODEL}:low_effort,high_effort")
    meta = {"ladder": {"model": MODEL, "settings": ["low_effort", "high_effort"]}, "datasets": ["simpleqa"],
            "heldout": {"frac": 0.5}}
    said: list[str] = []
    check_router_ladder(meta, lad, "frames", said.append)  # same ladder, other data set: allowed, said
    assert said == ["note: the router was fitted on simpleqa, not frames (transfer)"]
    check_router_ladder({"policy": "router"}, lad, "frames", said.append)  # the shipped routers: no ladder
    assert len(said) == 1
    assert router_heldout_frac(meta) == 0.5 and router_heldout_frac({}) == 0.2


def learned_router(path: Path) -> tuple[Path, dict[str, Any]]:
    """A router file whose served policy is the answer-aware cascade (what ``router fit --traces`` writes when
    the joint family certifies a point): every question starts cheap; the cheap answer escalates when it abstains
    or the model's P(wrong) ≥ its threshold. The model reads the router score and the usage's completion tokens,
    so the test fails if the gateway does not hand either to the features."""
    from router.escalation import FEATURES

    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("score")] = 40.0
    coef[FEATURES.index("completion_tokens")] = 8.0
    model = {"features": list(FEATURES), "mean": [0.0] * len(FEATURES), "scale": [1.0] * len(FEATURES),
             "coef": coef, "intercept": -41.5, "threshold": 0.5}
    meta = {"policy": "length", "ladder": {"model": MODEL, "settings": ["low_effort", "high_effort"]},
            "datasets": ["frames"], "router_thresholds": [0.0], "cascade_thresholds": [1.0],
            "serving": {"policy": "length+escalation", "scorer": "length", "thresholds": [1.0],
                        "cascade": {"escalate_on": ["empty_answer", "length_in_thought", "abstain", "learned"],
                                    "rule": "router.abstention.abstains or router.escalation.should_escalate",
                                    "phrases": ["i don't know"], "models": {"low_effort": model}},
                        "guarantee": {"floor": 0.98, "delta": 0.1, "n_calibration": 12, "cross_fitted": True}}}
    return save_router(TrainedRouter(pipeline=None, scorer="length", thresholds=[1.0], metadata=meta), path), model


def test_a_gateway_with_only_the_file_escalates_as_its_learned_model_says(tmp_path: Path, redis_url: str) -> None:
    """Gateway C (``auto``: nothing but ``routing.router_path``) escalates exactly the cheap answers the file's
    escalation model flags on the fit-time features of the recorded answers (router.fit.escalation_fit.tier_features),
    plus the abstentions; both calls paid."""
    from router.escalation import should_escalate
    from router.fit.escalation_fit import tier_features
    from router.fit.traces import load_ladder

    traces = write(tmp_path / "traces")
    settings = Settings.load(None, engine={"enabled": False}, redis={"url": redis_url, "start_if_missing": False})
    router_file, model = learned_router(tmp_path / "learned.skops")
    cfg = Config(traces, "frames", f"{MODEL}:low_effort,high_effort", router_file, concurrency=4,
                 time_budget_s=200, progress=False)
    report, details = run(cfg, settings, log=lambda _: None)
    assert details["complete"] and sum(details["errors"].values()) == 0
    data = load_ladder(traces, "frames", f"{MODEL}:low_effort,high_effort")
    router = load_router(router_file)
    scores = np.array([router.score(q) for q in data.questions])
    X = tier_features(data, 0, scores, ["i don't know"])
    esc = [i for i in range(data.n) if abstains(data.responses[i][0], ["i don't know"]) or should_escalate(model, X[i])]
    learned_only = [i for i in esc if not abstains(data.responses[i][0], ["i don't know"])]
    assert len(learned_only) > 0 and len(esc) < data.n, "the model (not only the phrases) decides some questions"
    assert details["escalations"]["auto"] == len(esc)
    want = float(data.tokens[:, 0].sum() + data.tokens[esc, 1].sum())
    assert report["policies"]["auto"]["completion_tokens"] == want


SETTINGS = ("low_effort", "high_effort")


def _run(policy: str, answered: dict[int, str]) -> Run:
    r = Run(policy, f"k-{policy}", "s")
    r.sent = [Sent(q, 200, tier) for q, tier in answered.items()]
    return r


def test_served_is_measured_on_the_questions_a_cut_run_answered() -> None:
    """A policy the time budget cut (8 of 10 questions sent, all answered by the top setting) costs what always-top
    cost on those 8 — savings 0, not the 20% a partial ledger over the whole always-top total reads; a policy that
    answered nothing has no served figures (None), not savings 1.0."""
    n = 10
    correct = np.zeros((n, 2), dtype=bool)
    correct[:, 1] = [True] * 7 + [False] * 3
    top_tokens = np.full(n, 100.0)
    runs = {"router+cascade": _run("router+cascade", {q: "high_effort" for q in range(8)}), "auto": _run("auto", {}),
            "router": _run("router", {q: "high_effort" for q in range(n)})}
    policies = {"router+cascade": {"completion_tokens": 800}, "auto": {"completion_tokens": 0},
                "router": {"completion_tokens": 1000}}
    sv = served_block(runs, policies, correct, top_tokens, SETTINGS)
    cut = sv["router+cascade"]
    assert cut["n_questions"] == 8 and cut["token_share"] == 1.0 and cut["savings"] == 0.0
    assert cut["accuracy_ratio"] == 1.0 and cut["holds_floor"] is True
    assert sv["auto"] == {"accuracy_ratio": None, "token_share": None, "savings": None, "holds_floor": None,
                          "n_questions": 0}
    assert sv["router"]["n_questions"] == n and sv["router"]["savings"] == 0.0
    # the console's token-share column: the same questions (it read 80% for the cut run, over all ten)
    shares = token_shares(runs, {**policies, "oracle": {"completion_tokens": 250}}, top_tokens, SETTINGS)
    assert shares == {"router+cascade": 1.0, "auto": None, "router": 1.0, "oracle": 0.25}


def test_served_accuracy_ratio_is_exact_for_a_policy_identical_to_always_top() -> None:
    """Ratio from counts (Σ correct / Σ always-top correct): 1.0 exactly, not a rounded accuracy over an unrounded
    one (1/3 rounds to 0.333333, and 0.333333 / 0.3333… = 0.999999)."""
    n = 3
    correct = np.array([[False, True], [False, False], [False, False]])
    runs = {"router": _run("router", {q: "high_effort" for q in range(n)})}
    sv = served_block(runs, {"router": {"completion_tokens": 300}}, correct, np.full(n, 100.0), SETTINGS)
    assert sv["router"]["accuracy_ratio"] == 1.0 and sv["router"]["holds_floor"] is True


def test_an_output_that_cannot_be_written_fails_before_the_run(tmp_path: Path) -> None:
    """--json / --png / --markdown are checked before anything starts (the router file here does not exist: the run
    would fail on it first): one line, exit 2, naming the flag — they were tracebacks after a minutes-long run."""
    from typer.testing import CliRunner

    from gateway.cli.main import app

    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["bench", "traces", "--traces", str(tmp_path), "--dataset", "frames", "--ladder", f"{MODEL}:low_effort,"
            "high_effort", "--router", str(tmp_path / "none.skops")]
    for flag, out in (("--json", afile / "x.json"), ("--png", tmp_path), ("--markdown", Path("/proc/x.md"))):
        res = CliRunner().invoke(app, [*base, flag, str(out)])
        assert res.exit_code == 2, res.output
        assert f"bench traces: {flag}: " in res.output and "Traceback" not in res.output, res.output


def test_policies_served_at_one_point_share_one_label_on_the_plot(tmp_path: Path) -> None:
    """A new user's o3-mini plot printed "router", "router+cascade", "random", "length" and "always:high_effort" on
    top of each other at one point: now one label names them all, and a point of its own keeps its own."""
    same = {"accuracy": 0.383}
    report = {"dataset": "frames", "ladder": "o3-mini:low_effort,high_effort", "n_questions": 4,
              "curves": {"router": [(0.0, 0.3), (1.0, 0.383)]}, "savings_at_98": {"router": 0.0},
              "policies": {"always:high_effort": same, "router": same, "length": same, "auto": {"accuracy": 0.39}}}
    details = {"token_share": {"always:high_effort": 1.0, "router": 1.0, "length": 1.0, "auto": 0.7},
               "always_top_accuracy": 0.383}
    labels = plot(report, details, tmp_path / "p.png")
    assert sorted(labels) == ["always:high_effort = router = length", "auto"]
    assert (tmp_path / "p.png").stat().st_size > 0
