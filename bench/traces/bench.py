"""``thinkgate bench traces``: recorded reasoning-model outcomes replayed through the real gateway, per policy.

    thinkgate bench traces --traces DIR --dataset frames --ladder Qwen3-14B:no_think,exd0 --router FILE \\
        --json OUT.json [--png OUT.png] [--heldout-only | --all] [--markdown OUT.md]

What runs (all on loopback). Redis (the configured one when it answers, else a private ``redis-server``), the
trace-replay upstream (:mod:`bench.traces.replay_upstream`, one process serving every setting of the ladder
as ``MODEL:SETTING``) and two ``thinkgate serve`` processes (engine off, cache off so every request is paid,
their own Redis key prefix, deleted afterwards), each with one tier per ladder setting, cheapest first, named
after the setting, priced at the model's list price (:mod:`bench.traces.prices`; a nominal price where there
is none, said in the output), and the router file as ``routing.router_path`` with ``routed_tiers`` = the
ladder (its calibrated thresholds apply). Gateway B differs only in the cascade: every tier but the top has
``escalate_on: [empty_answer, length_in_thought, abstain]``. Gateway C is a gateway with nothing but the router
file (``routing.router_path``, no thresholds, no ``escalate_on``): it serves the file's policy (``auto``).

Questions: every question of ``DIR/<dataset>`` that all the ladder's settings recorded
(:func:`router.fit.traces.load_ladder`), or with ``--heldout-only`` only those of the router's held-out split
(:func:`router.fit.traces.is_heldout`). Each is sent as the only (user) message, bare, non-streamed.

Policies (each with its own API key, so the ledger separates them):

==================  =========================================================================  =======
policy              what is sent                                                               gateway
==================  =========================================================================  =======
``always:<s>``      ``model: <s>`` for every question                                          A
``router``          ``model: auto`` (the router file picks the tier)                           A
``random``          ``model: <s>`` drawn at random (seeded) at the tier mix ``router`` served  A
``length``          ``model: <s>`` by prompt-length rank (longest → top) at that same mix      A
``router+cascade``  ``model: auto``; abstaining/empty/cut cheap answers escalate               B
``auto``            ``model: auto`` on a gateway with only the router file: its served policy  C
                    (thresholds, cascade or not), no tier ``escalate_on``, no thresholds
``oracle``          not served: the cheapest setting whose recorded answer is correct (else
                    the cheapest), computed from the traces with the always replays' tokens
==================  =========================================================================  =======

Per policy, from the **metering ledger** (the gateway's Redis usage stream, read back by key and time window):
``completion_tokens`` and ``reasoning_tokens`` (sums over every upstream call, escalated first attempts
included), ``cost_usd`` (Σ ``cost_micro_usd`` / 10⁶ — never recomputed), ``requests`` (answered client
requests) and ``tiers`` (share of requests answered by each setting). ``accuracy``: the recorded grading of the
setting that answered each question (``x-thinkgate-tier``); the served answer is checked to be that setting's
recording. Curves (``[token_share, accuracy]``, token_share = tokens / always-top tokens) over every threshold:
``router`` and ``length`` (:func:`router.fit.ladder_eval.threshold_curve` on the router file's scores / the
prompt lengths), ``router+cascade`` (:func:`router.fit.ladder_eval.cascade_curve`, abstention by the serving
rule :func:`gateway.pipeline.abstention.abstains` on the served answers) and ``random`` (expected, every mix),
all built from the per-question ledger tokens of the ``always:<s>`` replays and the recorded grading;
``savings_at_98`` = :func:`router.fit.ladder_eval.savings_at_98` of each curve (the oracle: its one point).

JSON (``--json``), exactly::

    {"dataset", "ladder", "n_questions", "complete", "skipped",
     "policies": {NAME: {"accuracy", "completion_tokens", "reasoning_tokens", "cost_usd", "requests", "sent",
                         "tiers": {SETTING: share}}},
     "curves": {NAME: [[token_share, accuracy], ...]}, "savings_at_98": {NAME: float},
     "served": {NAME: {"accuracy_ratio", "token_share", "savings", "holds_floor", "n_questions"}}}

``savings_at_98`` is the **curve metric** (each curve's best threshold picked on the questions it scores);
``served`` is the deployable number: ``router``, ``router+cascade`` and ``auto`` at the thresholds their gateway
served, over the ``n_questions`` questions the policy answered and against always-top on those same questions:
accuracy_ratio = Σ correct / Σ always-top correct, token_share = completion tokens / always-top's (ledger),
savings = 1 − token_share, holds_floor = Σ correct ≥ 98% of Σ always-top correct (None, all four, for a policy
that answered nothing). ``sent``: the requests a policy sent before the time budget ran out (the oracle: 0, it
is computed).

Time: the whole run is bounded by ``--time-budget-s`` (default 280 s, under 5 minutes with start-up); requests
not sent by then are skipped, the run says so and exits 1 (the JSON is still written, with what was measured,
``"complete": false`` and ``"skipped"``: the requests not sent, over all policies).
"""

from __future__ import annotations

import os
import random
import secrets
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import typer

from bench._lib.redis_keys import bench_redis
from bench.traces.prices import ListPrice, price_of
from bench.traces.replay_upstream import ReplayProcess
from gateway.config import Settings
from gateway.ledger.event import UsageEvent
from gateway.ledger.report import counts_as_request
from gateway.pipeline.abstention import abstains
from router.fit.ladder_eval import cascade_curve, random_curve, savings_at_98, threshold_curve
from router.fit.traces import (
    HELDOUT_FRAC,
    Ladder,
    LadderData,
    check_cheapest_first,
    heldout_mask,
    load_ladder,
    parse_ladder,
)

CASCADE_ON = ["empty_answer", "length_in_thought", "abstain"]
REQUEST_TIMEOUT_S = 60.0
MAX_TOKENS = 1_000_000  # tiers never cut a recording (the replay ignores max_tokens anyway)


class TracesBenchError(RuntimeError):
    """The bench could not run (bad arguments, a missing file, a stack part that did not start)."""


@dataclass
class Sent:
    """One client request: question index, HTTP status, the answering tier, the answer, request id, score."""

    q: int
    status: int
    tier: str | None = None
    content: str | None = None
    request_id: str | None = None
    difficulty: float | None = None


@dataclass
class Run:
    """One served policy: its key, window (epoch s), requests and ledger events."""

    policy: str
    key_id: str
    secret: str
    url: str = ""
    t_start: float = 0.0
    t_end: float = 0.0
    sent: list[Sent] = field(default_factory=list)
    events: list[UsageEvent] = field(default_factory=list)
    skipped: int = 0


# ----------------------------------------------------------------------------------------------- the stack


def tier_configs(model: str, settings: tuple[str, ...], base_url: str, price: ListPrice,
                 cascade: bool | None) -> list[dict[str, Any]]:
    """One tier per setting, cheapest first, on the replay upstream; the cascade on every tier but the top
    (``cascade=None``: no ``escalate_on`` at all, so the router file's policy decides)."""
    out = []
    for i, s in enumerate(settings):
        t: dict[str, Any] = {"name": s, "base_url": base_url, "model": f"{model}:{s}", "max_tokens": MAX_TOKENS,
                             "budget_mode": "off", "thinking_budget": None, "prices": price.as_config(),
                             "read_timeout_s": REQUEST_TIMEOUT_S, "max_retries": 0}
        if cascade is not None:
            t["escalate_on"] = list(CASCADE_ON) if cascade and i < len(settings) - 1 else []
        out.append(t)
    return out


def gateway_config(base: Settings, tiers: list[dict[str, Any]], router_path: Path, keys: list[dict[str, Any]],
                   prefix: str, state_dir: Path, name: str, thresholds: list[float] | None = None) -> dict[str, Any]:
    """The YAML dict of one bench gateway (module doc): ``base`` with engine and cache off, the ladder's tiers,
    the router file (its own thresholds, or ``thresholds``), the bench keys, a private Redis key prefix and spool.
    A tier dict without ``escalate_on`` leaves the cascade to the router file (gateway ``auto``)."""
    names = [t["name"] for t in tiers]
    data = base.model_dump(mode="json")
    data["engine"]["enabled"] = False
    data["tiers"] = tiers
    efforts = {"none": names[0], "minimal": names[0], "low": names[0], "medium": names[len(names) // 2],
               "high": names[-1]}
    data["routing"] = {**data["routing"], "router_path": str(router_path.resolve()), "routed_tiers": names,
                       "default_tier": names[-1], "thresholds": thresholds, "on_router_error": "refuse_start",
                       "effort_tiers": efforts}
    data["redis"] = {**data["redis"], "key_prefix": prefix, "start_if_missing": False,
                     "socket_timeout_s": max(float(data["redis"]["socket_timeout_s"]), 2.0)}
    data["cache"] = {**data["cache"], "mode": "off"}
    data["cache"]["semantic"] = {**data["cache"].get("semantic", {}), "enabled": False}
    data["auth"] = {**data["auth"], "keys": keys, "admin_key_sha256": None}
    data["server"] = {**data["server"], "log_level": "warning"}
    data["metering"] = {**data["metering"], "spool_path": str(state_dir / f"spool-{name}.jsonl")}
    return data


# -------------------------------------------------------------------------------------------- requests


def send_all(run: Run, questions: list[str], order: list[int], models: list[str], concurrency: int,
             deadline: float, tick: Callable[[], None]) -> None:
    """Send question ``order[i]`` with ``model: models[i]``, ``concurrency`` in flight; window recorded."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"authorization": f"Bearer {run.secret}"}

    def one(client: httpx.Client, i: int) -> Sent:
        q = order[i]
        if time.monotonic() > deadline:
            tick()
            return Sent(q, -1)
        body = {"model": models[i], "messages": [{"role": "user", "content": questions[q]}]}
        try:
            r = client.post(run.url + "/v1/chat/completions", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except httpx.HTTPError:
            tick()
            return Sent(q, 0)
        content = None
        if r.status_code == 200:
            try:
                content = r.json()["choices"][0]["message"].get("content") or ""
            except (ValueError, KeyError, IndexError):
                content = None
        d = r.headers.get("x-thinkgate-difficulty")
        tick()
        return Sent(q, r.status_code, r.headers.get("x-thinkgate-tier"), content, r.headers.get("x-request-id"),
                    float(d) if d else None)

    with httpx.Client(limits=limits, trust_env=False) as client, ThreadPoolExecutor(concurrency) as pool:
        run.t_start = time.time()
        run.sent = list(pool.map(lambda i: one(client, i), range(len(order))))
        run.t_end = time.time()
    run.skipped = sum(1 for s in run.sent if s.status == -1)
    run.sent = [s for s in run.sent if s.status != -1]


def settle(ledger: Any, run: Run, timeout_s: float = 20.0) -> None:
    """Read the run's events once metering has written them all (each answered request has ≥ 1 event)."""
    want = sum(1 for s in run.sent if s.status > 0)
    deadline = time.monotonic() + timeout_s
    last = -1
    while True:
        evs = ledger.events(run.t_start - 0.05, run.t_end + 0.05, {run.key_id})
        if (len(evs) >= want and len(evs) == last) or time.monotonic() > deadline:
            run.events = evs
            return
        last = len(evs)
        time.sleep(0.3)


# ------------------------------------------------------------------------------------------- summaries


def tier_mix(choice: np.ndarray, k: int) -> list[int]:
    """Counts per setting index."""
    return [int(np.sum(choice == j)) for j in range(k)]


def random_choice(n: int, counts: list[int], seed: int) -> np.ndarray:
    """Setting indices with exactly ``counts`` of each, in a seeded random order."""
    ch = np.repeat(np.arange(len(counts)), counts).tolist()
    random.Random(seed).shuffle(ch)
    return np.asarray(ch, dtype=np.int64)[:n]


def length_choice(lengths: np.ndarray, counts: list[int]) -> np.ndarray:
    """Setting indices by prompt-length rank (shortest → cheapest) with ``counts`` of each."""
    order = np.argsort(lengths, kind="stable")
    ch = np.empty(len(lengths), dtype=np.int64)
    ch[order] = np.repeat(np.arange(len(counts)), counts)
    return ch


def summarize(run: Run, data: LadderData, settings: tuple[str, ...]) -> dict[str, Any]:
    """The policy's JSON entry (module doc) from its requests and ledger events."""
    idx = {s: j for j, s in enumerate(settings)}
    ok = [s for s in run.sent if s.status == 200 and s.tier in idx]
    acc = sum(bool(data.correct[s.q, idx[s.tier or ""]]) for s in ok) / len(ok) if ok else 0.0
    upstream = [e for e in run.events if not e.cached]
    answered = [e for e in run.events if counts_as_request(e)]
    counts = Counter(e.tier for e in answered)
    n = len(answered)
    return {
        "accuracy": round(acc, 6),
        "completion_tokens": sum(e.completion_tokens for e in upstream),
        "reasoning_tokens": sum(e.reasoning_tokens for e in upstream),
        "cost_usd": sum(e.cost_micro_usd for e in run.events) / 1_000_000,
        "requests": n,
        "tiers": {s: round(counts.get(s, 0) / n, 6) if n else 0.0 for s in settings},
        "sent": len(run.sent),
    }


def check_answers(run: Run, data: LadderData, settings: tuple[str, ...]) -> int:
    """How many served answers differ from the recording of the setting that answered (should be 0)."""
    idx = {s: j for j, s in enumerate(settings)}
    return sum(1 for s in run.sent if s.status == 200 and s.tier in idx
               and (s.content or "") != data.responses[s.q][idx[s.tier or ""]])


def per_question_tokens(runs: dict[str, Run], data: LadderData, settings: tuple[str, ...]) -> np.ndarray:
    """(n, k) completion tokens of each question on each setting, from the always replays' ledger events
    (matched by request id); the recorded count where an event is missing (a skipped request)."""
    tok = data.tokens.copy()
    for j, s in enumerate(settings):
        run = runs.get(f"always:{s}")
        if run is None:
            continue
        by_id = {e.request_id: e for e in run.events}
        for sent in run.sent:
            e = by_id.get(sent.request_id or "")
            if e is not None:
                tok[sent.q, j] = e.completion_tokens
    return tok


def _curve(points: list[list[float]]) -> list[list[float]]:
    return [[round(x, 6), round(y, 6)] for x, y in points]


# ------------------------------------------------------------------------------------------------- run


@dataclass
class Config:
    """Arguments of one run (module doc)."""

    traces: Path
    dataset: str
    ladder: str
    router: Path
    heldout_only: bool = False
    concurrency: int = 8
    time_budget_s: float = 280.0
    seed: int = 0
    progress: bool = True


def check_router_ladder(meta: dict[str, Any], lad: Ladder, dataset: str, log: Callable[[str], None]) -> None:
    """Refuse a trace router (``router fit --traces``: metadata ``ladder``) fitted on another ladder: its
    thresholds would route to tiers it never learned (raises :class:`TracesBenchError`). A router fitted on other
    data sets is allowed (transfer), said in ``log``. Routers without ladder metadata (the shipped ones) pass."""
    fitted = meta.get("ladder")
    if isinstance(fitted, dict):
        want = {"model": lad.model, "settings": list(lad.settings)}
        got = {"model": fitted.get("model"), "settings": list(fitted.get("settings") or [])}
        if got != want:
            raise TracesBenchError(f"the router was fitted on ladder {got['model']}:{','.join(got['settings'])}, "
                                   f"not {lad.name}: fit one with thinkgate router fit --ladder {lad.name}")
    datasets = meta.get("datasets")
    if isinstance(datasets, list) and datasets and dataset not in datasets:
        log(f"note: the router was fitted on {', '.join(map(str, datasets))}, not {dataset} (transfer)")


def router_heldout_frac(meta: dict[str, Any]) -> float:
    """The held-out share the router file was fitted with (``heldout.frac``), else the default 20%."""
    h = meta.get("heldout")
    frac = h.get("frac") if isinstance(h, dict) else None
    return float(frac) if isinstance(frac, int | float) and 0 < frac < 1 else HELDOUT_FRAC


def _load_inputs(cfg: Config, log: Callable[[str], None]) -> tuple[Ladder, LadderData, Any]:
    """The ladder, its recorded traces (held-out questions only with ``cfg.heldout_only``) and the router file,
    checked against each other. Raises :class:`TracesBenchError` naming what does not fit."""
    from router.persistence import load_router

    try:
        lad = parse_ladder(cfg.ladder)
    except ValueError as exc:
        raise TracesBenchError(str(exc)) from None
    if len(lad.settings) > 3:
        raise TracesBenchError("ladders of 2 or 3 settings are supported (the curves)")
    try:
        data = load_ladder(cfg.traces, cfg.dataset, lad)
        check_cheapest_first(data)  # always-top is the last setting: a reversed ladder benches the wrong baseline
    except (FileNotFoundError, ValueError) as exc:
        raise TracesBenchError(str(exc)) from None
    if not cfg.router.is_file():
        raise TracesBenchError(f"--router {cfg.router}: no such file")
    router = load_router(cfg.router)
    if len(router.thresholds) != len(lad.settings) - 1:
        raise TracesBenchError(f"router {cfg.router} has {len(router.thresholds)} threshold(s); the ladder "
                               f"{lad.name} needs {len(lad.settings) - 1}")
    check_router_ladder(router.metadata, lad, cfg.dataset, log)
    if cfg.heldout_only:
        data = data.subset(np.flatnonzero(heldout_mask(data, router_heldout_frac(router.metadata))))
        if data.n == 0:
            raise TracesBenchError("no held-out question in this folder")
    return lad, data, router


def run(cfg: Config, settings: Settings, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)
        ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the bench; returns (the JSON report, details: prices, timings, checks, served points)."""
    from tqdm import tqdm

    from bench.savings_stack import Ledger, serve_gateway

    started = time.time()
    deadline = time.monotonic() + cfg.time_budget_s
    lad, data, router = _load_inputs(cfg, log)
    # router+cascade serves the same score at the router file's cascade thresholds when it has them (calibrated
    # by `router fit` on its validation questions' cascade outcomes), else at its plain thresholds
    cascade_cuts = _cuts(router.metadata.get("cascade_thresholds"), len(router.thresholds))
    # router (gateway A) serves the file's router-alone thresholds when it has them (a file whose served policy is
    # router+cascade keeps those apart), else its thresholds; `auto` (gateway C) gets nothing but the file
    router_cuts = _cuts(router.metadata.get("router_thresholds"), len(router.thresholds))
    scores = np.array([router.score(q) for q in data.questions], dtype=np.float64)
    lengths = np.array([len(q) for q in data.questions], dtype=np.float64)
    settings_t = lad.settings
    k = len(settings_t)
    price = price_of(lad.model)
    run_id = uuid.uuid4().hex[:8]
    prefix = f"tgbench:traces:{run_id}:"
    served = [*(f"always:{s}" for s in settings_t), "router", "random", "length", "router+cascade", "auto"]
    runs: dict[str, Run] = {p: Run(p, f"traces-{run_id}-{p.replace(':', '-').replace('+', '-')}",
                                   "tg-" + secrets.token_hex(16)) for p in served}
    details: dict[str, Any] = {"run": run_id, "price": {"input": str(price.input), "output": str(price.output),
                                                         "cached_input": str(price.cached_input),
                                                         "source": price.source},
                               "router": str(cfg.router), "router_policy": router.metadata.get("policy"),
                               "thresholds": list(router.thresholds), "cascade_thresholds": cascade_cuts,
                               "router_thresholds": router_cuts,
                               "served_policy": (router.metadata.get("serving") or {}).get("policy"),
                               "heldout_only": cfg.heldout_only}
    with ExitStack() as stack:
        state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tg-traces-")))
        settings = bench_redis(stack, settings, prefix)
        t0 = time.monotonic()
        replay = stack.enter_context(ReplayProcess(cfg.traces, cfg.dataset, [(lad.model, s) for s in settings_t]))
        keys = [{"id": r.key_id, "secret": r.secret, "tags": {"bench": "traces", "policy": r.policy}}
                for r in runs.values()]
        urls = {}
        gateways: tuple[tuple[str, bool | None, list[float] | None], ...] = (
            ("a", False, router_cuts), ("b", True, cascade_cuts), ("c", None, None))
        for name, cascade, cuts in gateways:
            tiers = tier_configs(lad.model, settings_t, replay.base_url, price, cascade)
            urls[name] = stack.enter_context(serve_gateway(
                gateway_config(settings, tiers, cfg.router, keys, prefix, state_dir, name, cuts), state_dir,
                f"gateway-{name}"))
        details["startup_s"] = round(time.monotonic() - t0, 1)
        ledger = Ledger(settings.model_copy(update={"redis": settings.redis.model_copy(
            update={"key_prefix": prefix})}))
        n = data.n
        bar = tqdm(total=n * len(served), desc=f"bench traces {lad.name}", disable=not cfg.progress,
                   file=sys.stderr)
        order = list(range(n))

        def serve(policy: str, models: list[str], gw: str = "a") -> Run:
            r = runs[policy]
            r.url = urls[gw]
            send_all(r, data.questions, order, models, cfg.concurrency, deadline, bar.update)
            settle(ledger, r)
            return r

        for s in settings_t:
            serve(f"always:{s}", [s] * n)
        routed = serve("router", ["auto"] * n)
        idx = {s: j for j, s in enumerate(settings_t)}
        choice = np.full(n, k - 1, dtype=np.int64)
        for sent in routed.sent:
            if sent.tier in idx:
                choice[sent.q] = idx[sent.tier or ""]
        counts = tier_mix(choice, k)
        serve("random", [settings_t[j] for j in random_choice(n, counts, cfg.seed)])
        serve("length", [settings_t[j] for j in length_choice(lengths, counts)])
        serve("router+cascade", ["auto"] * n, "b")
        serve("auto", ["auto"] * n, "c")
        bar.close()
    # ---- numbers
    policies = {p: summarize(r, data, settings_t) for p, r in runs.items()}
    tokens = per_question_tokens(runs, data, settings_t)
    correct = data.correct
    top_acc = float(correct[:, -1].mean())
    top_tok = float(tokens[:, -1].sum())
    ab = np.zeros((n, k), dtype=bool)
    for j, s in enumerate(settings_t):
        got = {x.q: x.content for x in runs[f"always:{s}"].sent if x.status == 200}
        ab[:, j] = [abstains(got.get(q, data.responses[q][j])) for q in range(n)]
    curves = {
        "router": threshold_curve(scores, correct, tokens),
        "router+cascade": cascade_curve(scores, correct, tokens, ab),
        "random": random_curve(correct, tokens, 1001 if k == 2 else 101),
        "length": threshold_curve(lengths, correct, tokens),
    }
    sav = {name: round(savings_at_98(cv, top_acc), 6) for name, cv in curves.items()}
    oc = np.where(correct.any(axis=1), np.argmax(correct, axis=1), 0)
    rows = np.arange(n)
    o_acc = float(correct[rows, oc].mean())
    o_tok = float(tokens[rows, oc].sum())
    sav["oracle"] = round(1 - o_tok / top_tok, 6) if o_acc >= 0.98 * top_acc - 1e-12 else 0.0
    o_events = {s: {e.request_id: e for e in runs[f"always:{s}"].events} for s in settings_t}
    o_cost = o_rt = 0
    for q in range(n):
        s = settings_t[int(oc[q])]
        sent = next((x for x in runs[f"always:{s}"].sent if x.q == q), None)
        e = o_events[s].get(sent.request_id or "") if sent else None
        if e is not None:
            o_cost += e.cost_micro_usd
            o_rt += e.reasoning_tokens
    policies["oracle"] = {"accuracy": round(o_acc, 6), "completion_tokens": int(o_tok), "reasoning_tokens": o_rt,
                          "cost_usd": o_cost / 1_000_000, "requests": 0, "sent": 0,
                          "tiers": {s: round(float(np.mean(oc == j)), 6) for j, s in enumerate(settings_t)}}
    skipped = sum(r.skipped for r in runs.values())
    details.update({
        "complete": skipped == 0, "skipped": skipped,
        "errors": {p: sum(1 for s in r.sent if s.status != 200) for p, r in runs.items()},
        "answer_mismatches": {p: check_answers(r, data, settings_t) for p, r in runs.items()},
        "escalations": {p: sum(1 for e in r.events if (e.error_code or "").startswith("escalated_"))
                        for p, r in runs.items()},
        "upstream_calls": {p: len(r.events) for p, r in runs.items()},
        "token_share": token_shares(runs, policies, tokens[:, -1], settings_t),
        "router_score_max_diff": max((abs(s.difficulty - scores[s.q]) for s in runs["router"].sent
                                      if s.difficulty is not None), default=None),
        "always_top_accuracy": round(top_acc, 6),
        "wall_s": round(time.time() - started, 1), "time_budget_s": cfg.time_budget_s,
    })
    report = {"dataset": cfg.dataset, "ladder": lad.name, "n_questions": n, "policies": policies,
              "curves": {name: _curve(cv) for name, cv in curves.items()}, "savings_at_98": sav,
              "served": served_block(runs, policies, correct, tokens[:, -1], settings_t),
              "complete": skipped == 0, "skipped": skipped}
    return report, details


def _cuts(value: Any, k: int) -> list[float] | None:
    """A threshold list from router metadata when it is usable (k ascending values in [0, 1]), else None."""
    if not (isinstance(value, list) and len(value) == k and all(isinstance(t, int | float) for t in value)):
        return None
    cuts = [float(t) for t in value]
    return cuts if cuts == sorted(cuts) and all(0 <= t <= 1 for t in cuts) else None


#: the policies with an operating point of their own (``served``): the file's thresholds, as a gateway serves them
SERVED = ("router", "router+cascade", "auto")


def answered_questions(run: Run, settings: tuple[str, ...]) -> list[tuple[int, int]]:
    """``[(question index, setting index)]`` of the requests ``run`` got a graded answer to (HTTP 200 from a ladder
    setting): the questions its accuracy — and its ``served`` figures — are measured on."""
    idx = {s: j for j, s in enumerate(settings)}
    return [(s.q, idx[s.tier]) for s in run.sent if s.status == 200 and s.tier in idx]


def token_shares(runs: dict[str, Run], policies: dict[str, Any], top_tokens: np.ndarray,
                 settings: tuple[str, ...]) -> dict[str, float | None]:
    """``{NAME: completion tokens / always-top's on the questions NAME answered}`` (:func:`answered_questions`; the
    computed oracle: every question). A run cut by the time budget answered a subset: over all questions its share
    read low (a cut ``always:<top>`` itself read below 100%). None where always-top spent nothing there."""
    out: dict[str, float | None] = {}
    for name, e in policies.items():
        r = runs.get(name)
        qs = np.arange(len(top_tokens)) if r is None else np.asarray(
            sorted({q for q, _ in answered_questions(r, settings)}), dtype=np.int64)
        top = float(top_tokens[qs].sum()) if qs.size else 0.0
        out[name] = round(e["completion_tokens"] / top, 6) if top else None
    return out


def served_block(runs: dict[str, Run], policies: dict[str, Any], correct: np.ndarray, top_tokens: np.ndarray,
                 settings: tuple[str, ...], floor: float = 0.98) -> dict[str, Any]:
    """``{NAME: {"accuracy_ratio", "token_share", "savings", "holds_floor", "n_questions"}}`` for :data:`SERVED`,
    each over the ``n_questions`` questions that policy answered (:func:`answered_questions`) against always-top on
    the same questions — a run cut by the time budget is compared with what always-top cost and scored *there*,
    not with the whole set.

    ``correct``: bool (n, k) recorded grading; ``top_tokens``: (n,) always-top completion tokens per question
    (ledger, :func:`per_question_tokens`); ``policies[NAME]["completion_tokens"]``: the policy's ledger sum (every
    upstream call of the requests it sent, escalated first attempts included — they carry their own request ids,
    so the run's sum is the per-question cost). accuracy_ratio = Σ correct / Σ always-top correct (from counts,
    rounded for output only), token_share = tokens / Σ always-top tokens, savings = 1 − token_share, holds_floor =
    Σ correct ≥ ``floor`` × Σ always-top correct. All four are None for a policy that answered no question."""
    out: dict[str, Any] = {}
    for name in SERVED:
        e, r = policies.get(name), runs.get(name)
        if e is None or r is None:
            continue
        got = answered_questions(r, settings)
        if not got:
            out[name] = {"accuracy_ratio": None, "token_share": None, "savings": None, "holds_floor": None,
                         "n_questions": 0}
            continue
        qs = np.asarray([q for q, _ in got], dtype=np.int64)
        hits = int(sum(bool(correct[q, j]) for q, j in got))
        top_hits = int(correct[qs, -1].sum())
        top_tok = float(top_tokens[qs].sum())
        share = e["completion_tokens"] / top_tok if top_tok else 1.0
        out[name] = {"accuracy_ratio": round(hits / top_hits, 6) if top_hits else 1.0,
                     "token_share": round(share, 6), "savings": round(1.0 - share, 6),
                     # integer counts: an answer set identical to always-top's holds exactly, no float residue
                     "holds_floor": bool(hits >= floor * top_hits - 1e-9), "n_questions": len(got)}
    return out


# ---------------------------------------------------------------------------------------------- outputs

ORDER = ("always", "auto", "router", "router+cascade", "random", "length", "oracle")


def _ordered(report: dict[str, Any]) -> list[str]:
    return sorted(report["policies"], key=lambda p: (ORDER.index(p.split(":")[0]), p))


def _served_cells(e: dict[str, Any], no: str = "NO") -> list[str]:
    """accuracy ratio, token share, savings, keeps-98% of one ``served`` entry as text; "—" for a policy the time
    budget cut before it answered anything (its figures are None)."""
    if e["accuracy_ratio"] is None:
        return ["—", "—", "—", "— (nothing answered)"]
    return [f"{e['accuracy_ratio']:.3f}", f"{e['token_share']:.1%}", f"{e['savings']:.1%}",
            "yes" if e["holds_floor"] else no]


def _router_line(details: dict[str, Any]) -> str:
    """The router file and the cuts each row ran at: the file's served policy (``auto``) and its split-family points
    (``router``, ``router+cascade``: without them in the file, its thresholds). It printed "thresholds [1.0],
    router+cascade at [0.0]" with no word that [0.0] is always top — nothing certified for that point — so the
    row's 0.0% savings read as a broken cascade."""
    from router.policy import thresholds_text

    own = details["thresholds"]
    return (f"router {details['router']} (scorer {details['router_policy']}; auto serves "
            f"{details.get('served_policy') or 'its thresholds'} at {thresholds_text(own)}; row router at "
            f"{thresholds_text(details.get('router_thresholds') or own)}, router+cascade at "
            f"{thresholds_text(details['cascade_thresholds'] or own)}: split-family points, always top where the "
            "calibration split certified nothing)")


def render(report: dict[str, Any], details: dict[str, Any]) -> Any:
    """A rich table of the policies plus the price and timing lines."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"ThinkGate on recorded traces: {report['dataset']} {report['ladder']}, "
                    f"{report['n_questions']} questions (cost from the metering ledger)")
    for c in ("policy", "accuracy", "completion tok", "reasoning tok", "token share", "cost USD", "requests",
              "tiers", "savings@98 (curve metric)"):
        t.add_column(c, justify="left" if c in ("policy", "tiers") else "right")
    for p in _ordered(report):
        e = report["policies"][p]
        sav = report["savings_at_98"].get(p)
        t.add_row(p + (" (computed)" if p == "oracle" else ""), f"{e['accuracy']:.1%}", str(e["completion_tokens"]),
                  str(e["reasoning_tokens"]), f"{details['token_share'].get(p) or 0:.1%}", f"{e['cost_usd']:.6f}",
                  str(e["requests"]), " ".join(f"{k}:{v:.0%}" for k, v in e["tiers"].items()),
                  "" if sav is None else f"{sav:.1%}")
    sv = Table(title="served: each policy at the thresholds its gateway serves (the deployable number)")
    for c in ("policy", "accuracy / always-top", "token share", "savings", "keeps 98%", "questions"):
        sv.add_column(c, justify="left" if c == "policy" else "right")
    for p, e in report.get("served", {}).items():
        sv.add_row(p, *_served_cells(e), str(e.get("n_questions", report["n_questions"])))
    pr = details["price"]
    note = ("NOMINAL price (no published list price)" if pr["source"] == "nominal" else f"list price ({pr['source']})")
    lines = [sv, t, Text(f"auto: a gateway with only the router file (served policy "
                         f"{details.get('served_policy') or 'thresholds, no cascade'}); escalations "
                         f"{details['escalations'].get('auto', 0)}"),
             Text("questions: the router's held-out split only (never fitted or calibrated on: what new traffic "
                  "gets)" if details.get("heldout_only") else
                  "questions: ALL of the folder, the ones the router was fitted and calibrated on included (reads "
                  "above what new traffic gets; --heldout-only scores its held-out split)"),
             Text(f"prices: {pr['input']} in / {pr['output']} out USD per 1M tokens, {note}"),
             Text(_router_line(details) + "; savings@98 = 1 - token share at the cheapest point of the curve with "
                  f"accuracy >= 98% of always-top ({details['always_top_accuracy']:.1%})"),
             Text(f"errors {sum(details['errors'].values())}, answer mismatches "
                  f"{sum(details['answer_mismatches'].values())}, router+cascade escalations "
                  f"{details['escalations']['router+cascade']}; start-up {details['startup_s']} s, wall "
                  f"{details['wall_s']} s (budget {details['time_budget_s']:.0f} s)"
                  + ("" if details["complete"] else f"; INCOMPLETE: {details['skipped']} requests skipped ("
                     + ", ".join(f"{p} sent {e['sent']}/{report['n_questions']}"
                                 for p, e in report["policies"].items()
                                 if p != "oracle" and e.get("sent", 0) < report["n_questions"])
                     + "; served figures are over the questions each policy answered)"))]
    return Group(*lines)


def markdown(report: dict[str, Any], details: dict[str, Any]) -> str:
    """The policy table as Markdown."""
    out = ["| served policy | accuracy / always-top | token share | savings | keeps 98% |", "|---|---:|---:|---:|---|"]
    for p, e in report.get("served", {}).items():
        out.append(f"| {p} | {' | '.join(_served_cells(e, no='no'))} |")
    out += ["", "| policy | accuracy | completion tok | reasoning tok | token share | cost USD (ledger) | requests | "
            "tiers | savings@98 (curve metric) |", "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for p in _ordered(report):
        e = report["policies"][p]
        sav = report["savings_at_98"].get(p)
        out.append(f"| {p}{' (computed)' if p == 'oracle' else ''} | {e['accuracy']:.1%} | {e['completion_tokens']} | "
                   f"{e['reasoning_tokens']} | {details['token_share'].get(p) or 0:.1%} | {e['cost_usd']:.6f} | "
                   f"{e['requests']} | {', '.join(f'{k} {v:.0%}' for k, v in e['tiers'].items())} | "
                   f"{'' if sav is None else f'{sav:.1%}'} |")
    return "\n".join(out)


def plot(report: dict[str, Any], details: dict[str, Any], path: Path) -> list[str]:
    """PNG: accuracy vs token share, each policy's curve, the served points and the oracle. Returns the point labels
    written (policies served at the same point share one: ``"router = length"``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, cv in report["curves"].items():
        if cv:
            xs, ys = zip(*cv, strict=True)
            ax.step(xs, ys, where="post", label=f"{name} (savings@98 {report['savings_at_98'][name]:.0%})", lw=1.2)
    at: dict[tuple[float, float], list[str]] = {}  # policies served at the same point share one label
    for p in _ordered(report):
        e = report["policies"][p]
        x = details["token_share"].get(p) or 0.0
        ax.scatter([x], [e["accuracy"]], s=30, marker="*" if p == "oracle" else "o", zorder=3)
        at.setdefault((round(x, 3), round(e["accuracy"], 3)), []).append(p)
    labels = [" = ".join(names) for names in at.values()]
    for (x, y), label in zip(at, labels, strict=True):  # one label per point: printed over each other, unreadable
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    top = details["always_top_accuracy"]
    ax.axhline(0.98 * top, color="gray", ls=":", lw=1, label="98% of always-top")
    ax.set_xlabel("completion tokens / always-top (metering ledger)")
    ax.set_ylabel("accuracy (recorded grading)")
    ax.set_title(f"{report['dataset']} {report['ladder']} ({report['n_questions']} questions, through the gateway)",
                 fontsize=9)
    ax.set_xlim(0, max(1.05, max((details["token_share"].get(p) or 0) for p in report["policies"]) + 0.05))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labels


# --------------------------------------------------------------------------------------------------- CLI


def traces(
    traces_dir: Path = typer.Option(Path(__file__).resolve().parents[2] / "data" / "traces", "--traces",
                                    help="Traces folder: DIR/<dataset>/<MODEL>__<SETTING>.jsonl.gz (default: the "
                                         "repository's data/traces)."),
    dataset: str = typer.Option(..., "--dataset", help="Data set folder under --traces (frames, simpleqa)."),
    ladder: str = typer.Option(..., "--ladder", help="MODEL:S1,S2[,S3], cheapest setting first."),
    router_file: Path = typer.Option(..., "--router", help="Router file (thinkgate router fit --traces …)."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the report (module doc) as JSON here."),
    png_path: Path | None = typer.Option(None, "--png", help="Write the curves PNG here."),
    md_path: Path | None = typer.Option(None, "--markdown", help="Write the policy table as Markdown here."),
    heldout_only: bool = typer.Option(False, "--heldout-only/--all", help="Only the router's held-out questions "
                                      "(router.fit.traces.is_heldout), or every question of the folder."),
    concurrency: int = typer.Option(8, min=1, max=64, help="Requests in flight."),
    time_budget_s: float = typer.Option(280.0, min=10, help="Whole-run budget (s); later requests are skipped."),
    seed: int = typer.Option(0, help="Seed of the random policy."),
    config: Path | None = typer.Option(None, "--config", "-c", help="Base YAML config (default: $THINKGATE_CONFIG)."),
) -> None:
    """Replay recorded traces through the gateway under every policy; cost from the metering ledger."""
    import json

    from gateway.cli.common import load_settings
    from router.console import console
    from router.fit.outputs import output_problem

    # checked before the run (minutes): a path that cannot be written fails now, in one line, not after it
    for flag, path in (("--json", json_path), ("--png", png_path), ("--markdown", md_path)):
        why = output_problem(path) if path is not None else None
        if why:
            typer.echo(f"thinkgate: bench traces: {flag}: {why}", err=True)
            raise typer.Exit(2)
    settings = load_settings(config)
    cfg = Config(traces_dir, dataset, ladder, router_file, heldout_only, concurrency, time_budget_s, seed,
                 progress=os.environ.get("TG_NO_PROGRESS") is None)
    try:
        report, details = run(cfg, settings)
    except (TracesBenchError, RuntimeError) as exc:
        typer.echo(f"thinkgate: bench traces: {exc}", err=True)
        raise typer.Exit(2) from None
    console().print(render(report, details))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1))
    if png_path:
        png_path.parent.mkdir(parents=True, exist_ok=True)
        plot(report, details, png_path)
    if md_path:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown(report, details) + "\n")
    if not details["complete"]:
        raise typer.Exit(1)
